"""``plan_segments``: how a batch's cache rows are read as views (no copies)."""

from __future__ import annotations

import random

import pytest

from specbatch.engine.kv_cache import KV_BLOCK, plan_segments


def blocks(n: int) -> int:
    return -(-n // KV_BLOCK)


def test_docstring_example():
    segs = plan_segments([0, 1, 2, 4], [2000, 300, 300, 300], segment_cost=3)
    assert [(s.lo, s.hi, s.kv_len, s.batch_rows) for s in segs] == [
        (0, 1, 2048, (0,)), (1, 5, 512, (1, 2, -1, 3))]
    assert segs[0].first_batch_row == 0 and segs[1].first_batch_row is None


def test_full_batch_of_equal_rows_is_one_view():
    segs = plan_segments(list(range(16)), [300] * 16)
    assert len(segs) == 1 and segs[0].first_batch_row == 0 and segs[0].kv_len == 512


@pytest.mark.parametrize("seed", range(20))
def test_every_row_read_once_and_far_enough(seed):
    """Random rows and lengths: each batch row is served by exactly one segment, its keys fit
    the segment's length, segments do not overlap, and the plan costs no more than one view
    over all rows or one view per row."""
    rng = random.Random(seed)
    n = rng.randint(1, 16)
    rows = rng.sample(range(24), n)
    lens = [rng.randint(1, 3000) for _ in rows]
    segs = plan_segments(rows, lens, segment_cost=3)
    served = {}
    for s in segs:
        assert s.kv_len % KV_BLOCK == 0 and len(s.batch_rows) == s.hi - s.lo
        for i, b in enumerate(s.batch_rows):
            if b >= 0:
                assert rows[b] == s.lo + i and lens[b] <= s.kv_len
                served[b] = served.get(b, 0) + 1
    assert served == {b: 1 for b in range(n)}
    assert all(a.hi <= b.lo for a, b in zip(segs, segs[1:]))
    cost = sum((s.hi - s.lo) * s.kv_len // KV_BLOCK + 3 for s in segs)
    one_view = (max(rows) - min(rows) + 1) * max(blocks(x) for x in lens) + 3
    per_row = sum(blocks(x) + 3 for x in lens)
    assert cost <= min(one_view, per_row)
