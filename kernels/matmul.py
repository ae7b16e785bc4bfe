"""Dense layer ``x @ weight.T (+ bias)`` whose rows do not depend on the row count (Triton).

A row's bits must be the same whether it runs alone (an M = 1 decode step), among the k + 1
tokens of a verify step, or beside the other rows of a batch (docs/design.md, "Batch
invariance"). cuBLAS does not promise that: it picks its kernel, tiling and split-K from the
problem size, M included. Here every output element is one dot product over K, reduced in one
fixed order: tiles of ``BLOCK_K`` along K from 0 up, each added by ``tl.dot`` into a float32
accumulator, with no split-K. The tile shape (``MatmulConfig``) is chosen from N, K and the
dtype only, never from M, and M is not specialized on (``do_not_specialize``), so the compiled
kernel a row runs through is the same at every M; rows past M load as zeros and only fill the
tile. Which rows share a tile, and in which order, then changes nothing in a row's result.
(The idea of Thinking Machines' batch_invariant_ops and vLLM's batch-invariant matmul: fixed
tiles, no split-K; this kernel is not persistent.)

Speed: a decode or verify step is bound by streaming the weights, so the tiles are narrow in N
(enough programs to fill the GPU without splitting K) and short in M (``BLOCK_M`` 16: an
M = 1 step wastes little). Programs of one N tile are adjacent in the grid, so its weights are
read from memory once and from L2 by the other M tiles. Prefill pays for the narrow tiles.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from . import check

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_PROGRAMS = 128  # N tiles wanted (~one wave on an H100/H200's 132 SMs) before widening


@dataclass(frozen=True)
class MatmulConfig:
    """Tile shape and launch settings of one (N, K, dtype). BLOCK_K sets the reduction order
    (so the bits); BLOCK_M and BLOCK_N set which outputs a program computes (and, through the
    MMA instruction shape, may set the bits too); num_warps/num_stages only the speed."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


def config_for(n: int, k: int, dtype: torch.dtype,
               interpreted: bool | None = None) -> MatmulConfig:
    """The tile shape ``linear`` uses for weight ``[n, k]`` in ``dtype``: a function of these
    three only (never of the row count), so a row's bits do not depend on M.

    BLOCK_N: the widest of 128/64/32/16 that still gives ``MIN_PROGRAMS`` N tiles (Llama-1.5B:
    o 2048 and q/k/v 3072 -> 16, gate/up 16384 and lm_head 49152 -> 128). BLOCK_K: 256 for
    16-bit narrow tiles (more bytes in flight per program), else 128, 64 when K is not a
    multiple of 128 (SmolLM2's 576); float32 (IEEE products, no TF32) 32.
    interpreted: under Triton's interpreter (default: ``TRITON_INTERPRET=1``, the CPU tests),
    whose cost is per program, wide tiles (64 x 128 x 64) instead; as fixed (the kernel tests
    pass the GPU's config explicitly to check it).
    """
    return _config(n, k, dtype, _interpreted() if interpreted is None else interpreted)


@functools.lru_cache(maxsize=None)
def _config(n: int, k: int, dtype: torch.dtype, interpreted: bool) -> MatmulConfig:
    if interpreted:
        return MatmulConfig(64, 128, 64)
    block_n = 16
    for width in (128, 64, 32):
        if -(-n // width) >= MIN_PROGRAMS:
            block_n = width
            break
    if dtype == torch.float32:
        return MatmulConfig(16, min(block_n, 64), 32, num_warps=4, num_stages=3)
    if k % 128:
        block_k = 64
    elif block_n <= 32 and k % 256 == 0:
        block_k = 256
    else:
        block_k = 128
    return MatmulConfig(16, block_n, block_k, num_warps=4 if block_n >= 64 else 2,
                        num_stages=4 if block_n <= 64 else 3)


if triton is not None:
    @triton.jit(do_not_specialize=["M"])
    def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr,  # x [M, K], w [N, K], bias [N], out [M, N]
                       M, N, K,
                       s_xm, s_xk, s_wn, s_wk, s_om,  # strides (out's N stride 1)
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)  # M tiles vary fastest: one N tile's programs run together
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_ptrs = x_ptr + rm[:, None].to(tl.int64) * s_xm + rk[None, :] * s_xk  # [BM, BK]
        w_ptrs = w_ptr + rn[None, :].to(tl.int64) * s_wn + rk[:, None] * s_wk  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # K tiles from 0 up, one after the other, into one float32 accumulator: the order is
        # fixed by K and BLOCK_K alone (no split-K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = rk < K - k0
            a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter's dot has no bfloat16 (products are exact in float32)
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            x_ptrs += BLOCK_K * s_xk
            w_ptrs += BLOCK_K * s_wk
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rm[:, None].to(tl.int64) * s_om + rn[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           config: MatmulConfig | None = None) -> torch.Tensor:
    """Triton launcher, ``F.linear``'s contract with row-count-invariant rows.

    x: ``[..., K]`` (``[M, K]`` or more leading dims; any strides, copied only where the
    leading dims cannot be flattened); weight: ``[N, K]``; bias: ``[N]`` or None; all float16,
    bfloat16 or float32, one dtype, one device. Products are summed in float32 (float32 inputs:
    IEEE products, never TF32), the bias added in float32, the result rounded once to x's dtype.
    Returns ``[..., N]`` in x's dtype. Row i of the result is bit-identical whatever the other
    rows are, how many there are (M = 0 gives an empty result) and in which order.
    config: the tile shape; default ``config_for(N, K, dtype)`` (pass one to run a slice of a
    weight with the full weight's tiles, or to try another shape).
    Raises ``ValueError`` for a shape, dtype or device mismatch or a missing triton.
    """
    n, k = weight.shape if weight.dim() == 2 else (-1, -1)
    if not (triton is not None and x.dim() >= 1 and x.shape[-1] == k and x.dtype in DTYPES
            and weight.dtype == x.dtype and x.device == weight.device
            and (bias is None or (bias.dtype == x.dtype and bias.shape == (n,)
                                  and bias.device == x.device))):
        _check_args(x, weight, bias)  # raises, naming what is wrong (messages built only here)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.view(*lead, n)
    if k == 0:
        return out.zero_().add_(bias if bias is not None else 0).view(*lead, n)
    cfg = config or config_for(n, k, x.dtype)
    b = bias if bias is not None else weight  # any pointer: not read without HAS_BIAS
    if bias is not None and bias.stride(0) != 1:
        b = bias.contiguous()
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _linear_kernel[grid](x2, weight, b, out, m, n, k,
                         x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1),
                         out.stride(0),
                         HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                         UPCAST=x.dtype == torch.bfloat16 and _interpreted(),
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                         num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.view(*lead, n)


def _check_args(x, weight, bias) -> None:
    check(triton is not None, "linear needs triton (pip install 'specbatch[gpu]')")
    check(x.dim() >= 1 and weight.dim() == 2, f"x: [..., K], weight: [N, K], got "
          f"{tuple(x.shape)} and {tuple(weight.shape)}")
    n, k = weight.shape
    check(x.shape[-1] == k, f"x has {x.shape[-1]} features, weight {tuple(weight.shape)} takes {k}")
    check(x.dtype in DTYPES, f"dtype {x.dtype} is not one of float16, bfloat16, float32")
    check(weight.dtype == x.dtype and (bias is None or bias.dtype == x.dtype),
          f"dtypes differ: x {x.dtype}, weight {weight.dtype}"
          + ("" if bias is None else f", bias {bias.dtype}"))
    check(bias is None or tuple(bias.shape) == (n,),
          f"bias: [{n}], got {None if bias is None else tuple(bias.shape)}")
    check(x.device == weight.device and (bias is None or bias.device == x.device),
          "x, weight and bias on one device")


def linear_reference(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, ``linear``'s contract (products and sums in float32, then x's dtype); its
    rows are not promised to be row-count invariant (the BLAS picks the order)."""
    out = torch.nn.functional.linear(x.float(), weight.float(),
                                     None if bias is None else bias.float())
    return out.to(x.dtype)
