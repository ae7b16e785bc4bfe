"""``--method auto`` with a draft model: the policy chooses lookup, the draft model or nothing,
per row and step, from the two step costs and the acceptance it observes (tiny float64 models).

(a) outputs equal plain decoding (T = 0 and T = 0.8, batch 1 and 4) while rows switch between
    the model and lookup, and the draft cache holds only committed tokens after every step;
(b) the choice follows cost and acceptance: a cheap draft that is the target is used for most
    steps; the same draft made expensive is never used; a cheap draft that is wrong is dropped
    once its drafts are seen to fail;
(c) the planner's table picks the draft model for a bucket only when its cost allows.
"""

from __future__ import annotations

import pytest

from specbatch.config import SamplingParams
from specbatch.engine.engine import Engine
from specbatch.engine.runner import ModelRunner
from specbatch.engine.sequence import Request, StopRules
from specbatch.models.llama import LlamaForward
from specbatch.auto.candidate import DraftModelCandidate, LookupCandidate
from specbatch.auto.costmodel import CostModel
from specbatch.auto.planner import best_k
from specbatch.auto.policy import AdaptivePolicy
from specbatch.auto.proposer import AutoProposer
from specbatch.spec_decode.draft import DraftProposer
from specbatch.spec_decode.ngram import NgramProposer
from tests.helpers import repeating_prompts, run_engine, tiny_llama
from tests.unit.test_draft import _assert_row_holds, perturbed

VOCAB = 64
MAX_TOKENS = 40
NUM_PROMPTS = 6
SEEDS = [7 * i + 1 for i in range(NUM_PROMPTS)]
SAMPLINGS = {"greedy": SamplingParams(max_tokens=MAX_TOKENS),
             "T0.8": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8)}
TARGET_COST = CostModel((0.02, 0.002, 0.0, 0.0))  # seconds: 20 ms a step + 2 ms a token
CHEAP_DRAFT = CostModel((0.001, 0.0002, 0.0, 0.0))
DEAR_DRAFT = CostModel((0.05, 0.01, 0.0, 0.0))  # one draft forward costs 2.5 verify steps


@pytest.fixture(scope="module")
def setup():
    target = tiny_llama(VOCAB, seed=31)
    prompts = repeating_prompts(VOCAB, NUM_PROMPTS, seed=32, min_len=4, max_len=24)
    base = {name: run_engine(target, prompts, 0, 1, sp, SEEDS) for name, sp in SAMPLINGS.items()}
    return target, prompts, base


def auto_engine(target, draft, batch_size: int, model_cost: CostModel, k: int = 4) -> Engine:
    runner = ModelRunner(LlamaForward(target), batch_size, 256, initial_capacity=16)
    model = DraftProposer(LlamaForward(draft), batch_size, initial_capacity=16)
    lookup = LookupCandidate(NgramProposer(2, 4), k, lambda s: [(1.0, 1.0)] * k,
                             match_len=False)
    policy = AdaptivePolicy(TARGET_COST, k, lookup, [DraftModelCandidate(model, model_cost, k)])
    proposer = AutoProposer([("ngram", lookup.proposer), ("draft", model)], policy)
    return Engine(runner, proposer, StopRules(frozenset(), 256), k)


def _model(engine: Engine) -> DraftModelCandidate:
    return engine.proposer.policy.candidate("draft")


def run_auto(engine: Engine, prompts, sampling: SamplingParams, check_cache: bool = False):
    """Completions in prompt order; with check_cache, after every step each running row's
    draft cache (when the model has drafted for it) holds a prefix of its committed tokens
    that equals a fresh prefill."""
    for i, (p, s) in enumerate(zip(prompts, SEEDS)):
        engine.scheduler.add(Request(i, list(p), sampling, seed=s, tag=i))
    model = _model(engine).proposer
    verify = engine.runner.verify

    def capped_verify(seqs, drafts, meta=None):  # no row drafts past k, max_tokens, context
        assert all(len(d) <= cap for d, cap in zip(drafts, engine._draft_caps(seqs)))
        return verify(seqs, drafts, meta)

    engine.runner.verify = capped_verify
    outputs = {}
    while engine.scheduler.has_work:
        for c in engine.step():
            outputs[c.request.request_id] = c
        if check_cache:
            for seq in engine.scheduler.running_sequences():
                if seq.seq_id in model.states:
                    n = model.cache.seq_lens[seq.row]
                    assert 1 <= len(seq.token_ids) - n
                    _assert_row_holds(model.cache, model.forward, seq.row, seq.token_ids[:n])
    return [outputs[i] for i in range(len(prompts))]


def steps_by(engine: Engine) -> dict[str, int]:
    total: dict[str, int] = {}
    for counts in engine.proposer.policy.steps_by_proposer.values():
        for source, n in counts.items():
            total[source] = total.get(source, 0) + n
    return total


# ---- (a) identity -----------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("batch_size", [1, 4])
def test_auto_with_draft_equals_plain(setup, batch_size, sampling):
    target, prompts, base = setup
    engine = auto_engine(target, perturbed(target, 0.1, seed=33), batch_size, CHEAP_DRAFT)
    out = run_auto(engine, prompts, SAMPLINGS[sampling], check_cache=True)
    assert [c.output_ids for c in out] == [b.output_ids for b in base[sampling]]
    steps = steps_by(engine)
    assert steps["draft"] > 0
    if sampling == "greedy":  # where lookup matches better, rows switch to it
        assert steps["ngram"] > 0
    assert _model(engine).proposer.states == {} and _model(engine).rows == {}


# ---- (b) the choice follows cost and acceptance -----------------------------------------------

def test_cheap_exact_draft_is_used(setup):
    target, prompts, base = setup
    engine = auto_engine(target, target, 4, CHEAP_DRAFT)
    out = run_auto(engine, prompts, SAMPLINGS["greedy"])
    assert [c.output_ids for c in out] == [b.output_ids for b in base["greedy"]]
    steps = steps_by(engine)
    assert steps["draft"] > 0.8 * sum(steps.values()), steps
    assert _model(engine).pool.p(0) > 0.95  # it learned that every draft is accepted


def test_expensive_draft_is_never_used(setup):
    target, prompts, base = setup
    engine = auto_engine(target, target, 4, DEAR_DRAFT)
    out = run_auto(engine, prompts, SAMPLINGS["greedy"])
    assert [c.output_ids for c in out] == [b.output_ids for b in base["greedy"]]
    assert steps_by(engine).get("draft", 0) == 0
    assert _model(engine).proposer.cache.seq_lens.count(0) == 4  # never even prefilled


def test_wrong_draft_is_dropped(setup):
    target, prompts, base = setup
    engine = auto_engine(target, tiny_llama(VOCAB, seed=99), 1, CHEAP_DRAFT)
    first: list[str] = []  # source of each of the first record's steps, in order
    policy, model = engine.proposer.policy, _model(engine)
    select = policy.select

    def recording_select(seqs, caps, num_rows=None, draining=False):
        out = select(seqs, caps, num_rows, draining=draining)
        if seqs[0].request.tag == 0:
            first.append("draft" if seqs[0].seq_id in model.drafted else "other")
        return out

    policy.select = recording_select
    out = run_auto(engine, prompts, SAMPLINGS["greedy"])
    assert [c.output_ids for c in out] == [b.output_ids for b in base["greedy"]]
    assert first[0] == "draft"  # the prior says try it ...
    assert first[-10:].count("draft") == 0  # ... the failures say stop
    assert model.pool.p(0) < 0.3


class _FakeModelProposer:
    """Records which rows the policy prefills (``states``) and asks for model drafts."""

    def __init__(self) -> None:
        self.states: dict[int, bool] = {}
        self.asked: list[int] = []

    def start(self, seq) -> None:
        self.states[seq.seq_id] = True

    def propose(self, seqs, ks):
        self.asked += [s.seq_id for s in seqs]
        return [[1] * k for k in ks]


class _NoLookup:
    def propose(self, seqs, ks):
        return [[] for _ in seqs]


def test_prefilling_a_long_context_is_charged():
    """Two rows alike but for their context: 100 tokens vs 20,000 with 30 tokens left to
    generate. Prefilling 20,000 tokens into the draft cache (~4 s at this cost) cannot pay back
    over ~10 steps, so only the short row drafts with the model; once started, a row pays no
    entry cost again."""
    from types import SimpleNamespace

    def seq(seq_id, context):
        return SimpleNamespace(seq_id=seq_id, token_ids=[0] * context, num_output_tokens=10,
                               sampling=SimpleNamespace(max_tokens=40),
                               request=SimpleNamespace(tag=seq_id))

    fake = _FakeModelProposer()
    policy = AdaptivePolicy(TARGET_COST, 4,
                            LookupCandidate(_NoLookup(), 4, lambda s: [(0.5, 9.5)] * 4),
                            [DraftModelCandidate(fake, CHEAP_DRAFT, 4, prior=0.9)])
    short, long = seq(1, 100), seq(2, 20000)
    policy.select([short, long], [4, 4])
    assert fake.asked == [1] and set(fake.states) == {1}
    fake.states[2] = True  # as if the long row had been prefilled: now it pays like the other
    fake.asked = []
    policy.select([short, long], [4, 4])
    assert fake.asked == [1, 2]


# ---- (c) planner ------------------------------------------------------------------------------

def test_planner_counts_the_draft_forwards():
    free = best_k(TARGET_COST, [0.7], 5, 4, 100)
    cheap = best_k(TARGET_COST, [0.7], 5, 4, 100, CHEAP_DRAFT)
    dear = best_k(TARGET_COST, [0.7], 5, 4, 100, DEAR_DRAFT)
    assert dear == (0, 1.0)  # drafting never pays back a forward that costs 2.5 steps
    assert 1 <= cheap[0] <= free[0] and 1.0 < cheap[1] < free[1]
