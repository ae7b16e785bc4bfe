"""Command line: ``specbatch run | bench | analyze | calibrate | predict-eval``: the flags, parsed
by click, and each command handed to its module in ``specbatch.commands`` (``command``), whose
exit status is the process's. No command logic here."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import click
from click.core import ParameterSource

from specbatch import methods
from specbatch.config import DTYPE_CHOICES, MAX_INT, MIN_INT

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


class _Seed(click.ParamType):
    """``--seed``: an integer from -2**63 to 2**64 - 1 (any 64-bit seed, signed or not). Not
    ``click.IntRange``, whose help would print both 20-digit ends."""

    name = "integer"

    def convert(self, value, param, ctx):
        try:
            seed = int(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not an integer", param, ctx)
        if not MIN_INT <= seed <= MAX_INT:
            self.fail(f"{seed} is not a 64-bit seed (-2**63 to 2**64 - 1)", param, ctx)
        return seed


class _UsageError(click.UsageError):
    """A usage error shown as one ``error:`` line and a hint, instead of click's usage block."""

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)
        if self.ctx is not None:
            click.echo(f"try '{self.ctx.command_path} --help'", file=file, err=file is None)


def _version() -> str:
    """``specbatch.__version__``, marked ``(not installed)`` for a checkout run without
    installing (click's own lookup raises there); ``unknown (not installed)`` with neither."""
    from specbatch._version import package_version

    version, installed = package_version()
    return version if installed else f"{version or 'unknown'} (not installed)"


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
    except click.exceptions.NoSuchOption as e:
        raise _UsageError(_no_such_option(e.option_name, e.possibilities or ()),
                          e.ctx) from None
    except click.UsageError as e:
        raise _UsageError(e.format_message(), e.ctx) from None


def _no_such_option(name: str, possibilities) -> str:
    """An unknown flag's message with the closest flags only: click lists every one over its
    cutoff (``--methd``: --method, --seed, --threads), these the ones within 0.1 of the best
    ``difflib`` ratio (--method)."""
    import difflib

    scored = sorted(((difflib.SequenceMatcher(None, name, p).ratio(), p) for p in possibilities
                     if difflib.SequenceMatcher(None, name, p).ratio() >= 0.6), reverse=True)
    close = [p for r, p in scored if r >= scored[0][0] - 0.1] if scored else []
    hint = (f" Did you mean {close[0]}?" if len(close) == 1 else
            f" Did you mean one of {', '.join(close)}?" if close else "")
    return f"no such option: {name}.{hint}"


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
                     help="Proposer: auto (per row and step, the prompt lookup, suffix or "
                     "--draft-model draft and its length that pay by this machine's measured step "
                     "cost), none (plain decoding), ngram (prompt lookup: the row's own text), draft "
                     "(--draft-model), or suffix "
                     "(own text + outputs of the job's finished records)."),
        click.option("--draft-model", default=None, help="Draft model for --method draft "
                     "(or for auto to choose per row): registry name, .gguf path or HF folder "
                     "sharing the target's tokenizer. Refused with ngram; none ignores it."),
        click.option("--k", "--num-speculative-tokens", "k", type=click.IntRange(0, 32),
                     default=5, show_default=True,
                     help="Draft tokens per verify step, 1-32 (0 only with --method none; auto: "
                     "the most a lookup or draft-model draft may have; suffix drafts, with suffix "
                     "or auto, may reach min(32, 3k))."),
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
        click.option("--dtype", type=click.Choice(DTYPE_CHOICES),
                     default="auto", show_default=True,
                     help="Weights and activations dtype. auto: the fastest batch-invariant "
                     "one for the model: on x86-64 CPUs with AVX2, int8 for a GGUF of Q4_1 / "
                     "Q8_0 / K-quant weights, else float32 (specbatch's C kernels); bfloat16 on GPUs. "
                     "int8 (CPU): float32, with a GGUF model's 4/8-bit weights multiplied by "
                     "activations rounded to 8 bits per block of 32, as llama.cpp does "
                     "(batch-invariant; not bit-equal to float32). bfloat16, float16, float64 "
                     "run on torch's kernels on a CPU. half, float: vLLM's names of float16, "
                     "float32."),
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
                                 "usable CPU). Without --threads or OMP_NUM_THREADS, a run "
                                 "fits its threads to other work on the CPUs: it starts on the "
                                 "CPUs others leave, gives CPUs to work that appears later and "
                                 "takes them back when it is gone (a `cpu: N threads now` "
                                 "line; no output bit changes). With a count of yours, OpenMP "
                                 "threads wait passively when other work holds the CPUs at "
                                 "start (OMP_WAIT_POLICY set by you wins); the `cpu:` line "
                                 "says what was chosen."))
    opts.append(click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
                             help="Where converted weights and auto's step-cost "
                             "calibrations are cached (default: $SPECBATCH_CACHE or "
                             "~/.cache/specbatch)."))
    for opt in reversed(opts):
        f = opt(f)
    return f


def _calibration_model_options(f):
    """``_model_options`` without the engine's --max-batch-size and --max-model-len: calibration
    times fixed shapes (``auto.costmodel.calibrate``)."""
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
        click.option("--top-k", type=click.IntRange(-1), default=0, show_default=True,
                     help="Sample from the K most likely tokens only; 0 = off (-1 too, as "
                     "in vLLM)."),
        click.option("--seed", type=_Seed(), default=0, show_default=True,
                     help="Run seed, a 64-bit integer; a record's seed is derived from it and "
                          "the record id."),
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
                     default=1.0, show_default=True, help="Divide a positive logit (multiply a "
                     "negative one) of every token in the prompt or output by it; 1 = off."),
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


class _StderrHandler(logging.Handler):
    """Prints the ``specbatch`` logger's records on stderr as the CLI's other lines: INFO as
    the bare message (progress: ``loading model ...``), other levels prefixed with the level
    (``warning: ...``). Writes through ``click.echo``, so it follows a replaced ``sys.stderr``
    (click's test runner, ``specbatch run ... 2> log``); above the progress bar where one is
    drawn (a line during a run, e.g. ``cpu: 1 thread now ...``, would split the bar)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
            if record.levelno != logging.INFO:
                message = f"{record.levelname.lower()}: {message}"
            bars = sys.modules.get("tqdm")  # loaded: a bar may be on the terminal
            with (bars.tqdm.external_write_mode(file=sys.stderr) if bars is not None
                  else nullcontext()):
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


def _given_flags(ctx: click.Context) -> frozenset[str]:
    """The names of the parameters set on the command line (or by the environment), not by a
    recipe or a default: where a flag and a recipe value conflict, the flag wins."""
    return frozenset(name for name in ctx.params
                     if ctx.get_parameter_source(name) in (ParameterSource.COMMANDLINE,
                                                           ParameterSource.ENVIRONMENT))


@main.command(short_help="Generate an output for every record of INPUT.")
@click.argument("input_path", metavar="INPUT", type=click.Path())
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="Output .jsonl or .parquet (default: INPUT stem + .out.jsonl in the "
                   "current folder: data/a.jsonl -> ./a.out.jsonl; required with INPUT -).")
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
@click.option("--resume", is_flag=True,
              help="Continue from OUT.work.jsonl even when its saved config is missing (a "
                   "rerun of the same command resumes without this flag).")
@click.option("--force", is_flag=True, help="Start over even if earlier work or output exists.")
@click.option("--no-progress", is_flag=True,
              help="No progress bar (nor the progress lines written where stderr is no terminal).")
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
def run(ctx, **options):
    """Generate an output for every record of INPUT (JSONL, JSON, Parquet, CSV or a saved
    dataset folder; - reads JSONL from standard input) and write them, with per-record
    acceptance stats, to OUT."""
    from specbatch.commands import run as command

    sys.exit(command.command(_given_flags(ctx), **options))


@main.command(short_help="Time configurations side by side on the same records.")
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
def bench(**options):
    """Time several configurations on the same records, interleaved; print output tok/s and
    the ratio to none, overall and per category; check the outputs are identical."""
    from specbatch.commands import bench as command

    sys.exit(command.command(**options))


@main.command(short_help="Acceptance tables of output files (--by, --what-if).")
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
@click.option("--batch-size", type=click.IntRange(1), default=None,
              help="Rows per step assumed by the predicted speedup; default: the run's "
              "--max-batch-size (OUT.config.json), else 16.")
@click.option("--compare", is_flag=True, help="Compare two files of the same records.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Write PNG plots into this folder.")
def analyze(**options):
    """Acceptance tables of output files, by --by (default: bucket, category or all) and by
    proposer; what-if replay of other n-gram settings; side-by-side comparison of two files."""
    from specbatch.commands import analyze as command

    sys.exit(command.command(**options))


@main.command(short_help="Measure this machine's step cost for a model and dtype.")
@_calibration_model_options
@click.option("--output", "-o", default=None, type=click.Path(dir_okay=False),
              help="Also write the cost model here (JSON).")
@click.option("--recalibrate", is_flag=True, help="Measure again even if cached.")
def calibrate(**options):
    """Measure this machine's step cost for the model and dtype (used by --method auto and
    analyze --what-if); cached per (model, dtype, device, CPU kernels, host)."""
    from specbatch.commands import calibrate as command

    sys.exit(command.command(**options))


@main.command("predict-eval", short_help="How well predicted acceptance ranks records.")
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
def predict_eval(**options):
    """Rank correlation (Spearman) between predicted and measured acceptance length on ngram
    output files: from the prompt alone, and after the probe (the first tokens replayed), with
    per-category means."""
    from specbatch.commands import calibrate as command

    sys.exit(command.predict_eval_command(**options))


if __name__ == "__main__":
    main()
