"""The command line's own behaviour: usage errors are one ``error:`` line, a hint, exit 2."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from specbatch.cli import main


@pytest.mark.parametrize("args, message, command", [
    (["run", "in.jsonl", "--bogus"], "error: No such option '--bogus'.", "main run"),
    (["run", "in.jsonl", "--k", "99"],
     "error: Invalid value for '--k' / '--num-speculative-tokens': 99 is not in the range "
     "0<=x<=32.", "main run"),
    (["run"], "error: Missing argument 'INPUT'.", "main run"),
    (["run", "in.jsonl", "--template", "{x}", "--prompt-field", "p"],
     "error: --template and --prompt-field exclude each other", "main run"),
    (["frob"], "error: No such command 'frob'.", "main"),
    (["analyze", "a.jsonl", "--batch-size", "0"],
     "error: Invalid value for '--batch-size': 0 is not in the range x>=1.", "main analyze"),
])
def test_usage_errors_are_one_line_and_a_hint(args, message, command):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.splitlines() == [message, f"try '{command} --help'"], result.output


def test_no_command_still_prints_the_help():
    result = CliRunner().invoke(main, [])
    assert "Commands:" in result.output and "error:" not in result.output
