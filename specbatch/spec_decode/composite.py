"""Prompt lookup and a draft model behind one proposer (``--method auto --draft-model NAME``).

The engine sees an ordinary proposer whose ``propose`` returns the prompt-lookup drafts (cheap:
a dict lookup per row). The draft model runs only when the auto policy
(``plan.policy.AdaptivePolicy``) decides, per step, that some rows should draft with it: the
policy calls ``propose_with_model`` for those rows and verifies the model's drafts instead of
the lookup's. Each row thus drafts with lookup, the draft model or nothing, step by step.

The draft model's KV rows are filled lazily: a row's prompt is prefilled into the draft cache
the first time the policy asks that row for model drafts (a record auto never drafts with the
model costs no draft forward). After that the ``DraftProposer`` invariants hold: a row that
skipped the model for some steps feeds the committed tokens it has not seen in its next draft
step (see ``spec_decode.draft``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence
    from specbatch.spec_decode.draft import DraftProposer
    from specbatch.spec_decode.ngram import NgramProposer


class LookupAndDraftProposer:
    """Lookup drafts by default, draft-model drafts on request. ``lookup``: an
    ``NgramProposer``; ``model``: a ``DraftProposer`` over the target's row count."""

    name = "auto"

    def __init__(self, lookup: NgramProposer, model: DraftProposer) -> None:
        self.lookup = lookup
        self.model = model

    def start(self, seq: Sequence) -> None:
        self.lookup.start(seq)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Prompt-lookup drafts, up to ``ks[i]`` tokens per row (see ``NgramProposer``)."""
        return self.lookup.propose(seqs, ks)

    def match_len(self, seq: Sequence) -> int:
        """The lookup's last matched n-gram size (``NgramProposer.match_len``)."""
        return self.lookup.match_len(seq)

    def has_model_row(self, seq: Sequence) -> bool:
        """Whether the draft cache holds the row (``start_model`` ran for it)."""
        return seq.seq_id in self.model.states

    def start_model(self, seqs: list[Sequence]) -> None:
        """Prefill the rows the draft cache does not hold yet (before ``propose_with_model``;
        separate so the policy's draft step timings do not include one-off prefills)."""
        for seq in seqs:
            if seq.seq_id not in self.model.states:
                self.model.start(seq)

    def propose_with_model(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """Draft-model drafts, ``ks[i]`` tokens for ``seqs[i]`` (fewer past the draft's
        context), in ``max(ks)`` batched draft forwards; rows must be started
        (``start_model``)."""
        return self.model.propose(seqs, ks)

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        self.lookup.on_commit(seq, num_new_tokens)
        if seq.seq_id in self.model.states:
            self.model.on_commit(seq, num_new_tokens)

    def finish(self, seq: Sequence) -> None:
        self.lookup.finish(seq)
        self.model.finish(seq)


class WithSuffix:
    """``--method auto``: the lookup (or lookup + draft model) proposer ``inner``, plus a
    ``SuffixProposer`` whose drafts the auto policy may verify instead, row by row and step by
    step (``plan.policy.AdaptivePolicy._select_suffix``). ``propose`` returns ``inner``'s
    drafts; every other attribute (``match_len``, ``propose_with_model``...) is ``inner``'s."""

    name = "auto"

    def __init__(self, inner, suffix) -> None:
        self.inner = inner
        self.suffix = suffix

    def __getattr__(self, attr: str):
        if attr in ("inner", "suffix"):  # not set yet (copy, unpickle): no recursion
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def start(self, seq: Sequence) -> None:
        self.inner.start(seq)
        self.suffix.start(seq)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return self.inner.propose(seqs, ks)

    def propose_suffix(self, seqs: list[Sequence], ks: list[int]) -> list:
        """The suffix proposer's scored ``Draft`` per row, at most ``ks[i]`` tokens."""
        return [self.suffix.draft(s, k, len(seqs)) for s, k in zip(seqs, ks)]

    def add_finished(self, outputs) -> None:
        self.suffix.add_finished(outputs)

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        self.inner.on_commit(seq, num_new_tokens)
        self.suffix.on_commit(seq, num_new_tokens)

    def finish(self, seq: Sequence) -> None:
        self.inner.finish(seq)
        self.suffix.finish(seq)
