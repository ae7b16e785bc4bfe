"""What the commands share between parsing and work: the checks made before anything loads
(the model names, the flags' values as config fields), the thread choice made before torch is
imported, and the exit on SIGTERM. Errors are click's: ``click.UsageError`` (a bad flag value:
one ``error:`` line and a usage hint, exit 2) and ``StopError`` (one ``error:`` line, exit 2)."""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import click

from specbatch.config import EngineConfig, SamplingParams


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What ``run`` and ``bench`` both take: the records, the model and how to generate
    (each command adds its own fields, keyword-only)."""

    input_path: str
    model: str | None
    cache_dir: str | None
    sampling: SamplingParams
    engine: EngineConfig
    run_seed: int = 0
    prompt_field: str | None = None
    id_field: str | None = None
    split: str | None = None
    limit: int | None = None
    template: str | None = None  # renders the user message from record fields
    cpu: object = None  # cpu_threads.ThreadChoice: its line is printed before the load
    calibration: str | None = None  # --calibration FILE: the step-cost fit auto uses


EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class StopError(click.ClickException):
    """A problem found before anything loads that is not a malformed command line (an unknown
    model): one ``error:`` line on stderr, exit status 2, no usage hint."""

    exit_code = EXIT_BAD_INPUT

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", file=file, err=file is None)


def file_age(path: str | Path, now: float | None = None) -> str:
    """How long ago ``path`` was written, in words ("5 min ago", "3 h ago", "2 days ago"): a
    machine's speed drifts (a 2-core VM's step times moved 2x within hours), so an old
    calibration may price steps wrong. now: seconds since the epoch (default: the clock)."""
    seconds = max((time.time() if now is None else now) - os.path.getmtime(path), 0.0)
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if seconds < 2 * 86400:
        return f"{int(seconds // 3600)} h ago"
    return f"{int(seconds // 86400)} days ago"


def check_model(name: str | None, draft: bool = False) -> None:
    """Fail fast on a ``--model`` (None: the packaged default) or, with ``draft``, a
    ``--draft-model`` that names no registry model, ``.gguf`` file or model folder, or a registry
    model that is not installed: checked by ``models.registry.find_model`` before torch is
    imported (seconds; tens on a loaded machine). Raises ``StopError`` (exit 2) with the
    one-line reason, naming the model."""
    from specbatch.models.registry import DEFAULT_MODEL, find_model

    name = name or DEFAULT_MODEL
    try:
        find_model(name)
    except ValueError as e:
        raise StopError(f"draft model {name!r}: {e}" if draft else str(e)) from None


# config fields -> the flags that set them, for errors raised while building the configs
FLAG_OF = {"num_speculative_tokens": "--k", "prompt_lookup_min": "--prompt-lookup-min",
           "prompt_lookup_max": "--prompt-lookup-max", "max_batch_size": "--max-batch-size",
           "max_model_len": "--max-model-len", "max_tokens": "--max-tokens",
           "min_tokens": "--min-tokens", "top_p": "--top-p", "top_k": "--top-k",
           "temperature": "--temperature", "draft_model": "--draft-model",
           "stop_token_ids": "--stop-token-id", "logprobs": "--logprobs", "dtype": "--dtype",
           "device": "--device",
           "n": "--n", "repetition_penalty": "--repetition-penalty", "min_p": "--min-p",
           "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}

def choose_threads(threads: int | None):
    """``cpu_threads.choose_threads`` (sets the OpenMP environment before torch loads): the
    ``ThreadChoice`` whose line the command prints before the model loads."""
    from specbatch import cpu_threads

    return cpu_threads.choose_threads(threads)


def token_id_flag_error(sampling: SamplingParams, vocab_size: int) -> str | None:
    """The one-line error for ``--stop-token-id`` ids (or a recipe's ``logit_bias`` ids) of
    the job's defaults outside the model's vocabulary (``vocab_size`` ids), else None: said
    once, as soon as the model is loaded, not once per record that inherits them."""
    from specbatch.io.records import out_of_vocabulary

    found = out_of_vocabulary(sampling, vocab_size)
    if found is None:
        return None
    name, bad = found
    return (f"{FLAG_OF.get(name, name)} {', '.join(map(str, bad))}: not a token id of this "
            f"model (its vocabulary has ids 0..{vocab_size - 1})")


def stop_strings(stop: tuple[str, ...]) -> tuple[str, ...]:
    """``--stop`` values; an empty one is a usage error naming the flag (not the tuple)."""
    if "" in stop:
        raise click.UsageError("--stop '': expected a non-empty string")
    return tuple(stop)


def as_flags(message: str) -> str:
    """``prompt_lookup_max=2: expected an integer >= prompt_lookup_min`` (a config field error)
    -> ``--prompt-lookup-max=2: expected an integer >= --prompt-lookup-min``; a repeatable
    flag's values as typed: ``stop_token_ids=(-1,)`` -> ``--stop-token-id -1``."""
    message = re.sub(r"\b[a-z_]+\b", lambda m: FLAG_OF.get(m.group(0), m.group(0)), message)
    return re.sub(r"(--stop-token-id)=\((.*?),?\)", lambda m: f"{m.group(1)} {m.group(2)}",
                  message)


def more_sampling(extra: dict) -> dict:
    """SamplingParams fields from the options added after the first ten
    (``cli._sampling_options``): n, the penalties, min_p and ``--json-schema FILE`` (read and
    compiled here, so a bad schema is a usage error before anything loads). Raises
    ``click.UsageError`` naming the schema file, not the flag (a recipe's ``json_schema``
    comes here too: "--json-schema" in its error named a flag the user never typed)."""
    out = {k: extra[k] for k in ("n", "repetition_penalty", "presence_penalty",
                                 "frequency_penalty", "min_p")}
    path = extra.get("json_schema")
    if path is not None:
        import json

        try:
            schema = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise click.UsageError(f"JSON schema {path}: cannot read it: {e}")
        from specbatch.engine.grammar import check_schema

        try:
            check_schema(schema)
        except ValueError as e:
            raise click.UsageError(f"JSON schema {path}: {e}") from None
        out["response_format"] = {"type": "json_schema",
                                  "json_schema": {"name": Path(path).stem, "schema": schema}}
    return out


def exit_from_signals() -> None:
    """SIGTERM behaves like Ctrl-C: a KeyboardInterrupt the run loop turns into a clean exit.
    The signal is also recorded (``run.request_stop``): Python drops an exception raised while
    a weakref callback runs (torch's caches use them), and the run loop then stops at the next
    finished record instead."""
    from specbatch.commands.run import request_stop

    def handler(signum, frame):
        request_stop(signum)
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)
