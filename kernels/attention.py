"""Decode/verify attention over the KV cache in place, batch-invariant by construction.

Each query token t (of any row, fed at any step) reads its own cache row ``rows[t]`` directly
(no gathered copy of rows) and attends to keys ``0 .. positions[t]`` (causal at its absolute
position). One program per (token, kv head) computes that head group's ``group`` query heads.
Keys are read in tiles of ``BLOCK_N`` positions aligned at position 0, from tile 0 up to the
tile holding ``positions[t]``, in that fixed order, with an online softmax in float32
(FlashAttention's rescaling, Dao et al. 2022, arXiv 2205.14135; the FlashDecoding layout
without split-K). Nothing a program computes depends on another token: not on the other rows,
not on how many query tokens its row feeds this step (1 at decode, k + 1 at verify), not on
the cache capacity or keys past its position. So a token's output is the same bits whatever
shares the step, which is what speculation needs (a verify of k + 1 tokens equals k + 1 decode
steps of the same row; vLLM RFC #54506 leaves this axis open).

Cost: no split over keys, so a long context runs on one program per (token, head); fine for
the short contexts of this engine's jobs, and it keeps the reduction order fixed.
"""

from __future__ import annotations

import torch

from . import check

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch reference still works
    triton = None

BLOCK_N = 64  # keys per tile (positions); tiles start at multiples of it


if triton is not None:
    @triton.jit
    def _attention_kernel(q_ptr,  # [T, H, D]
                          k_cache_ptr, v_cache_ptr,  # [R, Hkv, C, D]
                          o_ptr,  # [T, H, D]
                          rows_ptr, pos_ptr,  # [T] int64
                          s_qt, s_qh, s_ot, s_oh,  # strides of q, o (D stride 1)
                          s_cr, s_ch, s_cc,  # strides of the caches (D stride 1)
                          scale,  # float: softmax scale (head_dim ** -0.5)
                          GROUP: tl.constexpr, GROUP_P2: tl.constexpr, D: tl.constexpr,
                          BLOCK: tl.constexpr):
        t = tl.program_id(0)
        hk = tl.program_id(1)
        row = tl.load(rows_ptr + t)
        pos = tl.load(pos_ptr + t)
        g = tl.arange(0, GROUP_P2)
        d = tl.arange(0, D)
        heads = hk * GROUP + g  # [G] query heads of this kv head
        gmask = g < GROUP
        q = tl.load(q_ptr + t * s_qt + heads[:, None] * s_qh + d[None, :], mask=gmask[:, None],
                    other=0.0).to(tl.float32)  # [G, D]
        base = row * s_cr + hk * s_ch
        m = tl.full((GROUP_P2,), float("-inf"), tl.float32)
        lsum = tl.zeros((GROUP_P2,), tl.float32)
        acc = tl.zeros((GROUP_P2, D), tl.float32)
        num_tiles = pos // BLOCK + 1
        for i in range(0, num_tiles):
            n = i * BLOCK + tl.arange(0, BLOCK)  # [N] key positions
            kmask = n <= pos
            offs = base + n[:, None] * s_cc + d[None, :]
            k = tl.load(k_cache_ptr + offs, mask=kmask[:, None], other=0.0).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
            s = tl.where(kmask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])  # [G, N]
            lsum = lsum * alpha + tl.sum(p, axis=1)
            v = tl.load(v_cache_ptr + offs, mask=kmask[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / lsum[:, None]
        tl.store(o_ptr + t * s_ot + heads[:, None] * s_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=gmask[:, None])


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              rows: torch.Tensor, positions: torch.Tensor, scale: float | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher. Query token t attends to ``k_cache[rows[t], :, :positions[t] + 1]``.

    q: ``[T, H, D]`` (last dim contiguous), float16 / bfloat16 / float32; k_cache, v_cache:
    ``[R, Hkv, C, D]`` contiguous, q's dtype, H a multiple of Hkv (grouped-query attention:
    query head h reads kv head ``h // (H // Hkv)``), D a power of 2; rows, positions: ``[T]``
    int64 (positions < C, not checked on the device). scale: default ``D ** -0.5``.
    Returns ``[T, H, D]`` in q's dtype (``out`` if given). Accumulates in float32.
    Raises ``ValueError`` for a shape, dtype, device or layout mismatch.
    """
    _check_args(q, k_cache, v_cache, rows, positions)
    t, h, d = q.shape
    hkv = k_cache.shape[1]
    group = h // hkv
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check(out.shape == q.shape and out.dtype == q.dtype and out.stride(2) == 1,
          "out: like q, last dim contiguous")
    if t == 0:
        return out
    _attention_kernel[(t, hkv)](
        q, k_cache, v_cache, out, rows, positions, q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        d ** -0.5 if scale is None else float(scale), GROUP=group,
        GROUP_P2=triton.next_power_of_2(group), D=d, BLOCK=BLOCK_N)
    return out


def attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        rows: torch.Tensor, positions: torch.Tensor,
                        scale: float | None = None) -> torch.Tensor:
    """Plain torch, same contract as ``attention`` (float32 softmax, one token at a time)."""
    t, h, d = q.shape
    group = h // k_cache.shape[1]
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for i in range(t):
        n = int(positions[i]) + 1
        keys = k_cache[rows[i], :, :n].float().repeat_interleave(group, dim=0)  # [H, n, D]
        values = v_cache[rows[i], :, :n].float().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hnd->hn", q[i].float(), keys) * scale
        out[i] = torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


def _check_args(q, k_cache, v_cache, rows, positions) -> None:
    check(triton is not None, "attention needs triton (pip install 'specbatch[gpu]')")
    check(q.dim() == 3, f"q: [T, H, D], got {tuple(q.shape)}")
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          f"k_cache, v_cache: [R, Hkv, C, D] each, got {tuple(k_cache.shape)} and "
          f"{tuple(v_cache.shape)}")
    t, h, d = q.shape
    hkv = k_cache.shape[1]
    check(k_cache.shape[3] == d, f"head_dim: q has {d}, the cache {k_cache.shape[3]}")
    check(h % hkv == 0, f"{h} query heads is not a multiple of {hkv} kv heads")
    check(d & (d - 1) == 0 and d >= 16, f"head_dim {d} is not a power of 2 >= 16")
    check(q.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"q: float16, bfloat16 or float32, got {q.dtype}")
    check(q.dtype == k_cache.dtype == v_cache.dtype,
          f"dtypes differ: q {q.dtype}, caches {k_cache.dtype}, {v_cache.dtype}")
    check(rows.shape == (t,) and positions.shape == (t,), f"rows, positions: [{t}] each, got "
          f"{tuple(rows.shape)} and {tuple(positions.shape)}")
    check(rows.dtype == torch.int64 and positions.dtype == torch.int64, "rows, positions: int64")
    check(len({x.device for x in (q, k_cache, v_cache, rows, positions)}) == 1,
          "all tensors on one device")
    check(q.stride(2) == 1, "q: last dim contiguous")
    check(k_cache.is_contiguous() and v_cache.is_contiguous()
          and k_cache.stride() == v_cache.stride(), "k_cache, v_cache: contiguous")
    check(rows.is_contiguous() and positions.is_contiguous(), "rows, positions: contiguous")
