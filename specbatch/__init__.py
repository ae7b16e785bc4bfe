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

from specbatch.config import SamplingParams  # noqa: E402
from specbatch.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]
