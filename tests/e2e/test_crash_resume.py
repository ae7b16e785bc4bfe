"""SIGKILL a real ``specbatch run`` at three points, rerun the same command, and get the bytes of
an uninterrupted run, with every record exactly once; with ``--method suffix`` and ``auto`` too.
SIGINT and SIGTERM: a clean stop (exit 130, finished records kept, how to resume printed).

The kill points (``tests/e2e/pause_run.py`` stops the real command there):
    early    after the first finished record is in the work file
    middle   halfway through appending a record's line (a torn last line in the work file)
    final    inside the final write: OUT complete under its temp name, not yet renamed
"""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_helpers import (REPO, assert_no_traceback, cli, cli_env, read_jsonl,
                               spec_bench_or_example, specbatch_command)

PAUSE_SCRIPT = REPO / "tests" / "e2e" / "pause_run.py"
NUM_RECORDS = 12
ARGS = ["--method", "ngram", "--k", "5", "--max-tokens", "16", "--max-batch-size", "4",
        "--no-progress"]

pytestmark = pytest.mark.slow


def _ids(rows: list[dict]) -> list:
    return [r.get("question_id", r.get("id")) for r in rows]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The input, and the output of an uninterrupted run of it."""
    root = tmp_path_factory.mktemp("crash")
    inp = spec_bench_or_example(NUM_RECORDS, root / "in.jsonl")
    out = root / "baseline" / "out.jsonl"
    r = cli("run", inp, "-o", out, *ARGS)
    assert r.returncode == 0, r.stderr
    return inp, out.read_bytes()


def _kill_at(point: str, args: list[str], workdir: Path) -> None:
    """Start the run, wait until it is paused at ``point``, SIGKILL it."""
    marker = workdir / "paused"
    with open(workdir / "killed.stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, str(PAUSE_SCRIPT), point, str(marker), *args],
                                env=cli_env(), stdout=subprocess.DEVNULL, stderr=err)
        try:
            deadline = time.monotonic() + 300
            while not marker.exists():
                assert proc.poll() is None, (f"run ended ({proc.returncode}) before {point}:\n"
                                             + (workdir / "killed.stderr").read_text())
                assert time.monotonic() < deadline, f"never reached {point}"
                time.sleep(0.05)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.parametrize("where", ["early", "middle", "final"])
def test_killed_run_resumes_to_the_same_bytes(job, tmp_path, where):
    inp, baseline = job
    num = len(read_jsonl(inp))
    out = tmp_path / "out.jsonl"
    work = Path(f"{out}.work.jsonl")
    args = ["run", str(inp), "-o", str(out), *ARGS]
    point, num_saved = {"early": ("after:1", 1), "middle": (f"torn:{num // 2 + 1}", num // 2),
                        "final": ("final", num)}[where]

    _kill_at(point, args, tmp_path)

    # what the kill left: the finished records in the work file, no final output
    assert not out.exists()
    data = work.read_bytes()
    whole = data.split(b"\n")[:-1]  # lines ended by a newline
    assert len(whole) == num_saved
    assert (data.endswith(b"\n")) == (where != "middle")  # the torn line has no newline
    temps = list(tmp_path.glob(".out.jsonl.*.tmp"))
    if where == "final":  # the whole output, written and fsynced, only not renamed yet
        assert [t.read_bytes() for t in temps] == [baseline]

    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert_no_traceback(r)
    assert f"resuming: {num_saved} of {num} records already done" in r.stderr
    assert out.read_bytes() == baseline
    rows = read_jsonl(out)
    counts = collections.Counter(_ids(rows))
    assert _ids(rows) == _ids(read_jsonl(inp)) and set(counts.values()) == {1}
    assert not work.exists() and not list(tmp_path.glob(".out.jsonl.*.tmp"))


# ----- SIGINT / SIGTERM: stop, keep what is finished, say how to resume, exit 130 -----

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_cleanly(job, tmp_path, sig):
    """The run stops, keeps every finished record (whole lines), says how to resume and exits
    130; after SIGTERM (what a batch scheduler sends) the rerun finishes it."""
    inp, baseline = job
    num = len(read_jsonl(inp))
    out = tmp_path / "out.jsonl"
    work = Path(f"{out}.work.jsonl")
    # one row at a time: after the first record, ~11 records of work remain, so the signal
    # lands mid-run even on a loaded machine (at batch 4 the rest could finish first)
    args = ["run", str(inp), "-o", str(out), *ARGS[:-2], "1", "--no-progress"]
    assert ARGS[-3:-1] == ["--max-batch-size", "4"]
    with open(tmp_path / "stderr", "wb") as err:
        # a child inherits an ignored SIGINT (pytest started in the background, as `cmd &`
        # or nohup do) and then rightly keeps ignoring it: give it the default disposition
        proc = subprocess.Popen([*specbatch_command(), *args], env=cli_env(),
                                stdout=subprocess.DEVNULL, stderr=err,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            deadline = time.monotonic() + 300
            while not (work.exists() and work.read_bytes().count(b"\n") >= 1):
                assert proc.poll() is None, (tmp_path / "stderr").read_text()
                assert time.monotonic() < deadline, "no record finished"
                time.sleep(0.02)
            proc.send_signal(sig)
            rc = proc.wait(timeout=120)
        finally:
            proc.kill()
            proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert rc == 130, stderr
    assert "Traceback" not in stderr, stderr
    saved = read_jsonl(work)  # whole lines only: the work file was closed, not cut
    assert work.read_bytes().endswith(b"\n")
    assert 1 <= len(saved) < num
    assert (f"interrupted: {len(saved)} of {num} records are saved in {work}" in stderr), stderr
    assert "Rerun the same command to resume." in stderr
    assert not out.exists()
    if sig != signal.SIGTERM:
        return

    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert f"resuming: {len(saved)} of {num} records already done" in r.stderr
    assert out.read_bytes() == baseline


@pytest.mark.parametrize("where", ["torn", "after"])
def test_auto_killed_and_resumed_gives_the_same_bytes(job, tmp_path, where):
    """``--method auto``: two uninterrupted runs give the same bytes (no time measured while a
    job runs enters a decision: the job prices its steps with the fit it started with, kept
    as OUT.calibration.json), and so does a run killed with records in flight and resumed
    (the records finished before the kill replay as placeholders, the decision journal
    OUT.decisions.jsonl makes the rows that ran beside them decide as they did); the outputs
    are those of ngram's run."""
    inp, baseline = job
    num = len(read_jsonl(inp))
    auto = [a if a != "ngram" else "auto" for a in ARGS]
    base, again = tmp_path / "base.jsonl", tmp_path / "again.jsonl"
    for path in (base, again):
        r = cli("run", inp, "-o", path, *auto)
        assert r.returncode == 0, r.stderr
    assert again.read_bytes() == base.read_bytes()
    assert Path(f"{base}.calibration.json").exists()
    assert not Path(f"{base}.decisions.jsonl").exists()  # removed at the end
    out = tmp_path / "out.jsonl"
    args = ["run", str(inp), "-o", str(out), *auto]
    cut = num // 2
    _kill_at(f"torn:{cut + 1}" if where == "torn" else f"after:{cut}", args, tmp_path)
    assert Path(f"{out}.decisions.jsonl").stat().st_size > 0
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert_no_traceback(r)
    assert f"resuming: {cut} of {num} records already done" in r.stderr
    assert "warning: resume:" not in r.stderr  # schedule and journal replayed exactly
    assert out.read_bytes() == base.read_bytes()
    rows, expected = read_jsonl(out), [json.loads(line) for line in baseline.splitlines()]
    assert [(r["output"], r["output_token_ids"], r["finish_reason"]) for r in rows] == \
        [(r["output"], r["output_token_ids"], r["finish_reason"]) for r in expected]


def test_suffix_killed_and_resumed_gives_the_same_bytes(tmp_path):
    """kill -9 halfway through a ``--method suffix`` job, resume: the same bytes as an
    uninterrupted run, ``spec`` counters included (a suffix record's drafts depend on the job
    index at each of its steps and on the rows beside it: the resume replays the schedule the
    work file recorded, with the finished records as placeholders)."""
    inp = spec_bench_or_example(NUM_RECORDS, tmp_path / "in.jsonl")
    suffix = [a if a != "ngram" else "suffix" for a in ARGS]
    base = tmp_path / "base.jsonl"
    assert cli("run", inp, "-o", base, *suffix).returncode == 0
    num = len(read_jsonl(inp))
    out = tmp_path / "out.jsonl"
    args = ["run", str(inp), "-o", str(out), *suffix]
    _kill_at(f"torn:{num // 2 + 1}", args, tmp_path)
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert f"resuming: {num // 2} of {num} records already done" in r.stderr
    assert "warning: resume:" not in r.stderr  # the schedule replayed without a divergence
    rows, expected = read_jsonl(out), read_jsonl(base)
    assert [x["output_token_ids"] for x in rows] == [x["output_token_ids"] for x in expected]
    assert out.read_bytes() == base.read_bytes()
