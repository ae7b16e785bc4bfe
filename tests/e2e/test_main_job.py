"""The main job end to end (issue 2, "Done when" 2): the real ``specbatch run`` on Spec-Bench with
the real model, ``--method ngram --k 5`` and ``--method none``.

Checks: every output field in every record; outputs token-identical between the two methods and
between ``--max-batch-size 16`` and ``1``; and each answer equal to transformers' greedy
``generate`` for the same prompt, model and dtype, or differing first at a near-tie (the two
candidate tokens within ``NEAR_TIE`` logits of each other on both sides; see
``specbatch.reference``). The comparison table is printed (``pytest -s`` shows it). The runs
name ``--dtype float32``: ``--dtype auto`` takes int8 for this Q4_1 GGUF on an AVX2 CPU,
llama.cpp's scheme, which transformers does not compute (its float32 differs from int8 past
near-ties; tests/unit/test_dtype_auto.py checks that the reference says so).

The issue's full check is 40 records at max_tokens 128 (80 answers: the first 40 records have
two turns each); that takes several minutes here, so this test runs a fixed subset of 12
records from 11 categories (5 of them two-turn records, 2 summarization, 2 rag) at max_tokens
48. The full check is run by hand:

    specbatch run ../shared/data/spec_bench/question.jsonl --limit 40 --method ngram --k 5 \
        --max-tokens 128 --dtype float32 -o a.jsonl
    specbatch run ../shared/data/spec_bench/question.jsonl --limit 40 --method none \
        --max-tokens 128 --dtype float32 -o b.jsonl
    python -m specbatch.reference a.jsonl
"""

from __future__ import annotations

import pytest

from specbatch.reference import compare_outputs, format_table
from tests.e2e.conftest import read_jsonl, run_cli, spec_bench_subset

pytestmark = pytest.mark.slow

# summarization x2, rag x2, writing / extraction / roleplay / coding / humanities (two turns
# each), translation, qa, math_reasoning. The batch-1 run takes the first NUM_BATCH1 of them.
QUESTION_IDS = [241, 481, 81, 131, 161, 321, 91, 122, 152, 242, 401, 482]
NUM_BATCH1 = 6
MAX_TOKENS = 48
K = 5
# bfloat16 logits of this model are ~10-30 (1 ulp = 0.0625-0.125) and ours and transformers'
# differ by up to ~0.75 after 30 layers (max_abs_diff in the table); measured flips were
# between tokens at most 0.25 apart; a flip between tokens closer than this is rounding.
NEAR_TIE = 0.5
MAX_LOGIT_DIFF = 1.0  # ours vs transformers' logits on the same prefix (measured <= 0.75)

SPEC_FIELDS = {"proposer", "num_speculative_tokens", "max_spec_tokens", "num_steps", "num_drafts",
               "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
               "num_draft_tokens_per_pos", "acceptance_rate", "mean_acceptance_length",
               "k_histogram"}


@pytest.fixture(scope="module")
def runs(spec_bench, real_model, tmp_path_factory):
    """Output files of: ngram k5 at batch 16, none at batch 16, ngram k5 at batch 1 (the first
    NUM_BATCH1 records: batch 1 is the slow one)."""
    d = tmp_path_factory.mktemp("main_job")
    inp = spec_bench_subset(spec_bench, QUESTION_IDS, d / "subset.jsonl")
    # float32 by name: transformers' generate computes float32, not auto's int8 (see above)
    common = ["--max-tokens", str(MAX_TOKENS), "--no-progress", "--dtype", "float32"]
    configs = {"ngram": ["--method", "ngram", "--k", str(K), "--max-batch-size", "16"],
               "none": ["--method", "none", "--max-batch-size", "16"],
               "ngram_b1": ["--method", "ngram", "--k", str(K), "--max-batch-size", "1",
                            "--limit", str(NUM_BATCH1)]}
    out = {}
    for name, args in configs.items():
        path = d / f"{name}.jsonl"
        run_cli("run", str(inp), "-o", str(path), *args, *common, cwd=d)
        out[name] = path
    return out


def _per_turn(row: dict, key: str) -> list:
    return row[key] if "turns" in row else [row[key]]


@pytest.mark.parametrize("name", ["ngram", "none", "ngram_b1"])
def test_every_record_has_every_field(runs, name):
    rows = read_jsonl(runs[name])
    expected = QUESTION_IDS[:NUM_BATCH1] if name == "ngram_b1" else QUESTION_IDS
    assert [r["question_id"] for r in rows] == expected  # one per record, input order
    k = 0 if name == "none" else K
    for r in rows:
        where = f"{name} question_id={r['question_id']}"
        num_turns = len(r["turns"])
        outputs, ids = _per_turn(r, "output"), _per_turn(r, "output_token_ids")
        finish, stop = _per_turn(r, "finish_reason"), _per_turn(r, "stop_reason")
        assert len(outputs) == len(ids) == len(finish) == len(stop) == num_turns, where
        for text, toks, fr, sr in zip(outputs, ids, finish, stop):
            assert isinstance(text, str) and text.strip(), where
            assert 0 < len(toks) <= MAX_TOKENS, where
            assert fr in ("stop", "length"), where
            assert (sr == toks[-1]) if fr == "stop" else (sr is None and len(toks) == MAX_TOKENS)
        usage = r["usage"]
        assert usage["prompt_tokens"] > 0, where
        assert usage["completion_tokens"] == sum(len(t) for t in ids), where

        s = r["spec"]
        assert SPEC_FIELDS <= set(s), where
        assert s["proposer"] == name.split("_")[0] and s["num_speculative_tokens"] == k, where
        assert s["max_spec_tokens"] == k, where  # ngram's cap is k
        assert len(s["num_accepted_tokens_per_pos"]) == k, where
        assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"], where
        assert sum(s["k_histogram"].values()) + num_turns == s["num_steps"], where  # + prefills
        assert s["num_drafts"] == sum(c for kk, c in s["k_histogram"].items() if kk != "0")
        # drafts that reached position i: the steps with a longer draft
        assert s["num_draft_tokens_per_pos"] == [
            sum(c for kk, c in s["k_histogram"].items() if int(kk) > i) for i in range(k)], where
        # each step emits accepted + 1 tokens, except a last step cut inside its accepted run
        slack = s["num_steps"] + s["num_accepted_tokens"] - usage["completion_tokens"]
        assert 0 <= slack <= num_turns, where
        if s["num_drafts"]:
            assert s["acceptance_rate"] == pytest.approx(
                s["num_accepted_tokens"] / s["num_draft_tokens"], abs=1e-6), where
            assert s["mean_acceptance_length"] == pytest.approx(
                1 + s["num_accepted_tokens"] / s["num_drafts"], abs=1e-6), where
        else:
            assert s["acceptance_rate"] is None and s["mean_acceptance_length"] is None, where
    if k:  # the comparison below means something only if speculation accepted tokens
        assert sum(r["spec"]["num_accepted_tokens"] for r in rows) > MAX_TOKENS


@pytest.mark.parametrize("other", ["none", "ngram_b1"])
def test_outputs_identical(runs, other):
    a, b = read_jsonl(runs["ngram"]), read_jsonl(runs[other])
    assert len(b) == (NUM_BATCH1 if other == "ngram_b1" else len(QUESTION_IDS))
    for x, y in zip(a, b):
        where = f"question_id={x['question_id']}: ngram k{K} batch 16 vs {other}"
        assert x["output_token_ids"] == y["output_token_ids"], where
        assert x["output"] == y["output"], where
        assert x["finish_reason"] == y["finish_reason"], where


def test_matches_transformers_generate(runs):
    rows = compare_outputs(runs["ngram"])
    print("\n" + format_table(rows, NEAR_TIE))
    assert len(rows) == len(QUESTION_IDS) + 5  # 5 two-turn records
    for r in rows:
        assert r.is_near_tie(NEAR_TIE), (
            f"question_id={r.record_id} turn {r.turn}: first difference at token {r.first_diff} "
            f"is not a near-tie (ours {r.our_token}, transformers {r.ref_token}, gap "
            f"{r.ref_gap} / {r.our_gap} logits, replay_ok={r.replay_ok})")
        assert r.identical or r.max_abs_diff <= MAX_LOGIT_DIFF, (
            f"question_id={r.record_id} turn {r.turn}: logits differ from transformers' by "
            f"{r.max_abs_diff} on the same prefix")
    # bfloat16 rounds these logits to 1/16-1/8, so exact top-2 ties are common: measured, 8 of
    # 17 answers flip at one within 48 tokens; a loose floor still catches a broken comparison
    assert sum(r.identical for r in rows) >= len(rows) // 3
