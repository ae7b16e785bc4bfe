"""Shared fixtures for the end-to-end tests: real data from ``<repo>/../shared/data`` (never
copied into the repo), the packaged real model, and the real ``specbatch`` command line.

A test that needs Spec-Bench or the model skips with a message saying what is missing and how
to get it; everything else about these tests is real: subprocesses, files, the model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# a git worktree elsewhere (e.g. /work/wt/NAME) points here at the shared copy
SPEC_BENCH = Path(os.environ.get("SPECBATCH_SPEC_BENCH")
                  or REPO.parent / "shared" / "data" / "spec_bench" / "question.jsonl")


def _require_spec_bench() -> Path:
    if not SPEC_BENCH.is_file():
        pytest.skip(f"Spec-Bench not found at {SPEC_BENCH} (the e2e tests read "
                    "<repo>/../shared/data/spec_bench/question.jsonl; the repo does not ship it)")
    return SPEC_BENCH


def _require_model() -> None:
    from specbatch.models.loader import resolve_model
    from specbatch.models.registry import DEFAULT_MODEL

    try:
        resolve_model(DEFAULT_MODEL)
    except ValueError as e:  # names the pip command that installs it
        pytest.skip(f"the real model is not installed: {e}")


@pytest.fixture(scope="session")
def spec_bench() -> Path:
    """Path of Spec-Bench's question.jsonl (480 records, 13 categories)."""
    return _require_spec_bench()


@pytest.fixture(scope="session")
def real_model() -> None:
    """Skips unless the default packaged model (SmolLM2-135M) is installed."""
    _require_model()


def spec_bench_subset(spec_bench: Path, question_ids: list[int], out: Path) -> Path:
    """Write the Spec-Bench records with these ``question_id``s, in the order given, to ``out``."""
    by_id = {json.loads(line)["question_id"]: line
             for line in spec_bench.read_text().splitlines() if line.strip()}
    missing = [q for q in question_ids if q not in by_id]
    assert not missing, f"question ids {missing} not in {spec_bench}"
    out.write_text("".join(by_id[q] + "\n" for q in question_ids))
    return out


def specbatch_command() -> list[str]:
    """The installed ``specbatch`` script beside this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("specbatch")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specbatch.cli"]


def run_cli(*args: str, cwd: Path, timeout: float = 600) -> str:
    """Run ``specbatch ARGS`` in a subprocess; fail the test with its stderr unless it exits 0.
    Returns stdout (the summary table; progress and warnings go to stderr). Prints the wall
    time (visible with ``pytest -s``)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([*specbatch_command(), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    print(f"specbatch {' '.join(args)}: exit {proc.returncode} in "
          f"{time.perf_counter() - t0:.1f} s")
    assert proc.returncode == 0, (f"specbatch {' '.join(args)} exited {proc.returncode}\n"
                                  f"stderr:\n{proc.stderr[-4000:]}")
    return proc.stdout


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
