"""kernels.attention: equals its torch reference, and is batch-invariant bit for bit.

Invariance, the property speculation needs: one row's outputs are the same bits computed alone,
beside 15 other rows, with 1 or k + 1 query tokens, and with extra padded keys in its row.
"""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels.attention import BLOCK_N, attention, attention_reference

H, HKV, D = 9, 3, 64  # SmolLM2-135M: 9 query heads over 3 kv heads, head_dim 64


def _cache(gen, rows, cap, dtype, device):
    k = torch.randn(rows, HKV, cap, D, generator=gen).to(dtype).to(device)
    v = torch.randn(rows, HKV, cap, D, generator=gen).to(dtype).to(device)
    return k, v


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2),
                                         (torch.float16, 2e-3)])
def test_attention_equals_reference(device, dtype, atol):
    """Tolerance: both accumulate in float32 in different orders (float32: ~1e-7); in 16-bit
    the outputs are rounded to the dtype, so they may differ by 1 ulp of values < 2 (bfloat16
    ulp 2^-7 = 7.8e-3 at 1..2: 1.6e-2 allows 1 ulp plus the float32 difference)."""
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache = _cache(gen, 6, 3 * BLOCK_N, dtype, device)
    # positions at tile edges (0, BLOCK_N - 1, BLOCK_N), mid-tile, and the last slot
    positions = torch.tensor([0, 1, BLOCK_N - 1, BLOCK_N, BLOCK_N + 1, 100, 3 * BLOCK_N - 1],
                             device=device)
    rows = torch.tensor([0, 5, 2, 2, 3, 1, 4], device=device)
    q = torch.randn(len(rows), H, D, generator=gen).to(dtype).to(device)
    got = attention(q, k_cache, v_cache, rows, positions)
    want = attention_reference(q, k_cache, v_cache, rows, positions)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    # position 0 attends to one key: its output is that value exactly (softmax weight 1)
    assert torch.equal(got[0].float(), v_cache[0, :, 0].float().repeat_interleave(3, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_is_batch_invariant(device, dtype):
    gen = torch.Generator().manual_seed(1)
    cap, k = 4 * BLOCK_N, 5
    k_cache, v_cache = _cache(gen, 16, cap, dtype, device)
    row, last = 7, 150  # row 7 verifies positions 145..150 (k + 1 = 6 query tokens)
    q_row = torch.randn(k + 1, H, D, generator=gen).to(dtype).to(device)
    pos_row = torch.arange(last - k, last + 1, device=device)
    rows_row = torch.full((k + 1,), row, device=device)

    alone = attention(q_row, k_cache, v_cache, rows_row, pos_row)

    # beside 15 other rows, each feeding 1 to 6 tokens at other positions, row 7 in the middle
    q_parts, r_parts, p_parts = [], [], []
    for other in range(16):
        if other == row:
            q_parts.append(q_row)
            r_parts.append(rows_row)
            p_parts.append(pos_row)
            continue
        n = 1 + other % (k + 1)
        start = int(torch.randint(0, cap - n, (1,), generator=gen))
        q_parts.append(torch.randn(n, H, D, generator=gen).to(dtype).to(device))
        r_parts.append(torch.full((n,), other, device=device))
        p_parts.append(torch.arange(start, start + n, device=device))
    batch = attention(torch.cat(q_parts), k_cache, v_cache, torch.cat(r_parts), torch.cat(p_parts))
    off = sum(len(x) for x in q_parts[:row])
    assert torch.equal(batch[off:off + k + 1], alone)

    # 1 query token at a time (k + 1 decode steps) equals the k + 1 tokens of one verify step
    for j in range(k + 1):
        one = attention(q_row[j:j + 1], k_cache, v_cache, rows_row[:1], pos_row[j:j + 1])
        assert torch.equal(one[0], alone[j])

    # extra padded keys: a cache with 4x the capacity and different stale keys past position
    # `last` (rejected drafts, padding) gives the same bits
    big_k, big_v = _cache(gen, 16, 4 * cap, dtype, device)
    big_k[:, :, :last + 1] = k_cache[:, :, :last + 1]
    big_v[:, :, :last + 1] = v_cache[:, :, :last + 1]
    padded = attention(q_row, big_k, big_v, rows_row, pos_row)
    assert torch.equal(padded, alone)

    # and the keys past a query's position really are not read: changing them changes nothing,
    # while changing a key at its position does
    k_cache[row, :, last + 1:] = 1e4
    assert torch.equal(attention(q_row, k_cache, v_cache, rows_row, pos_row), alone)
    k_cache[row, :, last] += 1.0
    assert not torch.equal(attention(q_row, k_cache, v_cache, rows_row, pos_row)[k], alone[k])


def test_attention_checks_its_arguments(device):
    cache = torch.zeros(2, HKV, 64, D, device=device)
    q = torch.ones(3, H, D, device=device)
    idx = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="not a multiple of 3 kv heads"):
        attention(torch.ones(3, 8, D, device=device), cache, cache, idx, idx)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        attention(q.double(), cache.double(), cache.double(), idx, idx)
    with pytest.raises(ValueError, match=r"rows, positions: \[3\] each"):
        attention(q, cache, cache, idx[:2], idx[:2])
    with pytest.raises(ValueError, match="q: last dim contiguous"):
        attention(torch.ones(3, D, H, device=device).transpose(1, 2), cache, cache, idx, idx)
