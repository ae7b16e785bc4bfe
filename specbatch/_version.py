"""The package version, for ``specbatch.__version__`` and ``specbatch --version`` (one source).

Installed (``pip install``, editable or not): the installed distribution's version. A source
checkout imported without installing: the version in the checkout's ``pyproject.toml``. Neither
(a copied package folder): ``None``. No torch, no click: ``import specbatch`` stays light.
"""

from __future__ import annotations

from pathlib import Path


def package_version() -> tuple[str | None, bool]:
    """``(version, installed)``: the installed distribution's version and True, else the
    checkout's ``pyproject.toml`` version (or None) and False."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specbatch"), True
    except PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            import tomli as tomllib
        return tomllib.loads(pyproject.read_text())["project"]["version"], False
    except (ImportError, OSError, ValueError, KeyError):
        return None, False


UNKNOWN = "0+unknown"  # a PEP 440 version that sorts below every release
