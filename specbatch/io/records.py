"""Read and validate input records before any model loads.

Formats, chosen by the path: ``.jsonl`` (read line by line here, so errors name the line),
``.json`` (a JSON array of objects, one object, or JSONL under a .json name), ``.parquet`` and
``.csv`` (through ``datasets``), and a folder written by ``Dataset.save_to_disk``. ``Record.line``
is a 1-based position and ``Record.unit`` says of what: a ``line`` of JSON text (for one object
in a .json file, the line it starts on), an ``element`` of a JSON array, or a ``row`` of a table
(a CSV header row is not counted). A CSV file's id columns keep their text as written (only an
empty cell is no id), read as integers when each cell is a plain integer (``_id_column``); its
integer sampling columns (``INT_SAMPLING_FIELDS``) are read cell by cell, an empty cell absent
(``_int_column``); its other columns, and the columns of Parquet files and folders, keep the
types the reader gives them. Errors say ``path:N:`` for a line, ``path: element N:`` and
``path: row N:`` otherwise.

Each line of a ``.jsonl`` file must be one JSON object: a line holding an array (or a string,
a number...) is a bad record on that line, known by its line number as a record without an id
(``RecordError.id``), and a file holding one JSON array spread over
several lines is refused as a whole (a ``.json`` file may hold an array of records). An object
that names a key twice (``{"prompt": "a", "prompt": "b"}``) is a bad record naming the key:
JSON readers keep one value silently (``duplicate_key``). JSON text is UTF-8 (a UTF-8 BOM is
skipped); a file that starts with a UTF-16 or UTF-32 byte order mark (Windows PowerShell's
``>`` writes UTF-16) is read in that encoding (``_as_utf8``).

A bad record never stops the read: it becomes a ``RecordError`` and the other records are still
returned, so ``--on-error skip`` can run them. A file-level problem (missing file, unknown
format, unreadable dataset, no records) is one ``RecordError`` with ``line == 0`` and no records.

A field whose value is null counts as absent (columnar formats fill missing cells with null),
for the prompt, the id and the sampling fields alike; except that an id written as null in JSON
(``"id": null``) is a bad record, as other ids that are neither a string nor an integer: the
record would be known by its line number while its output says ``"id": null``. A record of a
specbatch output (``is_output``) is the exception: it echoes a table row's empty id cell as
null, so an output read back (``analyze``, ``predict-eval``, the input of another job) takes it
for no id.

A ``template`` (``--template`` or a recipe's ``input.template``) builds the prompt from record
fields instead: ``"{instruction}\n\n{code}"`` becomes the user message of a one-message chat,
so the model's chat template applies as for ``messages``. A record without one of the fields
is a per-record error naming the field.
"""

from __future__ import annotations

import difflib
import json
import logging
import numbers
import os
import re
import string
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from specbatch.config import (SAMPLING_FIELDS, UNSUPPORTED_SAMPLING_FIELDS, SamplingParams,
                              context_limit_text, prompt_too_long_text)
from specbatch.io.openai_batch import is_batch_request
from specbatch.io.openai_batch import to_record as openai_batch_record

PROMPT_FIELDS = ("prompt", "messages", "turns", "prompt_token_ids")
ID_FIELDS = ("id", "question_id")
# fields `specbatch run` adds to every record of its output (docs/output.md)
OUTPUT_FIELDS = ("output", "output_token_ids", "finish_reason", "usage", "spec")
ROLES = ("system", "user", "assistant")
FORMATS = (".jsonl", ".json", ".parquet", ".csv")
_BOM = b"\xef\xbb\xbf"
INT_SAMPLING_FIELDS = ("top_k", "seed", "max_tokens", "min_tokens", "logprobs", "n")
# A field within this difflib ratio of a known name (lower case, '-' and ' ' read as '_') is
# taken for a typo of it: 0.9 catches "temprature", "max_token", "prompts"; it spares metadata
# such as "speed" (0.89 to "seed"), "top" (0.86 to "stop"), "num_tokens" (0.8 to "min_tokens").
NEAR_MISS_CUTOFF = 0.9


@dataclass(frozen=True)
class Record:
    """One valid input record.

    index: 0-based position among the valid records, in input order (the output order).
    line: 1-based position in the input, of the kind ``unit`` names.
    id: from ``--id-field``, else ``id``, else ``question_id``, else the line number.
    fields: the record as read, echoed into the output.
    Exactly one of ``prompt`` (plain text), ``messages`` (chat list of {role, content}),
    ``turns`` (user turns, generated in order, each answer fed back) and ``prompt_token_ids``
    (the prompt's token ids as given, vLLM's ``TokensPrompt``: no tokenizer, no chat template;
    checked against the model's vocabulary by ``check_token_ids``) is set.
    sampling: the run defaults overridden by the record's own sampling fields.
    id_from_line: the record has no id, so ``id`` is its line number.
    unit: what ``line`` counts: ``line`` (of JSON text), ``element`` (of a JSON array),
        ``row`` (of a table) or ``prompt`` (of ``LLM.generate``'s list, ``records_from_rows``).
    """

    index: int
    line: int
    id: str | int
    fields: dict
    prompt: str | None
    messages: list[dict] | None
    turns: list[str] | None
    sampling: SamplingParams
    id_from_line: bool = False
    unit: str = "line"
    prompt_token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RecordError:
    """A record (or, with ``line == 0``, the whole file) that cannot run. unit: what ``line``
    counts, as ``Record.unit``.

    Shown as ``path:N: id=ID: reason`` (a line), ``path: element N: ...`` / ``path: row N:
    ...``, and, for the Python API's prompts (no path, unit ``prompt``), ``prompt N: reason``,
    with ``id=ID:`` only where the id is not the position N itself (a record without an id
    field is named by its position, which the message already gives)."""

    path: str
    line: int
    id: str | int | None
    reason: str
    unit: str = "line"

    def __str__(self) -> str:
        if not self.line:
            where = self.path
        elif self.unit == "line":
            where = f"{self.path}:{self.line}"
        elif not self.path:
            where = f"{self.unit} {self.line}"
        else:
            where = f"{self.path}: {self.unit} {self.line}"
        own_id = self.id is not None and not (isinstance(self.id, int) and self.id == self.line)
        who = f" id={self.id!r}:" if own_id else ""
        return f"{where}:{who} {self.reason}"


def read_records(path: str | os.PathLike, *, prompt_field: str | None = None,
                 id_field: str | None = None, split: str | None = None,
                 defaults: SamplingParams = SamplingParams(), template: str | None = None,
                 input_format: str = "auto", null_ids: bool = False,
                 data: bytes | None = None) -> tuple[list[Record], list[RecordError]]:
    """Read ``path`` and validate every record; never raises for bad input.

    ``path`` ``-`` is standard input, read as JSONL (``data``: its bytes, when the caller has
    read them already; else read here) and named ``<stdin>`` in the errors.

    Returns the valid records (``index`` 0..n-1 in input order) and the errors, in line order.
    A duplicate id (compared as text, so 7 and "7" clash) is an error on every record after the
    first, naming the first one's line. ``template`` (exclusive with ``prompt_field``) renders
    each record's user message from its fields; see the module docstring. input_format:
    ``openai-batch`` reads every line as an OpenAI batch request (``io.openai_batch``; the
    record's ``fields`` keep the request as read), ``records`` never does, ``auto`` does for
    lines with ``custom_id`` and ``body``. null_ids: take an id written as null in JSON for no
    id, as a table's empty cell always is, instead of refusing it; a record of a specbatch
    output (``is_output``), which echoes a table's nulls, is always read so.
    Raises ``ValueError`` only for a bad call: a malformed template, or both template and
    prompt_field.
    """
    p = input_name(path)
    if template is not None:
        template_fields(template)
        if prompt_field is not None:
            raise ValueError("give a prompt field or a template, not both")
    try:
        if str(path) == STDIN:
            if split is not None:
                raise _FileError("--split applies only to a dataset folder, not standard input")
            rows = list(_json_rows(_as_utf8(read_stdin() if data is None else data), ".jsonl",
                                   _STDIN_ARRAY_HINT))
        else:
            rows = list(_rows(Path(path), split, ID_FIELDS if id_field is None else (id_field,)))
    except _FileError as e:
        return [], [RecordError(p, 0, None, str(e))]
    if not rows:
        return [], [RecordError(p, 0, None, "no records")]
    unit = rows[0][0]  # one kind per file
    return _validate(p, [(n, row) for _, n, row in rows], prompt_field, id_field, defaults,
                     template, input_format, unit, null_ids=null_ids or unit == "row")


STDIN = "-"  # the INPUT that means standard input (JSONL)


def input_name(path: str | os.PathLike) -> str:
    """How errors name an input: ``<stdin>`` for ``-``, else the path as given."""
    return "<stdin>" if str(path) == STDIN else str(path)


def read_stdin() -> bytes:
    """All of standard input, as bytes (read once: a pipe cannot be read again)."""
    import sys

    stream = sys.stdin
    return stream.buffer.read() if hasattr(stream, "buffer") else stream.read().encode()


PROMPT_UNIT = "prompt"  # Record.unit of the Python API's prompts: errors say ``prompt N:``


def records_from_rows(rows: Iterable[dict], *, prompt_field: str | None = None,
                      id_field: str | None = None,
                      defaults: SamplingParams | list[SamplingParams] = SamplingParams(),
                      template: str | None = None,
                      ) -> tuple[list[Record], list[RecordError]]:
    """Validate in-memory rows (dicts in the input format: ``LLM.generate``'s prompts) as
    ``read_records`` validates a file's; row i is ``prompt i + 1`` (``PROMPT_UNIT``), which
    its errors name (``prompt 2: prompt is empty``). A row that is no dict is a bad row.
    defaults: the sampling defaults, or one per row. Raises ``ValueError`` only for a bad
    call (a malformed template, both template and prompt_field, or a ``defaults`` list of
    another length)."""
    rows = list(rows)
    if template is not None:
        template_fields(template)
        if prompt_field is not None:
            raise ValueError("give a prompt field or a template, not both")
    if isinstance(defaults, list) and len(defaults) != len(rows):
        raise ValueError(f"{len(defaults)} sampling params for {len(rows)} prompts")
    rows = [row if isinstance(row, dict) else _BadLine(
        f"expected a string or a dict, got {_a(_kind(row))}", {}) for row in rows]
    return _validate("", list(enumerate(rows, 1)), prompt_field, id_field, defaults,
                     template, unit=PROMPT_UNIT)


def _validate(p: str, rows: list, prompt_field: str | None, id_field: str | None,
              defaults: SamplingParams | list[SamplingParams], template: str | None,
              input_format: str = "auto", unit: str = "line", null_ids: bool = True,
              ) -> tuple[list[Record], list[RecordError]]:
    """Records and errors of ``rows`` (``(line, row)`` pairs, ``line`` counting ``unit``s); see
    ``read_records``. null_ids: an id field holding null counts as no id (else it is refused)."""
    records, errors, first_line = [], [], {}
    named = {prompt_field, id_field, *(template_fields(template) if template is not None else ())}
    taken = _output_ids(rows, id_field)
    for line, row in rows:
        if isinstance(row, _BadLine):
            errors.append(RecordError(p, line, _bad_line_id(row, id_field, line, null_ids),
                                      row.reason, unit))
            continue
        wide: dict[str, int] = {}
        if isinstance(row, _WideInts):
            row, wide = row.row, row.ints
        rec_id, source = None, row
        try:
            if input_format == "openai-batch" or (input_format == "auto"
                                                  and is_batch_request(row)):
                rec_id = row.get("custom_id")
                row = openai_batch_record(row)  # ValueError names unsupported body fields
            rec_id = _record_id(row, id_field, line, wide, null_ids or is_output(row))
            seen = (line, rec_id, id_field is None and all(row.get(k) is None for k in ID_FIELDS))
            if seen[2] and str(rec_id) in taken and is_output(row):  # see _output_ids
                rec_id = f"{unit} {line}"
                seen = (line, rec_id, True)
            key = str(rec_id)
            clash = _duplicate(seen, first_line[key], unit) if key in first_line else None
            if clash is not None and not seen[2]:
                raise ValueError(clash)
            first_line.setdefault(key, seen)
            _check_fields(row, named)
            if template is not None:
                if row.get("prompt_token_ids") is not None:
                    raise ValueError("prompt_token_ids is given with a template, which builds "
                                     "the prompt from the record's fields; keep one")
                prompt, messages, turns, token_ids = None, [_render(template, row)], None, None
            else:
                prompt, messages, turns, token_ids = _prompt(row, prompt_field,
                                                             cli=unit != PROMPT_UNIT)
            sampling = _sampling(row, defaults[line - 1] if isinstance(
                defaults, list) else defaults, wide)
            if clash is not None:  # a record known by its line: its own faults are named first
                raise ValueError(clash)
        except ValueError as e:
            errors.append(RecordError(p, line, rec_id, str(e), unit))
            continue
        records.append(Record(len(records), line, rec_id, source, prompt, messages, turns,
                              sampling, id_from_line=seen[2], unit=unit,
                              prompt_token_ids=token_ids))
    return records, errors


def _output_ids(rows: list, id_field: str | None) -> set[str]:
    """The explicit ids (as text) of the output records among ``rows``. A specbatch output
    keeps its records' order but not their input lines: an id-less record is known by its
    line in the output, which (after ``--on-error skip`` dropped earlier lines) can be another
    record's explicit id; such a record is then known as ``"line N"`` instead of being
    refused as a duplicate. In an input file the line is the record's own, and a clash is
    refused (its seed derives from its id)."""
    taken = set()
    for _, row in rows:
        row = row.row if isinstance(row, _WideInts) else row
        if isinstance(row, dict) and is_output(row):
            keys = (id_field,) if id_field is not None else ID_FIELDS
            value = next((row[k] for k in keys if row.get(k) is not None), None)
            if value is not None:
                taken.add(str(value))
    return taken


def is_output(row: dict) -> bool:
    """Whether ``row`` is a record of a specbatch output (it has every ``OUTPUT_FIELDS``): its
    other fields echo an input record, so an id field holding null is a table's empty cell,
    no id, not a null the user wrote."""
    return all(k in row for k in OUTPUT_FIELDS)


def _where(affected: list[Record]) -> tuple[str, str]:
    """What warned records' places count (``Record.unit``) and the first three places:
    ("line", "3, 7, 9, ...")."""
    lines = ", ".join(str(r.line) for r in affected[:3])
    return affected[0].unit, lines + (", ..." if len(affected) > 3 else "")


def order_warning(records: Iterable[Record]) -> str | None:
    """A one-line warning when records sample (temperature > 0) with neither an id nor a
    seed: the id falls back to the line number and the seed derives from the id, so their
    output changes when their place in the file changes. None when no record is affected."""
    affected = [r for r in records
                if r.id_from_line and r.sampling.seed is None and not r.sampling.is_greedy]
    if not affected:
        return None
    unit, where = _where(affected)
    return (f"{len(affected)} record(s) sample at temperature > 0 with no id and no seed ({unit} "
            f"{where}): their seed derives from the {unit} number, so their output changes if "
            "their place in the file changes; give each an id or a seed")


def greedy_samples_warning(records: Iterable[Record]) -> str | None:
    """A one-line warning when records ask for several samples (n > 1) at temperature 0:
    greedy decoding gives each the same tokens. None when no record is affected."""
    affected = [r for r in records if r.sampling.n > 1 and r.sampling.is_greedy]
    if not affected:
        return None
    unit, where = _where(affected)
    return (f"{len(affected)} record(s) ask for n > 1 samples at temperature 0 ({unit} {where}): "
            "greedy samples are identical; set a temperature > 0 for different ones")


def check_lengths(records: Iterable[Record], count_tokens: Callable[[Record], int],
                  max_model_len: int, path: str | os.PathLike, *, tokenizer=None,
                  limit_setting: str | None = None) -> list[RecordError]:
    """Errors for records whose prompt leaves no room for a completion token.

    count_tokens: prompt tokens of a record as the model will see it (chat template applied;
        for ``turns``, the first turn: later turns grow with the answers and are capped at run
        time). max_model_len: the model's context (tokens), or the user's lower cap, whose
        setting ``limit_setting`` names (``--max-model-len``; ``config.context_limit_text``).
    tokenizer: the model's transformers tokenizer. When given, a prompt is first measured in
        bytes and refused without tokenising it (``count_tokens`` is not called) when it cannot
        fit (``min_num_tokens``): tokenising a 50 MB line took 7.8 GB and 94 s. For ``turns``
        this also refuses a record whose later turn alone cannot fit (it would fail mid-record,
        after being tokenised in full to size the batch).
    """
    errors = []
    max_bytes = max_token_bytes(tokenizer) if tokenizer is not None else 0
    for r in records:
        reason = None
        if tokenizer is not None:
            for what, text in _prompt_texts(r, tokenizer):
                num_bytes, n = min_num_tokens(text, tokenizer, max_bytes)
                if n >= max_model_len:
                    reason = (f"{what} is {num_bytes} bytes, so at least {n} tokens (no token of "
                              f"this model covers more than {max_bytes} bytes); "
                              f"{context_limit_text(max_model_len, limit_setting)}")
                    break
        if reason is None:
            n = count_tokens(r)
            if n >= max_model_len:
                reason = prompt_too_long_text(n, max_model_len, limit_setting)
        if reason is not None:
            errors.append(RecordError(str(path), r.line, r.id, reason, r.unit))
    return errors


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the bytes of text one token of ``tokenizer`` covers: its longest
    vocabulary entry, in UTF-8 bytes.

    Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen, SmolLM2) write each byte of text as one
    character of 1-2 UTF-8 bytes ("Ġ" for a space), and sentencepiece ones write a space as "▁"
    (3 bytes) and a byte as "<0xE4>": the entry is never shorter than the text it covers, so
    the bound errs on the safe side (SmolLM2: 162, for 81 bytes of text).
    """
    from specbatch.prompts import per_tokenizer

    # once per tokenizer (~25 ms for a 49k vocabulary, every ``generate`` call before)
    return per_tokenizer(_MAX_TOKEN_BYTES, tokenizer, None, lambda: max(
        len(t.encode("utf-8")) for t in tokenizer.get_vocab()))


_MAX_TOKEN_BYTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def min_num_tokens(text: str, tokenizer, max_bytes: int) -> tuple[int, int]:
    """(bytes, a lower bound on the tokens ``tokenizer`` makes of ``text``), without tokenising.

    The tokens of byte-level BPE and sentencepiece tokenizers (the Llama family's) cover every
    byte of the normalized text, and none covers more than ``max_bytes`` (``max_token_bytes``),
    so there are at least ceil(bytes / max_bytes). Bytes are counted after the tokenizer's
    normalizer, if it has one (NFKC turns a 3-byte fullwidth letter into 1 byte). A tokenizer
    whose pre-tokenizer drops text (BERT's whitespace split) would break the bound; no causal
    LM's does.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is not None:
        text = normalizer.normalize_str(text)
    num_bytes = len(text.encode("utf-8"))
    return num_bytes, -(-num_bytes // max(max_bytes, 1))


def _prompt_texts(record: Record, tokenizer) -> Iterator[tuple[str, str]]:
    """(name, text) of each prompt the record feeds, as the tokenizer will see it: the plain
    prompt, or the chat as the chat template renders it; for ``turns``, the first turn's chat,
    then each later turn's own text (the later prompt holds it, and more); none for token ids
    (``count_tokens`` counts them)."""
    if record.prompt_token_ids is not None:
        return
    if record.prompt is not None:
        yield "prompt", record.prompt
        return
    messages = (record.messages if record.messages is not None
                else [{"role": "user", "content": record.turns[0]}])
    yield "prompt", tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
    for i, turn in enumerate((record.turns or [])[1:], start=2):
        yield f"turn {i}", turn


def out_of_vocabulary(sampling: SamplingParams, vocab_size: int) -> tuple[str, list[int]] | None:
    """The first of ``stop_token_ids`` / ``logit_bias`` that names ids outside the model's
    vocabulary (``vocab_size`` token ids, 0 .. vocab_size - 1), with those ids; else None."""
    for name, ids in (("stop_token_ids", sampling.stop_token_ids),
                      ("logit_bias", [t for t, _ in sampling.logit_bias])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            return name, bad
    return None


def check_token_ids(records: Iterable[Record], vocab_size: int,
                    path: str | os.PathLike) -> list[RecordError]:
    """Errors for records whose ``prompt_token_ids``, ``stop_token_ids`` or ``logit_bias``
    name an id outside the model's vocabulary (``out_of_vocabulary``): one per record, the
    first such field named with its bad ids (the first ``MAX_IDS_SHOWN``)."""
    errors = []
    for r in records:
        bad = [t for t in r.prompt_token_ids or () if t >= vocab_size]
        found = ("prompt_token_ids", bad) if bad else out_of_vocabulary(r.sampling, vocab_size)
        if found:
            name, bad = found
            shown = ", ".join(map(str, bad[:MAX_IDS_SHOWN])) + (
                f", ... ({len(bad)} ids)" if len(bad) > MAX_IDS_SHOWN else "")
            errors.append(RecordError(str(path), r.line, r.id,
                                      f"{name} [{shown}] are not token ids of this model "
                                      f"(its vocabulary has ids 0..{vocab_size - 1})", r.unit))
    return errors


MAX_IDS_SHOWN = 10  # bad token ids a record's error lists
MAX_ERRORS_SHOWN = 20


NO_VALID_RECORDS = "error: no valid records; nothing to run."


def error_lines(errors: list[RecordError], on_error: str, level: str = "error",
                can_skip: bool = True, none_valid: bool = False) -> list[str]:
    """One line per bad record (the first ``MAX_ERRORS_SHOWN``), as the commands print them,
    then at most one summary line. level: ``error`` when they stop the run, ``warning`` when
    ``--on-error skip`` leaves them out and the run goes on. can_skip: whether the command has
    ``--on-error skip`` to suggest (``bench`` has not). none_valid: no record can run (every
    one is bad, or the input as a whole): one bad record is said by its own line alone (a JSON
    array piped as JSONL, one prompt too long: one line), several end with
    ``NO_VALID_RECORDS``; ``--on-error skip`` is not suggested (it would run nothing)."""
    lines = [f"{level}: {e}" for e in errors[:MAX_ERRORS_SHOWN]]
    if len(errors) > MAX_ERRORS_SHOWN:
        lines.append(f"... and {len(errors) - MAX_ERRORS_SHOWN} more")
    if none_valid:
        if len(errors) > 1:
            lines.append(NO_VALID_RECORDS)
    elif on_error == "fail":
        lines.append(f"{len(errors)} bad record(s); nothing was generated. Fix them"
                     + (", or pass --on-error skip to run the others." if can_skip else "."))
    return lines

class _FileError(Exception):
    """A problem with the whole file; its text is the reason shown to the user."""


@dataclass(frozen=True)
class _BadLine:
    """A line (element) that is no record. row: its fields, for its id (``_bad_line_id``):
    the object of a duplicate key (duplicate: that key), ``{}`` for valid JSON that is no
    object, None where the line is not JSON (its id, if it has one, cannot be read)."""

    reason: str
    row: dict | None = field(default=None, compare=False)
    duplicate: str | None = None


def _bad_line_id(bad: _BadLine, id_field: str | None, line: int,
                 null_ids: bool) -> str | int | None:
    """The id a bad line is reported by: as a record's (``_record_id``), so its line number
    where it has no id field (valid JSON that is no object, an object without one): an array
    line was reported as ``id: null`` while an object without an id was reported by its line.
    None where the line is not JSON (an id in it cannot be read), where the object's id is
    itself bad, as for a record, or is the duplicate key (either value may be meant)."""
    if bad.row is None or (bad.duplicate is not None and bad.duplicate in (
            (id_field,) if id_field else ID_FIELDS)):
        return None
    try:
        return _record_id(bad.row, id_field, line, {}, null_ids)
    except ValueError:
        return None


@dataclass(frozen=True)
class _WideInts:
    """A JSON object holding an integer beyond 64 bits, which orjson reads as a float.

    row: the object as orjson read it (what the output echoes). ints: top-level key -> the
    integer (or the list holding one, e.g. ``stop_token_ids``) as written, so that a checked
    field (the id, an integer sampling field) is reported as the user wrote it, not as
    ``1.2345678901234568e+29``.
    """

    row: dict
    ints: dict[str, int | list]


def _rows(path: Path, split: str | None, id_fields: tuple[str, ...] = ID_FIELDS,
          ) -> Iterator[tuple[str, int, dict | _BadLine | _WideInts]]:
    """(unit, position, row) of each record of ``path``; see ``Record.unit``. id_fields: the
    columns that may hold the id, which a CSV file keeps as text (``_csv_id_options``)."""
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
        yield from _json_rows(_as_utf8(path.read_bytes()), suffix)
        return
    if suffix == ".csv" and sum(1 for line in path.read_text(errors="replace").splitlines()
                                if line.strip()) <= 1:
        return  # no line, or a header only: "no records" (datasets' own message says less)
    import datasets  # slow import; only the columnar formats need it

    load = datasets.Dataset.from_parquet if suffix == ".parquet" else datasets.Dataset.from_csv
    quiet = logging.getLogger("datasets")  # it logs the reader's error before raising it
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        options = _csv_id_options(path, id_fields) if suffix == ".csv" else {}
        with tempfile.TemporaryDirectory() as cache_dir:  # keep the user's HF cache clean
            ds = load(str(path), cache_dir=cache_dir, keep_in_memory=True, **options)
    except Exception as e:  # any reader failure is bad input, reported, not a crash
        while e.__cause__ is not None or e.__context__ is not None:  # the reader's own error
            e = e.__cause__ or e.__context__  # (datasets wraps it: "An error occurred ...")
        raise _FileError(f"cannot read {suffix} file: {type(e).__name__}: {e}") from e
    finally:
        quiet.setLevel(level)
    text = options.get("converters", {})
    yield from _dataset_rows(ds, {name: _id_column(ds[name]) if name in id_fields
                                  else _int_column(ds[name]) for name in text})


def _csv_id_options(path: Path, id_fields: tuple[str, ...]) -> dict:
    """Options of ``datasets.Dataset.from_csv`` (those of ``pandas.read_csv``) that read the id
    columns and the integer sampling columns (``INT_SAMPLING_FIELDS``) of the CSV file ``path``
    (``converters``' keys) as text, exactly as written, an empty cell as "" (so a column is
    text in every chunk pandas reads); the other columns are typed as pandas infers them, with
    its missing-value words ("NA", "null", ...). Left alone, pandas made an id column with an
    empty cell float (1.0) and read "007" as 7, and made an integer sampling column with an
    empty cell float (``max_tokens=5.0: expected an integer``)."""
    import pandas

    names = list(pandas.read_csv(path, nrows=0).columns)  # the header, named as from_csv will
    ids = [c for c in names if c in id_fields]
    ints = [c for c in names if c in INT_SAMPLING_FIELDS and c not in ids]
    if not ids and not ints:
        return {}
    options: dict = {"converters": {c: str for c in ids + ints}}
    try:  # pandas' default missing-value words, kept for the other columns
        from pandas._libs.parsers import STR_NA_VALUES
    except ImportError:  # not where pandas kept them: its words are missing ids too
        return options
    return {**options, "keep_default_na": False,
            "na_values": {c: [] if c in ids or c in ints else sorted(STR_NA_VALUES)
                          for c in names}}


_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def _int_column(cells: Iterable[str | None]) -> list[int | float | str | None]:
    """The values of a CSV integer sampling column (``max_tokens``, ``seed``...), from its
    cells' text, each on its own (pandas typed the whole column by inference, so one empty cell
    made every value float): an empty cell or one of pandas' missing-value words ("NA",
    "null"...) is None (the field is absent: the job's default), an integer is that int (exact,
    however large: the range is checked with the field), another number is a float and any
    other text stays text, both refused as not integers by the field's check."""
    try:
        from pandas._libs.parsers import STR_NA_VALUES
    except ImportError:
        STR_NA_VALUES = set()
    values: list[int | float | str | None] = []
    for cell in cells:
        text = None if cell is None else cell.strip()
        if text is None or text == "" or cell in STR_NA_VALUES or text in STR_NA_VALUES:
            values.append(None)
        elif _INTEGER.fullmatch(text):
            values.append(int(text))
        elif _DECIMAL.fullmatch(text):
            values.append(float(text))
        else:
            values.append(cell)
    return values


_PLAIN_INTEGER = re.compile(r"-?[1-9][0-9]*|0")


def _id_column(cells: Iterable[str | None]) -> list[str | int | None]:
    """The ids of a CSV id column, from its cells' text: an empty cell is None (no id). When
    every other cell is an integer written plainly (its text is ``str(int(text))``: no '+', no
    leading zero, no blank) and they all fit one 64-bit integer column (signed, or unsigned when
    none is negative), they are those integers, as pandas typed such a column and as a Parquet
    integer column reads (so the output echoes them as JSON integers, read back the same);
    otherwise every id is its text, so "007" and "7" are two ids."""
    values = [None if v is None or v == "" else v for v in cells]
    written = [v for v in values if v is not None]
    if not written or not all(_PLAIN_INTEGER.fullmatch(v) for v in written):
        return values
    numbers = [int(v) for v in written]
    low, high = min(numbers), max(numbers)
    if not (-2**63 <= low and high < 2**63 or 0 <= low and high < 2**64):
        return values
    return [None if v is None else int(v) for v in values]


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


def _dataset_rows(ds, columns: dict[str, list] | None = None
                  ) -> Iterator[tuple[str, int, dict]]:
    """columns: name -> every row's value, in place of what ``ds`` holds (``_id_column``)."""
    for i, row in enumerate(ds):
        for name, values in (columns or {}).items():
            row[name] = values[i]
        yield "row", i + 1, row


# what a JSONL input holding a JSON array is told to do instead
_ARRAY_HINT = "a .json file may hold an array of records"
_STDIN_ARRAY_HINT = ("standard input is read as JSONL: pass the array as a .json file, or pipe "
                     "it through jq -c '.[]'")


def _json_rows(data: bytes, suffix: str, array_hint: str = _ARRAY_HINT
               ) -> Iterator[tuple[str, int, dict | _BadLine | _WideInts]]:
    """(unit, position, row) of JSON text read as ``suffix`` (``.jsonl`` or ``.json``).
    array_hint: what a ``.jsonl`` input holding a JSON array is told (``_STDIN_ARRAY_HINT``
    for standard input, which has no file name to change)."""
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    head = data.lstrip()
    ends = [i for i in (head.find(b"\n"), head.find(b"\r")) if i >= 0]
    first = head[:min(ends, default=len(head))]  # the first line that is not blank
    start = data[:len(data) - len(head)].count(_eol(data)) + 1  # its line number
    if suffix == ".jsonl":
        if head.startswith(b"[") and not _parses(first):
            raise _FileError("expected one JSON object per line, got a JSON array over several "
                             f"lines (from line {start}); {array_hint}")
    else:
        reason = ""
        try:
            whole = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            whole, reason = None, f"line {e.lineno}, column {e.colno}: {e.msg}"
        if isinstance(whole, (list, dict)) and duplicate_key(data, whole) is not None:
            # which element: read again with the pairs hook (only for such a file)
            pairs = json.loads(data, object_pairs_hook=_object_pairs)
            if isinstance(whole, dict):
                key = _first_duplicate_key(pairs)
                yield "line", start, _duplicate_key_line(key, whole)
                return
            whole = [_duplicate_key_line(_first_duplicate_key(p), item)
                     if _first_duplicate_key(p) is not None else item
                     for p, item in zip(pairs, whole)]
        if isinstance(whole, list):  # a JSON array: rows are its elements
            exact = None
            for i, item in enumerate(whole):
                if isinstance(item, _BadLine):
                    yield "element", i + 1, item
                    continue
                if not isinstance(item, dict):
                    yield "element", i + 1, _BadLine(
                        f"expected a JSON object, got {_a(_kind(item))}", {})
                    continue
                if exact is None and _may_be_wide(item):
                    exact = _exact(data)
                yield "element", i + 1, _with_wide_ints(item, exact[i] if exact else None)
            return
        if isinstance(whole, dict):  # one object, possibly spread over several lines
            yield "line", start, _with_wide_ints(whole, _exact(data) if _may_be_wide(whole)
                                                 else None)
            return
        if whole is None and head.startswith(b"[") and not _parses(first):
            raise _FileError(f"looks like a JSON array but is not valid JSON: {reason}")
    for n, row in _jsonl_rows(data, array_hint):
        yield "line", n, row


# byte order marks of the Unicode encodings other than UTF-8 (UTF-32 first: its little-endian
# mark begins with UTF-16's)
_OTHER_BOMS = ((b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
               (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"))


def _as_utf8(data: bytes) -> bytes:
    """``data``, re-encoded as UTF-8 when it starts with a UTF-16 or UTF-32 byte order mark
    (Windows PowerShell's ``>`` writes UTF-16): JSON read from it then has the same lines.
    Raises ``_FileError`` (one line, naming the encoding) when it does not decode."""
    for bom, encoding in _OTHER_BOMS:
        if data.startswith(bom):
            try:
                return data.decode(encoding).encode("utf-8")
            except UnicodeDecodeError as e:
                raise _FileError(f"starts with a {encoding.upper()} byte order mark but is not "
                                 f"valid {encoding.upper()} at byte {e.start}: convert it to "
                                 "UTF-8") from None
    if b"\x00" in data[:4096]:  # JSON text never holds a raw NUL: UTF-16/32 without a mark
        head = data[:4096]
        odd, even = head[1::2].count(0), head[0::2].count(0)
        kind = ("UTF-16 (little-endian)" if odd > 2 * even else "UTF-16 (big-endian)"
                if even > 2 * odd else "UTF-32 or binary")
        raise _FileError(f"holds NUL bytes between its characters: it looks like {kind} "
                         "without a byte order mark; convert it to UTF-8 (iconv -f ENCODING "
                         "-t UTF-8)")
    return data


_KEY_COLON = re.compile(rb'"\s*:')  # ends every object key (and nothing else outside strings)


class _DuplicateKeys(dict):
    """An object read by ``json.loads`` whose text names ``keys`` more than once."""

    keys: list[str]


def _object_pairs(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) == len(pairs):
        return obj
    seen: set[str] = set()
    dup = _DuplicateKeys(obj)
    dup.keys = [k for k, _ in pairs if k in seen or seen.add(k)]
    return dup


def _num_keys(value) -> int:
    if isinstance(value, dict):
        return len(value) + sum(_num_keys(v) for v in value.values())
    if isinstance(value, list):
        return sum(_num_keys(v) for v in value)
    return 0


def _first_duplicate_key(value) -> str | None:
    if isinstance(value, _DuplicateKeys):
        return value.keys[0]
    children = value.values() if isinstance(value, dict) else (
        value if isinstance(value, list) else ())
    for v in children:
        key = _first_duplicate_key(v)
        if key is not None:
            return key
    return None


def duplicate_key(source: bytes, value) -> str | None:
    """A key that a JSON object of ``source`` (JSON text that orjson read as ``value``) holds
    twice, else None. orjson (as the standard library) keeps the last value of a duplicate key
    silently. Cheap on the common path: every key is a string followed by ``:``, so a text
    with no more ``":`` than ``value`` has keys holds no duplicate; only a text with more
    (a duplicate, or ``\":`` inside a string) is read again with a pairs hook."""
    num_colons = len(_KEY_COLON.findall(source))
    if ((isinstance(value, dict) and num_colons <= len(value))  # the cheap test first
            or num_colons <= _num_keys(value)):
        return None
    return _first_duplicate_key(json.loads(source, object_pairs_hook=_object_pairs))


def _duplicate_key_line(key: str, row: dict) -> _BadLine:
    return _BadLine(f"duplicate key {json.dumps(key)} in a JSON object: JSON readers keep one "
                    "of the two values silently; keep the one you mean", row, key)


def _jsonl_rows(data: bytes, array_hint: str = _ARRAY_HINT
                ) -> Iterator[tuple[int, dict | _BadLine | _WideInts]]:
    for n, raw in enumerate(data.split(_eol(data)), start=1):
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
            mixed = (" (a CR ends a record inside this line: the file mixes CR-only and LF line "
                     "endings)" if b"}\r" in raw.rstrip() else "")
            # orjson reads a word starting with n, t or f as a misspelt null, true or false
            why = ("unexpected word, expected a JSON value" if e.msg.startswith("invalid literal")
                   else e.msg)
            yield n, _BadLine(f"invalid JSON at column {e.colno}: {why}{mixed}")
            continue
        if not isinstance(value, dict):
            hint = (f" ({array_hint})" if isinstance(value, list)
                    and any(isinstance(x, dict) for x in value) else "")
            yield n, _BadLine(f"expected one JSON object per line, got {_a(_kind(value))}{hint}",
                              {})
            continue
        key = duplicate_key(raw, value)
        if key is not None:
            yield n, _duplicate_key_line(key, value)
            continue
        yield n, _with_wide_ints(value, _exact(text) if _may_be_wide(value) else None)


def _eol(data: bytes) -> bytes:
    """What ends the lines of ``data``: a file with CR and no LF has classic Mac line endings (a
    raw CR cannot be inside a JSON string, so it can only end a line or be blank space); CRLF
    lines keep a CR that orjson reads as blank space."""
    return b"\r" if b"\n" not in data and b"\r" in data else b"\n"


def _may_be_wide(obj: dict) -> bool:
    """Whether a top-level value, or an element of a top-level list (``stop_token_ids``), may be
    an integer that orjson read as a float (beyond 64 bits); ``_exact`` decides."""
    return any(_wide_float(v) or (isinstance(v, list) and any(_wide_float(x) for x in v))
               for v in obj.values())


def _wide_float(v) -> bool:
    return isinstance(v, float) and abs(v) >= 2**63 and v.is_integer()


def _exact(source: str | bytes):
    """The JSON text read again by the standard library, which keeps every integer exact."""
    try:
        return json.loads(source)
    except (ValueError, RecursionError):  # orjson read it, so this is not expected
        return None


def _with_wide_ints(row: dict, exact) -> dict | _WideInts:
    """``row``, or a ``_WideInts`` with the integers ``exact`` (the same object read exactly)
    holds where ``row`` has floats: a top-level integer, or a whole list holding one."""
    if not isinstance(exact, dict):
        return row
    ints = {}
    for k, v in exact.items():
        got = row.get(k)
        if _is_int(v) and isinstance(got, float):
            ints[k] = v
        elif (isinstance(v, list) and isinstance(got, list)
              and any(_is_int(x) and isinstance(y, float) for x, y in zip(v, got))):
            ints[k] = v
    return _WideInts(row, ints) if ints else row


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _duplicate(this: tuple[int, str | int, bool], first: tuple[int, str | int, bool],
               unit: str = "line") -> str:
    """Why a record whose id was seen before is refused. this, first: (line, id, whether the id
    is the line number, for want of one), e.g. ``duplicate id '7': first seen on line 1 as 7
    (ids are compared as text)``. unit: what the line numbers count (``Record.unit``)."""
    (_, rec_id, _), (first_line, first_id, _) = this, first
    msg = f"duplicate id {rec_id!r}: first seen on {unit} {first_line}"
    notes = [f"{unit} {n} has no id and takes its {unit} number"
             for n, _, by_line in (first, this) if by_line]
    if repr(first_id) != repr(rec_id):
        msg += f" as {first_id!r}"
        notes.append("ids are compared as text")
    return msg + (f" ({'; '.join(notes)})" if notes else "")


def _record_id(row: dict, id_field: str | None, line: int, wide: dict[str, int],
               null_ids: bool = True) -> str | int:
    """wide: the record's integers beyond 64 bits (see ``_WideInts``). null_ids: an id field
    holding null counts as absent; else the first id field present holding null is refused."""
    if id_field is not None:
        if row.get(id_field) is None:
            if id_field in row and not null_ids:
                raise ValueError(f"{json.dumps(id_field)} is null; give a string or integer id")
            raise ValueError(f"missing id field {id_field!r}")
        key = id_field
    else:
        present = [k for k in ID_FIELDS if k in row and (row[k] is not None or not null_ids)]
        key = present[0] if present else None
        if key is not None and row[key] is None:
            raise ValueError(f"{json.dumps(key)} is null; give a string or integer id, or leave "
                             "the field out")
    if key in wide and _is_int(wide[key]):
        raise ValueError(f"id {wide[key]} does not fit in 64 bits; write it as a string")
    value = line if key is None else row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"id must be a string or an integer, got {_kind(value)} {value!r}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("id is an empty string")
    return value


def unsupported_fields(row: dict) -> list[str]:
    """The record's non-null fields that are sampling parameters specbatch does not apply
    (``config.UNSUPPORTED_SAMPLING_FIELDS``, less any that are now ``SAMPLING_FIELDS``), in the
    record's order."""
    return [k for k, v in row.items() if v is not None and k in UNSUPPORTED_SAMPLING_FIELDS
            and k not in SAMPLING_FIELDS]


def _check_fields(row: dict, named: set) -> None:
    """Raise ``ValueError`` for a field the user cannot mean as metadata: a sampling parameter
    specbatch does not apply, or a near-miss of a field the reader knows ("temprature"). Other
    fields are metadata and pass through. named: fields the run names (--prompt-field,
    --id-field, template fields), never near-misses."""
    bad = unsupported_fields(row)
    if bad:
        hints = {UNSUPPORTED_SAMPLING_FIELDS[k] for k in bad}
        names = ", ".join(repr(k) for k in bad)
        if len(bad) == 1 and hints != {""}:
            raise ValueError(f"unsupported sampling parameter {names}: use {hints.pop()}")
        raise ValueError(f"unsupported sampling parameter{'s' * (len(bad) > 1)} {names}: "
                         f"specbatch does not apply {'them' if len(bad) > 1 else 'it'} (rename a "
                         "field that is only metadata)")
    for k in row:
        meant = None if k in named else _near_miss(k)
        if meant is not None:
            flag = ("--id-field" if meant in ID_FIELDS
                    else "--prompt-field" if meant in PROMPT_FIELDS else None)
            also = f"pass {flag} {k}, or " if flag else ""
            raise ValueError(f"unknown field {k!r}: did you mean {meant!r}? ({also}rename a "
                             "field that is only metadata)")


_KNOWN_FIELDS = (*SAMPLING_FIELDS, *PROMPT_FIELDS, *ID_FIELDS)


def _near_miss(name: str) -> str | None:
    """The known field ``name`` is probably a typo of, else None. A near-miss: the same name
    but for case, '-', '_' and ' ' ("maxTokens", "top-p"); a plural or singular of a name of 4+
    letters ("stops", "message"); or a difflib ratio >= ``NEAR_MISS_CUTOFF``."""
    known = _KNOWN_FIELDS
    if name in known or name in UNSUPPORTED_SAMPLING_FIELDS:
        return None
    norm = name.lower().replace("-", "_").replace(" ", "_")
    for k in known:
        if k.replace("_", "") == norm.replace("_", ""):
            return k
        if len(k) >= 4 and (norm == k + "s" or norm + "s" == k):
            return k
    match = difflib.get_close_matches(norm, known, n=1, cutoff=NEAR_MISS_CUTOFF)
    return match[0] if match else None


def _prompt(row: dict, prompt_field: str | None, cli: bool = True
            ) -> tuple[str | None, list[dict] | None, list[str] | None, tuple[int, ...] | None]:
    """(prompt, messages, turns, prompt_token_ids), one of them set, from the prompt field's
    value. cli: a file's record (a missing prompt names ``--prompt-field``), not an API
    prompt."""
    if prompt_field is not None:
        if prompt_field not in row:
            raise ValueError(f"missing prompt field {prompt_field!r}")
        name = prompt_field
    else:
        given = [k for k in PROMPT_FIELDS if row.get(k) is not None]
        if len(given) > 1:
            raise ValueError(f"both {' and '.join(given)} are given; keep one")
        name = given[0] if given else None
        if name is None:
            name = next((k for k in PROMPT_FIELDS if k in row), None)
            if name is None:
                raise ValueError(f"no prompt: expected a field {', '.join(PROMPT_FIELDS)}"
                                 + (" (or choose one with --prompt-field)" if cli else ""))
    value = row[name]
    if name == "prompt_token_ids":
        return None, None, None, _token_ids(value)
    if name == "messages" and not (isinstance(value, list) and value
                                   and all(isinstance(v, dict) for v in value)):
        # the chat field's name says what it holds: a string here is a mistake, not a prompt
        raise ValueError("messages must be a list of {role, content} messages; got "
                         + _shape(value))
    if name == "turns" and not isinstance(value, list):
        # so does ``turns``: a string there would run as a raw prompt without the chat template
        raise ValueError("turns must be a list of user turns (strings), e.g. [\"...\"]; got "
                         + _shape(value) + " (a single prompt goes in \"prompt\")")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{name} is empty")
        return value, None, None, None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        for i, turn in enumerate(value):
            if not turn.strip():
                raise ValueError(f"{name}: turn {i + 1} is empty")
        return None, None, list(value), None
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return None, _messages(name, value), None, None
    if isinstance(value, list) and not value:
        raise ValueError(f"{name} is an empty list")
    ids = (" (token ids go in \"prompt_token_ids\")" if isinstance(value, list)
           and all(_is_int(v) for v in value) else "")
    raise ValueError(f"{name} must be a string, a list of strings (turns) or a list of "
                     f"{{role, content}} messages; got {_shape(value)}{ids}")


def _token_ids(value) -> tuple[int, ...]:
    """A ``prompt_token_ids`` value (vLLM's ``TokensPrompt``) as a tuple of ids; raises
    ``ValueError`` naming the first bad entry. Ids past the vocabulary are the model's to
    refuse (``check_token_ids``)."""
    if isinstance(value, tuple) or (hasattr(value, "tolist") and getattr(value, "ndim", 0) == 1):
        value = list(value.tolist() if hasattr(value, "tolist") else value)  # numpy, a tensor
    if not isinstance(value, list):
        raise ValueError(f"prompt_token_ids must be a list of token ids (integers >= 0); got "
                         f"{_a(_kind(value))}")
    if not value:
        raise ValueError("prompt_token_ids is an empty list")
    for i, t in enumerate(value):
        # numpy's integers (np.int64) are integers too
        integer = isinstance(t, numbers.Integral) and not isinstance(t, bool)
        if not (integer and t >= 0):
            raise ValueError(f"prompt_token_ids[{i}]={_as_json(int(t) if integer else t)}: "
                             "expected a token id (an integer >= 0)")
    return tuple(int(t) for t in value)


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


def text_parts(content: list) -> str | None:
    """The text of a message's content given as OpenAI content parts (``[{"type": "text",
    "text": "..."}, ...]``, joined), or None where a part is not text (an image, audio...)."""
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
               for p in content):
        return None
    return "".join(p["text"] for p in content)


def _messages(name: str, value: list[dict]) -> list[dict]:
    """The chat of ``value`` as {role, content} messages, each content a string (text parts
    joined, ``text_parts``). Raises ``ValueError`` naming the message at fault."""
    out = []
    for i, m in enumerate(value):
        role, content = m.get("role"), m.get("content")
        if "role" not in m:
            raise ValueError(f"{name}[{i}].role is missing: expected one of {', '.join(ROLES)}")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}].role={role!r}: expected one of {', '.join(ROLES)}")
        if "content" not in m:
            raise ValueError(f"{name}[{i}].content is missing: expected a string")
        if isinstance(content, list) and content:
            content = text_parts(content)
            if content is None:
                raise ValueError(f"{name}[{i}].content: only text parts are supported "
                                 '({"type": "text", "text": ...})')
        if not isinstance(content, str):
            raise ValueError(f"{name}[{i}].content must be a string or a list of text parts, "
                             f"got {_kind(content)}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "user" for m in out):
        raise ValueError(f"{name} has no user message")
    return out


def _sampling(row: dict, defaults: SamplingParams, wide: dict[str, int]) -> SamplingParams:
    """The record's sampling parameters. wide: its integers beyond 64 bits (``_WideInts``)."""
    own = {k: row[k] for k in SAMPLING_FIELDS if row.get(k) is not None}
    if not own:
        return defaults
    for k in INT_SAMPLING_FIELDS:
        if k in own and k in wide and _is_int(wide[k]):
            raise ValueError(f"invalid sampling field: {k}={wide[k]}: expected an integer "
                             "that fits in 64 bits")
    if "stop_token_ids" in own and "stop_token_ids" in wide:
        raise ValueError(f"invalid sampling field: stop_token_ids={wide['stop_token_ids']}: "
                         "expected token ids that fit in 64 bits")
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


def _as_json(value) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _shape(value) -> str:
    """``an array of string and object`` / ``an empty list`` / ``_kind(value)``."""
    if isinstance(value, list):
        kinds = sorted({_kind(v) for v in value})
        return f"an array of {' and '.join(kinds)}" if kinds else "an empty list"
    return _kind(value)


def _a(kind: str) -> str:
    """``kind`` (a ``_kind``) with its article: ``an array``, ``a number``, ``null``."""
    return kind if kind == "null" else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


def _kind(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null",
             int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


__all__ = ["Record", "RecordError", "read_records", "read_stdin", "input_name", "STDIN",
           "check_lengths", "template_fields", "order_warning", "unsupported_fields", "is_output",
           "PROMPT_FIELDS", "ID_FIELDS", "OUTPUT_FIELDS", "PROMPT_UNIT"]
