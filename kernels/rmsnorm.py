"""RMSNorm, one program per row: a row's bits never depend on the rows beside it.

The engine's math (``LlamaForward._rms_norm``, as transformers' ``LlamaRMSNorm``): in float32
whatever the model dtype, ``h = x * rsqrt(mean(x ** 2) + eps)``, rounded to x's dtype, then
times the weight in that dtype (the float32 product rounded once, as torch rounds a
bfloat16/float16 product). torch's CUDA reduction may split a row's sum of squares
differently with the number of rows; here one program reads its whole row (padded to a power of
2 with zeros, which add exact zeros) and sums it with one ``tl.sum`` of a fixed shape.
"""

from __future__ import annotations

import os

import torch

from . import check

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HIDDEN = 65536  # one program holds a row


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr,  # x [M, H] (H stride 1), weight [H], out [M, H]
                         M, H, s_xm, s_om, eps,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK)
        ok = (rows < M)[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + rows[:, None] * s_xm + cols[None, :], mask=ok,
                    other=0.0).to(tl.float32)  # [ROWS, BLOCK]
        mean = tl.sum(x * x, axis=1) / H  # each row alone, zeros past H
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
        h = (x * inv[:, None]).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
        y = w.to(tl.float32)[None, :] * h.to(tl.float32)
        tl.store(out_ptr + rows[:, None] * s_om + cols[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=ok)


def rows_per_program() -> int:
    """Rows one program normalizes: 1 (one program per row); 16 under Triton's interpreter
    (CPU tests), whose cost is per program. Fixed either way, never a function of M."""
    return 16 if os.environ.get("TRITON_INTERPRET") == "1" else 1


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton launcher: ``weight * (x * rsqrt(mean(x ** 2, -1) + eps))`` computed in float32 and
    rounded to x's dtype before the weight multiply (the engine's ``_rms_norm``).

    x: ``[..., H]`` float16, bfloat16 or float32 (copied if its last dim is not contiguous or
    its leading dims cannot be flattened); weight: ``[H]``, x's dtype, same device; eps: float.
    Returns a new ``[..., H]`` tensor in x's dtype. H <= ``MAX_HIDDEN``.
    Raises ``ValueError`` for a shape, dtype or device mismatch or a missing triton.
    """
    hidden = x.shape[-1] if x.dim() else -1
    if not (triton is not None and weight.dim() == 1 and weight.shape[0] == hidden
            and x.dtype in DTYPES and weight.dtype == x.dtype and x.device == weight.device
            and 0 < hidden <= MAX_HIDDEN):
        _check_args(x, weight)  # raises, naming what is wrong (messages built only here)
    x2 = x.reshape(-1, hidden)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    if x2.shape[0]:
        block = triton.next_power_of_2(hidden)
        rows = rows_per_program()
        _rms_norm_kernel[(triton.cdiv(x2.shape[0], rows),)](
            x2, w, out, x2.shape[0], hidden, x2.stride(0), out.stride(0), float(eps),
            ROWS=rows, BLOCK=block, num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape)


def _check_args(x, weight) -> None:
    check(triton is not None, "rms_norm needs triton (pip install 'specbatch[gpu]')")
    check(x.dim() >= 1 and weight.dim() == 1 and x.shape[-1] == weight.shape[0],
          f"x: [..., H], weight: [H], got {tuple(x.shape)} and {tuple(weight.shape)}")
    check(x.dtype in DTYPES, f"dtype {x.dtype} is not one of float16, bfloat16, float32")
    check(weight.dtype == x.dtype, f"dtypes differ: x {x.dtype}, weight {weight.dtype}")
    check(x.device == weight.device, "x and weight on one device")
    hidden = x.shape[-1]
    check(0 < hidden <= MAX_HIDDEN, f"hidden size {hidden} is not in 1..{MAX_HIDDEN}")


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, ``rms_norm``'s contract (the engine's torch path for 16-bit dtypes)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)
