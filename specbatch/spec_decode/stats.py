"""Per-record acceptance statistics, counted over committed tokens only.

Terms (as in vLLM): a *drafting* verify step feeds the last committed token plus k draft tokens;
*accepted* tokens are the leading draft tokens equal to the target's own choice; the target then
emits one more token, the *recovered* token (at the first mismatch) or the *bonus* token (when all
drafts matched). The *acceptance length* of a step is the tokens it emits: accepted + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """Counters for one record (summed over its turns).

    num_steps: target forward passes that emitted tokens for the record: one prefill step per
        answer (per turn, per sample), which emits the first token and never drafts, plus the
        decode / verify steps.
    num_drafts: verify steps that carried at least one draft token.
    num_draft_tokens: draft tokens proposed over those steps.
    num_accepted_tokens: draft tokens accepted *and committed* (a stop can drop some).
    num_speculative_tokens: k, the draft tokens per verify step the run asked for
        (``SpecConfig.num_speculative_tokens``; 0 for ``none``).
    max_spec_tokens: the engine's per-row draft cap (tokens): k, except ``suffix`` and
        ``auto``, whose suffix drafts may reach ``min(32, 3k)`` (``methods.Method.draft_cap``);
        vLLM's suffix proposer passes its cap under this name. Default: k.
    num_accepted_tokens_per_pos: accepted count at draft position i (0-based), one entry per
        position up to the longest draft verified (``to_dict`` pads it to at least k).
    num_draft_tokens_per_pos: drafting steps whose draft had a token at position i (0-based),
        i.e. that verified position i: a draft of d tokens counts at 0..d-1. Same length as
        ``num_accepted_tokens_per_pos``; the per-position acceptance rate is
        ``accepted[i] / drafted[i]`` (drafts vary in length: a 2-token draft never tried
        position 3). Entry i equals the ``k_histogram`` steps with more than i drafts
        (``drafted_per_pos``). ``None`` when unknown (``from_dict`` of an old ``spec`` whose
        histogram does not account for its drafts); ``merge`` with an unknown side gives
        unknown.
    k_histogram: draft length -> decode / verify steps that carried that many draft tokens (0:
        a plain decode step). The prefill steps are NOT in it: its values sum to
        ``num_steps`` minus one per answer (``replay`` and ``Engine`` count the prefill in
        ``num_steps`` alone), so ``mean_k`` is a mean over decode steps.
    """

    proposer: str = "none"
    num_speculative_tokens: int = 0
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    k_histogram: dict[int, int] = field(default_factory=dict)  # k used -> decode steps
    max_spec_tokens: int | None = None
    num_draft_tokens_per_pos: list[int] | None = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_spec_tokens is None:
            self.max_spec_tokens = self.num_speculative_tokens

    def record_step(self, num_draft: int, num_accepted: int) -> None:
        """Count one verify (or plain decode) step with ``num_draft`` draft tokens of which the
        first ``num_accepted`` were committed. Not for the prefill step: count it as
        ``num_steps += 1`` (it is not in ``k_histogram``)."""
        self.num_steps += 1
        self.k_histogram[num_draft] = self.k_histogram.get(num_draft, 0) + 1
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.num_accepted_tokens_per_pos) < num_draft:
            self.num_accepted_tokens_per_pos.extend(
                [0] * (num_draft - len(self.num_accepted_tokens_per_pos)))
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1
        drafted = self.num_draft_tokens_per_pos
        if drafted is not None:
            if len(drafted) < num_draft:
                drafted.extend([0] * (num_draft - len(drafted)))
            for i in range(num_draft):
                drafted[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_accepted_tokens_per_pos = _add_lists(self.num_accepted_tokens_per_pos,
                                                      other.num_accepted_tokens_per_pos)
        if self.num_draft_tokens_per_pos is None or other.num_draft_tokens_per_pos is None:
            self.num_draft_tokens_per_pos = None  # one side predates the field: unknown
        else:
            self.num_draft_tokens_per_pos = _add_lists(self.num_draft_tokens_per_pos,
                                                       other.num_draft_tokens_per_pos)
        for k, c in other.k_histogram.items():
            self.k_histogram[k] = self.k_histogram.get(k, 0) + c

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / draft tokens; ``None`` when nothing was drafted."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """1 + accepted / drafts: tokens emitted per drafting verify step (vLLM's convention)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def mean_k(self) -> float | None:
        """Mean draft length over verify steps (the k actually used; 0 for no draft)."""
        steps = sum(self.k_histogram.values())
        return sum(k * c for k, c in self.k_histogram.items()) / steps if steps else None

    @property
    def longest_draft(self) -> int:
        """The longest draft verified (tokens; 0 when nothing was drafted): positions past it
        were never drafted, so their accepted counts are 0."""
        return max((k for k, c in self.k_histogram.items() if c), default=0)

    @classmethod
    def from_dict(cls, d: dict) -> SpecStats:
        """The counters of a record's ``spec`` field (``to_dict``'s output, as written to the
        output file); the derived ratios are recomputed, not read.

        A ``spec`` written before ``max_spec_tokens`` existed held the per-row draft cap in
        ``num_speculative_tokens`` (for ``suffix`` and ``auto``, ``min(32, 3k)``): both fields
        are then that value (``analyze.load.upgrade_spec`` recovers k from the run config).
        A ``spec`` written before ``num_draft_tokens_per_pos`` existed gets it from
        ``k_histogram`` (position i was verified by every step whose draft was longer than i),
        where that histogram accounts for every draft (``num_drafts``, ``num_draft_tokens``);
        else it is ``None`` (unknown)."""
        k = d.get("num_speculative_tokens", 0)
        cap = d.get("max_spec_tokens")
        # parquet stores the histogram as a struct: absent keys read back as null
        hist = {int(key): v for key, v in (d.get("k_histogram") or {}).items() if v is not None}
        drafted = d.get("num_draft_tokens_per_pos")
        if drafted is not None:
            drafted = list(drafted)
        elif (sum(n for n_draft, n in hist.items() if n_draft > 0) == d["num_drafts"]
              and sum(n_draft * n for n_draft, n in hist.items()) == d["num_draft_tokens"]):
            drafted = drafted_per_pos(hist)
            # as long as the accepted list (padded to k by to_dict), as to_dict would write it
            drafted += [0] * (len(d.get("num_accepted_tokens_per_pos") or ()) - len(drafted))
        return cls(proposer=d.get("proposer", "none"),
                   num_speculative_tokens=k, max_spec_tokens=k if cap is None else cap,
                   num_steps=d["num_steps"], num_drafts=d["num_drafts"],
                   num_draft_tokens=d["num_draft_tokens"],
                   num_accepted_tokens=d["num_accepted_tokens"],
                   num_accepted_tokens_per_pos=list(d.get("num_accepted_tokens_per_pos") or []),
                   num_draft_tokens_per_pos=drafted, k_histogram=hist)

    def to_dict(self) -> dict:
        """The record's ``spec`` field (docs/output.md). ``num_accepted_tokens_per_pos`` and
        ``num_draft_tokens_per_pos`` have k entries each, more where a draft was longer than k
        (a suffix draft, up to ``max_spec_tokens``); the latter is left out when unknown
        (``None``: read from a file that predates it)."""
        k = self.num_speculative_tokens
        per_pos = self.num_accepted_tokens_per_pos
        drafted = self.num_draft_tokens_per_pos
        n = max(k, len(per_pos), len(drafted or ()))
        per_pos = per_pos + [0] * (n - len(per_pos))
        out = {
            "proposer": self.proposer,
            "num_speculative_tokens": k,
            "max_spec_tokens": self.max_spec_tokens,
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": per_pos,
            "num_draft_tokens_per_pos": (None if drafted is None
                                         else drafted + [0] * (n - len(drafted))),
            "acceptance_rate": _round(self.acceptance_rate),
            "mean_acceptance_length": _round(self.mean_acceptance_length),
            "k_histogram": {str(k): c for k, c in sorted(self.k_histogram.items())},
            "mean_k": _round(self.mean_k),
        }
        if drafted is None:
            del out["num_draft_tokens_per_pos"]
        return out


def drafted_per_pos(k_histogram: dict[int, int]) -> list[int]:
    """``num_draft_tokens_per_pos`` from a ``k_histogram`` (draft length -> steps): entry i
    counts the steps whose draft was longer than i; one entry per position up to the longest
    draft."""
    longest = max((d for d, n in k_histogram.items() if n), default=0)
    return [sum(n for d, n in k_histogram.items() if d > i) for i in range(longest)]


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum, the shorter list read as padded with zeros."""
    out = a + [0] * (len(b) - len(a))
    for i, c in enumerate(b):
        out[i] += c
    return out


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
