"""A row-invariant float32 matmul for x86-64 CPUs (AVX2 + FMA), in C: ``linear_cpu.c``.

The engine's float32 dense layers need a matmul whose row ``i`` has the same bits whatever the
number of rows beside it (``specbatch/models/dense.py``). oneDNN's inner product gives that, but
it pays for every extra row from two rows up, although a step of up to ~16 rows should cost what
streaming the weights once costs. This kernel keeps one fixed reduction order per output element
(see the C file) and streams a packed copy of the weight once per call for up to 4 rows. All
dense layers of one SmolLM2-135M step (AMD EPYC Zen 3, AVX2, 2 threads, ``python
benchmarks/dense_rows.py``): see docs/benchmarks.md.

The C file is compiled once per machine with the system C compiler (``$CC``, else ``cc``;
~1 s) into ``$SPECBATCH_CACHE`` (default ``~/.cache/specbatch``)/kernels, named by a hash of the
source, flags and CPU kind, and loaded with ctypes. It links OpenMP dynamically; loaded after
torch, it shares torch's OpenMP runtime and thread count. ``available()`` is False (and the
engine keeps oneDNN) when the CPU lacks AVX2/FMA, no compiler works, or
``SPECBATCH_CPU_LINEAR=onednn``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils.weak import WeakIdKeyDictionary

_log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("linear_cpu.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC")
NR = 3  # weight rows per packed panel (linear_cpu.c)


def _cache_dir() -> Path:
    root = os.environ.get("SPECBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specbatch")
    return Path(root) / "kernels"


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split("\nflags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx2" in flags and "fma" in flags


def _build() -> Path:
    """Compile ``linear_cpu.c`` (once per source / flags / compiler) and return the library's
    path. Raises ``RuntimeError`` with the compiler's message when it fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join((cc,) + FLAGS).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"linear_cpu-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # compile to a temporary name, then rename: concurrent builds (Ray workers) never see half a
    # library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                              text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def _library():
    """The loaded kernel, or None (with the reason logged once) when it cannot be used here."""
    if os.environ.get("SPECBATCH_CPU_LINEAR", "").lower() == "onednn":
        return None
    if not _cpu_has_avx2_fma():
        _log.info("CPU without AVX2/FMA: float32 dense layers use oneDNN")
        return None
    try:
        lib = ctypes.CDLL(str(_build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _log.warning("the float32 CPU matmul kernel did not build (%s); using oneDNN, which "
                     "is slower at few rows", exc)
        return None
    fn = lib.sb_linear_f32
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
    fn.restype = None
    return fn


def available() -> bool:
    """Whether ``linear`` can run here (builds the kernel on first call)."""
    return _library() is not None


# weight -> (its version, the packed copy); the copy lives as long as the weight
_PACKED = WeakIdKeyDictionary()


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's layout of ``weight`` ``[N, K]`` float32: ``[ceil(N / 3), ceil(K / 8), 3,
    8]``, zero-padded (panel p = rows 3p..3p+2, eight k at a time). Cached per weight until it
    changes in place (``_version``); costs one more copy of the weight's bytes."""
    entry = _PACKED.get(weight)
    if entry is not None and entry[0] == weight._version:
        return entry[1]
    n, k = weight.shape
    panels, chunks = -(-n // NR), -(-k // 8)
    padded = weight.detach().new_zeros(panels * NR, chunks * 8)
    padded[:n, :k] = weight.detach()
    packed = padded.view(panels, NR, chunks, 8).transpose(1, 2).contiguous()
    _PACKED[weight] = (weight._version, packed)
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with rows that do not depend on the row count.

    x: ``[..., K]`` float32 CPU; weight: ``[N, K]`` float32; bias: ``[N]`` float32 or None.
    Returns ``[..., N]`` float32. Raises ``RuntimeError`` if the kernel is not ``available()``,
    ``ValueError`` on a dtype, device or shape it does not take.
    """
    fn = _library()
    if fn is None:
        raise RuntimeError("the float32 CPU matmul kernel is not available here")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"float32 CPU tensors only, got x {x.dtype} on {x.device}, "
                         f"weight {weight.dtype}")
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)  # a view where it can be (a row-broadcast x keeps row stride 0)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    if bias is not None:
        bias = bias.detach().contiguous()
    if m:
        fn(x2.data_ptr(), x2.stride(0), pack_weight(weight).data_ptr(),
           None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k)
    return y.view(*lead, n)
