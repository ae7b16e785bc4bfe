"""Command line: ``specbatch run | bench``. Options map onto config fields; no logic here."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import click
from click.core import ParameterSource

from specbatch import methods
from specbatch.config import MAX_INT, MIN_INT, EngineConfig, SamplingParams, SpecConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")



class _MethodChoice(click.Choice):
    """``--method``'s choices: the registered methods (``specbatch.methods``) when the command
    line is parsed, auto (the default) first, so a method registered after import is one."""

    def __init__(self) -> None:
        super().__init__(())

    @property
    def choices(self):
        return ("auto", *(m for m in methods.names() if m != "auto"))

    @choices.setter
    def choices(self, value) -> None:
        pass

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class _UsageError(click.UsageError):
    """A usage error shown as one ``error:`` line and a hint, instead of click's usage block."""

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)
        if self.ctx is not None:
            click.echo(f"try '{self.ctx.command_path} --help'", file=file, err=file is None)


class _StopError(click.ClickException):
    """A problem found before anything loads that is not a malformed command line (an unknown
    model): one ``error:`` line on stderr, exit status 2, no usage hint."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


def _check_model(name: str | None, draft: bool = False) -> None:
    """Fail fast on a ``--model`` (None: the packaged default) or, with ``draft``, a
    ``--draft-model`` that names no registry model, ``.gguf`` file or model folder, or a registry
    model that is not installed: checked by ``models.registry.find_model`` before torch is
    imported (seconds; tens on a loaded machine). Raises ``_StopError`` (exit 2) with the
    one-line reason, naming the model."""
    from specbatch.models.registry import DEFAULT_MODEL, find_model

    name = name or DEFAULT_MODEL
    try:
        find_model(name)
    except ValueError as e:
        raise _StopError(f"draft model {name!r}: {e}" if draft else str(e)) from None


# config fields -> the flags that set them, for errors raised while building the configs
_FLAG_OF = {"num_speculative_tokens": "--k", "prompt_lookup_min": "--prompt-lookup-min",
            "prompt_lookup_max": "--prompt-lookup-max", "max_batch_size": "--max-batch-size",
            "max_model_len": "--max-model-len", "max_tokens": "--max-tokens",
            "min_tokens": "--min-tokens", "top_p": "--top-p", "top_k": "--top-k",
            "temperature": "--temperature", "draft_model": "--draft-model",
            "stop_token_ids": "--stop-token-id", "logprobs": "--logprobs", "dtype": "--dtype",
            "device": "--device",
            "n": "--n", "repetition_penalty": "--repetition-penalty", "min_p": "--min-p",
            "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}


def _version() -> str:
    """``specbatch.__version__``, marked ``(not installed)`` for a checkout run without
    installing (click's own lookup raises there); ``unknown (not installed)`` with neither."""
    from specbatch._version import package_version

    version, installed = package_version()
    return version if installed else f"{version or 'unknown'} (not installed)"


def _choose_threads(threads: int | None):
    """``cpu_threads.choose_threads`` (sets the OpenMP environment before torch loads): the
    ``ThreadChoice`` whose line the command prints before the model loads."""
    from specbatch.cpu_threads import choose_threads

    return choose_threads(threads)


def _stop_strings(stop: tuple[str, ...]) -> tuple[str, ...]:
    """``--stop`` values; an empty one is a usage error naming the flag (not the tuple)."""
    if "" in stop:
        raise click.UsageError("--stop '': expected a non-empty string")
    return tuple(stop)


def _as_flags(message: str) -> str:
    """``prompt_lookup_max=2: expected an integer >= prompt_lookup_min`` (a config field error)
    -> ``--prompt-lookup-max=2: expected an integer >= --prompt-lookup-min``."""
    return re.sub(r"\b[a-z_]+\b", lambda m: _FLAG_OF.get(m.group(0), m.group(0)), message)


@contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """Re-raise click's usage errors (bad flag, bad value, missing argument, unknown command,
    and our own ``click.UsageError``) as ``_UsageError``; click's ``main`` then shows them and
    exits 2 as usual. A bare ``specbatch`` still prints the help (``NoArgsIsHelpError``)."""
    keep = (_UsageError, *[c for c in [getattr(click.exceptions, "NoArgsIsHelpError", None)]
                           if c is not None])
    try:
        yield
    except keep:
        raise
    except click.UsageError as e:
        raise _UsageError(e.format_message(), e.ctx) from None


class _Group(click.Group):
    """The ``specbatch`` group: usage errors of it and of every subcommand are one line."""

    def make_context(self, info_name, args, parent=None, **extra) -> click.Context:
        with _one_line_usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx: click.Context):
        with _one_line_usage_errors():  # the subcommand parses its options in here
            return super().invoke(ctx)


def _spec_options(f):
    for opt in reversed([
        click.option("--method", type=_MethodChoice(),
                     default="auto", show_default=True,
                     help="Proposer: auto (prompt lookup with k chosen per bucket and step from "
                     "measured cost), none (plain decoding), ngram, draft (--draft-model), or suffix "
                     "(own text + outputs of the job's finished records)."),
        click.option("--draft-model", default=None, help="Draft model for --method draft "
                     "(or for auto to choose per row): registry name, .gguf path or HF folder "
                     "sharing the target's tokenizer. Refused with ngram; none ignores it."),
        click.option("--k", "--num-speculative-tokens", "k", type=click.IntRange(0, 32),
                     default=5, show_default=True,
                     help="Draft tokens per verify step (with auto: the most it may choose)."),
        click.option("--prompt-lookup-min", type=click.IntRange(1), default=2, show_default=True,
                     help="Shortest n-gram (tokens) the lookup matches."),
        click.option("--prompt-lookup-max", type=click.IntRange(1), default=4, show_default=True,
                     help="Longest n-gram (tokens) the lookup matches."),
    ]):
        f = opt(f)
    return f


def _model_options(f, batch: bool = True):
    """--model, --dtype, --device, --cache-dir and, with ``batch``, --max-batch-size and
    --max-model-len (what an engine is built with)."""
    opts = [
        click.option("--model", default=None, help="Registry name, .gguf path, HF folder, or "
                     "dummy:SHAPE[:SEED] (seeded random weights: docs/gpu.md) (default: "
                     "smollm2-135m)."),
        click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32", "float64",
                                                   "int8"]),
                     default="auto", show_default=True,
                     help="Weights and activations dtype. auto: the fastest batch-invariant "
                     "one for the model: on x86-64 CPUs with AVX2, int8 for a GGUF of Q4_1 / "
                     "Q8_0 / K-quant weights, else float32 (specbatch's C kernels); bfloat16 on GPUs. "
                     "int8 (CPU): float32, with a GGUF model's 4/8-bit weights multiplied by "
                     "activations rounded to 8 bits per block of 32, as llama.cpp does "
                     "(batch-invariant; not bit-equal to float32)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto",
                     show_default=True,
                     help="Where the model runs: auto picks cuda when a GPU is visible."),
    ]
    if batch:
        opts += [
            click.option("--max-batch-size", type=click.IntRange(1), default=16,
                         show_default=True, help="Rows decoded together (continuous batching)."),
            click.option("--max-model-len", type=click.IntRange(2), default=None,
                         help="Cap on prompt + output tokens (default: the model's context)."),
            click.option("--no-prefix-caching", is_flag=True,
                         help="Prefill every prompt from its first token (by default a prompt "
                         "starts after the longest prefix of it a cache row already holds, "
                         "e.g. a job's shared instruction; on the CPU kernels, where it "
                         "changes no output bit)."),
        ]
    if batch:  # calibrate follows OMP_NUM_THREADS
        opts.append(click.option("--threads", type=click.IntRange(1), default=None,
                                 help="CPU threads (default: OMP_NUM_THREADS, else one per "
                                 "usable CPU). When other work holds the CPUs, OpenMP threads "
                                 "wait passively instead of spinning (OMP_WAIT_POLICY set by "
                                 "you wins); the `cpu:` line says what was chosen."))
    opts.append(click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                             help="Where converted weights are cached (default: "
                             "$SPECBATCH_CACHE or ~/.cache/specbatch)."))
    for opt in reversed(opts):
        f = opt(f)
    return f


def _calibration_model_options(f):
    """``_model_options`` without the engine's --max-batch-size and --max-model-len: calibration
    times fixed shapes (``plan.costmodel.calibrate``)."""
    return _model_options(f, batch=False)


def _input_options(f):
    for opt in reversed([
        click.option("--prompt-field", default=None, help="Field holding the prompt."),
        click.option("--id-field", default=None, help="Field holding the record id."),
        click.option("--split", default=None, help="Split of a saved DatasetDict."),
        click.option("--limit", type=click.IntRange(1), default=None,
                     help="Only the first N valid records."),
    ]):
        f = opt(f)
    return f


def _sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True,
                     help="Most output tokens per answer (each turn of a turns record has its own)."),
        click.option("--min-tokens", type=click.IntRange(0), default=0, show_default=True,
                     help="Least output tokens per answer: EOS and stops cannot end it sooner."),
        click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True,
                     help="Sampling temperature; 0 = greedy (argmax)."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0,
                     show_default=True,
                     help="Nucleus sampling: keep the fewest tokens whose probability adds up "
                     "to P; 1 = off."),
        click.option("--top-k", type=click.IntRange(0), default=0, show_default=True,
                     help="Sample from the K most likely tokens only; 0 = off."),
        click.option("--seed", type=click.IntRange(MIN_INT, MAX_INT), default=0,
                     show_default=True,
                     help="Run seed; a record's seed is derived from it and the record id."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--stop-token-id", "stop_token_ids", type=int, multiple=True,
                     help="Stop token id (repeatable)."),
        click.option("--ignore-eos", is_flag=True, default=False,
                     help="Go on past EOS (up to --max-tokens); stop strings still end it."),
        click.option("--logprobs", type=click.IntRange(0, 20), default=None,
                     help="Return each token's logprob and the top-N alternatives."),
        click.option("--n", "n", type=click.IntRange(1, 1024), default=1, show_default=True,
                     help="Samples per prompt (output fields become lists when > 1)."),
        click.option("--repetition-penalty", type=click.FloatRange(0, min_open=True),
                     default=1.0, show_default=True, help="Divide (or, if negative, multiply) "
                     "the logit of every token in the prompt or output by it; 1 = off."),
        click.option("--presence-penalty", type=click.FloatRange(-2, 2), default=0.0,
                     show_default=True, help="Subtracted once from the logit of every token "
                     "already in the output."),
        click.option("--frequency-penalty", type=click.FloatRange(-2, 2), default=0.0,
                     show_default=True, help="Subtracted from a token's logit once per time it "
                     "is already in the output."),
        click.option("--min-p", type=click.FloatRange(0, 1), default=0.0, show_default=True,
                     help="Drop tokens less likely than min-p times the most likely one."),
        click.option("--json-schema", "json_schema", type=click.Path(dir_okay=False),
                     default=None, help="JSON schema FILE every output must follow (a "
                     "record's response_format overrides it)."),
    ]):
        f = opt(f)
    return f


def _more_sampling(extra: dict) -> dict:
    """SamplingParams fields from the options added after the first ten (``_sampling_options``):
    n, the penalties, min_p and ``--json-schema FILE`` (read and compiled here, so a bad schema
    is a usage error before anything loads). Raises ``click.UsageError``."""
    out = {k: extra[k] for k in ("n", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "min_p")}
    path = extra.get("json_schema")
    if path is not None:
        import json

        try:
            schema = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise click.UsageError(f"--json-schema {path}: cannot read a JSON schema: {e}")
        from specbatch.engine.grammar import check_schema

        try:
            check_schema(schema)
        except ValueError as e:
            raise click.UsageError(f"--json-schema {path}: {e}") from None
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": Path(path).stem, "schema": schema}}
    return out


class _StderrHandler(logging.Handler):
    """Prints the ``specbatch`` logger's records on stderr as the CLI's other lines: INFO as
    the bare message (progress: ``loading model ...``), other levels prefixed with the level
    (``warning: ...``). Writes through ``click.echo``, so it follows a replaced ``sys.stderr``
    (click's test runner, ``specbatch run ... 2> log``)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.levelno != logging.INFO:
                message = f"{record.levelname.lower()}: {message}"
            click.echo(message, err=True)
        except Exception:  # noqa: BLE001 -- logging's contract: report, never raise
            self.handleError(record)


def _log_to_stderr(ctx: click.Context, verbose: bool) -> None:
    """Show the ``specbatch`` logger (the library's progress and warnings) on stderr at INFO
    (DEBUG with ``--verbose``) for this command; undone when the command ends, so that a
    process that calls ``main`` (tests) finds the logger as it was."""
    log = logging.getLogger("specbatch")
    saved = log.level, log.propagate
    handler = _StderrHandler()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.propagate = False  # the root handler of --verbose would print each line again

    def restore() -> None:
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]

    ctx.call_on_close(restore)


@click.group(cls=_Group)
@click.version_option(_version(), prog_name="specbatch", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", is_flag=True, help="Log more (other libraries' INFO too).")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Offline batch text generation with speculative decoding."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    _log_to_stderr(ctx, verbose)
    if not verbose:  # our own progress bar is the one a user reads
        # through the environment, so that a run that stops at validation never imports them
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers reads it
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        if "transformers" in sys.modules:  # already imported (e.g. a test calling main)
            sys.modules["transformers"].utils.logging.disable_progress_bar()
        if "datasets" in sys.modules:
            sys.modules["datasets"].disable_progress_bars()


def _recipe_defaults(ctx: click.Context, param: click.Parameter, value: str | None):
    """``--recipe FILE`` (eager): the recipe's values become the other options' defaults, so a
    flag given on the command line wins and the built-in defaults fill the rest."""
    if value is None:
        return None
    from specbatch.recipe import load_recipe

    try:
        recipe = load_recipe(value)
    except ValueError as e:
        raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    ctx.default_map = {**(ctx.default_map or {}), **recipe.options}
    return recipe


def _given(ctx: click.Context, name: str) -> bool:
    return ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                              ParameterSource.ENVIRONMENT)


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path())
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="Output .jsonl or .parquet (default: INPUT stem + .out.jsonl).")
@click.option("--recipe", type=click.Path(dir_okay=False), default=None, is_eager=True,
              callback=_recipe_defaults,
              help="Job definition (recipes/*.toml); flags given here override its values.")
@click.option("--input-format", type=click.Choice(["auto", "records", "openai-batch"]),
              default="auto", show_default=True,
              help="openai-batch: lines are OpenAI batch requests (custom_id, url, body), "
              "answered in the OpenAI batch output format; auto: detected per line.")
@click.option("--template", default=None,
              help="Build each prompt (the user message of a chat) from record fields: "
              "'{field}' is replaced by the record's value. Recipes hold multi-line ones.")
@_model_options
@_spec_options
@_sampling_options
@_input_options
@click.option("--on-error", type=click.Choice(["fail", "skip"]), default="fail",
              show_default=True, help="Bad records: stop before generating, or skip them "
              "(listed in OUT.errors.jsonl).")
@click.option("--resume", is_flag=True, help="Continue from OUT.work.jsonl.")
@click.option("--force", is_flag=True, help="Start over even if earlier work or output exists.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--progress-interval", type=click.FloatRange(0, min_open=True), default=10.0,
              show_default=True, metavar="SECONDS",
              help="When stderr is not a terminal (a log file): seconds between plain "
              "progress lines (records, tokens, token rate, time left).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Step-cost fit for --method auto (`specbatch calibrate -o FILE`) instead of "
              "the one cached for this machine; nothing is measured.")
@click.option("--plan-only", is_flag=True,
              help="With --method auto: print the plan (buckets, k, predicted speedup) and exit.")
@click.option("--ray", "use_ray", is_flag=True,
              help="Spread the job over Ray Data replicas (pip install 'specbatch[ray]').")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="With --ray: the cluster to join ('auto': the one `ray start` runs here); "
              "default: start a local Ray.")
@click.option("--replicas", type=click.IntRange(1), default=1, show_default=True,
              help="With --ray: engine replicas (each holds the model; a GPU each on CUDA, "
              "else the CPUs divided among them).")
@click.pass_context
def run(ctx, input_path, output, recipe, template, model, dtype, device, max_batch_size,
        max_model_len, no_prefix_caching, threads, cache_dir, method, draft_model, k, prompt_lookup_min,
        prompt_lookup_max,
        max_tokens, min_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
        ignore_eos, logprobs, prompt_field, id_field, split, limit, on_error, resume, force,
        no_progress, progress_interval, calibration, plan_only, use_ray, ray_address, replicas, input_format,
        **more_sampling):
    """Generate an output for every record of INPUT (JSONL, JSON, Parquet, CSV or a saved
    dataset folder) and write them, with per-record acceptance stats, to OUT."""
    from specbatch.run import RunOptions, run_job

    cpu = _choose_threads(threads)  # first: before anything imports torch
    if template is not None and prompt_field is not None:  # one from the recipe: the flag wins
        if _given(ctx, "template") == _given(ctx, "prompt_field"):
            raise click.UsageError("--template and --prompt-field exclude each other")
        template, prompt_field = ((template, None) if _given(ctx, "template")
                                  else (None, prompt_field))
    # before anything imports torch; --method none ignores a draft model, ngram refuses it below
    _check_model(model)
    if draft_model is not None and methods.uses_draft_model(method):
        _check_model(draft_model, draft=True)
    try:
        if template is not None:
            from specbatch.io.records import template_fields

            template_fields(template)
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=None,
                                  max_tokens=max_tokens, min_tokens=min_tokens,
                                  stop=_stop_strings(stop),
                                  stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                                  logprobs=logprobs, **_more_sampling(more_sampling))
        spec = SpecConfig(method=method, num_speculative_tokens=k,
                          prompt_lookup_min=prompt_lookup_min,
                          prompt_lookup_max=prompt_lookup_max, draft_model=draft_model)
        engine = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                              dtype=dtype, device=device,
                              prefix_caching=not no_prefix_caching)
    except ValueError as e:
        raise click.UsageError(_as_flags(str(e))) from None
    if plan_only and method != "auto":  # before anything loads
        raise click.UsageError(f"--plan-only needs --method auto (got --method {method})")
    if calibration is not None and method != "auto":
        raise click.UsageError(f"--calibration needs --method auto (got --method {method})")
    if (ray_address is not None or _given(ctx, "replicas")) and not use_ray:
        raise click.UsageError("--ray-address and --replicas need --ray")
    out = output or f"{Path(input_path).name.split('.')[0]}.out.jsonl"
    opts = RunOptions(input_path=input_path, output_path=out, model=model, cache_dir=cache_dir,
                      sampling=sampling, spec=spec, engine=engine, run_seed=seed,
                      prompt_field=prompt_field, id_field=id_field, split=split, limit=limit,
                      on_error=on_error, resume=resume, force=force, progress=not no_progress,
                      plan_only=plan_only, ray=use_ray, ray_address=ray_address,
                      replicas=replicas, input_format=input_format,
                      template=template, recipe=recipe.identity if recipe else None,
                      cpu=cpu, calibration=calibration, progress_interval=progress_interval)
    _exit_from_signals()
    sys.exit(run_job(opts))


@main.command()
@click.argument("input_path", metavar="INPUT", type=click.Path(exists=True))
@click.option("--configs", default="none,ngram:k=5", show_default=True,
              help="Comma-separated configurations: none, ngram:k=N[:min=A:max=B], draft:k=N, "
                   "suffix[:k=N], auto[:k=CAP][:draft] (auto:draft may also draft with "
                   "--draft-model). Each configuration runs a category's records with a fresh "
                   "engine, so suffix indexes only that run's finished records.")
@click.option("--draft-model", default=None,
              help="Draft model of the draft:k=N and auto:draft configurations.")
@_model_options
@_sampling_options
@_input_options
@click.option("--per-category", type=click.IntRange(1), default=None,
              help="Take the first N records of each category.")
@click.option("--categories", default=None, help="Comma-separated categories to keep.")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Rounds of the interleaved schedule.")
@click.option("--group", "groups", multiple=True, metavar="NAME=CAT,CAT",
              help="Also a table row for these categories together (repeatable), e.g. "
                   "copy-heavy=summarization,rag.")
@click.option("--template", default=None,
              help="Render the user message from record fields, as `run --template` (e.g. a "
                   "recipe's [input] template).")
@click.option("--calibration", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Step-cost fit for the auto configurations (`specbatch calibrate -o FILE`) instead of "
              "the one cached for this machine; nothing is measured.")
def bench(input_path, configs, draft_model, model, dtype, device, max_batch_size, max_model_len,
          no_prefix_caching, threads, cache_dir, max_tokens, min_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
          ignore_eos, logprobs, prompt_field, id_field, split, limit, per_category, categories,
          repeats, groups, template, calibration, **more_sampling):
    """Time several configurations on the same records, interleaved; print output tok/s and
    the ratio to none, overall and per category; check the outputs are identical."""
    from specbatch.bench import BenchOptions, parse_configs, parse_groups, run_bench

    cpu = _choose_threads(threads)  # first: before anything imports torch
    _check_model(model)
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                  max_tokens=max_tokens, min_tokens=min_tokens,
                                  stop=_stop_strings(stop),
                                  stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                                  logprobs=logprobs, **_more_sampling(more_sampling))
        engine = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                              dtype=dtype, device=device,
                              prefix_caching=not no_prefix_caching)
        specs = parse_configs(configs, draft_model)
        named_groups = parse_groups(groups)
    except ValueError as e:
        raise click.UsageError(_as_flags(str(e))) from None
    if draft_model is not None:  # used by a configuration (parse_configs checked)
        _check_model(draft_model, draft=True)
    sys.exit(run_bench(BenchOptions(
        input_path=input_path, model=model, draft_model=draft_model, cache_dir=cache_dir,
        sampling=sampling, specs=specs, engine=engine, run_seed=seed, prompt_field=prompt_field,
        id_field=id_field, split=split, limit=limit, per_category=per_category,
        categories=tuple(categories.split(",")) if categories else None, repeats=repeats,
        groups=named_groups, template=template, cpu=cpu, calibration=calibration)))



@main.command()
@click.argument("paths", metavar="OUT.jsonl [OUT2.jsonl ...]", nargs=-1, required=True,
                type=click.Path())
@click.option("--by", default=None, metavar="FIELD",
              help="Group by this input field (e.g. category), or by bucket, proposer or "
              "all; default: bucket for an auto run, else category when the records have "
              "one, else all.")
@click.option("--what-if", is_flag=True,
              help="Replay other n-gram settings (k 1..8, a few n-gram sizes) on the outputs.")
@click.option("--calibration", type=click.Path(dir_okay=False), default=None,
              help="Cost model (`specbatch calibrate -o`) with which --what-if predicts each "
              "setting's speedup; default: the one cached for the run's model and dtype.")
@click.option("--batch-size", type=click.IntRange(1), default=16, show_default=True,
              help="Rows per step assumed by the predicted speedup.")
@click.option("--compare", is_flag=True, help="Compare two files of the same records.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write PNG plots into this folder.")
def analyze(paths, by, what_if, calibration, batch_size, compare, as_json, plot_dir):
    """Acceptance tables of output files, by --by (default: bucket, category or all) and by
    proposer; what-if replay of other n-gram settings; side-by-side comparison of two files."""
    from specbatch.analyze.report import AnalyzeOptions, run_analyze

    sys.exit(run_analyze(AnalyzeOptions(
        paths=tuple(paths), by=by, what_if=what_if, calibration=calibration,
        batch_size=batch_size, compare=compare, as_json=as_json, plot_dir=plot_dir)))

@main.command()
@_calibration_model_options
@click.option("--output", "-o", default=None, type=click.Path(dir_okay=False),
              help="Also write the cost model here (JSON).")
@click.option("--recalibrate", is_flag=True, help="Measure again even if cached.")
def calibrate(model, dtype, device, cache_dir, output, recalibrate):
    """Measure this machine's step cost for the model and dtype (used by --method auto and
    analyze --what-if); cached per (model, dtype, device, CPU kernels, host)."""
    from specbatch.config import resolve_device
    from specbatch.plan.calibrate_cmd import run_calibrate

    cpu = _choose_threads(None)  # first: before anything imports torch
    _check_model(model)
    try:
        device = resolve_device(device)
    except ValueError as e:
        raise click.UsageError(_as_flags(str(e))) from None
    sys.exit(run_calibrate(model, dtype, cache_dir, output, recalibrate, device=device,
                           cpu=cpu))


@main.command("predict-eval")
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--k", type=click.IntRange(1, 32), default=5, show_default=True,
              help="k of the predicted acceptance length.")
@click.option("--model", default=None, help="Tokenizer's model (default: the run's model).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where converted weights are cached (default: $SPECBATCH_CACHE or "
              "~/.cache/specbatch).")
@click.option("--refit", is_flag=True, help="Also fit the predictor's weights to these files "
              "and report their 2-fold out-of-sample rank correlation.")
@click.option("--probe-tokens", type=click.IntRange(2, None), default=None,
              help="Output tokens the probe replays (default: what --method auto uses, 16).")
def predict_eval(paths, k, model, cache_dir, refit, probe_tokens):
    """Rank correlation (Spearman) between predicted and measured acceptance length on ngram
    output files: from the prompt alone, and after the probe (the first tokens replayed), with
    per-category means."""
    from specbatch.plan.calibrate_cmd import run_predict_eval

    if model is not None:
        _check_model(model)
    sys.exit(run_predict_eval(paths, k, model, cache_dir, refit, probe_tokens))


def _exit_from_signals() -> None:
    """SIGTERM behaves like Ctrl-C: a KeyboardInterrupt the run loop turns into a clean exit.
    The signal is also recorded (``run.request_stop``): Python drops an exception raised while
    a weakref callback runs (torch's caches use them), and the run loop then stops at the next
    finished record instead."""
    from specbatch.run import request_stop

    def handler(signum, frame):
        request_stop(signum)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


if __name__ == "__main__":
    main()
