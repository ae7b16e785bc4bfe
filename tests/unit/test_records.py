"""read_records over the bad-input corpus, and a round trip through every input format."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from specbatch.config import SamplingParams
from specbatch.io.records import (Record, RecordError, check_lengths, check_token_ids,
                                  read_records)

CORPUS = Path(__file__).parents[1] / "data" / "bad_inputs"
QUESTIONS = Path(__file__).parents[3] / "shared" / "data" / "spec_bench" / "question.jsonl"

# file -> (number of valid records, [(line, reason fragment)]); line 0 is a file-level error.
# The same table, with exit statuses, is tests/data/bad_inputs/README.md.
CASES = {
    "blank_lines.jsonl": (3, []),
    "bom.jsonl": (2, []),
    "utf16.jsonl": (2, []),
    "crlf.jsonl": (2, []),
    "cr_only.jsonl": (2, []),
    "prompt_and_messages.jsonl": (2, [(2, "both prompt and messages are given; keep one"),
                                      (3, "both prompt and turns are given; keep one")]),
    "unknown_fields.jsonl": (2, [(2, "unsupported sampling parameters 'best_of', "
                                     "'use_beam_search': specbatch does not apply them"),
                                 (3, "unknown field 'temprature': did you mean 'temperature'?")]),
    "json_array.jsonl": (0, [(0, "expected one JSON object per line, got a JSON array over "
                                 "several lines (from line 1); a .json file may hold an array")]),
    "invalid_utf8.jsonl": (2, [(2, "invalid UTF-8 at byte")]),
    "truncated_json.jsonl": (2, [(3, "invalid JSON at column 32: ")]),  # then orjson's words
    "not_object.jsonl": (2, [(2, "expected one JSON object per line, got an array"),
                             (3, "expected one JSON object per line, got a string"),
                             (4, "expected one JSON object per line, got a number")]),
    "broken_array.json": (0, [(0, "looks like a JSON array but is not valid JSON")]),
    "missing_prompt.jsonl": (2, [(2, "no prompt: expected a field prompt, messages, turns")]),
    "bad_prompt_type.jsonl": (2, [(2, "a list of {role, content} messages; got null"),
                                  (3, "got number"), (4, "got object"),
                                  (5, "got an array of number")]),
    "empty_prompt.jsonl": (2, [(2, "prompt is empty"), (3, "prompt is empty"),
                               (4, "turns is an empty list"), (5, "turns: turn 2 is empty")]),
    "bad_messages.jsonl": (2, [(2, "messages[0].role='robot'"),
                               (3, "messages[0].content is missing"),
                               (4, "messages has no user message")]),
    "duplicate_keys.jsonl": (2, [(2, 'duplicate key "prompt" in a JSON object'),
                                 (3, 'duplicate key "content" in a JSON object')]),
    "duplicate_ids.jsonl": (3, [(3, "duplicate id 1: first seen on line 1"),
                                (5, "duplicate id 1: first seen on line 1")]),
    "bad_id.jsonl": (2, [(2, "id must be a string or an integer"), (3, "id is an empty string"),
                         (5, '"id" is null; give a string or integer id, or leave the field out')]),
    "bad_sampling.jsonl": (2, [(2, "invalid sampling field: temperature=-1:"),
                               (3, "invalid sampling field: top_p=2:"),
                               (4, 'invalid sampling field: max_tokens="100"'),
                               (5, "invalid sampling field: stop=5: expected a non-empty "
                                   "string or a list of non-empty strings")]),
    "empty.jsonl": (0, [(0, "no records")]),
    "header_only.csv": (0, [(0, "no records")]),
    "unknown_ext.txt": (0, [(0, "unknown input format '.txt'")]),
    "too_long.jsonl": (3, []),  # too long only once tokenised: see test_check_lengths
    "huge_prompt.jsonl": (3, []),  # too long by its bytes: see test_over_long_prompts_...
}


def test_corpus_is_covered():
    on_disk = {p.name for p in CORPUS.iterdir() if p.name != "README.md"}
    assert on_disk == set(CASES)
    readme = (CORPUS / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_corpus(name):
    num_valid, expected = CASES[name]
    records, errors = read_records(CORPUS / name)
    assert len(records) == num_valid
    assert [r.index for r in records] == list(range(num_valid))
    assert [e.line for e in errors] == [line for line, _ in expected]
    for err, (_, fragment) in zip(errors, expected):
        assert fragment in err.reason, str(err)
        assert err.path == str(CORPUS / name)
    for r in records:  # the good records are whole
        assert r.prompt or r.messages or r.turns


def test_good_lines_keep_their_line_numbers():
    records, _ = read_records(CORPUS / "blank_lines.jsonl")
    assert [(r.index, r.line, r.id) for r in records] == [(0, 1, 1), (1, 4, 2), (2, 6, 3)]
    records, _ = read_records(CORPUS / "bad_sampling.jsonl")
    assert records[1].sampling == SamplingParams(temperature=0.7, seed=3)


def test_record_error_str():
    err = RecordError("in.jsonl", 3, 7, "prompt is empty")
    assert str(err) == "in.jsonl:3: id=7: prompt is empty"
    assert str(RecordError("in.jsonl", 2, None, "bad")) == "in.jsonl:2: bad"
    assert str(RecordError("in.jsonl", 0, None, "no records")) == "in.jsonl: no records"


def test_invalid_json_names_the_line_and_the_column_in_it(tmp_path):
    """The parser sees one line at a time: its "line 1" is no news; the column is, in
    characters (not bytes) from 1. After the colon comes orjson's own wording, which changes
    between releases ("unexpected character" in 3.8, "..., expected ',' or '}'" in 3.13): the
    test checks only what specbatch adds (file, line, column) and that some reason follows."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n\n{"id": 2, "prompt": "é" x}\n',
                    encoding="utf-8")
    _, errors = read_records(path)
    assert len(errors) == 1
    head, _, why = str(errors[0]).partition("invalid JSON at column 25: ")
    assert head == f"{path}:3: " and why.strip(), str(errors[0])
    assert '{"id": 2, "prompt": "é" x}'[25 - 1] == "x"
    path = tmp_path / "in.json"
    path.write_text('[\n{"id": 1, "prompt": "a"},\n{"id": 2 "prompt": "b"}\n]\n')
    _, errors = read_records(path)  # a broken array: line and column in the file
    assert len(errors) == 1
    head, _, why = str(errors[0]).partition("line 3, column 10: ")
    assert head == f"{path}: looks like a JSON array but is not valid JSON: " and why.strip(), \
        str(errors[0])


def test_integers_beyond_64_bits_are_reported_as_written(tmp_path):
    """orjson reads an integer beyond 64 bits as a float; the message shows the integer."""
    big = 123456789012345678901234567890
    rows = ['{"id": 1, "prompt": "a", "seed": 18446744073709551615}',
            f'{{"id": 2, "prompt": "a", "seed": {big}}}',
            f'{{"id": 3, "prompt": "a", "max_tokens": -{big}}}',
            f'{{"id": {big}, "prompt": "a"}}',
            '{"id": 5, "prompt": "a", "seed": 1e30}']
    for name, text in [("in.jsonl", "\n".join(rows)), ("in.json", f"[{','.join(rows)}]")]:
        path = tmp_path / name
        path.write_text(text)
        records, errors = read_records(path)
        at = f"{path}:" if name == "in.jsonl" else f"{path}: element "
        assert [(r.id, r.sampling.seed) for r in records] == [(1, 2**64 - 1)]
        assert [str(e) for e in errors] == [
            f"{at}2: invalid sampling field: seed={big}: expected an integer that "
            "fits in 64 bits",
            f"{at}3: invalid sampling field: max_tokens=-{big}: expected an integer "
            "that fits in 64 bits",
            f"{at}4: id {big} does not fit in 64 bits; write it as a string",
            f"{at}5: invalid sampling field: seed=1e+30: expected an integer that "
            "fits in 64 bits"]


def _read_lines(tmp_path, rows: list[str]):
    """``read_records`` of a JSONL file holding ``rows``, one per line."""
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return read_records(path)


def test_bad_values_are_named_as_written(tmp_path):
    """A missing message key is said to be missing (not "null"); a bad ``logit_bias`` or
    ``stop`` is shown as the JSON the record holds (not the tuple it is read into), and so is
    every other bad value (``true``, ``"hot"``, not Python's ``True``, ``'hot'``); ``stop``
    says a string is accepted too. One line each, naming the input line."""
    rows = ['{"id": 1, "messages": [{"role": "user"}]}',
            '{"id": 2, "messages": [{"role": "user", "content": null}]}',
            '{"id": 3, "messages": [{"content": "hi"}]}',
            '{"id": 4, "prompt": "a", "logit_bias": {"5": 200}}',
            '{"id": 5, "prompt": "a", "logit_bias": {"x": 1}}',
            '{"id": 6, "prompt": "a", "stop": ["a", ""]}',
            '{"id": 7, "prompt": "a", "stop": 5}',
            '{"id": 8, "prompt": "a", "stop_token_ids": [1, -2]}',
            '{"id": 9, "prompt": "a", "stop": "END", "logit_bias": {"5": -100}}',
            '{"id": 10, "prompt": "a", "max_tokens": true}',
            '{"id": 11, "prompt": "a", "temperature": "hot"}',
            '{"id": 12, "prompt": "a", "response_format": {"type": "json_schema", '
            '"json_schema": 5}}']
    records, errors = _read_lines(tmp_path, rows)
    assert [r.id for r in records] == [9]
    bias = 'expected an object {"token id": bias} with ids >= 0 and biases in [-100, 100]'
    stop = "expected a non-empty string or a list of non-empty strings"
    assert [e.reason for e in errors] == [
        "messages[0].content is missing: expected a string",
        "messages[0].content must be a string or a list of text parts, got null",
        "messages[0].role is missing: expected one of system, user, assistant",
        f'invalid sampling field: logit_bias={{"5": 200}}: {bias}',
        f'invalid sampling field: logit_bias={{"x": 1}}: {bias}',
        f'invalid sampling field: stop=["a", ""]: {stop}',
        f"invalid sampling field: stop=5: {stop}",
        "invalid sampling field: stop_token_ids=[1, -2]: expected token ids (integers >= 0)",
        "invalid sampling field: max_tokens=true: expected an integer >= 1",
        'invalid sampling field: temperature="hot": expected a finite number >= 0',
        'invalid sampling field: response_format={"type": "json_schema", "json_schema": 5}: '
        'expected json_schema to be an object with a "schema" object']
    path = tmp_path / "in.jsonl"
    assert all("\n" not in str(e) and str(e).startswith(f"{path}:{e.line}: ") for e in errors)


def test_message_content_as_text_parts(tmp_path):
    """OpenAI's content parts: text parts are joined, as in a batch body (where they were
    accepted while a plain record refused them: "content must be a string, got array"); any
    other part is refused by name."""
    rows = ['{"id": 1, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"},'
            ' {"type": "text", "text": " there"}]}]}',
            '{"id": 2, "messages": [{"role": "user", "content": [{"type": "image_url", '
            '"image_url": {"url": "x"}}]}]}']
    records, errors = _read_lines(tmp_path, rows)
    assert [r.messages for r in records] == [[{"role": "user", "content": "Hi there"}]]
    assert [e.reason for e in errors] == [
        'messages[0].content: only text parts are supported ({"type": "text", "text": ...})']


def test_ids_are_compared_as_text(tmp_path):
    """7 and "7" are one id (analyze --compare matches records by the id's text); a record
    without an id takes its line number. The message says which applies."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 7, "prompt": "a"}\n{"id": "7", "prompt": "b"}\n{"prompt": "c"}\n'
                    '{"id": "3", "prompt": "d"}\n{"id": 7, "prompt": "e"}\n')
    records, errors = read_records(path)
    assert [r.id for r in records] == [7, 3]
    assert [str(e) for e in errors] == [
        f"{path}:2: id='7': duplicate id '7': first seen on line 1 as 7 (ids are compared as "
        "text)",
        f"{path}:4: id='3': duplicate id '3': first seen on line 3 as 3 (line 3 has no id and "
        "takes its line number; ids are compared as text)",
        f"{path}:5: id=7: duplicate id 7: first seen on line 1"]


def test_a_record_known_by_its_line_is_refused_for_its_own_fault_first(tmp_path):
    """A record without an id takes its line number, which can be an earlier record's id: where
    the record is bad anyway (no prompt here) that is what its error says; where it is sound,
    the clash (either way the clashing record is refused, the first one kept)."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 2, "prompt": "a"}\n{"note": "b"}\n{"id": 3, "prompt": "c"}\n'
                    '{"id": 5, "prompt": "d"}\n{"prompt": "e"}\n')
    records, errors = read_records(path)
    assert [r.id for r in records] == [2, 3, 5]
    assert [(e.line, e.reason.split(":")[0]) for e in errors] == [
        (2, "no prompt"), (5, "duplicate id 5")]
    assert "line 5 has no id and takes its line number" in errors[1].reason


def test_a_word_that_is_not_json_is_named_so(tmp_path):
    """A line starting with a word orjson reads as a misspelt null / true / false ("not json",
    "trash") is "an unexpected word" (orjson: "invalid literal, expected 'null'")."""
    path = tmp_path / "in.jsonl"
    path.write_text('not json\n{"prompt": "a"}\ntrash\n')
    records, errors = read_records(path)
    assert len(records) == 1
    assert [(e.line, e.reason) for e in errors] == [
        (1, "invalid JSON at column 1: unexpected word, expected a JSON value"),
        (3, "invalid JSON at column 1: unexpected word, expected a JSON value")]


def test_check_lengths():
    path = CORPUS / "too_long.jsonl"
    records, errors = read_records(path)
    assert errors == []
    errors = check_lengths(records, lambda r: len(r.prompt.split()), 128, path)
    assert [(e.line, e.id, e.reason) for e in errors] == [
        (2, 2, "prompt is 301 tokens; the model's context is 128")]
    assert check_lengths(records, lambda r: 127, 128, path) == []
    assert len(check_lengths(records, lambda r: 128, 128, path)) == 3  # no room to generate


def test_check_token_ids(tmp_path):
    """A stop token id the model does not have is a bad record (it used to crash sampling with
    an IndexError once min_tokens banned it)."""
    path = _write_jsonl(tmp_path / "stop.jsonl", [
        {"id": "a", "prompt": "x", "stop_token_ids": [5, 99]},
        {"id": "b", "prompt": "x", "stop_token_ids": [100, 7, 12345678901234567890]},
        {"id": "c", "prompt": "x"}])
    records, errors = read_records(path)
    assert errors == []
    errors = check_token_ids(records, 100, path)
    assert [(e.line, e.id, e.reason) for e in errors] == [
        (2, "b", "stop_token_ids [100, 12345678901234567890] are not token ids of this model "
                 "(its vocabulary has ids 0..99)")]


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def test_prompt_field_shapes_and_ids(tmp_path):
    rows = [{"key": "a", "q": "plain text"},
            {"key": "b", "q": ["turn one", "turn two"]},
            {"key": "c", "q": [{"role": "user", "content": "hi", "name": None}]},
            {"key": "d", "prompt": "not used"}]
    records, errors = read_records(_write_jsonl(tmp_path / "in.jsonl", rows),
                                   prompt_field="q", id_field="key")
    assert [(r.id, r.prompt, r.turns, r.messages) for r in records] == [
        ("a", "plain text", None, None),
        ("b", None, ["turn one", "turn two"], None),
        ("c", None, None, [{"role": "user", "content": "hi"}])]
    assert [(e.line, e.id, e.reason) for e in errors] == [(4, "d", "missing prompt field 'q'")]
    assert records[2].fields == rows[2]

    records, errors = read_records(tmp_path / "in.jsonl", prompt_field="q", id_field="nope")
    assert records == [] and {e.reason for e in errors} == {"missing id field 'nope'"}


def test_id_fallbacks_and_sampling_defaults(tmp_path):
    rows = [{"id": "x", "question_id": 9, "prompt": "a"},
            {"question_id": 9, "prompt": "b", "max_tokens": 5, "stop": "END"},
            {"prompt": "c", "temperature": None}]
    defaults = SamplingParams(temperature=0.5, max_tokens=64)
    records, errors = read_records(_write_jsonl(tmp_path / "in.jsonl", rows), defaults=defaults)
    assert errors == []
    assert [r.id for r in records] == ["x", 9, 3]  # id, else question_id, else the line
    assert records[0].sampling is defaults
    assert records[1].sampling == SamplingParams(temperature=0.5, max_tokens=5, stop=("END",))
    assert records[2].sampling == defaults  # null means "not set"


def test_a_null_id_in_json_is_a_bad_record(tmp_path):
    """``"id": null`` was taken for no id: the line number became the id while the output kept
    ``"id": null``. Written in JSON it is refused as other bad ids are (as OpenAI batch refuses
    a null ``custom_id``); a missing id still takes the line number."""
    rows = [{"id": 1, "prompt": "a"}, {"prompt": "b"}, {"id": None, "prompt": "c"},
            {"question_id": None, "prompt": "d"}, {"id": 5, "question_id": None, "prompt": "e"},
            {"id": None, "question_id": 6, "prompt": "f"}]
    path = _write_jsonl(tmp_path / "in.jsonl", rows)
    records, errors = read_records(path)
    assert [(r.id, r.line) for r in records] == [(1, 1), (2, 2), (5, 5)]
    why = "is null; give a string or integer id, or leave the field out"
    assert [str(e) for e in errors] == [f'{path}:3: "id" {why}', f'{path}:4: "question_id" {why}',
                                        f'{path}:6: "id" {why}']
    array = tmp_path / "in.json"
    array.write_bytes(orjson.dumps(rows[:3]))
    _, errors = read_records(array)
    assert [str(e) for e in errors] == [f'{array}: element 3: "id" {why}']
    _, errors = read_records(_write_jsonl(tmp_path / "key.jsonl", [
        {"key": None, "prompt": "a"}, {"prompt": "b"}]), id_field="key")
    assert [e.reason for e in errors] == ['"key" is null; give a string or integer id',
                                          "missing id field 'key'"]
    # a specbatch output echoes its input's fields: analyze reads them back as they were
    records, errors = read_records(path, null_ids=True)
    assert errors == [] and [r.id for r in records] == [1, 2, 3, 4, 5, 6]


def test_an_empty_id_cell_of_a_table_is_no_id(tmp_path):
    """A table cannot leave a field out of one row: its empty cell reads as null, no id."""
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "in.parquet"
    datasets.Dataset.from_list([{"id": 1, "prompt": "a"},
                                {"id": None, "prompt": "b"}]).to_parquet(str(path))
    records, errors = read_records(path)
    assert errors == [] and [(r.id, r.id_from_line) for r in records] == [(1, False), (2, True)]


def _read_csv(tmp_path, text: str, **kwargs):
    path = tmp_path / "in.csv"
    path.write_text(text)
    return read_records(path, **kwargs)


def test_a_csv_id_column_keeps_its_text(tmp_path):
    """A CSV's id column was typed by inference: an empty cell made it float (every id "got
    number 1.0", a bad record) and "007" became 7 (then a duplicate of "7"). An id column is
    read as text: an empty cell is no id; a column of plain integers (no sign, leading zero or
    blank, 64 bits) is read as integers, as a Parquet integer column and the JSON ids they are
    written as in the output; any other column keeps its text as written."""
    pytest.importorskip("datasets")
    records, errors = _read_csv(tmp_path, "id,prompt\n1,hello\n,world\n3,again\n")
    assert errors == []
    assert [(r.id, r.id_from_line, r.fields["id"]) for r in records] == [
        (1, False, 1), (2, True, None), (3, False, 3)]
    records, errors = _read_csv(tmp_path, "id,prompt\n007,hello\n7,world\n")
    assert errors == [] and [r.id for r in records] == ["007", "7"]
    assert [r.fields["id"] for r in records] == ["007", "7"]
    # only an empty cell is no id: pandas' other missing-value words are ids as written
    records, errors = _read_csv(tmp_path, "id,prompt\nNA,a\nnull,b\n,c\nNone,d\n-0,e\n")
    assert errors == [] and [r.id for r in records] == ["NA", "null", 3, "None", "-0"]
    records, errors = _read_csv(tmp_path, "id,prompt\n-5,a\n+6,b\n")
    assert errors == [] and [r.id for r in records] == ["-5", "+6"]
    records, errors = _read_csv(tmp_path, "id,prompt\n-5,a\n6,b\n1.0,c\n")
    assert errors == [] and [r.id for r in records] == ["-5", "6", "1.0"]
    records, errors = _read_csv(tmp_path, f"id,prompt\n-5,a\n{2**63},b\n")
    assert errors == [] and [r.id for r in records] == ["-5", str(2**63)]
    records, errors = _read_csv(tmp_path, f"id,prompt\n5,a\n{2**64 - 1},b\n")
    assert errors == [] and [r.id for r in records] == [5, 2**64 - 1]
    # the question_id fallback and --id-field columns alike; other columns are typed as before
    records, errors = _read_csv(tmp_path, "question_id,prompt,n\n01,a,1\n,b,2\n")
    assert errors == [] and [r.id for r in records] == ["01", 2]
    assert [r.fields["n"] for r in records] == [1, 2]
    records, errors = _read_csv(tmp_path, "key,id,prompt\n0042,5,a\n,5.5,b\n", id_field="key")
    assert [r.id for r in records] == ["0042"] and [e.reason for e in errors] == [
        "missing id field 'key'"]
    assert records[0].fields["id"] == 5.0  # not the id column: inferred, as before
    records, errors = _read_csv(tmp_path, "id,prompt\n,a\n,b\n")
    assert errors == [] and [(r.id, r.fields["id"]) for r in records] == [(1, None), (2, None)]


def test_a_csv_id_column_keeps_one_type_over_reader_chunks(tmp_path):
    """pandas reads a CSV in chunks of 10,000 rows: a chunk of empty ids must not change the
    column's type."""
    pytest.importorskip("datasets")
    n = 10_001
    text = "id,prompt\n" + "".join(f"{i:03d},p\n" for i in range(5)) + ",p\n" * (n - 5)
    records, errors = _read_csv(tmp_path, text)
    assert errors == [] and len(records) == n
    assert [r.id for r in records[:6]] == ["000", "001", "002", "003", "004", 6]
    text = "id,prompt\n" + ",p\n" * (n - 1) + "x,p\n"
    records, errors = _read_csv(tmp_path, text)
    assert errors == [] and records[-1].id == "x" and records[0].id == 1


def test_a_csv_integer_sampling_column_with_an_empty_cell_stays_integer(tmp_path):
    """pandas typed a CSV's sampling columns by inference: an empty cell made an integer column
    float, so ``max_tokens`` 5 became 5.0, a bad record (``max_tokens=5.0: expected an
    integer``). Each integer field's cell is read on its own: an empty cell (or a missing-value
    word) is the field absent (the job default), ``5`` is 5; a float field stays float."""
    pytest.importorskip("datasets")
    text = ("prompt,max_tokens,seed,top_k,n,min_tokens,logprobs,temperature\n"
            "a,5,,3,,2,,0.5\n"
            f"b,,{2**63 + 1},,2,,1,\n"
            "c,NA,7,null,1,,,1\n")
    defaults = SamplingParams(max_tokens=9, top_k=4)
    records, errors = _read_csv(tmp_path, text, defaults=defaults)
    assert errors == []
    got = [(s.max_tokens, s.seed, s.top_k, s.n, s.min_tokens, s.logprobs, s.temperature)
           for s in (r.sampling for r in records)]
    assert got == [(5, None, 3, 1, 2, None, 0.5), (9, 2**63 + 1, 4, 2, 0, 1, 0.0),
                   (9, 7, 4, 1, 0, None, 1.0)]
    assert all(type(v) is int for v in got[1][:5] if v is not None)
    assert records[0].fields["max_tokens"] == 5 and records[1].fields["max_tokens"] is None
    assert type(records[0].fields["max_tokens"]) is int
    # a cell that is not an integer is still a bad record, shown as written
    records, errors = _read_csv(tmp_path, "prompt,max_tokens\na,5\nb,\nc,5.5\nd,many\n")
    assert [r.sampling.max_tokens for r in records] == [5, 128]
    assert [(e.line, e.reason) for e in errors] == [
        (3, "invalid sampling field: max_tokens=5.5: expected an integer >= 1"),
        (4, 'invalid sampling field: max_tokens="many": expected an integer >= 1')]
    # a reader chunk (10,000 rows) of empty cells does not change the column's type
    n = 10_001
    records, errors = _read_csv(tmp_path, "prompt,seed\n" + "p,\n" * (n - 1) + "p,3\n")
    assert errors == [] and len(records) == n
    assert records[0].sampling.seed is None and records[-1].sampling.seed == 3


def test_an_output_of_a_table_job_with_missing_ids_reads_back(tmp_path, tiny_gguf):
    """A table row with no id (an empty cell) is echoed as ``"id": null`` in the output. Reading
    that output back works: a resume gives the bytes of an uninterrupted run, ``analyze``
    reads every record, and the output read as records (``predict-eval``, or as the input of
    another job) takes the null for no id, since a specbatch output only echoes a table's
    empty cell: it was a bad record (``"id" is null``). A null id written by hand is still
    one."""
    import json

    from click.testing import CliRunner

    from specbatch.analyze.load import load_run
    from specbatch.cli import main

    model = tiny_gguf
    src = tmp_path / "in.csv"
    src.write_text("id,prompt\n007,hello\n,world\n7,again\n")
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "-o", str(out), "--model", str(model), "--cache-dir",
            str(tmp_path / "c"), "--method", "ngram", "--max-tokens", "4", "--no-progress"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    whole = out.read_bytes()
    lines = whole.decode().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["007", None, "7"]
    out.unlink()  # as if killed after the first two records
    (tmp_path / "out.jsonl.work.jsonl").write_text("".join(
        json.dumps({"index": i, "record": json.loads(lines[i])}) + "\n" for i in (1, 0)))
    resumed = CliRunner().invoke(main, args)
    assert resumed.exit_code == 0, resumed.output
    assert "resuming: 2 of 3 records" in resumed.output and out.read_bytes() == whole

    run = load_run(out)
    assert run.problems == [] and [r.id for r in run.records] == ["007", 2, "7"]
    records, errors = read_records(out)
    assert errors == [] and [(r.id, r.id_from_line) for r in records] == [
        ("007", False), (2, True), ("7", False)]
    assert records[1].fields["id"] is None  # echoed again as it was
    path = _write_jsonl(tmp_path / "hand.jsonl", [{"id": None, "prompt": "a", "output": "x"}])
    _, errors = read_records(path)
    assert [e.reason for e in errors] == [
        '"id" is null; give a string or integer id, or leave the field out']


def test_an_id_less_output_record_never_clashes_with_an_explicit_id(tmp_path):
    """An output keeps its records' order, not their input lines: after ``--on-error skip``
    the id-less record on output line 1 would take id 1, which the next record has; ``analyze``
    dropped one as a duplicate. It is known as ``"line 1"`` instead (only where it clashes);
    in an input file the same clash is still refused (a record's seed derives from its id)."""
    from specbatch.analyze.load import load_run

    out = {"output": "x", "output_token_ids": [1], "finish_reason": "length",
           "usage": {"prompt_tokens": 1, "completion_tokens": 1},
           "spec": {"num_steps": 1, "num_drafts": 0, "num_draft_tokens": 0,
                    "num_accepted_tokens": 0}}
    rows = [{"prompt": "a"}, {"id": 1, "prompt": "b"}, {"prompt": "c"}]
    path = _write_jsonl(tmp_path / "out.jsonl", [{**r, **out} for r in rows])
    records, errors = read_records(path)
    assert errors == [] and [r.id for r in records] == ["line 1", 1, 3]
    assert [r.id for r in load_run(path).records] == ["line 1", 1, 3]
    _, errors = read_records(_write_jsonl(tmp_path / "in.jsonl", rows))
    assert [e.line for e in errors] == [2] and "duplicate id 1" in errors[0].reason


def test_missing_file(tmp_path):
    records, errors = read_records(tmp_path / "nope.jsonl")
    assert records == [] and errors[0].reason == "no such file or folder"


def test_spec_bench_questions():
    if not QUESTIONS.exists():
        pytest.skip("shared spec_bench data not present")
    records, errors = read_records(QUESTIONS)
    assert errors == [] and len(records) == 480
    assert records[0].id == 81 and len(records[0].turns) == 2 and records[0].prompt is None
    assert [r.line for r in records] == list(range(1, 481))


# ----- one tiny dataset through every input format -----

ROWS = [
    {"id": 1, "prompt": "Say hi.", "messages": None, "temperature": 0.5, "stop": None},
    {"id": 2, "prompt": None, "messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Name a fruit."}],
     "temperature": None, "stop": ["\n"]},
    {"id": 3, "prompt": "Count to three.", "messages": None, "temperature": None, "stop": None},
]
CSV_ROWS = [{"id": r["id"], "prompt": r["prompt"] or "Name a fruit.",
             "temperature": r["temperature"]} for r in ROWS]


def _summary(records: list[Record]) -> list[tuple]:
    return [(r.index, r.line, r.id, r.prompt, r.messages, r.turns, r.sampling) for r in records]


def _dataset(rows):
    datasets = pytest.importorskip("datasets")
    return datasets.Dataset.from_list(rows)


def _reference(tmp_path, rows):
    records, errors = read_records(_write_jsonl(tmp_path / "reference.jsonl", rows))
    assert errors == [] and len(records) == len(rows)
    return _summary(records)


@pytest.mark.parametrize("fmt", ["jsonl", "json-lines", "json-array", "parquet", "disk",
                                 "disk-dict", "csv"])
def test_format_round_trip(tmp_path, fmt):
    rows = CSV_ROWS if fmt == "csv" else ROWS
    ds = _dataset(rows)
    split = None
    if fmt == "jsonl":
        path = tmp_path / "in.jsonl"
        ds.to_json(path)
    elif fmt == "json-lines":
        path = tmp_path / "in.json"
        ds.to_json(path)
    elif fmt == "json-array":
        path = tmp_path / "in.json"
        path.write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    elif fmt == "parquet":
        path = tmp_path / "in.parquet"
        ds.to_parquet(path)
    elif fmt == "csv":
        path = tmp_path / "in.csv"
        ds.to_csv(path, index=False)
    elif fmt == "disk":
        path = tmp_path / "in_ds"
        ds.save_to_disk(path)
    else:
        import datasets

        path = tmp_path / "in_dd"
        datasets.DatasetDict(test=ds, other=ds.select([0])).save_to_disk(path)
        split = "test"
    records, errors = read_records(path, split=split)
    assert errors == []
    assert _summary(records) == _reference(tmp_path, rows)
    assert records[0].fields["id"] == 1


def test_dataset_dict_splits(tmp_path):
    import datasets

    ds = _dataset(CSV_ROWS)
    datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(tmp_path / "with_train")
    records, errors = read_records(tmp_path / "with_train")
    assert errors == [] and len(records) == 3  # "train" by default
    records, errors = read_records(tmp_path / "with_train", split="dev")
    assert errors[0].reason == "no split 'dev'; the dataset has splits train, test"

    datasets.DatasetDict(a=ds, b=ds).save_to_disk(tmp_path / "no_train")
    records, errors = read_records(tmp_path / "no_train")
    assert records == []
    assert errors[0].reason == "the dataset has splits a, b; choose one with --split"

    ds.save_to_disk(tmp_path / "single")
    records, errors = read_records(tmp_path / "single", split="train")
    assert records == [] and "single dataset" in errors[0].reason


# ----- where a problem is: a line of JSON text, an element of a JSON array, a row of a table -----

def test_a_jsonl_line_holding_an_array_is_refused_on_its_line(tmp_path):
    """A JSONL line must be one JSON object. A one-line file holding an array of records was
    read as an array, its second element reported as ``notobj.jsonl:2:``."""
    path = tmp_path / "notobj.jsonl"
    path.write_text('[{"prompt": "a"}, 5]\n')
    records, errors = read_records(path)
    assert records == []
    assert [str(e) for e in errors] == [
        f"{path}:1: expected one JSON object per line, got an array (a .json file may "
        "hold an array of records)"]
    path.write_text('{"id": 1, "prompt": "a"}\n\n[1, 2]\n"x"\n')
    records, errors = read_records(path)
    assert [r.id for r in records] == [1]
    assert [str(e) for e in errors] == [
        f"{path}:3: expected one JSON object per line, got an array",
        f"{path}:4: expected one JSON object per line, got a string"]


def test_a_line_that_is_no_record_is_named_by_its_line_as_a_record_without_id(tmp_path):
    """A line of JSON that is no object (an array, a string) has no id, as an object without
    one: both are known by their line number (``RecordError.id``, the ``id`` of
    OUT.errors.jsonl); an array line was ``id: null`` (fresh-user pass). A line that is not
    JSON has no id that can be read (None). A duplicate-key object keeps its own id, or none
    where the id is the duplicated key; with ``--id-field`` no line without that field has an
    id."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "prompt": "a"}\n[1, 2]\n{"prompt": ""}\n"x"\n{bad\n'
                    '{"id": 9, "prompt": "a", "prompt": "b"}\n{"id": 9, "id": 3, "prompt": "a"}\n'
                    '{"prompt": "a", "prompt": "b"}\n')
    records, errors = read_records(path)
    assert [r.id for r in records] == [1]
    assert [(e.line, e.id) for e in errors] == [(2, 2), (3, 3), (4, 4), (5, None), (6, 9),
                                                (7, None), (8, 8)]
    assert str(errors[0]) == f"{path}:2: expected one JSON object per line, got an array"
    assert str(errors[1]) == f"{path}:3: prompt is empty"
    _, errors = read_records(path, id_field="id")
    assert [(e.line, e.id) for e in errors] == [(2, None), (3, None), (4, None), (5, None),
                                                (6, 9), (7, None), (8, None)]


def test_a_jsonl_file_holding_an_array_over_several_lines_is_refused(tmp_path):
    """Read line by line it would give an error per line and take the odd line that holds one
    whole object: one file-level error says what the file is instead."""
    path = tmp_path / "in.jsonl"
    path.write_text('\n[\n  {"id": 1, "prompt": "a"},\n  {"id": 2, "prompt": "b"}\n]\n')
    records, errors = read_records(path)
    assert records == []
    assert [str(e) for e in errors] == [
        f"{path}: expected one JSON object per line, got a JSON array over several lines (from "
        "line 2); a .json file may hold an array of records"]


def test_json_array_problems_name_the_element_not_a_line(tmp_path):
    """In a .json array a record's place is its element number, said as such (``path:N:``
    reads as line N, and the array may be on one line)."""
    path = tmp_path / "in.json"
    path.write_text('[{"id": 1, "prompt": "a"}, 5,\n {"id": 1, "prompt": "b"}, {"prompt": ""}]')
    records, errors = read_records(path)
    assert [(r.id, r.line, r.unit) for r in records] == [(1, 1, "element")]
    assert [str(e) for e in errors] == [
        f"{path}: element 2: expected a JSON object, got a number",
        f"{path}: element 3: id=1: duplicate id 1: first seen on element 1",
        f"{path}: element 4: prompt is empty"]
    path.write_text('\n\n{"id": 1,\n "prompt": ""}\n')  # one object: the line it starts on
    _, errors = read_records(path)
    assert [str(e) for e in errors] == [f"{path}:3: id=1: prompt is empty"]
    path.write_text('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n')  # JSONL in .json
    _, errors = read_records(path)
    assert [str(e) for e in errors] == [f"{path}:2: id=1: duplicate id 1: first seen on line 1"]


def test_table_problems_name_the_row_not_a_line(tmp_path):
    """A CSV's row 2 is its third line (the header is not counted): said as ``row 2``."""
    pytest.importorskip("datasets")
    path = tmp_path / "in.csv"
    path.write_text("id,prompt\n1,a\n1,b\n")
    records, errors = read_records(path)
    assert [(r.id, r.line, r.unit) for r in records] == [(1, 1, "row")]
    assert [str(e) for e in errors] == [
        f"{path}: row 2: id=1: duplicate id 1: first seen on row 1"]


def test_unreadable_columnar_files(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    records, errors = read_records(tmp_path / "bad.parquet")
    assert records == [] and errors[0].line == 0
    assert errors[0].reason.startswith("cannot read .parquet file:")
    (tmp_path / "not_a_dataset").mkdir()
    records, errors = read_records(tmp_path / "not_a_dataset")
    assert records == [] and "not a dataset folder" in errors[0].reason


def test_a_malformed_csv_says_the_readers_error_once(tmp_path, capfd):
    """An unterminated quote: datasets logged pandas' error twice on stderr, then raised its
    own ("DatasetGenerationError: An error occurred while generating the dataset"), which does
    not say where; the reason is pandas' own message, and nothing else is printed."""
    pytest.importorskip("datasets")
    path = tmp_path / "bad.csv"
    path.write_text('id,prompt\n1,hello\n2,hi\n3,"unterminated\n')
    records, errors = read_records(path)
    assert records == [] and errors[0].line == 0
    assert errors[0].reason.startswith("cannot read .csv file: ParserError: ")
    assert "EOF inside string starting at row 3" in errors[0].reason, errors[0].reason
    assert capfd.readouterr().err == ""


# ----- issue 16: fields the reader does not know, ambiguous prompts, CR files, wide ids -----

def test_unsupported_sampling_fields_are_bad_records(tmp_path):
    """A vLLM / OpenAI sampling parameter specbatch does not apply must not pass as metadata:
    the user would believe it was applied. The issue's example (n, min_p, repetition_penalty)
    stays a bad record until each becomes a SamplingParams field."""
    from specbatch.config import SAMPLING_FIELDS

    path = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "Hello", "best_of": 3, "use_beam_search": True},
        {"id": 2, "prompt": "Hello", "max_completion_tokens": 5},
        {"id": 3, "prompt": "Hello", "best_of": None},  # null counts as absent
        {"id": 4, "prompt": "Hello", "n": 3, "min_p": 0.1, "repetition_penalty": 1.2},
    ])
    records, errors = read_records(path)
    assert [str(e) for e in errors[:2]] == [
        f"{path}:1: unsupported sampling parameters 'best_of', 'use_beam_search': "
        "specbatch does not apply them (rename a field that is only metadata)",
        f"{path}:2: unsupported sampling parameter 'max_completion_tokens': use "
        "max_tokens"]
    unsupported = [k for k in ("n", "min_p", "repetition_penalty") if k not in SAMPLING_FIELDS]
    if unsupported:
        assert [r.id for r in records] == [3]
        assert errors[2].line == 4
        assert errors[2].reason.startswith(
            f"unsupported sampling parameter{'s' * (len(unsupported) > 1)} "
            + ", ".join(repr(k) for k in unsupported))
    else:
        assert [r.id for r in records] == [3, 4]


def test_llama_cpp_sampling_names_are_bad_records(tmp_path):
    """llama.cpp's names for parameters specbatch has (n_predict, repeat_penalty) ran as
    metadata: 6 tokens (--max-tokens) where the record asked for 2, no penalty, no warning."""
    path = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "Count: 1, 2, 3,", "n_predict": 2},
        {"id": 2, "prompt": "Hello", "repeat_penalty": 1.3},
        {"id": 3, "prompt": "Hello", "mirostat": 2, "tfs_z": 0.9},
        {"id": 4, "prompt": "Hello", "max_length": 3},  # transformers (and ollama's below)
        {"id": 5, "prompt": "Hello", "num_predict": 3},
    ])
    records, errors = read_records(path)
    assert records == []
    assert [str(e) for e in errors] == [
        f"{path}:1: unsupported sampling parameter 'n_predict': use max_tokens",
        f"{path}:2: unsupported sampling parameter 'repeat_penalty': use repetition_penalty",
        f"{path}:3: unsupported sampling parameters 'mirostat', 'tfs_z': specbatch does not "
        "apply them (rename a field that is only metadata)",
        f"{path}:4: unsupported sampling parameter 'max_length': use max_tokens (output tokens "
        "only)",
        f"{path}:5: unsupported sampling parameter 'num_predict': use max_tokens"]


def test_unsupported_list_names_sampling_parameters_only():
    """Supported fields drop out of the check whatever the list says; metadata names a record
    commonly carries are not on it."""
    from specbatch.config import SAMPLING_FIELDS, UNSUPPORTED_SAMPLING_FIELDS
    from specbatch.io.records import unsupported_fields

    assert "min_p" in UNSUPPORTED_SAMPLING_FIELDS or "min_p" in SAMPLING_FIELDS
    for name in ("model", "user", "metadata", "category", "stream"):
        assert name not in UNSUPPORTED_SAMPLING_FIELDS
    assert unsupported_fields({name: 1 for name in SAMPLING_FIELDS}) == []


METADATA = ["category", "question_id", "reference", "source", "task", "label", "answer", "idx",
            "index", "name", "type", "lang", "language", "meta", "metadata", "dataset", "split",
            "text", "input", "output", "instruction", "context", "response", "title", "url",
            "tags", "level", "subject", "difficulty", "step", "steps", "model", "user", "score",
            "system", "question", "query", "document", "target", "tokens", "num_tokens", "topic",
            "ids", "uid", "seq", "speed", "need", "shop", "turn_count", "prompt_id", "top"]


def test_metadata_fields_pass_through(tmp_path):
    row = {"id": 1, "prompt": "Hello", **{k: f"v-{k}" for k in METADATA if k != "question_id"}}
    records, errors = read_records(_write_jsonl(tmp_path / "in.jsonl", [row]))
    assert errors == [] and records[0].fields == row


@pytest.mark.parametrize("field,meant", [("temprature", "temperature"),
                                         ("Temperature", "temperature"),
                                         ("top-p", "top_p"), ("max_token", "max_tokens"),
                                         ("maxTokens", "max_tokens"), ("stops", "stop"),
                                         ("stop_tokens_ids", "stop_token_ids"), ("seeds", "seed"),
                                         ("prompts", "prompt"), ("message", "messages"),
                                         ("min_token", "min_tokens"), ("ignore-eos", "ignore_eos"),
                                         ("questionid", "question_id"), ("ID", "id")])
def test_near_miss_of_a_field_name_is_a_bad_record(tmp_path, field, meant):
    path = _write_jsonl(tmp_path / "in.jsonl",
                        [{"id": 1, "prompt": "Hello", field: 0.7}, {"id": 2, "prompt": "Hi"}])
    records, errors = read_records(path)
    assert [r.id for r in records] == [2]
    flag = {"prompt": "--prompt-field", "messages": "--prompt-field",
            "question_id": "--id-field", "id": "--id-field"}.get(meant)
    also = f"pass {flag} {field}, or " if flag else ""  # it may be the prompt or the id
    assert [str(e) for e in errors] == [
        f"{path}:1: unknown field {field!r}: did you mean {meant!r}? ({also}rename a "
        "field that is only metadata)"]


def test_fields_the_run_names_are_known(tmp_path):
    """--prompt-field, --id-field and template fields are known: no did-you-mean for them."""
    path = _write_jsonl(tmp_path / "in.jsonl", [{"prompts": "a", "ID": 4, "topp": "b"}])
    records, errors = read_records(path, prompt_field="prompts", id_field="ID")
    assert [e.reason for e in errors] == [
        "unknown field 'topp': did you mean 'top_p'? (rename a field that is only metadata)"]
    records, errors = read_records(path, id_field="ID", template="{prompts} {topp}")
    assert errors == [] and records[0].id == 4
    assert records[0].messages[0]["content"] == "a b"


def test_prompt_and_messages_together_are_a_bad_record(tmp_path):
    path = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        {"id": 2, "prompt": "a", "turns": ["b"]},
        {"id": 3, "prompt": "a", "messages": None},  # null counts as absent
        {"id": 4, "q": "a", "prompt": "metadata"}])
    records, errors = read_records(path)
    assert [str(e) for e in errors] == [
        f"{path}:1: both prompt and messages are given; keep one",
        f"{path}:2: both prompt and turns are given; keep one"]
    assert [r.id for r in records] == [3, 4]
    records, errors = read_records(path, prompt_field="q")  # the chosen field wins, no clash
    assert [(r.id, r.prompt) for r in records] == [(4, "a")] and len(errors) == 3


def test_cr_only_line_endings_are_read(tmp_path):
    """Old Mac line endings: every record is read, and errors name the right line."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "a"}\r{"id": 2, "prompt": "b"}\r\r'
                     b'{"id": 3, "prompt": ""}\r')
    records, errors = read_records(path)
    assert [(r.id, r.line, r.prompt) for r in records] == [(1, 1, "a"), (2, 2, "b")]
    assert [str(e) for e in errors] == [f"{path}:4: id=3: prompt is empty"]


def test_cr_inside_a_line_of_an_lf_file_is_named(tmp_path):
    """A file mixing LF lines and CR-only line ends: the broken line says why."""
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": 1, "prompt": "a"}\n'
                     b'{"id": 2, "prompt": "b"}\r{"id": 3, "prompt": "c"}\n')
    records, errors = read_records(path)
    assert [r.id for r in records] == [1] and [e.line for e in errors] == [2]
    assert errors[0].reason.startswith("invalid JSON at column 26: ")
    assert errors[0].reason.endswith(" (a CR ends a record inside this line: the file mixes "
                                     "CR-only and LF line endings)")


def test_wide_stop_token_ids_are_reported_as_written(tmp_path):
    big = 123456789012345678901234567890
    for name, text in [("in.jsonl", f'{{"id": 1, "prompt": "a", "stop_token_ids": [7, {big}]}}\n'),
                       ("in.json", f'[{{"id": 1, "prompt": "a", "stop_token_ids": [7, {big}]}}]')]:
        path = tmp_path / name
        path.write_text(text)
        records, errors = read_records(path)
        at = f"{path}:" if name == "in.jsonl" else f"{path}: element "
        assert records == []
        assert [str(e) for e in errors] == [
            f"{at}1: invalid sampling field: stop_token_ids=[7, {big}]: expected token "
            "ids that fit in 64 bits"]


class _CountingTokenizer:
    """A tokenizer whose longest token is 4 bytes ("abcd"), one word a token, and which
    fails the test if asked to tokenise a prompt the byte bound should have refused."""

    max_encode_bytes = 10_000

    def __init__(self, normalizer=None) -> None:
        self.encoded = []
        if normalizer is not None:
            from types import SimpleNamespace

            self.backend_tokenizer = SimpleNamespace(normalizer=normalizer)

    def get_vocab(self) -> dict:
        return {"a": 0, "ab": 1, "abcd": 2, "<s>": 3}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize
        return "".join(f"<s>{m['role']}\n{m['content']}\n" for m in messages) + "<s>assistant\n"

    def encode(self, text, add_special_tokens=True):
        assert len(text.encode()) < self.max_encode_bytes, "tokenised an over-long prompt"
        self.encoded.append(text)
        return text.split()


def test_over_long_prompts_are_refused_by_bytes_before_tokenising(tmp_path):
    """A prompt of more UTF-8 bytes than the context's tokens can cover (no token covers more
    than the longest vocabulary entry: 4 bytes here) is refused without tokenising it (a 50 MB
    line took 7.8 GB and 94 s to tokenise); shorter ones are counted as before."""
    path = _write_jsonl(tmp_path / "in.jsonl", [
        {"id": 1, "prompt": "x " * 200_000},  # 400,000 bytes >= 100 tokens x 4 bytes
        {"id": 2, "messages": [{"role": "user", "content": "é" * 300_000}]},
        {"id": 3, "turns": ["short", "y" * 50_000]},  # a later turn alone cannot fit
        {"id": 4, "prompt": "x " * 99},  # 99 tokens, 198 bytes: tokenised, fits
        {"id": 5, "prompt": "x " * 100},  # 100 tokens by count: no room to generate
        {"id": 6, "prompt": "xyzw" * 99},  # 396 bytes: maybe 99 tokens, tokenised (1 token)
        {"id": 7, "prompt": "xyzw" * 99 + "x"}])  # 397 bytes: at least 99.25, so 100 tokens
    records, errors = read_records(path)
    assert errors == []
    tok = _CountingTokenizer()
    count = lambda r: len(tok.encode(r.prompt)) if r.prompt else 5  # noqa: E731
    errors = check_lengths(records, count, 100, path, tokenizer=tok)
    assert [(e.line, e.reason) for e in errors] == [
        (1, "prompt is 400000 bytes, so at least 100000 tokens (no token of this model covers "
            "more than 4 bytes); the model's context is 100"),
        (2, "prompt is 600022 bytes, so at least 150006 tokens (no token of this model covers "
            "more than 4 bytes); the model's context is 100"),
        (3, "turn 2 is 50000 bytes, so at least 12500 tokens (no token of this model covers "
            "more than 4 bytes); the model's context is 100"),
        (5, "prompt is 100 tokens, leaving no room for output; the model's context is 100"),
        (7, "prompt is 397 bytes, so at least 100 tokens (no token of this model covers more "
            "than 4 bytes); the model's context is 100")]
    assert tok.encoded == ["x " * 99, "x " * 100, "xyzw" * 99]


def test_byte_bound_counts_the_text_the_tokenizer_sees(tmp_path):
    """A normalizer may shrink the text (NFKC: a 3-byte fullwidth letter becomes 1 byte): the
    bound counts the bytes after it."""
    import unicodedata
    from types import SimpleNamespace

    nfkc = SimpleNamespace(normalize_str=lambda s: unicodedata.normalize("NFKC", s))
    path = _write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "prompt": "Ａ" * 3000}])
    records, _ = read_records(path)  # 9000 bytes as written, 3000 once normalized
    tok = _CountingTokenizer(normalizer=nfkc)
    errors = check_lengths(records, lambda r: len(tok.encode(r.prompt)), 1000, path,
                           tokenizer=tok)
    assert errors == [] and len(tok.encoded) == 1


def test_messages_field_must_hold_chat_messages(tmp_path):
    """``messages`` as a string or a list of strings is a bad record (it was read as a plain
    prompt / turns by its shape, without the chat template); ``--prompt-field`` naming another
    field keeps the shape rule."""
    rows = ['{"id": 1, "messages": "hello"}',
            '{"id": 2, "messages": ["hello"]}',
            '{"id": 3, "messages": []}',
            '{"id": 4, "messages": [{"role": "user", "content": "hi"}]}']
    records, errors = _read_lines(tmp_path, rows)
    assert [r.id for r in records] == [4]
    expected = "messages must be a list of {role, content} messages; got "
    assert [e.reason for e in errors] == [expected + "string", expected + "an array of string",
                                          expected + "an empty list"]
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": 1, "chat": "hello"}\n')
    records, errors = read_records(other, prompt_field="chat")
    assert errors == [] and records[0].prompt == "hello"


def test_sampling_params_take_the_python_forms_vllm_users_write():
    """``stop`` as a string or list, ``stop_token_ids`` as a list, ``logit_bias`` as a dict
    (int or string ids): read into the tuples the engine uses; a bad ``response_format`` shape
    is refused at construction, as in a record."""
    from specbatch.config import ConfigError

    sp = SamplingParams(stop=["\n", "END"], stop_token_ids=[2, 7], logit_bias={5: 1, "3": -2})
    assert sp.stop == ("\n", "END") and sp.stop_token_ids == (2, 7)
    assert sp.logit_bias == ((3, -2.0), (5, 1.0))
    assert SamplingParams(stop="x").stop == ("x",)
    assert hash(sp) == hash(SamplingParams(stop=("\n", "END"), stop_token_ids=(2, 7),
                                           logit_bias=((3, -2.0), (5, 1.0))))
    with pytest.raises(ConfigError, match="stop=.*expected a non-empty string"):
        SamplingParams(stop=["x", ""])
    with pytest.raises(ConfigError, match="json_schema to be an object"):
        SamplingParams(response_format={"type": "json_schema", "json_schema": 5})


def test_utf16_files_are_read_and_bad_ones_named(tmp_path):
    """A UTF-16 or UTF-32 file (with its byte order mark) reads as its text, line numbers and
    all; one that does not decode is one file-level line naming the encoding, not "invalid
    UTF-8" on every line (issue 36)."""
    records, errors = read_records(CORPUS / "utf16.jsonl")
    assert errors == []
    assert [r.prompt for r in records][1] == "Name a colour. Réponds en français."
    for encoding in ("utf-16-be", "utf-32"):
        path = tmp_path / f"{encoding}.jsonl"
        bom = b"\xfe\xff" if encoding == "utf-16-be" else b""  # utf-32 writes its own
        path.write_bytes(bom + '{"prompt": "héllo"}\n\n{"prompt": 3}\n'.encode(encoding))
        records, errors = read_records(path)
        assert [r.prompt for r in records] == ["héllo"], encoding
        assert [(e.line, e.reason.endswith("got number")) for e in errors] == [(3, True)]
    path = tmp_path / "cut.jsonl"
    path.write_bytes('{"prompt": "a"}\n'.encode("utf-16") + b"\x00\xd8")  # a lone surrogate
    records, errors = read_records(path)
    assert records == [] and [str(e) for e in errors] == [
        f"{path}: starts with a UTF-16 byte order mark but is not valid UTF-16 at byte 34: "
        "convert it to UTF-8"]


def test_duplicate_keys_in_a_json_file(tmp_path):
    """A .json array names the element with a duplicate key, a single object its line; keys
    spelled with blank space before the colon are found too."""
    path = tmp_path / "a.json"
    path.write_text('[{"prompt": "a"}, {"prompt": "b", "id": 1, "id" : 2}, {"prompt": "c"}]')
    records, errors = read_records(path)
    assert [r.prompt for r in records] == ["a", "c"]
    assert [str(e) for e in errors] == [f'{path}: element 2: duplicate key "id" in a JSON '
                                        "object: JSON readers keep one of the two values "
                                        "silently; keep the one you mean"]
    path = tmp_path / "one.json"
    path.write_text('\n{"prompt": "a",\n "max_tokens": 3,\t"max_tokens"\t:\t4}')
    records, errors = read_records(path)
    assert records == [] and [(e.line, e.reason[:27]) for e in errors] == [
        (2, 'duplicate key "max_tokens" ')]


def test_sampling_params_name_bad_values_as_written():
    """A bad ``SamplingParams(...)`` value from Python is echoed as the caller wrote it (a
    dict, a list), not as the tuple it is read into; ``stop`` says a string is fine too."""
    from specbatch.config import SamplingParams

    cases = [({"logit_bias": {"x": 1}}, 'logit_bias={"x": 1}: expected an object {"token id": '
              "bias} with ids >= 0 and biases in [-100, 100]"),
             ({"logit_bias": {5: 1000}}, 'logit_bias={"5": 1000}: expected'),
             ({"stop": 5}, "stop=5: expected a non-empty string or a list of non-empty strings"),
             ({"stop": ["a", 5]}, 'stop=["a", 5]: expected a non-empty string or a list'),
             ({"stop_token_ids": [-1]}, "stop_token_ids=[-1]: expected token ids (integers >= 0)")]
    for kwargs, message in cases:
        with pytest.raises(ValueError) as e:
            SamplingParams(**kwargs)
        assert str(e.value).startswith(message), (kwargs, str(e.value))


def test_utf16_without_a_byte_order_mark_is_one_line_naming_it(tmp_path):
    """``iconv -t UTF-16LE`` writes no byte order mark: one file-level line naming UTF-16, not
    an "invalid JSON" per line plus one for the trailing NUL (fresh-user pass)."""
    for encoding, kind in (("utf-16-le", "UTF-16 (little-endian)"),
                           ("utf-16-be", "UTF-16 (big-endian)")):
        path = tmp_path / f"{encoding}.jsonl"
        path.write_bytes('{"prompt": "a"}\n{"prompt": "b"}\n'.encode(encoding))
        records, errors = read_records(path)
        assert records == [] and [str(e) for e in errors] == [
            f"{path}: holds NUL bytes between its characters: it looks like {kind} without a "
            "byte order mark; convert it to UTF-8 (iconv -f ENCODING -t UTF-8)"], encoding


def test_turns_field_must_hold_a_list_of_turns(tmp_path):
    """``turns`` as a string is a bad record (it ran as a raw prompt without the chat template,
    one output string instead of a list); a list of strings is the turns."""
    rows = ['{"id": "t4", "turns": "notalist"}',
            '{"id": "t5", "turns": ["hello", "and then?"]}']
    records, errors = _read_lines(tmp_path, rows)
    assert [r.id for r in records] == ["t5"] and records[0].turns == ["hello", "and then?"]
    assert [e.reason for e in errors] == [
        'turns must be a list of user turns (strings), e.g. ["..."]; got string '
        '(a single prompt goes in "prompt")']


def test_max_token_bytes_reads_a_vocabulary_once_until_it_grows():
    """``check_lengths`` runs on every ``generate`` call: the longest token is measured once
    per tokenizer, and again when tokens are added."""
    from specbatch.io.records import max_token_bytes

    class Tok:
        def __init__(self):
            self.vocab, self.reads = {"a": 0, "bcd": 1, "\u00e9\u00e9": 2}, 0

        def __len__(self):
            return len(self.vocab)

        def get_vocab(self):
            self.reads += 1
            return dict(self.vocab)

    tok = Tok()
    assert max_token_bytes(tok) == 4 and max_token_bytes(tok) == 4 and tok.reads == 1
    tok.vocab["longest-token"] = 3
    assert max_token_bytes(tok) == 13 and tok.reads == 2
    assert max_token_bytes(Tok()) == 4  # another tokenizer: its own


def test_an_api_prompt_without_a_prompt_names_no_cli_flag():
    """``LLM.generate``'s dicts have no ``--prompt-field`` to point at (fresh-user finding); a
    file's record still gets the hint."""
    from specbatch.io.records import records_from_rows

    _, errors = records_from_rows([{"id": 1, "text": "hi"}])
    assert [str(e) for e in errors] == [
        "prompt 1: no prompt: expected a field prompt, messages, turns, prompt_token_ids"]
