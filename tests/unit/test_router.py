"""``spec_decode.router.Router``: auto's proposer feeds its policy the full proposals, the
verify step's time and the committed tokens, and forwards everything else to the candidates."""

from types import SimpleNamespace

from specbatch.spec_decode.router import Router


class _Candidates:
    name = "candidates"

    def __init__(self):
        self.calls = []

    def start(self, seq):
        self.calls.append(("start", seq.seq_id))

    def propose(self, seqs, ks):
        return [[1, 2, 3, 4], [5]][:len(seqs)]

    def on_commit(self, seq, n):
        self.calls.append(("commit", seq.seq_id, n))

    def finish(self, seq):
        self.calls.append(("finish", seq.seq_id))

    def match_len(self, seq):
        return 7


class _Policy:
    def __init__(self):
        self.selected, self.observed, self.steps, self.finished = [], [], [], []

    def select(self, seqs, drafts, caps):
        self.selected.append((drafts, caps))
        return [d[:2] for d in drafts]

    def observe_step(self, seqs, drafts, seconds):
        self.steps.append((len(seqs), drafts, seconds))

    def observe(self, seq, draft, emitted):
        self.observed.append((seq.seq_id, draft, emitted))

    def finish(self, seq):
        self.finished.append(seq.seq_id)


def test_router_feeds_the_policy_and_forwards_the_rest():
    cands, policy = _Candidates(), _Policy()
    router = Router(cands, policy)
    a = SimpleNamespace(seq_id=0, token_ids=[10, 11])
    b = SimpleNamespace(seq_id=1, token_ids=[12])
    router.start(a)
    drafts = router.propose([a, b], [3, 0])
    assert policy.selected == [([[1, 2, 3], []], [3, 0])]  # capped before the policy cuts
    assert drafts == [[1, 2], []]
    router.on_verify([a, b], drafts, 0.25)
    assert policy.steps == [(2, [[1, 2], []], 0.25)]
    a.token_ids += [1, 9]  # one accepted, one recovered
    router.on_commit(a, 2)
    assert policy.observed == [(0, [1, 2, 3], [1, 9])]  # the full proposal, what came out
    router.finish(b)  # finished before its commit: nothing observed for it
    assert policy.finished == [1] and len(policy.observed) == 1
    assert cands.calls == [("start", 0), ("commit", 0, 2), ("finish", 1)]
    assert router.match_len(a) == 7 and router.name == "auto"
