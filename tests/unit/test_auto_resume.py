"""``--method auto`` resumes to the stats of an uninterrupted run: no time measured while a job
runs enters a decision (the cost models are the job's fixed fits), and a resumed job replays
the decision journal (``auto.journal``) for the rows that ran beside records finished before
the kill (placeholders now, ``sequence.Replay``), then continues from the pooled state the
interrupted run had there. Tiny random model (tests.helpers), lookup + suffix candidates."""

from __future__ import annotations

import shutil

import pytest

from specbatch.auto.candidate import Setup
from specbatch.auto.costmodel import CostModel
from specbatch.auto.journal import DecisionJournal
from specbatch.auto.policy import AdaptivePolicy
from specbatch.config import SamplingParams, SpecConfig
from specbatch.engine.sequence import Replay, Request
from specbatch.spec_decode import make_proposer
from tests.helpers import make_engine, repeating_prompts, run_engine, tiny_llama

VOCAB = 48
K = 4
# drafting pays only where acceptance is high: the step cap and the cuts depend on the rows;
# a calibrated fit (with samples), as a job's
_TRUE = CostModel((0.020, 0.0020, 0.0, 0.0))
COST = CostModel(_TRUE.coef, samples=tuple((r, q, 300, _TRUE.step_time(r, q, 300))
                                           for r in (1, 4) for q in (1, 3, 5)))
GREEDY = SamplingParams(max_tokens=16)


def _prior(seq):
    a = 0.25 + 0.15 * (seq.request.tag % 4)
    return [(a * 4, (1 - a) * 4)] * K


DRAFT_COST = CostModel((0.002, 0.0004, 0.0, 0.0))  # a draft forward: a tenth of a step


def _auto_engine(model, batch_size: int, draft=None, prefill_budget=None):
    """An engine with auto's proposer (lookup + suffix, and the draft model ``draft`` when
    given) and policy, as ``llm.prepare`` builds it; returns (engine, policy)."""
    from specbatch.models.llama import LlamaForward

    config = SpecConfig(method="auto", num_speculative_tokens=K)
    engine = make_engine(model, K, batch_size)
    if prefill_budget is not None:  # prompt tokens per prefill forward
        engine.runner.max_prefill_tokens = prefill_budget
    engine.proposer = make_proposer(config, LlamaForward(draft) if draft else None, batch_size)
    engine.k = config.draft_cap
    lookup, *others = engine.proposer.build_candidates(
        Setup(K, _prior, draft_cost=DRAFT_COST if draft else None))
    policy = AdaptivePolicy(COST, K, lookup, others)
    engine.proposer.use(policy)
    return engine, policy


def _job():
    prompts = repeating_prompts(VOCAB, 12, seed=7)
    prompts += [p[:7] for p in prompts[:6]]
    sampling = [SamplingParams(max_tokens=6 + (i * 7) % 23) for i in range(len(prompts))]
    return prompts, sampling


def _requests(prompts, sampling):
    return [Request((i, 0, 0), p, sp, seed=i, tag=i)
            for i, (p, sp) in enumerate(zip(prompts, sampling))]


def _run(model, batch_size, journal_path, cut=None, kept=None, draft=None, prefill_budget=None):
    """Run the job with a journal, flushing it before each finished answer is "written" (as
    ``specbatch run`` does); with ``cut``, the journal file as it was right after the
    ``cut``-th answer was written is copied to ``kept`` (a kill there). Returns (engine,
    policy, completions in finish order)."""
    prompts, sampling = _job()
    engine, policy = _auto_engine(model, batch_size, draft, prefill_budget)
    journal = DecisionJournal(journal_path, resume=False, done=set())
    journal.attach(policy)
    engine.proposer.journal = journal
    out = []
    for c in engine.generate(_requests(prompts, sampling)):
        journal.flush()
        out.append(c)
        journal.written(c.request.tag)
        if cut is not None and len(out) == cut:
            shutil.copy(journal_path, kept)
    journal.close()
    return engine, policy, out


def _resume(model, batch_size, journal_path, done: list, use_journal: bool = True,
            draft=None, prefill_budget=None):
    """The job again with the answers ``done`` as placeholders (a resume), replaying the
    journal at ``journal_path`` unless not ``use_journal``."""
    prompts, sampling = _job()
    engine, policy = _auto_engine(model, batch_size, draft, prefill_budget)
    finished = {c.request.request_id: c for c in done}
    reqs = _requests(prompts, sampling)
    for r in reqs:
        if (c := finished.get(r.request_id)) is not None:
            s = c.schedule
            r.replay = Replay(s["admit"], s["verify"], s["finish"], s["row"], s["phase"],
                              c.output_ids, c.finish_reason)
    journal = None
    if use_journal:
        journal = DecisionJournal(journal_path, resume=True,
                                  done={c.request.tag for c in done})
        journal.attach(policy)
        engine.proposer.journal = journal
    out = []
    for c in engine.generate(reqs):
        if journal is not None:
            journal.flush()
            journal.written(c.request.tag)
        out.append(c)
    return engine, policy, out


@pytest.mark.parametrize("batch_size,cut,budget", [(4, 5, None), (3, 2, None), (5, 9, None),
                                                   (5, 3, 24), (4, 6, 30)])
def test_a_resumed_auto_job_decides_as_the_uninterrupted_one(tmp_path, batch_size, cut,
                                                             budget):
    """Kill after ``cut`` answers are written, resume with them as placeholders and the
    journal: every other answer has the stats (steps, draft tokens, k histogram), schedule
    and steps per source of the uninterrupted run, not only its tokens. ``budget``: prompt
    tokens per prefill forward, so small that the prompts admitted together take several
    prefill steps: a placeholder needs no prefill, and until it was charged its prompt's
    budget the real prompts beside it prefilled steps earlier than in the run they resume
    (the extraction recipe at batch 16: 22 auto and 5 suffix records' counters differed)."""
    model = tiny_llama(VOCAB, seed=5)
    first, policy1, full = _run(model, batch_size, tmp_path / "j.jsonl", cut,
                                tmp_path / "kept.jsonl", prefill_budget=budget)
    assert len({c.schedule["finish"] for c in full}) > 3  # answers finish at different steps
    if budget is not None:  # some prefill took more than one step
        assert any(c.schedule["verify"] is not None
                   and c.schedule["verify"] > c.schedule["admit"] + 1 for c in full)
    second, policy2, resumed = _resume(model, batch_size, tmp_path / "kept.jsonl", full[:cut],
                                       prefill_budget=budget)
    assert second.replay_mismatches == 0 and policy2.forced_mismatches == 0
    rest = {c.request.request_id: c for c in full[cut:]}
    assert sorted(c.request.request_id for c in resumed) == sorted(rest)
    assert sum(c.stats.num_draft_tokens for c in resumed) > 0
    for c in resumed:
        want = rest[c.request.request_id]
        assert c.output_ids == want.output_ids
        assert c.stats.to_dict() == want.stats.to_dict(), c.request.request_id
        assert c.schedule == want.schedule
        assert policy2.steps_by_proposer[c.request.tag] == \
            policy1.steps_by_proposer[c.request.tag]
    used = {src for c in policy1.steps_by_proposer.values() for src in c}
    assert {"ngram", "none"} <= used, used
    assert second.step_index == first.step_index
    assert policy2.state() == policy1.state()


def test_a_resumed_auto_job_with_a_draft_model_decides_alike(tmp_path):
    """The same with a draft model among the candidates (its pooled acceptance and whether it
    is in use are restored; its drafts come from a forward over the rows it drafts for)."""
    from tests.unit.test_draft import perturbed

    model = tiny_llama(VOCAB, seed=5)
    draft = perturbed(model, 0.05, seed=9)
    _, policy1, full = _run(model, 4, tmp_path / "j.jsonl", 6, tmp_path / "kept.jsonl", draft)
    assert any("draft" in c for c in policy1.steps_by_proposer.values())
    _, policy2, resumed = _resume(model, 4, tmp_path / "kept.jsonl", full[:6], draft=draft)
    assert policy2.forced_mismatches == 0
    want = {c.request.request_id: c for c in full}
    for c in resumed:
        assert c.output_ids == want[c.request.request_id].output_ids
        assert c.stats.to_dict() == want[c.request.request_id].stats.to_dict()
    assert policy2.state() == policy1.state()


def test_the_journal_is_what_makes_the_resume_exact(tmp_path):
    """The premise (fails without the journal): the same resume, the policy left to decide
    the in-flight rows beside placeholders, changes some answer's stats (outputs never)."""
    model = tiny_llama(VOCAB, seed=5)
    _, _, full = _run(model, 4, tmp_path / "j.jsonl", 5, tmp_path / "kept.jsonl")
    _, _, resumed = _resume(model, 4, tmp_path / "kept.jsonl", full[:5], use_journal=False)
    want = {c.request.request_id: c for c in full}
    assert all(c.output_ids == want[c.request.request_id].output_ids for c in resumed)
    assert any(c.stats.to_dict() != want[c.request.request_id].stats.to_dict()
               for c in resumed)


# what a step is reported to take (seconds) from its rows' drafts, and a suffix lookup's clock
# tick: drafting looks dear, free, or as the tiny model's real step
CLOCKS = [lambda drafts, seconds: seconds,
          lambda drafts, seconds: 0.2 + 0.05 * sum(len(d) for d in drafts),
          lambda drafts, seconds: 0.001]


def test_two_runs_decide_alike_whatever_the_clock():
    """No time measured while a job runs enters a decision: steps reported to take their real
    time, much longer the more is drafted, or nearly nothing, give the same drafts (before,
    the online refit of the step cost and the suffix lookup's measured seconds moved them: two
    runs of a job differed)."""
    model = tiny_llama(VOCAB, seed=5)
    prompts, sampling = _job()
    runs = []
    for step_seconds in CLOCKS:
        engine, policy = _auto_engine(model, 4)
        on_verify = engine.proposer.on_verify

        def slowed(seqs, drafts, seconds, on_verify=on_verify, step_seconds=step_seconds):
            on_verify(seqs, drafts, step_seconds(drafts, seconds))

        engine.proposer.on_verify = slowed
        out = sorted(engine.generate(_requests(prompts, sampling)),
                     key=lambda c: c.request.request_id)
        runs.append([c.stats.to_dict() for c in out])
    assert runs[0] == runs[1] == runs[2]


def test_auto_outputs_equal_plain_decoding_after_a_resume(tmp_path):
    model = tiny_llama(VOCAB, seed=5)
    prompts, sampling = _job()
    base = run_engine(model, prompts, 0, 1, sampling)
    _, _, full = _run(model, 4, tmp_path / "j.jsonl", 6, tmp_path / "kept.jsonl")
    _, _, resumed = _resume(model, 4, tmp_path / "kept.jsonl", full[:6])
    got = {c.request.tag: c.output_ids for c in full[:6] + resumed}
    assert [got[i] for i in range(len(prompts))] == [b.output_ids for b in base]


def test_a_resume_is_exact_from_a_compacted_journal_cut_short(tmp_path, monkeypatch):
    """With a small compaction threshold (the file rewritten as records are written) and a
    kill inside an append (a truncated last line, ignored when read back), the resume is
    still exact."""
    from specbatch.auto import journal as journal_mod

    model = tiny_llama(VOCAB, seed=5)
    _, _, whole = _run(model, 4, tmp_path / "w.jsonl", 8, tmp_path / "whole.jsonl")
    monkeypatch.setattr(journal_mod, "COMPACT_BYTES", 2000)
    _, _, full = _run(model, 4, tmp_path / "j.jsonl", 8, tmp_path / "kept.jsonl")
    assert [c.stats.to_dict() for c in full] == [c.stats.to_dict() for c in whole]
    kept = tmp_path / "kept.jsonl"
    lines = kept.read_bytes().splitlines()
    assert b'"state"' in lines[-1]
    with open(kept, "ab") as f:  # a kill inside an append
        f.write(b'{"rows":[[3,0,0,"ngram",2]')
    _, policy2, resumed = _resume(model, 4, kept, full[:8])
    assert policy2.forced_mismatches == 0
    want = {c.request.request_id: c for c in full}
    for c in resumed:
        assert c.stats.to_dict() == want[c.request.request_id].stats.to_dict()


class _Policy:
    """What the journal reads of a policy: its last step's choices and its state."""

    replaying = False

    def __init__(self):
        self.decisions, self.k = [], 0

    def state(self):
        return {"current_k": self.k, "using": {}, "candidates": {}}

    def force(self, decisions, state):
        self.forced = (decisions, state)


def test_the_journal_keeps_only_the_steps_a_resume_needs(tmp_path, monkeypatch):
    """Records 0..39 run 4 at a time, each 10 steps; record r is written when it ends. Past
    ``COMPACT_BYTES`` the file is rewritten from the first step of the oldest record not
    written yet, so it stays small; read back, it gives every step of the records in flight
    and the state of the last append."""
    from specbatch.auto import journal as journal_mod

    monkeypatch.setattr(journal_mod, "COMPACT_BYTES", 3000)
    path = tmp_path / "j.jsonl"
    journal = DecisionJournal(path, resume=False, done=set())
    policy = _Policy()
    journal.attach(policy)
    running, steps_of, sizes, next_id = [0, 1, 2, 3], {}, [], 4
    for step in range(100):
        policy.k = step
        policy.decisions = [((r, 0, 0), "ngram", (r + step) % 4) for r in running]
        for r in running:
            steps_of.setdefault(r, []).append(("ngram", (r + step) % 4))
        journal.step(policy)
        for r in list(running):
            if len(steps_of[r]) == 10 + r % 3:  # finished: flushed, then written
                journal.flush()
                journal.written(r)
                running.remove(r)
                running.append(next_id)
                next_id += 1
        sizes.append(path.stat().st_size)
    journal.flush()
    assert max(sizes) < 2 * 3000 + 2000 and sizes[-1] < 3000 + 2000
    done = set(steps_of) - set(running)
    again = DecisionJournal(path, resume=True, done=done)
    assert again.state == {"current_k": 99, "using": {}, "candidates": {}}
    assert dict(again.decisions) == {(r, 0, 0): steps_of[r] for r in running}


def test_a_corrupt_journal_line_is_one_line_error(tmp_path):
    path = tmp_path / "j.jsonl"
    path.write_bytes(b'{"rows":[[1,0,0,"ngram",2]],"state":null}\nnot json\n'
                     b'{"rows":[],"state":{}}\n')
    with pytest.raises(ValueError, match=r"j\.jsonl: line 2 is not a decision line"):
        DecisionJournal(path, resume=True, done=set())
