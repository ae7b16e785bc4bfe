"""Prompt-lookup proposer: NgramIndex lookups and NgramProposer bookkeeping across sequences."""

from __future__ import annotations

import random

import pytest

from specbatch.config import SamplingParams
from specbatch.engine.sequence import Request, Sequence
from specbatch.spec_decode.ngram import NgramIndex, NgramProposer

# (name, tokens, min_n, max_n, k, expected draft)
CASES = [
    ("no match", [1, 2, 3, 4, 5], 1, 3, 4, []),
    ("context shorter than min_n", [7, 7], 2, 3, 4, []),
    ("single token", [7], 1, 3, 4, []),
    ("only match is the suffix itself", [1, 2, 3, 1, 2], 3, 3, 4, []),
    ("k = 0", [1, 2, 1], 1, 2, 0, []),
    # suffix [2, 3] last occurred right before the final token: draft starts at the end
    ("match at the very end", [9, 2, 3, 2, 3], 2, 2, 1, [2]),
    # 1-gram [5] -> 6 (latest at index 3); 3-gram [3, 4, 5] -> 8 (index 1): longest wins
    ("longest n-gram preferred", [3, 4, 5, 8, 5, 6, 3, 4, 5], 1, 3, 2, [8, 5]),
    ("shorter n-gram when longer misses", [1, 5, 6, 2, 5], 1, 3, 2, [6, 2]),
    # [1, 2] occurs at 0 (-> 3) and 3 (-> 4): the most recent occurrence wins
    ("tie: most recent occurrence wins", [1, 2, 3, 1, 2, 4, 9, 1, 2], 2, 2, 2, [4, 9]),
    ("tie at n = 1", [5, 1, 5, 2, 5, 3, 5], 1, 1, 1, [3]),
    # continuation runs past the end: drafting continues from the drafted tokens
    ("periodic continuation", [1, 2, 1, 2], 1, 2, 7, [1, 2, 1, 2, 1, 2, 1]),
    ("periodic, period 3", [4, 5, 6, 4, 5], 2, 2, 6, [6, 4, 5, 6, 4, 5]),
    ("constant run", [8, 8], 1, 1, 3, [8, 8, 8]),
    ("draft shorter than k is never cut", [1, 2, 3, 4, 1], 1, 2, 3, [2, 3, 4]),
]


@pytest.mark.parametrize("name,tokens,min_n,max_n,k,expected", CASES, ids=[c[0] for c in CASES])
def test_index_propose(name, tokens, min_n, max_n, k, expected):
    assert NgramIndex(list(tokens), min_n, max_n).propose(k) == expected


def reference_propose(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Brute force: longest suffix n-gram, its most recent earlier occurrence, continued over
    the growing text (tokens + draft)."""
    if k <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                text = list(tokens)
                for j in range(k):
                    text.append(text[start + n + j])
                return text[length:]
    return []


def test_index_matches_brute_force_on_random_text():
    rng = random.Random(0)
    checked_nonempty = 0
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        min_n = rng.randrange(1, 3)
        max_n = min_n + rng.randrange(0, 3)
        k = rng.randrange(0, 9)
        got = NgramIndex(tokens, min_n, max_n).propose(k)
        assert got == reference_propose(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)
        checked_nonempty += bool(got)
    assert checked_nonempty > 100


def test_incremental_index_equals_from_scratch():
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(3)]
    index = NgramIndex(tokens, 1, 4)
    while len(tokens) < 200:
        tokens.extend(rng.randrange(6) for _ in range(rng.randrange(1, 6)))
        index.extend()
        fresh = NgramIndex(list(tokens), 1, 4)
        assert index.tables == fresh.tables
        assert index.num_indexed == len(tokens)
        for k in (1, 5):
            assert index.propose(k) == fresh.propose(k)


def make_seq(tokens: list[int]) -> Sequence:
    return Sequence(Request(tokens[0], list(tokens), SamplingParams()), "ngram", 5)


def test_rows_without_proposals_in_the_middle_of_a_batch():
    seqs = [make_seq([1, 2, 3, 1, 2]), make_seq([4, 5, 6, 7]), make_seq([9, 9, 1, 9]),
            make_seq([3, 3, 3])]
    proposer = NgramProposer(1, 3)
    for s in seqs:
        proposer.start(s)
    drafts = proposer.propose(seqs, [3, 3, 0, 2])
    assert drafts == [[3, 1, 2], [], [], [3, 3]]
    drafts = proposer.propose(seqs, [3, 3, 2, 2])
    assert drafts[2] == [1, 9]  # [9] last occurred at index 1, followed by 1, 9


def test_state_never_leaks_between_sequences():
    """Each sequence's drafts come from its own tokens only, whatever the other sequences
    hold, and a finished sequence's index is dropped."""
    a = make_seq([1, 2, 3, 4])
    b = make_seq([5, 6, 7, 8, 5, 6])
    proposer = NgramProposer(1, 2)
    proposer.start(a)
    proposer.start(b)
    assert proposer.propose([a, b], [3, 3]) == [[], [7, 8, 5]]
    b.token_ids.extend([9, 1])  # b's index now knows [9] -> 1
    proposer.on_commit(b, 2)
    a.token_ids.append(9)  # a's index knows [1] -> 2
    proposer.on_commit(a, 1)
    assert proposer.propose([a, b], [3, 3]) == [[], []]
    a.token_ids.append(1)
    proposer.on_commit(a, 1)
    assert proposer.propose([b, a], [3, 3]) == [[], [2, 3, 4]]
    proposer.finish(a)
    assert a.seq_id not in proposer.indexes and b.seq_id in proposer.indexes
    # a new sequence with a's tokens starts from an index of its own, built from its tokens
    c = make_seq(list(a.token_ids[:4]))
    proposer.start(c)
    assert proposer.propose([c], [3]) == [[]]
    c.token_ids.append(2)
    proposer.on_commit(c, 1)
    assert proposer.propose([b, c], [2, 2]) == [[], [3, 4]]


def test_proposer_matches_fresh_index_as_tokens_commit():
    rng = random.Random(2)
    seq = make_seq([rng.randrange(5) for _ in range(8)])
    proposer = NgramProposer(2, 4)
    proposer.start(seq)
    for _ in range(40):
        new = [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        seq.token_ids.extend(new)
        proposer.on_commit(seq, len(new))
        assert proposer.propose([seq], [4]) == [NgramIndex(list(seq.token_ids), 2, 4).propose(4)]


@pytest.mark.parametrize("lo,hi", [(0, 2), (3, 2)])
def test_bad_sizes_raise(lo, hi):
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(lo, hi)
