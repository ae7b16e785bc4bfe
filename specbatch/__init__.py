"""specbatch: offline batch text generation with speculative decoding.

The Python surface: ``LLM`` (load a model, generate for prompts, records or chats) and
``SamplingParams``. Importing it loads no model code (torch is imported on first use).
"""

from specbatch._source import install_kernels_finder

install_kernels_finder()

from specbatch.config import SamplingParams  # noqa: E402
from specbatch.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams"]
