"""``--method auto`` while the job drains (``auto.policy``, ``AdaptivePolicy._worth``): with no
request waiting for a row, a row that finishes before the job's end anyway drafts only what
its own share of later steps pays for; the rows that set the end draft as before."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specbatch.auto.costmodel import CostModel
from tests.unit.test_planner import _policy

# 10 ms a step plus 0.5 ms a token: plain decoding of 2 rows costs 11 ms, 5.5 ms a token, and
# a row that leaves saves 0.5 ms of every later step
COST = CostModel((0.010, 0.0005, 0.0, 0.0))
DRAFT = [1, 2, 3, 4, 5]


def _row(seq_id: int, left: int, accepted: int = 0, steps: int = 1, later: int = 0):
    """A row with ``left`` tokens to its max_tokens (128) after ``steps`` steps in which its
    drafts had ``accepted`` tokens accepted; ``later``: its record's later turns' tokens."""
    return SimpleNamespace(
        seq_id=seq_id, token_ids=[0] * 100, num_output_tokens=128 - left,
        sampling=SimpleNamespace(max_tokens=128),
        stats=SimpleNamespace(num_accepted_tokens=accepted, num_steps=steps),
        request=SimpleNamespace(tag=seq_id, later_tokens=later))


def _drafted(rows, num_waiting):
    """Draft tokens each row gets from a fresh policy (every position's prior 0.6)."""
    policy, given = _policy(COST, 5, lambda s: [(6.0, 4.0)] * 5)
    given.drafts = [DRAFT] * len(rows)
    chosen = policy.select(rows, [5] * len(rows), num_waiting=num_waiting)
    return [len(d) for d in chosen], policy


def test_a_row_ahead_of_the_end_drafts_only_what_its_own_share_pays():
    # row 0 copies (40 tokens accepted in 20 steps: 2.67 tokens a step, 50 left: done in ~19
    # steps at that pace, 50 at one a step); row 1 is novel with 60 left: the job ends in ~60
    # steps whatever row 0 does
    ahead, novel = _row(0, 50, accepted=40, steps=21), _row(1, 60, steps=21)
    waiting, policy = _drafted([ahead, novel], num_waiting=3)
    assert policy._w is None  # requests wait: every token is worth a step's share
    # 3 positions each (reach 0.6, 0.36, 0.22): 4.35 tokens in 14 ms, where a draft token's
    # 0.5 ms is worth 0.155 tokens, more than the 4th position's 0.13
    assert waiting == [3, 3]
    drained, policy = _drafted([ahead, novel], num_waiting=0)
    # row 0's token saves 0.5 ms of a later step: worth 0.5 / 5.5 of a plain token, less than
    # any draft token costs; row 1 sets the end and keeps the full worth, and drafting alone
    # its 4th position pays (3.31 tokens in 13 ms: a draft token is worth 0.127 tokens)
    assert policy._w == pytest.approx([0.5 / 5.5, 1.0])
    assert drained == [0, 4]
    assert _drafted([ahead, novel], num_waiting=None)[0] == waiting  # not known: as waiting


def test_rows_that_set_the_end_together_draft_as_when_requests_wait():
    # both copy at 2.67 tokens a step: the job ends when the one with more left does (~22
    # steps), before either would at one token a step, so both set the end
    rows = [_row(0, 50, accepted=40, steps=21), _row(1, 60, accepted=40, steps=21)]
    drained, policy = _drafted(rows, num_waiting=0)
    assert policy._w is None and drained == [3, 3]
    # a record's later turns are work its row still brings: the row is not ahead
    ahead = _row(0, 50, accepted=40, steps=21, later=128)
    drained, policy = _drafted([ahead, _row(1, 60, steps=21)], num_waiting=0)
    assert policy._w == pytest.approx([1.0, 0.5 / 5.5]) and drained == [4, 0]


def test_a_fresh_job_sets_its_end_from_every_row():
    # the first steps: no row has accepted a draft yet, every row has max_tokens left
    rows = [_row(i, 128) for i in range(4)]
    drained, policy = _drafted(rows, num_waiting=0)
    assert policy._w is None and drained == [2, 2, 2, 2]  # 4 rows: 7.84 tokens in 16 ms


def test_the_engine_tells_auto_how_many_requests_wait():
    from specbatch.auto.candidate import LookupCandidate
    from specbatch.auto.policy import AdaptivePolicy
    from specbatch.auto.proposer import AutoProposer
    from specbatch.config import SamplingParams
    from specbatch.engine.engine import Engine
    from specbatch.engine.runner import ModelRunner
    from specbatch.engine.sequence import Request, StopRules
    from specbatch.models.llama import LlamaForward
    from specbatch.spec_decode.ngram import NgramProposer
    from tests.helpers import repeating_prompts, tiny_llama

    lookup = LookupCandidate(NgramProposer(2, 4), 4, lambda s: [(1.0, 1.0)] * 4,
                             match_len=False)
    policy = AdaptivePolicy(COST, 4, lookup)
    engine = Engine(ModelRunner(LlamaForward(tiny_llama(64)), 2, 256, initial_capacity=16),
                    AutoProposer([("ngram", lookup.proposer)], policy), StopRules(frozenset(), 256),
                    4)
    seen, select = [], policy.select

    def spy(seqs, caps, num_rows=None, num_waiting=None):
        seen.append((len(seqs), num_waiting))
        return select(seqs, caps, num_rows, num_waiting=num_waiting)

    policy.select = spy
    sampling = [SamplingParams(max_tokens=n) for n in (6, 12, 12)]  # record 0 ends first
    list(engine.generate([Request(i, list(p), s, seed=i, tag=i) for i, (p, s)
                          in enumerate(zip(repeating_prompts(64, 3), sampling))]))
    assert seen[0] == (2, 1)  # two rows run, the third record waits
    assert seen[-1][1] == 0 and (2, 0) in seen  # it took record 0's row: nothing waits


def test_a_turn_knows_the_tokens_its_record_s_later_turns_may_bring():
    from specbatch.pipeline import _later_tokens

    three = SimpleNamespace(turns=["a", "b", "c"], sampling=SimpleNamespace(max_tokens=64))
    assert [_later_tokens(three, t) for t in range(3)] == [128, 64, 0]
    one = SimpleNamespace(turns=None, sampling=SimpleNamespace(max_tokens=64))
    assert _later_tokens(one, 0) == 0
