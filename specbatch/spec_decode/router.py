"""``--method auto`` as one proposer: a router over prompt lookup, the draft model, suffix
drafts and nothing, row by row and step by step.

The candidates come from ``candidates`` (``spec_decode.composite``: prompt lookup, plus the draft
model when there is one, plus the suffix proposer), and the choice from ``policy``
(``plan.policy.AdaptivePolicy``: measured step cost and acceptance). The engine sees an
ordinary ``Proposer``: ``propose`` returns the drafts to verify, already cut and routed, and the
router feeds what the policy learns from (the full lookup proposal, the verify step's wall time,
the tokens each step committed) back to it. Nothing is set on the engine from outside.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence


class Router:
    """candidates: the proposer whose ``propose`` gives the prompt-lookup drafts (``NgramProposer``,
    ``LookupAndDraftProposer`` or ``WithSuffix``); policy: an object with ``select(seqs, drafts,
    caps) -> drafts``, ``observe(seq, proposed, emitted)``, ``finish(seq)`` and, optionally,
    ``observe_step(seqs, drafts, seconds)`` (``AdaptivePolicy``). Other attributes
    (``match_len``, ``add_finished``, ``model``...) are the candidates'."""

    name = "auto"

    def __init__(self, candidates, policy) -> None:
        self.candidates = candidates
        self.policy = policy
        self._proposed: dict[int, list[int]] = {}  # seq id -> this step's full lookup draft

    def __getattr__(self, attr: str):
        if attr in ("candidates", "policy", "_proposed"):  # not set yet (copy, unpickle)
            raise AttributeError(attr)
        return getattr(self.candidates, attr)

    def start(self, seq: Sequence) -> None:
        self.candidates.start(seq)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """The drafts to verify: lookup drafts of up to ``ks[i]`` tokens, cut or replaced (draft
        model, suffix) by the policy. ks: each row's cap (the engine's ``draft_cap``)."""
        proposed = [d[:k] for d, k in zip(self.candidates.propose(seqs, ks), ks)]
        self._proposed = {s.seq_id: d for s, d in zip(seqs, proposed)}
        return self.policy.select(seqs, proposed, ks)

    def on_verify(self, seqs: list[Sequence], drafts: list[list[int]], seconds: float) -> None:
        """The verify step's wall time (seconds: forward, sampling and commit, ending with the
        step's one device-to-host copy) for the policy's cost model."""
        observe_step = getattr(self.policy, "observe_step", None)
        if observe_step is not None:
            observe_step(seqs, drafts, seconds)

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        proposed = self._proposed.pop(seq.seq_id, None)
        if proposed is not None:  # the policy checks the full proposal against what came out
            emitted = seq.token_ids[len(seq.token_ids) - num_new_tokens:]
            self.policy.observe(seq, proposed, emitted)
        self.candidates.on_commit(seq, num_new_tokens)

    def finish(self, seq: Sequence) -> None:
        self._proposed.pop(seq.seq_id, None)
        self.candidates.finish(seq)
        self.policy.finish(seq)
