"""Completions -> output fields: what the writer stores beside each record, and what
``LLM.generate`` returns. No model code (no torch): ``analyze`` and the Ray driver import it.

Fields: ``output``, ``output_token_ids``, ``finish_reason``, ``stop_reason``, ``usage``, ``spec``
and, when asked, ``logprobs`` / ``error``. For ``turns`` records ``output``,
``output_token_ids``, ``finish_reason`` and ``stop_reason`` are lists, one entry per turn; with
``n`` > 1 samples, one entry per sample (see ``output_fields``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specbatch.spec_decode.stats import SpecStats

OUTPUT_FIELDS = ("output", "output_token_ids", "finish_reason", "stop_reason", "usage", "spec",
                 "logprobs", "error")


def _merged_stats(completions: list) -> SpecStats:
    first = completions[0].stats
    stats = SpecStats(proposer=first.proposer, num_speculative_tokens=first.num_speculative_tokens,
                      max_spec_tokens=first.max_spec_tokens)
    for c in completions:
        stats.merge(c.stats)
    return stats


def output_fields(rec, samples: list[list]) -> dict:
    """The output fields of a record from its completions (``engine.Completion``),
    ``samples[s][turn]`` (fewer turns when one stopped with an error).

    With n = 1 each field holds the sample's value (a list over turns for ``turns`` records);
    with n > 1, ``output``, ``output_token_ids``, ``finish_reason``, ``stop_reason`` and
    ``logprobs`` are lists with one such value per sample, ``spec`` sums all samples and
    ``spec.per_sample`` lists each sample's own, and ``usage`` counts the prompt once (as
    OpenAI does) and every sample's completion tokens."""
    is_turns = rec.turns is not None
    is_multi = len(samples) > 1

    def field_of(get):
        per_sample = [[get(c) for c in cs] if is_turns else get(cs[0]) for cs in samples]
        return per_sample if is_multi else per_sample[0]

    everything = [c for cs in samples for c in cs]
    out = {
        "output": field_of(lambda c: c.text),
        "output_token_ids": field_of(lambda c: c.output_ids),
        "finish_reason": field_of(lambda c: c.finish_reason),
        "stop_reason": field_of(lambda c: c.stop_reason),
        "usage": {"prompt_tokens": sum(len(c.prompt_ids) for c in samples[0]
                                       if c.prompt_fed),  # not a prompt refused as too long
                  "completion_tokens": sum(len(c.output_ids) for c in everything)},
        "spec": _merged_stats(everything).to_dict(),
    }
    if is_multi:
        out["spec"]["per_sample"] = [_merged_stats(cs).to_dict() for cs in samples]
    if rec.sampling.logprobs is not None:
        out["logprobs"] = field_of(lambda c: [{"token_id": e.token_id, "logprob": e.logprob,
                                               "top": [[t, lp] for t, lp in e.top]}
                                              for e in (c.logprobs or [])])
    errors = [c.error for c in everything if c.error]
    if errors:
        out["error"] = errors[0]
    return out


@dataclass
class Logprob:
    """One token's log probability in ``CompletionOutput.logprobs`` (vLLM's ``Logprob``).
    logprob: natural log; rank: 1-based rank among the top-N reported at that position (None
    when the chosen token is not among them); decoded_token: its text (None without a
    tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request, shaped as vLLM's ``CompletionOutput``.

    index: the sample, 0 .. n-1. text / token_ids / finish_reason / stop_reason: the answer
    (token_ids keep a final EOS / stop id, text does not); for a ``turns`` record each is a list
    with one entry per turn. logprobs: ``None`` unless the request asked for ``logprobs``; else
    one ``{token_id: Logprob}`` dict per output token, the chosen token and the top-N
    (a list of those per turn for ``turns``). cumulative_logprob: the sum of the chosen tokens'
    logprobs (per turn for ``turns``), ``None`` without ``logprobs``.
    """

    index: int
    text: Any
    token_ids: Any
    cumulative_logprob: Any
    logprobs: Any
    finish_reason: Any
    stop_reason: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


def vllm_logprobs(entries: list[dict] | None, decode=None) -> tuple[list[dict] | None,
                                                                     float | None]:
    """specbatch's ``logprobs`` field of one answer (``[{"token_id", "logprob", "top":
    [[id, lp], ...]}, ...]``) -> vLLM's form, ``([{id: Logprob}, ...], cumulative logprob)``.
    decode(id) -> text fills ``decoded_token`` (None: left None)."""
    if entries is None:
        return None, None
    out, total = [], 0.0
    for e in entries:
        top = {t: Logprob(lp, rank, decode(t) if decode else None)
               for rank, (t, lp) in enumerate(e["top"], start=1)}
        chosen = top.get(e["token_id"])
        pos = {e["token_id"]: chosen if chosen is not None else Logprob(
            e["logprob"], None, decode(e["token_id"]) if decode else None)}
        pos.update((t, lp) for t, lp in top.items() if t != e["token_id"])
        out.append(pos)
        total += e["logprob"]
    return out, total


@dataclass
class RequestOutput:
    """One record's result from ``LLM.generate`` / ``LLM.chat`` (input order), shaped as vLLM's
    ``RequestOutput`` with specbatch's stats beside it.

    vLLM's fields: request_id (the record id as text), prompt (the prompt text; for a chat or
    ``turns`` record, the first prompt as rendered by the chat template), prompt_token_ids (the
    first prompt's ids), outputs (one ``CompletionOutput`` per sample, ``n`` of them),
    finished (always True: results come back whole), prompt_logprobs (None: not computed).

    specbatch's own: id (the record id as given, str or int), index (input position), usage
    (``{"prompt_tokens", "completion_tokens"}``), spec (the per-record speculation stats
    ``specbatch run`` writes, docs/output.md), error, fields (every output field as the CLI
    writes it). text / token_ids / finish_reason / stop_reason / logprobs: the CLI's
    ``output`` / ``output_token_ids`` / ... fields (one value; a list per turn for a ``turns``
    record; with ``n`` > 1 a list of those, one per sample).
    """

    index: int
    id: str | int
    text: Any
    token_ids: Any
    finish_reason: Any
    stop_reason: Any
    usage: dict
    spec: dict
    logprobs: Any = None
    error: str | None = None
    fields: dict = field(default_factory=dict, repr=False)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    prompt_logprobs: None = None

    @property
    def request_id(self) -> str:
        return str(self.id)

    @classmethod
    def from_fields(cls, record, fields: dict, prompt: str | None = None,
                    prompt_token_ids: list[int] | None = None,
                    decode=None) -> RequestOutput:
        """From ``output_fields`` of ``record``. decode(id) -> text: for ``Logprob``s."""
        n = record.sampling.n
        is_turns = record.turns is not None

        def per_sample(name):
            v = fields.get(name)
            return v if n > 1 else [v]

        outputs = []
        for s, (text, ids, fr, sr, lps) in enumerate(zip(
                per_sample("output"), per_sample("output_token_ids"),
                per_sample("finish_reason"), per_sample("stop_reason"),
                per_sample("logprobs") if "logprobs" in fields else [None] * n)):
            if is_turns:
                pairs = [vllm_logprobs(t, decode) for t in lps] if lps is not None else None
                lp = [p[0] for p in pairs] if pairs is not None else None
                cum = [p[1] for p in pairs] if pairs is not None else None
            else:
                lp, cum = vllm_logprobs(lps, decode)
            outputs.append(CompletionOutput(s, text, ids, cum, lp, fr, sr))
        return cls(record.index, record.id, fields["output"], fields["output_token_ids"],
                   fields["finish_reason"], fields["stop_reason"], fields["usage"],
                   fields["spec"], fields.get("logprobs"), fields.get("error"), fields,
                   prompt=prompt, prompt_token_ids=prompt_token_ids, outputs=outputs)
