"""From validated records to output records: prompts -> requests -> engine -> output dicts.

A record's prompt is ``prompt`` (plain text, tokenised as is), ``messages`` (a chat list,
rendered with the tokenizer's chat template) or ``turns`` (user turns answered in order, each
with the earlier turns and answers in context, as Spec-Bench does). Requests are sorted by
prompt length (longest first) so rows in a batch have similar lengths; outputs are matched
back to records by index, and the writer restores input order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from specbatch.engine.engine import Completion, Engine
from specbatch.engine.sequence import Request
from specbatch.spec_decode.sampler import derive_seed
from specbatch.spec_decode.stats import SpecStats


@dataclass
class _Pending:
    record: Any
    num_samples: int = 1
    completions: dict[int, list[Completion]] = field(default_factory=dict)  # sample -> turns
    messages: dict[int, list[dict] | None] = field(default_factory=dict)  # sample -> chat

    def add(self, sample: int, c: Completion) -> None:
        self.completions.setdefault(sample, []).append(c)

    def is_done(self) -> bool:
        """Every sample has all its turns, or stopped at an error."""
        num_turns = len(self.record.turns) if self.record.turns is not None else 1
        return len(self.completions) == self.num_samples and all(
            len(cs) == num_turns or cs[-1].finish_reason == "error"
            for cs in self.completions.values())


class PromptRenderer:
    """Tokenises a record's prompt for each turn. ``tokenizer``: a transformers tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._first: dict[int, tuple[list[int], list[dict] | None]] = {}  # record index -> ...

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first_prompt(self, record) -> tuple[list[int], list[dict] | None]:
        """Prompt ids of the first (or only) answer, and the chat so far (None for ``prompt``).
        Remembered per record index: length checks, the planner and generation tokenise once."""
        if record.index not in self._first:
            self._first[record.index] = self._render_first(record)
        ids, messages = self._first[record.index]
        return ids, (list(messages) if messages is not None else None)

    def _render_first(self, record) -> tuple[list[int], list[dict] | None]:
        if record.prompt is not None:
            return self.tokenizer.encode(record.prompt), None
        messages = (list(record.messages) if record.messages is not None
                    else [{"role": "user", "content": record.turns[0]}])
        return self.encode_chat(messages), messages

    def count_tokens(self, record) -> int:
        return len(self.first_prompt(record)[0])

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def record_seed(record, run_seed: int) -> int:
    """The record's own ``seed`` if set, else derived from the run seed and the record id (not
    its line number or batch slot), so a record samples the same wherever it runs."""
    sp = record.sampling
    return sp.seed if sp.seed is not None else derive_seed(run_seed, record.id)


def sample_seed(record, run_seed: int, sample: int) -> int:
    """Seed of sample ``sample`` of ``n``: sample 0 is the record seed (what n = 1 samples),
    sample s > 0 one derived from it and s, so samples never share noise."""
    seed = record_seed(record, run_seed)
    return seed if sample == 0 else derive_seed(seed, "sample", sample)


def grammar_for(record, compiler):
    """The compiled grammar of a record's ``response_format`` (None without one)."""
    schema = record.sampling.json_schema
    return None if schema is None else compiler.compile(schema)


def generate_records(engine: Engine, renderer: PromptRenderer, records: Iterable,
                     run_seed: int = 0,
                     on_tokens: Callable[[int, SpecStats], None] | None = None,
                     plan=None) -> Iterator[tuple[Any, dict]]:
    """Run records through the engine; yield ``(record, output_fields)`` as records finish.

    output_fields: ``output``, ``output_token_ids``, ``finish_reason``, ``stop_reason``,
    ``usage``, ``spec`` and, when asked, ``logprobs`` / ``error``. For ``turns`` records,
    ``output``, ``output_token_ids``, ``finish_reason`` and ``stop_reason`` are lists, one per
    turn. on_tokens(num_new_completion_tokens, stats) is called per finished answer.
    plan: a ``plan.planner.Plan`` (``--method auto``): orders records by bucket then length, and
    adds its per-record fields to ``spec``; without one, records run longest prompt first.
    """
    pending: dict[int, _Pending] = {}
    requests = []
    compiler = None  # xgrammar, built for the first record with a response_format
    for rec in records:
        ids, messages = renderer.first_prompt(rec)
        pending[rec.index] = _Pending(rec, rec.sampling.n)
        if rec.sampling.json_schema is not None and compiler is None:
            from specbatch.engine.grammar import GrammarCompiler

            compiler = GrammarCompiler(renderer.tokenizer, engine.runner.forward.vocab_size)
        grammar = grammar_for(rec, compiler)
        for sample in range(rec.sampling.n):
            pending[rec.index].messages[sample] = messages
            seed = sample_seed(rec, run_seed, sample)
            requests.append(Request((rec.index, 0, sample), ids, rec.sampling,
                                    seed=derive_seed(seed, 0), tag=rec.index, grammar=grammar))
    if plan is not None:
        requests.sort(key=lambda r: plan.order_key(r.tag, len(r.prompt_ids)))
    else:
        requests.sort(key=lambda r: -len(r.prompt_ids))

    def follow_up(c: Completion) -> Request | None:
        p = pending[c.request.tag]
        rec = p.record
        _, turn, sample = c.request.request_id
        if rec.turns is None or turn + 1 >= len(rec.turns):
            return None
        chat = p.messages[sample] + [{"role": "assistant", "content": c.text},
                                     {"role": "user", "content": rec.turns[turn + 1]}]
        p.messages[sample] = chat
        seed = derive_seed(sample_seed(rec, run_seed, sample), turn + 1)
        return Request((rec.index, turn + 1, sample), renderer.encode_chat(chat), rec.sampling,
                       seed=seed, tag=rec.index, grammar=c.request.grammar)

    for c in engine.generate(requests, follow_up=follow_up):
        p = pending[c.request.tag]
        p.add(c.request.request_id[2], c)
        if on_tokens is not None:
            on_tokens(len(c.output_ids), c.stats)
        rec = p.record
        if p.is_done():
            del pending[c.request.tag]
            out = _output_fields(rec, [p.completions[s] for s in range(p.num_samples)])
            if plan is not None:
                out["spec"].update(plan.annotate(rec.index))
            yield rec, out


def _merged_stats(completions: list[Completion]) -> SpecStats:
    stats = SpecStats(proposer=completions[0].stats.proposer,
                      num_speculative_tokens=completions[0].stats.num_speculative_tokens)
    for c in completions:
        stats.merge(c.stats)
    return stats


def _output_fields(rec, samples: list[list[Completion]]) -> dict:
    """The output fields of a record from its completions, ``samples[s][turn]``.

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
        "usage": {"prompt_tokens": sum(len(c.prompt_ids) for c in samples[0] if c.prompt_fed),
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


class Throughput:
    """Running totals for the progress bar: output tokens, seconds, acceptance."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.num_tokens = 0
        self.stats = SpecStats()

    def add(self, num_tokens: int, stats: SpecStats) -> None:
        self.num_tokens += num_tokens
        self.stats.merge(stats)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / max(time.perf_counter() - self.start, 1e-9)


def build_engine(model, spec_config, engine_config, eos_ids: Iterable[int], max_model_len: int,
                 detokenize: Callable[[list[int]], str] | None, draft_model=None) -> Engine:
    """Wire a transformers model into an ``Engine``.

    model: a Llama-family transformers model (already in the wanted dtype and device).
    max_model_len: context cap (tokens), lowered to ``engine_config.max_model_len`` if set.
    draft_model: the draft transformers model for ``method = draft``, or for ``auto`` to choose
    from (vocabulary checked by the caller, ``spec_decode.draft.load_draft_model``).
    """
    from specbatch.engine.runner import ModelRunner
    from specbatch.engine.sequence import StopRules
    from specbatch.models.llama import LlamaForward
    from specbatch.spec_decode import make_proposer

    if engine_config.max_model_len is not None:
        max_model_len = min(max_model_len, engine_config.max_model_len)
    runner = ModelRunner(LlamaForward(model), engine_config.max_batch_size, max_model_len,
                         prefill_chunk=engine_config.prefill_chunk,
                         max_prefill_tokens=engine_config.max_prefill_tokens)
    stop_rules = StopRules(frozenset(eos_ids), max_model_len, detokenize)
    draft_forward = LlamaForward(draft_model) if draft_model is not None else None
    proposer = make_proposer(spec_config, draft_forward, engine_config.max_batch_size)
    return Engine(runner, proposer, stop_rules, spec_config.draft_cap, detokenize)


def longest_row(records, renderer: PromptRenderer, max_model_len: int) -> int:
    """Tokens the longest record may hold in a cache row: its first prompt, every turn's
    ``max_tokens``, and the later turns' text (plus 16 tokens of chat template each); at most
    ``max_model_len``."""
    longest = 0
    for r in records:
        n = renderer.count_tokens(r) + r.sampling.max_tokens
        for turn in (r.turns or [])[1:]:
            n += len(renderer.tokenizer.encode(turn, add_special_tokens=False)) + 16
            n += r.sampling.max_tokens
        longest = max(longest, n)
    return min(longest, max_model_len)


def fit_batch_size(batch_size: int, tokens_per_row: int, forwards,
                   free_bytes: int | None = None, reserve: float = 0.1,
                   initial_capacity: int = 512) -> tuple[int, str | None]:
    """The largest batch size <= ``batch_size`` whose KV rows fit in memory.

    Every row may grow to ``tokens_per_row`` tokens (longest prompt + largest max_tokens, at
    most the context) in each model's cache (``forwards``: the target's ``LlamaForward`` and,
    with a draft model, the draft's). A cache allocates all its rows at the capacity it has
    grown to: ``initial_capacity`` positions, doubled until the longest row fits
    (``KVCache.ensure_capacity``). free_bytes: memory available now, with the weights already
    loaded (default: ``psutil``'s available memory, or the device's free memory on CUDA);
    ``reserve`` of it is left for activations. Returns (batch size, a one-line note when it had
    to be lowered, else None); never below 1.
    """
    forwards = list(forwards)
    if free_bytes is None:
        device = forwards[0].device
        if device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(device)[0]
        else:
            import psutil

            free_bytes = psutil.virtual_memory().available
    from specbatch.engine.kv_cache import round_capacity

    capacity = round_capacity(initial_capacity)
    while capacity < tokens_per_row:
        capacity *= 2
    per_row = capacity * sum(f.kv_bytes_per_token for f in forwards)
    fits = max(1, int(free_bytes * (1 - reserve)) // max(per_row, 1))
    if fits >= batch_size:
        return batch_size, None
    models = "target + draft" if len(forwards) > 1 else "target"
    return fits, (f"memory: a row of {capacity} KV positions takes {per_row / 2**20:.1f} MiB "
                  f"({models}) and {_gib(free_bytes)} is available: batch size lowered from "
                  f"{batch_size} to {fits}")


def fit_engine_config(engine_config, records, renderer: PromptRenderer, max_model_len: int,
                      model, draft_model=None, echo=print):
    """``engine_config`` with ``max_batch_size`` at most the number of records (a record holds
    one row at a time) and lowered, with a note to ``echo``, if the KV rows of the target and
    the draft would not fit in memory (``fit_batch_size``). model, draft_model: transformers
    models as loaded."""
    from dataclasses import replace

    from specbatch.models.llama import LlamaForward

    records = list(records)
    if not records:
        return engine_config
    rows = min(engine_config.max_batch_size, sum(r.sampling.n for r in records))
    forwards = [LlamaForward(model)] + ([LlamaForward(draft_model)] if draft_model else [])
    rows, note = fit_batch_size(rows, longest_row(records, renderer, max_model_len), forwards)
    if note is not None:
        echo(note)
    return replace(engine_config, max_batch_size=rows)


def memory_summary(engine: Engine) -> str:
    """One line: weights and KV cache bytes of the target and, for a draft proposer, the draft.

    KV bytes are the caches' size at the time of the call (they grow with the longest row)."""
    from specbatch.spec_decode.draft import DraftProposer, weight_bytes

    runner, proposer = engine.runner, engine.proposer
    proposer = getattr(proposer, "model", proposer)  # auto with a draft model: the draft
    line = (f"memory: target weights {_gib(weight_bytes(runner.forward.hf_model))}, KV "
            f"{_gib(runner.cache.nbytes)} ({runner.cache.num_rows} rows x "
            f"{runner.cache.capacity} positions)")
    if isinstance(proposer, DraftProposer):
        line += (f"; draft weights {_gib(proposer.weight_bytes)}, KV "
                 f"{_gib(proposer.cache.nbytes)}")
    return line


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
