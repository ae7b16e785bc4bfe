"""Auto's decisions, pinned: a recorded closed-loop run of ``--method auto``'s proposer (prompt
lookup, a draft model and suffix drafts, all stand-ins driven by a seeded generator) under fixed
cost models, with no wall time (the candidates' clock is a counter), gives the same drafts,
step by step, as the policy before the ``specbatch.auto`` package (``specbatch/plan/policy.py``
at commit 4815fd0, per-candidate ``_select_lookup`` / ``_select_model`` / ``_select_suffix``),
whose decisions ``tests/data/auto_decisions.json`` holds; re-recorded when auto's costs became
fixed for a job (no online refit of the target's fit from the reported step times, the suffix
lookup priced at a fixed cost per row): with those two pinned the same way, the
tree before gave this tree's decisions on all three scenarios; and again when the lookup and
suffix candidates stopped learning from positions another draft's accepted tokens showed
(``LookupCandidate.observe``) and the lookup's estimates got a pooled calibration; and when a
row an earlier candidate took (the draft model) counted its own draft's reach, not the lookup's
at that length, as a later candidate (suffix) was offered the rest (only the slower-draft
scenario's decisions moved); and when the lookup stand-in's proposal became the same prefix
under any cap (as ``NgramIndex.propose``'s is; it proposes in 80% of steps, was 70%, so that
every candidate is still chosen in every scenario), with which the lookup candidate asking for
at most k + 1 tokens was shown to change nothing; and when a later candidate's draft that starts
with the lookup's scored the shared tokens with the higher estimate (``policy._shared``); and
when the suffix lookup stopped being charged to suffix drafts alone (it runs for every row every
step, whatever the step verifies: ``SuffixCandidate``); and when the base got its own
dormancy (``policy.BASE_IDLE_STEPS``: not weighed while the draft model or suffix takes the rows;
the two draft-model scenarios moved, by 3 and 4 of 55 steps); and when a suffix draft position's
frequency got one pseudo-occurrence for an unseen continuation (``candidate._frequencies``; the
suffix stand-in's drafts carry a support per position, drawn from the generator).

A step here is what the engine does: admit rows up to the batch (``start``, then the first
token is committed), ask the proposer for drafts under each row's cap, commit what a target
whose tokens are a fixed function of (row, position) accepts (``on_commit``), report a
deterministic step time (``on_verify``) and finish rows at ``max_tokens`` (``finish``). The
truth does not depend on the drafts, so the drafts the policy chose are its only output.

Re-record (only when a decision change is intended) with the tree to record from first on the
path: ``PYTHONPATH=TREE python tests/unit/test_auto_replay.py > tests/data/auto_decisions.json``
(TREE's ``specbatch.plan.policy`` is used when it exists: the old shape).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "auto_decisions.json"
K = 4
BATCH = 6
CAP = min(32, 3 * K)  # auto's draft cap (SUFFIX_CAP_FACTOR * k)
VOCAB = 6  # small, so drafts from any source are often right
# name -> the draft model's step cost (seconds: per forward, per row), or None: no draft model
SCENARIOS = {"lookup+suffix": None, "lookup+draft+suffix": (0.0015, 0.0002),
             "lookup+slower-draft+suffix": (0.0025, 0.0003)}


def _h(*key) -> random.Random:
    return random.Random(repr(key))  # a str seed: the same stream in every process


def truth(seq_id: int, pos: int) -> int:
    return _h("truth", seq_id, pos).randrange(VOCAB)


class Seq:
    def __init__(self, seq_id: int, prompt_len: int, max_tokens: int) -> None:
        self.seq_id = seq_id
        self.token_ids = [truth(seq_id, p) for p in range(prompt_len)]
        self.num_prompt_tokens = prompt_len
        self.sampling = SimpleNamespace(max_tokens=max_tokens)
        self.request = SimpleNamespace(tag=seq_id)
        self.finish_reason = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


def _guess(kind: str, seq: Seq, step: int, n: int, skill: float) -> list[int]:
    """n tokens: the truth while a coin of ``skill`` comes up, then a wrong token, then noise."""
    rng, pos, out = _h(kind, seq.seq_id, step), len(seq.token_ids), []
    right = True
    for j in range(n):
        right = right and rng.random() < skill
        t = truth(seq.seq_id, pos + j)
        out.append(t if right else (t + 1 + rng.randrange(VOCAB - 1)) % VOCAB)
    return out


class Lookup:
    """``NgramProposer``'s interface: a row-dependent share of rows draft, some exactly."""

    name = "ngram"

    def __init__(self) -> None:
        self.step = 0
        self.match: dict[int, int] = {}

    def start(self, seq) -> None:
        pass

    def propose(self, seqs, ks):
        self.step += 1
        out = []
        for s, k in zip(seqs, ks):
            rng = _h("lookup-len", s.seq_id, self.step)
            # the match's length, cut at the cap: the same proposal's prefix under any cap
            n = min(rng.randrange(CAP + 1), k) if rng.random() < 0.8 else 0
            self.match[s.seq_id] = 1 + rng.randrange(4) if n else 0
            out.append(_guess("lookup", s, self.step, n, 0.3 + 0.6 * (s.seq_id % 3) / 2))
        return out

    def match_len(self, seq) -> int:
        return self.match.get(seq.seq_id, 0)

    def on_commit(self, seq, n: int) -> None:
        pass

    def finish(self, seq) -> None:
        pass


class Model:
    """``DraftProposer``'s interface; rows whose id is 1 mod 4 draft one token short."""

    name = "draft"

    def __init__(self) -> None:
        self.states: dict[int, int] = {}
        self.calls = 0

    def start(self, seq) -> None:
        self.states[seq.seq_id] = len(seq.token_ids)

    def propose(self, seqs, ks):
        self.calls += 1
        return [_guess("model", s, self.calls, k - (s.seq_id % 4 == 1 and k > 1), 0.75)
                for s, k in zip(seqs, ks)]

    def on_commit(self, seq, n: int) -> None:
        assert seq.seq_id in self.states

    def finish(self, seq) -> None:
        self.states.pop(seq.seq_id, None)


class Suffix:
    """``SuffixProposer``'s ``draft``: scored drafts of any length up to the cap."""

    name = "suffix"

    def __init__(self) -> None:
        self.calls = 0

    def start(self, seq) -> None:
        pass

    def draft(self, seq, cap: int, num_rows: int = 1):
        from specbatch.spec_decode.suffix import Draft

        self.calls += 1
        rng = _h("suffix-len", seq.seq_id, self.calls)
        if rng.random() < 0.35 or cap <= 0:
            return Draft([], [], 0, "", [])
        n = 1 + rng.randrange(cap)
        probs, p = [], 1.0
        for _ in range(n):
            p *= rng.choice((0.3, 0.5, 0.7, 0.9, 0.97, 1.0))
            probs.append(p)
        skill = 0.4 + 0.5 * rng.random()
        return Draft(_guess("suffix", seq, self.calls, n, skill), probs, 1 + rng.randrange(10),
                     rng.choice(("self", "job")), [rng.choice((1, 2, 5, 50)) for _ in range(n)])

    def on_commit(self, seq, n: int) -> None:
        pass

    def finish(self, seq) -> None:
        pass


class Clock:
    """A counter as ``time.perf_counter`` (seconds): each call advances by a set amount."""

    def __init__(self) -> None:
        self.t, self.calls = 100.0, 0

    def perf_counter(self) -> float:
        self.calls += 1
        self.t += 0.0004 * (1 + self.calls % 7)
        return self.t

    thread_time = perf_counter  # the suffix lookup's CPU time: the same counter


def costs():
    """The target's cost (calibrated, fixed for the job; packed attention, knotted dense
    slope) and the draft model's (synthetic: fixed)."""
    try:
        from specbatch.auto.costmodel import CostModel
    except ImportError:  # pragma: no cover - the old tree (recording)
        from specbatch.plan.costmodel import CostModel
    target = CostModel((0.020, 0.0030, 2e-6, 4e-7, 0.0020, 0.0012, 0.0009, 0.0008, 0.0008),
                       knots=(4, 8, 16, 32, 64), packed=True,
                       samples=tuple((r, q, 300, 0.02 + 0.002 * r * q)
                                     for r in (1, 4, 8) for q in (1, 3, 5)))
    return target, CostModel


def _prior(seq):
    a = 0.2 + 0.15 * (seq.seq_id % 5)
    return [(a * 4, (1 - a) * 4)] * K


def new_proposer(draft_cost, clock):
    """``--method auto``'s proposer as ``auto.planner`` builds it, over the stand-ins."""
    from specbatch.auto import candidate as cand_mod
    from specbatch.auto.candidate import Probe, Setup
    from specbatch.auto.policy import AdaptivePolicy
    from specbatch.auto.proposer import AutoProposer

    cand_mod.time = clock
    target, cost_model = costs()
    members = [("ngram", Lookup())] + ([("draft", Model())] if draft_cost else []) + [
        ("suffix", Suffix())]
    proposer = AutoProposer(members)
    setup = Setup(K, _prior, Probe(16, 2, 4, 4096),
                  cost_model((*draft_cost, 0.0, 0.0)) if draft_cost else None)
    lookup, *others = proposer.build_candidates(setup)
    proposer.use(AdaptivePolicy(target, K, lookup, others))
    return proposer


def old_proposer(draft_cost, clock):  # pragma: no cover - recording only
    """The same over cb6e8c5's ``Router``, ``WithSuffix``, ``LookupAndDraftProposer``."""
    from specbatch.plan import policy as policy_mod
    from specbatch.plan.policy import AdaptivePolicy, Probe
    from specbatch.spec_decode.composite import LookupAndDraftProposer, WithSuffix
    from specbatch.spec_decode.router import Router

    policy_mod.time = clock
    target, cost_model = costs()
    inner = Lookup()
    if draft_cost:
        inner = LookupAndDraftProposer(inner, Model())
    proposer = WithSuffix(inner, Suffix())
    policy = AdaptivePolicy(target, K, _prior, probe=Probe(16, 2, 4, 4096),
                            proposer=proposer if draft_cost else None,
                            model_cost=cost_model((*draft_cost, 0.0, 0.0)) if draft_cost else None,
                            match_len_of=proposer.match_len, suffix=proposer)
    return Router(proposer, policy)


def simulate(proposer, records: int = 24, seed: int = 5) -> dict:
    """Drive ``proposer`` as the engine does; returns each step's drafts (per row: seq id,
    draft) and the steps per source, per record."""
    rng = random.Random(seed)
    queue = [Seq(i, rng.randrange(8, 60), rng.randrange(10, 50)) for i in range(records)]
    running: list[Seq] = []
    steps = []
    while queue or running:
        while queue and len(running) < BATCH:
            seq = queue.pop(0)
            proposer.start(seq)
            seq.token_ids.append(truth(seq.seq_id, len(seq.token_ids)))
            proposer.on_commit(seq, 1)
            running.append(seq)
        caps = [min(CAP, s.sampling.max_tokens - s.num_output_tokens - 1) for s in running]
        drafts = [d[:c] for d, c in zip(proposer.propose(running, caps), caps)]
        steps.append([[s.seq_id, d] for s, d in zip(running, drafts)])
        for s, d in zip(running, drafts):
            pos, emitted = len(s.token_ids), []
            for j, t in enumerate(d):
                if t != truth(s.seq_id, pos + j):
                    break
                emitted.append(t)
            emitted.append(truth(s.seq_id, pos + len(emitted)))
            s.token_ids.extend(emitted)
            proposer.on_commit(s, len(emitted))
        fed = sum(1 + len(d) for d in drafts)
        proposer.on_verify(running, drafts, 0.018 + 0.0021 * fed + 0.001 * (len(steps) % 3))
        for s in [s for s in running if s.num_output_tokens >= s.sampling.max_tokens]:
            s.finish_reason = "length"
            proposer.finish(s)
            running.remove(s)
    counts = proposer.policy.steps_by_proposer
    return {"steps": steps,
            "sources": {str(tag): dict(sorted(c.items())) for tag, c in sorted(counts.items())}}


def record() -> dict:  # pragma: no cover - recording only
    from importlib.util import find_spec

    old = find_spec("specbatch.plan") is not None and find_spec("specbatch.plan.policy")
    make = old_proposer if old else new_proposer
    return {name: simulate(make(draft_cost, Clock())) for name, draft_cost in SCENARIOS.items()}


def test_auto_makes_the_recorded_decisions():
    expected = json.loads(FIXTURE.read_text())
    for name, draft_cost in SCENARIOS.items():
        got = simulate(new_proposer(draft_cost, Clock()))
        want = expected[name]
        assert len(got["steps"]) == len(want["steps"]), name
        for i, (g, w) in enumerate(zip(got["steps"], want["steps"])):
            assert g == w, (name, i)
        assert got["sources"] == want["sources"], name
        used = {src for c in got["sources"].values() for src in c}
        # every candidate was chosen somewhere, so every path of the loop is pinned
        assert used == ({"ngram", "suffix", "none"} | ({"draft"} if draft_cost else set())), used


if __name__ == "__main__":  # pragma: no cover
    json.dump(record(), sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
