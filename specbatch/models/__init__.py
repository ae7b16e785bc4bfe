"""Models: the packaged-model registry and the loader (transformers load, GGUF weight cache).

The loader's names are imported on first use: ``specbatch.models.registry`` (name checks, no
torch) must not pay for importing torch through this package.
"""

from __future__ import annotations

from typing import Any

from specbatch.models.registry import DEFAULT_MODEL, REGISTRY

__all__ = ["DEFAULT_MODEL", "REGISTRY", "LoadedModel", "ModelSource", "load_model",
           "resolve_model"]

_FROM_LOADER = ("LoadedModel", "ModelSource", "load_model", "resolve_model")


def __getattr__(name: str) -> Any:
    if name in _FROM_LOADER:
        from specbatch.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
