"""Online choice of each row's draft, per step, from measured cost and per-candidate confidence.

Each step the policy chooses, for every row, which candidate (``auto.candidate.Candidate``)
drafts and how many of its tokens are verified, to maximise expected output tokens per second:

    rate = sum_rows E[tokens emitted | row i feeds k_i drafts]
           / (step_time(rows, 1 + max k_i, ctx, tokens = sum (1 + k_i)) + drafting seconds)

E[tokens] = 1 + sum_{j<k_i} reach_i[j], where reach_i[j] is the candidate's chance that draft
positions 0..j are all accepted (``Candidate.reach``). The runner packs the real tokens of a
verify step for the dense layers, so a row's extra draft token costs ``CostModel.token_cost``
seconds (the dense slope at the step's token count, plus its attention over the row's keys where
the forward packs attention too, ``CostModel.packed``; elsewhere attention is padded to the
longest row).

One loop, two stages:

1. The base candidate (prompt lookup, ``LookupCandidate``; drafted every step) sets the step:
   for each step cap K in 0..k_max every row keeps draft position j only while its reach is
   worth that token at the step's rate (a fixed point of three rounds; at one row every cut
   is priced instead, ``_one_row``), and the cap with the best rate wins. Hysteresis: K
   changes only when the new choice is predicted to be ``switch_margin`` better than keeping
   the current one.
2. Every other candidate, in order (``methods`` registration order: the draft model, then
   suffix, then any registered method with ``auto=True``), is offered the rows no earlier
   candidate took (``_offer``). At the base's rate r one more verified token costs
   ``r * token_cost`` tokens (its value); for each of the candidate's step caps a row takes the
   candidate's draft, cut where a position stops being worth that value, if its net gain
   ``sum(reach[:d]) - d * value - entry_seconds * r`` beats its current draft's; the step then
   pays the verify step plus the candidate's ``step_seconds`` and the rows' entry seconds, and
   the candidate is used only if the best cap's rate beats the base's (by ``switch_margin``
   for a candidate with ``hysteresis``, which once used is kept unless the base is that much
   better). Only then does the candidate draft (``Candidate.drafts``).

The drain: while requests wait for rows (or a row's record has a later turn), a row that
accepts a draft token frees its row a step sooner for the next request, so an accepted token
saves what a token of the step costs on average, and the rate above is the job's. Once nothing
waits (``Engine.draining``) the job ends with its last rows. A step of R rows costs
``t(R) = S + R * D`` at one token a row, D = ``(t(R) - t(1)) / (R - 1)`` the cost of one row
more (t: a plain step at the rows' mean context; its mean over the rows the batch shrinks
through, where the matmul tiles make one row's step uneven) and S the rest (``_drain``).
An accepted token saves its row's share D; the per-step part S shrinks only as fast as the
slowest row progresses. So in the drain the seconds a step's drafts save are
``D * sum_i a_i + S * min_i a_i`` (a_i: row i's expected accepted tokens) where the queue's rate
counts ``D * sum_i a_i + S * mean_i a_i``; the policy keeps its rate machinery and prices a
step as ``(R + sum_i a_i + (S / D) * min_i a_i) / (step_time - S)`` (``_bonus`` = S / D). A
row's draft positions are cut at a token's worth of 1, and, where every row proposes, also at
``1 + (S / D) / R`` (every row drafting raises the least a_i), the better rate of the two per
step cap (``_cuts``, ``_offer``). At one row the drain prices as the queue: that row's steps
are the job's. Priced as the queue's rate, the 16 peer records at batch 16 (one wave: all
drain) drafted 489 tokens in auto's weighed steps (302 accepted) and their verify steps cost
2.0% more than plain decoding's by the fit auto optimises (float32, 2-core Zen 2,
``benchmarks/auto_decisions.py``: 5.70 against 5.59 s); priced as the drain, 193 tokens (129
accepted), 0.7% less (5.55 s). Without the ``min`` term (each accepted token worth D alone) a
cheap exact draft model at batch 4 went unused in the drain, where every row drafting ends the
job sooner (``tests/unit/test_auto_draft.py``), as any drafting would on a GPU, where a step's
cost hardly grows with its rows.

Drafting must pay by a margin: the base's drafts, and any other candidate's, are verified only
where the step's predicted rate beats plain decoding's (no row drafting) by ``draft_margin``
(3%: what the fit's error hides; the one-wave batch-16 float32 job of the 16 peer records,
where drafting's predicted gain was within it, ran 0.965x plain decoding without it, 0.986x
with it).

Dormancy: weighing the drafts costs host time every step (candidates drafted and scored, every
row's cuts, every row learning from the commit: ~1.6 ms a step of 16 rows and ~0.3 ms at one
row, CPU time, SmolLM2-135M int8 on an AMX Xeon, against a ~20 ms / ~7.5 ms verify step). Where
no drafting pays, that is all the difference to plain decoding: the 16 peer records at batch 16,
int8, ran auto at 0.978x ``none`` (6 interleaved rounds) with its verify steps 3% cheaper and
its host time 3% dearer. So once weighed steps in a row where no row drafted add up to
``IDLE_ROWS`` rows, the policy sleeps: the next ``SLEEP_FIRST`` steps draft nothing and weigh
nothing (no reach, no cuts, no candidate but the base drafts), then it weighs one step; a step
that again drafts nothing doubles the sleep (up to ``SLEEP_MAX`` steps), one that drafts wakes
it. A row that joins the step (a new record, or a turn's follow-up) wakes it at once. While it
sleeps the rows still learn: the base proposes every step and its first position is scored
against the commit (``LookupCandidate.observe``), so a row whose text starts copying is drafted
for at the next weighed step. Steps slept through count as ``none`` in ``steps_by_proposer`` and
are journaled as ``idle`` (a resume replays them as slept: the other candidates' pooled
acceptance decays per step they draft). Measured (``benchmarks/auto_decisions.py``, one fit, CPU
time of the policy and candidates per verify step): 16 peer records at batch 16, 1.64 -> 1.20 ms
(128 verify steps, 127 awake); 64 Spec-Bench records at batch 16, 2.11 -> 1.14 ms (844 steps,
839 awake); at batch 1 it sleeps only after 64 idle steps (the 16 peer records, float32: 1137
verify steps, as awake).

The base's dormancy: the base is weighed every awake step (its reach, every cap's cuts), and
where another candidate takes the rows that is host time spent for nothing (the extraction
recipe at batch 1: suffix drafted 814 of 1010 weighed steps, lookup 33). So once
``BASE_IDLE_STEPS`` weighed steps in a row drafted from another candidate and none from the
base, the base sleeps as the policy does (2 steps, doubling to ``SLEEP_MAX`` while the step
it then weighs again drafts from another candidate alone; a step that verifies its drafts, or a
row that joins, wakes it): its proposals are not weighed, the other candidates are offered
every row against plain decoding, and the rows still learn (the base proposes every step and
its first position is scored at the commit, as in the policy's sleep; a resume replays those
steps exactly, by the journal's choices). Measured (``benchmarks/auto_decisions.py``, one fit,
SmolLM2-135M int8, 2-core Zen 4; verify steps, fit-priced forward seconds, CPU ms of the policy
and candidates per verify step): the extraction recipe at batch 1 (48 records) 1937 -> 1918,
13.12 -> 13.06 s (suffix alone 1907, 13.07 s), 0.334 -> 0.275 ms; the 130-record Spec-Bench
job at batch 16 1263 -> 1258, 22.14 -> 22.06 s, 1.28 -> 1.12 ms; the extraction recipe at
batch 16 245 -> 254, 6.99 -> 7.06 s, the same CPU time (there the lookup missed while it slept).

``steps_by_proposer`` counts which candidate (or none) drafted each row's steps, per record.
After every step each candidate learns from the committed tokens (``Candidate.observe``). The
cost models are fixed for the job (the job's calibration): no time measured while it runs
enters a decision, so the same job decides the same way in every run.

Resume (``auto.journal``): ``decisions`` holds the last step's choice per row (its request id,
source, draft length), which the journal appends; ``force`` makes the rows of a resumed job
take the journaled choices, step by step, until the journal ends, and then sets the pooled
state (``state``) the interrupted run had there: a row that ran beside records finished before
the kill (placeholders now, ``sequence.Replay``) is decided as it was beside them.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specbatch.auto.candidate import Candidate, LookupCandidate
from specbatch.auto.costmodel import CostModel

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence

# rows of the weighed steps in a row without a draft before the policy sleeps: 4 steps of 16
# rows, 64 steps of one. At batch 1 weighing costs ~2% of a step and a row's copying comes
# and goes: sleeping after 4 idle steps there cost 2.5% more verify steps on the 16 peer
# records (float32: 1165 against 1137 awake), more than the weighing it saved
IDLE_ROWS = 64
SLEEP_FIRST = 2  # steps slept the first time; doubled while the step it then weighs is idle
SLEEP_MAX = 16  # the longest sleep (steps): a row that starts copying waits at most this long
IDLE = "idle"  # the journal's source of a row in a step slept through
# weighed steps in a row where another candidate drafted and the base did not, before the
# base sleeps (the base's dormancy, module docstring)
BASE_IDLE_STEPS = 4


@dataclass
class Sleep:
    """A dormancy's counters (module docstring): ``idle``, the idle amount weighed in a row
    (rows for the policy, steps for the base); ``length``, the next sleep (steps); ``left``,
    steps of the current sleep still to go."""

    idle: int = 0
    length: int = SLEEP_FIRST
    left: int = 0

    def skips(self, joined: bool) -> bool:
        """Whether this step is slept through (one step of the sleep spent); a row that
        joined ends the sleep."""
        if self.left and not joined:
            self.left -= 1
            return True
        self.left = 0
        return False

    def weighed(self, idle: int, limit: int) -> None:
        """A weighed step, ``idle`` of it idle (0: active, which resets the counters): once
        the idle amount reaches ``limit``, sleep, and double the next sleep up to
        ``SLEEP_MAX``."""
        if not idle:
            self.idle, self.length = 0, SLEEP_FIRST
            return
        self.idle += idle
        if self.idle >= limit:
            self.left = self.length
            self.length = min(2 * self.length, SLEEP_MAX)

    def state(self) -> list[int]:
        return [self.idle, self.length, self.left]

    @classmethod
    def from_state(cls, values) -> Sleep:
        return cls(*(int(x) for x in values))


def _request_id(seq) -> tuple:
    """A row's request id as a tuple (the journal's key: ``(record index, turn, sample)`` for
    ``pipeline``'s requests)."""
    rid = getattr(seq.request, "request_id", None)
    if rid is None:
        rid = seq.seq_id
    return tuple(rid) if isinstance(rid, (tuple, list)) else (rid,)


def _prepare(cand: Candidate, seqs, caps: list[int], num_rows: int | None) -> list[int]:
    """``cand.prepare``, given ``num_rows`` where it ``counts_rows``."""
    if num_rows is not None and getattr(cand, "counts_rows", False):
        return cand.prepare(seqs, caps, num_rows=num_rows)
    return cand.prepare(seqs, caps)


def _prefix_sums(reach: list[list[float]]) -> list[list[float]]:
    """Per row, ``[sum(r[:0]), sum(r[:1]), ...]``: the expected extra tokens of a draft cut
    after each position (added left to right, as ``sum`` does)."""
    out = []
    for r in reach:
        acc, row = 0, [0]
        for x in r:
            acc += x
            row.append(acc)
        out.append(row)
    return out


def _run(reach: list[float], threshold: float) -> int:
    """How many leading positions of ``reach`` are at least ``threshold``."""
    n = 0
    for x in reach:
        if x < threshold:
            break
        n += 1
    return n


def _shared(reach: list[float], base: list[float], mine: list[int],
            theirs: list[int]) -> list[float]:
    """A candidate's reach for a row (``reach``, its proposal ``mine``) where the proposal
    starts with the base's (``theirs``, reach ``base``): the same tokens have the same chance
    whoever proposes them, so over the shared prefix the row keeps the higher estimate (the
    base's is the one a step would otherwise verify) and past it the candidate's own
    conditional chances. Without it a suffix draft that extends a lookup draft lost to it
    wherever the lookup's estimate of their common tokens read higher: on the extraction
    recipe (48 records, batch 1) auto verified 2028 steps against suffix alone 1955; with it
    1983."""
    m = 0
    top = min(len(reach), len(base), len(mine), len(theirs))
    while m < top and mine[m] == theirs[m]:
        m += 1
    if m == 0:
        return reach
    out = [max(x, y) for x, y in zip(reach[:m], base[:m])]
    scale = out[m - 1] / reach[m - 1] if reach[m - 1] > 0 else 0.0
    return out + [x * scale for x in reach[m:]]


def _context(seqs) -> float:
    """The step's context for the cost model: the rows' mean length (tokens). Attention reads
    each row up to its own length, so a step costs by the sum over rows; the longest row times
    the rows priced a batch of 10 rows at 600-1300 tokens 25-35% high (summarization records),
    and drafting looked cheaper than it was."""
    return sum(len(s.token_ids) for s in seqs) / len(seqs)


@dataclass
class _Step:
    """One ``select``: its rows, their caps, mean context and rows of the verify step (a
    resume's placeholders included); the base's predicted rate and plain decoding's
    (tokens/s); and per row, as candidates take rows (``_offer``): the draft tokens it feeds,
    its draft's reach, the source drafting it and the draft of a row another candidate took."""

    seqs: list
    caps: list[int]
    ctx: float
    num_rows: int | None
    rate: float
    plain: float
    fed: list[int]
    reach: list[list[float]]
    source: list[str]
    chosen: list[list[int]]
    base: list[list[float]]  # the base's reach per row, uncut (``_select_base``)


class AdaptivePolicy:
    """Chooses each row's candidate and draft length per step from a ``CostModel`` and the
    candidates' confidence.

    cost: the target's step cost (fixed for the job); k_max: auto's k (tokens); lookup: the base
    candidate (prompt lookup);
    others: the candidates offered after it, in order (``Candidate``); switch_margin: the
    hysteresis of the step cap and of candidates with ``hysteresis``; draft_margin: how much
    better than plain decoding a step's predicted rate must be for it to verify drafts.
    """

    def __init__(self, cost: CostModel, k_max: int, lookup: LookupCandidate,
                 others: Seq[Candidate] = (), switch_margin: float = 0.03,
                 draft_margin: float = 0.03) -> None:
        self.cost = cost
        self.k_max = k_max
        self.lookup = lookup
        self.others = list(others)
        self.switch_margin = switch_margin
        self.draft_margin = draft_margin
        self.current_k = k_max
        self.using: dict[str, bool] = {c.name: False for c in self.others}
        # request tag -> steps per source (a candidate's name, or "none")
        self.steps_by_proposer: dict = {}
        # the last step's choices, per row: (request id, source, draft length)
        self.decisions: list[tuple] = []
        # resume: request id -> journaled (source, length) per step still to replay, and the
        # pooled state to set when they run out (``force``)
        self._forced: dict[tuple, deque] | None = None
        self._forced_state: dict | None = None
        self.forced_mismatches = 0  # rows whose journaled choices did not fit (a divergence)
        self._memo: dict[tuple, float] = {}  # this step's step times (``_seconds``)
        self._sink = 0.0  # the drain's S: seconds of a step one row's progress does not save
        self._bonus = 0.0  # the drain's S / D (module docstring; ``select``)
        # dormancy (module docstring): the policy's (idle: rows of the weighed steps in a row
        # without a draft), the base's (idle: weighed steps in a row that another candidate
        # drafted and the base did not), the last step's seq ids
        self.sleep = Sleep()
        self.base_sleep = Sleep()
        self._last_rows: set[int] = set()

    @property
    def candidates(self) -> list[Candidate]:
        """The base, then the others, in the order they are offered rows."""
        return [self.lookup, *self.others]

    @property
    def probe_results(self) -> dict:
        """Request tag -> (replayed lookup acceptance length or None, probe tokens)."""
        return self.lookup.probe_results

    def candidate(self, name: str) -> Candidate:
        """The candidate named ``name``; raises ``KeyError``."""
        for c in self.candidates:
            if c.name == name:
                return c
        raise KeyError(name)

    def rate(self, seqs, drafts: list[list[int]], k: int) -> float:
        """Expected output tokens per second if every lookup draft is cut to ``k`` tokens."""
        return self._rate(seqs, [min(k, len(d)) for d in drafts])

    def _rate(self, seqs, cuts: list[int], reach: list[list[float]] | None = None,
              ctx: float | None = None, sums: list[list[float]] | None = None) -> float:
        """Expected output tokens per second if row i feeds ``cuts[i]`` base draft tokens
        (rows run packed: the dense layers cost by the real tokens, attention by the longest
        row or, where packed, by the real tokens; at the rows' mean context, ``_context``).
        reach: per row, the base's ``reach`` (default: asked for ``cuts``); ctx: the rows'
        mean context (default: ``_context(seqs)``); sums: ``_prefix_sums(reach)`` when known."""
        if sums is None:
            sums = _prefix_sums(self.lookup.reach(seqs, cuts) if reach is None else reach)
        return self._rate_of(len(seqs), cuts, sums, _context(seqs) if ctx is None else ctx)

    def _rate_of(self, rows: int, cuts: list[int], sums: list[list[float]],
                 ctx: float) -> float:
        """``_rate`` of a step of ``rows`` rows given the cuts and prefix sums of the rows that
        may draft (any subset holding every row with a cut, in row order: a row cut to 0 adds
        nothing)."""
        tokens = rows + sum(c_i[c] for c_i, c in zip(sums, cuts) if c)
        if self._bonus and len(cuts) == rows:
            tokens += self._bonus * min(c_i[c] for c_i, c in zip(sums, cuts))
        q = 1 + max(cuts, default=0)
        return tokens / self._seconds(rows, q, ctx, rows + sum(cuts),
                                      sum(1 for c in cuts if c))

    def _seconds(self, rows: int, q: int, ctx: float, tokens: int,
                 drafting: int | None = None) -> float:
        """``cost.step_time(rows, q, ctx, num_tokens=tokens, drafting_rows=drafting)``
        (``drafting``: the rows with a draft; ``CostModel.drafting``), remembered until the
        next ``select`` (a step weighs the same few shapes many times)."""
        key = (rows, q, ctx, tokens, drafting)
        seconds = self._memo.get(key)
        if seconds is None:
            seconds = self._memo[key] = self.cost.step_time(
                rows, q, ctx, num_tokens=tokens, drafting_rows=drafting) - self._sink
        return seconds

    def _drain(self, rows: int, ctx: float) -> tuple[float, float]:
        """``(S, S / D)`` of a step of ``rows`` rows at mean context ``ctx`` while the job
        drains (module docstring): S = ``t(R) - R * D`` the seconds one row's progress does not
        save, D = ``(t(R) - t(1)) / (R - 1)`` a row's share, t(r) a plain step of r rows;
        ``(0.0, 0.0)`` at one row, or where t does not grow with the rows."""
        if rows <= 1:
            return 0.0, 0.0
        t_rows, t_one = self.cost.step_time(rows, 1, ctx), self.cost.step_time(1, 1, ctx)
        if t_rows <= t_one:
            return 0.0, 0.0
        share = (t_rows - t_one) / (rows - 1)
        sink = max(t_rows - rows * share, 0.0)
        return sink, sink / share

    def _cuts(self, rows: int, lengths: list[int], k: int, reach: list[list[float]],
              keys: list[int], ctx: float, sums: list[list[float]],
              worth: float = 1.0) -> list[int]:
        """Draft lengths under a step cap ``k`` of the rows that may draft (``lengths``, their
        proposals' lengths; ``keys``, their lengths in tokens; ``reach``, ``sums``: their
        reach and its ``_prefix_sums``) in a step of ``rows`` rows: a row keeps draft position
        j only if the chance that positions 0..j are all accepted (the expected extra tokens
        it brings), times ``worth`` (a token's worth in the step's tokens: 1, or in the drain
        with every row drafting more, module docstring), is worth the packed token it costs at
        the step's rate (Dinkelbach-style fixed point, 3 rounds from "keep everything")."""
        tops = [min(k, n) for n in lengths]
        if not any(tops):
            return tops
        cuts, per_key = tops, self.cost.token_key_cost
        for _ in range(3):
            # a packed token's price: the dense slope at the step's token count (plus scoring
            # the row's keys where attention is packed)
            rate = self._rate_of(rows, cuts, sums, ctx)
            slope = self._token_cost(rows + sum(cuts))
            new = []
            for key_len, r, top in zip(keys, reach, tops):
                threshold, j = rate * (slope + per_key * key_len) / worth, 0
                while j < top and r[j] >= threshold:  # ``_run`` of r[:top]
                    j += 1
                new.append(j)
            if new == cuts:
                break
            cuts = new
        return cuts

    def _token_cost(self, tokens: int) -> float:
        """``cost.token_cost(tokens)``, remembered until the next ``select``."""
        key = ("token", tokens)
        seconds = self._memo.get(key)
        if seconds is None:
            seconds = self._memo[key] = self.cost.token_cost(tokens)
        return seconds

    def select(self, seqs: list[Sequence], caps: list[int], num_rows: int | None = None,
               draining: bool = False) -> list[list[int]]:
        """The drafts to verify this step, one per row (possibly empty). caps: the most tokens
        each row may draft (its k, ``max_tokens`` and the context; the engine's
        ``_draft_caps``). num_rows: the rows of the verify step, a resumed job's placeholders
        included (default ``len(seqs)``; candidates with ``counts_rows`` are told). draining:
        no request waits for a row (``Engine.draining``): steps are priced as the drain's
        (module docstring)."""
        ctx = _context(seqs)
        self._memo.clear()
        # the drain's S, and S / D: the per-step part in rows' shares, which the slowest
        # row's progress saves
        self._sink, self._bonus = self._drain(len(seqs), ctx) if draining else (0.0, 0.0)
        rows_now = {s.seq_id for s in seqs}
        joined, self._last_rows = not rows_now <= self._last_rows, rows_now
        if self._forced is not None:
            queues = [self._forced.get(_request_id(s)) for s in seqs]
            if any(queues):
                return self._replay(seqs, caps, num_rows, ctx, queues)
            self._end_forcing()
        if self.sleep.skips(joined):
            return self._doze(seqs, caps)
        lengths = self.lookup.prepare(seqs, caps)
        base_weighed = not self.base_sleep.skips(joined)
        if not base_weighed:  # the base sleeps: its proposals are scored at the commit only
            lengths = [0] * len(seqs)
        fed, rate, plain, reach = self._select_base(seqs, lengths, ctx)
        step = _Step(seqs, caps, ctx, num_rows, rate, plain, fed,
                     [r[:f] for r, f in zip(reach, fed)],
                     [self.lookup.name if c else "none" for c in fed], [[] for _ in seqs], reach)
        for cand in self.others:
            self._offer(cand, step)
        rows = [i for i, src in enumerate(step.source) if src == self.lookup.name]
        for i, d in zip(rows, self.lookup.drafts([seqs[i] for i in rows],
                                                 [fed[i] for i in rows], ctx)):
            step.chosen[i] = d
        self._count(seqs, step.chosen, step.source)
        drafted = any(step.chosen)
        if base_weighed and drafted:
            self.base_sleep.weighed(int(self.lookup.name not in step.source), BASE_IDLE_STEPS)
        self.sleep.weighed(0 if drafted else len(seqs), IDLE_ROWS)
        return step.chosen

    def _doze(self, seqs, caps: list[int]) -> list[list[int]]:
        """A step slept through: no drafts; the base proposes (its first position is scored
        when the step commits), nothing is weighed."""
        self.lookup.prepare(seqs, caps)
        chosen: list[list[int]] = [[] for _ in seqs]
        self._count(seqs, chosen, ["none"] * len(seqs), IDLE)
        return chosen

    def _count(self, seqs, chosen: list[list[int]], source: list[str],
               journaled: str | None = None) -> None:
        """Count the step's sources per record, and keep its decisions for the journal (the
        source ``journaled`` for every row where given)."""
        for s, src in zip(seqs, source):
            self.steps_by_proposer.setdefault(s.request.tag, Counter())[src] += 1
        self.decisions = [(_request_id(s), journaled or src, len(d))
                          for s, src, d in zip(seqs, source, chosen)]

    # ---- resume ---------------------------------------------------------------------------
    def force(self, decisions: dict[tuple, list[tuple[str, int]]], state: dict | None) -> None:
        """Replay journaled choices (``auto.journal``): decisions, request id -> its
        (source, draft length) per verify step, in order; state: ``state()`` at the journal's
        end, set once a step comes whose rows have none left. Until then a step's rows take
        their journaled choices (a row with none left drafts nothing and counts in
        ``forced_mismatches``); every candidate still prepares and drafts them, and learns
        from the commits, so each row's own state follows its tokens."""
        self._forced = {k: deque(v) for k, v in decisions.items() if v}
        self._forced_state = state
        if not self._forced:
            self._end_forcing()

    @property
    def replaying(self) -> bool:
        """Whether the rows still take journaled choices (``force``)."""
        return self._forced is not None

    def _end_forcing(self) -> None:
        self.forced_mismatches += sum(1 for q in (self._forced or {}).values() if q)
        if self._forced_state is not None:
            self.set_state(self._forced_state)
        self._forced = self._forced_state = None

    def _replay(self, seqs, caps: list[int], num_rows: int | None, ctx: float,
                queues: list[deque | None]) -> list[list[int]]:
        """A step of journaled choices (``force``)."""
        chosen_src: list[tuple[str, int]] = []
        for q in queues:
            if q:
                chosen_src.append(q.popleft())
            else:
                self.forced_mismatches += 1
                chosen_src.append(("none", 0))
        if all(src == IDLE for src, _ in chosen_src):
            return self._doze(seqs, caps)
        self.lookup.prepare(seqs, caps)
        chosen: list[list[int]] = [[] for _ in seqs]
        source = ["none"] * len(seqs)
        names = {c.name for c in self.candidates}
        for i, (src, n) in enumerate(chosen_src):
            if src not in names and src not in ("none", IDLE):
                self.forced_mismatches += 1
        for cand in self.candidates:
            if cand is not self.lookup:
                _prepare(cand, seqs, caps, num_rows)
            rows = [i for i, (src, n) in enumerate(chosen_src) if src == cand.name and n]
            if not rows:
                continue
            drafts = cand.drafts([seqs[i] for i in rows], [chosen_src[i][1] for i in rows], ctx)
            for i, d in zip(rows, drafts):
                if len(d) != chosen_src[i][1]:
                    self.forced_mismatches += 1
                chosen[i], source[i] = d, cand.name if d else "none"
        self._count(seqs, chosen, source)
        return chosen

    def state(self) -> dict:
        """What the policy learned pooled over rows, as JSON values: the step cap, which
        candidates are in use, the dormancy counters (idle rows, next sleep, steps of sleep
        left) and the base's (idle steps, next sleep, steps of sleep left), each candidate's
        ``global_state`` (those that have one)."""
        return {"current_k": self.current_k, "using": dict(sorted(self.using.items())),
                "sleep": self.sleep.state(), "base_sleep": self.base_sleep.state(),
                "candidates": {c.name: c.global_state() for c in self.candidates
                               if hasattr(c, "global_state")}}

    def set_state(self, state: dict) -> None:
        """Set ``state()``'s values; raises ``KeyError`` / ``TypeError`` / ``ValueError`` on
        another shape."""
        self.current_k = int(state["current_k"])
        self.sleep = Sleep.from_state(state.get("sleep", Sleep().state()))
        self.base_sleep = Sleep.from_state(state.get("base_sleep", Sleep().state()))
        self.using.update({str(k): bool(v) for k, v in state["using"].items()})
        for c in self.candidates:
            got = state["candidates"].get(c.name)
            if got is not None and hasattr(c, "set_global_state"):
                c.set_global_state(got)

    def _select_base(self, seqs, lengths: list[int],
                     ctx: float) -> tuple[list[int], float, float, list[list[float]]]:
        """Per-row base draft lengths under the chosen step cap, their predicted rate and
        plain decoding's (tokens/s; ctx: the rows' mean context), and the base's reach per
        row (at least as long as its draft)."""
        longest = max(lengths, default=0)
        rows = len(seqs)
        if longest == 0:
            plain = self._rate_of(rows, [], [], ctx)
            return [0] * rows, plain, plain, [[] for _ in seqs]
        # only the rows with a proposal can draft: the others' cuts stay 0 and add nothing
        act = [i for i, n in enumerate(lengths) if n]
        lens = [lengths[i] for i in act]
        mine = self.lookup.reach([seqs[i] for i in act], [min(self.k_max, n) for n in lens])
        sums = _prefix_sums(mine)
        top = min(self.k_max, longest)
        if rows == 1:  # one row: every cut priced, each cap's best (``_one_row``)
            options, rates = self._one_row(sums[0], top, ctx)
        else:
            keys = [len(seqs[i].token_ids) for i in act]
            options = {k: self._cuts(rows, lens, k, mine, keys, ctx, sums)
                       for k in range(0, top + 1)}
            rates = {k: self._rate_of(rows, cuts, sums, ctx) for k, cuts in options.items()}
            if self._bonus and len(act) == rows:  # the drain: every row drafting (docstring)
                worth = 1.0 + self._bonus / rows
                for k in range(1, top + 1):
                    dense = self._cuts(rows, lens, k, mine, keys, ctx, sums, worth)
                    r = self._rate_of(rows, dense, sums, ctx)
                    if r > rates[k]:
                        options[k], rates[k] = dense, r
        best = max(rates, key=lambda k: (rates[k], -k))
        keep = min(self.current_k, longest)
        if rates[best] > rates[keep] * (1 + self.switch_margin):
            self.current_k = best
            keep = best
        if rates[keep] <= rates[0] * (1 + self.draft_margin):
            keep = 0  # drafting this step is not predicted to pay by more than the margin
        fed = [0] * rows
        reach: list[list[float]] = [[] for _ in seqs]
        for i, c, r in zip(act, options[keep], mine):
            fed[i], reach[i] = c, r
        return fed, rates[keep], rates[0], reach

    def _one_row(self, sums: list[float], top: int,
                 ctx: float) -> tuple[dict[int, list[int]], dict[int, float]]:
        """``_select_base``'s options and rates for a step of one row (sums: its reach's
        ``_prefix_sums``; top: the longest cut, ``min(k_max, its proposal)``): the rate of every
        cut c in 0..top, ``(1 + sums[c]) / step_time(1, 1 + c)``, and for each cap K the best
        cut up to K (the shorter of equals). Exact where the fixed point of ``_cuts`` prices a
        position by the dense slope alone: a cut that starts a matmul tile (9 fed tokens on the
        CPU's AVX-512 kernels) costs the whole tile, and at one row that is the choice."""
        options: dict[int, list[int]] = {}
        rates: dict[int, float] = {}
        best_c, best_r = 0, -1.0
        for c in range(top + 1):
            r = (1 + sums[c]) / self._seconds(1, 1 + c, ctx, 1 + c, int(c > 0))
            if r > best_r:
                best_c, best_r = c, r
            options[c], rates[c] = [best_c], best_r
        return options, rates

    def _offer(self, cand: Candidate, step: _Step) -> None:
        """Offer ``cand`` the rows no earlier candidate took (``step.source`` still the
        base's or none); the rows it takes get its drafts in ``step.chosen``, their length in
        ``step.fed``, their reach in ``step.reach`` and its name in ``step.source``."""
        seqs, ctx, fed, current, base_rate = step.seqs, step.ctx, step.fed, step.reach, step.rate
        n = len(seqs)
        avail = _prepare(cand, seqs, step.caps, step.num_rows)
        free = [src in (self.lookup.name, "none") for src in step.source]
        value = base_rate * self.cost.token_cost(n + sum(fed), ctx)
        reach = cand.reach(seqs, avail)
        if hasattr(cand, "proposal"):
            reach = [_shared(r, b, cand.proposal(s), self.lookup.proposal(s))
                     for s, r, b in zip(seqs, reach, step.base)]
        entry = cand.entry_seconds(seqs, reach)
        best = None  # (rate, lengths per row, 0 = keep the current draft)
        # a token's worth in the step's tokens; in the drain also every row drafting (docstring)
        worths = (1.0, 1.0 + self._bonus / n) if self._bonus else (1.0,)
        # per worth: a token's value, and each row's net gain from its current draft
        nets = {w: (value / w, [sum(c) - len(c) * value / w for c in current]) for w in worths}
        for cap, worth in ((c, w) for c in cand.cap_options(self.k_max) for w in worths):
            v, net = nets[worth]
            lengths = []
            for r, net_i, e, ok in zip(reach, net, entry, free):
                d = _run(r[:cap], v) if ok else 0
                gain = sum(r[:d]) - d * v - e * base_rate
                lengths.append(d if d and gain > net_i else 0)
            if not any(lengths):
                continue
            gains = [sum(r[:d]) if d else sum(c) for r, c, d in zip(reach, current, lengths)]
            tokens = n + sum(gains) + self._bonus * min(gains, default=0.0)
            feeds = [d if d else f for d, f in zip(lengths, fed)]
            seconds = self._seconds(n, 1 + max(feeds), ctx, n + sum(feeds),
                                    sum(1 for f in feeds if f))
            seconds += sum(e for e, d in zip(entry, lengths) if d)
            for extra in cand.step_seconds(lengths, ctx):
                seconds += extra
            rate = tokens / seconds
            if best is None or rate > best[0]:
                best = (rate, lengths)
        margin = 1.0
        if cand.hysteresis:
            margin = 1 / (1 + self.switch_margin) if self.using[cand.name] \
                else 1 + self.switch_margin
        self.using[cand.name] = (best is not None and best[0] > base_rate * margin
                                 and best[0] > step.plain * (1 + self.draft_margin))
        if not self.using[cand.name]:
            return
        rows = [i for i, d in enumerate(best[1]) if d]
        drafts = cand.drafts([seqs[i] for i in rows], [best[1][i] for i in rows], ctx)
        for i, d in zip(rows, drafts):
            step.chosen[i], fed[i], step.source[i] = d, len(d), cand.name
            current[i] = reach[i][:len(d)]

    def observe(self, seq, emitted: list[int]) -> None:
        """The tokens the step committed for a row of the step: every candidate learns."""
        for c in self.candidates:
            c.observe(seq, emitted)
