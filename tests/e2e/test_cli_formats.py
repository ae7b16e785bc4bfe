"""Every input format, ``--split``, ``--prompt-field``, ``--id-field``, ``.parquet`` output and a
recipe with a template, through the real ``specbatch run`` (one process, one model load).

The same three records are written in each format; every run must give the outputs of the
JSONL run, in input order, with the input fields echoed.
"""

from __future__ import annotations

import json

import orjson
import pytest

from tests.cli_helpers import REPO, assert_no_traceback, cli_session, read_jsonl

datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.slow

ROWS = [{"id": 1, "prompt": "Say hi.", "category": "greet"},
        {"id": 2, "prompt": "Name a fruit.", "category": "list"},
        {"id": 3, "prompt": "Count to three.", "category": "list"}]
FAST = ["--method", "ngram", "--max-tokens", "3", "--max-batch-size", "2", "--no-progress"]


def _inputs(root) -> dict[str, tuple[str, list[str]]]:
    """name -> (input path, extra flags)."""
    ds = datasets.Dataset.from_list(ROWS)
    (root / "in.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in ROWS))
    (root / "in.json").write_bytes(orjson.dumps(ROWS, option=orjson.OPT_INDENT_2))
    ds.to_parquet(str(root / "in.parquet"))
    ds.to_csv(str(root / "in.csv"), index=False)
    ds.save_to_disk(str(root / "in_disk"))
    datasets.DatasetDict(test=ds, other=ds.select([0])).save_to_disk(str(root / "in_dict"))
    renamed = [{"key": f"r{r['id']}", "question": r["prompt"], "prompt": "not this one",
                "category": r["category"]} for r in ROWS]
    (root / "renamed.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in renamed))
    return {"jsonl": ("in.jsonl", []), "json": ("in.json", []), "parquet": ("in.parquet", []),
            "csv": ("in.csv", []), "disk": ("in_disk", []),
            "dict": ("in_dict", ["--split", "test"]),
            "fields": ("renamed.jsonl", ["--prompt-field", "question", "--id-field", "key"])}


def test_formats_round_trip(tmp_path):
    inputs = _inputs(tmp_path)
    runs = {name: ["run", str(tmp_path / path), "-o", str(tmp_path / f"{name}.out.jsonl"),
                   *FAST, *flags] for name, (path, flags) in inputs.items()}
    runs["parquet-out"] = ["run", str(tmp_path / "in.jsonl"), "-o",
                           str(tmp_path / "out.parquet"), *FAST]
    recipe_out = tmp_path / "code_edit.out.jsonl"
    runs["recipe"] = ["run", "--recipe", str(REPO / "recipes" / "code_edit.toml"),
                      str(REPO / "recipes" / "prompts" / "code_edit.jsonl"), "-o",
                      str(recipe_out), "--max-tokens", "3", "--no-progress"]
    results = dict(zip(runs, cli_session(list(runs.values()), tmp_path / "session")))
    for name, r in results.items():
        assert r.returncode == 0, (name, r.stderr)
        assert_no_traceback(r)

    reference = read_jsonl(tmp_path / "jsonl.out.jsonl")
    assert [{k: row[k] for k in ROWS[0]} for row in reference] == ROWS
    assert all(1 <= len(row["output_token_ids"]) <= 3 for row in reference)
    generated = [(row["output"], row["output_token_ids"]) for row in reference]
    for name in ("json", "parquet", "csv", "disk", "dict"):
        rows = read_jsonl(tmp_path / f"{name}.out.jsonl")
        assert [(row["output"], row["output_token_ids"]) for row in rows] == generated, name
        assert [{k: row[k] for k in ROWS[0]} for row in rows] == ROWS, name

    rows = read_jsonl(tmp_path / "fields.out.jsonl")
    assert [(row["output"], row["output_token_ids"]) for row in rows] == generated
    assert [row["key"] for row in rows] == ["r1", "r2", "r3"]
    config = json.loads((tmp_path / "fields.out.jsonl.config.json").read_text())
    assert (config["prompt_field"], config["id_field"]) == ("question", "key")

    parquet_rows = datasets.Dataset.from_parquet(str(tmp_path / "out.parquet")).to_list()
    assert [{k: row[k] for k in ("id", "prompt", "output", "output_token_ids",
                                 "finish_reason")} for row in parquet_rows] == \
        [{k: row[k] for k in ("id", "prompt", "output", "output_token_ids", "finish_reason")}
         for row in reference]

    # the recipe: its values, its template, its name and version in the saved config
    config = json.loads((tmp_path / "code_edit.out.jsonl.config.json").read_text())
    assert config["recipe"] == {"name": "code_edit", "version": 1}
    assert config["template"].startswith("{instruction}") and config["k"] == 5
    assert config["sampling"]["max_tokens"] == 3  # the flag over the recipe's 256
    rows = read_jsonl(recipe_out)
    assert [row["id"] for row in rows] == [
        r["id"] for r in read_jsonl(REPO / "recipes" / "prompts" / "code_edit.jsonl")]
    assert all(row["usage"]["prompt_tokens"] > 40 for row in rows)  # instruction + code
