"""kernels/select_cpu.py (C): the greedy choice at fed positions equals the torch sequence it
replaces (gather, mask, argmax, NaN check), on ties, masks, -inf and NaN rows, vocab sizes not
a multiple of the vector width."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels import select_cpu

pytestmark = pytest.mark.skipif(not select_cpu.available(), reason="C kernels not built")


def random_mask(t, v, gen, density):
    words = (v + 31) // 32
    bits = torch.rand(t, words * 32, generator=gen) < density
    packed = torch.zeros(t, words, dtype=torch.int64)
    for j in range(32):
        packed |= bits[:, j::32].to(torch.int64) << j
    packed = torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed)  # as int32
    return packed.to(torch.int32)


@pytest.mark.parametrize("vocab", [49152, 101, 37, 8])
@pytest.mark.parametrize("density", [None, 0.5, 0.02])
def test_equals_the_torch_sequence(vocab, density):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=gen)
    logits[3] = torch.round(logits[3])  # many ties: the lowest allowed id wins
    logits[5, :] = 2.0  # all tied
    index = torch.tensor([0, 3, 5, 7, 11, 3, 2], dtype=torch.int64)
    mask = None if density is None else random_mask(len(index), vocab, gen, density)
    ids, nan = select_cpu.greedy_select(logits, index, mask)
    ref_ids, ref_nan = select_cpu.reference(logits, index, mask)
    assert torch.equal(ids, ref_ids) and torch.equal(nan, ref_nan) and not nan.any()


def test_edge_rows():
    vocab = 70
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(1))
    logits[1] = float("-inf")  # every logit -inf: index 0, as torch
    logits[2, 9] = float("nan")  # a NaN, even in a refused token, is flagged
    logits[3, 69] = 50.0  # the maximum in the tail past the last full vector, allowed
    index = torch.arange(6)
    mask = torch.zeros(6, 3, dtype=torch.int32)
    mask[:, :] = -1  # every token allowed ...
    mask[2, 0] = 1  # ... but in row 2 only token 0
    mask[4] = 0  # row 4: none allowed -> every masked logit -inf -> index 0
    mask[5, 1] = 1 << 3  # row 5: only token 35
    mask[5, 0] = mask[5, 2] = 0
    ids, nan = select_cpu.greedy_select(logits, index, mask)
    ref_ids, ref_nan = select_cpu.reference(logits, index, mask)
    assert nan.tolist() == [False, False, True, False, False, False] == ref_nan.tolist()
    keep = ~nan
    assert torch.equal(ids[keep], ref_ids[keep])
    assert ids[1] == 0 and ids[3] == 69 and ids[4] == 0 and ids[5] == 35


def test_rows_of_a_padded_step_by_index():
    """index picks rows out of a [B * Q, V] view (the step's padded logits) in any order."""
    gen = torch.Generator().manual_seed(4)
    step = torch.randn(3, 5, 300, generator=gen)
    index = torch.tensor([0, 1, 5, 10, 11, 12, 13], dtype=torch.int64)
    ids, _ = select_cpu.greedy_select(step.view(15, 300), index)
    assert torch.equal(ids, torch.argmax(step.view(15, 300)[index], dim=-1))
