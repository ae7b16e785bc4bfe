"""Online choice of the draft length, per row and per step, from measured cost and acceptance.

Each step the proposer drafts up to k_max tokens per row (cheap for prompt lookup). The policy
then cuts each row's draft to the length that maximises expected output tokens per second:

    rate = sum_rows E[tokens emitted | row i feeds k_i drafts]
           / step_time(rows, 1 + max k_i, ctx, tokens = sum (1 + k_i))

E[tokens] = 1 + sum_{j=1..k_i} prod_{m<=j} p_m, where p_m is the row's conditional acceptance
at draft position m: a Beta posterior whose prior is the record's predicted acceptance
(``predict``) and whose counts are the row's own recent history, decayed so a record whose
text changes is followed. The runner packs the real tokens of a verify step for the dense
layers, so a row's extra draft token costs ``CostModel.token_cost`` seconds; attention is
padded to the longest row. For each step cap K in 0..k_max every row keeps draft position j
only while the chance that positions 1..j are all accepted is worth that token at the step's
rate (a fixed point of three rounds), and the cap with the best rate wins.

The policy also learns while it drafts nothing: a lookup draft is computed every step anyway, so
comparing it with the tokens the target then emits tells whether it would have been accepted
(at K = 0 only the first draft position can be checked). K therefore returns from 0 as soon as
a record starts copying, without probe steps. Hysteresis: the step cap K changes only when the
new choice is predicted to be ``switch_margin`` better than keeping the current one.

Probe: once a row has committed ``Probe.tokens`` output tokens (16 by default), the policy
replays prompt lookup over them (``spec.replay``: exact at any temperature, since the committed
tokens do not depend on what was drafted) and replaces the row's counts with the replayed ones:
every draft position is then measured, even for a row that ran at K = 0. The replayed acceptance
length of each record's first probe is kept in ``probe_results`` (the record's ``probe`` stats).
No token is generated twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile

from specbatch.plan.costmodel import CostModel, OnlineCost
from specbatch.spec.replay import NgramReplay
from specbatch.spec.stats import SpecStats


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
    """Decayed per-position counts for one sequence. prior: (alpha, beta) per position."""

    prior: list[tuple[float, float]]
    trials: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)

    def p(self, j: int) -> float:
        a, b = self.prior[min(j, len(self.prior) - 1)]
        t = self.trials[j] if j < len(self.trials) else 0.0
        h = self.hits[j] if j < len(self.hits) else 0.0
        return (h + a) / (t + a + b)

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


class AdaptivePolicy:
    """Chooses the step's draft length from a ``CostModel`` and per-row acceptance.

    prior_for(seq) -> [(alpha, beta)] per draft position: the planner's prediction.
    Raises nothing; a row never seen gets the prior.
    """

    def __init__(self, cost: CostModel, k_max: int, prior_for, decay: float = 0.9,
                 switch_margin: float = 0.03, probe: Probe | None = None) -> None:
        self.cost = cost if isinstance(cost, OnlineCost) or not cost.samples else OnlineCost(cost)
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
        run packed: the dense layers cost by the real tokens, attention by the longest row).
        reach: per row, the chances that draft positions 0..j are all accepted (``_reach``)."""
        if reach is None:
            reach = self._reach(seqs, cuts)
        ctx = max(len(s.token_ids) for s in seqs)
        tokens = len(seqs) + sum(sum(r[:c]) for r, c in zip(reach, cuts))
        q = 1 + max(cuts, default=0)
        return tokens / self.cost.step_time(len(seqs), q, ctx, num_tokens=len(seqs) + sum(cuts))

    def _reach(self, seqs, lengths: list[int]) -> list[list[float]]:
        """Per row: ``[prod_{m<=j} p_m for j < lengths[i]]`` (expected extra tokens per draft
        position, E[tokens] = 1 + their sum)."""
        out = []
        for s, n in zip(seqs, lengths):
            acc, run, r = self._row(s), 1.0, []
            for j in range(n):
                run *= acc.p(j)
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
        token_cost = self.cost.token_cost()
        for _ in range(3):
            threshold = self._rate(seqs, cuts, reach) * token_cost
            new = [min(c0, sum(1 for _ in takewhile(lambda x: x >= threshold, r)))
                   for r, c0 in zip(reach, (min(k, len(d)) for d in drafts))]
            if new == cuts:
                break
            cuts = new
        return cuts

    def select(self, seqs, drafts: list[list[int]]) -> list[list[int]]:
        """Cut the drafts to this step's chosen lengths (per row, under one step cap)."""
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return drafts
        reach = self._reach(seqs, [min(self.k_max, len(d)) for d in drafts])
        options = {k: self._cuts(seqs, drafts, k, reach)
                   for k in range(0, min(self.k_max, longest) + 1)}
        rates = {k: self._rate(seqs, cuts, reach) for k, cuts in options.items()}
        best = max(rates, key=lambda k: (rates[k], -k))
        keep = min(self.current_k, longest)
        if rates[best] > rates[keep] * (1 + self.switch_margin):
            self.current_k = best
            keep = best
        return [d[:c] for d, c in zip(drafts, options[keep])]

    def observe_step(self, seqs, drafts: list[list[int]], seconds: float) -> None:
        """A verify step's wall time (seconds), for the online cost fit (``OnlineCost``)."""
        if isinstance(self.cost, OnlineCost):
            self.cost.observe(len(seqs), 1 + max((len(d) for d in drafts), default=0),
                              max(len(s.token_ids) for s in seqs),
                              sum(1 + len(d) for d in drafts), seconds)

    def observe(self, seq, draft: list[int], emitted: list[int]) -> None:
        self._row(seq).observe(draft, emitted, self.decay)
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
        self.probed.discard(seq.seq_id)
