"""What auto's candidates learn from a verify step: the positions whose outcome does not depend
on which draft was verified (``LookupCandidate.observe``, ``SuffixCandidate.observe``).

Under greedy decoding the emitted tokens are the target's whatever was verified, but how many a
step emits is set by the verified draft. A candidate whose proposal was not verified is scored
on its first position only: scoring the positions that another draft's accepted tokens showed
counts hits exactly where the text copies well (the lookup's estimates read 0.1-0.2 above its
realised acceptance on the extraction recipe, and auto took lookup drafts over longer suffix
ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specbatch.auto.candidate import LookupCandidate, SuffixCandidate, _calibration_cell
from specbatch.spec_decode.suffix import Draft

PROPOSAL = [7, 8, 9, 10, 11, 12]
# a suffix draft's context seen this often: its smoothed frequency is its raw one to 1e-6
# (``candidate._frequencies``)
SEEN = 10**6


class FixedLookup:
    """A prompt-lookup stand-in: proposes ``text`` (default ``PROPOSAL``, cut to the cap) from
    a 3-gram match."""

    def __init__(self, text=PROPOSAL):
        self.text = text

    def propose(self, seqs, caps):
        return [self.text[:c] for c in caps]

    def match_len(self, seq):
        return 3


class FixedSuffix:
    def draft(self, seq, cap, rows):
        n = min(cap, len(PROPOSAL))
        return Draft(PROPOSAL[:n], [0.9 ** (j + 1) for j in range(n)], 4, "self", [9] * n)


def _seq():
    return SimpleNamespace(seq_id=1, token_ids=[1, 2, 3], num_output_tokens=0,
                           request=SimpleNamespace(tag=0))


def _lookup():
    return LookupCandidate(FixedLookup(), 4, lambda s: [(1.0, 1.0)] * 4)


def test_a_lookup_proposal_not_verified_is_scored_on_its_first_position():
    cand, seq = _lookup(), _seq()
    cand.prepare([seq], [6])
    cand.reach([seq], [4])
    cand.observe(seq, PROPOSAL[:4] + [99])  # another draft's 4 accepted tokens and a bonus
    row = cand.rows[seq.seq_id]
    assert row.trials == [1.0] and row.hits == [1.0]
    assert cand.lookup_pool.trials == [1.0]
    # the calibration cell of the first position, estimated at the prior's 0.5
    assert cand.calibration == {_calibration_cell(0, 0.5): [1.0, 1.0]}


def test_a_verified_lookup_draft_is_scored_through_its_bonus_position():
    cand, seq = _lookup(), _seq()
    cand.prepare([seq], [6])
    cand.reach([seq], [4])
    assert cand.drafts([seq], [2], 0.0) == [PROPOSAL[:2]]
    cand.observe(seq, PROPOSAL[:2] + [99])  # 2 accepted, the bonus differs from position 2
    row = cand.rows[seq.seq_id]
    assert row.trials == [1.0, 1.0, 1.0] and row.hits == [1.0, 1.0, 0.0]
    cells = {cell: th for cell, th in cand.calibration.items()}
    assert sum(t for t, _ in cells.values()) == 3.0 and sum(h for _, h in cells.values()) == 2.0


def test_the_lookup_calibration_moves_its_reach_and_round_trips():
    cand, seq = _lookup(), _seq()
    before = cand.reach([seq], [1])[0][0]
    for _ in range(20):  # fresh rows estimated at the prior's 0.5, never accepted
        cand.rows.clear()
        cand.prepare([seq], [6])
        cand.reach([seq], [1])
        cand.observe(seq, [99])
    assert set(cand.calibration) == {_calibration_cell(0, 0.5)}
    cand.rows.clear()
    cand.prepare([seq], [6])
    assert before == 0.5 and cand.reach([seq], [1])[0][0] < 0.1
    other = _lookup()
    other.set_global_state(cand.global_state())
    assert other.calibration == cand.calibration


def test_a_suffix_draft_not_verified_is_scored_on_its_first_position():
    cand, seq = SuffixCandidate(FixedSuffix()), _seq()
    cand.prepare([seq], [6])
    cand.observe(seq, PROPOSAL[:5] + [99])
    assert sum(t for t, _ in cand.pool.values()) == 1.0
    cand.prepare([seq], [6])
    cand.drafts([seq], [3], 0.0)
    cand.observe(seq, PROPOSAL[:5] + [99])
    assert sum(t for t, _ in cand.pool.values()) == 1.0 * 0.995 + 4.0  # decayed, then 0..3


def test_a_suffix_draft_that_extends_the_lookup_draft_scores_their_shared_tokens_once():
    """Lookup proposes 6 tokens it is 90% sure of, position by position; suffix proposes the
    same 6 and 9 more, at 60% each by its own counts. The shared tokens have one chance of
    acceptance whoever proposes them: the suffix draft keeps the lookup's estimate over them,
    so the longer draft wins (without it, the lookup's 5 tokens did)."""
    from specbatch.auto.costmodel import CostModel
    from specbatch.auto.policy import AdaptivePolicy

    text = list(range(7, 22))

    class Suffix:
        def draft(self, seq, cap, rows):
            return Draft(text[:cap], [0.6 ** (j + 1) for j in range(cap)], 4, "self",
                         [SEEN] * cap)

    lookup = LookupCandidate(FixedLookup(text), 5, lambda s: [(9.0, 1.0)] * 5, match_len=True)
    policy = AdaptivePolicy(CostModel((0.010, 0.0002, 0.0, 0.0)), 5, lookup,
                            [SuffixCandidate(Suffix())])
    drafts = policy.select([_seq()], [15])
    assert policy.decisions[0][1:] == ("suffix", len(drafts[0])) and len(drafts[0]) > 5, \
        policy.decisions
    assert drafts[0] == text[:len(drafts[0])]


def _one_token_suffix_policy(freq: float, rows: int = 16):
    """A step of ``rows`` rows where the lookup proposes nothing and suffix proposes one token
    at ``freq`` per row (its reach, before the pool has seen a draft)."""
    from specbatch.auto.costmodel import CostModel
    from specbatch.auto.policy import AdaptivePolicy

    class NoLookup(FixedLookup):
        def propose(self, seqs, caps):
            return [[] for _ in caps]

    class Suffix:
        def draft(self, seq, cap, rows):
            return Draft([7], [freq], 4, "self", [SEEN])

    lookup = LookupCandidate(NoLookup(), 4, lambda s: [(1.0, 1.0)] * 4)
    policy = AdaptivePolicy(CostModel((0.010, 0.0002, 0.0, 0.0)), 4, lookup,
                            [SuffixCandidate(Suffix())])
    seqs = [SimpleNamespace(seq_id=i, token_ids=[1, 2, 3], num_output_tokens=0,
                            request=SimpleNamespace(tag=0)) for i in range(rows)]
    return policy, seqs


def test_suffix_drafts_are_priced_by_the_verify_step_alone():
    """The suffix lookup runs for every row in ``prepare``, before anything is chosen, so it
    costs the same whichever draft the step verifies: suffix drafts pay when their predicted
    rate (the verify step's seconds alone) beats plain decoding's by ``draft_margin``. Priced
    at the ~30 us per row auto used to charge suffix drafts alone (0.48 ms of a 16.4 ms step
    here), the 1.045x draft below lost to plain decoding."""
    policy, seqs = _one_token_suffix_policy(0.5)
    plain = 16 / policy._seconds(16, 1, 3.0, 16)
    drafted = lambda f: (16 + 16 * f) / policy._seconds(16, 2, 3.0, 32)  # noqa: E731
    # the frequencies where drafting is 1.045x and 1.02x of plain decoding
    pays = (1.045 * plain * policy._seconds(16, 2, 3.0, 32) - 16) / 16
    short = (1.02 * plain * policy._seconds(16, 2, 3.0, 32) - 16) / 16
    assert drafted(pays) / plain > 1 + policy.draft_margin > drafted(short) / plain
    assert (drafted(pays) * policy._seconds(16, 2, 3.0, 32)
            / (policy._seconds(16, 2, 3.0, 32) + 16 * 30e-6)) / plain < 1 + policy.draft_margin
    for freq, taken in ((pays, True), (short, False)):
        policy, seqs = _one_token_suffix_policy(freq)
        drafts = policy.select(seqs, [4] * 16)
        assert [src for _, src, _ in policy.decisions] == ["suffix" if taken else "none"] * 16
        assert drafts == ([[7]] * 16 if taken else [[]] * 16)


def test_a_suffix_draft_from_a_single_occurrence_is_never_certain():
    """A 12-token own-text draft after an 8-token match, every position from a context seen
    once before (raw frequency 1.0 each), its first position accepted in each of 8 steps. The
    raw frequency made the pool's prior 1.0 and the cell's estimate stayed 1.0 at 8 of 8 hits:
    the whole 12 tokens read certain (on the 16 peer records such drafts gave 4 of 38). Smoothed
    (``_frequencies``: 1 / (1 + 1)), the cell's estimate is its hits against a prior of 0.5,
    and the draft's reach falls along it; a context seen 100 times, every time continuing the
    same way, starts near certain in a cell of its own."""
    ids = list(range(100, 112))

    def candidate(seen: int) -> SuffixCandidate:
        class Suffix:
            def draft(self, seq, cap, rows):
                return Draft(ids[:cap], [1.0] * min(cap, 12), 8, "self", [seen] * min(cap, 12))
        return SuffixCandidate(Suffix())

    once, seq = candidate(1), _seq()
    for _ in range(8):  # not verified: scored on the first position, accepted
        once.prepare([seq], [12])
        once.observe(seq, [ids[0], 99])
    once.prepare([seq], [12])
    reach = once.reach([seq], [12])[0]
    trials, hits = once.pool[(8, 2)]  # 8+ matched, the 0.4-0.6 bucket
    p = (hits + 2.0 * 0.5) / (trials + 2.0)
    assert trials == hits == pytest.approx(sum(0.995 ** i for i in range(1, 9)))
    assert reach == pytest.approx([p ** (j + 1) for j in range(12)]) and reach[-1] < 0.35
    often = candidate(100)
    often.prepare([seq], [12])
    assert often.reach([seq], [12])[0][-1] == pytest.approx((100 / 101) ** 12)
