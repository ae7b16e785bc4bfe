"""``specbatch.kernels`` in a source checkout that is not installed.

The kernels live in ``kernels/`` at the top of the repository and install as
``specbatch.kernels`` (``package-dir`` in pyproject.toml), so no top-level ``kernels`` module is
ever installed (that is the import name of Hugging Face's kernel hub). A checkout imported
straight from its folder (a git worktree, ``PYTHONPATH=checkout``, the air-gapped GPU check) has
no installed mapping, or one that points at another checkout; ``install_kernels_finder`` makes
``import specbatch.kernels`` load this checkout's ``kernels/``. Lazily: importing ``specbatch``
still imports no torch. An installed (non-source) specbatch keeps its own
``specbatch/kernels`` and this does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
_CHECKOUT_KERNELS = _PACKAGE.parent / "kernels"


class _KernelsFinder(importlib.abc.MetaPathFinder):
    """Finds ``specbatch.kernels`` (only) in the checkout's ``kernels/`` folder; its submodules
    are then found on that package's ``__path__`` as usual."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "specbatch.kernels":
            return None
        return importlib.util.spec_from_file_location(
            fullname, _CHECKOUT_KERNELS / "__init__.py",
            submodule_search_locations=[str(_CHECKOUT_KERNELS)])


def install_kernels_finder() -> None:
    """Put ``_KernelsFinder`` first on ``sys.meta_path`` when this package is a source
    checkout's ``specbatch/`` (``kernels/`` and ``pyproject.toml`` beside it, no
    ``specbatch/kernels``). Idempotent."""
    if ((_PACKAGE / "kernels").exists() or not (_CHECKOUT_KERNELS / "cpu_build.py").is_file()
            or not (_PACKAGE.parent / "pyproject.toml").is_file()):
        return
    if not any(isinstance(f, _KernelsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _KernelsFinder())
