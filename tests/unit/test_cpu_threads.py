"""Threads and the OpenMP wait policy on a shared machine (issue 36): chosen before torch loads
and said in the ``cpu:`` line (the job beside busy neighbours: tests/e2e/test_shared_machine.py)."""

from __future__ import annotations


import pytest

from specbatch.cpu_threads import choose_threads, usable_cpus


def test_busy_machine_makes_threads_wait_passively():
    env: dict[str, str] = {}
    cpus = usable_cpus()
    choice = choose_threads(load=0.5 * cpus, environ=env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and choice.wait == "passive"
    assert choice.threads == cpus
    assert choice.line().startswith(f"cpu: {cpus} thread")
    assert "wait passively (other work holds the CPUs: " in choice.line(), choice.line()


def test_quiet_machine_keeps_the_default():
    env: dict[str, str] = {}
    choice = choose_threads(load=0.0, environ=env)
    assert env == {} and choice.wait == "active"
    assert choice.line().endswith("spin-wait (the machine is quiet)"), choice.line()


def test_user_settings_win():
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    choice = choose_threads(3, load=99.0, environ=env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": "3"}
    assert choice.line() == ("cpu: 3 threads, OpenMP threads spin-wait (--threads; "
                             "OMP_WAIT_POLICY is set)")
    env = {"OMP_NUM_THREADS": "1"}
    assert choose_threads(load=0.0, environ=env).threads == 1
    with pytest.raises(ValueError, match="threads=0"):
        choose_threads(0, environ={})


def test_other_load_is_the_runnable_threads_now_not_the_minute_average(tmp_path):
    """The 1-minute average counts the job that ran just before (interleaved bench arms on a
    quiet 2-core machine read 1.2-1.5 and waited passively: ngram k5 int8 at batch 16 ran at
    0.65x); what is runnable now, less this process, is what competes."""
    from specbatch.cpu_threads import other_load

    path = tmp_path / "loadavg"
    path.write_text("1.52 0.90 0.40 1/412 9999\n")  # quiet now, busy a moment ago
    assert other_load(samples=3, interval=0, loadavg=str(path)) == 0.0
    path.write_text("0.20 0.10 0.05 3/412 9999\n")  # two neighbours just started
    assert other_load(samples=3, interval=0, loadavg=str(path)) == 2.0


@pytest.mark.parametrize("load, policy", [(8.0, "PASSIVE"), (0.0, None)])
def test_python_api_chooses_the_wait_policy_like_the_cli(load, policy):
    """``LLM(...)`` on a busy machine sets ``OMP_WAIT_POLICY=PASSIVE`` before torch loads (an API
    user was 3-10x slower than the CLI beside other jobs), logs the ``cpu:`` line, and leaves
    the default on a quiet one; in a fresh process, so torch is not loaded yet."""
    import os
    import subprocess
    import sys

    script = f"""
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
import specbatch.cpu_threads as c
c.other_load = lambda *a, **k: {load}
from specbatch import LLM
from specbatch.llm import ModelLoadError
assert "torch" not in sys.modules
try:
    LLM("no-such-model")
except ModelLoadError:
    pass
print("POLICY", os.environ.get("OMP_WAIT_POLICY"))
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"POLICY {policy}" in out.stdout
    how = "wait passively" if policy else "spin-wait"
    assert f"OpenMP threads {how}" in out.stderr
