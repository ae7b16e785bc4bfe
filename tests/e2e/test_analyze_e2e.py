"""``specbatch run`` then ``specbatch analyze`` on 20 Spec-Bench records with the real model
(SmolLM2-135M, bfloat16, ngram k5, T = 0): the what-if replay of the run's own setting equals
every record's recorded stats (two-turn records included), the category table reconciles with
the records, the plots are written, and compare finds one altered output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli import main

SPEC_BENCH = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "spec_bench" / \
    "question.jsonl"
COUNTERS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens")
MAX_TOKENS = 32

pytestmark = pytest.mark.slow


def _specbatch(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "specbatch.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """20 records: the first of 5 two-turn categories and the first 3 of each one-turn category
    (summarization and rag have long prompts); returns (output path, analyze JSON,
    plot folder)."""
    if not SPEC_BENCH.is_file():
        pytest.skip(f"Spec-Bench data not found at {SPEC_BENCH} (expected beside the repo in "
                    "shared/data/spec_bench/question.jsonl)")
    rows = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]
    two_turn: dict[str, dict] = {}
    one_turn: dict[str, list] = {}
    for r in rows:
        if len(r["turns"]) > 1:
            if len(two_turn) < 5:
                two_turn.setdefault(r["category"], r)
        else:
            one_turn.setdefault(r["category"], []).append(r)
    picked = list(two_turn.values()) + [r for rs in one_turn.values() for r in rs[:3]]
    assert len(picked) == 20, "Spec-Bench has 5 two-turn and 5 one-turn categories or more"
    tmp = tmp_path_factory.mktemp("analyze_e2e")
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in picked))
    result = _specbatch("run", "in.jsonl", "-o", "out.jsonl", "--method", "ngram", "--k", "5",
                        "--max-tokens", str(MAX_TOKENS), "--no-progress", cwd=tmp)
    assert result.returncode == 0, result.stderr
    result = _specbatch("analyze", "out.jsonl", "--by", "category", "--what-if", "--json",
                        "--plot", "plots", cwd=tmp)
    assert result.returncode == 0, result.stderr
    return tmp / "out.jsonl", json.loads(result.stdout), tmp / "plots"


def test_what_if_replay_equals_recorded_stats(run):
    out, doc, _ = run
    records = {r["question_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(records) == 20
    assert sum(len(r["finish_reason"]) == 2 for r in records.values()) == 5  # all are turns
    wi = doc["what_if"]
    assert wi["num_replayed"] == 20 and wi["num_skipped"] == 0
    checks = {c["id"]: c for c in wi["self_check"]["records"]}
    assert set(checks) == set(records)
    for qid, rec in records.items():
        got = checks[qid]["replayed"]
        spec = rec["spec"]
        for key in COUNTERS + ("num_accepted_tokens_per_pos", "k_histogram", "proposer",
                               "num_speculative_tokens", "max_spec_tokens"):
            assert got[key] == spec[key], (qid, key)
        assert checks[qid]["setting"] == "ngram:k=5:min=2:max=4"
    assert wi["self_check"]["num_equal"] == 20
    assert sum(r["spec"]["num_accepted_tokens"] for r in records.values()) > 0


def test_category_table_reconciles(run):
    out, doc, _ = run
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = doc["tables"]["category"]
    total = rows[-1]
    assert total["group"] == "(all)"
    assert {r["group"] for r in rows[:-1]} == {r["category"] for r in records}
    for key in COUNTERS:
        want = sum(r["spec"][key] for r in records)
        assert total[key] == want and sum(r[key] for r in rows[:-1]) == want, key
    assert total["num_output_tokens"] == sum(r["usage"]["completion_tokens"] for r in records)
    for row in rows:
        cat = [r for r in records if r["category"] == row["group"]] if row is not total \
            else records
        assert row["num_records"] == len(cat)
        reasons = [x for r in cat for x in (r["finish_reason"] if isinstance(
            r["finish_reason"], list) else [r["finish_reason"]])]
        assert sum(row["finish_reasons"].values()) == len(reasons) == row["num_prefill_steps"]


def test_plots_written(run):
    from matplotlib.image import imread

    _, doc, plots = run
    assert sorted(p.name for p in plots.iterdir()) == [
        "acceptance_length.png", "per_position_acceptance.png", "what_if.png"]
    for p in plots.iterdir():
        img = imread(p)
        assert img.shape[0] >= 300 and img.shape[1] >= 600 and img.std() > 0.05, p.name


def test_compare_finds_the_altered_record(run, tmp_path):
    out, _, _ = run
    records = [json.loads(line) for line in out.read_text().splitlines()]
    target = next(r for r in records if len(r["output_token_ids"][-1]) > 10)
    turn = len(target["output_token_ids"]) - 1
    target["output_token_ids"][turn][7] += 1
    altered = tmp_path / "altered.jsonl"
    altered.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = CliRunner().invoke(main, ["analyze", str(out), str(out), "--compare", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["compare"]["num_differing_outputs"] == 0
    result = CliRunner().invoke(main, ["analyze", str(out), str(altered), "--compare", "--json"])
    assert result.exit_code == 0, result.output
    cmp = json.loads(result.output)["compare"]
    assert cmp["num_differing_outputs"] == 1 and cmp["num_common"] == 20
    d = cmp["differing_outputs"][0]
    assert (d["id"], d["turn"], d["position"]) == (target["question_id"], turn, 7)
