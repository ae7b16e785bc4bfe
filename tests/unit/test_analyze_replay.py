"""What-if replay is exact: replaying a greedy n-gram run from its prompt and output ids with the
run's own (k, min, max) gives the recorded ``SpecStats`` of every record, whatever ended it
(EOS, max_tokens, the context, a stop string) and whatever its per-record max_tokens."""

from __future__ import annotations

import pytest

from specbatch.config import SamplingParams
from specbatch.spec_decode.caps import draft_cap
from specbatch.spec_decode.replay import NgramReplay, replay_ngram
from tests.helpers import repeating_prompts, run_engine, tiny_llama

VOCAB = 48
NUM_PROMPTS = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=11)


@pytest.fixture(scope="module")
def prompts():
    return repeating_prompts(VOCAB, NUM_PROMPTS, seed=3, min_len=4, max_len=40)


@pytest.fixture(scope="module")
def eos_id(model, prompts):
    """A token that ends about half of the plain outputs early, so both EOS and max_tokens
    endings are replayed."""
    base = run_engine(model, prompts, 0, 8, SamplingParams(max_tokens=40))
    seen = {t: sum(t in c.output_ids[:-1] for c in base) for t in range(VOCAB)}
    return min(seen, key=lambda t: abs(seen[t] - NUM_PROMPTS // 2))


def _detok(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


CASES = {  # name: (k, (min, max), batch size, max_model_len, stop strings)
    "k5-1to3": (5, (1, 3), 8, 256, ()),
    "k1-2to4": (1, (2, 4), 4, 256, ()),
    "k8-1to1": (8, (1, 1), 16, 256, ()),
    "k3-context-cap": (3, (1, 3), 8, 48, ()),
    "k4-stop-strings": (4, (2, 3), 8, 256, ("ab", "zz", "qd")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_recorded_stats(model, prompts, eos_id, case):
    k, (lo, hi), batch_size, max_model_len, stop = CASES[case]
    # per-record max_tokens, tiny ones included (1: finished at prefill; 2: one capped step)
    sampling = [SamplingParams(max_tokens=[1, 2, 3, 17, 40][i % 5], stop=stop)
                for i in range(NUM_PROMPTS)]
    out = run_engine(model, prompts, k, batch_size, sampling, eos_ids=(eos_id,),
                     max_model_len=max_model_len, prompt_lookup=(lo, hi), detokenize=_detok)
    reasons = {(c.finish_reason, str(c.stop_reason)) for c in out}
    assert ("stop", str(eos_id)) in reasons and ("length", "None") in reasons
    if stop:
        assert any(isinstance(c.stop_reason, str) for c in out)
    assert sum(c.stats.num_accepted_tokens for c in out) > 0
    assert sum(c.stats.num_draft_tokens - c.stats.num_accepted_tokens for c in out) > 0
    for c, sp in zip(out, sampling):
        got = replay_ngram(c.prompt_ids, c.output_ids, k, lo, hi, sp.max_tokens, max_model_len)
        assert got.to_dict() == c.stats.to_dict(), (c.request.request_id, c.finish_reason)


def test_replay_table_serves_every_k(model, prompts, eos_id):
    """One ``NgramReplay`` at max_k = 8 gives, for each k, what a run at that k recorded."""
    sp = SamplingParams(max_tokens=30)
    replays = None
    for k in (1, 2, 6):
        out = run_engine(model, prompts[:12], k, 8, sp, eos_ids=(eos_id,), prompt_lookup=(1, 3))
        if replays is None:
            replays = [NgramReplay(c.prompt_ids, c.output_ids, 1, 3, 8) for c in out]
        for c, r in zip(out, replays):
            assert r.stats(k, 30, 256).to_dict() == c.stats.to_dict()


def test_replay_worked_example():
    """Prompt ``1 2 3 9 1 2``, output ``3 4 5 6``, k = 3, min = max = 2: after the prefill
    token 3 the suffix ``2 3`` matched before, drafting ``9 1 2``; 9 is rejected (4 recovered).
    Then ``3 4`` is new: no draft, 5 committed; ``4 5`` new: no draft, 6 committed (the end)."""
    s = replay_ngram([1, 2, 3, 9, 1, 2], [3, 4, 5, 6], 3, 2, 2, max_tokens=10, max_model_len=99)
    assert (s.num_steps, s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (4, 1, 3, 0)
    assert s.k_histogram == {3: 1, 0: 2}
    # the same output with the draft accepted twice: 9 1 then bonus 2; cap at max_tokens = 4
    s = replay_ngram([1, 2, 3, 9, 1, 2], [3, 9, 1, 2], 3, 2, 2, max_tokens=4, max_model_len=99)
    assert s.k_histogram == {2: 1} and s.num_accepted_tokens_per_pos == [1, 1]
    assert s.num_steps == 2


def test_draft_cap():
    assert draft_cap(5, 10, 7, 100, 50) == 2
    assert draft_cap(5, 10, 9, 100, 50) == 0
    assert draft_cap(5, 100, 7, 52, 50) == 1
    assert draft_cap(5, 100, 7, 1000, 50) == 5
