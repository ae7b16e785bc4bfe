"""``specbatch run``: validate -> load -> generate -> write, with resume and clean interrupts.

Exit status: 0 done; 1 an I/O error while running (finished records are kept); 2 bad input or
options, found before anything is generated (a bad record with ``--on-error fail``, an unknown
model, an output that cannot be written, a saved config that differs); 130 interrupted by
SIGINT / SIGTERM (finished records are kept; rerun the same command to resume). Every one of
these prints one ``error:`` line per problem on stderr, never a traceback.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from specbatch import methods
from specbatch.commands.common import JobOptions
from specbatch.config import EngineConfig, SamplingParams, SpecConfig

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


@dataclass(frozen=True, kw_only=True)
class RunOptions(JobOptions):
    output_path: str
    spec: SpecConfig
    on_error: str = "fail"
    resume: bool = False
    force: bool = False
    progress: bool = True
    recipe: dict | None = None  # {"name", "version"} of the recipe the options came from
    plan_only: bool = False  # --method auto: print the plan and exit
    ray: bool = False  # spread the job over Ray Data replicas (``specbatch.ray``)
    ray_address: str | None = None  # None: start a local Ray
    replicas: int = 1
    input_format: str = "auto"  # records | openai-batch | auto (detected per line)
    progress_interval: float = 10.0  # seconds between plain progress lines (stderr not a tty)
    input_data: bytes | None = None  # INPUT ``-``: standard input, read once (``command``)


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def busy_machine_warning() -> str | None:
    """A one-line warning when other work holds the CPUs (``cpu_threads.other_load``: what
    runs beside this job now, at least ``BUSY_SHARE`` of the usable CPUs: the same measure that
    makes the CLI choose passive waiting) and OpenMP threads still spin-wait (a wait policy set
    by hand, or torch loaded before the choice): their spinning threads and ours slow each
    other a lot. None on a quieter machine, where the OS says nothing of its load, where
    threads wait passively, or where the job's ``ThreadGovernor`` fits its spinning threads to
    the neighbours (the ``cpu:`` line says which)."""
    from specbatch import cpu_threads

    if (os.environ.get("OMP_WAIT_POLICY", "").lower() == "passive"
            or cpu_threads.governor is not None):
        return None
    load, cpus = cpu_threads.other_load(), cpu_threads.usable_cpus()
    if load is None or load < cpu_threads.BUSY_SHARE * cpus:
        return None
    return (f"the machine is busy ({cpu_threads.holds(load, cpus)}): "
            "OpenMP threads spin-wait, so several jobs on the same cores slow each other a "
            "lot; run one job at a time, or set OMP_WAIT_POLICY=PASSIVE")


def warn_if_busy() -> None:
    """Log ``busy_machine_warning()``, if any, on the ``specbatch`` logger (where the startup
    lines, ``loading model ...``, go): ``specbatch run`` and ``bench`` call it before the load."""
    if (warning := busy_machine_warning()) is not None:
        logging.getLogger("specbatch").warning(warning)


def _report_errors(errors, on_error: str, level: str = "error", can_skip: bool = True,
                   none_valid: bool = False) -> None:
    """Print ``io.records.error_lines`` to stderr (none_valid: no record can run)."""
    from specbatch.io.records import error_lines

    for line in error_lines(errors, on_error, level, can_skip, none_valid):
        _err(line)


def _os_error(e: OSError) -> str:
    from specbatch.llm import os_error_text

    return os_error_text(e)


@dataclass
class _Job:
    """What an interrupt needs to report: set as the run gets that far."""

    num_records: int = 0
    writer: object = None
    bar: object = None
    done_before: set = field(default_factory=set)
    lock: object = None  # ``io.writer.OutLock``, taken before the model loads
    from_stdin: bool = False  # INPUT ``-``: a resume needs the same standard input again
    force: bool = False  # ``--force``: the same command would start over, not resume


def load_records(opts) -> tuple[list, list]:
    """Read and validate INPUT (no model needed); apply ``--limit``."""
    from specbatch.io.records import read_records

    records, errors = read_records(opts.input_path, prompt_field=opts.prompt_field,
                                   id_field=opts.id_field, split=opts.split,
                                   defaults=opts.sampling, template=opts.template,
                                   input_format=getattr(opts, "input_format", "auto"),
                                   data=getattr(opts, "input_data", None))
    if opts.limit is not None and len(records) >= opts.limit:
        # the lines after the Nth valid record are not read for this job: their errors are not
        # its errors; without a cut every bad line is reported
        records = records[:opts.limit]
        errors = [e for e in errors if e.line == 0 or e.line <= records[-1].line]
    return records, errors


_STOP_REQUESTED: list[int] = []  # signals received (``request_stop``)


def request_stop(signum: int) -> None:
    """Record a stop signal, so the run loop stops at the next finished record even if the
    KeyboardInterrupt the handler raised was swallowed (raised inside a weakref callback)."""
    _STOP_REQUESTED.append(signum)


def run_job(opts: RunOptions) -> int:
    """Run the job; returns the exit status (see the module docstring). SIGINT (and SIGTERM,
    which the CLI turns into SIGINT's ``KeyboardInterrupt``) stops it cleanly at any point."""
    from specbatch.io.records import STDIN

    job = _Job(from_stdin=str(opts.input_path) == STDIN, force=opts.force)
    _STOP_REQUESTED.clear()
    try:
        return _run_job(opts, job)
    except KeyboardInterrupt:
        return _interrupted(job)
    finally:
        if job.lock is not None:  # ended before its writer held OUT.lock: let it go
            job.lock.release()


def _interrupted(job: _Job) -> int:
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not cut the cleanup
        signal.signal(sig, signal.SIG_IGN)
    if job.bar is not None:
        job.bar.close()
    if job.writer is None:
        _err("\ninterrupted before generation started; nothing was written.")
        return EXIT_INTERRUPTED
    job.writer.absorb_shards()  # what Ray replicas finished (none in a local run)
    job.writer.close()  # fsync what is finished
    num_done = len(job.writer.done_indices())
    _err(f"\ninterrupted: {num_done} of {job.num_records} records are saved in "
         f"{job.writer.work_path} ({num_done - len(job.done_before)} new in this run).\n"
         + ("Rerun the same command" + (" without --force" if job.force else "")
            + (" with the same standard input" if job.from_stdin else "") + " to resume."))
    return EXIT_INTERRUPTED


def _run_job(opts: RunOptions, job: _Job) -> int:
    from specbatch.io.writer import OutputWriter, check_output_path

    if (getattr(opts, "input_data", None) is None and opts.input_path != "-"
            and not Path(opts.input_path).exists()):  # before OUT: a finished OUT hid it
        _err(f"error: {opts.input_path}: no such file or folder")
        return EXIT_BAD_INPUT
    try:  # then: a wrong output path is one line, before any record's errors or a model load
        check_output_path(opts.output_path, opts.input_path,
                          force=None if opts.plan_only else opts.force)
    except ValueError as e:
        _err(f"error: {e}")
        return EXIT_BAD_INPUT
    records, errors = load_records(opts)
    if any(e.line == 0 for e in errors):  # the whole file: one line says it
        for e in errors:
            _err(f"error: {e}")
        return EXIT_BAD_INPUT
    if not records:
        _report_errors(errors, opts.on_error, none_valid=True)
        return EXIT_BAD_INPUT
    if errors and opts.on_error == "fail":
        _report_errors(errors, "fail")
        return EXIT_BAD_INPUT
    if errors:  # --on-error skip: said now, not after the model load (seconds to minutes)
        _report_errors(errors, "skip", level="warning")

    from specbatch.io.records import RecordError, greedy_samples_warning, order_warning

    for warning in (order_warning(records), greedy_samples_warning(records)):
        if warning is not None:
            _err(f"warning: {warning}")

    if opts.ray:  # before the model loads: without Ray, say how to install it
        from specbatch.ray import RayUnavailable, import_ray

        try:
            import_ray()
        except RayUnavailable as e:
            _err(f"error: {e}")
            return EXIT_BAD_INPUT

    # --dtype auto for this model (its file's header; every Ray replica runs this choice)
    opts = replace(opts, engine=opts.engine.for_model(opts.model, opts.cache_dir))
    # the options known without the model: a resume with other options is refused before the
    # load (the writer checks the whole config again after it)
    config = {
        "input": (opts.input_path if job.from_stdin  # "-": no file to name
                  else str(Path(opts.input_path).resolve())),
        "input_sha256": _input_digest(opts.input_path, opts.input_data),
        "dtype": opts.engine.dtype,
        **({} if opts.engine.dtype_auto is None else {"dtype_auto": opts.engine.dtype_auto}),
        "method": opts.spec.method,
        "k": opts.spec.k,
        "prompt_lookup_min": opts.spec.prompt_lookup_min,
        "prompt_lookup_max": opts.spec.prompt_lookup_max,
        "sampling": opts.sampling.to_dict(),
        "seed": opts.run_seed,
        "prompt_field": opts.prompt_field,
        "template": opts.template,
        "id_field": opts.id_field,
        "split": opts.split,
        "limit": opts.limit,
        "recipe": opts.recipe,
        # the rows per step asked for: outputs do not depend on it, but suffix's and auto's
        # spec stats do (a resume at another batch would not be byte-identical), and
        # ``analyze --what-if`` predicts at it
        "max_batch_size": opts.engine.max_batch_size,
    }
    if not opts.plan_only:
        from specbatch.io.writer import OutLock, check_resume

        try:
            # OUT.lock from now: a run writing OUT, or one starting beside this one, is
            # refused before either loads its model
            job.lock = OutLock(opts.output_path)
            if not opts.force:
                check_resume(opts.output_path, config)
        except ValueError as e:
            _err(f"error: {e}")
            return EXIT_BAD_INPUT
        except OSError as e:
            _err(f"error: cannot write the output: {_os_error(e)}")
            return EXIT_BAD_INPUT

    if opts.cpu is not None:
        logging.getLogger("specbatch").info(opts.cpu.line())
    warn_if_busy()
    from specbatch.io.openai_batch import output_line
    from specbatch.llm import LLM, ModelLoadError
    from specbatch.ray import ReplicaFailed  # no Ray import: the error class only

    # with --ray the driver loads the model only to check the records (on its CPU: it may have
    # no GPU); the replicas generate
    engine = replace(opts.engine, device="cpu") if opts.ray else opts.engine
    try:
        llm = LLM.from_config(opts.model, opts.spec, engine, cache_dir=opts.cache_dir,
                              seed=opts.run_seed, echo=_err)
    except ModelLoadError as e:
        _err(f"error: {e}")
        return EXIT_BAD_INPUT
    from specbatch.pipeline import Throughput  # imports torch: after "loading model ..."

    if opts.calibration is not None:
        try:
            for line in llm.pin_calibration(opts.calibration):
                _err(f"warning: {line}")
        except ValueError as e:
            _err(f"error: --calibration {e}")
            return EXIT_BAD_INPUT

    from specbatch.commands.common import token_id_flag_error
    from specbatch.io.records import input_name

    # a flag's bad token id: one line now, not one per record that inherits it
    if (why := token_id_flag_error(opts.sampling, llm.loaded.model.config.vocab_size)):
        _err(f"error: {why}")
        return EXIT_BAD_INPUT
    model_errors = llm.check_records(records, input_name(opts.input_path))
    bad_lines = {e.line for e in model_errors}  # records this model cannot run
    skipped = [r.index for r in records if r.line in bad_lines]
    if len(skipped) == len(records):  # this model can run none of them: nothing to skip to
        if errors and opts.on_error == "skip":  # the input's own were said before the load
            from specbatch.io.records import NO_VALID_RECORDS

            _report_errors(model_errors, "skip")
            _err(NO_VALID_RECORDS)
        else:
            _report_errors(errors + model_errors, opts.on_error, none_valid=True)
        return EXIT_BAD_INPUT
    if model_errors and opts.on_error == "fail":
        _report_errors(errors + model_errors, "fail")
        return EXIT_BAD_INPUT
    errors = sorted(errors + model_errors, key=lambda e: e.line)  # OUT.errors.jsonl in file order

    config = {**config, "model": llm.model_id, "max_model_len": llm.max_model_len,
              **({"draft_model": llm.draft_model_id} if llm.draft is not None else {})}
    job.num_records = len(records)
    if opts.plan_only:
        if opts.spec.method != "auto":
            _err("error: --plan-only needs --method auto")
            return EXIT_BAD_INPUT
        skip = set(skipped)
        # the plan is the command's result: stdout (``> plan.txt``); the notes stay on stderr
        llm.prepare([r for r in records if r.index not in skip], echo_plan=click.echo)
        return EXIT_OK
    try:
        writer = OutputWriter(opts.output_path, config, resume=opts.resume, force=opts.force,
                              num_records=len(records), lock=job.lock)
        writer.write_errors(errors)
    except ValueError as e:
        _err(f"error: {e}")
        return EXIT_BAD_INPUT
    except OSError as e:
        _err(f"error: cannot write the output: {_os_error(e)}")
        return EXIT_BAD_INPUT
    job.writer = writer
    if model_errors:  # those of the input were printed before the model loaded
        _report_errors(model_errors, "skip", level="warning")
    if errors:
        _err(f"skipping {len(errors)} bad record(s); listed in {writer.errors_path}")
    done = job.done_before = writer.done_indices()
    skip = set(skipped)
    todo = [r for r in records if r.index not in done and r.index not in skip]
    if done:
        _err(f"resuming: {len(done)} of {len(records)} records already done in "
             f"{writer.work_path}")

    from specbatch.progress import Progress

    progress = None  # made once the engine is ready (after auto's calibration)
    journal = None  # --method auto: its decision journal (``auto.journal``)
    schedules: dict[int, list] = {}  # --method suffix: where each record's answers ran

    def on_tokens(n, stats):
        tput.add(n, stats)
        if progress is not None:
            progress.answer_done(n, stats)

    def on_step(num_tokens):
        if progress is not None:
            progress.tick(num_tokens)

    if opts.ray:
        from specbatch.ray import generate_on_ray

        results = generate_on_ray(todo, model=opts.model, spec=opts.spec, engine=opts.engine,
                                  replicas=opts.replicas, address=opts.ray_address,
                                  cache_dir=opts.cache_dir, seed=opts.run_seed,
                                  out_path=str(opts.output_path), num_records=len(records),
                                  on_tokens=on_tokens)
    else:  # with --method auto: calibrates, plans, prints the plan
        replay = _replay(opts, writer, done)
        auto = opts.spec.method == "auto"
        if auto and writer.resumed and writer.fits_path.exists():
            try:  # the fits the interrupted job decided with, whatever the cache holds now
                llm.use_job_fits(str(writer.fits_path))
            except ValueError as e:
                _err(f"warning: {e}; the spec counters of the records run after the resume "
                     "may differ from an uninterrupted run's (outputs do not)")
        if replay is not None:  # the whole job's batch size, its records in their order
            job_records = [r for r in records if r.index not in skip]
            prepared = llm.prepare(job_records, engine=llm.fit_engine_config(job_records))
        else:
            prepared = llm.prepare(todo)
        proposer = prepared.engine.proposer
        resume = methods.get(opts.spec.method).resume  # suffix: re-index finished outputs
        if done and replay is None and resume is not None:
            # no schedule to replay (a work file of an older version, or --ray's): the
            # finished outputs join the index first
            resume(proposer, writer.finished_records())
        if auto:
            journal = _decision_journal(writer, prepared, done, replay)
        results = prepared.run(opts.run_seed, on_tokens, on_step, replay=replay,
                               schedules=schedules if _replays(opts) else None)
    tput = Throughput()
    by_category: dict[str, list] = defaultdict(list)
    for line in writer.finished_records() if done else ():  # the summary covers the whole job
        if "spec" in line and "usage" in line:  # not an OpenAI batch response line
            by_category[str(line.get("category", ""))].append(line)
    failed = []  # records written with an ``error`` (a NaN, a later turn past the context)
    bar = progress = job.bar = (Progress(  # the records run: not those --on-error skip left out
        len(records) - len(skip), len(done),
        max_tokens=max((r.sampling.max_tokens * r.sampling.n * len(r.turns or [None])
                        for r in todo), default=1),
        interval=opts.progress_interval) if opts.progress else None)
    try:
        for rec, out in results:
            if journal is not None:  # the journal covers every step of what the work file has
                journal.flush()
            writer.write(rec.index, output_line(rec, out, llm.model_id),
                         schedule=schedules.pop(rec.index, None))
            if journal is not None:
                journal.written(rec.index)
            if _STOP_REQUESTED:  # a SIGTERM whose KeyboardInterrupt was swallowed
                raise KeyboardInterrupt
            by_category[str(rec.fields.get("category", ""))].append(out)
            if "error" in out:
                failed.append(RecordError(input_name(opts.input_path), rec.line, rec.id,
                                          out["error"], rec.unit))
            if bar is not None:
                bar.record_done(out.get("usage", {}).get("completion_tokens"))
        if bar is not None:
            bar.close()
        if not opts.ray and prepared.engine.replay_mismatches:
            _err(f"warning: resume: {prepared.engine.replay_mismatches} finished answer(s) did "
                 "not replay at their recorded step and row; the spec counters of the records "
                 "run after the resume may differ from an uninterrupted run's (outputs do not)")
        policy = getattr(prepared.plan, "policy", None) if not opts.ray else None
        if policy is not None and policy.forced_mismatches:
            _err(f"warning: resume: {policy.forced_mismatches} journaled draft choice(s) did "
                 f"not fit the rows they were replayed for ({writer.decisions_path}); the spec "
                 "counters of the records run after the resume may differ from an "
                 "uninterrupted run's (outputs do not)")
        writer.absorb_shards()  # Ray replicas' own work files (none in a local run)
        if journal is not None:
            journal.close()
        n = writer.finish(skipped=skipped)
    except ReplicaFailed as e:  # --ray: a replica died and Ray gave up on it
        if bar is not None:
            bar.close()
        writer.absorb_shards()
        writer.close()
        _err(f"error: the job on Ray stopped: {e}. {len(writer.done_indices())} of "
             f"{len(records)} records are saved in {writer.work_path}; rerun the same command "
             "to resume.")
        return EXIT_FAILED
    except OSError as e:  # disk full, folder removed under us: what is finished is kept
        if bar is not None:
            bar.close()
        _err(f"error: writing the output failed: {_os_error(e)}. Finished records are kept in "
             f"{writer.work_path}; free the space and rerun the same command to resume.")
        return EXIT_FAILED
    elapsed = time.perf_counter() - tput.start
    # the result goes to stdout (``specbatch run ... > log`` keeps it); progress and warnings
    # stay on stderr
    noun = "record" if n == 1 else "records"
    click.echo(f"wrote {n} {noun} to {opts.output_path} ({tput.num_tokens} new output tokens "
               f"in {elapsed:.1f} s, {tput.tokens_per_second:.1f} tok/s; model load "
               f"{llm.load_seconds:.1f} s)")
    if failed:  # written, with finish_reason "error", but the user must hear of them
        _report_errors(failed, "skip", level="warning")
        _err(f"{len(failed)} record(s) stopped with an error; their output so far is written "
             "with finish_reason \"error\" and an \"error\" field")
    click.echo(summary_table(by_category))
    if llm.engine is not None:  # with --ray the engines live in the replicas
        click.echo(llm.memory_summary())
    return EXIT_OK


def _decision_journal(writer, prepared, done: set, replay):
    """``--method auto``: keep the job's fits beside OUT (``OUT.calibration.json``) and open its
    decision journal (``auto.journal``, ``OUT.decisions.jsonl``), which a resumed job replays
    (``AdaptivePolicy.force``). Returns the journal, or None when it cannot be kept (a warning
    says why; outputs are the same, a later resume's stats may differ)."""
    from specbatch.auto.costmodel import save_job_fits
    from specbatch.auto.journal import DecisionJournal

    target, draft = prepared.fits
    try:
        save_job_fits(writer.fits_path, target, draft)
    except OSError as e:
        _err(f"warning: cannot keep the job's calibration: {_os_error(e)}")
    resume = writer.resumed and (not done or replay is not None)
    if writer.resumed and done and not writer.decisions_path.exists():
        _err(f"warning: resume: no decision journal ({writer.decisions_path}, written since "
             "specbatch keeps one); the spec counters of the records run after the resume may "
             "differ from an uninterrupted run's (outputs do not)")
    try:
        journal = DecisionJournal(writer.decisions_path, resume=resume, done=done)
    except ValueError as e:
        _err(f"warning: resume: {e}; the spec counters of the records run after the resume may "
             "differ from an uninterrupted run's (outputs do not)")
        writer.decisions_path.unlink(missing_ok=True)
        journal = DecisionJournal(writer.decisions_path, resume=False, done=done)
    except OSError as e:
        _err(f"warning: cannot keep auto's decision journal: {_os_error(e)}")
        return None
    journal.attach(prepared.plan.policy)
    prepared.engine.proposer.journal = journal
    return journal


def _replays(opts: RunOptions) -> bool:
    """Whether the method's drafts depend on the schedule, so its records' schedules are kept
    and a resume replays them (``methods.Method.replay_schedule``: suffix)."""
    return not opts.ray and methods.get(opts.spec.method).replay_schedule


def _replay(opts: RunOptions, writer, done: set) -> dict | None:
    """A resumed ``--method suffix`` or ``auto`` job: index -> the schedule of each finished
    record, when every one has one (``pipeline.generate_records`` replays them), else None. A
    suffix record's drafts depend on what the job-wide index holds at each of its steps and on
    the rows beside it, i.e. on the schedule, and auto's choices are joint over a step's rows
    (its decision journal, ``auto.journal``, replays those of the records in flight);
    ``ngram`` and ``none`` drafts depend on neither."""
    if not done or not _replays(opts):
        return None
    schedules = writer.finished_schedules()
    if not done <= set(schedules):
        return None
    return {i: schedules[i] for i in done}


def summary_table(by_category: dict[str, list[dict]]) -> str:
    """Per-category totals of the job's records (input ``category`` field): after a resume,
    those of the earlier runs too (the ``wrote`` line above it counts this run's tokens)."""
    from specbatch.spec_decode.stats import SpecStats

    lines = [f"{'category':<16}{'records':>8}{'out tok':>9}{'steps':>8}{'tok/step':>9}"
             f"{'accept len':>11}{'accept rate':>12}"]
    groups = dict(sorted(by_category.items()))
    if len(groups) > 1:
        groups["(all)"] = [o for outs in by_category.values() for o in outs]
    for cat, outs in groups.items():
        s = SpecStats()
        for o in outs:
            s.merge(SpecStats.from_dict(o["spec"]))
        tokens = sum(o["usage"]["completion_tokens"] for o in outs)
        mal, rate = s.mean_acceptance_length, s.acceptance_rate
        lines.append(f"{cat or '-':<16}{len(outs):>8}{tokens:>9}{s.num_steps:>8}"
                     f"{tokens / max(s.num_steps, 1):>9.2f}"
                     f"{_or_dash(mal):>11}{_or_dash(rate):>12}")
    return "\n".join(lines)


def _or_dash(x: float | None) -> str:
    """``0.00`` is a measurement (drafts, none accepted); ``-`` means nothing was drafted."""
    return "-" if x is None else f"{x:.2f}"


def _input_digest(path: str, data: bytes | None = None) -> str:
    """sha256 of INPUT's bytes (of every file of a folder, in name order); ``data``: those of
    standard input (INPUT ``-``), already read."""
    if data is not None:
        return hashlib.sha256(data).hexdigest()
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def command(given: frozenset[str], input_path, output, recipe, template, model, dtype, device,
            max_batch_size, max_model_len, no_prefix_caching, threads, cache_dir, method,
            draft_model, k, prompt_lookup_min, prompt_lookup_max, max_tokens, min_tokens,
            temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, logprobs,
            prompt_field, id_field, split, limit, on_error, resume, force, no_progress,
            progress_interval, calibration, plan_only, use_ray, ray_address, replicas,
            input_format, **more_sampling) -> int:
    """``specbatch run`` from its parsed flags (``cli.run``; ``recipe``: the loaded
    ``--recipe``, whose values were the flags' defaults; ``given``: the names of the flags set
    on the command line): check them and the model names before anything loads, build the
    configs, then ``run_job``. Returns the exit status. Raises ``click.UsageError`` (a bad or
    conflicting flag) and ``common.StopError`` (an unknown model), both exit 2."""
    from specbatch.commands.common import (as_flags, check_model, choose_threads,
                                           exit_from_signals, stop_strings)
    from specbatch.commands.common import more_sampling as sampling_fields

    cpu = choose_threads(threads)  # first: before anything imports torch
    if template is not None and prompt_field is not None:  # one from the recipe: the flag wins
        if ("template" in given) == ("prompt_field" in given):
            raise click.UsageError("--template and --prompt-field exclude each other")
        template, prompt_field = ((template, None) if "template" in given
                                  else (None, prompt_field))
    # before anything imports torch; --method none ignores a draft model, ngram refuses it below
    check_model(model)
    if draft_model is not None and methods.uses_draft_model(method):
        check_model(draft_model, draft=True)
    try:
        if template is not None:
            from specbatch.io.records import template_fields

            template_fields(template)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=None,
                                  max_tokens=max_tokens, min_tokens=min_tokens,
                                  stop=stop_strings(stop),
                                  stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                                  logprobs=logprobs, **sampling_fields(more_sampling))
        spec = SpecConfig(method=method, num_speculative_tokens=k,
                          prompt_lookup_min=prompt_lookup_min,
                          prompt_lookup_max=prompt_lookup_max, draft_model=draft_model)
        engine = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                              dtype=dtype, device=device,
                              prefix_caching=not no_prefix_caching)
    except ValueError as e:
        raise click.UsageError(as_flags(str(e))) from None
    if plan_only and method != "auto":  # before anything loads
        raise click.UsageError(f"--plan-only needs --method auto (got --method {method})")
    if calibration is not None and method != "auto":
        raise click.UsageError(f"--calibration needs --method auto (got --method {method})")
    if (ray_address is not None or "replicas" in given) and not use_ray:
        raise click.UsageError("--ray-address and --replicas need --ray")
    from specbatch.io.records import STDIN, read_stdin

    input_data = None
    if input_path == STDIN:  # read now, once: a pipe cannot be read again
        if output is None:
            raise click.UsageError("INPUT - (standard input) needs -o OUT.jsonl: there is no "
                                   "file name to name the output after")
        if sys.stdin is not None and sys.stdin.isatty():  # nothing piped: say what it waits for
            _err("reading JSONL records from standard input (the terminal); end with Ctrl-D")
        input_data = read_stdin()
    out = output or f"{Path(input_path).name.split('.')[0]}.out.jsonl"
    opts = RunOptions(input_path=input_path, output_path=out, model=model, cache_dir=cache_dir,
                      sampling=sampling, spec=spec, engine=engine, run_seed=seed,
                      prompt_field=prompt_field, id_field=id_field, split=split, limit=limit,
                      on_error=on_error, resume=resume, force=force, progress=not no_progress,
                      plan_only=plan_only, ray=use_ray, ray_address=ray_address,
                      replicas=replicas, input_format=input_format,
                      template=template, recipe=recipe.identity if recipe else None,
                      cpu=cpu, calibration=calibration, progress_interval=progress_interval,
                      input_data=input_data)
    exit_from_signals()
    return run_job(opts)


__all__ = ["RunOptions", "command", "run_job", "summary_table", "replace"]
