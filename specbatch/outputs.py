"""Completions -> output fields: what the writer stores beside each record, and what
``LLM.generate`` returns. No model code (no torch): ``analyze`` and the Ray driver import it.

Fields: ``output``, ``output_token_ids``, ``finish_reason``, ``stop_reason``, ``usage``, ``spec``
and, when asked, ``logprobs`` / ``error``. For ``turns`` records ``output``,
``output_token_ids``, ``finish_reason`` and ``stop_reason`` are lists, one entry per turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specbatch.spec_decode.stats import SpecStats

OUTPUT_FIELDS = ("output", "output_token_ids", "finish_reason", "stop_reason", "usage", "spec",
                 "logprobs", "error")


def output_fields(record, completions: list) -> dict:
    """The output fields of ``record`` from its answers' completions (``engine.Completion``,
    one per turn, in turn order; fewer when a turn stopped with an error)."""
    stats = SpecStats(proposer=completions[0].stats.proposer,
                      num_speculative_tokens=completions[0].stats.num_speculative_tokens)
    for c in completions:
        stats.merge(c.stats)
    is_turns = record.turns is not None

    def per_turn(values: list):
        return values if is_turns else values[0]

    out = {
        "output": per_turn([c.text for c in completions]),
        "output_token_ids": per_turn([c.output_ids for c in completions]),
        "finish_reason": per_turn([c.finish_reason for c in completions]),
        "stop_reason": per_turn([c.stop_reason for c in completions]),
        "usage": {"prompt_tokens": sum(len(c.prompt_ids) for c in completions),
                  "completion_tokens": sum(len(c.output_ids) for c in completions)},
        "spec": stats.to_dict(),
    }
    if record.sampling.logprobs is not None:
        out["logprobs"] = per_turn([[{"token_id": e.token_id, "logprob": e.logprob,
                                      "top": [[t, lp] for t, lp in e.top]}
                                     for e in (c.logprobs or [])] for c in completions])
    errors = [c.error for c in completions if c.error]
    if errors:
        out["error"] = errors[0]
    return out


@dataclass
class RequestOutput:
    """One record's result from ``LLM.generate`` / ``LLM.chat`` (input order).

    text / token_ids / finish_reason / stop_reason: one value, or a list with one per turn for
    a ``turns`` record. token_ids include a final EOS / stop id (``text`` does not).
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
