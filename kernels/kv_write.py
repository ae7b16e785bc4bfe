"""KV write: store a step's keys and values into their cache rows at their positions.

Cache layout (``engine.kv_cache.KVCache``, one layer): ``[num_rows, num_kv_heads, capacity,
head_dim]``. Token t of the step goes to row ``rows[t]``, position ``positions[t]``. One program
per (token, kv head) copies ``head_dim`` keys and values; nothing is read back, so the write
does not depend on the other tokens.
"""

from __future__ import annotations

import torch

from . import check

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None


if triton is not None:
    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr,  # [T, Hkv, D] new keys / values
                         k_cache_ptr, v_cache_ptr,  # [R, Hkv, C, D]
                         rows_ptr, pos_ptr,  # [T] int64
                         s_kt, s_kh, s_vt, s_vh,  # strides of k, v (D stride 1)
                         s_cr, s_ch, s_cc,  # strides of the caches (D stride 1)
                         D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        row = tl.load(rows_ptr + t)
        pos = tl.load(pos_ptr + t)
        d = tl.arange(0, D)
        dst = row * s_cr + h * s_ch + pos * s_cc + d
        tl.store(k_cache_ptr + dst, tl.load(k_ptr + t * s_kt + h * s_kh + d))
        tl.store(v_cache_ptr + dst, tl.load(v_ptr + t * s_vt + h * s_vh + d))


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Triton launcher: ``k_cache[rows[t], :, positions[t]] = k[t]`` (and v), in place.

    k, v: ``[T, Hkv, D]`` (last dim contiguous), the caches' dtype; k_cache, v_cache:
    ``[R, Hkv, C, D]`` contiguous; rows, positions: ``[T]`` int64 on the same device. D must
    be a power of 2. Positions must be < C (not checked on the device: no sync).
    Raises ``ValueError`` for a shape, dtype, device or layout mismatch.
    """
    _check_args(k, v, k_cache, v_cache, rows, positions)
    t, hkv, d = k.shape
    if t == 0:
        return
    _kv_write_kernel[(t, hkv)](k, v, k_cache, v_cache, rows, positions,
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                               k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), D=d)


def kv_write_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Plain torch, same contract as ``kv_write``."""
    k_cache[rows, :, positions] = k
    v_cache[rows, :, positions] = v


def _check_args(k, v, k_cache, v_cache, rows, positions) -> None:
    check(triton is not None, "kv_write needs triton (pip install 'specbatch[gpu]')")
    check(k.dim() == 3 and k.shape == v.shape, f"k, v: [T, Hkv, D] each, got {tuple(k.shape)} "
          f"and {tuple(v.shape)}")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          f"k_cache, v_cache: [R, Hkv, C, D] each, got {tuple(k_cache.shape)} and "
          f"{tuple(v_cache.shape)}")
    t, hkv, d = k.shape
    check(k_cache.shape[1] == hkv and k_cache.shape[3] == d,
          f"k {tuple(k.shape)} does not fit the cache {tuple(k_cache.shape)}")
    check(d & (d - 1) == 0, f"head_dim {d} is not a power of 2")
    check(rows.shape == (t,) and positions.shape == (t,), f"rows, positions: [{t}] each, got "
          f"{tuple(rows.shape)} and {tuple(positions.shape)}")
    check(rows.dtype == torch.int64 and positions.dtype == torch.int64,
          "rows, positions: int64")
    check(k.dtype == v.dtype == k_cache.dtype == v_cache.dtype,
          f"dtypes differ: k {k.dtype}, v {v.dtype}, caches {k_cache.dtype}, {v_cache.dtype}")
    check(len({x.device for x in (k, v, k_cache, v_cache, rows, positions)}) == 1,
          "all tensors on one device")
    check(k.stride(2) == 1 and v.stride(2) == 1, "k, v: last dim contiguous")
    check(k_cache.is_contiguous() and v_cache.is_contiguous()
          and k_cache.stride() == v_cache.stride(), "k_cache, v_cache: contiguous")
    check(rows.is_contiguous() and positions.is_contiguous(), "rows, positions: contiguous")
