"""``SpecStats`` counters: per-position drafted / accepted counts, merge, the record format
(``to_dict`` / ``from_dict``) and ``spec`` fields written before ``num_draft_tokens_per_pos``."""

from __future__ import annotations

from specbatch.spec_decode.stats import SpecStats, drafted_per_pos


def _steps(stats: SpecStats, steps) -> SpecStats:
    stats.num_steps += 1  # the prefill: in num_steps, not in k_histogram
    for num_draft, num_accepted in steps:
        stats.record_step(num_draft, num_accepted)
    return stats


def test_record_step_counts_the_drafts_that_reach_each_position():
    # drafts of 2 (1 accepted), 5 (all 5), none, 3 (0 accepted): position 4 and 5 were
    # verified once, by the 5-token draft
    s = _steps(SpecStats("suffix", 3), [(2, 1), (5, 5), (0, 0), (3, 0)])
    assert s.num_accepted_tokens_per_pos == [2, 1, 1, 1, 1]
    assert s.num_draft_tokens_per_pos == [3, 3, 2, 1, 1]
    assert s.num_draft_tokens_per_pos == drafted_per_pos(s.k_histogram)
    assert sum(s.num_draft_tokens_per_pos) == s.num_draft_tokens == 10
    # the prefill step is in num_steps, not in k_histogram
    assert (s.num_steps, sum(s.k_histogram.values())) == (5, 4)
    assert s.mean_k == 2.5  # over the 4 decode steps, not the 5 steps
    d = s.to_dict()
    assert d["num_accepted_tokens_per_pos"] == [2, 1, 1, 1, 1]
    assert d["num_draft_tokens_per_pos"] == [3, 3, 2, 1, 1]
    assert SpecStats.from_dict(d) == s


def test_to_dict_pads_both_lists_to_k():
    s = _steps(SpecStats("ngram", 4), [(1, 1), (2, 0)])
    d = s.to_dict()
    assert d["num_accepted_tokens_per_pos"] == [1, 0, 0, 0]
    assert d["num_draft_tokens_per_pos"] == [2, 1, 0, 0]
    assert SpecStats("none", 0).to_dict()["num_draft_tokens_per_pos"] == []


def test_merge_adds_positions_and_an_unknown_side_makes_them_unknown():
    a = _steps(SpecStats("suffix", 3), [(2, 2)])
    b = _steps(SpecStats("suffix", 3), [(4, 1), (1, 0)])
    a.merge(b)
    assert a.num_accepted_tokens_per_pos == [2, 1, 0, 0]
    assert a.num_draft_tokens_per_pos == [3, 2, 1, 1]
    old = SpecStats.from_dict({"num_steps": 2, "num_drafts": 1, "num_draft_tokens": 2,
                               "num_accepted_tokens": 1, "num_accepted_tokens_per_pos": [1],
                               "k_histogram": {}})  # no histogram to derive it from
    assert old.num_draft_tokens_per_pos is None
    a.merge(old)
    assert a.num_draft_tokens_per_pos is None
    assert a.num_accepted_tokens_per_pos == [3, 1, 0, 0]
    assert "num_draft_tokens_per_pos" not in a.to_dict()


def test_an_old_spec_gets_the_drafted_counts_from_its_histogram():
    """A ``spec`` written before ``num_draft_tokens_per_pos``: the histogram says how many
    drafts reached each position (a 7-token draft and a 2-token one: 2, 2, 1, 1, 1, 1, 1)."""
    d = {"proposer": "suffix", "num_speculative_tokens": 5, "max_spec_tokens": 15,
         "num_steps": 4, "num_drafts": 2, "num_draft_tokens": 9, "num_accepted_tokens": 7,
         "num_accepted_tokens_per_pos": [2, 1, 1, 1, 1, 1, 0],
         "k_histogram": {"0": 1, "2": 1, "7": 1}}
    assert SpecStats.from_dict(d).num_draft_tokens_per_pos == [2, 2, 1, 1, 1, 1, 1]
    # a histogram that does not account for the drafts: unknown, not made up
    assert SpecStats.from_dict({**d, "k_histogram": {"7": 1}}).num_draft_tokens_per_pos is None
    # nothing drafted: nothing unknown
    plain = {"num_steps": 3, "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
             "k_histogram": {"0": 2}}
    assert SpecStats.from_dict(plain).num_draft_tokens_per_pos == []
    # a recorded list is read as it is
    assert SpecStats.from_dict({**d, "num_draft_tokens_per_pos": [2, 2, 1, 1, 1, 1, 1]}) \
        == SpecStats.from_dict(d)
