"""The proposer interface: who guesses the draft tokens a verify step checks.

A proposer keeps whatever per-sequence state it needs (an n-gram index, a draft model's KV
rows) keyed by ``Sequence.seq_id``, and hears about every sequence's lifecycle from the engine:

    start(seq)            the sequence was prefilled; its prompt (and first token) are known
    propose(seqs, ks)     draft up to ks[i] tokens for seqs[i]; a row may get fewer, or none
    on_commit(seq, n)     n tokens were appended to seq.token_ids (accepted + recovered/bonus)
    finish(seq)           drop the sequence's state

    on_verify(seqs, drafts, seconds)
                          a verify step of rows seqs with these drafts ended (after its commits);
                          seconds: its wall time, the forward plus sampling, grammar masks and
                          commit (``auto`` ends its step there: its decision journal)

A proposer subclasses ``Proposer`` and so inherits the defaults: ``on_verify`` does nothing,
``counts_rows`` is False (True: ``propose`` takes ``num_rows=``, the rows of the verify step,
a resumed job's placeholders included; ``suffix``) and ``sees_drain`` is False (True:
``propose`` takes ``draining=``, ``Engine.draining``: no request waits for a row; ``auto``).
The engine calls these directly.

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
    """What the engine calls (the module docstring). Subclass it: ``on_verify``,
    ``counts_rows`` and ``sees_drain`` have defaults here."""

    name: str
    counts_rows: bool = False
    sees_drain: bool = False

    def start(self, seq: Sequence) -> None: ...

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]: ...

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None: ...

    def finish(self, seq: Sequence) -> None: ...

    def on_verify(self, seqs: list[Sequence], drafts: list[list[int]], seconds: float) -> None:
        """After a verify step (seconds: its wall time); default: nothing."""


class NoProposer(Proposer):
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
