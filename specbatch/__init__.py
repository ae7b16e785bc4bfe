"""specbatch: offline batch text generation with speculative decoding.

The Python surface: ``LLM`` (load a model, generate for prompts, records or chats) and
``SamplingParams``. Importing it loads no model code (torch is imported on first use).
"""

from specbatch.config import SamplingParams
from specbatch.llm import LLM

__all__ = ["LLM", "SamplingParams"]
