"""A row-invariant float32 matmul for x86-64 CPUs (AVX2 + FMA), in C: ``csrc/linear_f32.c``.

The engine's float32 dense layers need a matmul whose row ``i`` has the same bits whatever the
number of rows beside it (``specbatch/models/dense.py``). oneDNN's inner product gives that, but
it pays for every extra row from two rows up, although a step of up to ~16 rows should cost what
streaming the weights once costs. This kernel keeps one fixed reduction order per output element
(see the C file) and streams a packed copy of the weight once per 4 rows. All dense layers of
one SmolLM2-135M step: ``python benchmarks/dense_rows.py``, figures in docs/benchmarks.md.
Built and loaded by ``kernels/cpu_build.py``; ``SPECBATCH_CPU_LINEAR=onednn`` keeps oneDNN.
"""

from __future__ import annotations

import os

import torch
from torch.utils.weak import WeakIdKeyDictionary

from kernels import cpu_build

NR = 3  # weight rows per packed panel (csrc/linear_f32.c)


def _library():
    if os.environ.get("SPECBATCH_CPU_LINEAR", "").lower() == "onednn":
        return None
    return cpu_build.library()


def available() -> bool:
    """Whether ``linear`` can run here (builds the C kernels on first call)."""
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
    lib = _library()
    if lib is None:
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
        lib.sb_linear_f32(x2.data_ptr(), x2.stride(0), pack_weight(weight).data_ptr(),
                          None if bias is None else bias.data_ptr(), y.data_ptr(), n, m, n, k)
    return y.view(*lead, n)
