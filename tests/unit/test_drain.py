"""The drain (``auto.policy``, "The drain"): once no request waits for a row, a row that
finishes early frees its row for nothing, so auto values an accepted draft token at a row's
share of a step, not at the step's cost per token. The engine says when the job drains
(``Engine.draining``) to a proposer that ``sees_drain``."""

from __future__ import annotations

import pytest

from specbatch.auto.costmodel import CostModel
from specbatch.config import SamplingParams
from specbatch.engine.engine import Engine
from specbatch.engine.runner import ModelRunner
from specbatch.engine.sequence import Request, StopRules
from specbatch.models.llama import LlamaForward
from specbatch.spec_decode.proposer import Proposer
from tests.helpers import tiny_llama
from tests.unit.test_planner import _policy, _seq

# 20 ms a step and 2 ms a token: a plain step of 16 rows costs 52 ms, 3.25 ms a token, while
# one row more or less changes it by 2 ms
LINEAR = CostModel((0.02, 0.002, 0.0, 0.0))
COPY = [1, 2, 3, 4, 5]


def _choose(draining: bool, rows: int, proposing: int | None = None) -> list[list[int]]:
    """A fresh policy's drafts for ``rows`` rows, the first ``proposing`` of them (default
    all) proposing ``COPY`` with every position accepted with chance 0.8 (a Beta(8, 2) prior),
    the others nothing, the job draining or not."""
    policy, given = _policy(LINEAR, 5, lambda s: [(8.0, 2.0)] * 5)
    proposing = rows if proposing is None else proposing
    given.drafts = [COPY] * proposing + [[]] * (rows - proposing)
    return policy.select([_seq(i) for i in range(rows)], [5] * rows, draining=draining)


def test_a_draft_token_is_worth_a_row_share_while_the_job_drains():
    # queue: a token is worth 3.25 ms of the step against 2 ms to verify it: the rows that
    # propose draft
    queue = _choose(False, 16, proposing=4)
    assert all(queue[:4]) and not any(queue[4:]), queue
    # drain, 4 of 16 rows drafting: the job ends with the others; a row's share of a step is
    # 2 ms, what verifying a token costs, so no draft pays
    assert _choose(True, 16, proposing=4) == [[]] * 16
    # drain, every row drafting: the last rows finish sooner too and the 20 ms of every step
    # shrink with the slowest row's progress: drafting pays
    dense = _choose(True, 16)
    assert all(dense), dense
    # one row: its steps are the job's, so the drain prices as the queue does
    assert _choose(True, 1) == _choose(False, 1) != [[]]


def test_the_drain_leaves_each_row_the_mean_cost_of_a_row():
    """``_drain``: the step price less S, shared by R rows, is ``(t(R) - t(1)) /
    (R - 1)``; a tiled fit's uneven steps (a tile every 4 tokens) averaged so."""
    tiled = CostModel((0.004, 0.001, 2e-7, 0.0, 0.0044, 0.0), tiled=True, tile_tokens=4)
    for cost in (LINEAR, tiled):
        policy, _ = _policy(cost, 5, lambda s: [(8.0, 2.0)] * 5)
        for rows in (2, 5, 16):
            t = [cost.step_time(r, 1, 300.0) for r in (1, rows)]
            sink, bonus = policy._drain(rows, 300.0)
            assert 0 < sink < t[1]
            assert (t[1] - sink) / rows == pytest.approx((t[1] - t[0]) / (rows - 1))
            assert bonus == pytest.approx(sink / ((t[1] - t[0]) / (rows - 1)))
        assert policy._drain(1, 300.0) == (0.0, 0.0)
    assert _policy(LINEAR, 5, lambda s: [])[0]._drain(16, 0.0) == pytest.approx((0.02, 10.0))


class _Spy(Proposer):
    """Drafts nothing; logs each step's rows (request ids) and what the engine said of the
    drain."""

    name = "spy"
    sees_drain = True

    def __init__(self) -> None:
        self.log: list[tuple[list, bool]] = []

    def start(self, seq) -> None:
        pass

    def propose(self, seqs, ks, draining=False):
        self.log.append((sorted(s.request.request_id for s in seqs), draining))
        return [[] for _ in seqs]

    def on_commit(self, seq, num_new_tokens: int) -> None:
        pass

    def finish(self, seq) -> None:
        pass


def test_the_engine_says_when_the_job_drains():
    """2 rows, 3 requests: draining only once the third has a row; a record with a later turn
    keeps the job from draining until that turn is queued."""
    model = LlamaForward(tiny_llama(64, seed=3))
    spy = _Spy()
    engine = Engine(ModelRunner(model, 2, 64, initial_capacity=16), spy,
                    StopRules(frozenset(), 64), 2)
    reqs = [Request(i, [5, 6, 7, 8], SamplingParams(max_tokens=n))
            for i, n in enumerate((3, 8, 4))]
    list(engine.generate(reqs))
    third = next(i for i, (rows, _) in enumerate(spy.log) if 2 in rows)
    assert third > 0
    assert [d for _, d in spy.log] == [False] * third + [True] * (len(spy.log) - third)

    # request 0 has a second turn (follow_ups=1): no drain while its first turn runs
    spy.log.clear()
    engine = Engine(ModelRunner(model, 2, 64, initial_capacity=16), spy,
                    StopRules(frozenset(), 64), 2)
    reqs = [Request(0, [5, 6, 7, 8], SamplingParams(max_tokens=3), follow_ups=1),
            Request(1, [5, 6, 7], SamplingParams(max_tokens=12))]

    def follow_up(c):
        if not c.request.follow_ups:
            return None
        return Request(10, c.request.prompt_ids + c.output_ids + [9],
                       SamplingParams(max_tokens=3), follow_ups=c.request.follow_ups - 1)

    list(engine.generate(reqs, follow_up=follow_up))
    turn2 = next(i for i, (rows, _) in enumerate(spy.log) if 10 in rows)
    assert [d for _, d in spy.log] == [False] * turn2 + [True] * (len(spy.log) - turn2)
