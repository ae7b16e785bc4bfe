"""The proposer interface: who guesses the draft tokens a verify step checks.

A proposer keeps whatever per-sequence state it needs (an n-gram index, a draft model's KV
rows) keyed by ``Sequence.seq_id``, and hears about every sequence's lifecycle from the engine:

    start(seq)            the sequence was prefilled; its prompt (and first token) are known
    propose(seqs, ks)     draft up to ks[i] tokens for seqs[i]; a row may get fewer, or none
    on_commit(seq, n)     n tokens were appended to seq.token_ids (accepted + recovered/bonus)
    finish(seq)           drop the sequence's state

and, if it defines it, ``on_verify(seqs, drafts, seconds)``: the verify step's wall time, the
forward plus sampling, grammar masks and commit (``auto``'s ``spec_decode.router.Router`` learns
the machine's step cost from it; a JSON-schema mask per fed token is part of that cost).

Drafts must be a deterministic function of the committed tokens (and, for a draft model, of
the record seed and positions; for suffix, of the answers finished before and of the rows in
the step): the output-invariance promise depends on it only through the verifier, but the
what-if replay in ``analyze`` and the probe in ``--method auto`` rely on it for n-gram drafts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence


class Proposer(Protocol):
    name: str

    def start(self, seq: Sequence) -> None: ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]: ...

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None: ...

    def finish(self, seq: Sequence) -> None: ...


class NoProposer:
    """``--method none``: never drafts, so every step is a plain decode step (k = 0)."""

    name = "none"

    def start(self, seq: Sequence) -> None:
        pass

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        return [[] for _ in seqs]

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        pass

    def finish(self, seq: Sequence) -> None:
        pass
