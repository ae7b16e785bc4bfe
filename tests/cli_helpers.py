"""Run the real ``specbatch`` command line in subprocesses, for the end-to-end tests.

``cli(...)`` is one process per command. ``cli_session(...)`` runs several command lines in one
process (``tests/e2e/cli_session.py``) so that the model loads once: each still goes through
``specbatch.cli.main`` with its own stdout, stderr and exit status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SPEC_BENCH = SHARED / "data" / "spec_bench" / "question.jsonl"
EXAMPLE_PROMPTS = REPO / "recipes" / "prompts" / "example.jsonl"
SESSION_SCRIPT = REPO / "tests" / "e2e" / "cli_session.py"


@dataclass(frozen=True)
class Result:
    returncode: int
    stdout: str
    stderr: str


def specbatch_command() -> list[str]:
    """The installed ``specbatch`` script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("specbatch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specbatch.cli"]


def cli_env() -> dict[str, str]:
    # One torch thread, as tests/helpers.py does: on a shared 2-core machine a second thread
    # made a 4-record run 30x slower (busy-waiting OpenMP threads), and one thread is what makes
    # the timings of these tests predictable.
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1"}


def cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> Result:
    p = subprocess.run([*specbatch_command(), *map(str, args)], cwd=cwd, env=cli_env(),
                       capture_output=True, text=True, timeout=timeout)
    return Result(p.returncode, p.stdout, p.stderr)


def cli_session(runs: list[list[str]], workdir: Path, timeout: float = 600) -> list[Result]:
    """Run each argument list through ``specbatch.cli.main`` in one process, in order."""
    workdir.mkdir(parents=True, exist_ok=True)
    jobs = [{"args": [str(a) for a in args], "stdout": str(workdir / f"run{i}.stdout"),
             "stderr": str(workdir / f"run{i}.stderr")} for i, args in enumerate(runs)]
    (workdir / "jobs.json").write_text(json.dumps(jobs))
    p = subprocess.run([sys.executable, str(SESSION_SCRIPT), str(workdir / "jobs.json")],
                       env=cli_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"session failed ({p.returncode}):\n{p.stdout}\n{p.stderr}"
    codes = json.loads((workdir / "jobs.json.rc").read_text())
    return [Result(rc, Path(j["stdout"]).read_text(), Path(j["stderr"]).read_text())
            for rc, j in zip(codes, jobs)]


def assert_no_traceback(result: Result) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert "Traceback" not in result.stdout, result.stdout


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def spec_bench_or_example(num: int, dest: Path) -> Path:
    """The first ``num`` Spec-Bench questions as ``dest``, or, without ``../shared``, the
    bundled example prompts (8 records)."""
    if SPEC_BENCH.exists():
        lines = SPEC_BENCH.read_text().splitlines(keepends=True)[:num]
    else:
        lines = EXAMPLE_PROMPTS.read_text().splitlines(keepends=True)
    dest.write_text("".join(lines))
    return dest
