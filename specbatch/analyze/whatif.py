"""What-if: the acceptance (and, with a cost model, the speedup) other n-gram settings would
have had on the recorded outputs, replayed exactly (``spec_decode.replay``), per group.

Which records replay. Temperature-0 records (greedy: both the drafts and the target's tokens
are functions of the committed tokens alone; T > 0 records are listed as skipped), without an
``error`` finish, from a file whose ``OUT.config.json`` names the model (for the tokenizer) and
the context cap. The prompts are re-tokenised with the run's tokenizer as ``pipeline`` built
them (``turns``: turn i sees the earlier turns and the recorded answers); a record whose
re-tokenised prompts do not add up to its ``usage.prompt_tokens`` is left out too.

Self-check. For records a run made with ``ngram``, the replay of the run's own (k, min, max)
must equal the recorded ``spec`` counters; ``self_check`` reports every record's result. (A
``spec`` written before ``num_draft_tokens_per_pos`` reads it from its ``k_histogram``:
``SpecStats.from_dict``.)

Predicted speedup (decode phase; prefill is the same for every configuration and left out).
With a cost model ``step_time(num_rows, query_len, context_len, num_tokens)`` and ``batch_size``
B rows, each group's records are run as a job of their own through a model of the engine's
schedule (``simulate``), once with plain decoding and once per setting, from the replayed steps:

    order:   longest prompt first (``pipeline``'s order, every method); a turn's follow-up
             goes to the front of the queue when its answer finishes (``Engine``)
    a step:  the running rows (at most B; a freed row is refilled at the next step, whose
             prefill commits the answer's first token; a prompt longer than the prefill budget,
             which the engine prefills over several steps, joins at once here) each run their
             next replayed step, drafting d_i
             and committing e_i tokens; it costs step_time(rows, q, ctx, num_tokens=t) with
             q = 1 + max d_i (padded attention; at least the fit's ``min_query_len`` on a one-row
             step, 2 for a fit that does not say, as ``runner.query_len`` pads a lone row), t =
             sum (1 + d_i) (the runner packs the rows' real tokens) and ctx the rows' mean
             context (prompt + committed output tokens)
    none:    the same schedule with d_i = 0, e_i = 1
    speedup = time(none) / time(config)

So a job's tail is priced as it runs: where few records are left the steps have few rows, and
drafting pays there as at batch 1 (20 Spec-Bench records at batch 16: 508 plain steps of ~10
rows, not 5043 / 16 steps of 16; a model of full steps with independent draft lengths read
ngram k5 at 0.71x where the cost model priced the run's own steps at 0.80x). The best
configuration of a group is the highest predicted speedup (``none`` = 1) with a cost model, else
the most tokens per decode step (which ignores what longer drafts cost: pass a calibration file
for a real answer). ``mean_context_len`` reports the group's mean context at a decode step: sum
over answers of (prompt + output / 2) * output, over the output tokens.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from specbatch import methods
from specbatch.analyze.load import RunFile, answers, config_path, spec_stats
from specbatch.analyze.tables import ALL, NO_GROUPS, file_names, group_label
from specbatch.io.records import Record
from specbatch.spec_decode.replay import NgramReplay
from specbatch.spec_decode.stats import SpecStats

KS = tuple(range(1, 9))
LOOKUPS = ((1, 2), (1, 3), (2, 4), (3, 5))


class CostModel(Protocol):
    def step_time(self, num_rows: int, query_len: int, context_len: int,
                  num_tokens: float | None = None) -> float: ...


@dataclass(frozen=True, order=True)
class Setting:
    """One n-gram configuration: k draft tokens, n-gram sizes prompt_lookup_min..max."""

    prompt_lookup_min: int
    prompt_lookup_max: int
    k: int

    @property
    def name(self) -> str:
        return f"ngram:k={self.k}:min={self.prompt_lookup_min}:max={self.prompt_lookup_max}"


@dataclass
class _GroupAcc:
    num_records: int = 0
    num_answers: int = 0
    num_output_tokens: int = 0
    context_weight: float = 0.0  # sum over answers of (prompt + output / 2) * output
    stats: dict[Setting, SpecStats] = field(default_factory=dict)
    jobs: list[list[Answer]] = field(default_factory=list)  # per record (with a cost model)


@dataclass(frozen=True)
class Answer:
    """One recorded answer as ``simulate`` runs it: its prompt (tokens, earlier turns
    included), its output tokens, and per setting the replayed verify steps as two byte strings
    of one entry per step: the draft tokens fed and the tokens the step committed."""

    prompt_len: int
    output_len: int
    steps: dict[Setting, tuple[bytes, bytes]]

    def plan(self, setting: Setting | None) -> tuple[bytes, bytes]:
        """``(drafts, emitted)`` per verify step at ``setting``; None: plain decoding (one
        token a step after the prefill's)."""
        if setting is None:
            return bytes(self.output_len - 1), b"\x01" * (self.output_len - 1)
        return self.steps[setting]


def settings_for(files: list[RunFile], ks=KS, lookups=LOOKUPS) -> list[Setting]:
    """The grid: every k in ``ks`` for every (min, max) in ``lookups`` and each run's own
    (min, max), plus each ngram run's own (k, min, max)."""
    looks = set(lookups)
    own = set()
    for f in files:
        c = f.config or {}
        if c.get("prompt_lookup_min") and c.get("prompt_lookup_max"):
            looks.add((c["prompt_lookup_min"], c["prompt_lookup_max"]))
            if _self_checked(c) and c.get("k"):
                own.add(Setting(c["prompt_lookup_min"], c["prompt_lookup_max"], c["k"]))
    return sorted({Setting(lo, hi, k) for lo, hi in looks for k in ks} | own)


def own_setting(f: RunFile, rec: Record) -> Setting | None:
    """The setting the record ran with, when its method's stats are an n-gram replay at a
    fixed k (``Method.whatif_self_check``: ngram; ``--method auto`` chooses the draft length
    per step: no fixed setting to check)."""
    c = f.config or {}
    spec = rec.fields["spec"]
    method = c.get("method", spec.get("proposer"))
    if (not _self_checked({"method": method}) or spec.get("proposer") != method
            or not c.get("prompt_lookup_min")):
        return None
    return Setting(c["prompt_lookup_min"], c["prompt_lookup_max"],
                   spec.get("num_speculative_tokens", c.get("k", 0)))


def _self_checked(config: dict) -> bool:
    """Whether a run of ``config``'s method has stats the n-gram replay reproduces."""
    entry = methods.get(config.get("method"))
    return entry is not None and entry.whatif_self_check


def _whatif_note(config: dict) -> str | None:
    """Why a run of ``config``'s method cannot be replayed exactly (the registry's note)."""
    entry = methods.get(config.get("method"))
    return entry.whatif_note if entry is not None else None


def skip_reason(f: RunFile, rec: Record) -> str | None:
    """Why the record cannot be replayed, or None."""
    c = f.config
    if c is None:
        return f"no run config {config_path(f.path).name} beside it"
    if not c.get("model") or not c.get("max_model_len"):
        return f"its run config {config_path(f.path).name} names no model or max_model_len"
    if not rec.sampling.is_greedy:
        return f"temperature {rec.sampling.temperature} > 0"
    reasons = answers(rec.fields, "finish_reason")
    if "error" in reasons:
        return "finish_reason error"
    outs = answers(rec.fields, "output_token_ids")
    if not outs or any(not o for o in outs):
        return "no output_token_ids"
    return None


def prompt_ids_per_answer(rec: Record, renderer) -> list[list[int]]:
    """The prompt ids of each recorded answer, as ``pipeline.generate_records`` built them.

    renderer: a ``prompts.PromptRenderer`` over the run's tokenizer.
    """
    first, messages = renderer.first_prompt(rec)
    ids = [first]
    if rec.turns is not None:
        texts = answers(rec.fields, "output")
        for i in range(1, len(texts)):
            messages = messages + [{"role": "assistant", "content": texts[i - 1]},
                                   {"role": "user", "content": rec.turns[i]}]
            ids.append(renderer.encode_chat(messages))
    return ids


def replay_record(prompts: list[list[int]], outputs: list[list[int]], max_tokens: int,
                  max_model_len: int, settings: list[Setting],
                  answers_out: list[Answer] | None = None) -> dict[Setting, SpecStats]:
    """Replayed stats of one record (its answers merged) for every setting.

    prompts / outputs: per answer, the prompt ids and the recorded output ids (tokens).
    max_tokens: the record's completion cap; max_model_len: the run's context cap (tokens).
    answers_out: given, gets one ``Answer`` per answer appended (its steps at every setting,
    for ``simulate``). One ``spec_decode.replay.NgramReplay`` per answer and (min, max) serves
    every k.
    """
    out: dict[Setting, SpecStats] = {}
    steps: list[dict[Setting, tuple[bytes, bytes]]] = [{} for _ in outputs]
    by_lookup: dict[tuple[int, int], list[Setting]] = {}
    for s in settings:
        by_lookup.setdefault((s.prompt_lookup_min, s.prompt_lookup_max), []).append(s)
    for (lo, hi), group in by_lookup.items():
        max_k = max(s.k for s in group)
        replays = [NgramReplay(p, o, lo, hi, max_k) for p, o in zip(prompts, outputs)]
        for s in group:
            total = SpecStats(proposer="ngram", num_speculative_tokens=s.k)
            for i, r in enumerate(replays):
                trace = [] if answers_out is not None else None
                total.merge(r.stats(s.k, max_tokens, max_model_len, steps_out=trace))
                if trace is not None:
                    steps[i][s] = (bytes(d for d, _ in trace), bytes(e for _, e in trace))
            out[s] = total
    if answers_out is not None:
        answers_out.extend(Answer(len(p), len(o), st) for p, o, st in zip(prompts, outputs, steps))
    return out


def simulate(jobs: list[list[Answer]], batch_size: int, cost: CostModel,
             setting: Setting | None = None) -> float:
    """Seconds of the verify steps of ``jobs`` (per record, its answers in turn order) run as
    one job at ``batch_size`` rows with ``setting``'s replayed steps (None: plain decoding),
    each step priced by ``cost``; the schedule and the price are the module doc's."""
    lone = getattr(cost, "min_query_len", 2)  # what a one-row step feeds at least
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].prompt_len)  # stable
    waiting = deque((i, 0) for i in order)
    free = list(range(batch_size))  # a heap: the lowest row is taken first (``Scheduler``)
    # in row order: [row, record, answer, steps done, context, drafts, emitted]
    running: list[list] = []
    seconds = 0.0

    def finish(entry: list) -> None:
        heapq.heappush(free, entry[0])
        i, a = entry[1], entry[2]
        if a + 1 < len(jobs[i]):  # the record's next turn, first in the queue
            waiting.appendleft((i, a + 1))

    while waiting or running:
        # Engine._admit: fill the free rows and prefill them; a row whose prefill token ended
        # its answer is refilled in this step only while no row is decoding
        while waiting and free:
            new = []
            while waiting and free:
                i, a = waiting.popleft()
                answer = jobs[i][a]
                new.append([heapq.heappop(free), i, a, 0, answer.prompt_len + 1,
                            *answer.plan(setting)])
            for entry in sorted(new):
                if entry[5]:
                    bisect.insort(running, entry)
                else:
                    finish(entry)
            if running:
                break
        if not running:
            continue
        # price the step, then commit it row by row (rows finish in row order)
        n, longest, fed, context, still = len(running), 0, 0, 0, []
        for entry in running:
            j = entry[3]
            d = entry[5][j]
            fed += d
            if d > longest:
                longest = d
            context += entry[4]
            entry[4] += entry[6][j]
            entry[3] = j + 1
            if j + 1 < len(entry[5]):
                still.append(entry)
            else:
                finish(entry)
        running = still
        q = 1 + longest if n > 1 or longest + 1 >= lone else lone
        seconds += cost.step_time(n, q, context / n, num_tokens=n + fed)
    return seconds


def what_if(files: list[RunFile], grouping: str, tokenizer_for: Callable[[str], Any],
            batch_size: int = 16, cost: CostModel | None = None, ks=KS,
            lookups=LOOKUPS, pooled: bool = True) -> dict:
    """Replay every replayable record of ``files`` for the settings grid; per-group results.

    grouping: ``bucket``, ``proposer`` or an input field (as in ``tables``).
    tokenizer_for: model id (``OUT.config.json`` ``model``) -> that model's tokenizer.
    pooled: the files are runs of one setting (``tables.differing_settings``); else each file
    gets its own groups and total (``FILE: group``, ``FILE: (all)``), as the tables do: two
    runs of the same prompts (say none and ngram) would otherwise count every record twice.
    Returns the ``what_if`` section of the analyze document (see docs/analyze.md).
    """
    from specbatch.prompts import PromptRenderer

    settings = settings_for(files, ks, lookups)
    groups: dict[str, _GroupAcc] = {}
    order: dict[str, tuple[int, str]] = {}  # group name -> (its file's place, group label)
    totals: dict[str, _GroupAcc] = {}  # one per file where not pooled, else one: ALL
    skipped, checks = [], []
    renderers: dict[str, PromptRenderer] = {}
    for i, (f, fname) in enumerate(zip(files, file_names(files))):
        prefix = "" if pooled else f"{fname}: "
        total = totals.setdefault(prefix + ALL, _GroupAcc())
        for rec in f.records:
            why = skip_reason(f, rec)
            if why is None:
                model_id = f.config["model"]
                if model_id not in renderers:
                    renderers[model_id] = PromptRenderer(tokenizer_for(model_id))
                prompts = prompt_ids_per_answer(rec, renderers[model_id])
                n_prompt = sum(len(p) for p in prompts)
                if n_prompt != rec.fields["usage"]["prompt_tokens"]:
                    why = (f"re-tokenised prompt is {n_prompt} tokens, the run saw "
                           f"{rec.fields['usage']['prompt_tokens']}")
            if why is not None:
                skipped.append({"file": f.label, "id": rec.id, "reason": why})
                continue
            outputs = answers(rec.fields, "output_token_ids")
            own = own_setting(f, rec)
            record_settings = settings if own is None or own in settings else settings + [own]
            record_answers: list[Answer] | None = [] if cost is not None else None
            stats = replay_record(prompts, outputs, rec.sampling.max_tokens,
                                  f.config["max_model_len"], record_settings, record_answers)
            if own is not None:
                replayed = stats[own].to_dict()
                checks.append({"file": f.label, "id": rec.id, "setting": own.name,
                               "equal": replayed == spec_stats(rec.fields).to_dict(),
                               "replayed": replayed})
            if grouping == NO_GROUPS:
                accs = (total,)
            else:
                label = group_label(rec, grouping)
                order.setdefault(prefix + label, (0 if pooled else i, label))
                accs = (groups.setdefault(prefix + label, _GroupAcc()), total)
            for acc in accs:
                acc.num_records += 1
                acc.num_answers += len(outputs)
                acc.num_output_tokens += sum(len(o) for o in outputs)
                acc.context_weight += sum((len(p) + len(o) / 2) * len(o)
                                          for p, o in zip(prompts, outputs))
                for s in settings:
                    acc.stats.setdefault(s, SpecStats("ngram", s.k)).merge(stats[s])
                if record_answers is not None:
                    acc.jobs.append(record_answers)
    rows = [_group_result(name, groups[name], settings, batch_size, cost)
            for name in sorted(groups, key=order.__getitem__)]  # files in the order given
    rows += [_group_result(name, acc, settings, batch_size, cost)
             for name, acc in totals.items() if acc.num_records]
    reasons: dict[str, int] = {}
    for s in skipped:
        reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
    return {
        "grouping": grouping,
        "batch_size": batch_size,
        "has_cost_model": cost is not None,
        "settings": [{"name": s.name, "k": s.k, "prompt_lookup_min": s.prompt_lookup_min,
                      "prompt_lookup_max": s.prompt_lookup_max} for s in settings],
        "num_replayed": sum(acc.num_records for acc in totals.values()),
        "num_skipped": len(skipped),
        "skipped_reasons": reasons,
        "skipped": skipped,
        "notes": [f"{f.label}: method {(f.config or {}).get('method')}: {note}; the tables "
                  "replay n-gram settings only and its own stats are not self-checked"
                  for f in files for note in [_whatif_note(f.config or {})] if note],
        "self_check": {"num_checked": len(checks),
                       "num_equal": sum(c["equal"] for c in checks),
                       "records": checks},
        "groups": rows,
    }


def _group_result(name: str, acc: _GroupAcc, settings: list[Setting], batch_size: int,
                  cost: CostModel | None) -> dict:
    ctx = round(acc.context_weight / acc.num_output_tokens) if acc.num_output_tokens else 0
    plain = simulate(acc.jobs, batch_size, cost) if cost is not None else 0.0
    configs = []
    for s in settings:
        st = acc.stats[s]
        num_decode = sum(st.k_histogram.values())
        speedup = (plain / simulate(acc.jobs, batch_size, cost, s)
                   if plain > 0 and num_decode else None)
        configs.append({
            "name": s.name,
            "mean_acceptance_length": _round(st.mean_acceptance_length),
            "acceptance_rate": _round(st.acceptance_rate),
            "tokens_per_decode_step": _round((acc.num_output_tokens - acc.num_answers)
                                             / num_decode if num_decode else None),
            "num_decode_steps": num_decode,
            "predicted_speedup": _round(speedup),
        })
    key = "predicted_speedup" if cost is not None else "tokens_per_decode_step"
    best = {"name": "none", "value": 1.0}
    for c in configs:
        if c[key] is not None and c[key] > best["value"]:
            best = {"name": c["name"], "value": c[key]}
    best["criterion"] = key
    return {"group": name, "num_records": acc.num_records, "num_answers": acc.num_answers,
            "num_output_tokens": acc.num_output_tokens, "mean_context_len": ctx,
            "configs": configs, "best": best}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
