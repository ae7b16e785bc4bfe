"""The command line's own behaviour: usage errors are one ``error:`` line, a hint, exit 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specbatch.cli import main


# message: our own text, exact; or a tuple of what we put into click's sentence (the flag, the
# value, our range), since click's wording ("Invalid value for ...") may change between releases.
@pytest.mark.parametrize("args, message, command", [
    (["run", "in.jsonl", "--bogus"], ("--bogus",), "main run"),
    (["run", "in.jsonl", "--k", "99"], ("'--k'", "99", "32"), "main run"),
    (["run"], ("INPUT",), "main run"),
    (["run", "in.jsonl", "--template", "{x}", "--prompt-field", "p"],
     "error: --template and --prompt-field exclude each other", "main run"),
    (["run", "in.jsonl", "--seed", "123456789012345678901234567890"],
     ("'--seed'", "123456789012345678901234567890", "18446744073709551615"), "main run"),
    (["run", "in.jsonl", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "error: --prompt-lookup-max=2: expected an integer >= --prompt-lookup-min", "main run"),
    (["bench", __file__, "--configs", "auto:draft"],  # checked before INPUT is read
     "error: config 'auto:draft' needs --draft-model", "main bench"),
    (["frob"], ("frob",), "main"),
    (["analyze", "a.jsonl", "--batch-size", "0"], ("'--batch-size'", "0"), "main analyze"),
])
def test_usage_errors_are_one_line_and_a_hint(args, message, command):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 and lines[1] == f"try '{command} --help'", result.output
    if isinstance(message, str):
        assert lines[0] == message
    else:
        assert lines[0].startswith("error: ") and all(m in lines[0] for m in message), lines[0]


def test_no_command_still_prints_the_help():
    result = CliRunner().invoke(main, [])
    assert "Offline batch text generation" in result.output and "error:" not in result.output


def test_skipped_records_are_warnings_failing_ones_errors(tmp_path):
    """``--on-error skip`` runs the good records: the bad ones are ``warning:`` lines; with
    ``--on-error fail`` the same records stop the run and are ``error:`` lines."""
    from tests.unit.test_loader import write_tiny_gguf

    model = tmp_path / "tiny.gguf"
    write_tiny_gguf(model)
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc abc"}\n{"id": 2}\n{"id": 3, "prompt": "x"}\n')
    common = ["run", str(inp), "--model", str(model), "--cache-dir", str(tmp_path / "c"),
              "--method", "none", "--max-tokens", "2", "--no-progress"]
    bad = f"{inp}:2: id=2: no prompt"
    skip = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "s.jsonl"),
                                     "--on-error", "skip"])
    assert skip.exit_code == 0, skip.output
    assert f"warning: {bad}" in skip.output and "error:" not in skip.output
    fail = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "f.jsonl")])
    assert fail.exit_code == 2
    assert f"error: {bad}" in fail.output and "warning:" not in fail.output


def test_summary_table_tells_zero_acceptance_from_no_drafts():
    from specbatch.run import summary_table

    def out(drafts, accepted, tokens):
        return {"spec": {"num_steps": tokens - accepted, "num_drafts": drafts,
                         "num_draft_tokens": 3 * drafts, "num_accepted_tokens": accepted},
                "usage": {"completion_tokens": tokens}}

    table = summary_table({"novel": [out(4, 0, 10)], "plain": [out(0, 0, 10)]})
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert rows["novel"][-2:] == ["1.00", "0.00"]  # drafted, nothing accepted
    assert rows["plain"][-2:] == ["-", "-"]  # nothing drafted


def test_records_that_stop_with_an_error_are_reported(tmp_path):
    """A later turn that no longer fits the context ends its record with an error: the record
    is written (finish_reason "error"), and the run says so instead of a silent success."""
    import json

    from tests.unit.test_loader import write_tiny_gguf

    model = tmp_path / "m.gguf"
    write_tiny_gguf(model)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "t", "turns": ["abc", "x" * 40]}) + "\n"
                   + json.dumps({"id": "ok", "prompt": "hello"}) + "\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(model),
                                       "--cache-dir", str(tmp_path / "c"), "--method", "none",
                                       "--max-tokens", "8", "--ignore-eos", "--no-progress",
                                       "--max-model-len", "40"])
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["t"]["finish_reason"][-1] == "error" and "context" in rows["t"]["error"]
    assert f"warning: {src}:1: id='t': prompt is" in result.output, result.output
    assert "1 record(s) stopped with an error" in result.output
    assert "error" not in rows["ok"] and rows["ok"]["finish_reason"] == "length"
