"""Sampling that speculation cannot change, on the real model (issue 3, "Done when" 4).

20 Spec-Bench records at temperature 0.8, seed 1, through the real ``specbatch run``:
``--method ngram --k 5`` and ``--method none`` give identical outputs (token ids, text, finish
reasons); a rerun with the same seed at another ``--max-batch-size`` (other batch compositions,
other rows) gives them again; and a different ``--seed`` changes most outputs, so the sampler is
really sampling and the identities above are not those of greedy decoding.

In bfloat16 the decode/verify path is batch-invariant and the Gumbel noise is a pure function of
(record seed, position, token id), so the identities are exact: no near-tie allowance.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import read_jsonl, run_cli, spec_bench_subset

pytestmark = pytest.mark.slow

# translation x4, qa x4, math_reasoning x4, writing / roleplay / coding / extraction (two turns
# each), summarization x2, rag x2
QUESTION_IDS = [81, 91, 122, 131, 161, 162, 163, 164, 241, 242, 321, 322, 323, 324,
                401, 402, 403, 404, 481, 482]
MAX_TOKENS = 32
TEMPERATURE = 0.8
NUM_SEED2 = 10  # records rerun with --seed 2 (only to show the seed matters)


@pytest.fixture(scope="module")
def runs(spec_bench, real_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("sampling_real")
    inp = spec_bench_subset(spec_bench, QUESTION_IDS, d / "subset.jsonl")
    common = ["--max-tokens", str(MAX_TOKENS), "--temperature", str(TEMPERATURE),
              "--no-progress"]
    configs = {
        "ngram": ["--method", "ngram", "--k", "5", "--max-batch-size", "16", "--seed", "1"],
        "none": ["--method", "none", "--max-batch-size", "16", "--seed", "1"],
        "ngram_b3": ["--method", "ngram", "--k", "5", "--max-batch-size", "3", "--seed", "1"],
        "seed2": ["--method", "ngram", "--k", "5", "--max-batch-size", "16", "--seed", "2",
                  "--limit", str(NUM_SEED2)],
    }
    out = {}
    for name, args in configs.items():
        path = d / f"{name}.jsonl"
        run_cli("run", str(inp), "-o", str(path), *args, *common, cwd=d)
        out[name] = read_jsonl(path)
        num = NUM_SEED2 if name == "seed2" else len(QUESTION_IDS)
        assert [r["question_id"] for r in out[name]] == QUESTION_IDS[:num]
    return out


def _answers(rows: list[dict]) -> list[tuple]:
    return [(r["question_id"], r["output_token_ids"], r["output"], r["finish_reason"])
            for r in rows]


def test_speculation_does_not_change_samples(runs):
    accepted = sum(r["spec"]["num_accepted_tokens"] for r in runs["ngram"])
    assert accepted > MAX_TOKENS, "too few accepted drafts for the comparison to mean much"
    for a, b in zip(_answers(runs["ngram"]), _answers(runs["none"]), strict=True):
        assert a == b, f"question_id={a[0]}: ngram k5 and none differ at T={TEMPERATURE}"


def test_rerun_at_another_batch_size_reproduces(runs):
    for a, b in zip(_answers(runs["ngram"]), _answers(runs["ngram_b3"]), strict=True):
        assert a == b, f"question_id={a[0]}: --max-batch-size 16 and 3 differ"


def test_another_seed_changes_samples(runs):
    num_changed = sum(a[1] != b[1] for a, b in zip(_answers(runs["ngram"]),
                                                   _answers(runs["seed2"])))
    print(f"\n--seed 2 changed {num_changed} of {NUM_SEED2} records")
    # at T = 0.8 over 32 tokens nearly every record should change; half is a loose floor
    assert num_changed >= NUM_SEED2 // 2, f"only {num_changed} of {NUM_SEED2} records changed"
