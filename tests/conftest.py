"""Every test session gets its own ``$SPECBATCH_CACHE``, an empty temp folder, removed at the end.

Tests then never write into the user's cache, and never read a calibration that an earlier run
measured (perhaps under load): a test that needs one measures it in this session. Only the
converted weights are taken from the user's cache (``gguf-v1/<sha256>/``, hard links, else
copies, and the ``hashes/`` memo that names them): converting SmolLM2-135M took 113 s on this
2-core machine under load 4-7 (15 s when quiet), so re-making it every session is costly. A
cache without them (a fresh machine) converts once, into the temp folder.

Set ``SPECBATCH_TEST_CACHE=DIR`` to use DIR instead (kept afterwards, for a look).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated (at import): without a GPU, every
# test that runs a Triton kernel runs it on CPU tensors under the interpreter, whichever test
# file imports a kernel module first (tests/kernels/conftest.py, tests/helpers.backend_cases)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_dot_per_row() -> None:
    """Make the Triton interpreter's ``tl.dot`` compute each output row on its own.

    The interpreter computes a tile's ``tl.dot`` as one ``numpy.matmul``, and numpy's OpenBLAS
    rounds a row by where it sits in its micro-tile on some CPUs: with the Haswell kernel (AMD
    Zen 2, AVX2) rows 6-11 of a 16-row tile came out in other bits than the same row at
    position 0 (float32, K 32-576), so the matmul kernel's row-invariance tests failed there
    while they passed on AVX-512 hosts. A GPU's MMA gives an element the same bits wherever its
    row sits, which is what those tests model; here every row is its own ``[1, K] @ [K, N]``
    product (one batched ``numpy.matmul``), whose bits depend on that row alone."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    dot = interpreter.InterpreterBuilder.create_dot
    if getattr(dot, "_per_row", False):
        return
    handle = interpreter.TensorHandle

    def create_dot(self, a, b, d, *args):
        # a [..., M, K] -> [..., M, 1, K]; b [..., K, N] -> [..., 1, K, N]; d likewise
        out = dot(self, handle(a.data[..., None, :], a.dtype),
                  handle(b.data[..., None, :, :], b.dtype),
                  handle(d.data[..., None, :], d.dtype), *args)
        return handle(out.data[..., 0, :], out.dtype)

    create_dot._per_row = True
    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_dot_per_row()

_CACHE_ENV = "SPECBATCH_CACHE"  # read by specbatch/settings.py
_WEIGHTS_DIR = "gguf-v1"  # loader._GGUF_CACHE_DIR
_MARKER = "specbatch-cache.json"  # loader._MARKER: the entry is complete


def _user_cache() -> Path:
    return Path(os.environ.get(_CACHE_ENV) or Path.home() / ".cache" / "specbatch").expanduser()


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(src, dst)


def seed_converted_weights(user: Path, cache: Path) -> list[str]:
    """Put ``user``'s complete converted-weight entries (and the hash memo) into ``cache``;
    nothing else (no calibration, no assembled split GGUFs). Returns the entries' names."""
    seeded = []
    weights = user / _WEIGHTS_DIR
    for entry in sorted(weights.iterdir()) if weights.is_dir() else []:
        if entry.name.startswith(".") or not (entry / _MARKER).is_file():
            continue  # a killed run's temp folder, or not ours
        dst = cache / _WEIGHTS_DIR / entry.name
        tmp = cache / _WEIGHTS_DIR / f".seed-{entry.name}"
        tmp.mkdir(parents=True)
        for f in entry.rglob("*"):
            if f.is_dir():
                (tmp / f.relative_to(entry)).mkdir(parents=True, exist_ok=True)
            elif f.name != _MARKER:
                _link_or_copy(f, tmp / f.relative_to(entry))
        shutil.copy2(entry / _MARKER, tmp / _MARKER)  # last: the entry is whole when it is there
        tmp.rename(dst)
        seeded.append(entry.name)
    if seeded and (user / "hashes").is_dir():
        shutil.copytree(user / "hashes", cache / "hashes")
    return seeded


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput"):  # an xdist worker: the controller's env is inherited
        return
    kept = os.environ.get("SPECBATCH_TEST_CACHE")
    if kept:
        cache = Path(kept)
        cache.mkdir(parents=True, exist_ok=True)
    else:
        cache = Path(tempfile.mkdtemp(prefix="specbatch-test-cache-"))
        config._specbatch_temp_cache = cache
    user = _user_cache()
    if user.resolve() != cache.resolve() and not (cache / _WEIGHTS_DIR).exists():
        seed_converted_weights(user, cache)
    os.environ[_CACHE_ENV] = str(cache)  # this process and every CLI subprocess a test starts


def pytest_unconfigure(config) -> None:
    cache = getattr(config, "_specbatch_temp_cache", None)
    if cache is not None:
        shutil.rmtree(cache, ignore_errors=True)


def pytest_report_header(config) -> str:
    return f"SPECBATCH_CACHE={os.environ.get(_CACHE_ENV)} (this session's own; see tests/conftest.py)"


import pytest  # noqa: E402  (after the cache setup above, which must not import torch)


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    """A 2-layer random Llama GGUF (``tests/unit/test_loader.write_tiny_gguf``) at
    ``tmp_path / "tiny.gguf"``: the model of the command-line tests."""
    from tests.unit.test_loader import write_tiny_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    return path
