"""``--method auto`` as one proposer: the candidates (``auto.candidate``) behind the adaptive
policy (``auto.policy.AdaptivePolicy``) that chooses, row by row and step by step, which
candidate's draft is verified and how much of it.

The engine sees an ordinary ``Proposer``: ``propose`` returns the drafts to verify, already
cut and routed; ``on_verify`` (the ``Proposer`` hook after a verify step) ends the step (the
decision journal, when kept, appends it); ``on_commit`` gives every candidate the tokens the
step committed. The
candidates are built from the registry (``methods``: every method with ``auto=True`` and a
``candidate`` builder) once the run is planned (``auto.planner.plan_auto``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specbatch.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from specbatch.auto.candidate import Candidate, Setup
    from specbatch.auto.policy import AdaptivePolicy
    from specbatch.engine.sequence import Sequence


class AutoProposer(Proposer):
    """members: ``(method name, proposer)`` pairs, in registry order, prompt lookup
    (``ngram``) first: the proposers auto may choose among (``methods``' auto builder).
    policy: set by ``use`` (``auto.planner.plan_auto``); ``propose`` before it raises
    ``RuntimeError``."""

    name = "auto"

    def __init__(self, members: list[tuple[str, Proposer]],
                 policy: AdaptivePolicy | None = None) -> None:
        self.members = members
        self.policy = policy
        self.journal = None  # an ``auto.journal.DecisionJournal`` (``specbatch run``)
        self._in_step: set[int] = set()  # seq ids of this step's rows

    def build_candidates(self, setup: Setup) -> list[Candidate]:
        """Each member's ``Candidate`` (its registry entry's ``candidate`` builder)."""
        from specbatch import methods

        return [methods.get(name).candidate(proposer, setup) for name, proposer in self.members]

    def use(self, policy: AdaptivePolicy) -> None:
        """Route through ``policy`` (built over ``build_candidates``)."""
        self.policy = policy

    def _candidates(self) -> list[Candidate]:
        if self.policy is None:
            raise RuntimeError("auto's proposer has no policy yet (auto.planner.plan_auto)")
        return self.policy.candidates

    def start(self, seq: Sequence) -> None:
        for c in self._candidates():
            c.start(seq)

    counts_rows = True  # suffix drafts depend on the rows of the step (a resume's placeholders)
    sees_drain = True  # a draft token is worth less while the job drains (``auto.policy``)

    def propose(self, seqs: list[Sequence], ks: list[int], num_rows: int | None = None,
                draining: bool = False) -> list[list[int]]:
        """The drafts to verify, at most ``ks[i]`` tokens for ``seqs[i]`` (the engine's cap).
        num_rows: the rows of the verify step, a resumed job's placeholders included (default
        ``len(seqs)``); draining: no request waits for a row (``Engine.draining``)."""
        self._candidates()
        self._in_step = {s.seq_id for s in seqs}
        return self.policy.select(seqs, ks, num_rows, draining=draining)

    def on_verify(self, seqs: list[Sequence], drafts: list[list[int]], seconds: float) -> None:
        """The end of a verify step: the journal (``auto.journal``, when one is kept) appends
        the step's choices. The step's time is not used: auto's costs are fixed for the job."""
        if self.journal is not None:
            self.journal.step(self.policy)

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        if seq.seq_id in self._in_step:  # the candidates check their drafts against it
            self._in_step.discard(seq.seq_id)
            self.policy.observe(seq, seq.token_ids[len(seq.token_ids) - num_new_tokens:])
        for c in self._candidates():
            c.on_commit(seq, num_new_tokens)

    def finish(self, seq: Sequence) -> None:
        self._in_step.discard(seq.seq_id)
        for c in self._candidates():
            c.finish(seq)
