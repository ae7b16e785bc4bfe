"""The bad-input corpus through the real ``specbatch run``, with ``--on-error fail`` and ``skip``.

Expected exit statuses, bad lines and message fragments come from the corpus README's table
(the documentation a user reads). Cases that stop before the model loads run as separate
``specbatch`` processes; the ones that need the model (generation, or tokenising for
``too_long``, ``huge_prompt``) share one process (``cli_session``), which loads the model once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from specbatch.io.records import read_records
from tests.cli_helpers import (REPO, Result, assert_no_traceback, cli, cli_session,
                               read_jsonl)

CORPUS = REPO / "tests" / "data" / "bad_inputs"
EXTRA_ARGS = {"too_long.jsonl": ["--max-model-len", "128"],  # as the README's table says
              "huge_prompt.jsonl": ["--max-model-len", "128"]}
FAST_ARGS = ["--method", "ngram", "--max-tokens", "4", "--max-batch-size", "4", "--no-progress"]


@dataclass(frozen=True)
class Case:
    name: str
    bad_lines: tuple[int, ...]  # () for none; (0,) for a file-level error
    fragment: str | None  # the first message fragment of the table, as a regex
    status: dict  # {"fail": int, "skip": int}

    @property
    def path(self) -> Path:
        return CORPUS / self.name

    @property
    def needs_model(self) -> dict:
        """Per mode: does the run get past validation (to generate or to tokenise)?"""
        tokenise = self.name in EXTRA_ARGS
        return {mode: self.status[mode] == 0 or tokenise for mode in ("fail", "skip")}


def _cases() -> list[Case]:
    cases = []
    for line in (CORPUS / "README.md").read_text().splitlines():
        m = re.match(r"\| `([^`]+)` \|", line)
        if not m:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name, bad, message, fail, skip = cells[0].strip("`"), cells[3], cells[4], cells[5], cells[6]
        bad_lines = (0,) if bad == "-" else tuple(int(x) for x in re.findall(r"\d+", bad))
        frag = re.search(r"`([^`]+)`", message)
        fragment = None
        if frag:  # "N" in the table stands for a number
            fragment = re.sub(r"\bN\b", r"\\d+", re.escape(frag.group(1)))
        cases.append(Case(name, bad_lines, fragment, {"fail": int(fail), "skip": int(skip)}))
    return cases


CASES = _cases()


def test_table_covers_the_corpus():
    on_disk = {p.name for p in CORPUS.iterdir() if p.name != "README.md"}
    assert {c.name for c in CASES} == on_disk


def _args(case: Case, mode: str, out: Path) -> list[str]:
    return ["run", str(case.path), "-o", str(out), "--on-error", mode, *FAST_ARGS,
            *EXTRA_ARGS.get(case.name, [])]


def _check(case: Case, mode: str, result: Result, out: Path) -> None:
    where = f"{case.name} --on-error {mode}:\n{result.stderr}"
    assert result.returncode == case.status[mode], where
    assert_no_traceback(result)
    err = result.stderr
    level = "error" if case.status[mode] else "warning"  # skipped records do not fail the run
    for line in case.bad_lines:  # every problem named by file and line ("path: reason" for 0)
        prefix = f"{case.path}:{line}:" if line else f"{case.path}:"
        assert f"{level}: {prefix}" in err, where
    if case.fragment is not None:
        assert re.search(case.fragment, err), where
    if result.returncode != 0:
        assert not out.exists() and not Path(f"{out}.work.jsonl").exists(), where
        return
    # exit 0: every good record generated, once, in input order; the bad ones listed
    records, _ = read_records(case.path)
    good = [r.fields for r in records if r.line not in case.bad_lines]
    rows = read_jsonl(out)
    assert len(rows) == len(good) > 0, where
    assert [{k: row[k] for k in fields} for row, fields in zip(rows, good)] == good, where
    for row in rows:
        assert row["finish_reason"] in ("stop", "length") and "error" not in row, row
        assert 1 <= len(row["output_token_ids"]) <= 4, row
    errors_file = Path(f"{out}.errors.jsonl")
    if case.bad_lines:
        assert [e["line"] for e in read_jsonl(errors_file)] == list(case.bad_lines), where
        assert f"skipping {len(case.bad_lines)} bad record(s)" in err, where
    else:
        assert not errors_file.exists(), where
    assert f"wrote {len(rows)} records" in result.stdout, where  # the result: stdout


@pytest.mark.parametrize("mode", ["fail", "skip"])
def test_stops_before_the_model(tmp_path, mode):
    """Cases rejected at validation: a separate ``specbatch`` process each (no model load)."""
    cases = [c for c in CASES if not c.needs_model[mode]]
    assert cases
    for case in cases:
        out = tmp_path / f"{case.name}.{mode}.out.jsonl"
        _check(case, mode, cli(*_args(case, mode, out), timeout=120), out)


@pytest.mark.slow
def test_runs_that_need_the_model(tmp_path):
    """Generation with the good records (and the tokenised length check): one process."""
    plan = [(c, mode) for c in CASES for mode in ("fail", "skip") if c.needs_model[mode]]
    assert {c.name for c, _ in plan} >= {"blank_lines.jsonl", "too_long.jsonl"}
    outs = [tmp_path / f"{c.name}.{mode}.out.jsonl" for c, mode in plan]
    results = cli_session([_args(c, mode, out) for (c, mode), out in zip(plan, outs)],
                          tmp_path / "session")
    for (case, mode), result, out in zip(plan, results, outs):
        _check(case, mode, result, out)


# ----- ordinary failures: one clear line, no traceback -----

def test_missing_input_and_bad_output_paths(tmp_path):
    good = CORPUS / "crlf.jsonl"
    (tmp_path / "a_file").write_text("")
    (tmp_path / "done.jsonl").write_text('{"prompt": "hi", "output": "x"}\n')  # a finished OUT
    cases = [
        (["run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "o.jsonl")],
         f"error: {tmp_path / 'nope.jsonl'}: no such file or folder"),
        # the missing input is named, not the finished OUT (fresh-user finding)
        (["run", str(tmp_path / "nope.jsonl"), "-o", str(tmp_path / "done.jsonl")],
         f"error: {tmp_path / 'nope.jsonl'}: no such file or folder"),
        (["run", str(good), "-o", str(tmp_path / "a_file" / "sub" / "o.jsonl")],
         "error: cannot create the output folder"),
        (["run", str(good), "-o", "/proc/x/o.jsonl"],  # root passes os.access on /proc
         "error: cannot create the output folder '/proc/x'"),
        (["run", str(good), "-o", str(tmp_path / "o.txt")],
         "expected a name ending in .jsonl or .parquet"),
        (["run", str(good), "-o", str(tmp_path)], str(tmp_path)),  # click: "... is a directory"
        (["run", str(good), "--recipe", str(tmp_path / "nope.toml")], "no such file"),
    ]
    for args, message in cases:
        r = cli(*args, timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        assert message in r.stderr, (args, r.stderr)
        assert_no_traceback(r)
        assert len([x for x in r.stderr.splitlines() if "rror" in x]) == 1, r.stderr


def test_bad_flag_values(tmp_path):
    good = str(CORPUS / "crlf.jsonl")
    out = str(tmp_path / "o.jsonl")
    cases = [
        (["--k", "-1"], "'--k'"),
        (["--temperature", "-0.5"], "'--temperature'"),
        (["--min-tokens", "9", "--max-tokens", "4"], "--min-tokens=9"),
        (["--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
         "--prompt-lookup-max=2: expected an integer >= --prompt-lookup-min"),
        (["--method", "magic"], "'--method'"),
        (["--template", "{code"], "template '{code'"),
        (["--template", "{a}", "--prompt-field", "b"], "exclude each other"),
        (["--on-error", "maybe"], "'--on-error'"),
    ]
    for flags, message in cases:
        r = cli("run", good, "-o", out, *flags, timeout=120)
        assert r.returncode == 2, (flags, r.stderr)
        assert message in r.stderr, (flags, r.stderr)
        assert_no_traceback(r)
        # one error line and a hint, not click's usage block
        first, hint = r.stderr.splitlines()
        assert first.startswith("error: ") and hint.endswith(" run --help'"), r.stderr


@pytest.mark.slow
def test_unknown_model(tmp_path):
    r = cli("run", CORPUS / "crlf.jsonl", "-o", tmp_path / "o.jsonl", "--model", "no-such-model",
            timeout=180)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: unknown model 'no-such-model'"), r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert_no_traceback(r)
