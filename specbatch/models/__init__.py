"""Models: the packaged-model registry and the loader (transformers load, GGUF weight cache)."""

from __future__ import annotations

from specbatch.models.loader import LoadedModel, ModelSource, load_model, resolve_model
from specbatch.models.registry import DEFAULT_MODEL, REGISTRY

__all__ = ["DEFAULT_MODEL", "REGISTRY", "LoadedModel", "ModelSource", "load_model",
           "resolve_model"]
