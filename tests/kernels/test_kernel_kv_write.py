"""kernels.kv_write: the Triton KV write equals its torch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels.kv_write import kv_write, kv_write_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kv_write_equals_reference(device, dtype):
    gen = torch.Generator().manual_seed(3)
    rows_n, hkv, cap, d, t = 5, 3, 96, 64, 11
    k_cache = torch.randn(rows_n, hkv, cap, d, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(rows_n, hkv, cap, d, generator=gen).to(dtype).to(device)
    # a packed verify step: rows 4, 0, 2 feed 4, 1 and 6 tokens at their own positions
    rows = torch.tensor([4] * 4 + [0] + [2] * 6, device=device)
    positions = torch.tensor([10, 11, 12, 13, 0, 90, 91, 92, 93, 94, 95], device=device)
    k = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(t, hkv, d, generator=gen).to(dtype).to(device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    kv_write_reference(k, v, want_k, want_v, rows, positions)
    kv_write(k, v, k_cache, v_cache, rows, positions)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert torch.equal(k_cache[2, :, 95], k[10])  # really written, not left as it was


def test_kv_write_checks_its_arguments(device):
    cache = torch.zeros(2, 2, 16, 16, device=device)
    k = torch.ones(3, 2, 16, device=device)
    idx = torch.zeros(3, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="dtypes differ"):
        kv_write(k.half(), k.half(), cache, cache.clone(), idx, idx)
    with pytest.raises(ValueError, match="does not fit the cache"):
        kv_write(torch.ones(3, 1, 16, device=device), torch.ones(3, 1, 16, device=device),
                 cache, cache.clone(), idx, idx)
    with pytest.raises(ValueError, match="rows, positions: int64"):
        kv_write(k, k, cache, cache.clone(), idx.int(), idx)
    with pytest.raises(ValueError, match="contiguous"):
        kv_write(k, k, cache.transpose(2, 3), cache.clone().transpose(2, 3), idx, idx)
