"""The middle of the data flow: prompts -> requests -> engine -> completions -> output fields.

records (``io.records``) -> prompts (``prompts.PromptRenderer``) -> requests (here) -> engine
(built by ``llm.LLM``, the one place that assembles one) -> completions -> output fields
(``outputs``) -> writer (``io.writer``). Requests are sorted by prompt length (longest first)
so rows in a batch have similar lengths; outputs are matched back to records by index, and the
writer restores input order.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from specbatch.engine.engine import Completion, Engine
from specbatch.engine.sequence import Replay, Request
from specbatch.outputs import output_fields
from specbatch.prompts import PromptRenderer
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
                     plan=None,
                     on_step: Callable[[int], None] | None = None,
                     replay: dict[int, list[dict]] | None = None,
                     schedules: dict[int, list[dict]] | None = None,
                     ) -> Iterator[tuple[Any, dict]]:
    """Run records through the engine; yield ``(record, output_fields)`` as records finish.

    output_fields: see ``outputs.output_fields``. on_tokens(num_new_completion_tokens, stats) is
    called per finished answer; on_step(num_output_tokens) after every engine step with the
    output tokens generated so far, unfinished rows included (``Engine.generate``).
    plan: a ``auto.planner.Plan`` (``--method auto``): adds its per-record fields to ``spec``.
    Records run longest prompt first, whatever the method.
    replay: resume, ``record.index`` -> the ``schedules`` entries of a record an interrupted
    run finished (``replay_requests``): the record is not generated again, its answers hold
    rows as placeholders where they ran, so the other records run where, and beside what, they
    ran in an uninterrupted run. schedules: filled with ``record.index`` -> one entry per
    answer (``Completion.schedule`` plus ``id``, ``output_ids``, ``finish_reason``) as records
    finish, before each is yielded (what a resume replays; the work file keeps it).
    """
    pending: dict[int, _Pending] = {}
    requests = []
    compiler = None  # xgrammar, built for the first record with a response_format
    for rec in records:
        ids, messages = renderer.first_prompt(rec)
        if replay is not None and rec.index in replay:
            requests.extend(replay_requests(rec, ids, replay[rec.index]))
            continue
        pending[rec.index] = _Pending(rec, rec.sampling.n)
        if rec.sampling.json_schema is not None and compiler is None:
            from specbatch.engine.grammar import GrammarCompiler

            compiler = GrammarCompiler.for_tokenizer(renderer.tokenizer,
                                                    engine.runner.forward.vocab_size)
        grammar = grammar_for(rec, compiler)
        for sample in range(rec.sampling.n):
            pending[rec.index].messages[sample] = messages
            seed = sample_seed(rec, run_seed, sample)
            requests.append(Request((rec.index, 0, sample), ids, rec.sampling,
                                    seed=derive_seed(seed, 0), tag=rec.index, grammar=grammar,
                                    follow_ups=_follow_ups(rec, 0)))
    # longest prompt first, whatever the method: auto's records in bucket order, as they were,
    # shared prefill forwards differently, and prompts that share a prefix (a chat template, a
    # recipe's instruction) in one forward each compute it (a prompt copies only what rows
    # held before the forward, ``ModelRunner.prefill_step``): 16 peer records at batch 16
    # (int8, Zen 2) computed 3691 prompt tokens under auto against none's 3609, and auto ran
    # at 0.982x of none with the same drafts as none (none); in none's order 0.992x
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
                       seed=seed, tag=rec.index, grammar=c.request.grammar,
                       follow_ups=_follow_ups(rec, turn + 1))

    for c in engine.generate(requests, follow_up=follow_up, on_step=on_step):
        p = pending[c.request.tag]
        p.add(c.request.request_id[2], c)
        if schedules is not None:
            schedules.setdefault(c.request.tag, []).append(
                {"id": list(c.request.request_id), **c.schedule,
                 "output_ids": c.output_ids, "finish_reason": c.finish_reason})
        if on_tokens is not None:
            on_tokens(len(c.output_ids), c.stats)
        rec = p.record
        if p.is_done():
            del pending[c.request.tag]
            out = output_fields(rec, [p.completions[s] for s in range(p.num_samples)])
            if plan is not None:
                out["spec"].update(plan.annotate(rec.index))
            yield rec, out


def _follow_ups(rec, turn: int) -> int:
    """The turns of ``rec`` after ``turn`` (``Request.follow_ups``)."""
    return max(len(rec.turns) - 1 - turn, 0) if rec.turns else 0


def replay_requests(rec, prompt_ids: list[int], entries: list[dict]) -> list[Request]:
    """The placeholder requests of a finished record (``Request.replay``), one per sample,
    each with its later turns chained (``Replay.next``), from its ``schedules`` entries.
    Raises ``ValueError`` on an entry that is not one (a work file of another version)."""
    try:
        by_id = {tuple(e["id"]): e for e in entries}
        firsts = []
        for sample in range(rec.sampling.n):
            nxt = None
            turns = sorted(t for (i, t, s) in by_id if s == sample)
            for turn in reversed(turns):
                e = by_id[(rec.index, turn, sample)]
                r = Replay(int(e["admit"]), None if e["verify"] is None else int(e["verify"]),
                           int(e["finish"]), int(e["row"]), str(e["phase"]),
                           [int(t) for t in e["output_ids"]], str(e["finish_reason"]), nxt)
                nxt = Request((rec.index, turn, sample), prompt_ids if turn == 0 else [],
                              rec.sampling, tag=rec.index, replay=r,
                              follow_ups=_follow_ups(rec, turn))
            if nxt is None or turns[0] != 0:
                raise ValueError(f"no schedule entry for sample {sample}'s first turn")
            firsts.append(nxt)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"record {rec.index}: bad schedule entry ({e})") from e
    return firsts


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


def kv_capacity(records, renderer: PromptRenderer, max_model_len: int, draft_cap: int) -> int:
    """KV positions per row to allocate a job's cache at (``ModelRunner``'s
    ``initial_capacity``): its longest row (``longest_row``) plus a verify step's queries past
    a row's last token (``1 + draft_cap``), rounded up to the cache's block
    (``kv_cache.round_capacity``). A cache allocated short doubles as rows grow, copying every
    layer: the extraction recipe at 16 rows (SmolLM2-135M, Zen 4) allocated 512 positions
    (0.19 s) and grew to 1024 (0.52 s), where allocating the 768 it needs takes 0.40 s. The
    multi-turn part of ``longest_row`` is an estimate: a longer row still grows the cache."""
    from specbatch.engine.kv_cache import round_capacity

    return round_capacity(longest_row(records, renderer, max_model_len) + 1 + draft_cap)


def fit_batch_size(batch_size: int, tokens_per_row: int, forwards,
                   free_bytes: int | None = None, reserve: float = 0.1,
                   initial_capacity: int = 512,
                   available_bytes: int | None = None) -> tuple[int, str | None]:
    """The largest batch size <= ``batch_size`` whose KV rows fit in memory.

    Every row may grow to ``tokens_per_row`` tokens (longest prompt + largest max_tokens, at
    most the context) in each model's cache (``forwards``: the target's ``LlamaForward`` and,
    with a draft model, the draft's). A cache allocates all its rows at one capacity: the
    draft's starts at ``initial_capacity`` positions and doubles until the longest row fits
    (``KVCache.ensure_capacity``), the target's is allocated at the job's longest row
    (``kv_capacity``, at most that); both are counted at the doubled size. free_bytes:
    memory the KV rows may take (default: the machine's total memory, or the device's on CUDA,
    less the loaded weights); ``reserve`` of it is left for activations. The default is a
    property of the machine and the job, never of what else runs: the batch size decides which
    rows share a step, and a batch size that followed the memory free at the moment made the
    output of a run follow the machine's load on a CPU whose kernels are not batch-invariant
    (issue 16). available_bytes: memory available now (default: ``psutil``'s, or the device's
    free memory); when the rows need more, the note warns and the batch size stays. Returns
    (batch size, a one-line note when it was lowered or memory is short now, else None); never
    below 1.
    """
    forwards = list(forwards)
    device = forwards[0].device
    if free_bytes is None or available_bytes is None:
        if device.type == "cuda":
            free_now, total = torch.cuda.mem_get_info(device)
        else:
            import psutil

            mem = psutil.virtual_memory()
            free_now, total = mem.available, mem.total
        if free_bytes is None:
            free_bytes = max(0, total - sum(f.weight_bytes for f in forwards))
        if available_bytes is None:
            available_bytes = free_now
    from specbatch.engine.kv_cache import round_capacity

    capacity = round_capacity(initial_capacity)
    while capacity < tokens_per_row:
        capacity *= 2
    per_row = capacity * sum(f.kv_bytes_per_token for f in forwards)
    fits = max(1, int(free_bytes * (1 - reserve)) // max(per_row, 1))
    models = "target + draft" if len(forwards) > 1 else "target"
    if fits < batch_size:
        return fits, (f"memory: a row of {capacity} KV positions takes {per_row / 2**20:.1f} MiB "
                      f"({models}) and {_gib(free_bytes)} is there for them: batch size lowered "
                      f"from {batch_size} to {fits}")
    need = batch_size * per_row
    if need > available_bytes * (1 - reserve):
        return batch_size, (f"warning: memory: {batch_size} rows of {capacity} KV positions "
                            f"({models}) may take {_gib(need)} and {_gib(available_bytes)} is "
                            f"available now (other processes hold the rest); the batch size "
                            f"stays {batch_size}, so that the output does not depend on what "
                            f"else runs; pass --max-batch-size to use less")
    return batch_size, None


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
    """One line: weight bytes the target holds (``LlamaForward.weight_bytes``: its tensors'
    storage plus the kernels' forms of the dense weights, e.g. int8 codes, whose float32
    values are released) and its KV cache bytes, the proposer's method's own part
    (its registry entry's ``memory``: a draft model's weights and KV) and, with prefix caching
    on, how many prompt tokens it saved prefilling.

    KV bytes are the caches' size at the time of the call (they grow with the longest row)."""
    from specbatch import methods

    runner, proposer = engine.runner, engine.proposer
    line = (f"memory: target weights {_gib(runner.forward.weight_bytes)}, KV "
            f"{_gib(runner.cache.nbytes)} ({_plural(runner.cache.num_rows, 'row')} x "
            f"{runner.cache.capacity} positions)")
    entry = methods.get(proposer.name)  # a proposer's name is its method's
    part = entry.memory(proposer) if entry is not None and entry.memory is not None else None
    if part:
        line += f"; {part}"
    if runner.prefix_caching and runner.num_prompt_tokens:
        line += (f"; prefix caching: {runner.num_prefix_reused} of {runner.num_prompt_tokens} "
                 f"prompt tokens found in a cache row, not prefilled "
                 f"({runner.num_prefix_reused / runner.num_prompt_tokens:.0%})")
    return line


def _plural(n: int, noun: str) -> str:
    """``1 row``, ``2 rows``."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
