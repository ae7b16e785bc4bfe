"""Acceptance tables: per-record ``spec`` counters summed by group, and the ratios that decide.

Groupings: ``bucket`` (``spec.bucket``, written by the auto planner; a record of another
method, which has none, is grouped under its ``proposer`` label, e.g. ``suffix:k=5``, so an auto
run analyzed beside a static one shows the static run as one row named for what it ran),
``proposer`` (``none``, ``auto`` or ``<proposer>:k=<k>``, k as the run asked), any input field
(``--by category``; records without the field are group ``-``) and ``all`` (no groups: the
table is the ``(all)`` row alone). ``default_grouping`` picks the primary grouping of a run
when ``--by`` does not: ``bucket`` for an auto run, else ``category`` when the records have
one (Spec-Bench's), else ``all``. Every table ends with the
``(all)`` row, summed over records independently of the groups, so its counters equal both the
sum of the group rows and the sum of the per-record counters (tested). ``(all)`` is the one
spelling of the total, and no group is named like it.
The text output leaves the ``(all)`` row out of a table with one group, whose row equals it.

Several files are pooled (one set of rows, one ``(all)``) only when they are runs of the same
setting (``RUN_SETTINGS`` of their ``OUT.config.json`` equal: the shards of one job, or reruns).
Files of different settings (``none`` beside ``ngram:k=5``, another k, model or sampling) are
not pooled: each file gets its own rows and its own total, named ``FILE: group`` and
``FILE: (all)`` (``file_tables``), since a total over different methods measures none of them.

Steps. ``spec.num_steps`` counts every target forward that emitted tokens for the record: one
prefill step per answer (a ``turns`` record has one per turn) plus the decode / verify steps.
``spec.k_histogram`` counts only the decode / verify steps, by draft length, so
``num_prefill_steps = num_steps - sum(k_histogram)``. The no-draft share is
``k_histogram[0] / num_decode_steps``: the verify steps that carried no draft (no n-gram match,
or a cap of 0 near ``max_tokens``), which cost a forward and emitted one token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from specbatch.analyze.load import answers, spec_stats
from specbatch.io.records import Record
from specbatch.spec_decode.stats import SpecStats

ALL = "(all)"
NO_FIELD = "-"
NO_GROUPS = "all"  # the grouping of one group: every record
DEFAULT_FIELD = "category"  # Spec-Bench's


def default_grouping(records: list[Record]) -> str:
    """``bucket`` when some record has a planner bucket (an auto run), else ``category`` when
    some record has that input field, else ``all`` (one group)."""
    if any(rec.fields["spec"].get("bucket") is not None for rec in records):
        return "bucket"
    if any(rec.fields.get(DEFAULT_FIELD) is not None for rec in records):
        return DEFAULT_FIELD
    return NO_GROUPS


def group_label(rec: Record, grouping: str) -> str:
    """The record's group under ``grouping`` (``bucket``, ``proposer``, ``all`` or an input
    field)."""
    if grouping == NO_GROUPS:
        return ALL
    spec = rec.fields["spec"]
    if grouping == "bucket":
        bucket = spec.get("bucket")
        return group_label(rec, "proposer") if bucket is None else str(bucket)
    if grouping == "proposer":
        name = spec.get("proposer", "none")
        if name in ("none", "auto"):  # auto's k is chosen per row and step (k_histogram)
            return name
        return f"{name}:k={spec.get('num_speculative_tokens', 0)}"
    value = rec.fields.get(grouping)
    return NO_FIELD if value is None else str(value)


@dataclass
class Group:
    """Counters of the records in one group (see ``row`` for the derived values)."""

    name: str
    num_records: int = 0
    num_answers: int = 0
    num_output_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reasons: Counter = field(default_factory=Counter)

    def add(self, rec: Record) -> None:
        f = rec.fields
        self.num_records += 1
        reasons = answers(f, "finish_reason")
        self.num_answers += len(reasons)
        self.finish_reasons.update(str(r) for r in reasons)
        self.num_output_tokens += f["usage"]["completion_tokens"]
        self.stats.merge(spec_stats(f))

    def row(self) -> dict:
        """The group's table row: counters and the ratios, documented in docs/analyze.md."""
        s = self.stats
        num_decode = sum(s.k_histogram.values())
        num_no_draft = s.k_histogram.get(0, 0)
        # positions up to the longest draft verified (past it no draft reached, all 0)
        per_pos = list(s.num_accepted_tokens_per_pos)
        last_nonzero = max((i + 1 for i, a in enumerate(per_pos) if a), default=0)
        per_pos = per_pos[:max(s.longest_draft, last_nonzero)]
        # drafted[i]: drafting steps whose draft reached position i (None: a file predating it)
        drafted = s.num_draft_tokens_per_pos
        if drafted is not None:
            drafted = (drafted + [0] * len(per_pos))[:len(per_pos)]
        # c[i]: drafting steps that accepted more than i drafts (c[0] = every drafting step)
        c = [s.num_drafts] + per_pos + [0]
        return {
            "group": self.name,
            "num_records": self.num_records,
            "num_answers": self.num_answers,
            "num_output_tokens": self.num_output_tokens,
            "num_steps": s.num_steps,
            "num_prefill_steps": s.num_steps - num_decode,
            "num_decode_steps": num_decode,
            "num_drafts": s.num_drafts,
            "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "tokens_per_step": _ratio(self.num_output_tokens, s.num_steps),
            "mean_acceptance_length": _round(s.mean_acceptance_length),
            "acceptance_rate": _round(s.acceptance_rate),
            "num_no_draft_steps": num_no_draft,
            "no_draft_share": _ratio(num_no_draft, num_decode),
            "num_accepted_tokens_per_pos": per_pos,
            "acceptance_per_pos": [_ratio(a, s.num_drafts) for a in per_pos],
            "conditional_acceptance_per_pos": [_ratio(c[i + 1], c[i])
                                               for i in range(len(per_pos))],
            "num_draft_tokens_per_pos": drafted,
            "acceptance_rate_per_pos": (None if drafted is None else
                                        [_ratio(a, t) for a, t in zip(per_pos, drafted)]),
            "acceptance_length_histogram": {str(i + 1): c[i] - c[i + 1]
                                            for i in range(len(per_pos) + 1)
                                            if s.num_drafts},
            "k_histogram": {str(k): n for k, n in sorted(s.k_histogram.items())},
            "finish_reasons": dict(sorted(self.finish_reasons.items())),
        }


def group_table(records: list[Record], grouping: str,
                labels: list[str] | None = None) -> list[dict]:
    """Rows of one grouping, sorted by group name, then the ``(all)`` row (alone for the
    grouping ``all``).

    labels: the records' groups, when given (``compare`` groups both files by the first's).
    """
    groups: dict[str, Group] = {}
    total = Group(ALL)
    if labels is None:
        labels = [group_label(rec, grouping) for rec in records]
    for rec, name in zip(records, labels, strict=True):
        if grouping != NO_GROUPS:
            groups.setdefault(name, Group(name)).add(rec)
        total.add(rec)
    return [groups[n].row() for n in sorted(groups)] + [total.row()]


def distinct_rows(rows: list[dict]) -> list[dict]:
    """The rows worth showing: a table of one group and ``(all)`` shows the group only (the
    two rows are equal); per file, for the tables of files not pooled (``file_tables``)."""
    blocks: dict = {}
    for r in rows:
        blocks.setdefault(r.get("file"), []).append(r)
    return [r for block in blocks.values() for r in (block[:1] if len(block) == 2 else block)]


# The run-config keys (``OUT.config.json``) whose values make two output files runs of
# different settings, whose counters are not pooled (``differing_settings``)
RUN_SETTINGS = ("model", "draft_model", "dtype", "method", "k", "prompt_lookup_min",
                "prompt_lookup_max", "sampling", "max_model_len")


def differing_settings(configs: list[dict | None]) -> list[str]:
    """The ``RUN_SETTINGS`` keys whose values differ among the files' configs (files without
    a config are left out: their settings are unknown); ``[]`` when they agree."""
    known = [c for c in configs if c is not None]
    return [k for k in RUN_SETTINGS if len({repr(c.get(k)) for c in known}) > 1]


def file_names(files: list) -> list[str]:
    """How the rows name each file (``analyze.load.RunFile``): its name, or its path as given
    where two files share a name."""
    names = [f.label for f in files]
    return [n if names.count(n) == 1 else str(f.path) for n, f in zip(names, files)]


def file_tables(files: list, grouping: str) -> list[dict]:
    """``group_table`` of each file in turn, each row's group named ``FILE: group`` and marked
    with ``"file"`` (``file_names``): the rows of files that are not pooled."""
    return [{**row, "group": f"{name}: {row['group']}", "file": name}
            for f, name in zip(files, file_names(files))
            for row in group_table(f.records, grouping)]


def record_groups(files: list, grouping: str, pooled: bool) -> list[tuple[str, Record]]:
    """``(group, record)`` for every record of ``files``, the group named as the tables name it
    (``FILE: group`` where the files are not pooled)."""
    return [(group_label(rec, grouping) if pooled else f"{name}: {group_label(rec, grouping)}",
             rec) for f, name in zip(files, file_names(files)) for rec in f.records]


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 6) if den else None


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)
