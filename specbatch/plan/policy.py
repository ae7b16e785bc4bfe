"""Online choice of the draft length, per row and per step, from measured cost and acceptance.

Each step the proposer drafts up to k_max tokens per row (cheap for prompt lookup). The policy
then cuts each row's draft to the length that maximises expected output tokens per second:

    rate = sum_rows E[tokens emitted | row i feeds k_i drafts]
           / step_time(rows, 1 + max k_i, ctx, tokens = sum (1 + k_i))

E[tokens] = 1 + sum_{j=1..k_i} prod_{m<=j} p_m, where p_m is the row's conditional acceptance
at draft position m: a Beta posterior whose prior is the record's predicted acceptance
(``predict``) and whose counts are the row's own recent history, decayed so a record whose
text changes is followed. The runner packs the real tokens of a verify step for the dense
layers, so a row's extra draft token costs ``CostModel.token_cost`` seconds (the dense slope at
the step's token count, plus its attention over the row's keys where the forward packs attention
too, ``CostModel.packed``; elsewhere attention is padded to the longest row). For each step cap
K in 0..k_max every row keeps draft position j only while the chance that positions 1..j are
all accepted is worth that token at the step's rate (a fixed point of three rounds), and the
cap with the best rate wins.

The policy also learns while it drafts nothing: a lookup draft is computed every step anyway, so
comparing it with the tokens the target then emits tells whether it would have been accepted
(at K = 0 only the first draft position can be checked). K therefore returns from 0 as soon as
a record starts copying, without probe steps. Hysteresis: the step cap K changes only when the
new choice is predicted to be ``switch_margin`` better than keeping the current one.

Probe: once a row has committed ``Probe.tokens`` output tokens (16 by default), the policy
replays prompt lookup over them (``spec_decode.replay``: exact at any temperature, since the committed
tokens do not depend on what was drafted) and replaces the row's counts with the replayed ones:
every draft position is then measured, even for a row that ran at K = 0. The replayed acceptance
length of each record's first probe is kept in ``probe_results`` (the record's ``probe`` stats).
No token is generated twice.

Draft model (``--method auto --draft-model NAME``; ``spec_decode.composite``): after choosing the
lookup drafts, the policy asks whether some rows should draft with the model instead. Its
acceptance per row is the row's own decayed counts over a prior pooled across all rows (which
starts at ``MODEL_PRIOR``); its cost is a second ``OnlineCost`` for the draft's forward,
calibrated like the target's and refitted with the timed draft forwards of the run. A row takes
the model when its drafts are worth more than its lookup drafts at the step's token value, and
the step uses the model at all only if the verify step plus the draft forwards it adds still
give more tokens per second than lookup alone. So each row, each step, drafts with lookup, the
model or nothing; ``steps_by_proposer`` counts which, per record.

Suffix drafts (``spec_decode.suffix``, routed by ``spec_decode.composite.WithSuffix``): every
step the policy also asks the suffix proposer for each row's draft (up to the engine's cap,
which for auto is ``SUFFIX_CAP_FACTOR * k``) with each position's frequency-based path
probability. A position's chance of acceptance is its conditional frequency (the path
probability over the previous position's) calibrated by acceptance pooled over all rows per
frequency bucket (``SUFFIX_BUCKETS``) and matched length (the draft's match plus the positions
before it, up to ``SUFFIX_MATCH_BINS`` tokens), with a Beta prior of ``SUFFIX_PRIOR_STRENGTH``
pseudo-trials at the frequency itself. The match length matters as much as the frequency: on the
130-record Spec-Bench subset a first draft token seen after every earlier occurrence of its
context (frequency >= 0.95) was accepted 34% of the time after a 1-token match and 92% after 8+
tokens (session 15); pooled by frequency alone, auto expected 0.71 tokens from a 1-token suffix
draft that gave 0.45. Like lookup drafts, suffix drafts are checked against the emitted tokens
every step, verified or not (the pool decays once per step, ``SUFFIX_POOL_DECAY``). A row takes
its suffix draft when it is worth more than its lookup draft at the step's token value, and the
step uses suffix drafts only if its predicted rate beats lookup alone. The lookup's own CPU time is
measured every step (``suffix_seconds``, an exponential mean) and counted in that comparison.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import takewhile

from specbatch.plan.costmodel import CostModel, OnlineCost
from specbatch.spec_decode.replay import NgramReplay
from specbatch.spec_decode.stats import SpecStats


MODEL_PRIOR = 0.7  # a draft model's conditional acceptance before it has drafted anything
MODEL_PRIOR_STRENGTH = 4.0  # pseudo-trials behind the pooled acceptance in a row's estimate
POOL_DECAY = 0.995  # per observed row-step, for acceptance pooled over all rows
# per verify step, for the suffix pool: decayed per row-step, its memory at batch 16 was ~12
# steps, the cell estimates noisy, and auto took suffix drafts where a cell read high by chance
SUFFIX_POOL_DECAY = 0.995
SUFFIX_BUCKETS = (0.2, 0.4, 0.6, 0.8, 0.95)  # edges: a suffix draft position's frequency
SUFFIX_PRIOR_STRENGTH = 2.0  # pseudo-trials at the frequency itself, per bucket
# the least share of its pseudo-trials a row's prior keeps as the row's own counts decay
# (``RowAcceptance``): a position seldom tried still leans on it
PRIOR_FLOOR = 0.05
SUFFIX_MATCH_BINS = 8  # matched tokens behind a suffix draft position: 1 .. 8 (8 and more)


@dataclass(frozen=True)
class Probe:
    """Replay prompt lookup (``prompt_lookup_min``/``max``, tokens) over a row's first
    ``tokens`` committed tokens. max_model_len: the run's context cap (tokens)."""

    tokens: int = 16
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    max_model_len: int = 1 << 30


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


def _logit_shift(p: float, p_group: float, p_all: float) -> float:
    """``p`` moved in logit space by ``logit(p_group) - logit(p_all)``: the odds of a row's
    estimate scaled by how much likelier its group accepts than everyone."""
    odds = p / max(1.0 - p, 1e-9) * (p_group / max(1.0 - p_group, 1e-9)) \
        / (p_all / max(1.0 - p_all, 1e-9))
    return odds / (1.0 + odds)


def _bucket(freq: float) -> int:
    """Index of the ``SUFFIX_BUCKETS`` interval holding a conditional frequency."""
    return sum(1 for edge in SUFFIX_BUCKETS if freq >= edge)


def _suffix_cell(matched: int, freq: float) -> tuple[int, int]:
    """The ``AdaptivePolicy.suffix_pool`` key of a suffix draft position: (tokens matched
    before it, at most ``SUFFIX_MATCH_BINS``; its frequency bucket)."""
    return min(max(matched, 1), SUFFIX_MATCH_BINS), _bucket(freq)


def _context(seqs) -> float:
    """The step's context for the cost model: the rows' mean length (tokens). Attention reads
    each row up to its own length, so a step costs by the sum over rows; the longest row times
    the rows priced a batch of 10 rows at 600-1300 tokens 25-35% high (summarization records,
    session 15), and drafting looked cheaper than it was."""
    return sum(len(s.token_ids) for s in seqs) / len(seqs)


def _online(cost: CostModel) -> CostModel | OnlineCost:
    """A calibrated model keeps fitting to the run's steps; a synthetic one (no samples) stays."""
    return cost if isinstance(cost, OnlineCost) or not cost.samples else OnlineCost(cost)


class AdaptivePolicy:
    """Chooses the step's draft length from a ``CostModel`` and per-row acceptance.

    prior_for(seq) -> [(alpha, beta)] per draft position: the planner's prediction.
    match_len_of(seq) -> int: the n-gram size behind the row's lookup draft this step
    (``NgramProposer.match_len``); drafts from longer matches are accepted more often, and the
    policy learns by how much, pooled over rows (``_reach``).
    proposer, model_cost: a ``LookupAndDraftProposer`` and the draft forward's ``CostModel``
    (both or neither; ``ValueError`` otherwise); model_prior: the draft model's assumed
    conditional acceptance until it has drafted. A row never seen gets the prior.
    """

    def __init__(self, cost: CostModel, k_max: int, prior_for, decay: float = 0.9,
                 switch_margin: float = 0.03, probe: Probe | None = None,
                 proposer=None, model_cost: CostModel | None = None,
                 model_prior: float = MODEL_PRIOR, match_len_of=None, suffix=None) -> None:
        self.cost = _online(cost)
        # suffix drafts (``spec_decode.composite.WithSuffix``): per (matched tokens, frequency
        # bucket) (``_suffix_cell``), decayed [trials, hits] of a draft position given the
        # ones before it were accepted
        self.suffix = suffix
        self.suffix_pool: dict[tuple[int, int], list[float]] = {}
        self._suffix_drafts: dict = {}  # seq id -> this step's suffix Draft
        self._suffix_used: set[int] = set()  # seq ids verified with their suffix draft
        self.suffix_seconds: float | None = None  # measured suffix lookup time per step
        # match_len_of(seq) -> n-gram size behind the row's lookup draft this step (0: none)
        self.match_len_of = match_len_of
        self._match: dict[int, int] = {}  # seq id -> this step's match length
        self.lookup_pool = RowAcceptance([(1.0, 1.0)])  # lookup acceptance, all rows pooled
        self.by_match_len: dict[int, RowAcceptance] = {}  # n -> the same, drafts from n-grams
        # draft model (``spec_decode.composite.LookupAndDraftProposer``) and its forward's step cost
        self.proposer = proposer
        self.model_cost = _online(model_cost) if model_cost is not None else None
        if (proposer is None) != (model_cost is None):
            raise ValueError("a draft model needs both proposer and model_cost")
        self.model_pool = RowAcceptance([(model_prior * MODEL_PRIOR_STRENGTH,
                                          (1 - model_prior) * MODEL_PRIOR_STRENGTH)])
        self.model_rows: dict[int, RowAcceptance] = {}  # seq id -> the model's own counts
        self._model_drafts: dict[int, list[int]] = {}  # seq id -> this step's model drafts
        self.using_model = False
        # request tag -> steps per source ("ngram", "draft", "none")
        self.steps_by_proposer: dict = {}
        self.k_max = k_max
        self.prior_for = prior_for
        self.decay = decay
        self.switch_margin = switch_margin
        self.probe = probe
        self.rows: dict[int, RowAcceptance] = {}
        self.probed: set[int] = set()  # seq ids
        # request tag -> (replayed mean acceptance length at k_max or None, probe tokens)
        self.probe_results: dict = {}
        self.current_k = k_max

    def _row(self, seq) -> RowAcceptance:
        acc = self.rows.get(seq.seq_id)
        if acc is None:
            acc = self.rows[seq.seq_id] = RowAcceptance(self.prior_for(seq))
        return acc

    def rate(self, seqs, drafts: list[list[int]], k: int) -> float:
        """Expected output tokens per second if every draft is cut to ``k`` tokens."""
        return self._rate(seqs, [min(k, len(d)) for d in drafts])

    def _rate(self, seqs, cuts: list[int], reach: list[list[float]] | None = None) -> float:
        """Expected output tokens per second if row i feeds ``cuts[i]`` draft tokens (rows
        run packed: the dense layers cost by the real tokens, attention by the longest row or,
        where packed, by the real tokens; at the rows' mean context, ``_context``).
        reach: per row, the chances that draft positions 0..j are all accepted (``_reach``)."""
        if reach is None:
            reach = self._reach(seqs, cuts)
        ctx = _context(seqs)
        tokens = len(seqs) + sum(sum(r[:c]) for r, c in zip(reach, cuts))
        q = 1 + max(cuts, default=0)
        return tokens / self.cost.step_time(len(seqs), q, ctx, num_tokens=len(seqs) + sum(cuts))

    def _reach(self, seqs, lengths: list[int]) -> list[list[float]]:
        """Per row: ``[prod_{m<=j} p_m for j < lengths[i]]`` (expected extra tokens per draft
        position, E[tokens] = 1 + their sum). With match lengths, each p_m is the row's own
        estimate shifted in logit by how much more (or less) often drafts from this step's
        n-gram size are accepted than lookup drafts overall, pooled over all rows."""
        out = []
        for s, n in zip(seqs, lengths):
            acc, run, r = self._row(s), 1.0, []
            pool_n = self.by_match_len.get(self._match.get(s.seq_id, 0))
            for j in range(n):
                p = acc.p(j)
                if pool_n is not None:
                    p = _logit_shift(p, pool_n.p(j), self.lookup_pool.p(j))
                run *= p
                r.append(run)
            out.append(r)
        return out

    def _cuts(self, seqs, drafts: list[list[int]], k: int,
              reach: list[list[float]]) -> list[int]:
        """Per-row draft lengths under a step cap ``k``: row i keeps draft position j only if
        the chance that positions 0..j are all accepted (the expected extra tokens it brings)
        is worth the packed token it costs at the step's rate (Dinkelbach-style fixed point,
        3 rounds from "keep everything")."""
        cuts = [min(k, len(d)) for d in drafts]
        for _ in range(3):
            # a packed token's price: the dense slope at the step's token count (plus scoring
            # the row's keys where attention is packed)
            rate = self._rate(seqs, cuts, reach)
            slope, per_key = self.cost.token_cost(len(seqs) + sum(cuts)), self.cost.token_key_cost
            new = []
            for s, r, c0 in zip(seqs, reach, (min(k, len(d)) for d in drafts)):
                threshold = rate * (slope + per_key * len(s.token_ids))
                new.append(min(c0, sum(1 for _ in takewhile(lambda x: x >= threshold, r))))
            if new == cuts:
                break
            cuts = new
        return cuts

    def select(self, seqs, drafts: list[list[int]],
               caps: list[int] | None = None) -> list[list[int]]:
        """Cut the lookup drafts to this step's chosen lengths (per row, under one step cap);
        with a draft model, replace some rows' drafts by the model's (``_select_model``).
        caps: the most tokens each row may draft this step (its k, ``max_tokens`` and the
        context; the engine's ``_draft_caps``); default k_max."""
        self._model_drafts = {}
        if self.match_len_of is not None:
            self._match = {s.seq_id: self.match_len_of(s) for s, d in zip(seqs, drafts) if d}
        cuts, rate = self._select_lookup(seqs, drafts)
        chosen = [d[:c] for d, c in zip(drafts, cuts)]
        caps = caps if caps is not None else [self.k_max] * len(seqs)
        if self.proposer is not None:
            chosen = self._select_model(seqs, chosen, rate, caps)
        self._suffix_used = set()
        if self.suffix is not None:
            chosen = self._select_suffix(seqs, chosen, rate, caps)
        for s, d in zip(seqs, chosen):
            source = ("draft" if s.seq_id in self._model_drafts else
                      "suffix" if s.seq_id in self._suffix_used else "ngram" if d else "none")
            self.steps_by_proposer.setdefault(s.request.tag, Counter())[source] += 1
        return chosen

    def _select_lookup(self, seqs, drafts: list[list[int]]) -> tuple[list[int], float]:
        """Per-row lookup draft lengths under the chosen step cap, and their predicted rate
        (tokens/s)."""
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return [0] * len(seqs), self._rate(seqs, [0] * len(seqs), [[] for _ in seqs])
        reach = self._reach(seqs, [min(self.k_max, len(d)) for d in drafts])
        options = {k: self._cuts(seqs, drafts, k, reach)
                   for k in range(0, min(self.k_max, longest) + 1)}
        rates = {k: self._rate(seqs, cuts, reach) for k, cuts in options.items()}
        best = max(rates, key=lambda k: (rates[k], -k))
        keep = min(self.current_k, longest)
        if rates[best] > rates[keep] * (1 + self.switch_margin):
            self.current_k = best
            keep = best
        return options[keep], rates[keep]

    def _model_reach(self, seq, n: int) -> list[float]:
        """As ``_reach`` for the draft model: the row's own decayed counts over a prior of
        ``PRIOR_STRENGTH`` pseudo-trials at the pooled acceptance of all rows so far."""
        acc = self.model_rows.get(seq.seq_id)
        run, out = 1.0, []
        for j in range(n):
            t = acc.trials[j] if acc is not None and j < len(acc.trials) else 0.0
            h = acc.hits[j] if acc is not None and j < len(acc.hits) else 0.0
            run *= (h + MODEL_PRIOR_STRENGTH * self.model_pool.p(j)) / (t + MODEL_PRIOR_STRENGTH)
            out.append(run)
        return out

    def _select_model(self, seqs, chosen: list[list[int]], lookup_rate: float,
                      caps: list[int]) -> list[list[int]]:
        """Rows whose draft-model drafts are worth more than their lookup drafts draft with the
        model this step, if the step's rate, draft forwards included, beats lookup alone.

        At the lookup choice's rate r, one more verified token costs ``r * token_cost`` tokens;
        a row takes the model's draft length ``d`` (under a cap D) whose positions each reach
        that value, and switches to the model if its net gain ``sum(reach[:d]) - d * value``
        beats the lookup's. The step's rate then pays the verify step plus D draft forwards
        (``model_cost.step_time`` at the rows still drafting at each depth); the best cap D
        is compared with lookup alone, with the same hysteresis as the step cap.

        A row the draft cache does not hold yet must first be prefilled into it (its whole
        context, once): that cost, spread over the row's remaining steps (``_entry_seconds``),
        is charged to the row's choice and to the step."""
        n = len(seqs)
        ctx = _context(seqs)
        value = lookup_rate * self.cost.token_cost(n + sum(len(d) for d in chosen), ctx)
        lookup_reach = self._reach(seqs, [len(d) for d in chosen])
        lookup_net = [sum(r) - len(r) * value for r in lookup_reach]
        model_reach = [self._model_reach(s, min(self.k_max, c)) for s, c in zip(seqs, caps)]
        entry = [0.0 if self.proposer.has_model_row(s) else self._entry_seconds(s, r)
                 for s, r in zip(seqs, model_reach)]
        best = None  # (rate, lengths per row, 0 = keep the lookup draft)
        for cap in range(1, self.k_max + 1):
            lengths = []
            for r, net, e in zip(model_reach, lookup_net, entry):
                d = sum(1 for _ in takewhile(lambda x: x >= value, r[:cap]))
                gain = sum(r[:d]) - d * value - e * lookup_rate
                lengths.append(d if d and gain > net else 0)
            if not any(lengths):
                continue
            tokens = n + sum(sum(mr[:d]) if d else sum(lr)
                             for mr, lr, d in zip(model_reach, lookup_reach, lengths))
            fed = [d if d else len(c) for d, c in zip(lengths, chosen)]
            seconds = self.cost.step_time(n, 1 + max(fed), ctx, num_tokens=n + sum(fed))
            seconds += sum(e for e, d in zip(entry, lengths) if d)
            for depth in range(max(lengths)):
                rows = sum(1 for d in lengths if d > depth)
                seconds += self.model_cost.step_time(rows, 1, ctx, num_tokens=rows)
            rate = tokens / seconds
            if best is None or rate > best[0]:
                best = (rate, lengths)
        margin = (1 + self.switch_margin) if not self.using_model else 1 / (1 + self.switch_margin)
        self.using_model = best is not None and best[0] > lookup_rate * margin
        if not self.using_model:
            return chosen
        rows = [i for i, d in enumerate(best[1]) if d]
        model_seqs = [seqs[i] for i in rows]
        self.proposer.start_model(model_seqs)
        t0 = time.perf_counter()
        model_drafts = self.proposer.propose_with_model(model_seqs, [best[1][i] for i in rows])
        seconds = time.perf_counter() - t0
        depth = max((len(d) for d in model_drafts), default=0)
        if depth and isinstance(self.model_cost, OnlineCost):  # mean seconds per draft forward
            self.model_cost.observe(len(rows), 1, ctx, len(rows), seconds / depth)
        out = list(chosen)
        for i, d in zip(rows, model_drafts):
            out[i] = d
            self._model_drafts[seqs[i].seq_id] = d
        return out

    def _suffix_reach(self, draft) -> list[float]:
        """Per position of a suffix ``Draft``: the chance it and the ones before it are all
        accepted (product of conditional frequencies calibrated per ``_suffix_cell``: position
        j of a draft matched on m tokens follows m + j matched tokens)."""
        run, prev, out = 1.0, 1.0, []
        for j, q in enumerate(draft.probs):
            freq = q / prev
            prev = q
            trials, hits = self.suffix_pool.get(_suffix_cell(draft.match_len + j, freq), (0, 0))
            run *= (hits + SUFFIX_PRIOR_STRENGTH * freq) / (trials + SUFFIX_PRIOR_STRENGTH)
            out.append(run)
        return out

    def _select_suffix(self, seqs, chosen: list[list[int]], lookup_rate: float,
                       caps: list[int]) -> list[list[int]]:
        """Rows (not drafting with the model) whose suffix draft, cut where a position stops
        being worth a packed token at the step's value, gains more than their current draft;
        kept if the step's predicted rate, suffix lookup time included, beats it without."""
        # the lookup's CPU time (Python on this thread): wall time counted other processes'
        # turns on a busy machine, priced suffix drafts by the load of the moment
        t0 = time.thread_time()
        drafts = self.suffix.propose_suffix(seqs, caps)
        seconds = time.thread_time() - t0
        self.suffix_seconds = (seconds if self.suffix_seconds is None
                               else 0.8 * self.suffix_seconds + 0.2 * seconds)
        self._suffix_drafts = {s.seq_id: d for s, d in zip(seqs, drafts) if d.ids}
        for cell in self.suffix_pool.values():  # once per step (SUFFIX_POOL_DECAY)
            cell[0] *= SUFFIX_POOL_DECAY
            cell[1] *= SUFFIX_POOL_DECAY
        if not self._suffix_drafts:
            return chosen
        ctx = _context(seqs)
        value = lookup_rate * self.cost.token_cost(len(seqs) + sum(len(d) for d in chosen), ctx)
        reach = self._reach(seqs, [len(d) for d in chosen])
        out, use = list(chosen), set()
        for i, (s, d) in enumerate(zip(seqs, drafts)):
            if not d.ids or s.seq_id in self._model_drafts:
                continue
            r = self._suffix_reach(d)
            n = sum(1 for _ in takewhile(lambda x: x >= value, r))
            if n and sum(r[:n]) - n * value > sum(reach[i]) - len(chosen[i]) * value:
                out[i], reach[i] = d.ids[:n], r[:n]
                use.add(s.seq_id)
        if not use:
            return chosen
        fed = [len(d) for d in out]
        step = self.cost.step_time(len(seqs), 1 + max(fed), ctx, num_tokens=len(seqs) + sum(fed))
        rate = (len(seqs) + sum(sum(r) for r in reach)) / (step + self.suffix_seconds)
        if rate <= lookup_rate:
            return chosen
        self._suffix_used = use
        return out

    def _observe_suffix(self, seq, emitted: list[int]) -> None:
        """Check this step's suffix draft against the emitted tokens (verified or not)."""
        draft = self._suffix_drafts.pop(seq.seq_id, None)
        if draft is None:
            return
        prev = 1.0
        for j in range(min(len(draft.ids), len(emitted))):
            key = _suffix_cell(draft.match_len + j, draft.probs[j] / prev)
            cell = self.suffix_pool.setdefault(key, [0.0, 0.0])
            prev = draft.probs[j]
            cell[0] += 1.0
            if draft.ids[j] != emitted[j]:
                break
            cell[1] += 1.0

    def _entry_seconds(self, seq, reach: list[float]) -> float:
        """Seconds of prefilling the row's context into the draft cache, per remaining step
        (remaining output tokens over the tokens a model-drafted step is expected to emit)."""
        prefill = self.model_cost.step_time(1, 1, 0, num_tokens=len(seq.token_ids))
        remaining = max(seq.sampling.max_tokens - seq.num_output_tokens, 1)
        return prefill * (1.0 + sum(reach)) / remaining

    def observe_step(self, seqs, drafts: list[list[int]], seconds: float) -> None:
        """A verify step's wall time (seconds), for the online cost fit (``OnlineCost``)."""
        if isinstance(self.cost, OnlineCost):
            self.cost.observe(len(seqs), 1 + max((len(d) for d in drafts), default=0),
                              _context(seqs),
                              sum(1 + len(d) for d in drafts), seconds)

    def observe(self, seq, draft: list[int], emitted: list[int]) -> None:
        """draft: the row's full lookup proposal (checked against ``emitted`` whether or not it
        was verified); the draft model's drafts of this step are learned from too."""
        self._row(seq).observe(draft, emitted, self.decay)
        n = self._match.pop(seq.seq_id, 0)
        if n:
            self.by_match_len.setdefault(n, RowAcceptance([(1.0, 1.0)])).observe(
                draft, emitted, POOL_DECAY)
            self.lookup_pool.observe(draft, emitted, POOL_DECAY)
        self._observe_suffix(seq, emitted)
        model_draft = self._model_drafts.pop(seq.seq_id, None)
        if model_draft is not None:
            row = self.model_rows.setdefault(seq.seq_id, RowAcceptance([(1.0, 1.0)]))
            row.observe(model_draft, emitted, self.decay)
            self.model_pool.observe(model_draft, emitted, POOL_DECAY)
        if (self.probe is not None and seq.seq_id not in self.probed
                and seq.num_output_tokens >= self.probe.tokens):
            self._run_probe(seq)

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

    def finish(self, seq) -> None:
        self.rows.pop(seq.seq_id, None)
        self.model_rows.pop(seq.seq_id, None)
        self._suffix_drafts.pop(seq.seq_id, None)
        self.probed.discard(seq.seq_id)
