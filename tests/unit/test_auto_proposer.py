"""``auto.proposer.AutoProposer``: auto's one proposer asks its policy for the drafts (with the
rows of the verify step, a resume's placeholders included), feeds it the tokens each row of the
step committed, ends the step in the decision journal when one is kept (the ``Proposer.on_verify``
hook; the step's time is not used), and forwards the lifecycle to every candidate, in order."""

from types import SimpleNamespace

import pytest

from specbatch.auto.proposer import AutoProposer


class _Candidate:
    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def start(self, seq):
        self.calls.append((self.name, "start", seq.seq_id))

    def on_commit(self, seq, n):
        self.calls.append((self.name, "commit", seq.seq_id, n))

    def finish(self, seq):
        self.calls.append((self.name, "finish", seq.seq_id))


class _Policy:
    def __init__(self, candidates):
        self.candidates = candidates
        self.selected, self.observed = [], []

    def select(self, seqs, caps, num_rows=None, draining=False):
        self.selected.append(([s.seq_id for s in seqs], caps, num_rows) + (draining,) * draining)
        return [[1, 2][:c] for c in caps]

    def observe(self, seq, emitted):
        self.observed.append((seq.seq_id, emitted))


class _Journal:
    def __init__(self):
        self.steps = []

    def step(self, policy):
        self.steps.append(policy)


def test_auto_proposer_feeds_the_policy_and_the_candidates():
    calls = []
    policy = _Policy([_Candidate("ngram", calls), _Candidate("suffix", calls)])
    proposer = AutoProposer([("ngram", None), ("suffix", None)])
    a = SimpleNamespace(seq_id=0, token_ids=[10, 11])
    b = SimpleNamespace(seq_id=1, token_ids=[12])
    with pytest.raises(RuntimeError, match="no policy yet"):
        proposer.start(a)
    proposer.use(policy)
    proposer.start(a)
    a.token_ids.append(5)  # the prefill's token: not a row of a step, nothing observed
    proposer.on_commit(a, 1)
    drafts = proposer.propose([a, b], [3, 0])
    assert policy.selected == [([0, 1], [3, 0], None)] and drafts == [[1, 2], []]
    proposer.on_verify([a, b], drafts, 0.25)  # no journal: nothing; the time is not used
    journal = proposer.journal = _Journal()
    proposer.on_verify([a, b], drafts, 0.25)
    assert journal.steps == [policy]
    a.token_ids += [1, 9]  # one accepted, one recovered
    proposer.on_commit(a, 2)
    assert policy.observed == [(0, [1, 9])]  # what the step committed
    proposer.finish(b)  # finished before its commit: nothing observed for it
    assert len(policy.observed) == 1
    assert calls == [("ngram", "start", 0), ("suffix", "start", 0),
                     ("ngram", "commit", 0, 1), ("suffix", "commit", 0, 1),
                     ("ngram", "commit", 0, 2), ("suffix", "commit", 0, 2),
                     ("ngram", "finish", 1), ("suffix", "finish", 1)]
    assert proposer.name == "auto" and proposer.counts_rows is True
    proposer.propose([a], [2], num_rows=3)  # two placeholders beside it (a resume)
    assert policy.selected[-1] == ([0], [2], 3)
    assert proposer.sees_drain is True  # the engine tells it whether the job drains
    proposer.propose([a], [2], draining=True)
    assert policy.selected[-1] == ([0], [2], None, True)
