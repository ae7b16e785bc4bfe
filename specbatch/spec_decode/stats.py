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

    num_steps: target forward passes that emitted tokens for the record (prefill included).
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
    """

    proposer: str = "none"
    num_speculative_tokens: int = 0
    num_steps: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    k_histogram: dict[int, int] = field(default_factory=dict)  # k used -> verify steps
    max_spec_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_spec_tokens is None:
            self.max_spec_tokens = self.num_speculative_tokens

    def record_step(self, num_draft: int, num_accepted: int) -> None:
        """Count one verify (or plain decode) step with ``num_draft`` draft tokens of which the
        first ``num_accepted`` were committed."""
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

    def merge(self, other: SpecStats) -> None:
        self.num_steps += other.num_steps
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.num_accepted_tokens_per_pos), len(other.num_accepted_tokens_per_pos))
        a = self.num_accepted_tokens_per_pos + [0] * (n - len(self.num_accepted_tokens_per_pos))
        for i, c in enumerate(other.num_accepted_tokens_per_pos):
            a[i] += c
        self.num_accepted_tokens_per_pos = a
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
        are then that value (``analyze.load.upgrade_spec`` recovers k from the run config)."""
        k = d.get("num_speculative_tokens", 0)
        cap = d.get("max_spec_tokens")
        return cls(proposer=d.get("proposer", "none"),
                   num_speculative_tokens=k, max_spec_tokens=k if cap is None else cap,
                   num_steps=d["num_steps"], num_drafts=d["num_drafts"],
                   num_draft_tokens=d["num_draft_tokens"],
                   num_accepted_tokens=d["num_accepted_tokens"],
                   num_accepted_tokens_per_pos=list(d.get("num_accepted_tokens_per_pos") or []),
                   # parquet stores the histogram as a struct: absent keys read back as null
                   k_histogram={int(k): v for k, v in (d.get("k_histogram") or {}).items()
                                if v is not None})

    def to_dict(self) -> dict:
        """The record's ``spec`` field (docs/output.md). ``num_accepted_tokens_per_pos`` has
        k entries, more where a draft was longer than k (a suffix draft, up to
        ``max_spec_tokens``)."""
        k = self.num_speculative_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos = per_pos + [0] * (k - len(per_pos))
        return {
            "proposer": self.proposer,
            "num_speculative_tokens": k,
            "max_spec_tokens": self.max_spec_tokens,
            "num_steps": self.num_steps,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": per_pos,
            "acceptance_rate": _round(self.acceptance_rate),
            "mean_acceptance_length": _round(self.mean_acceptance_length),
            "k_histogram": {str(k): c for k, c in sorted(self.k_histogram.items())},
            "mean_k": _round(self.mean_k),
        }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
