"""Threads and the OpenMP wait policy on a shared machine (issue 36): chosen before torch loads
and said in the ``cpu:`` line (the job beside busy neighbours: tests/e2e/test_shared_machine.py)."""

from __future__ import annotations


import os

import pytest

from specbatch.cpu_threads import choose_threads, usable_cpus


def test_busy_machine_makes_threads_wait_passively():
    env: dict[str, str] = {}
    cpus = usable_cpus()
    choice = choose_threads(load=0.5 * cpus, environ=env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"} and choice.wait == "passive"
    assert choice.threads == cpus
    assert choice.line().startswith(f"cpu: {cpus} thread")
    assert (f"wait passively (other work holds {0.5 * cpus:.1f} of the {cpus} usable CPU(s); "
            in choice.line()), choice.line()


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
    nostat = str(tmp_path / "no-stat")
    path.write_text("1.52 0.90 0.40 1/412 9999\n")  # quiet now, busy a moment ago
    assert other_load(samples=3, interval=0, loadavg=str(path), stat=nostat) == 0.0
    path.write_text("0.20 0.10 0.05 3/412 9999\n")  # two neighbours just started
    assert other_load(samples=3, interval=0, loadavg=str(path), stat=nostat) == 2.0


def test_other_load_counts_the_cpu_time_others_used_in_the_window(tmp_path, monkeypatch):
    """A neighbour that held one of 2 CPUs over the window counts though no thread of it was
    runnable at the reads (a test suite between two tests read 0 runnable, threads spun, and a
    plain decode ran 4.7x slower than passive waiting); this process's own CPU time in the
    window does not count; only the usable CPUs' lines are read."""
    from specbatch import cpu_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("2.78 1.50 0.60 1/412 9999\n")  # nothing else runnable at the reads
    stat = tmp_path / "stat"

    def write(busy0: int, idle0: int, busy1: int, idle1: int) -> None:  # user, idle ticks
        stat.write_text(f"cpu  0 0 0 0 0 0 0 0 0 0\n"
                        f"cpu0 {busy0} 0 0 {idle0} 0 0 0 0 0 0\n"
                        f"cpu1 {busy1} 0 0 {idle1} 0 0 0 0 0 0\n"
                        f"cpu2 {busy0 * 7} 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")  # not usable

    # over the window cpu0 is busy its 30 ticks, cpu1 idle its 30
    reads = iter([(0, 100, 0, 100), (30, 100, 0, 130)])

    def fake_jiffies(cpus, path):
        write(*next(reads))
        return real(cpus, path)

    real = cpu_threads._cpu_jiffies
    monkeypatch.setattr(cpu_threads, "_cpu_jiffies", fake_jiffies)
    monkeypatch.setattr(cpu_threads, "_own_cpu_seconds", lambda: 0.0)
    got = cpu_threads.other_load(samples=3, interval=0.01, loadavg=str(loadavg), stat=str(stat))
    assert got == pytest.approx(30 / 60 * 2)  # 1 of the 2 CPUs
    assert cpu_threads.choose_threads(load=got, environ={}).wait == "passive"
    # the same ticks, all of them this process's own CPU time: nobody else
    reads = iter([(0, 100, 0, 100), (30, 100, 0, 130)])
    clock = iter([0.0, 10.0])
    monkeypatch.setattr(cpu_threads, "_own_cpu_seconds", lambda: next(clock))
    assert cpu_threads.other_load(samples=3, interval=0.01, loadavg=str(loadavg),
                                  stat=str(stat)) == 0.0


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
