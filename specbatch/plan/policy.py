"""Online choice of the draft length, per step, from measured cost and observed acceptance.

Each step the proposer drafts up to k_max tokens per row (cheap for prompt lookup). The policy
then picks one draft length K for the step (rows with shorter drafts keep theirs) that
maximises expected output tokens per second:

    rate(K) = sum_rows E[tokens emitted | draft truncated to K] / step_time(rows, K + 1, ctx)

E[tokens] = 1 + sum_{i=1..K'} prod_{j<=i} p_j (K' = the row's draft length, capped at K), where
p_j is the row's conditional acceptance at draft position j: a Beta posterior whose prior is
the record's predicted acceptance (``predict``) and whose counts are the row's own recent
history, decayed so a record whose text changes is followed. One K per step because the
padded batch costs by its longest row: a row drafting fewer tokens saves nothing.

The policy also learns while it drafts nothing: a lookup draft is computed every step anyway, so
comparing it with the tokens the target then emits tells whether it would have been accepted
(at K = 0 only the first draft position can be checked). K therefore returns from 0 as soon as
a record starts copying, without probe steps. Hysteresis: K changes only when the new choice is
predicted to be ``switch_margin`` better than keeping the current one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.plan.costmodel import CostModel


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
        n = min(len(draft), len(emitted))
        if n == 0:
            return
        while len(self.trials) < len(draft):
            self.trials.append(0.0)
            self.hits.append(0.0)
        for j in range(len(self.trials)):
            self.trials[j] *= decay
            self.hits[j] *= decay
        for j in range(n):  # position j is tried only if 0..j-1 matched
            self.trials[j] += 1.0
            if draft[j] != emitted[j]:
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
                 switch_margin: float = 0.03) -> None:
        self.cost = cost
        self.k_max = k_max
        self.prior_for = prior_for
        self.decay = decay
        self.switch_margin = switch_margin
        self.rows: dict[int, RowAcceptance] = {}
        self.current_k = k_max

    def _row(self, seq) -> RowAcceptance:
        acc = self.rows.get(seq.seq_id)
        if acc is None:
            acc = self.rows[seq.seq_id] = RowAcceptance(self.prior_for(seq))
        return acc

    def rate(self, seqs, drafts: list[list[int]], k: int) -> float:
        """Expected output tokens per second if every draft is cut to ``k`` tokens."""
        ctx = max(len(s.token_ids) for s in seqs)
        tokens = sum(self._row(s).expected_tokens(min(k, len(d))) for s, d in zip(seqs, drafts))
        q = 1 + min(k, max((len(d) for d in drafts), default=0))
        return tokens / self.cost.step_time(len(seqs), q, ctx)

    def select(self, seqs, drafts: list[list[int]]) -> list[list[int]]:
        """Cut the drafts to this step's chosen length."""
        longest = max((len(d) for d in drafts), default=0)
        if longest == 0:
            return drafts
        rates = {k: self.rate(seqs, drafts, k) for k in range(0, min(self.k_max, longest) + 1)}
        best = max(rates, key=lambda k: (rates[k], -k))
        keep = min(self.current_k, longest)
        if rates[best] > rates[keep] * (1 + self.switch_margin):
            self.current_k = best
            keep = best
        return [d[:keep] for d in drafts]

    def observe(self, seq, draft: list[int], emitted: list[int]) -> None:
        self._row(seq).observe(draft, emitted, self.decay)

    def finish(self, seq) -> None:
        self.rows.pop(seq.seq_id, None)
