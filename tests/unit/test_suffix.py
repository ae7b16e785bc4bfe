"""The suffix proposer (``spec_decode.suffix``): the automaton's longest match and counts against
brute force, the documented continuation on hand-built cases, eviction under the bound, resume
rebuilding the same index, and outputs equal to plain decoding on tiny float64 models."""

from __future__ import annotations

import random

import pytest

from specbatch.config import SamplingParams, SpecConfig
from specbatch.engine.sequence import Request, Sequence
from specbatch.spec_decode import make_proposer, suffix
from specbatch.spec_decode.suffix import (SuffixAutomaton, SuffixIndex, SuffixProposer,
                                          finished_outputs)
from tests.helpers import make_engine, repeating_prompts, run_engine, tiny_llama, tiny_qwen2


def _occurrences(docs: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(1 for d in docs for i in range(len(d) - n + 1) if d[i:i + n] == pattern)


def _brute_longest(docs: list[list[int]], tail: list[int]) -> int:
    for n in range(len(tail), 0, -1):
        if _occurrences(docs, tail[len(tail) - n:]):
            return n
    return 0


def _snapshot(sam: SuffixAutomaton) -> tuple:
    return (sam.nxt, sam.link, sam.length, sam.occ, sam.num_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_match_and_counts_equal_brute_force(seed):
    """Random small-alphabet documents: the longest matched suffix and every continuation's
    count equal a brute-force scan of the documents."""
    rng = random.Random(seed)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 30))] for _ in range(12)]
    sam = SuffixAutomaton()
    for d in docs:
        sam.add_document(d)
    assert sam.num_tokens == sum(map(len, docs))
    assert sam.num_states <= 2 * sam.num_tokens + 1
    for _ in range(200):
        tail = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]  # 4: never indexed
        state, n = sam.match(tail)
        assert n == _brute_longest(docs, tail)
        if n:
            pattern = tail[len(tail) - n:]
            assert sam.occ[state] == _occurrences(docs, pattern)
            for tok, child in sam.nxt[state].items():
                assert sam.occ[child] == _occurrences(docs, pattern + [tok])


def _scanned_continuation(sam: SuffixAutomaton, state: int, max_len: int) -> list[int]:
    """The documented greedy continuation with every state's children scanned (no cache)."""
    ids, v = [], state
    while len(ids) < max_len and sam.nxt[v] and sam.occ[v]:
        tok, v = min(sam.nxt[v].items(), key=lambda kv: (-sam.occ[kv[1]], kv[0]))
        ids.append(tok)
    return ids


@pytest.mark.parametrize("seed", range(6))
def test_cached_continuations_equal_a_scan_as_documents_arrive(seed):
    """The per-state best-continuation cache, kept up to date (not dropped) as documents
    arrive: after every document (which grows counts, adds transitions and clones states under
    cached entries) every cached best equals a scan of the state's children, and so do drafts."""
    rng = random.Random(seed)
    sam = SuffixAutomaton()
    alphabet = 3 + seed % 3
    for _ in range(60):
        sam.add_document([rng.randrange(alphabet) for _ in range(rng.randrange(1, 25))])
        for v, cached in sam.best.items():
            assert cached == min(sam.nxt[v].items(), key=lambda kv: (-sam.occ[kv[1]], kv[0]))
        for _ in range(15):
            state, n = sam.match([rng.randrange(alphabet) for _ in range(rng.randrange(1, 6))])
            got, _, _ = sam.continuation(state, 12, min_prob=0.0)
            assert got == _scanned_continuation(sam, state, 12)
    assert len(sam.best) > 20  # the cache was used, across documents


def test_a_rows_match_advanced_by_its_new_tokens_equals_a_fresh_walk():
    """The job-index match a row keeps between propose calls (advanced by the committed tokens,
    cut to max_match, walked again after a document joins) equals a walk of its last max_match
    tokens, and so do the drafts: a proposer that has followed the row drafts what a fresh one
    drafts. Documents copy stretches of the row's text, so matches pass max_match."""
    rng = random.Random(7)
    index = SuffixIndex()
    follower = SuffixProposer(index, max_match=4)
    seq = Sequence(Request(0, [rng.randrange(3) for _ in range(40)], SamplingParams()),
                   "suffix", 8)
    index.add(seq.token_ids[5:30])
    follower.start(seq)
    capped = 0
    for step in range(300):
        seq.token_ids.extend(rng.randrange(3) for _ in range(rng.randrange(1, 4)))
        follower.on_commit(seq, 0)
        if step % 5 == 0:
            i = rng.randrange(len(seq.token_ids) - 10)
            index.add(seq.token_ids[i:i + rng.randrange(5, 30)])
        fresh = SuffixProposer(index, max_match=4)
        fresh.start(seq)
        state, n = follower.rows[seq.seq_id].job_match(index, 4)
        assert (state, n) == index.sam.match(seq.token_ids[-4:])
        capped += n == 4
        assert follower.draft(seq, 8) == fresh.draft(seq, 8)
    assert capped > 100

    # a join that clones the row's state: "2" sat with "7 1 2"; [1, 2, 4] splits "1 2", "2" off
    # it, and a match advanced from the stale state would claim "1 2 4" for the text "5 2 4"
    index = SuffixIndex()
    index.add([7, 1, 2, 3])
    follower = SuffixProposer(index, max_match=4)
    seq = Sequence(Request(1, [5, 2], SamplingParams()), "suffix", 8)
    follower.start(seq)
    assert follower.rows[seq.seq_id].job_match(index, 4)[1] == 1
    index.add([1, 2, 4])
    seq.token_ids.append(4)
    assert follower.rows[seq.seq_id].job_match(index, 4) == index.sam.match([5, 2, 4]) == (
        index.sam.nxt[index.sam.nxt[0][2]][4], 2)


def test_continuation_follows_frequency_hand_built():
    """After "1 2", 3 follows three times and 4 once: the draft takes 3 (p = 3/4) then, after
    "1 2 3", 5 twice and 6 once (p = 3/4 * 2/3 = 1/2), then 7 (p = 1/2 * 1/2 = 1/4: "1 2 3 5"
    ends one document and continues with 7 in the other)."""
    docs = [[1, 2, 3, 5, 7], [1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4]]
    sam = SuffixAutomaton()
    for d in docs:
        sam.add_document(d)
    state, n = sam.match([9, 1, 2])
    assert n == 2
    ids, probs, support = sam.continuation(state, 10)
    assert ids == [3, 5, 7]
    assert probs == pytest.approx([3 / 4, 1 / 2, 1 / 4])
    assert support == [4, 3, 2]  # occurrences of "1 2", "1 2 3", "1 2 3 5"
    # the path stops once its probability falls below min_token_prob
    assert sam.continuation(state, 10, min_prob=0.3)[0] == [3, 5]
    assert sam.continuation(state, 1)[0] == [3]
    # equal counts: the lowest token id wins
    tie = SuffixAutomaton()
    for d in ([8, 6], [8, 2], [8, 9]):
        tie.add_document(d)
    assert tie.continuation(tie.match([8])[0], 5, min_prob=0.0) == ([2], [pytest.approx(1 / 3)],
                                                                    [3])


def _seq(tokens: list[int], num_prompt: int, k: int = 15) -> Sequence:
    seq = Sequence(Request(0, tokens[:num_prompt], SamplingParams()), "suffix", k)
    seq.token_ids.extend(tokens[num_prompt:])
    return seq


def test_proposer_drafts_from_the_job_index_when_own_text_has_no_match():
    """A row whose own text has no repeat drafts from the finished outputs; the draft is at most
    max_spec_factor * match length long, and its own text wins when it matches longer."""
    job = SuffixIndex()
    for _ in range(3):
        job.add([40, 41, 42, 43, 44, 45, 46, 47])
    prop = SuffixProposer(job)
    seq = _seq([1, 2, 3, 40, 41, 42], 3)
    prop.start(seq)
    assert prop.propose([seq], [15]) == [[43, 44, 45]]  # match "40 41 42": 3 tokens -> 3
    d = prop.last_draft(seq)
    assert (d.source, d.match_len, d.probs, d.support) == ("job", 3, [1.0] * 3, [3] * 3)
    seq.token_ids.extend([43, 44, 45, 46])
    prop.on_commit(seq, 4)
    assert prop.propose([seq], [2]) == [[47]]  # the documents end after 47
    # own text: "5 6 7 8" repeated twice in the prompt -> "5 6 7" drafts 8 5 6 (p = 1 each)
    own = _seq([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], 8)
    prop.start(own)
    assert prop.propose([own], [3]) == [[8, 5, 6]]
    # the occurrence at the row's end has no continuation yet and does not count against it:
    # the 7-token match "5 6 7 8 5 6 7" was seen once before, and so was each longer context
    d = prop.last_draft(own)
    assert (d.source, d.match_len, d.probs, d.support) == ("self", 7, [1.0] * 3, [1] * 3)
    prop.finish(own)
    assert len(job.docs) == 4 and job.docs[-1] == (5, 6, 7)  # the finished answer joined


def test_the_longer_match_drafts_as_if_both_were_walked():
    """``SuffixProposer.draft`` walks the continuation of the longer match only (the other's
    where that one is empty): on random texts over a few tokens, beside a job index, its drafts
    are those of walking both and keeping the longer match's, own text on a tie or where the
    job's is empty."""
    rng = random.Random(3)
    job = SuffixIndex()
    for _ in range(6):
        job.add([rng.randrange(5) for _ in range(rng.randrange(4, 30))])
    prop = SuffixProposer(job)
    seqs = [_seq([rng.randrange(5) for _ in range(rng.randrange(1, 12))], 1) for _ in range(8)]
    for seq in seqs:
        prop.start(seq)
    for step in range(40):
        for seq in seqs:
            cap, rows = rng.choice((1, 3, 15)), rng.choice((1, 16))
            got = prop.draft(seq, cap, rows)
            row = prop.rows[seq.seq_id]
            own_factor = (max(prop.max_spec_factor, suffix.OWN_FACTOR_FEW_ROWS)
                          if rows <= suffix.FEW_ROWS else prop.max_spec_factor)
            own = row.draft(cap, prop.min_token_prob, own_factor)
            state, n = row.job_match(job, prop.max_match)
            both = suffix.draft_from(job.sam, state, n, cap, "job", prop.min_token_prob,
                                     prop.max_spec_factor)
            want = both if both.ids and (both.match_len > own.match_len or not own.ids) else own
            assert got == want, (step, seq.seq_id)
            seq.token_ids.append(got.ids[0] if got.ids and rng.random() < 0.7
                                 else rng.randrange(5))
            prop.on_commit(seq, 1)


def test_proposer_picks_the_longer_match_and_few_rows_draft_longer_own_text():
    """Own text and job index compete on match length, not on path probability: a 2-token own
    match drafting with probability 1 loses to a 3-token job match whose continuations are split
    1:1. In a step of <= FEW_ROWS rows the own-text draft grows to OWN_FACTOR_FEW_ROWS x its
    match; in a full step to max_spec_factor x."""
    job = SuffixIndex()
    job.add([7, 8, 9, 10, 11])
    job.add([7, 8, 9, 12, 13])
    prop = SuffixProposer(job, min_token_prob=0.0)
    # own text: "8 9" repeats (prompt "8 9 20 21 22 ... 8 9"), the job index matches "7 8 9"
    seq = _seq([8, 9, 20, 21, 22, 23, 7, 8, 9], 6)
    prop.start(seq)
    assert prop.propose([seq], [15]) == [[10, 11]]  # lowest id of the 1:1 tie, 3 -> at most 3
    d = prop.last_draft(seq)
    assert (d.source, d.match_len, d.probs) == ("job", 3, [0.5, 0.5])
    # own text only (no job match): 2-token match "8 9" -> 4 drafts at one row, 2 at 16 rows
    own = _seq([8, 9, 20, 21, 22, 23, 5, 8, 9], 6)
    prop.start(own)
    assert suffix.FEW_ROWS == 2 and suffix.OWN_FACTOR_FEW_ROWS == 2.0
    assert prop.propose([own], [15]) == [[20, 21, 22, 23]]
    others = [_seq([100 + i], 1) for i in range(15)]
    for o in others:
        prop.start(o)
    assert prop.propose([own, *others], [15] * 16)[0] == [20, 21]
    assert prop.last_draft(own).source == "self"


def test_method_suffix_cuts_many_row_drafts_at_k_and_probability_07():
    """--method suffix: in a step of more than FEW_ROWS rows a draft stops at k tokens and where
    its path probability drops below 0.7; at one row it keeps SuffixDecoding's 0.1 and the 3k
    cap. auto's suffix drafts keep them at any row count (its policy cuts by step cost)."""
    job = SuffixIndex()
    for _ in range(4):
        job.add(list(range(40, 60)))
    job.add([40, 41, 42, 99])  # after "40 41 42": 43 four times, 99 once -> p 0.8 then 0.8
    job.add([40, 41, 42, 43, 98])  # after "... 43": 44 four times, 98 once -> p 0.64
    method = make_proposer(SpecConfig(method="suffix", num_speculative_tokens=3))
    auto_suffix = dict(make_proposer(SpecConfig(method="auto",
                                                 num_speculative_tokens=3)).members)["suffix"]
    assert method.many_rows_cap == 3 and auto_suffix.many_rows_cap is None
    for prop in (method, auto_suffix):
        prop.index = job
    seq = _seq([1, 2, 3, 4, 5, 6, 7, 8, 40, 41, 42, 43, 44, 45, 46, 47, 48], 9)
    others = [_seq([100 + i], 1) for i in range(15)]
    for prop in (method, auto_suffix):
        for s in (seq, *others):
            prop.start(s)
    # one row: the 9-token match drafts to the 9-token cap (probabilities 1)
    assert method.propose([seq], [9])[0] == list(range(49, 58))
    # sixteen rows: at most k = 3
    assert method.propose([seq, *others], [9] * 16)[0] == [49, 50, 51]
    assert auto_suffix.draft(seq, 9, 16).ids == list(range(49, 58))
    # a short match whose path falls under 0.7: "42" -> 43 (0.8), 44 (0.64) cut after one
    short = _seq([7, 42], 9)
    for prop in (method, auto_suffix):
        prop.start(short)
    assert method.propose([short, *others], [9] * 16)[0] == [43]
    assert auto_suffix.draft(short, 9, 16).ids == [43]  # factor 1 x a 1-token match
    assert method.propose([short], [9])[0] == [43]


def test_eviction_keeps_index_under_bound():
    """Documents beyond the bound evict the oldest first; the automaton then holds exactly the
    documents kept (rebuilt), and a document's own text stops matching once it is evicted."""
    bound = 500
    job = SuffixIndex(max_tokens=bound)
    rng = random.Random(0)
    added = []
    for i in range(200):
        doc = [1000 + i] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        job.add(doc)
        added.append(doc)
        assert job.num_tokens <= bound
        assert job.sam.num_tokens == job.num_tokens == sum(map(len, job.docs))
        assert job.sam.num_states <= 2 * bound + 1
    assert job.num_evicted > 0
    assert [list(d) for d in job.docs] == added[len(added) - len(job.docs):]
    assert job.sam.match([1000])[1] == 0  # the first document's marker is gone
    assert job.sam.match([1000 + 199])[1] == 1
    fresh = SuffixAutomaton()
    for d in job.docs:
        fresh.add_document(d)
    assert _snapshot(fresh) == _snapshot(job.sam)
    job.add(list(range(bound + 1)))  # longer than the bound: not indexed
    assert job.num_tokens <= bound


VOCAB = 96
GREEDY = SamplingParams(max_tokens=24)


def _suffix_engine(model, batch_size: int, k: int = 5):
    engine = make_engine(model, k, batch_size)
    engine.proposer = make_proposer(SpecConfig(method="suffix", num_speculative_tokens=k))
    engine.k = SpecConfig(method="suffix", num_speculative_tokens=k).draft_cap
    return engine


@pytest.mark.parametrize("make_model", [lambda: tiny_llama(VOCAB, seed=5),
                                        lambda: tiny_qwen2(VOCAB, seed=6)])
def test_suffix_outputs_equal_plain_decoding(make_model):
    """Suffix speculation (own text + finished outputs) at batch 1 and 4 gives the tokens of
    plain decoding; drafts were accepted, some from the job-wide index, some past k at batch 1
    (steps of more than FEW_ROWS rows cut them at k)."""
    model = make_model()
    prompts = repeating_prompts(VOCAB, 10, seed=7)
    prompts += [p[:6] for p in prompts]  # later records repeat earlier ones' beginnings
    base = run_engine(model, prompts, 0, 1, GREEDY)
    for batch_size in (1, 4):
        engine = _suffix_engine(model, batch_size)
        reqs = [Request(i, p, GREEDY, seed=i) for i, p in enumerate(prompts)]
        seen_job = []
        propose = engine.proposer.propose

        def spy(seqs, ks):
            out = propose(seqs, ks)
            seen_job.extend(engine.proposer.last_draft(s).source == "job" and bool(d)
                            for s, d in zip(seqs, out))
            return out

        engine.proposer.propose = spy
        out = sorted(engine.generate(reqs), key=lambda c: c.request.request_id)
        assert [c.output_ids for c in out] == [b.output_ids for b in base]
        assert sum(c.stats.num_accepted_tokens for c in out) >= 20
        assert any(seen_job)
        if batch_size == 1:
            assert max(max(c.stats.k_histogram) for c in out) > 5  # a draft longer than k
        assert len(engine.proposer.index.docs) == len(prompts)
        for c in out:  # the stats hold k as asked and the cap beside it
            assert (c.stats.num_speculative_tokens, c.stats.max_spec_tokens) == (5, 15)
            per_pos = c.stats.to_dict()["num_accepted_tokens_per_pos"]
            assert len(per_pos) == max(5, c.stats.longest_draft)


def test_resume_rebuilds_the_same_index(tmp_path):
    """The index a job builds live equals the one rebuilt from its work file (OutputWriter,
    resumed), turns records and records that stopped with an error included."""
    from specbatch.io.writer import OutputWriter

    model = tiny_llama(VOCAB, seed=5)
    prompts = repeating_prompts(VOCAB, 8, seed=3)
    engine = _suffix_engine(model, 3)
    writer = OutputWriter(tmp_path / "out.jsonl", {"method": "suffix"}, resume=False,
                          force=False, num_records=len(prompts) + 2)
    for c in engine.generate([Request(i, p, GREEDY, seed=i) for i, p in enumerate(prompts)]):
        writer.write(c.request.request_id, {"output_token_ids": c.output_ids,
                                            "finish_reason": c.finish_reason})
    live = engine.proposer.index
    # a two-turn record and an errored one, as the pipeline writes them
    turns = [[5, 6, 7, 8], [9, 10, 11]]
    for t in turns:
        live.add(t)
    writer.write(len(prompts), {"output_token_ids": turns, "finish_reason": ["stop", "length"]})
    writer.write(len(prompts) + 1, {"output_token_ids": [1, 2], "finish_reason": "error",
                                    "error": "NaN in the target's logits"})
    writer.close()

    resumed = OutputWriter(tmp_path / "out.jsonl", {"method": "suffix"}, resume=True,
                           force=False, num_records=len(prompts) + 2)
    prop = SuffixProposer()
    prop.add_finished(finished_outputs(resumed.finished_records()))
    resumed.close()
    assert [list(d) for d in prop.index.docs] == [list(d) for d in live.docs]
    assert _snapshot(prop.index.sam) == _snapshot(live.sam)


def _replayed(prompts, sampling, batch_size, cut):
    """An uninterrupted suffix run, and a rerun where the answers of the first ``cut``
    finished are placeholders replaying their recorded schedule (a resume): both engines."""
    from specbatch.engine.sequence import Replay

    model = tiny_llama(VOCAB, seed=5)

    def requests():
        return [Request(i, p, sp, seed=i) for i, (p, sp) in enumerate(zip(prompts, sampling))]

    first = _suffix_engine(model, batch_size)
    full = list(first.generate(requests()))
    done = {c.request.request_id: c for c in full[:cut]}
    second = _suffix_engine(model, batch_size)
    reqs = requests()
    for i, r in enumerate(reqs):
        if (c := done.get(r.request_id)) is not None:
            s = c.schedule
            r.replay = Replay(s["admit"], s["verify"], s["finish"], s["row"], s["phase"],
                              c.output_ids, c.finish_reason)
    resumed = list(second.generate(reqs))
    return first, full, done, second, resumed


@pytest.mark.parametrize("batch_size,cut", [(3, 4), (4, 7), (2, 1)])
def test_a_resume_that_replays_the_schedule_gives_the_same_stats(batch_size, cut):
    """Placeholders hold the rows of the answers finished before the kill from their recorded
    admission to their recorded finish and join the job-wide index there: the other records
    run at the same steps, rows and index as uninterrupted, so their drafts and stats (steps,
    draft tokens, k histogram) are equal, not only their tokens; one record ends at its
    prefill (max_tokens 1: the ``admit`` phase)."""
    prompts = repeating_prompts(VOCAB, 10, seed=7)
    prompts += [p[:6] for p in prompts]
    sampling = [SamplingParams(max_tokens=8 + (i * 5) % 20) for i in range(len(prompts))]
    sampling[5] = SamplingParams(max_tokens=1)
    first, full, done, second, resumed = _replayed(prompts, sampling, batch_size, cut)
    assert second.replay_mismatches == 0
    assert any(c.schedule["phase"] == "admit" for c in full)  # the max_tokens 1 record
    rest = {c.request.request_id: c for c in full if c.request.request_id not in done}
    assert sorted(c.request.request_id for c in resumed) == sorted(rest)
    assert sum(c.stats.num_draft_tokens for c in resumed) > 0
    for c in resumed:
        want = rest[c.request.request_id]
        assert c.output_ids == want.output_ids
        assert c.stats.to_dict() == want.stats.to_dict()
        assert c.schedule == want.schedule
    assert second.step_index == first.step_index
    assert [list(d) for d in second.proposer.index.docs] == \
        [list(d) for d in first.proposer.index.docs]


def test_a_resume_without_the_replay_drafts_differently():
    """The premise: restarting the unfinished records with the finished outputs indexed first
    (the resume before the replay) changes some record's drafts, so the stats differ."""
    prompts = repeating_prompts(VOCAB, 10, seed=7)
    prompts += [p[:6] for p in prompts]
    sampling = [SamplingParams(max_tokens=8 + (i * 5) % 20) for i in range(len(prompts))]
    model = tiny_llama(VOCAB, seed=5)
    first = _suffix_engine(model, 3)
    full = list(first.generate([Request(i, p, sp, seed=i)
                                for i, (p, sp) in enumerate(zip(prompts, sampling))]))
    done = {c.request.request_id for c in full[:4]}
    second = _suffix_engine(model, 3)
    second.proposer.add_finished(c.output_ids for c in full[:4])
    resumed = list(second.generate([Request(i, p, sp, seed=i) for i, (p, sp)
                                    in enumerate(zip(prompts, sampling)) if i not in done]))
    want = {c.request.request_id: c for c in full}
    assert all(c.output_ids == want[c.request.request_id].output_ids for c in resumed)
    assert any(c.stats.to_dict() != want[c.request.request_id].stats.to_dict()
               for c in resumed)


def test_auto_routes_suffix_drafts_per_row_and_keeps_outputs():
    """``auto`` (lookup + suffix candidates, ``auto.proposer``) with a cost model where verifying is
    nearly free: rows verify suffix drafts on some steps, some longer than k, the suffix pools
    learn, and outputs equal plain decoding."""
    from specbatch.auto.candidate import Setup
    from specbatch.auto.costmodel import CostModel
    from specbatch.auto.policy import AdaptivePolicy

    model = tiny_llama(VOCAB, seed=5)
    prompts = repeating_prompts(VOCAB, 10, seed=7)
    prompts += [p[:6] for p in prompts]
    base = run_engine(model, prompts, 0, 1, GREEDY)
    config = SpecConfig(method="auto", num_speculative_tokens=4)
    engine = make_engine(model, 4, 4)
    engine.proposer = make_proposer(config)
    engine.k = config.draft_cap
    lookup, suffix = engine.proposer.build_candidates(Setup(4, lambda s: [(2.0, 2.0)] * 4))
    policy = AdaptivePolicy(CostModel((0.040, 0.0005, 0.0, 0.0)), 4, lookup, [suffix])
    engine.proposer.use(policy)  # as auto's is built
    reqs = [Request(i, p, GREEDY, seed=i, tag=i) for i, p in enumerate(prompts)]
    out = sorted(engine.generate(reqs), key=lambda c: c.request.request_id)
    assert [c.output_ids for c in out] == [b.output_ids for b in base]
    steps = {}
    for counts in policy.steps_by_proposer.values():
        for source, n in counts.items():
            steps[source] = steps.get(source, 0) + n
    assert steps.get("suffix", 0) > 0 and steps.get("ngram", 0) > 0, steps
    assert max(max(c.stats.k_histogram) for c in out) > 4  # a suffix draft past k
    assert sum(t for t, _ in suffix.pool.values()) > 0


def test_json_extraction_recipe_and_example_input():
    """The templated job: a suffix recipe whose template renders every one of 100+ example
    records (Spec-Bench rag / summarization articles) with one fixed instruction."""
    import json
    from pathlib import Path

    from specbatch.io.records import read_records, template_fields
    from specbatch.recipe import load_recipe

    recipes = Path(__file__).resolve().parents[2] / "recipes"
    recipe = load_recipe(recipes / "json_extraction.toml")
    assert (recipe.name, recipe.options["method"], recipe.options["max_tokens"]) == \
        ("json_extraction", "suffix", 512)
    schema = json.loads(Path(recipe.options["json_schema"]).read_text())  # beside the recipe
    assert Path(recipe.options["json_schema"]).parent == recipes
    assert set(schema["required"]) == {"title", "people", "organizations", "locations", "date",
                                       "topic"}
    assert template_fields(recipe.options["template"]) == ["article"]
    records, errors = read_records(recipes / "prompts" / "json_extraction.jsonl",
                                   template=recipe.options["template"])
    assert errors == [] and len(records) >= 100
    instructions = {r.messages[0]["content"].split("Article:")[0] for r in records}
    assert len(instructions) == 1 and '"title"' in next(iter(instructions))
    assert {r.fields["source_category"] for r in records} == {"rag", "summarization"}
