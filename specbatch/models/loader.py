"""Find a model (``--model``), load it with transformers, and cache dequantised GGUF weights.

``--model`` takes a registry short name (``specbatch.models.registry``), a path to a ``.gguf``
file, a local Hugging Face folder (one with ``config.json``), or ``dummy:SHAPE[:SEED]``: a model
of a known shape with seeded random weights and SmolLM2's tokenizer (``specbatch.models.dummy``;
nothing is read or cached but the tokenizer).

GGUF cache. Loading a GGUF with transformers dequantises every tensor and builds the tokenizer
from the GGUF metadata: ~15 s for SmolLM2-135M on 2 CPU cores. The first load therefore saves
the dequantised float32 weights (safetensors), config, generation config and tokenizer under
``<cache>/gguf-v1/<sha256 of the GGUF file>/``; later loads read that folder (< 1 s). The folder
is written into a temp dir beside it and renamed into place with ``os.replace``, so a killed run
leaves no half cache. The file's sha256 is remembered in ``<cache>/hashes/`` keyed by path, size
and mtime, so an unchanged file is hashed once. The cache always holds float32; the requested
dtype is applied while loading from it. Every load, first or later, goes through the cached
folder, so the first run and later runs get the same model and tokenizer objects.

BOS (checked with transformers 5.24, SmolLM2-135M-Instruct Q4_1): the GGUF tokenizer has
``add_bos_token=False``; its BOS token is ``<|im_start|>`` (id 1), which the chat template writes
itself. Encoding a chat-templated prompt gives ``[1, 9690, 198, ...]`` -- one ``<|im_start|>``,
not two -- and ``tokenizer("Hello")`` gives ``[19556]`` with no BOS. The cached tokenizer
behaves the same. EOS is ``<|im_end|>`` (id 2), which is also the pad token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specbatch.models.registry import (REGISTRY, cache_root, find_model,  # noqa: F401
                                      registry_entry, write_text_atomic)

logger = logging.getLogger("specbatch")

KINDS = ("registry", "gguf", "hf_folder", "dummy")
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "float64": torch.float64,
                "int8": torch.float32}  # float32 weights, 8-bit activations (LlamaForward)
# Bump when the cache layout or conversion changes: entries of an old layout are then ignored.
_GGUF_CACHE_DIR = "gguf-v1"
_MARKER = "specbatch-cache.json"
_STALE_TEMP_S = 3600.0  # a temp dir this old belongs to a killed run (saving takes seconds)
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are.

    kind: "registry" (packaged GGUF), "gguf" (a .gguf path), "hf_folder" (a HF folder) or
        "dummy" (seeded random weights, ``models.dummy``).
    path: the folder holding the GGUF file, or the HF folder itself; for "dummy", the
        ``$SPECBATCH_TOKENIZER`` folder, or ``.`` when the tokenizer comes from the package.
    gguf_file: the GGUF file name inside ``path``; None for "hf_folder" and "dummy".
    name: the registry name for a registry model (also where the user named it by its
        Hugging Face id: one model, one ``model_id``); ``dummy:SHAPE:SEED`` for a dummy one (the
        seed always written); the absolute path otherwise.
    """

    kind: str
    path: Path
    gguf_file: str | None
    name: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"ModelSource.kind must be one of {KINDS}, got {self.kind!r}")
        if (self.gguf_file is None) != (self.kind in ("hf_folder", "dummy")):
            raise ValueError(f"ModelSource.gguf_file must be set exactly for GGUF kinds, got "
                             f"kind={self.kind!r} gguf_file={self.gguf_file!r}")

    @property
    def gguf_path(self) -> Path | None:
        return None if self.gguf_file is None else self.path / self.gguf_file


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference.

    model: transformers ``PreTrainedModel`` in eval mode, on the requested device and dtype.
    tokenizer: the matching transformers tokenizer (see the module docstring about BOS).
    eos_token_ids: ids that end generation: generation_config ``eos_token_id`` (int or list),
        else ``tokenizer.eos_token_id``; empty when neither is set.
    max_model_len: ``config.max_position_embeddings`` (tokens, prompt and completion together).
    model_id: stable identity of the weights, ``<registry name or absolute path>@sha256:<16 hex>``
        (hash of the GGUF file, or of the HF folder's files; ``dummy:SHAPE:SEED@sha256:...``,
        the hash of the shape, seed and init scheme); equal ids mean equal weights.
    """

    model: Any
    tokenizer: Any
    source: ModelSource
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    model_id: str

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device


def resolve_model(name: str, cache_dir: str | Path | None = None) -> ModelSource:
    """Find the files for ``--model``: a registry short name, a ``.gguf`` path or a HF folder.

    Registry names win over same-named paths. A registry model shipped in parts is assembled
    once under the cache root (``cache_dir``, as in ``load_model``). Raises ValueError as
    ``registry.find_model`` (an unknown name, a missing file, a registry model that is not
    installed, a file that is not ``.gguf``, a folder without ``config.json``) and for parts
    that do not assemble into the expected file.
    """
    kind, path = find_model(name)
    if kind == "dummy":
        from specbatch.models import dummy

        shape, seed = dummy.parse_name(name)
        return ModelSource("dummy", dummy.tokenizer_folder() or Path("."), None,
                           dummy.canonical_name(shape, seed))
    if kind == "registry":  # by its registry name, also where named by its hub id
        entry = registry_entry(name)
        path = entry.locate(cache_root(cache_dir))
        return ModelSource("registry", path.parent, path.name, entry.name)
    assert path is not None
    if kind == "gguf":
        return ModelSource("gguf", path.parent, path.name, str(path))
    return ModelSource("hf_folder", path, None, str(path))


def load_model(name: str, dtype: str = "float32", device: str = "cpu",
               cache_dir: str | Path | None = None) -> LoadedModel:
    """Load ``--model`` for inference.

    name: see ``resolve_model``.
    dtype: "float32", "bfloat16", "float16" or "float64"; weights are cast while loading.
        "int8": float32 weights, and the model is marked (``specbatch_activations = "int8"``)
        so that ``LlamaForward`` runs its code-weight matmuls with 8-bit activations; the first
        ``LlamaForward`` then releases the float32 values of the weights it holds codes of
        (``backends.cpu.Int8Weights``), after which transformers' forward refuses to
        run on the model (load it again in float32 for that).
    device: a torch device string ("cpu", "cuda", "cuda:1").
    cache_dir: root of the GGUF cache; else env ``SPECBATCH_CACHE``; else ``~/.cache/specbatch``.

    Raises ValueError for a bad dtype or device and whatever ``resolve_model`` raises. The first
    load of a GGUF converts it (~15 s for 135M parameters) and logs that on logger "specbatch".
    """
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {tuple(TORCH_DTYPES)}, got {dtype!r}")
    try:
        torch_device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device {device!r} is not a torch device: {error}") from None
    source = resolve_model(name, cache_dir)
    if source.kind == "dummy":
        model, tokenizer, digest = _load_dummy(source, TORCH_DTYPES[dtype], torch_device,
                                               cache_dir)
    else:
        folder, digest = _model_folder(source, cache_root(cache_dir), dtype)
        model, tokenizer = _load_folder(folder, TORCH_DTYPES[dtype], torch_device)
    if dtype == "int8":
        model.specbatch_activations = "int8"
        if source.gguf_path is not None:  # where its Q4_K / Q6_K codes are (kernels/kquant.py)
            model.specbatch_gguf = str(source.gguf_path)
    return LoadedModel(model=model, tokenizer=tokenizer, source=source,
                       eos_token_ids=_eos_token_ids(model, tokenizer),
                       max_model_len=_max_model_len(model.config),
                       model_id=f"{source.name}@sha256:{digest[:16]}")


def load_tokenizer(name: str, cache_dir: str | Path | None = None) -> tuple[Any, str]:
    """``(tokenizer, model_id)`` of ``--model`` without its weights: the same tokenizer and id
    as ``load_model`` gives (a GGUF is converted into the cache first if it is not there yet),
    in a fraction of the time. Raises what ``resolve_model`` raises."""
    from transformers import AutoTokenizer

    source = resolve_model(name, cache_dir)
    if source.kind == "dummy":
        from specbatch.models import dummy

        shape, seed = dummy.parse_name(source.name)
        return (dummy.load_tokenizer(cache_dir),
                f"{source.name}@sha256:{dummy.weights_digest(shape, seed)[:16]}")
    folder, digest = _model_folder(source, cache_root(cache_dir))
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tokenizer, f"{source.name}@sha256:{digest[:16]}"


def _load_dummy(source: ModelSource, torch_dtype: torch.dtype, device: torch.device,
                cache_dir: str | Path | None) -> tuple[Any, Any, str]:
    """Model, tokenizer and weights digest of a ``dummy:SHAPE:SEED`` source."""
    from specbatch.models import dummy

    shape, seed = dummy.parse_name(source.name)
    tokenizer = dummy.load_tokenizer(cache_dir)
    model = dummy.build_model(shape, seed, torch_dtype, device)
    return model, tokenizer, dummy.weights_digest(shape, seed)


def _model_folder(source: ModelSource, root: Path,
                  dtype: str | None = None) -> tuple[Path, str]:
    """The HF folder to load ``source`` from and the sha256 of its weights: a HF folder itself,
    or a GGUF's converted cache entry under ``root`` (converted now if missing). dtype: the
    dtype the model is loaded in, if it is (for the conversion's message only)."""
    if source.kind == "hf_folder":
        return source.path, _folder_sha256(source.path, root)
    gguf_path = source.gguf_path
    assert gguf_path is not None
    digest = _file_sha256(gguf_path, root)
    folder = root / _GGUF_CACHE_DIR / digest
    if not _is_complete(folder):
        _convert_gguf(gguf_path, folder, digest, dtype)
    return folder, digest


@contextmanager
def _no_transformers_bars() -> Iterator[None]:
    """transformers' progress bars off for one of our loads: its own (``Loading weights``,
    ``transformers.utils.logging.disable_progress_bar``) and the plain tqdm bar of the GGUF
    conversion (``Converting and de-quantizing GGUF tensors...``, which that switch does not
    reach). Both are restored afterwards, so bars outside our loads (a user's own, transformers'
    in a user's code) are as they were; our ``converting ...`` log line says what is going on."""
    import functools

    from transformers.utils import logging as hf_logging

    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # no gguf package: no conversion bar either
        gguf_utils = None
    bars_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    if gguf_tqdm is not None:
        gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        if bars_on:
            hf_logging.enable_progress_bar()


def _load_gguf(gguf_path: Path) -> tuple[Any, Any]:
    """Model (float32, dense, not marked quantized) and tokenizer straight from a GGUF file,
    with no progress bar on stderr (``_no_transformers_bars``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, file = str(gguf_path.parent), gguf_path.name
    # dequantize=True makes transformers unpack every weight to a plain tensor and drop its
    # quantizer afterwards; a model still holding the GGUF quantizer refuses save_pretrained
    # ("quantized with gguf and is not serializable").
    with _no_transformers_bars():
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=file, dtype=torch.float32, local_files_only=True,
            quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    _drop_quantizer(model)
    return model, tokenizer


def _drop_quantizer(model: Any) -> None:
    """Unmark a fully dequantised model as quantized, so that save_pretrained accepts it.

    A no-op where transformers already did it. These are the attributes
    ``HfQuantizer.remove_quantization_config`` clears (transformers 5.x).
    """
    if getattr(model, "hf_quantizer", None) is None and not getattr(model, "is_quantized", False):
        return
    for name, param in model.named_parameters():
        if not param.dtype.is_floating_point:
            raise RuntimeError(f"GGUF weight {name} is still packed ({param.dtype}); cannot "
                               f"cache a model that transformers did not dequantise")
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def conversion_message(gguf_path: Path, entry_dir: Path, dtype: str | None = None) -> str:
    """The line logged when ``gguf_path`` is converted into the cache entry ``entry_dir``.

    The entry is the tokenizer, config and float32 (dequantised) weights, whatever the dtype
    loaded. With dtype "int8" and a file whose matmul weights the int8 kernels take as codes
    (``gguf_header.int8_code_types``), the line says that the matmuls run on the file's own
    codes and the float32 copy serves the embedding and norms (``backends.cpu.Int8Weights``):
    a fresh user read "converting ... to float32" right after "loading model ... (int8, ...)"
    as int8 not being used."""
    line = (f"converting {gguf_path} once: its tokenizer, config and float32 weights, "
            f"cached at {entry_dir}")
    if dtype == "int8":
        from specbatch.models.gguf_header import int8_code_types

        types = int8_code_types(gguf_path)
        if types:
            line += (f" (int8 multiplies by the file's own {' + '.join(types)} codes; the "
                     f"float32 copy serves the embedding and norms)")
    return line


def _convert_gguf(gguf_path: Path, entry_dir: Path, digest: str,
                  dtype: str | None = None) -> None:
    """Write the dequantised model and tokenizer of ``gguf_path`` to ``entry_dir``, atomically.
    dtype: as ``_model_folder``'s."""
    from specbatch.models.gguf_header import check_whole

    check_whole(gguf_path)  # a cut file fails here in one line, not deep in transformers
    logger.info("%s", conversion_message(gguf_path, entry_dir, dtype))
    start = time.perf_counter()
    model, tokenizer = _load_gguf(gguf_path)
    parent = entry_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest[:12]}-", dir=parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"gguf_path": str(gguf_path), "sha256": digest, "dtype": "float32"}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        # Another process may have converted the same file meanwhile; its copy is as good as
        # ours. An entry without the marker was not written by us: replace it.
        if not _is_complete(entry_dir):
            if entry_dir.exists():
                shutil.rmtree(entry_dir)
            try:
                os.replace(tmp, entry_dir)
            except OSError:
                if not _is_complete(entry_dir):  # not a lost race: a real failure
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path.name, time.perf_counter() - start)


def _is_complete(entry_dir: Path) -> bool:
    return (entry_dir / _MARKER).is_file()


def _remove_stale_temps(parent: Path) -> None:
    """Delete temp dirs that killed runs left behind (each holds a whole model)."""
    now = time.time()
    for tmp in parent.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TEMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            pass  # gone already: another process cleaned it


def _load_folder(folder: Path, torch_dtype: torch.dtype, device: torch.device) -> tuple[Any, Any]:
    """Model (eval mode) and tokenizer from a HF folder, cast to ``torch_dtype`` on load.

    Casting in from_pretrained, not with ``.to(dtype)`` afterwards, keeps float32 buffers such
    as the rotary ``inv_freq`` in float32, as transformers intends.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _no_transformers_bars():
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype,
                                                     local_files_only=True)
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return model, tokenizer


def _eos_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos)
    return tuple(dict.fromkeys(int(i) for i in ids))  # dedupe, keep order


def _max_model_len(config: Any) -> int:
    value = getattr(config, "max_position_embeddings", None)
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"model config has no usable max_position_embeddings ({value!r})")
    return value


def _file_sha256(path: Path, cache_root: Path) -> str:
    """sha256 hex of a file, remembered in ``<cache_root>/hashes/`` by path, size and mtime."""
    path = path.resolve()
    stat = path.stat()
    key_text = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}"
    sidecar = cache_root / "hashes" / (hashlib.sha256(key_text.encode()).hexdigest()[:32] + ".json")
    try:
        remembered = json.loads(sidecar.read_text())
        if remembered.get("key") == key_text and len(remembered.get("sha256", "")) == 64:
            return remembered["sha256"]
    except (OSError, ValueError, AttributeError):
        pass  # no sidecar yet, or a damaged one: hash again
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    sha = digest.hexdigest()
    try:
        _write_atomic(sidecar, json.dumps({"key": key_text, "sha256": sha}) + "\n")
    except OSError as error:  # a read-only cache only costs a re-hash next time
        logger.warning("could not remember the sha256 of %s: %s", path, error)
    return sha


def _folder_sha256(folder: Path, cache_root: Path) -> str:
    """sha256 over the names and contents of a HF folder's top-level files (hidden ones skipped)."""
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            digest.update(f"{path.name}\0{_file_sha256(path, cache_root)}\n".encode())
    return digest.hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
