"""Builds and loads the engine's C kernels for x86-64 CPUs (``kernels/csrc/*.c``, AVX2 + FMA).

Every ``.c`` file in ``csrc/`` is compiled into one shared library, once per machine, with the
system C compiler (``$CC``, else ``cc``; 2-15 s, logged) into ``$SPECBATCH_CACHE`` (default
``$XDG_CACHE_HOME/specbatch``, i.e. ``~/.cache/specbatch``)``/kernels`` (the temp folder's
``specbatch-kernels`` where that is not writable), named by a hash of the sources, compiler and
flags, and loaded with ctypes. It links OpenMP dynamically: loaded after
torch, it shares torch's OpenMP runtime (``libgomp.so.1``), so its threads are torch's and
``torch.set_num_threads`` applies to it.

``library()`` is None (the engine then keeps its torch path: oneDNN matmuls, torch attention)
when the CPU lacks AVX2/FMA, no compiler works (logged once), or ``SPECBATCH_CPU_KERNELS=0``.
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
import time
from pathlib import Path

from specbatch import settings

_log = logging.getLogger(__name__)

SOURCES = sorted(Path(__file__).with_name("csrc").glob("*.c"))
HEADERS = sorted(Path(__file__).with_name("csrc").glob("*.h"))  # hashed too: a change rebuilds
# -ffp-contract=off: a product and a sum written apart stay apart (the documented roundings)
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")


def cache_dir() -> Path:
    root = settings.cache_dir() or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specbatch")
    return Path(root) / "kernels"


def cpu_has_avx2_fma() -> bool:
    """From ``/proc/cpuinfo`` (False where it cannot be read: not Linux x86-64)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = text.split("\nflags", 1)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return False
    return "avx2" in flags and "fma" in flags and "f16c" in flags  # F16C: every AVX2 CPU


def build() -> Path:
    """Compile the sources (unless already built) and return the library's path. Raises
    ``RuntimeError`` with the compiler's message when there is no compiler or it fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    digest = hashlib.sha256(" ".join((cc,) + FLAGS).encode())
    for src in SOURCES + HEADERS:
        digest.update(src.name.encode() + src.read_bytes())
    name = f"specbatch_cpu-{digest.hexdigest()[:16]}.so"
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / "specbatch-kernels"):
        lib = folder / name
        if lib.exists():
            return lib
        try:  # a read-only home (a container, a cluster node) falls back to the temp folder
            folder.mkdir(parents=True, exist_ok=True)
            if os.access(folder, os.W_OK):
                break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no writable folder for the built kernels ({cache_dir()})")
    # compile to a temporary name, then rename: a concurrent build (another process, a Ray
    # worker) never loads half a library
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    # a first run on a machine waits for this: say so (a fresh user saw ~12 s of silence)
    _log.info("building the C kernels (once on this machine) into %s", lib.parent)
    start = time.monotonic()
    try:
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True,
                              text=True, timeout=300)
        if proc.returncode != 0:
            why = proc.stderr.strip()[-500:] or f"exit status {proc.returncode}, no message"
            raise RuntimeError(f"{cc} failed: {why}")
        os.replace(tmp, lib)
        _log.info("built the C kernels in %.1f s", time.monotonic() - start)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (the reason logged once) when they cannot be used here."""
    if not settings.cpu_kernels():
        return None
    if not cpu_has_avx2_fma():
        _log.info("CPU without AVX2/FMA: the C kernels are off (oneDNN matmuls, torch "
                  "attention)")
        return None
    import torch  # noqa: F401  (loads torch's libgomp first, so the kernels share it)

    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _log.warning("the C kernels did not build (%s); float32 runs on oneDNN and torch "
                     "attention, slower at few rows", exc)
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.sb_linear_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
    lib.sb_linear_f32.restype = None
    lib.sb_linear_quant.argtypes = [p, i64, ctypes.c_int, p, p, p, p, i64, i64, i64, i64]
    lib.sb_linear_quant.restype = ctypes.c_int
    lib.sb_linear_avx512.argtypes = [ctypes.c_int]
    lib.sb_linear_avx512.restype = ctypes.c_int
    lib.sb_linear_qmicro512_from.argtypes = [ctypes.c_int]
    lib.sb_linear_qmicro512_from.restype = ctypes.c_int
    lib.sb_linear_q8_isa.argtypes = [ctypes.c_int]
    lib.sb_linear_q8_isa.restype = ctypes.c_int
    lib.sb_attention_avx512.argtypes = [ctypes.c_int]
    lib.sb_attention_avx512.restype = ctypes.c_int
    for start in (lib.sb_linear_avx512_start, lib.sb_attention_avx512_start,
                  lib.sb_linear_q8_isa_start):
        start.argtypes, start.restype = [ctypes.c_int], None
    # the starting ISA from the environment; a state a test or an A/B timing set stays
    lib.sb_linear_avx512_start(settings.cpu_avx512())
    lib.sb_attention_avx512_start(settings.cpu_avx512())
    lib.sb_linear_q8_isa_start(settings.cpu_vnni())
    lib.sb_decode_f32.argtypes = [p, i64, p, i64, i64, p, p, p, p, i64, i64, i64, i64, i64, i64,
                                  ctypes.c_float, ctypes.c_float, ctypes.c_int]
    lib.sb_decode_f32.restype = ctypes.c_int
    lib.sb_attention_f32.argtypes = [p, i64, i64, p, p, i64, i64, i64, p, p, p, i64, i64,
                                     i64, i64, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.sb_attention_f32.restype = ctypes.c_int
    lib.sb_greedy_select.argtypes = [p, i64, p, i64, i64, p, i64, p, p]
    lib.sb_greedy_select.restype = None
    return lib
