"""Read and validate input records before any model loads.

Formats, chosen by the path: ``.jsonl`` (read line by line here, so errors name the line),
``.json`` (a JSON array of objects, one object, or JSONL under a .json name), ``.parquet`` and
``.csv`` (through ``datasets``), and a folder written by ``Dataset.save_to_disk``. For the
formats without lines, ``Record.line`` is the 1-based row (element) number; a CSV header row is
not counted.

A ``.jsonl`` file that holds one JSON array instead of lines is accepted like ``.json``.

A bad record never stops the read: it becomes a ``RecordError`` and the other records are still
returned, so ``--on-error skip`` can run them. A file-level problem (missing file, unknown
format, unreadable dataset, no records) is one ``RecordError`` with ``line == 0`` and no records.

A field whose value is null counts as absent (columnar formats fill missing cells with null),
for the prompt, the id and the sampling fields alike.

A ``template`` (``--template`` or a recipe's ``input.template``) builds the prompt from record
fields instead: ``"{instruction}\n\n{code}"`` becomes the user message of a one-message chat,
so the model's chat template applies as for ``messages``. A record without one of the fields
is a per-record error naming the field.
"""

from __future__ import annotations

import json
import os
import string
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson

from specbatch.config import SAMPLING_FIELDS, SamplingParams

PROMPT_FIELDS = ("prompt", "messages", "turns")
ID_FIELDS = ("id", "question_id")
ROLES = ("system", "user", "assistant")
FORMATS = (".jsonl", ".json", ".parquet", ".csv")
_BOM = b"\xef\xbb\xbf"
INT_SAMPLING_FIELDS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "n")


@dataclass(frozen=True)
class Record:
    """One valid input record.

    index: 0-based position among the valid records, in input order (the output order).
    line: 1-based line in a JSONL file, or 1-based row for the other formats.
    id: from ``--id-field``, else ``id``, else ``question_id``, else the line number.
    fields: the record as read, echoed into the output.
    Exactly one of ``prompt`` (plain text), ``messages`` (chat list of {role, content}) and
    ``turns`` (user turns, generated in order, each answer fed back) is set.
    sampling: the run defaults overridden by the record's own sampling fields.
    """

    index: int
    line: int
    id: str | int
    fields: dict
    prompt: str | None
    messages: list[dict] | None
    turns: list[str] | None
    sampling: SamplingParams


@dataclass(frozen=True)
class RecordError:
    """A record (or, with ``line == 0``, the whole file) that cannot run."""

    path: str
    line: int
    id: str | int | None
    reason: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line else self.path
        who = f" id={self.id!r}:" if self.id is not None else ""
        return f"{where}:{who} {self.reason}"


def read_records(path: str | os.PathLike, *, prompt_field: str | None = None,
                 id_field: str | None = None, split: str | None = None,
                 defaults: SamplingParams = SamplingParams(), template: str | None = None,
                 ) -> tuple[list[Record], list[RecordError]]:
    """Read ``path`` and validate every record; never raises for bad input.

    Returns the valid records (``index`` 0..n-1 in input order) and the errors, in line order.
    A duplicate id (compared as text, so 7 and "7" clash) is an error on every record after the
    first, naming the first one's line. ``template`` (exclusive with ``prompt_field``) renders
    each record's user message from its fields; see the module docstring.
    Raises ``ValueError`` only for a bad call: a malformed template, or both template and
    prompt_field.
    """
    p = str(path)
    if template is not None:
        template_fields(template)
        if prompt_field is not None:
            raise ValueError("give a prompt field or a template, not both")
    try:
        rows = list(_rows(Path(path), split))
    except _FileError as e:
        return [], [RecordError(p, 0, None, str(e))]
    if not rows:
        return [], [RecordError(p, 0, None, "no records")]
    return _validate(p, rows, prompt_field, id_field, defaults, template)


def records_from_rows(rows: Iterable[dict], *, prompt_field: str | None = None,
                      id_field: str | None = None,
                      defaults: SamplingParams | list[SamplingParams] = SamplingParams(),
                      template: str | None = None, source: str = "<records>",
                      ) -> tuple[list[Record], list[RecordError]]:
    """Validate in-memory rows (dicts in the input format) as ``read_records`` validates a
    file's; row i is "line" i + 1 of ``source``. defaults: the sampling defaults, or one per
    row. Raises ``ValueError`` only for a bad call (a malformed template, both template and
    prompt_field, or a ``defaults`` list of another length)."""
    rows = list(rows)
    if template is not None:
        template_fields(template)
        if prompt_field is not None:
            raise ValueError("give a prompt field or a template, not both")
    if isinstance(defaults, list) and len(defaults) != len(rows):
        raise ValueError(f"{len(defaults)} sampling params for {len(rows)} prompts")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"prompt {i + 1}: expected a string or a dict, got {_kind(row)}")
    return _validate(source, list(enumerate(rows, 1)), prompt_field, id_field, defaults,
                     template)


def _validate(p: str, rows: list, prompt_field: str | None, id_field: str | None,
              defaults: SamplingParams | list[SamplingParams], template: str | None,
              ) -> tuple[list[Record], list[RecordError]]:
    """Records and errors of ``rows`` (``(line, row)`` pairs); see ``read_records``."""
    records, errors, first_line = [], [], {}
    for line, row in rows:
        if isinstance(row, _BadLine):
            errors.append(RecordError(p, line, None, row.reason))
            continue
        wide: dict[str, int] = {}
        if isinstance(row, _WideInts):
            row, wide = row.row, row.ints
        rec_id = None
        try:
            rec_id = _record_id(row, id_field, line, wide)
            seen = (line, rec_id, id_field is None and all(row.get(k) is None for k in ID_FIELDS))
            key = str(rec_id)
            if key in first_line:
                raise ValueError(_duplicate(seen, first_line[key]))
            first_line[key] = seen
            if template is not None:
                prompt, messages, turns = None, [_render(template, row)], None
            else:
                prompt, messages, turns = _prompt(row, prompt_field)
            sampling = _sampling(row, defaults[line - 1] if isinstance(
                defaults, list) else defaults, wide)
        except ValueError as e:
            errors.append(RecordError(p, line, rec_id, str(e)))
            continue
        records.append(Record(len(records), line, rec_id, row, prompt, messages, turns, sampling))
    return records, errors


def check_lengths(records: Iterable[Record], count_tokens: Callable[[Record], int],
                  max_model_len: int, path: str | os.PathLike) -> list[RecordError]:
    """Errors for records whose prompt leaves no room for a completion token.

    count_tokens: prompt tokens of a record as the model will see it (chat template applied;
        for ``turns``, the first turn: later turns grow with the answers and are capped at run
        time). max_model_len: the model's context (tokens).
    """
    errors = []
    for r in records:
        n = count_tokens(r)
        if n >= max_model_len:
            errors.append(RecordError(str(path), r.line, r.id,
                                      f"prompt is {n} tokens; the model's context is "
                                      f"{max_model_len}"))
    return errors


def check_token_ids(records: Iterable[Record], vocab_size: int,
                    path: str | os.PathLike) -> list[RecordError]:
    """Errors for records whose ``stop_token_ids`` or ``logit_bias`` name an id outside the
    model's vocabulary (``vocab_size`` token ids, 0 .. vocab_size - 1)."""
    errors = []
    for r in records:
        for name, ids in (("stop_token_ids", r.sampling.stop_token_ids),
                          ("logit_bias", [t for t, _ in r.sampling.logit_bias])):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                errors.append(RecordError(str(path), r.line, r.id,
                                          f"{name} {bad} are not token ids of this model "
                                          f"(its vocabulary has ids 0..{vocab_size - 1})"))
                break
    return errors



MAX_ERRORS_SHOWN = 20


def error_lines(errors: list[RecordError], on_error: str, level: str = "error",
                can_skip: bool = True) -> list[str]:
    """One line per bad record (the first ``MAX_ERRORS_SHOWN``), as the commands print them.
    level: ``error`` when they stop the run, ``warning`` when ``--on-error skip`` leaves them
    out and the run goes on. can_skip: whether the command has ``--on-error skip`` to suggest
    (``bench`` has not)."""
    lines = [f"{level}: {e}" for e in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"... and {len(errors) - MAX_ERRORS_SHOWN} more")
    if on_error == "fail":
        lines.append(f"{len(errors)} bad record(s); nothing was generated. Fix them"
                     + (", or pass --on-error skip to run the others." if can_skip else "."))
    return lines

class _FileError(Exception):
    """A problem with the whole file; its text is the reason shown to the user."""


@dataclass(frozen=True)
class _BadLine:
    reason: str


@dataclass(frozen=True)
class _WideInts:
    """A JSON object holding an integer beyond 64 bits, which orjson reads as a float.

    row: the object as orjson read it (what the output echoes). ints: top-level key -> the
    integer as written, so that a checked field (the id, an integer sampling field) is reported
    as the user wrote it, not as ``1.2345678901234568e+29``.
    """

    row: dict
    ints: dict[str, int]


def _rows(path: Path, split: str | None
          ) -> Iterator[tuple[int, dict | _BadLine | _WideInts]]:
    if not path.exists():
        raise _FileError("no such file or folder")
    if path.is_dir():
        yield from _dataset_rows(_load_from_disk(path, split))
        return
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise _FileError(f"unknown input format {suffix or '(no extension)'!r}: expected "
                         f"{', '.join(FORMATS)} or a folder written by Dataset.save_to_disk")
    if split is not None:
        raise _FileError(f"--split applies only to a dataset folder, not a {suffix} file")
    if suffix in (".jsonl", ".json"):
        yield from _json_rows(path.read_bytes(), suffix)
        return
    import datasets  # slow import; only the columnar formats need it

    load = datasets.Dataset.from_parquet if suffix == ".parquet" else datasets.Dataset.from_csv
    try:
        with tempfile.TemporaryDirectory() as cache_dir:  # keep the user's HF cache clean
            ds = load(str(path), cache_dir=cache_dir, keep_in_memory=True)
    except Exception as e:  # any reader failure is bad input, reported, not a crash
        raise _FileError(f"cannot read {suffix} file: {type(e).__name__}: {e}") from e
    yield from _dataset_rows(ds)


def _load_from_disk(path: Path, split: str | None):
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise _FileError(f"not a dataset folder written by save_to_disk: {e}") from e
    if isinstance(ds, datasets.DatasetDict):
        splits = ", ".join(ds.keys())
        name = split if split is not None else "train" if "train" in ds else None
        if name is None:
            raise _FileError(f"the dataset has splits {splits}; choose one with --split")
        if name not in ds:
            raise _FileError(f"no split {name!r}; the dataset has splits {splits}")
        return ds[name]
    if split is not None:
        raise _FileError(f"--split {split!r} given but the folder holds a single dataset")
    return ds


def _dataset_rows(ds) -> Iterator[tuple[int, dict]]:
    for i, row in enumerate(ds):
        yield i + 1, row


def _json_rows(data: bytes, suffix: str
               ) -> Iterator[tuple[int, dict | _BadLine | _WideInts]]:
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    head = data.lstrip()
    if suffix == ".json" or head.startswith(b"["):
        reason = ""
        try:
            whole = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            whole, reason = None, f"line {e.lineno}, column {e.colno}: {e.msg}"
        if isinstance(whole, list):  # a JSON array: rows are its elements
            exact = None
            for i, item in enumerate(whole):
                if not isinstance(item, dict):
                    yield i + 1, _BadLine(f"array element is a JSON {_kind(item)}, not an object")
                    continue
                if exact is None and _may_be_wide(item):
                    exact = _exact(data)
                yield i + 1, _with_wide_ints(item, exact[i] if exact else None)
            return
        if isinstance(whole, dict):  # one object, possibly spread over several lines
            yield 1, _with_wide_ints(whole, _exact(data) if _may_be_wide(whole) else None)
            return
        if whole is None and head.startswith(b"[") and not _parses(head.split(b"\n", 1)[0]):
            raise _FileError(f"looks like a JSON array but is not valid JSON: {reason}")
    yield from _jsonl_rows(data)


def _jsonl_rows(data: bytes) -> Iterator[tuple[int, dict | _BadLine | _WideInts]]:
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield n, _BadLine(f"invalid UTF-8 at byte {e.start} of the line")
            continue
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as e:  # its "line 1" is this line: give the column only
            yield n, _BadLine(f"invalid JSON at column {e.colno}: {e.msg}")
            continue
        if not isinstance(value, dict):
            yield n, _BadLine(f"line is a JSON {_kind(value)}, not an object")
            continue
        yield n, _with_wide_ints(value, _exact(text) if _may_be_wide(value) else None)


def _may_be_wide(obj: dict) -> bool:
    """Whether a top-level value may be an integer that orjson read as a float (beyond 64 bits);
    ``_exact`` decides."""
    return any(isinstance(v, float) and abs(v) >= 2**63 and v.is_integer() for v in obj.values())


def _exact(source: str | bytes):
    """The JSON text read again by the standard library, which keeps every integer exact."""
    try:
        return json.loads(source)
    except (ValueError, RecursionError):  # orjson read it, so this is not expected
        return None


def _with_wide_ints(row: dict, exact) -> dict | _WideInts:
    """``row``, or a ``_WideInts`` with the integers ``exact`` (the same object read exactly)
    holds where ``row`` has floats."""
    if not isinstance(exact, dict):
        return row
    ints = {k: v for k, v in exact.items() if isinstance(v, int) and not isinstance(v, bool)
            and isinstance(row.get(k), float)}
    return _WideInts(row, ints) if ints else row


def _duplicate(this: tuple[int, str | int, bool], first: tuple[int, str | int, bool]) -> str:
    """Why a record whose id was seen before is refused. this, first: (line, id, whether the id
    is the line number, for want of one), e.g. ``duplicate id '7': first seen on line 1 as 7
    (ids are compared as text)``."""
    (_, rec_id, _), (first_line, first_id, _) = this, first
    msg = f"duplicate id {rec_id!r}: first seen on line {first_line}"
    notes = [f"line {n} has no id and takes its line number"
             for n, _, by_line in (first, this) if by_line]
    if repr(first_id) != repr(rec_id):
        msg += f" as {first_id!r}"
        notes.append("ids are compared as text")
    return msg + (f" ({'; '.join(notes)})" if notes else "")


def _record_id(row: dict, id_field: str | None, line: int, wide: dict[str, int]) -> str | int:
    """wide: the record's integers beyond 64 bits (see ``_WideInts``)."""
    if id_field is not None:
        if row.get(id_field) is None:
            raise ValueError(f"missing id field {id_field!r}")
        key = id_field
    else:
        key = next((k for k in ID_FIELDS if row.get(k) is not None), None)
    if key in wide:
        raise ValueError(f"id {wide[key]} does not fit in 64 bits; write it as a string")
    value = line if key is None else row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"id must be a string or an integer, got {_kind(value)} {value!r}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("id is an empty string")
    return value


def _prompt(row: dict, prompt_field: str | None
            ) -> tuple[str | None, list[dict] | None, list[str] | None]:
    """(prompt, messages, turns), one of them set, from the prompt field's value."""
    if prompt_field is not None:
        if prompt_field not in row:
            raise ValueError(f"missing prompt field {prompt_field!r}")
        name = prompt_field
    else:
        name = next((k for k in PROMPT_FIELDS if row.get(k) is not None), None)
        if name is None:
            name = next((k for k in PROMPT_FIELDS if k in row), None)
            if name is None:
                raise ValueError(f"no prompt: expected a field {', '.join(PROMPT_FIELDS)} "
                                 "(or choose one with --prompt-field)")
    value = row[name]
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{name} is empty")
        return value, None, None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        for i, turn in enumerate(value):
            if not turn.strip():
                raise ValueError(f"{name}: turn {i + 1} is empty")
        return None, None, list(value)
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return None, _messages(name, value), None
    if isinstance(value, list) and not value:
        raise ValueError(f"{name} is an empty list")
    got = (f"an array of {' and '.join(sorted({_kind(v) for v in value}))}"
           if isinstance(value, list) else _kind(value))
    raise ValueError(f"{name} must be a string, a list of strings (turns) or a list of "
                     f"{{role, content}} messages; got {got}")


def template_fields(template: str) -> list[str]:
    """Names of the record fields ``template`` uses, in order of first use.

    ``"{instruction}\n\n{code}"`` -> ``["instruction", "code"]``; ``{{`` and ``}}`` are literal
    braces. Raises ``ValueError`` for a malformed template, a field that is not a plain name
    (``{}``, ``{0}``, ``{a.b}``, ``{a[0]}``) or a template with no field.
    """
    if not isinstance(template, str):
        raise ValueError(f"template must be a string, got {_kind(template)}")
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"template {template!r}: {e} (write {{{{ and }}}} for literal "
                         "braces)") from None
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"template {template!r}: {{{name}}} is not a field name; use "
                             "{field} with a record field's name")
        if spec and ("{" in spec):
            raise ValueError(f"template {template!r}: nested fields are not supported")
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"template {template!r} uses no record field")
    return names


def _render(template: str, row: dict) -> dict:
    """The user message ``template`` makes of ``row``'s fields."""
    for name in template_fields(template):
        value = row.get(name)
        if value is None:
            raise ValueError(f"template field {name!r} is missing"
                             + (" (null)" if name in row else ""))
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"template field {name!r} must be text or a number, got "
                             f"{_kind(value)}")
    try:
        text = template.format_map(row)
    except (ValueError, TypeError) as e:  # a format spec that does not fit the value
        raise ValueError(f"template cannot render this record: {e}") from None
    if not text.strip():
        raise ValueError("template renders an empty prompt")
    return {"role": "user", "content": text}


def _messages(name: str, value: list[dict]) -> list[dict]:
    for i, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}].role={role!r}: expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{name}[{i}].content must be a string, got {_kind(content)}")
    if not any(m["role"] == "user" for m in value):
        raise ValueError(f"{name} has no user message")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _sampling(row: dict, defaults: SamplingParams, wide: dict[str, int]) -> SamplingParams:
    """The record's sampling parameters. wide: its integers beyond 64 bits (``_WideInts``)."""
    own = {k: row[k] for k in SAMPLING_FIELDS if row.get(k) is not None}
    if not own:
        return defaults
    for k in INT_SAMPLING_FIELDS:
        if k in own and k in wide:
            raise ValueError(f"invalid sampling field: {k}={wide[k]}: expected an integer "
                             "that fits in 64 bits")
    try:
        sp = SamplingParams.from_dict(own, base=defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"invalid sampling field: {e}") from e
    if "response_format" in own and sp.json_schema is not None:
        from specbatch.engine.grammar import check_schema

        check_schema(sp.json_schema)  # ValueError: the record is bad, before the model loads
    return sp


def _parses(data: bytes) -> bool:
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        return False
    return True


def _kind(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
             int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


__all__ = ["Record", "RecordError", "read_records", "check_lengths", "template_fields",
           "PROMPT_FIELDS", "ID_FIELDS"]
