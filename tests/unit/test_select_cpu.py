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


def test_greedy_accept_equals_sample_and_accept():
    """``verify.greedy_accept`` (C choice, acceptance and NaN flags on the host) gives what the
    torch path gives (``sample_and_accept`` at T = 0, NaN from the logits, one fetch): accepted
    counts and the target grid with its padding (of the rows without a NaN: those end in an
    error), NaN rows, on 200 random steps of 1-6 rows with
    drafts of 0-5 tokens that the target partly takes, padded queries and NaN logits."""
    import random
    from types import SimpleNamespace

    from specbatch.config import SamplingParams
    from specbatch.engine.step_metadata import StepMetadata, fetch_step_results
    from specbatch.spec_decode.verify import greedy_accept, sample_and_accept

    rng, vocab, seen = random.Random(0), 50, {"accepted": 0, "nan": 0}
    sp = SamplingParams(temperature=0.0, max_tokens=64)
    no_stops = SimpleNamespace(stop_ids=lambda s: set())
    for _ in range(200):
        b = rng.randint(1, 6)
        drafts = [[rng.randrange(vocab) for _ in range(rng.choice([0, 0, 1, 3, 5]))]
                  for _ in range(b)]
        seqs = [SimpleNamespace(token_ids=list(range(5 + i)), num_output_tokens=1, sampling=sp,
                                request=SimpleNamespace(seed=0), row=i) for i in range(b)]
        meta = StepMetadata.build(seqs, drafts, no_stops, torch.device("cpu"),
                                  rng.choice([None, 8]))
        logits = torch.randn(b, meta.query_len, vocab)
        for i, d in enumerate(drafts):
            for j, t in enumerate(d):
                if rng.random() < 0.7:
                    logits[i, j, t] = 100.0
        if rng.random() < 0.2:
            logits[rng.randrange(b), 0, rng.randrange(vocab)] = float("nan")
        fed = logits.reshape(-1, vocab)[meta.token_index]  # [T, V], as runner.verify gives
        target, accepted, _ = sample_and_accept(fed, meta)
        nan = torch.isnan(logits.amax(dim=-1)).any(dim=1)
        ref = fetch_step_results(accepted, nan, target)
        ref.target_ids = [[t if j < n else -1 for j, t in enumerate(row)]
                          for row, n in zip(ref.target_ids, meta.num_fed)]
        got = greedy_accept(fed, meta)
        assert got is not None
        assert got[1] == ref.has_nan
        ok = [i for i, bad in enumerate(ref.has_nan) if not bad]  # a NaN row ends in an error
        assert [got[0][i] for i in ok] == [ref.num_accepted[i] for i in ok]
        assert [got[2][i] for i in ok] == [ref.target_ids[i] for i in ok]
        seen["accepted"] += sum(ref.num_accepted)
        seen["nan"] += sum(ref.has_nan)
    assert seen["accepted"] > 100 and seen["nan"] > 10  # both cases were exercised
