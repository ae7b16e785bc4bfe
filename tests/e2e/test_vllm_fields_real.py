"""vLLM's sampling fields and OpenAI batch files on the real model (issue 13).

One input holds two Spec-Bench prompts per feature, each record with its own fields: ``n = 3``
at T = 0.8, ``repetition_penalty = 1.3``, ``presence_penalty = frequency_penalty = 0.5``,
``min_p = 0.1`` at T = 0.8, a ``logit_bias``, and a JSON schema (``response_format``). Through the
real ``specbatch run`` (bfloat16), ngram k = 5 at batch 8 gives exactly the tokens of ``none``
at batch 1, and every JSON output parses and validates.

A 20-line OpenAI batch file (chat and completions requests, three with unsupported body
fields) round-trips: one output line per valid request in input order with its ``custom_id``,
well-formed response bodies, and one error naming the unsupported fields per bad line.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import read_jsonl, run_cli

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 24
SCHEMA = {"type": "object",
          "properties": {"answer": {"type": "string", "maxLength": 60},
                         "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
                         "topic": {"enum": ["science", "history", "language", "other"]}},
          "required": ["answer", "confidence", "topic"], "additionalProperties": False}
FEATURES = {
    "n": {"n": 3, "temperature": 0.8},
    "repetition": {"repetition_penalty": 1.3},
    "presence_frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "min_p": {"min_p": 0.1, "temperature": 0.8},
    "logit_bias": {"logit_bias": {"28": -100, "30": 5, "253": 3}},
    "json": {"response_format": {"type": "json_schema", "json_schema": {"name": "qa",
                                                                       "schema": SCHEMA}},
             "max_tokens": 96},
}


def _prompts(spec_bench, num: int) -> list[str]:
    """First turns of short Spec-Bench questions (qa, then translation)."""
    rows = [json.loads(line) for line in spec_bench.read_text().splitlines() if line.strip()]
    short = [r["turns"][0] for r in rows if r["category"] in ("qa", "translation")]
    return short[:num]


@pytest.fixture(scope="module")
def feature_runs(spec_bench, real_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm_fields")
    prompts = _prompts(spec_bench, 2 * len(FEATURES))
    lines = []
    for i, (name, fields) in enumerate(FEATURES.items()):
        for j in range(2):
            lines.append({"id": f"{name}-{j}", "feature": name, "seed": 7 + j,
                          "messages": [{"role": "user", "content": prompts[2 * i + j]}],
                          **fields})
    inp = d / "features.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["--max-tokens", str(MAX_TOKENS), "--no-progress"]
    # --dtype auto (the default): a batch-invariant dtype (int8 for the bundled Q4_1 GGUF on
    # an x86-64 CPU with AVX2, bfloat16 on a GPU), so the equality is exact
    run_cli("run", str(inp), "-o", str(d / "none.jsonl"), "--method", "none",
            "--max-batch-size", "1", *common, cwd=d, timeout=2400)
    run_cli("run", str(inp), "-o", str(d / "ngram.jsonl"), "--method", "ngram", "--k", "5",
            "--max-batch-size", "8", *common, cwd=d, timeout=2400)
    return read_jsonl(d / "none.jsonl"), read_jsonl(d / "ngram.jsonl")


@pytest.mark.parametrize("feature", list(FEATURES))
def test_ngram_batch8_equals_none_batch1(feature_runs, feature):
    none, ngram = feature_runs
    a = [r for r in none if r["feature"] == feature]
    b = [r for r in ngram if r["feature"] == feature]
    assert len(a) == len(b) == 2
    for x, y in zip(a, b):
        assert x["output_token_ids"] == y["output_token_ids"], x["id"]
        assert x["output"] == y["output"] and x["finish_reason"] == y["finish_reason"]
    if feature == "n":
        for r in a:
            assert len(r["output_token_ids"]) == 3 and len(r["spec"]["per_sample"]) == 3
            assert len({tuple(ids) for ids in r["output_token_ids"]}) == 3  # own noise each
    if feature == "logit_bias":
        for r in a:  # token 28 is banned by its bias of -100
            assert 28 not in r["output_token_ids"]


def test_features_were_speculated(feature_runs):
    _, ngram = feature_runs
    assert sum(r["spec"]["num_accepted_tokens"] for r in ngram) > 10


def test_json_outputs_validate(feature_runs):
    none, _ = feature_runs
    rows = [r for r in none if r["feature"] == "json"]
    for r in rows:
        assert r["finish_reason"] == "stop", r["output"]
        jsonschema.validate(json.loads(r["output"]), SCHEMA)


# ---- OpenAI batch files ---------------------------------------------------------------------

BAD = {5: {"tools": [{"type": "function", "function": {"name": "f"}}]},
       11: {"stream": True},
       17: {"suffix": "!", "echo": True}}


def _batch_lines(prompts: list[str]) -> list[dict]:
    lines = []
    for i, p in enumerate(prompts):
        chat = i % 3 != 2
        body = ({"model": "smollm2", "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": p}],
                 "max_completion_tokens": 8}
                if chat else {"model": "smollm2", "prompt": p, "max_tokens": 8})
        if i % 4 == 1:
            body.update(temperature=0.7, seed=i, top_p=0.9)
        if i == 4:
            body.update(logprobs=True, top_logprobs=2)
        if i == 7:
            body.update(n=2, temperature=0.9, seed=3)
        if i == 8:
            body.update(logprobs=1)  # a completions request: logprobs is an integer there
        if i == 9:
            body.update(response_format={"type": "json_object"}, max_completion_tokens=24)
        if i == 13:
            body.update(stop=["."], frequency_penalty=0.4)
        if i in BAD:
            body.update(BAD[i])
        url = "/v1/chat/completions" if chat else "/v1/completions"
        lines.append({"custom_id": f"req-{i:02d}-{'abc'[i % 3]}", "method": "POST", "url": url,
                      "body": body})
    return lines


def test_openai_batch_round_trip(spec_bench, real_model, tmp_path):
    requests = _batch_lines(_prompts(spec_bench, 20))
    inp = tmp_path / "batch.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in requests))
    out = tmp_path / "batch.out.jsonl"
    # float32: faster than bfloat16 on a CPU without AMX; nothing here compares two runs
    run_cli("run", str(inp), "-o", str(out), "--method", "ngram", "--k", "5", "--dtype",
            "float32", "--on-error", "skip", "--no-progress", cwd=tmp_path, timeout=1200)
    rows = read_jsonl(out)
    good = [r for i, r in enumerate(requests) if i not in BAD]
    assert [r["custom_id"] for r in rows] == [r["custom_id"] for r in good]  # order and values
    for req, row in zip(good, rows):
        assert set(row) == {"id", "custom_id", "response", "error"} and row["error"] is None
        resp = row["response"]
        assert resp["status_code"] == 200
        body = resp["body"]
        chat = req["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        n = req["body"].get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(n))
        for c in body["choices"]:
            text = c["message"]["content"] if chat else c["text"]
            assert isinstance(text, str) and c["finish_reason"] in ("stop", "length")
            if chat:
                assert c["message"]["role"] == "assistant"
        u = body["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > 0
        assert body["specbatch"]["proposer"] == "ngram"
        if req["body"].get("logprobs") is True:
            content = body["choices"][0]["logprobs"]["content"]
            assert len(content) == u["completion_tokens"]
            assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
        if not chat and req["body"].get("logprobs") == 1:
            lp = body["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == u["completion_tokens"]
        if "response_format" in req["body"] and body["choices"][0]["finish_reason"] == "stop":
            assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)
    errors = read_jsonl(tmp_path / "batch.out.jsonl.errors.jsonl")
    assert [e["line"] for e in errors] == [i + 1 for i in sorted(BAD)]
    assert [e["id"] for e in errors] == [requests[i]["custom_id"] for i in sorted(BAD)]
    assert "tools" in errors[0]["reason"]
    assert "stream" in errors[1]["reason"]
    assert "echo, suffix" in errors[2]["reason"]
