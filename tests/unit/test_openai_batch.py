"""OpenAI batch files (io.openai_batch, io.records): request -> record mapping, unsupported
fields named per line, and the output line's format."""

from __future__ import annotations

import json

import pytest

from specbatch.io.openai_batch import response_line, to_record
from specbatch.io.records import read_records


def chat(custom_id="a", **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}}


def test_chat_request_maps_onto_record_fields():
    rec = to_record(chat(max_completion_tokens=9, temperature=0.5, top_p=0.9, seed=4,
                         stop=["."], n=2, logprobs=True, top_logprobs=3, presence_penalty=0.1,
                         frequency_penalty=0.2, logit_bias={"5": -1},
                         response_format={"type": "json_object"}, user="u1"))
    assert rec == {"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9,
                   "temperature": 0.5, "top_p": 0.9, "seed": 4, "stop": ["."], "n": 2,
                   "logprobs": 3, "presence_penalty": 0.1, "frequency_penalty": 0.2,
                   "logit_bias": {"5": -1}, "response_format": {"type": "json_object"}}


def test_completions_request_and_content_parts():
    rec = to_record({"custom_id": "c", "url": "/v1/completions",
                     "body": {"prompt": "Once", "logprobs": 2}})
    assert rec == {"id": "c", "prompt": "Once", "max_tokens": 16, "logprobs": 2}
    rec = to_record(chat(messages=[{"role": "developer", "content": "x"},
                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}]))
    assert rec["messages"] == [{"role": "system", "content": "x"},
                               {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("row, reason", [
    (chat(tools=[], tool_choice="auto"), "unsupported body field(s) for /v1/chat/completions: "
                                         "tool_choice, tools"),
    (chat(stream=True), "streaming is not supported"),
    ({**chat(), "url": "/v1/embeddings"}, "url '/v1/embeddings'"),
    ({**chat(), "method": "GET"}, "method 'GET'"),
    ({**chat(), "custom_id": 5}, "custom_id must be a non-empty string"),
    ({"custom_id": "c", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}},
     "a list of prompts"),
    (chat(messages=[{"role": "tool", "content": "x"}]), "role='tool'"),
    (chat(messages=[{"content": "x"}]), "body.messages[0].role is missing"),
    (chat(messages=[{"role": ["user"], "content": "x"}]), "body.messages[0].role=['user']"),
    (chat(messages=[{"role": "user"}]), "body.messages[0].content is missing"),
    (chat(top_logprobs=2), "needs body.logprobs"),
    ({**chat(), "extra": 1}, "unsupported request field(s): extra"),
])
def test_bad_requests_name_the_problem(row, reason):
    with pytest.raises(ValueError, match=None) as e:
        to_record(row)
    assert reason in str(e.value)


def test_read_records_detects_batch_lines_and_reports_per_line(tmp_path):
    lines = [chat("r1", max_tokens=5), chat("r2", tools=[]), chat("r3", top_p=2.0),
             {"id": 4, "prompt": "plain record"}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    records, errors = read_records(path)
    assert [(r.id, r.sampling.max_tokens) for r in records] == [("r1", 5), (4, 128)]
    assert records[0].fields == lines[0]  # the request as read: the response line needs it
    assert [(e.line, e.id) for e in errors] == [(2, "r2"), (3, "r3")]
    assert "tools" in errors[0].reason and "top_p" in errors[1].reason
    # forced format: a plain record is a bad request
    records, errors = read_records(path, input_format="openai-batch")
    assert len(records) == 1 and errors[-1].line == 4


def _out(**extra):
    return {"output": "hi there", "output_token_ids": [5, 6, 2], "finish_reason": "stop",
            "stop_reason": 2, "usage": {"prompt_tokens": 7, "completion_tokens": 3},
            "spec": {"proposer": "ngram", "num_steps": 2}, **extra}


def test_response_line_chat_and_completion():
    line = response_line(chat("x"), _out(), "smollm2-135m")
    assert line["custom_id"] == "x" and line["error"] is None
    assert line["id"].startswith("batch_req-")
    body = line["response"]["body"]
    assert line["response"]["status_code"] == 200
    assert body["object"] == "chat.completion" and body["model"] == "smollm2-135m"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                        "content": "hi there"},
                                "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert body["specbatch"] == {"proposer": "ngram", "num_steps": 2}
    # deterministic: the same request and output give the same bytes
    assert response_line(chat("x"), _out(), "smollm2-135m") == line

    comp = {"custom_id": "y", "url": "/v1/completions", "body": {"prompt": "p"}}
    lp = [{"token_id": 5, "logprob": -0.5, "top": [[5, -0.5], [9, -1.5]]}]
    multi = _out(output=["a", "b"], finish_reason=["stop", "length"], logprobs=[lp, lp])
    body = response_line(comp, multi, "m")["response"]["body"]
    assert body["object"] == "text_completion"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "a", "stop"), (1, "b", "length")]
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["token_id:5"], "token_logprobs": [-0.5],
        "top_logprobs": [{"token_id:5": -0.5, "token_id:9": -1.5}]}


def test_failed_record_is_a_500_response():
    line = response_line(chat("z"), _out(error="NaN in the target's logits",
                                         finish_reason="error"), "m")
    assert line["response"]["status_code"] == 500
    assert "NaN" in line["response"]["body"]["error"]["message"]


def test_output_line_picks_the_format_by_record():
    from specbatch.io.openai_batch import output_line

    class Rec:
        def __init__(self, fields):
            self.fields = fields

    assert output_line(Rec({"id": 1, "prompt": "p"}), _out(), "m")["output"] == "hi there"
    assert output_line(Rec(chat("k")), _out(), "m")["custom_id"] == "k"
