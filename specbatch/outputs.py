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
    stats = SpecStats(proposer=completions[0].stats.proposer,
                      num_speculative_tokens=completions[0].stats.num_speculative_tokens)
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
class RequestOutput:
    """One record's result from ``LLM.generate`` / ``LLM.chat`` (input order).

    text / token_ids / finish_reason / stop_reason: one value, or a list with one per turn for
    a ``turns`` record (and, with ``n`` > 1, a list of those, one per sample). token_ids
    include a final EOS / stop id (``text`` does not).
    usage: ``{"prompt_tokens", "completion_tokens"}``. spec: the per-record speculation stats
    ``specbatch run`` writes (docs/output.md). fields: every output field as the CLI writes it.
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

    @classmethod
    def from_fields(cls, record, fields: dict) -> RequestOutput:
        return cls(record.index, record.id, fields["output"], fields["output_token_ids"],
                   fields["finish_reason"], fields["stop_reason"], fields["usage"],
                   fields["spec"], fields.get("logprobs"), fields.get("error"), fields)
