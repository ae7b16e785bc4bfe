"""The Python API (issue 12, "Done when" 1): ``from specbatch import LLM, SamplingParams`` in a
fresh ``python -c`` generates for 3 records (a plain prompt, a chat, a two-turn Spec-Bench
record) and gets the token ids, finish reasons, usage and ``spec`` stats that ``specbatch run``
writes for the same records and flags; ``llm.chat`` equals ``generate`` of the same messages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.conftest import REPO, read_jsonl, run_cli


MAX_TOKENS = 24

SCRIPT = r"""
import json, sys
from specbatch import LLM, SamplingParams

rows = json.loads(sys.argv[1])
llm = LLM(method="ngram", k=5, max_batch_size=4)
outs = llm.generate(rows, SamplingParams(max_tokens=%d))
chat = llm.chat([rows[1]["messages"]], SamplingParams(max_tokens=%d))
print(json.dumps({"outs": [o.fields for o in outs],
                  "texts": [o.text for o in outs], "ids": [o.id for o in outs],
                  "chat_ids": chat[0].token_ids}))
""" % (MAX_TOKENS, MAX_TOKENS)


def test_llm_generate_equals_the_cli(spec_bench, real_model, tmp_path):
    turns = json.loads(spec_bench.read_text().splitlines()[0])  # question 81: two turns
    rows = [{"id": "plain", "prompt": "Repeat after me: the cat sat on the mat. The cat sat"},
            {"id": "chat", "messages": [{"role": "user",
                                         "content": "List three colours, one per line."}]},
            turns]
    inp = tmp_path / "three.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_cli("run", str(inp), "-o", str(tmp_path / "cli.jsonl"), "--method", "ngram", "--k", "5",
            "--max-batch-size", "4", "--max-tokens", str(MAX_TOKENS), "--no-progress",
            cwd=tmp_path)
    cli = read_jsonl(tmp_path / "cli.jsonl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(rows)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = json.loads(proc.stdout.splitlines()[-1])
    assert api["ids"] == ["plain", "chat", 81]
    assert len(cli) == 3
    for row, out, text in zip(cli, api["outs"], api["texts"]):
        for key in ("output", "output_token_ids", "finish_reason", "stop_reason", "usage",
                    "spec"):
            assert out[key] == row[key], (row.get("id", row.get("question_id")), key)
        assert text == row["output"]
    assert isinstance(cli[2]["output_token_ids"], list) and len(cli[2]["output_token_ids"]) == 2
    assert all(len(t) > 0 for t in cli[2]["output_token_ids"])
    assert api["chat_ids"] == cli[1]["output_token_ids"]


def test_bad_prompt_is_one_value_error(real_model):
    """A bad prompt stops ``generate`` before anything runs, with the input's error text; the
    same LLM then generates (results in input order, with the usage ``run`` writes)."""
    from specbatch import LLM, SamplingParams

    llm = LLM(method="none", max_batch_size=2)
    with pytest.raises(ValueError, match="^prompt 2: prompt is empty$"):
        llm.generate(["fine", "  "])
    assert llm.generate([]) == []
    outs = llm.generate(["Say yes.", "Say no, then stop."], SamplingParams(max_tokens=3))
    assert [o.id for o in outs] == [1, 2]
    assert all(1 <= o.usage["completion_tokens"] <= 3 for o in outs)
    assert outs[0].spec["proposer"] == "none" and outs[0].spec["num_drafts"] == 0
    # one string is one prompt (as vLLM's generate), not a list of its characters; one chat too
    one = llm.generate("Say yes.", SamplingParams(max_tokens=3))
    assert len(one) == 1 and one[0].token_ids == outs[0].token_ids
    chat = llm.chat([{"role": "user", "content": "Say yes."}], SamplingParams(max_tokens=3))
    assert len(chat) == 1
