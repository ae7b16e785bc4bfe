"""``--method auto`` sleeps where no drafting pays (``auto.policy``, "Dormancy"): after weighed
steps without a draft of ``IDLE_ROWS`` rows in all it weighs only every 2, 4, 8, then 16 steps,
wakes at once for a row that joins, learns while asleep, and a resume replays the steps slept
through as slept."""

from __future__ import annotations

import pytest

from specbatch.auto import policy as policy_mod
from specbatch.auto.candidate import ForwardingCandidate
from specbatch.auto.costmodel import CostModel
from specbatch.auto.policy import IDLE, IDLE_ROWS, SLEEP_FIRST, SLEEP_MAX
from tests.unit import test_auto_resume as resume
from tests.unit.test_planner import _policy, _select, _seq

NEVER_PAYS = CostModel((0.02, 0.02, 0.0, 0.0))  # a draft token costs a whole step
COPY = [1, 2, 3, 4, 5]


def _weighed_steps(policy, seqs_per_step, drafts, emitted):
    """Run ``len(seqs_per_step)`` steps (the rows of each, every row proposing ``drafts``
    and committing ``emitted``); returns the indices of the steps the policy weighed."""
    weighed, inner = [], policy._select_base
    step = [0]

    def spy(*a):
        weighed.append(step[0])
        return inner(*a)

    policy._select_base = spy
    for i, seqs in enumerate(seqs_per_step):
        step[0] = i
        chosen = _select(policy, seqs, [drafts] * len(seqs))
        for s, d in zip(seqs, chosen):
            policy.observe(s, emitted[:len(d) + 1])
    return weighed


def test_the_schedule_of_a_job_where_no_drafting_pays():
    policy, _ = _policy(NEVER_PAYS, 5, lambda s: [(1.0, 1.0)] * 5)
    rows = [_seq(i) for i in range(16)]
    weighed = _weighed_steps(policy, [rows] * 60, COPY, [7] * 6)
    # 4 weighed steps of 16 rows, then sleeps of 2, 4, 8, 16, 16 steps, one weighed after each
    assert IDLE_ROWS == 64 and SLEEP_FIRST == 2 and SLEEP_MAX == 16
    assert weighed == [0, 1, 2, 3, 6, 11, 20, 37, 54], weighed
    assert policy.steps_by_proposer[1]["none"] == 60
    assert policy.decisions[:2] == [((0,), IDLE, 0), ((1,), IDLE, 0)]  # step 59 was slept
    # one row: 64 weighed steps before the first sleep
    policy, _ = _policy(NEVER_PAYS, 5, lambda s: [(1.0, 1.0)] * 5)
    weighed = _weighed_steps(policy, [[_seq(1)]] * 70, COPY, [7] * 6)
    assert weighed == list(range(64)) + [66], weighed  # then asleep for steps 67-70


def test_a_row_that_joins_wakes_the_policy():
    policy, _ = _policy(NEVER_PAYS, 5, lambda s: [(1.0, 1.0)] * 5)
    rows = [_seq(i) for i in range(16)]
    steps = [rows] * 12 + [rows + [_seq(99)]] * 3
    weighed = _weighed_steps(policy, steps, COPY, [7] * 6)
    assert weighed == [0, 1, 2, 3, 6, 11, 12], weighed  # step 12: row 99 joined mid-sleep
    # it weighed idle again: the next sleep in the doubling (16 steps) began, 2 slept since
    assert policy.sleep.left == SLEEP_MAX - 2


def test_a_row_that_starts_copying_is_drafted_for_after_the_sleep():
    # a draft token costs 10% of a step: drafting pays once drafts are accepted
    policy, _ = _policy(CostModel((0.02, 0.002, 0.0, 0.0)), 5, lambda s: [(1.0, 9.0)] * 5)
    row = _seq(1)
    novel = _weighed_steps(policy, [[row]] * 90, COPY, [7] * 6)
    assert novel == list(range(64)) + [66, 71, 80], novel  # asleep for steps 81-96
    lens = []
    for _ in range(SLEEP_MAX + 4):  # the text copies now: the base's first position is
        chosen = _select(policy, [row], [COPY])[0]  # scored every step, asleep or not
        lens.append(len(chosen))
        policy.observe(row, COPY[:len(chosen)] + [COPY[len(chosen)]] if len(chosen) < 5
                       else COPY + [9])
    first = next(i for i, n in enumerate(lens) if n)
    assert first <= SLEEP_MAX and all(lens[first:]), lens  # then awake every step
    assert lens[-1] == 5, lens


@pytest.mark.parametrize(("base_idle", "token_cost"),
                         [(policy_mod.BASE_IDLE_STEPS, 0.005), (10 ** 6, 0.010)])
def test_a_resume_replays_the_steps_slept_through(tmp_path, monkeypatch, base_idle, token_cost):
    """Two jobs: where a draft token costs half a step and the base never sleeps, the policy
    sleeps between drafting stretches; where a draft token costs a quarter of a step, suffix
    drafts long enough stretches for the base to sleep. Killed after 5 answers and resumed
    from the journal, every other answer and the policy's state are the uninterrupted run's."""
    true = CostModel((0.020, token_cost, 0.0, 0.0))
    monkeypatch.setattr(policy_mod, "IDLE_ROWS", 16)  # 4 idle steps of this job's 4 rows
    monkeypatch.setattr(policy_mod, "BASE_IDLE_STEPS", base_idle)
    slept, select = [], policy_mod.AdaptivePolicy.select

    def spy(self, *a, **kw):
        out = select(self, *a, **kw)
        slept.append(self.base_sleep.left)
        return out

    monkeypatch.setattr(policy_mod.AdaptivePolicy, "select", spy)
    monkeypatch.setattr(resume, "COST", CostModel(true.coef, samples=tuple(
        (r, q, 300, true.step_time(r, q, 300)) for r in (1, 4) for q in (1, 3, 5))))
    model = resume.tiny_llama(resume.VOCAB, seed=5)
    _, policy1, full = resume._run(model, 4, tmp_path / "j.jsonl", 5, tmp_path / "kept.jsonl")
    kept = (tmp_path / "kept.jsonl").read_text()
    if base_idle == 10 ** 6:
        assert f'"{IDLE}"' in kept and '"suffix"' in kept, kept[:400]
    else:  # the base slept
        assert max(slept) > 0
    _, policy2, resumed = resume._resume(model, 4, tmp_path / "kept.jsonl", full[:5])
    assert policy2.forced_mismatches == 0
    want = {c.request.request_id: c for c in full}
    for c in resumed:
        assert c.output_ids == want[c.request.request_id].output_ids
        assert c.stats.to_dict() == want[c.request.request_id].stats.to_dict()
        assert policy2.steps_by_proposer[c.request.tag] == \
            policy1.steps_by_proposer[c.request.tag]
    assert policy2.state() == policy1.state()
    if base_idle != 10 ** 6:
        return
    # replaying the slept steps as weighed ones decays the suffix pool once more per step
    monkeypatch.setattr(policy_mod, "IDLE", "not idle")
    _, policy3, _ = resume._resume(model, 4, tmp_path / "kept.jsonl", full[:5])
    assert policy3.state() != policy1.state()


class _Sure(ForwardingCandidate):
    """Another candidate whose 3-token draft is always accepted (reach 1.0); drafting is free
    (``ForwardingCandidate``'s defaults), and no proposer stands behind it."""

    name = "sure"
    hysteresis = False

    def prepare(self, seqs, caps):
        return [3] * len(seqs)

    def reach(self, seqs, lengths):
        return [[1.0] * n for n in lengths]

    def drafts(self, seqs, lengths, ctx):
        return [[5] * n for n in lengths]


def _base_weighed(policy, seqs_per_step, lookup_draft):
    """Steps (indices) whose base proposals the policy weighed (``LookupCandidate.reach``)."""
    weighed, inner, step = [], policy.lookup.reach, [0]

    def spy(*a):
        weighed.append(step[0])
        return inner(*a)

    policy.lookup.reach = spy
    for i, seqs in enumerate(seqs_per_step):
        step[0] = i
        chosen = _select(policy, seqs, [lookup_draft] * len(seqs))
        for s, d in zip(seqs, chosen):
            policy.observe(s, d + [9])
    return weighed


def test_the_base_sleeps_while_another_candidate_takes_the_rows():
    """Lookup drafts that are never accepted beside another candidate's sure ones: after
    ``BASE_IDLE_STEPS`` weighed steps the base is weighed every 2, 4, 8, then 16 steps (the
    other candidate drafts every step), its first position is still scored every step, and
    a row that joins wakes it."""
    from specbatch.auto.policy import AdaptivePolicy, BASE_IDLE_STEPS
    from tests.unit.test_planner import _Given
    from specbatch.auto.candidate import LookupCandidate

    def build():
        lookup = LookupCandidate(_Given(), 5, lambda s: [(1.0, 9.0)] * 5)
        return AdaptivePolicy(CostModel((0.02, 0.002, 0.0, 0.0)), 5, lookup, [_Sure()])

    policy = build()
    rows = [_seq(i) for i in range(4)]
    weighed = _base_weighed(policy, [rows] * 40, [7, 7, 7])
    assert BASE_IDLE_STEPS == 4
    assert weighed == [0, 1, 2, 3, 6, 11, 20, 37], weighed
    assert policy.steps_by_proposer[1] == {"sure": 40}
    assert policy.lookup.rows[1].trials[0] > 5  # scored in every step, 40 decayed by 0.9
    state = policy.state()
    assert state["base_sleep"] == [BASE_IDLE_STEPS + 4, SLEEP_MAX, SLEEP_MAX - 2]
    again = build()
    again.set_state(state)
    assert again.state() == state
    # a row that joins mid-sleep wakes the base for that step
    policy = build()
    weighed = _base_weighed(policy, [rows] * 12 + [rows + [_seq(99)]] * 2, [7, 7, 7])
    assert weighed == [0, 1, 2, 3, 6, 11, 12], weighed
    # a base whose drafts are verified is weighed every step
    policy = build()
    policy.others = []
    assert _base_weighed(policy, [rows] * 10, [9, 9, 9]) == list(range(10))
