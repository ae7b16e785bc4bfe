"""Every ``SPECBATCH_*`` environment variable specbatch reads, read here and nowhere else.

| Variable | Default | Meaning |
|---|---|---|
| ``SPECBATCH_CACHE`` | ``~/.cache/specbatch`` | Root of the caches: converted weights, calibrations, the built C kernels (``<root>/kernels``; their default follows ``$XDG_CACHE_HOME``). ``--cache-dir`` overrides it for the weights. |
| ``SPECBATCH_KERNELS`` | unset: Triton on CUDA only | ``1`` runs the Triton kernels on any device (CPU tensors under ``TRITON_INTERPRET=1`` in the tests), ``0`` never. |
| ``SPECBATCH_CPU_KERNELS`` | on | ``0`` turns every C kernel off (float32 then runs on oneDNN and torch attention; dtype int8 is refused). |
| ``SPECBATCH_CPU_LINEAR`` | ``c`` | ``onednn``: the dense layers run on oneDNN instead of the C matmul (no C decode step either). |
| ``SPECBATCH_CPU_ATTENTION`` | ``c`` | ``torch``: the torch attention instead of the C one. |
| ``SPECBATCH_CPU_DECODE`` | ``c`` | ``torch``: the torch layer loop (C matmuls and attention) instead of one C call per step. |
| ``SPECBATCH_CPU_WEIGHTS`` | ``codes`` | ``float32``: the C matmul streams float32 panels even for weights exact as 4/8-bit codes. |
| ``SPECBATCH_CPU_AVX512`` | on | ``0``: the C matmuls and attention start on their AVX2 forms (same bits; A/B timings). |
| ``SPECBATCH_TOKENIZER`` | unset: the packaged SmolLM2 GGUF's | A folder holding SmolLM2's ``tokenizer.json``, for the dummy-weights models (``--model dummy:...``) where the GGUF is not installed (the air-gapped GPU bundle). |
| ``SPECBATCH_CUDA_LINEAR`` | ``auto`` | ``triton`` / ``cublas``: the CUDA dense layers on specbatch's invariant Triton matmul / on cuBLAS, instead of the load-time probe's choice (``models/dense.choose_cuda_linear``). |
| ``SPECBATCH_CPU_VNNI`` | on | ``0``: the int8 matmul starts on its AVX2 form instead of AVX-512 VNNI (same bits). |
| ``SPECBATCH_START_THREADS`` | unset | Set by specbatch, not by hand: the count a job that started beside other work put in ``OMP_NUM_THREADS`` (``cpu_threads.choose_threads``), so that a later choice, or a child process that inherits it (a Ray worker), does not take it for the user's count. |

Each function reads its variable when called, never at import, so a test's
``monkeypatch.setenv`` applies to the next call (the C kernels read ``cpu_avx512`` and
``cpu_vnni`` once, when ``kernels/cpu_build.py`` loads them). Values are compared
case-insensitively; any other value means the default. This module imports nothing heavy (the
kernels import it).
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLES = ("SPECBATCH_CACHE", "SPECBATCH_KERNELS", "SPECBATCH_CPU_KERNELS",
             "SPECBATCH_CPU_LINEAR", "SPECBATCH_CPU_ATTENTION", "SPECBATCH_CPU_DECODE",
             "SPECBATCH_CPU_WEIGHTS", "SPECBATCH_CPU_AVX512", "SPECBATCH_CPU_VNNI",
             "SPECBATCH_CUDA_LINEAR", "SPECBATCH_TOKENIZER", "SPECBATCH_START_THREADS")
TOKENIZER = "SPECBATCH_TOKENIZER"  # named in messages (models/dummy.py)
START_THREADS = "SPECBATCH_START_THREADS"  # written by cpu_threads.choose_threads


def _get(name: str) -> str:
    return os.environ.get(name, "")


def cache_dir() -> Path | None:
    """``$SPECBATCH_CACHE`` (``~`` expanded), or None when unset or empty."""
    value = _get("SPECBATCH_CACHE")
    return Path(value).expanduser() if value else None


def triton_kernels() -> bool | None:
    """``SPECBATCH_KERNELS``: True (``1``: Triton on any device), False (``0``: never), None
    (unset or anything else: Triton on CUDA where it imports)."""
    return {"1": True, "0": False}.get(_get("SPECBATCH_KERNELS"))


def cpu_kernels() -> bool:
    """Whether the C kernels may be used at all (``SPECBATCH_CPU_KERNELS`` is not ``0``)."""
    return _get("SPECBATCH_CPU_KERNELS") != "0"


def cpu_linear() -> bool:
    """Whether the dense layers may run on the C matmul (``SPECBATCH_CPU_LINEAR`` is not
    ``onednn``)."""
    return _get("SPECBATCH_CPU_LINEAR").lower() != "onednn"


def cpu_attention() -> bool:
    """Whether attention may run in C (``SPECBATCH_CPU_ATTENTION`` is not ``torch``)."""
    return _get("SPECBATCH_CPU_ATTENTION").lower() != "torch"


def cpu_decode() -> bool:
    """Whether a step may run as one C call over all layers (``SPECBATCH_CPU_DECODE`` is not
    ``torch``)."""
    return _get("SPECBATCH_CPU_DECODE").lower() != "torch"


def cpu_code_weights() -> bool:
    """Whether the C matmul streams exact 4/8-bit codes (``SPECBATCH_CPU_WEIGHTS`` is not
    ``float32``)."""
    return _get("SPECBATCH_CPU_WEIGHTS").lower() != "float32"


def cpu_avx512() -> bool:
    """Whether the C kernels start on their AVX-512 forms where the CPU has them
    (``SPECBATCH_CPU_AVX512`` does not start with ``0``)."""
    return not _get("SPECBATCH_CPU_AVX512").startswith("0")


def cpu_vnni() -> bool:
    """Whether the int8 matmul starts on AVX-512 VNNI where the CPU has it
    (``SPECBATCH_CPU_VNNI`` does not start with ``0``)."""
    return not _get("SPECBATCH_CPU_VNNI").startswith("0")


def cpu_switches() -> str:
    """The C-kernel switches that change step times, as set (``""`` when none is):
    ``" SPECBATCH_CPU_DECODE=torch"`` and the like, for the calibration's fingerprint."""
    return "".join(f" {name}={_get(name)}" for name in
                   ("SPECBATCH_CPU_DECODE", "SPECBATCH_CPU_WEIGHTS", "SPECBATCH_CPU_AVX512")
                   if _get(name))



def cuda_linear() -> str:
    """``SPECBATCH_CUDA_LINEAR`` as written (``auto`` when unset or empty); the caller checks
    it is ``auto``, ``triton`` or ``cublas``."""
    return _get("SPECBATCH_CUDA_LINEAR") or "auto"


def tokenizer_folder() -> str:
    """``SPECBATCH_TOKENIZER`` as written (empty when unset); ``models/dummy.py`` checks it."""
    return _get(TOKENIZER)
