"""specbatch: offline batch text generation with speculative decoding.

The Python surface: ``LLM`` (load a model, generate for prompts, records or chats) and
``SamplingParams``. Importing it loads no model code (torch is imported on first use).
"""

from specbatch._source import install_kernels_finder
from specbatch._version import UNKNOWN as _UNKNOWN
from specbatch._version import package_version as _package_version

install_kernels_finder()
# the installed distribution's version, else the checkout's pyproject.toml's (as --version)
__version__: str = _package_version()[0] or _UNKNOWN

from typing import TypedDict  # noqa: E402

from specbatch.config import SamplingParams  # noqa: E402
from specbatch.llm import LLM  # noqa: E402


class TokensPrompt(TypedDict, total=False):
    """A prompt given as token ids, as vLLM's ``TokensPrompt`` (a dict): ``prompt_token_ids``,
    the ids fed as they are (no tokenizer, no chat template); ``LLM.generate`` takes it where
    it takes a prompt string."""

    prompt_token_ids: list[int]


__all__ = ["LLM", "SamplingParams", "TokensPrompt", "__version__"]
