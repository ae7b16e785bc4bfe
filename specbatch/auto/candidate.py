"""The ``Candidate`` protocol: a proposer ``--method auto`` may verify the drafts of, with what
the policy needs to value them, and the three built-in candidates.

A candidate wraps one method's proposer (``methods.Method.candidate`` builds it) and adds:

- per-position confidence: ``reach(seqs, lengths)``, per row, the chance that draft positions
  0..j are all accepted (the expected extra tokens position j brings; a row feeding n drafts
  emits ``1 + sum(reach[:n])`` tokens on average);
- its cost per step: ``step_seconds`` (what drafting adds to a verify step: a draft model's
  forwards, a lookup's measured time) and ``entry_seconds`` (one-off per-row costs, spread
  over the row's remaining steps: a draft model's prefill);
- its acceptance pool: what it learns from the tokens each step commits (``observe``), verified
  or not.

Per step the policy (``auto.policy.AdaptivePolicy``) calls ``prepare`` once (cheap candidates
draft here), asks ``reach`` for the lengths it weighs, and calls ``drafts`` for the rows it
gives the candidate (a draft model drafts only then). The lifecycle calls (``start``,
``on_commit``, ``finish``) are the ``Proposer``'s; the auto proposer (``auto.proposer``)
forwards them to every candidate, which forwards them to its proposer and drops its own rows.

Built in: ``LookupCandidate`` (prompt lookup, the base: drafted every step, it sets the step's
cap), ``DraftModelCandidate`` and ``SuffixCandidate``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from specbatch.auto.costmodel import CostModel
from specbatch.spec_decode.replay import NgramReplay
from specbatch.spec_decode.stats import SpecStats

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence
    from specbatch.spec_decode.proposer import Proposer


MODEL_PRIOR = 0.7  # a draft model's conditional acceptance before it has drafted anything
MODEL_PRIOR_STRENGTH = 4.0  # pseudo-trials behind the pooled acceptance in a row's estimate
POOL_DECAY = 0.995  # per observed row-step, for acceptance pooled over all rows
# per verify step, for the suffix pool: decayed per row-step, its memory at batch 16 was ~12
# steps, the cell estimates noisy, and auto took suffix drafts where a cell read high by chance
SUFFIX_POOL_DECAY = 0.995
SUFFIX_BUCKETS = (0.2, 0.4, 0.6, 0.8, 0.95)  # edges: a suffix draft position's frequency
SUFFIX_PRIOR_STRENGTH = 2.0  # pseudo-trials at the (smoothed) frequency itself, per bucket
# the least share of its pseudo-trials a row's prior keeps as the row's own counts decay
# (``RowAcceptance``): a position seldom tried still leans on it
PRIOR_FLOOR = 0.05
SUFFIX_MATCH_BINS = 8  # matched tokens behind a suffix draft position: 1 .. 8 (8 and more)
# a lookup draft position's estimated conditional acceptance, in bins of this width: the
# estimate is calibrated by the acceptance pooled over all rows per bin (``LookupCandidate``)
LOOKUP_CALIBRATION_BIN = 0.1
LOOKUP_CALIBRATION_PRIOR = 2.0  # pseudo-trials at the estimate itself, per bin
_LAST_CALIBRATION_BIN = round(1 / LOOKUP_CALIBRATION_BIN) - 1


class Candidate(Protocol):
    """A proposer whose drafts auto may verify, row by row and step by step.

    name: its method's name (``methods``); the ``proposer_steps`` stats count steps under it.
    proposer: the method's ``Proposer`` (its per-sequence state).
    hysteresis: True where switching to the candidate has a cost the step cannot see (a
        draft model's cache): once used it is kept unless another choice is predicted
        ``switch_margin`` better, and taken up only when it is that much better.

    Every step, for the rows ``seqs`` of the verify step (a list of ``Sequence``):
    """

    name: str
    proposer: Proposer
    hysteresis: bool

    def prepare(self, seqs: list[Sequence], caps: list[int]) -> list[int]:
        """Called once per step before any choice: the longest draft row i could get
        (tokens, at most ``caps[i]``, the engine's per-row cap). A candidate whose drafts are
        cheap drafts here; one whose drafts are costly (a draft model) drafts in ``drafts``."""
        ...

    def reach(self, seqs: list[Sequence], lengths: list[int]) -> list[list[float]]:
        """Per row, ``lengths[i]`` floats in [0, 1], non-increasing: the chance that draft
        positions 0..j are all accepted, for j < lengths[i] (at most what ``prepare`` gave)."""
        ...

    def cap_options(self, k_max: int) -> Seq[int | None]:
        """The step caps (tokens) the policy tries for this candidate (None: no cap)."""
        ...

    def entry_seconds(self, seqs: list[Sequence], reach: list[list[float]]) -> list[float]:
        """Per row, one-off seconds of drafting with this candidate, spread over the row's
        remaining steps (0.0: none). reach: ``reach`` at ``prepare``'s lengths."""
        ...

    def step_seconds(self, lengths: list[int], ctx: float) -> list[float]:
        """Seconds drafting adds to a verify step where row i takes ``lengths[i]`` tokens from
        this candidate (0: not this candidate); ctx: the rows' mean context (tokens). A list,
        summed in order."""
        ...

    def drafts(self, seqs: list[Sequence], lengths: list[int], ctx: float) -> list[list[int]]:
        """The draft token ids of the rows the policy gave this candidate, at most
        ``lengths[i]`` each (fewer where the candidate cannot: a draft model past its
        context)."""
        ...

    def observe(self, seq: Sequence, emitted: list[int]) -> None:
        """The tokens the step committed for a row of the step: its acceptance pool learns
        from the positions whose outcome does not depend on which draft was verified (the
        first always; the ones after it where its own draft was verified)."""
        ...

    def start(self, seq: Sequence) -> None: ...

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None: ...

    def finish(self, seq: Sequence) -> None: ...

    # Optional:
    # counts_rows = True: ``prepare`` takes ``num_rows=``, the rows of the verify step (a
    #     resumed job's placeholders included), where its drafts depend on it (suffix).
    # proposal(seq) -> list[int]: the tokens ``prepare`` found for the row this step (its
    #     draft before any cut), where known before ``drafts`` (not a draft model's): where a
    #     later candidate's starts with the base's, the policy scores the shared tokens once.
    # global_state() -> dict of JSON values / set_global_state(dict): what it learned pooled
    #     over rows (not a row's own state, which follows the row's tokens), so a resumed job
    #     continues from where the interrupted one was (``auto.journal``). A candidate without
    #     them still resumes with the same outputs; its ``spec`` stats may then differ.


@dataclass(frozen=True)
class Probe:
    """Replay prompt lookup (``prompt_lookup_min``/``max``, tokens) over a row's first
    ``tokens`` committed tokens. max_model_len: the run's context cap (tokens)."""

    tokens: int = 16
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_model_len: int = 1 << 30


@dataclass(frozen=True)
class Setup:
    """What a candidate's builder (``methods.Method.candidate``) is given.

    k_max: auto's k (tokens); prior_for(seq) -> [(alpha, beta)] per draft position: the
    planner's prediction of the row's lookup acceptance; probe: the lookup probe, or None;
    draft_cost: the draft forward's ``CostModel`` when a draft model is loaded, else None."""

    k_max: int
    prior_for: Callable[[Sequence], list[tuple[float, float]]]
    probe: Probe | None = None
    draft_cost: CostModel | None = None


@dataclass
class RowAcceptance:
    """Decayed per-position counts for one sequence. prior: (alpha, beta) per position.

    The prior is forgotten as the counts are (its pseudo-trials decay with them, to at most
    ``PRIOR_FLOOR`` of their weight): it is the oldest information about the row. Kept whole,
    it set a floor under the estimate of a row whose drafts are never accepted (prior 1.2 of
    4 pseudo-trials and ~10 steps of decayed memory: p = 0.086 for ever), and where a draft
    token costs under ~8% of a step's rate (batch 1) auto drafted 1-2 tokens every step of
    such a row and never settled on k = 0."""

    prior: list[tuple[float, float]]
    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    weight: float = 1.0  # the prior's remaining weight (decays with the counts)

    def p(self, j: int) -> float:
        a, b = self.prior[min(j, len(self.prior) - 1)]
        t = self.trials[j] if j < len(self.trials) else 0.0
        h = self.hits[j] if j < len(self.hits) else 0.0
        return (h + self.weight * a) / (t + self.weight * (a + b))

    def observe(self, draft: list[int], emitted: list[int], decay: float) -> None:
        """draft: the full (untruncated) proposal; emitted: the tokens the step committed."""
        accepted = 0
        while accepted < min(len(draft), len(emitted)) and draft[accepted] == emitted[accepted]:
            accepted += 1
        self.count(len(draft), accepted, len(emitted), decay)

    def count(self, num_draft: int, accepted: int, num_emitted: int, decay: float) -> None:
        """One step: ``num_draft`` drafted, the first ``accepted`` matched, ``num_emitted``
        tokens committed. Draft position j counts as a trial only if 0..j-1 matched."""
        n = min(num_draft, num_emitted)
        if n == 0:
            return
        while len(self.trials) < num_draft:
            self.trials.append(0.0)
            self.hits.append(0.0)
        for j in range(len(self.trials)):
            self.trials[j] *= decay
            self.hits[j] *= decay
        self.weight = max(self.weight * decay, PRIOR_FLOOR)
        for j in range(n):
            self.trials[j] += 1.0
            if j >= accepted:
                break
            self.hits[j] += 1.0

    def expected_tokens(self, draft_len: int) -> float:
        total, run = 1.0, 1.0
        for j in range(draft_len):
            run *= self.p(j)
            total += run
        return total


def pool_state(acc: RowAcceptance) -> dict:
    """A pooled ``RowAcceptance`` as JSON values (floats round-trip exactly)."""
    return {"prior": [list(p) for p in acc.prior], "trials": list(acc.trials),
            "hits": list(acc.hits), "weight": acc.weight}


def pool_from(d: dict) -> RowAcceptance:
    """The ``RowAcceptance`` of ``pool_state``; raises ``KeyError`` / ``TypeError`` /
    ``ValueError`` on another shape."""
    return RowAcceptance([(float(a), float(b)) for a, b in d["prior"]],
                         [float(t) for t in d["trials"]], [float(h) for h in d["hits"]],
                         float(d["weight"]))


def _odds(p: float) -> float:
    """p / (1 - p), the denominator at least 1e-9."""
    return p / max(1.0 - p, 1e-9)


def _shifted(p: float, group: float, everyone: float) -> float:
    """``p`` moved in logit space by ``log(group) - log(everyone)`` (two odds, ``_odds``):
    the odds of a row's estimate scaled by how much likelier its group accepts than
    everyone."""
    odds = _odds(p) * group / everyone
    return odds / (1.0 + odds)


class ForwardingCandidate:
    """Base for a ``Candidate`` built around a ``Proposer`` (``self.proposer``): the lifecycle
    calls (``start``, ``on_commit``, ``finish``) go to it, and ``finish`` also drops the row's
    own state (``_drop``; nothing by default). A registered method's candidate subclasses it
    and writes only the pricing and drafting half of the protocol. Defaults for a candidate
    whose drafts cost nothing beyond the verify step (its lookup runs in ``prepare``, for every
    row whatever the step verifies, so it is no part of the choice): one cap (``None``: the
    policy cuts each row), no entry or step seconds, nothing learnt from the commits."""

    proposer: Proposer

    def cap_options(self, k_max: int) -> Seq[int | None]:
        return (None,)

    def entry_seconds(self, seqs, reach) -> list[float]:
        return [0.0] * len(seqs)

    def step_seconds(self, lengths: list[int], ctx: float) -> list[float]:
        return []

    def observe(self, seq, emitted: list[int]) -> None:
        pass

    def start(self, seq) -> None:
        self.proposer.start(seq)

    def on_commit(self, seq, num_new_tokens: int) -> None:
        self.proposer.on_commit(seq, num_new_tokens)

    def finish(self, seq) -> None:
        self.proposer.finish(seq)
        self._drop(seq)

    def _drop(self, seq) -> None:
        pass


# ---- prompt lookup ------------------------------------------------------------------------

class LookupCandidate(ForwardingCandidate):
    """Prompt lookup (``NgramProposer``): auto's base, drafted every step (a dict lookup per
    row), whose drafts the policy cuts under one step cap (``AdaptivePolicy``).

    Confidence: position j's conditional acceptance is a Beta posterior whose prior is the
    record's predicted acceptance (``prior_for``) and whose counts are the row's own recent
    history (``decay`` per observed step), shifted in logit by how much more (or less) often
    drafts from this step's n-gram size (``NgramProposer.match_len``) are accepted than lookup
    drafts overall, pooled over all rows (``by_match_len``, ``lookup_pool``; ``match_len``
    False: no shift). Every step's proposal is scored against the emitted tokens where the
    outcome does not depend on which draft was verified: its first position always (a row
    learns while it drafts nothing), positions 1..n where the row verified n lookup tokens.

    Calibration: that estimate is then calibrated by the acceptance pooled over all rows per
    bin of it (``LOOKUP_CALIBRATION_BIN`` wide, ``calibration``; a Beta prior of
    ``LOOKUP_CALIBRATION_PRIOR`` pseudo-trials at the estimate itself), as the suffix
    candidate's frequencies are. Uncalibrated, it read 0.1-0.15 above the realised acceptance
    on the extraction recipe (SmolLM2-135M, batch 1: positions estimated at 0.4-0.5 accepted
    31% of the time, suffix's 38%), and the policy took lookup drafts where suffix's were
    longer: 6624 verify steps for the 160 records where suffix alone took 6317 (6505 with the
    calibration and the scoring of ``observe``; calibrating on the steps that verified a lookup
    draft only gave 6393, but a row whose first verified drafts failed then stayed undrafted:
    batch 1 at acceptance 0.37 fell to 0.956x the best static k,
    ``test_planner.py::test_auto_at_batch_1_keeps_up_with_the_best_static_k``).

    Probe: once a row has committed ``probe.tokens`` output tokens, prompt lookup is replayed
    over them (``spec_decode.replay``, exact at any temperature) and the replayed counts replace
    the row's; the replayed acceptance length of each record's first probe is kept in
    ``probe_results`` (request tag -> (mean acceptance length or None, probe tokens))."""

    name = "ngram"
    hysteresis = False

    def __init__(self, proposer, k_max: int, prior_for, decay: float = 0.9,
                 probe: Probe | None = None, match_len: bool = True) -> None:
        self.proposer = proposer
        self.k_max = k_max
        self.prior_for = prior_for
        self.decay = decay
        self.probe = probe
        self.use_match_len = match_len
        self.rows: dict[int, RowAcceptance] = {}
        self.lookup_pool = RowAcceptance([(1.0, 1.0)])  # lookup acceptance, all rows pooled
        self.by_match_len: dict[int, RowAcceptance] = {}  # n -> the same, drafts from n-grams
        # ``_calibration_cell`` of an estimate -> [trials, hits] pooled over rows
        self.calibration: dict[tuple[int, int], list[float]] = {}
        self._estimates: dict[int, list[float]] = {}  # seq id -> this step's raw estimates
        self._verified: dict[int, int] = {}  # seq id -> lookup tokens verified this step
        self._match: dict[int, int] = {}  # seq id -> this step's match length
        self._proposed: dict[int, list[int]] = {}  # seq id -> this step's full proposal
        self._odds: dict[tuple[int, int], tuple[float, float]] = {}  # ``_pooled_odds``
        self.probed: set[int] = set()  # seq ids
        self.probe_results: dict = {}

    def _row(self, seq) -> RowAcceptance:
        acc = self.rows.get(seq.seq_id)
        if acc is None:
            acc = self.rows[seq.seq_id] = RowAcceptance(self.prior_for(seq))
        return acc

    def prepare(self, seqs, caps: list[int]) -> list[int]:
        # a lookup draft is verified up to k_max tokens and learnt from up to its bonus
        # position: a longer proposal (the engine caps auto's rows for suffix's long drafts)
        # is never used, and estimating its positions took ~10% of a step's choice (16 rows)
        caps = [min(c, self.k_max + 1) for c in caps]
        proposed = [d[:k] for d, k in zip(self.proposer.propose(seqs, caps), caps)]
        self._proposed = {s.seq_id: d for s, d in zip(seqs, proposed)}
        self._estimates = {}
        if self.use_match_len:
            self._match = {s.seq_id: self.proposer.match_len(s)
                           for s, d in zip(seqs, proposed) if d}
        return [len(d) for d in proposed]

    def _raw(self, seq, n: int) -> list[float]:
        """The row's estimated conditional acceptance of draft positions 0..n-1 before
        calibration (its Beta posterior, shifted by its n-gram size's pool), computed once a
        step for the whole proposal and kept for ``observe``, which scores the bins."""
        est = self._estimates.get(seq.seq_id)
        if est is not None and len(est) >= n:
            return est[:n]
        acc = self._row(seq)
        m = self._match.get(seq.seq_id, 0)
        est = []
        if m in self.by_match_len:
            for j in range(max(n, len(self._proposed.get(seq.seq_id, ())))):
                p = acc.p(j)
                group, everyone = self._pooled_odds(m, j)
                est.append(_shifted(p, group, everyone))
        else:
            est = [acc.p(j) for j in range(max(n, len(self._proposed.get(seq.seq_id, ()))))]
        self._estimates[seq.seq_id] = est
        return est[:n]

    def _pooled_odds(self, m: int, j: int) -> tuple[float, float]:
        """The odds of acceptance at draft position j of drafts from m-grams and of all lookup
        drafts (``by_match_len``, ``lookup_pool``), computed once until a pool learns (the
        same for every row of a step)."""
        key = (m, j)
        odds = self._odds.get(key)
        if odds is None:
            odds = self._odds[key] = (_odds(self.by_match_len[m].p(j)),
                                      _odds(self.lookup_pool.p(j)))
        return odds

    def reach(self, seqs, lengths: list[int]) -> list[list[float]]:
        out = []
        for s, n in zip(seqs, lengths):
            run, r = 1.0, []
            for j, p in enumerate(self._raw(s, n)):
                trials, hits = self.calibration.get(_calibration_cell(j, p), (0.0, 0.0))
                run *= (hits + LOOKUP_CALIBRATION_PRIOR * p) / (trials + LOOKUP_CALIBRATION_PRIOR)
                r.append(run)
            out.append(r)
        return out

    def cap_options(self, k_max: int) -> range:
        return range(0, k_max + 1)

    def proposal(self, seq) -> list[int]:
        """The row's n-gram draft this step, before any cut (at most k + 1 tokens)."""
        return self._proposed.get(seq.seq_id, [])

    def drafts(self, seqs, lengths: list[int], ctx: float) -> list[list[int]]:
        for s, n in zip(seqs, lengths):
            self._verified[s.seq_id] = n
        return [self._proposed[s.seq_id][:n] for s, n in zip(seqs, lengths)]

    def observe(self, seq, emitted: list[int]) -> None:
        draft = self._proposed.pop(seq.seq_id, [])
        # learn from the positions whose outcome does not depend on another draft's: position
        # 0 always, and where the row verified n lookup tokens, positions 1..n (n: its bonus
        # token, seen only if 0..n-1 matched). Another draft's accepted tokens show more of a
        # lookup proposal exactly where the text copies well, and counting those read 0.1-0.2
        # high (``calibration`` scores the same positions, before the row's counts move)
        seen = draft[:self._verified.pop(seq.seq_id, 0) + 1]
        est = self._raw(seq, min(len(seen), len(emitted)))
        if est:
            for cell in self.calibration.values():
                cell[0] *= POOL_DECAY
                cell[1] *= POOL_DECAY
        for j, p in enumerate(est):
            cell = self.calibration.setdefault(_calibration_cell(j, p), [0.0, 0.0])
            cell[0] += 1.0
            if draft[j] != emitted[j]:
                break
            cell[1] += 1.0
        self._row(seq).observe(seen, emitted, self.decay)
        n = self._match.pop(seq.seq_id, 0)
        if n:
            self.by_match_len.setdefault(n, RowAcceptance([(1.0, 1.0)])).observe(
                seen, emitted, POOL_DECAY)
            self.lookup_pool.observe(seen, emitted, POOL_DECAY)
            self._odds.clear()
        if (self.probe is not None and seq.seq_id not in self.probed
                and seq.num_output_tokens >= self.probe.tokens):
            self._run_probe(seq)

    def global_state(self) -> dict:
        """The acceptance pooled over rows (``lookup_pool``, ``by_match_len``): what a
        resumed job restores (``auto.journal``); a row's own state follows its tokens."""
        return {"pool": pool_state(self.lookup_pool),
                "by_match_len": [[n, pool_state(a)] for n, a in sorted(self.by_match_len.items())],
                "calibration": [[j, b, t, h]
                                for (j, b), (t, h) in sorted(self.calibration.items())]}

    def set_global_state(self, state: dict) -> None:
        self._odds.clear()
        self.lookup_pool = pool_from(state["pool"])
        self.by_match_len = {int(n): pool_from(a) for n, a in state["by_match_len"]}
        self.calibration = {(int(j), int(b)): [float(t), float(h)]
                            for j, b, t, h in state.get("calibration", ())}

    def _run_probe(self, seq) -> None:
        """Replace the row's counts with prompt lookup replayed over its committed tokens."""
        self.probed.add(seq.seq_id)
        n_prompt = seq.num_prompt_tokens
        out = list(seq.token_ids[n_prompt:])
        replay = NgramReplay(seq.token_ids[:n_prompt], out, self.probe.prompt_lookup_min,
                             self.probe.prompt_lookup_max, self.k_max)
        acc = RowAcceptance(self.prior_for(seq))
        stats = SpecStats()
        for draft, accepted, emitted in replay.steps(self.k_max, seq.sampling.max_tokens,
                                                     self.probe.max_model_len):
            acc.count(len(draft), accepted, emitted, self.decay)
            stats.record_step(len(draft), accepted)
        self.rows[seq.seq_id] = acc
        self.probe_results.setdefault(seq.request.tag, (stats.mean_acceptance_length, len(out)))

    def _drop(self, seq) -> None:
        self.rows.pop(seq.seq_id, None)
        self._proposed.pop(seq.seq_id, None)
        self._estimates.pop(seq.seq_id, None)
        self._verified.pop(seq.seq_id, None)
        self.probed.discard(seq.seq_id)


# ---- draft model --------------------------------------------------------------------------

class DraftModelCandidate(ForwardingCandidate):
    """A draft model (``DraftProposer``; ``--method auto --draft-model NAME``).

    Confidence: per row, its own decayed counts over a prior of ``MODEL_PRIOR_STRENGTH``
    pseudo-trials at the acceptance pooled over all rows (``pool``, which starts at ``prior``).
    Cost: ``cost``, the draft forward's ``CostModel`` (calibrated like the target's, fixed for
    the job: no time measured while it runs enters a decision): one forward of the rows still
    drafting per draft depth. A row the draft cache does not hold yet is prefilled the first time it is given
    model drafts; that prefill, spread over the row's remaining steps, is its entry cost. A
    row that skipped the model for some steps feeds the committed tokens it has not seen in its
    next draft step (``spec_decode.draft``)."""

    name = "draft"
    hysteresis = True

    def __init__(self, proposer, cost: CostModel, k_max: int, prior: float = MODEL_PRIOR,
                 decay: float = 0.9) -> None:
        self.proposer = proposer
        self.cost = cost
        self.k_max = k_max
        self.decay = decay
        self.pool = RowAcceptance([(prior * MODEL_PRIOR_STRENGTH,
                                    (1 - prior) * MODEL_PRIOR_STRENGTH)])
        self.rows: dict[int, RowAcceptance] = {}  # seq id -> the model's own counts
        self.drafted: dict[int, list[int]] = {}  # seq id -> this step's model draft

    def prepare(self, seqs, caps: list[int]) -> list[int]:
        self.drafted = {}
        return [min(self.k_max, c) for c in caps]

    def reach(self, seqs, lengths: list[int]) -> list[list[float]]:
        out = []
        for seq, n in zip(seqs, lengths):
            acc = self.rows.get(seq.seq_id)
            run, r = 1.0, []
            for j in range(n):
                t = acc.trials[j] if acc is not None and j < len(acc.trials) else 0.0
                h = acc.hits[j] if acc is not None and j < len(acc.hits) else 0.0
                run *= (h + MODEL_PRIOR_STRENGTH * self.pool.p(j)) / (t + MODEL_PRIOR_STRENGTH)
                r.append(run)
            out.append(r)
        return out

    def cap_options(self, k_max: int) -> range:
        return range(1, k_max + 1)

    def entry_seconds(self, seqs, reach) -> list[float]:
        """Seconds of prefilling the row's context into the draft cache, per remaining step
        (remaining output tokens over the tokens a model-drafted step is expected to emit);
        0.0 for a row the cache holds."""
        out = []
        for seq, r in zip(seqs, reach):
            if seq.seq_id in self.proposer.states:
                out.append(0.0)
                continue
            prefill = self.cost.step_time(1, 1, 0, num_tokens=len(seq.token_ids))
            remaining = max(seq.sampling.max_tokens - seq.num_output_tokens, 1)
            out.append(prefill * (1.0 + sum(r)) / remaining)
        return out

    def step_seconds(self, lengths: list[int], ctx: float) -> list[float]:
        out = []
        for depth in range(max(lengths, default=0)):
            rows = sum(1 for d in lengths if d > depth)
            out.append(self.cost.step_time(rows, 1, ctx, num_tokens=rows))
        return out

    def drafts(self, seqs, lengths: list[int], ctx: float) -> list[list[int]]:
        """Prefills the rows the cache lacks, then drafts in ``max(lengths)`` batched
        forwards."""
        for seq in seqs:
            if seq.seq_id not in self.proposer.states:
                self.proposer.start(seq)
        out = self.proposer.propose(seqs, lengths)
        for s, d in zip(seqs, out):
            self.drafted[s.seq_id] = d
        return out

    def observe(self, seq, emitted: list[int]) -> None:
        draft = self.drafted.pop(seq.seq_id, None)
        if draft is not None:
            row = self.rows.setdefault(seq.seq_id, RowAcceptance([(1.0, 1.0)]))
            row.observe(draft, emitted, self.decay)
            self.pool.observe(draft, emitted, POOL_DECAY)

    def start(self, seq) -> None:
        pass  # prefilled when first given model drafts (``drafts``)

    def global_state(self) -> dict:
        return {"pool": pool_state(self.pool)}

    def set_global_state(self, state: dict) -> None:
        self.pool = pool_from(state["pool"])

    def on_commit(self, seq, num_new_tokens: int) -> None:
        if seq.seq_id in self.proposer.states:
            self.proposer.on_commit(seq, num_new_tokens)

    def _drop(self, seq) -> None:
        self.rows.pop(seq.seq_id, None)


# ---- suffix -------------------------------------------------------------------------------

def _calibration_cell(j: int, p: float) -> tuple[int, int]:
    """The ``LookupCandidate.calibration`` cell of draft position j estimated at p: (0 for
    the first position, 1 after it; p's bin). The first position is scored on every row, the
    later ones on rows that verified lookup drafts only, which the policy took where their
    estimate was high: a cell of their own keeps that selection out of the first's."""
    return min(j, 1), min(int(p / LOOKUP_CALIBRATION_BIN), _LAST_CALIBRATION_BIN)


def _bucket(freq: float) -> int:
    """Index of the ``SUFFIX_BUCKETS`` interval holding a conditional frequency (how many
    edges are at most ``freq``)."""
    return bisect_right(SUFFIX_BUCKETS, freq)


def _suffix_cell(matched: int, freq: float) -> tuple[int, int]:
    """The ``SuffixCandidate.pool`` key of a suffix draft position: (tokens matched before
    it, at most ``SUFFIX_MATCH_BINS``; its frequency bucket)."""
    return min(max(matched, 1), SUFFIX_MATCH_BINS), _bucket(freq)


def _frequencies(draft) -> list[float]:
    """Each position's chance that the text continues as the earlier occurrences of its
    context did: ``occ(P c) / (occ(P) + 1)`` for the continuation c of a context P seen
    ``occ(P)`` times (``Draft.support``), as PPM's escape method A estimates it (Cleary and
    Witten, "Data Compression Using Adaptive Coding and Partial String Matching", IEEE Trans.
    Commun. 1984: one pseudo-occurrence for a continuation never seen). The raw conditional
    frequency ``occ(P c) / occ(P)`` reads 1.0 after a single occurrence, which most own-text
    drafts are: the pool's prior at that frequency (mean 1.0) stayed at 1.0 until its cell saw
    a miss, however many hits it had, and on the 16 peer records (batch 16, int8) auto drafted
    12-15 tokens per row from a cell at 8 of 8 hits and 4 of 38 were accepted."""
    out, prev = [], 1.0
    for q, seen in zip(draft.probs, draft.support):
        out.append(q / prev * seen / (seen + 1))
        prev = q
    return out


class SuffixCandidate(ForwardingCandidate):
    """Suffix drafts (``SuffixProposer``; the row's own text and the job's finished answers),
    drafted every step up to the engine's cap (``SUFFIX_CAP_FACTOR * k`` for auto).

    Confidence: a position's chance of acceptance is its conditional frequency (the path
    probability over the previous position's, with one pseudo-occurrence for an unseen
    continuation: ``_frequencies``) calibrated by acceptance pooled over all rows
    per frequency bucket (``SUFFIX_BUCKETS``) and matched length (the draft's match plus the
    positions before it, up to ``SUFFIX_MATCH_BINS`` tokens), with a Beta prior of
    ``SUFFIX_PRIOR_STRENGTH`` pseudo-trials at the frequency itself. The match length matters
    as much as the frequency: on the 130-record Spec-Bench subset a first draft token seen
    after every earlier occurrence of its context (raw frequency >= 0.95) was accepted 34% of the
    time after a 1-token match and 92% after 8+ tokens; pooled by frequency alone, auto expected
    0.71 tokens from a 1-token suffix draft that gave 0.45. Every draft is scored against the
    emitted tokens as the lookup's are (its first position; positions 1..n where n suffix
    tokens were verified) (``pool``, [trials, hits] per cell, decays once per step,
    ``SUFFIX_POOL_DECAY``). Cost: none beyond the verify step's. The lookup runs for every row
    every step (``prepare``, before anything is chosen: its drafts are what the policy weighs,
    and the rows learn from them), so it is spent whichever draft the step verifies and is no
    part of the choice. Charging it to suffix drafts alone (as auto did, ~30 us per row
    measured once per calibration) weighed ~3% of a batch-16 int8 step against them on the
    16 peer records.

    num_rows (``counts_rows``): the rows of the verify step, a resumed job's placeholders
    included; the own-text factor depends on it (``SuffixProposer.draft``)."""

    name = "suffix"
    hysteresis = False
    counts_rows = True

    def __init__(self, proposer) -> None:
        self.proposer = proposer
        self.pool: dict[tuple[int, int], list[float]] = {}
        self._drafts: dict = {}  # seq id -> this step's suffix Draft (rows with one)
        self._freqs: dict = {}  # seq id -> its draft's ``_frequencies``
        self._verified: dict[int, int] = {}  # seq id -> suffix tokens verified this step

    def prepare(self, seqs, caps: list[int], num_rows: int | None = None) -> list[int]:
        rows = len(seqs) if num_rows is None else num_rows
        drafts = [self.proposer.draft(s, k, rows) for s, k in zip(seqs, caps)]
        self._drafts = {s.seq_id: d for s, d in zip(seqs, drafts) if d.ids}
        self._freqs = {sid: _frequencies(d) for sid, d in self._drafts.items()}
        for cell in self.pool.values():  # once per step (SUFFIX_POOL_DECAY)
            cell[0] *= SUFFIX_POOL_DECAY
            cell[1] *= SUFFIX_POOL_DECAY
        return [len(d.ids) for d in drafts]

    def reach(self, seqs, lengths: list[int]) -> list[list[float]]:
        """Product of conditional frequencies calibrated per ``_suffix_cell`` (position j of
        a draft matched on m tokens follows m + j matched tokens)."""
        out = []
        for s, n in zip(seqs, lengths):
            draft = self._drafts.get(s.seq_id)
            run, r = 1.0, []
            for j, freq in enumerate(self._freqs[s.seq_id][:n] if draft is not None else ()):
                trials, hits = self.pool.get(_suffix_cell(draft.match_len + j, freq), (0, 0))
                run *= (hits + SUFFIX_PRIOR_STRENGTH * freq) / (trials + SUFFIX_PRIOR_STRENGTH)
                r.append(run)
            out.append(r)
        return out

    def proposal(self, seq) -> list[int]:
        """The row's suffix draft this step, before any cut ([] if none)."""
        d = self._drafts.get(seq.seq_id)
        return d.ids if d is not None else []

    def drafts(self, seqs, lengths: list[int], ctx: float) -> list[list[int]]:
        for s, n in zip(seqs, lengths):
            self._verified[s.seq_id] = n
        return [self._drafts[s.seq_id].ids[:n] for s, n in zip(seqs, lengths)]

    def observe(self, seq, emitted: list[int]) -> None:
        draft = self._drafts.pop(seq.seq_id, None)
        freqs = self._freqs.pop(seq.seq_id, None)
        verified = self._verified.pop(seq.seq_id, 0)
        if draft is None:
            return
        # as ``LookupCandidate.observe``: position 0, and 1..n where n suffix tokens were
        # verified (another draft's accepted tokens show more of this one where text copies)
        for j in range(min(len(draft.ids), len(emitted), verified + 1)):
            cell = self.pool.setdefault(_suffix_cell(draft.match_len + j, freqs[j]), [0.0, 0.0])
            cell[0] += 1.0
            if draft.ids[j] != emitted[j]:
                break
            cell[1] += 1.0

    def global_state(self) -> dict:
        return {"pool": [[m, b, t, h] for (m, b), (t, h) in sorted(self.pool.items())]}

    def set_global_state(self, state: dict) -> None:
        self.pool = {(int(m), int(b)): [float(t), float(h)] for m, b, t, h in state["pool"]}

    def _drop(self, seq) -> None:
        self._drafts.pop(seq.seq_id, None)
        self._freqs.pop(seq.seq_id, None)
        self._verified.pop(seq.seq_id, None)
