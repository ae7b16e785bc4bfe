"""Read what ``specbatch run`` wrote: the output records and the run config beside them.

``analyze`` reads only the writer's files: ``OUT`` (``.jsonl`` or ``.parquet``, one record per
input record: the input fields plus ``output``, ``output_token_ids``, ``finish_reason``,
``usage``, ``spec``) and ``OUT.config.json`` (model id, method, k, n-gram sizes, sampling
defaults, prompt / id fields or template, context cap). The records are parsed with the same
reader as the input (``io.records.read_records``) under the run's prompt / id fields or template
and sampling defaults, so a record's prompt and ``SamplingParams`` are what the run used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specbatch import methods
from specbatch.config import SamplingParams
from specbatch.io.records import OUTPUT_FIELDS, Record, RecordError, read_records
from specbatch.spec_decode.stats import SpecStats


@dataclass
class RunFile:
    """One output file. config: ``OUT.config.json`` as saved, or None when it is missing.
    problems: lines of the file that could not be read as records (``file:line: reason``)."""

    path: Path
    config: dict | None
    records: list[Record]
    problems: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.path.name


def config_path(out_path: str | Path) -> Path:
    """``OUT.config.json`` beside ``OUT`` (named as ``io.writer`` names it)."""
    p = Path(out_path)
    return p.with_name(p.name + ".config.json")


def load_run(path: str | Path) -> RunFile:
    """Read one output file. Raises ``ValueError`` naming the file when it cannot be read at
    all (missing, unknown format, no records, no output record: an input file); bad lines
    become ``RunFile.problems``."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not an output file (give OUT.jsonl)")
    if not path.is_file():
        raise ValueError(f"{path}: no such output file")
    config = None
    cpath = config_path(path)
    if cpath.is_file():
        try:
            config = json.loads(cpath.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{cpath}: unreadable run config ({e})") from None
    defaults = SamplingParams()
    if config and isinstance(config.get("sampling"), dict):
        defaults = SamplingParams.from_dict(config["sampling"])
    c = config or {}
    records, errors = read_records(path, prompt_field=c.get("prompt_field"),
                                   id_field=c.get("id_field"), defaults=defaults,
                                   template=c.get("template"),
                                   null_ids=True)  # echoed from a table's empty cell
    if any(e.line == 0 for e in errors):
        raise ValueError(str(errors[0]))
    problems = [str(e) for e in errors]
    good = []
    for r in records:
        missing = [k for k in ("spec", "usage", "finish_reason") if k not in r.fields]
        if missing:
            problems.append(str(RecordError(str(path), r.line, r.id, "not an output record (no "
                                            f"{', '.join(missing)})", r.unit)))
        else:
            if isinstance(r.fields["spec"], dict):
                upgrade_spec(r.fields["spec"], config)
                for s in r.fields["spec"].get("per_sample") or []:
                    if isinstance(s, dict):
                        upgrade_spec(s, config)
            good.append(r)
    if not records and errors and config is None and _outputs_without_prompts(path):
        raise ValueError(f"{path}: none of its lines reads as a record ({errors[0].reason}, "
                         f"line {errors[0].line}) and the run's config {cpath.name} is not "
                         "beside it: the output of a --template, recipe or --prompt-field job "
                         "needs it to read its records; keep or copy it beside the file")
    if not good and _batch_output(path):
        raise ValueError(f"{path}: an OpenAI batch output (custom_id, response), as `specbatch "
                         "run` answers an OpenAI batch input: not read here yet (only specbatch's "
                         "own output format is); each line's stats are in response.body.specbatch")
    if not good:  # an input file (its records may not even read as prompts: no prompt field)
        lines = len(records) + len(errors)
        raise ValueError(f"{path}: none of its {lines} lines is an output record (no spec, usage, "
                         "finish_reason): analyze reads the OUT file `specbatch run` wrote, not "
                         "its input")
    return RunFile(path, config, good, problems)


def _batch_output(path: Path) -> bool:
    """Whether the first line of ``path`` is an OpenAI batch output line (``custom_id`` and
    ``response``, docs/output.md "OpenAI batch files")."""
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and {"custom_id", "response"} <= first.keys()


def _outputs_without_prompts(path: Path) -> bool:
    """Whether ``path`` holds output records that do not read as prompts on their own (a
    ``--template`` or recipe job's output without the config that names the template): read
    with ``output`` as the prompt field, some record then has every output field."""
    records, _ = read_records(path, prompt_field="output", null_ids=True)
    return any(all(k in r.fields for k in OUTPUT_FIELDS) for r in records)


def upgrade_spec(spec: dict, config: dict | None) -> dict:
    """A record's ``spec`` field in the current format, changed in place and returned.

    Files written before ``max_spec_tokens`` existed have no such field and held the per-row
    draft cap in ``num_speculative_tokens`` (for ``suffix`` and ``auto``, ``min(32, 3k)``, e.g.
    15 at k = 5). Such a spec gets ``max_spec_tokens`` = that cap and ``num_speculative_tokens``
    = k: the run config's ``k`` when ``OUT.config.json`` is beside the file and names the
    record's method; else the one k whose cap it is (``methods.Method.draft_cap``); else the
    cap stays (a cap of 32 fits every k from 11 up). A current spec is left as it is."""
    if spec.get("max_spec_tokens") is not None or "num_speculative_tokens" not in spec:
        return spec
    cap = spec["num_speculative_tokens"]
    proposer = spec.get("proposer")
    c = config or {}
    entry = methods.get(proposer)
    k = cap
    if isinstance(c.get("k"), int) and c.get("method") == proposer and (
            entry is None or entry.draft_cap(c["k"]) == cap):
        k = c["k"]
    elif entry is not None and isinstance(cap, int):
        ks = [n for n in range(cap + 1) if entry.draft_cap(n) == cap]
        if len(ks) == 1:
            k = ks[0]
    spec["num_speculative_tokens"] = k
    spec["max_spec_tokens"] = cap
    return spec


def spec_stats(fields: dict) -> SpecStats:
    """A record's ``spec`` field as ``SpecStats`` (the counters, not the derived ratios)."""
    return SpecStats.from_dict(fields["spec"])


def answers(fields: dict, key: str) -> list:
    """Per-answer values of ``output`` / ``output_token_ids`` / ``finish_reason`` /
    ``stop_reason``: a list with one entry per turn for ``turns`` records, else ``[value]``."""
    value = fields.get(key)
    is_turns = isinstance(fields.get("finish_reason"), list)
    return list(value) if is_turns else [value]
