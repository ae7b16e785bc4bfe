"""``specbatch run``: validate -> load -> generate -> write, with resume and clean interrupts.

Exit status: 0 done; 1 an I/O error while running (finished records are kept); 2 bad input or
options, found before anything is generated (a bad record with ``--on-error fail``, an unknown
model, an output that cannot be written, a saved config that differs); 130 interrupted by
SIGINT / SIGTERM (finished records are kept; rerun the same command to resume). Every one of
these prints one ``error:`` line per problem on stderr, never a traceback.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from specbatch.config import EngineConfig, SamplingParams, SpecConfig

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_ERRORS_SHOWN = 20


@dataclass(frozen=True)
class RunOptions:
    input_path: str
    output_path: str
    model: str | None
    cache_dir: str | None
    sampling: SamplingParams
    spec: SpecConfig
    engine: EngineConfig
    run_seed: int = 0
    prompt_field: str | None = None
    id_field: str | None = None
    split: str | None = None
    limit: int | None = None
    on_error: str = "fail"
    resume: bool = False
    force: bool = False
    progress: bool = True
    template: str | None = None  # renders the user message from record fields
    recipe: dict | None = None  # {"name", "version"} of the recipe the options came from
    plan_only: bool = False  # --method auto: print the plan and exit


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _report_errors(errors, on_error: str, level: str = "error", can_skip: bool = True) -> None:
    """One line per bad record (the first ``MAX_ERRORS_SHOWN``). level: ``error`` when they stop
    the run, ``warning`` when ``--on-error skip`` leaves them out and the run goes on.
    can_skip: whether the command has ``--on-error skip`` to suggest (``bench`` has not)."""
    for e in errors[:MAX_ERRORS_SHOWN]:
        _err(f"{level}: {e}")
    if len(errors) > MAX_ERRORS_SHOWN:
        _err(f"... and {len(errors) - MAX_ERRORS_SHOWN} more")
    if on_error == "fail":
        _err(f"{len(errors)} bad record(s); nothing was generated. Fix them"
             + (", or pass --on-error skip to run the others." if can_skip else "."))


def _os_error(e: OSError) -> str:
    """``[Errno 2] No such file ...: '/x'`` -> ``/x: No such file or directory``."""
    where = e.filename if e.filename is not None else ""
    return f"{where}: {e.strerror}" if where and e.strerror else str(e)


@dataclass
class _Job:
    """What an interrupt needs to report: set as the run gets that far."""

    num_records: int = 0
    writer: object = None
    bar: object = None
    done_before: set = field(default_factory=set)


def load_records(opts) -> tuple[list, list]:
    """Read and validate INPUT (no model needed); apply ``--limit``."""
    from specbatch.io.records import read_records

    records, errors = read_records(opts.input_path, prompt_field=opts.prompt_field,
                                   id_field=opts.id_field, split=opts.split,
                                   defaults=opts.sampling, template=opts.template)
    if opts.limit is not None:
        records = records[:opts.limit]
        errors = [e for e in errors if e.line == 0 or not records or e.line <= records[-1].line]
    return records, errors


def run_job(opts: RunOptions) -> int:
    """Run the job; returns the exit status (see the module docstring). SIGINT (and SIGTERM,
    which the CLI turns into SIGINT's ``KeyboardInterrupt``) stops it cleanly at any point."""
    job = _Job()
    try:
        return _run_job(opts, job)
    except KeyboardInterrupt:
        return _interrupted(job)


def _interrupted(job: _Job) -> int:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup
        signal.signal(sig, signal.SIG_IGN)
    if job.bar is not None:
        job.bar.close()
    if job.writer is None:
        _err("\ninterrupted before generation started; nothing was written.")
        return EXIT_INTERRUPTED
    job.writer.close()  # fsync what is finished
    num_done = len(job.writer.done_indices())
    _err(f"\ninterrupted: {num_done} of {job.num_records} records are saved in "
         f"{job.writer.work_path} ({num_done - len(job.done_before)} new in this run).\n"
         "Rerun the same command to resume.")
    return EXIT_INTERRUPTED


def _run_job(opts: RunOptions, job: _Job) -> int:
    records, errors = load_records(opts)
    if any(e.line == 0 for e in errors):  # the whole file: one line says it
        for e in errors:
            _err(f"error: {e}")
        return EXIT_BAD_INPUT
    if not records:
        _report_errors(errors, "skip")
        _err("error: no valid records; nothing to run.")
        return EXIT_BAD_INPUT
    if errors and opts.on_error == "fail":
        _report_errors(errors, "fail")
        return EXIT_BAD_INPUT

    from specbatch.io.records import RecordError, order_warning

    if (warning := order_warning(records)) is not None:
        _err(f"warning: {warning}")
    from specbatch.io.writer import OutputWriter, check_output_path

    try:  # before the model loads: a wrong output path should not cost a load
        check_output_path(opts.output_path, opts.input_path,
                          force=None if opts.plan_only else opts.force)
    except ValueError as e:
        _err(f"error: {e}")
        return EXIT_BAD_INPUT

    from specbatch.models.loader import load_model
    from specbatch.models.registry import DEFAULT_MODEL
    from specbatch.pipeline import (PromptRenderer, Throughput, build_engine, fit_engine_config,
                                    generate_records, memory_summary)

    t0 = time.perf_counter()
    try:
        loaded = load_model(opts.model or DEFAULT_MODEL, dtype=opts.engine.dtype,
                            device=opts.engine.device, cache_dir=opts.cache_dir)
    except ValueError as e:
        _err(f"error: {e}")
        return EXIT_BAD_INPUT
    except OSError as e:
        _err(f"error: cannot load model {opts.model or DEFAULT_MODEL!r}: {_os_error(e)}")
        return EXIT_BAD_INPUT
    draft = None
    if opts.spec.method in ("draft", "auto") and opts.spec.draft_model is not None:
        from specbatch.spec_decode.draft import load_draft_model

        try:
            draft = load_draft_model(opts.spec.draft_model, loaded, opts.engine.dtype,
                                     opts.engine.device, opts.cache_dir)
        except (ValueError, OSError) as e:
            why = e if isinstance(e, ValueError) else _os_error(e)
            _err(f"error: {why}" if str(why).startswith("draft model ")
                 else f"error: draft model {opts.spec.draft_model!r}: {why}")
            return EXIT_BAD_INPUT
    load_s = time.perf_counter() - t0
    renderer = PromptRenderer(loaded.tokenizer)
    max_model_len = loaded.max_model_len
    if opts.engine.max_model_len is not None:
        max_model_len = min(max_model_len, opts.engine.max_model_len)

    from specbatch.io.records import check_lengths, check_token_ids

    model_errors = (check_lengths(records, renderer.count_tokens, max_model_len,
                                  str(opts.input_path), tokenizer=loaded.tokenizer)
                    + check_token_ids(records, loaded.model.config.vocab_size,
                                      str(opts.input_path)))
    if model_errors and opts.on_error == "fail":
        _report_errors(errors + model_errors, "fail")
        return EXIT_BAD_INPUT
    errors += model_errors
    bad_lines = {e.line for e in model_errors}  # records this model cannot run
    skipped = [r.index for r in records if r.line in bad_lines]

    config = {
        "input": str(Path(opts.input_path).resolve()),
        "input_sha256": _input_digest(opts.input_path),
        "model": loaded.model_id,
        "dtype": opts.engine.dtype,
        "method": opts.spec.method,
        "k": opts.spec.k,
        "prompt_lookup_min": opts.spec.prompt_lookup_min,
        "prompt_lookup_max": opts.spec.prompt_lookup_max,
        **({"draft_model": draft.model_id} if draft is not None else {}),
        "sampling": opts.sampling.to_dict(),
        "seed": opts.run_seed,
        "prompt_field": opts.prompt_field,
        "template": opts.template,
        "id_field": opts.id_field,
        "split": opts.split,
        "limit": opts.limit,
        "max_model_len": max_model_len,
        "recipe": opts.recipe,
    }
    job.num_records = len(records)
    if opts.plan_only:
        if opts.spec.method != "auto":
            _err("error: --plan-only needs --method auto")
            return EXIT_BAD_INPUT
        from specbatch.plan.planner import prepare_auto

        skip = set(skipped)
        todo = [r for r in records if r.index not in skip]
        engine_config = fit_engine_config(opts.engine, todo, renderer, max_model_len,
                                          loaded.model,
                                          draft.model if draft is not None else None, echo=_err)
        engine = build_engine(loaded.model, opts.spec, engine_config, loaded.eos_token_ids,
                              max_model_len, renderer.detokenize,
                              draft_model=draft.model if draft is not None else None)
        prepare_auto(engine, todo, renderer, opts.spec,
                     engine_config, loaded.model_id, opts.cache_dir, echo=_err,
                     draft_model_id=draft.model_id if draft is not None else "")
        return EXIT_OK
    try:
        writer = OutputWriter(opts.output_path, config, resume=opts.resume, force=opts.force,
                              num_records=len(records))
        writer.write_errors(errors)
    except ValueError as e:
        _err(f"error: {e}")
        return EXIT_BAD_INPUT
    except OSError as e:
        _err(f"error: cannot write the output: {_os_error(e)}")
        return EXIT_BAD_INPUT
    job.writer = writer
    if errors:
        _report_errors(errors, "skip", level="warning")
        _err(f"skipping {len(errors)} bad record(s); listed in {writer.errors_path}")
    done = job.done_before = writer.done_indices()
    skip = set(skipped)
    todo = [r for r in records if r.index not in done and r.index not in skip]
    if done:
        _err(f"resuming: {len(done)} of {len(records)} records already done in "
             f"{writer.work_path}")

    engine_config = fit_engine_config(opts.engine, todo, renderer, max_model_len, loaded.model,
                                      draft.model if draft is not None else None, echo=_err)
    engine = build_engine(loaded.model, opts.spec, engine_config, loaded.eos_token_ids,
                          max_model_len, renderer.detokenize,
                          draft_model=draft.model if draft is not None else None)
    if done and hasattr(engine.proposer, "add_finished"):  # suffix: re-index finished outputs
        from specbatch.spec_decode.suffix import finished_outputs

        engine.proposer.add_finished(finished_outputs(writer.finished_records()))
    plan = None
    if opts.spec.method == "auto":
        from specbatch.plan.planner import prepare_auto

        plan = prepare_auto(engine, todo, renderer, opts.spec, engine_config, loaded.model_id,
                            opts.cache_dir, echo=_err,
                            draft_model_id=draft.model_id if draft is not None else "")
    tput = Throughput()
    by_category: dict[str, list] = defaultdict(list)
    failed = []  # records written with an ``error`` (a NaN, a later turn past the context)
    bar = job.bar = _progress(len(records), len(done) + len(skip), opts.progress,
                              warmup=engine_config.max_batch_size)

    def on_tokens(n, stats):
        tput.add(n, stats)

    try:
        for rec, out in generate_records(engine, renderer, todo, opts.run_seed, on_tokens,
                                         plan=plan):
            writer.write(rec.index, {**rec.fields, **out})
            by_category[str(rec.fields.get("category", ""))].append(out)
            if "error" in out:
                failed.append(RecordError(str(opts.input_path), rec.line, rec.id, out["error"]))
            if bar is not None:
                mal = tput.stats.mean_acceptance_length
                bar.set_postfix_str(f"{tput.tokens_per_second:.1f} tok/s"
                                    + (f", accept len {mal:.2f}" if mal else ""), refresh=False)
                bar.update(1)
        if bar is not None:
            bar.close()
        n = writer.finish(skipped=skipped)
    except OSError as e:  # disk full, folder removed under us: what is finished is kept
        if bar is not None:
            bar.close()
        _err(f"error: writing the output failed: {_os_error(e)}. Finished records are kept in "
             f"{writer.work_path}; free the space and rerun the same command to resume.")
        return EXIT_FAILED
    elapsed = time.perf_counter() - tput.start
    # the result goes to stdout (``specbatch run ... > log`` keeps it); progress and warnings
    # stay on stderr
    click.echo(f"wrote {n} records to {opts.output_path} ({tput.num_tokens} new output tokens "
               f"in {elapsed:.1f} s, {tput.tokens_per_second:.1f} tok/s; model load "
               f"{load_s:.1f} s)")
    if failed:  # written, with finish_reason "error", but the user must hear of them
        _report_errors(failed, "skip", level="warning")
        _err(f"{len(failed)} record(s) stopped with an error; their output so far is written "
             "with finish_reason \"error\" and an \"error\" field")
    click.echo(summary_table(by_category))
    click.echo(memory_summary(engine))
    return EXIT_OK


def summary_table(by_category: dict[str, list[dict]]) -> str:
    """Per-category totals of the records generated in this run (input ``category`` field)."""
    from specbatch.spec_decode.stats import SpecStats

    lines = [f"{'category':<16}{'records':>8}{'out tok':>9}{'steps':>8}{'tok/step':>9}"
             f"{'accept len':>11}{'accept rate':>12}"]
    groups = dict(sorted(by_category.items()))
    if len(groups) > 1:
        groups["(all)"] = [o for outs in by_category.values() for o in outs]
    for cat, outs in groups.items():
        s = SpecStats()
        for o in outs:
            d = o["spec"]
            s.merge(SpecStats(num_steps=d["num_steps"], num_drafts=d["num_drafts"],
                              num_draft_tokens=d["num_draft_tokens"],
                              num_accepted_tokens=d["num_accepted_tokens"]))
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        mal, rate = s.mean_acceptance_length, s.acceptance_rate
        lines.append(f"{cat or '-':<16}{len(outs):>8}{tokens:>9}{s.num_steps:>8}"
                     f"{tokens / max(s.num_steps, 1):>9.2f}"
                     f"{_or_dash(mal):>11}{_or_dash(rate):>12}")
    return "\n".join(lines)


def _or_dash(x: float | None) -> str:
    """``0.00`` is a measurement (drafts, none accepted); ``-`` means nothing was drafted."""
    return "-" if x is None else f"{x:.2f}"


def _progress(total: int, initial: int, enabled: bool, warmup: int = 1):
    """A tqdm bar over records on stderr. The time left is shown only once ``warmup`` records
    (a batch) finished in this run, and from the mean rate since the start: the first records
    finish after the prefill of the whole batch, and extrapolating from them (tqdm's default)
    once said 2:24:13 for a job that took 22 minutes."""
    if not enabled:
        return None
    from tqdm import tqdm

    class _Bar(tqdm):
        @property
        def format_dict(self):
            d = super().format_dict
            if d["n"] - d["initial"] < min(warmup, d["total"] - d["initial"]):
                d["bar_format"] = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<?{postfix}]"
            return d

    return _Bar(total=total, initial=initial, unit="rec", file=sys.stderr, dynamic_ncols=True,
                smoothing=0)


def _input_digest(path: str) -> str:
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


__all__ = ["RunOptions", "run_job", "summary_table", "replace"]
