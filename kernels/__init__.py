"""Kernels of the engine's hot ops: Triton for GPUs, each file with its launcher and a
plain-torch reference, and C for x86-64 CPUs (``csrc/``, built by ``cpu_build``).

- ``sample_accept``: position-keyed Gumbel-max sampling fused with draft acceptance.
- ``attention``: decode/verify attention over the KV cache in place, batch-invariant.
- ``kv_write``: a step's keys and values into their cache rows and positions.
- ``matmul``: the dense layers (``F.linear``'s contract), a row's bits independent of the row
  count (fixed K order, no split-K, tiles from N/K/dtype only).
- ``rmsnorm``: RMSNorm, one program per row.
- ``linear_cpu`` (C): the float32 dense layers on CPU, a row's bits independent of the rows
  beside it; ``attention_cpu`` (C): ``attention``'s contract for float32 on CPU;
  ``select_cpu`` (C): an all-greedy step's choice at every fed position (masked argmax with
  the grammar bitmask, NaN flag) in one pass over the logits. Used whenever
  they build (AVX2 + FMA and a C compiler; ``SPECBATCH_CPU_KERNELS=0`` turns them off).

The engine uses a Triton kernel when ``enabled(device)``: the device is CUDA and Triton imports (or
``SPECBATCH_KERNELS=1`` forces them, e.g. on CPU tensors under ``TRITON_INTERPRET=1`` in the
tests; ``SPECBATCH_KERNELS=0`` turns them off). Otherwise it runs the torch path.
"""

from __future__ import annotations

import functools

import torch

from specbatch import settings


@functools.cache
def have_triton() -> bool:
    """Whether ``triton`` imports (the ``gpu`` extra)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising something else at import
        return False
    return True


def enabled(device: torch.device | str) -> bool:
    """Whether the engine should run the Triton kernels for tensors on ``device``."""
    flag = settings.triton_kernels()
    if flag is False or (flag is None and torch.device(device).type != "cuda"):
        return False  # decided without importing triton (slow to import)
    return have_triton()


def check(cond: bool, what: str) -> None:
    """Launcher argument check: raises ``ValueError(what)`` (kept under ``python -O``)."""
    if not cond:
        raise ValueError(what)
