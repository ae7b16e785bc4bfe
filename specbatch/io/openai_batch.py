"""OpenAI batch files: the input ``vllm run-batch`` and the OpenAI Batch API read, and their
output format.

Input, one request per line (``/v1/chat/completions`` or ``/v1/completions``)::

    {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, ...}}

``to_record`` maps a request onto specbatch's record fields (``messages`` or ``prompt``, the
sampling fields); a body field specbatch does not support (tools, streaming, ...) makes the
record bad, naming the fields: never ignored silently. ``response_line`` writes the answer::

    {"id": "batch_req_...", "custom_id": "req-1",
     "response": {"status_code": 200, "request_id": "...", "body": {"object":
                  "chat.completion", "choices": [...], "usage": {...}, "specbatch": {...}}},
     "error": null}

``body.specbatch`` is the extension field with the record's speculative-decoding stats (the
``spec`` of a specbatch output line). ``created`` is 0 and the ids are derived from the
``custom_id``, so an output file is byte-reproducible (resumed or not). Token strings in
``logprobs`` are written ``"token_id:N"`` (vLLM's ``return_tokens_as_token_ids`` form).
Torch-free.
"""

from __future__ import annotations

import hashlib

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
URLS = (CHAT_URL, COMPLETIONS_URL)

# body field -> specbatch record field, for both endpoints (OpenAI's and vLLM's extra names)
_SAME = ("temperature", "top_p", "seed", "stop", "n", "presence_penalty", "frequency_penalty",
         "logit_bias", "response_format", "top_k", "min_p", "repetition_penalty", "min_tokens",
         "ignore_eos", "stop_token_ids")
# accepted and not used: the job's model answers every request; user is an end-user tag
_IGNORED = ("model", "user")
CHAT_FIELDS = ("messages", "max_tokens", "max_completion_tokens", "logprobs", "top_logprobs",
               "stream", *_SAME, *_IGNORED)
COMPLETION_FIELDS = ("prompt", "max_tokens", "logprobs", "stream", *_SAME, *_IGNORED)
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def is_batch_request(row: dict) -> bool:
    """Whether a line looks like an OpenAI batch request (``custom_id`` and ``body``)."""
    return "custom_id" in row and "body" in row


def to_record(row: dict) -> dict:
    """The specbatch record fields of one batch request line.

    Returns ``{"id": custom_id, "messages" | "prompt": ..., <sampling fields>}``. Raises
    ``ValueError`` naming the problem: a missing or non-string ``custom_id``, a method other
    than POST, an unsupported url, a body that is not an object, unsupported body fields, or
    values this mapping cannot carry (a list of prompts, non-text message parts, a tool role).
    """
    custom_id = row.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"custom_id must be a non-empty string, got {custom_id!r}")
    unknown = sorted(set(row) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unsupported request field(s): {', '.join(unknown)}")
    method = row.get("method", "POST")
    if method != "POST":
        raise ValueError(f"method {method!r}: expected POST")
    url = row.get("url")
    if url not in URLS:
        raise ValueError(f"url {url!r}: expected {' or '.join(URLS)}")
    body = row["body"]
    if not isinstance(body, dict):
        raise ValueError("body must be a JSON object")
    allowed = CHAT_FIELDS if url == CHAT_URL else COMPLETION_FIELDS
    bad = sorted(k for k in body if k not in allowed)
    if bad:
        raise ValueError(f"unsupported body field(s) for {url}: {', '.join(bad)}")
    if body.get("stream"):
        raise ValueError("body.stream: streaming is not supported in a batch (set it false)")
    rec: dict = {"id": custom_id}
    for key in _SAME:
        if body.get(key) is not None:
            rec[key] = body[key]
    if url == CHAT_URL:
        rec["messages"] = _messages(body.get("messages"))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if body.get("logprobs"):
            rec["logprobs"] = body.get("top_logprobs") or 0
        elif body.get("top_logprobs"):
            raise ValueError("body.top_logprobs needs body.logprobs: true")
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("body.prompt must be one string (a list of prompts or token ids "
                             "is not supported: write one request per prompt)")
        rec["prompt"] = prompt
        limit = body.get("max_tokens", 16)  # the completions endpoint's default
        if body.get("logprobs") is not None:
            rec["logprobs"] = body["logprobs"]
    if limit is not None:
        rec["max_tokens"] = limit
    return rec


def _messages(value) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError("body.messages must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"body.messages[{i}] must be an object")
        if "role" not in m:
            raise ValueError(f"body.messages[{i}].role is missing: expected one of "
                             f"{', '.join(_ROLES)}")
        role = _ROLES.get(m["role"]) if isinstance(m["role"], str) else None
        if role is None:
            raise ValueError(f"body.messages[{i}].role={m.get('role')!r}: expected one of "
                             f"{', '.join(_ROLES)}")
        if "content" not in m:
            raise ValueError(f"body.messages[{i}].content is missing: expected a string or a "
                             "list of text parts")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            from specbatch.io.records import text_parts

            content = text_parts(content)
            if content is None:
                raise ValueError(f"body.messages[{i}].content: only text parts are supported")
        out.append({"role": role, "content": content})
    return out


def _id(prefix: str, custom_id: str) -> str:
    return f"{prefix}-{hashlib.blake2b(custom_id.encode(), digest_size=12).hexdigest()}"


def response_line(request: dict, out: dict, model: str) -> dict:
    """The batch output line answering ``request`` (the input line as read) with ``out`` (the
    output fields ``pipeline`` produced for it). model: the model that answered."""
    custom_id = request["custom_id"]
    url = request["url"]
    line = {"id": _id("batch_req", custom_id), "custom_id": custom_id}
    if "error" in out:  # the model failed on it (a NaN): a server error, as OpenAI reports one
        line["response"] = {"status_code": 500, "request_id": _id("req", custom_id),
                            "body": {"error": {"message": out["error"],
                                               "type": "server_error"}}}
        line["error"] = None
        return line
    multi = isinstance(out["finish_reason"], list)

    def per_sample(key):
        return out[key] if multi else [out[key]]

    texts, reasons = per_sample("output"), per_sample("finish_reason")
    logprobs = per_sample("logprobs") if "logprobs" in out else [None] * len(texts)
    choices = []
    for i, (text, reason, lps) in enumerate(zip(texts, reasons, logprobs)):
        if url == CHAT_URL:
            choices.append({"index": i, "message": {"role": "assistant", "content": text},
                            "logprobs": _chat_logprobs(lps), "finish_reason": reason})
        else:
            choices.append({"index": i, "text": text, "logprobs": _completion_logprobs(lps),
                            "finish_reason": reason})
    usage = out["usage"]
    body = {"id": _id("chatcmpl" if url == CHAT_URL else "cmpl", custom_id),
            "object": "chat.completion" if url == CHAT_URL else "text_completion",
            "created": 0, "model": model, "choices": choices,
            "usage": {"prompt_tokens": usage["prompt_tokens"],
                      "completion_tokens": usage["completion_tokens"],
                      "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"]},
            "specbatch": out["spec"]}
    line["response"] = {"status_code": 200, "request_id": _id("req", custom_id), "body": body}
    line["error"] = None
    return line


def _token(token_id: int) -> str:
    return f"token_id:{token_id}"


def _chat_logprobs(entries: list[dict] | None) -> dict | None:
    if entries is None:
        return None
    return {"content": [{"token": _token(e["token_id"]), "logprob": e["logprob"], "bytes": None,
                         "top_logprobs": [{"token": _token(t), "logprob": lp, "bytes": None}
                                          for t, lp in e["top"]]} for e in entries]}


def _completion_logprobs(entries: list[dict] | None) -> dict | None:
    if entries is None:
        return None
    return {"tokens": [_token(e["token_id"]) for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token(t): lp for t, lp in e["top"]} for e in entries]}


def output_line(rec, out: dict, model_id: str) -> dict:
    """What OUT holds for a record (``io.records.Record``): its fields plus the output fields,
    or, for an OpenAI batch request, the batch output line answering it."""
    if is_batch_request(rec.fields):
        return response_line(rec.fields, out, model_id)
    return {**rec.fields, **out}
