"""Threads and the OpenMP wait policy on a shared machine (issue 36): chosen before torch loads
and said in the ``cpu:`` line (the job beside busy neighbours: tests/e2e/test_shared_machine.py)."""

from __future__ import annotations


import os

import pytest

from specbatch.cpu_threads import choose_threads, holds, usable_cpus


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
    over = f"; more threads than the {usable_cpus()} usable CPU(s)" if usable_cpus() < 3 else ""
    assert choice.line() == ("cpu: 3 threads, OpenMP threads spin-wait (--threads; "
                             f"OMP_WAIT_POLICY is set{over})")
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


@pytest.mark.parametrize("load, threads, line", [
    (8.0, "1", "cpu: 1 thread, OpenMP threads spin-wait (other work holds all 2 usable CPU(s) "
               "(8 threads runnable); all 2 once it is gone)"),
    (0.0, None, "cpu: 2 threads, OpenMP threads spin-wait (the machine is quiet)")])
def test_python_api_chooses_threads_like_the_cli(load, threads, line):
    """``LLM(...)`` chooses its threads before torch loads, as the CLI does (an API user was
    3-10x slower than the CLI beside other jobs when its threads spun on every CPU): on a busy
    machine the CPUs the others leave, raised by the governor when they go; logs the ``cpu:``
    line. In a fresh process, so torch is not loaded yet."""
    import os
    import subprocess
    import sys

    script = f"""
import logging, os, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
import specbatch.cpu_threads as c
c.other_load = lambda *a, **k: {load}
c.usable_cpus = lambda: 2
from specbatch import LLM
from specbatch.llm import ModelLoadError
assert "torch" not in sys.modules
try:
    LLM("no-such-model")
except ModelLoadError:
    pass
import torch
print("POLICY", os.environ.get("OMP_WAIT_POLICY"), "THREADS", os.environ.get("OMP_NUM_THREADS"),
      "GOVERNOR", c.governor.base, c.governor.threads, "TORCH", torch.get_num_threads())
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    start = int(threads or 2)
    want = f"POLICY None THREADS {threads} GOVERNOR 2 {start} TORCH {start}"
    assert want in out.stdout, out.stdout
    assert line in out.stderr, out.stderr


def test_a_start_beside_other_work_is_no_users_count():
    """The ``OMP_NUM_THREADS`` a busy start put in the environment is the process's own choice:
    a later choice (of this process, or of a child that inherits it, as a Ray worker does)
    does not read it as a count the user fixed."""
    from specbatch import settings

    env = {"OMP_NUM_THREADS": "1", settings.START_THREADS: "1"}
    choice = choose_threads(load=0.0, environ=env)
    assert env == {} and choice.threads == usable_cpus() and "OMP_NUM_THREADS" not in choice.why
    env = {"OMP_NUM_THREADS": "3", settings.START_THREADS: "1"}  # the user's, set afterwards
    assert choose_threads(load=0.0, environ=env).threads == 3


@pytest.mark.parametrize("cpus, load, want", [(2, 1.0, 1), (2, 1.25, 1), (2, 5.0, 1),
                                              (8, 4.0, 4), (8, 4.4, 3), (8, 7.9, 1)])
def test_a_busy_start_takes_the_cpus_the_others_leave(cpus, load, want):
    """As the governor would run there: ``cpus - ceil(load - SLACK)``, at least one."""
    from specbatch.cpu_threads import start_threads

    assert start_threads(cpus, cpus, load) == want


class _Neighbours:
    """A fake machine for ``ThreadGovernor``: each ``window(busy, own)`` is the next
    ``INTERVAL`` s, in which the 2 CPUs were busy ``busy`` CPUs' worth and this process used
    ``own`` CPUs (all its threads)."""

    def __init__(self) -> None:
        self.now, self.ticks, self.own_s, self.reads, self.applied = 0.0, [0, 0], 0.0, 0, []

    def window(self, busy: float, own: float, seconds: float = 1.0) -> None:
        self.now += seconds
        self.ticks[0] += round(100 * busy * seconds)
        self.ticks[1] += round(100 * 2 * seconds)
        self.own_s += own * seconds

    def reader(self):
        self.reads += 1
        return tuple(self.ticks)

    def governor(self, start: int | None = None):
        from specbatch.cpu_threads import ThreadGovernor

        return ThreadGovernor(2, cpus=2, reader=self.reader, own=lambda: self.own_s,
                              clock=lambda: self.now, set_threads=self.applied.append,
                              start=start)


def test_governor_gives_a_cpu_to_work_that_appears_and_takes_it_back(caplog):
    """Measured on the 2-core Xeon: a busy loop beside two spinning threads reads ~0.6-0.7
    CPUs of other work (the three share the cores); beside one thread ~1.0; alone ~0.01."""
    m = _Neighbours()
    g = m.governor()
    m.window(busy=2.0, own=1.99)  # alone: 0.01 of other work
    g.poll()
    assert g.threads == 2 and m.applied == [] and g.other == pytest.approx(0.01, abs=1e-6)
    with caplog.at_level("INFO", logger="specbatch"):
        m.window(busy=2.0, own=1.35)  # a busy loop appears
        g.poll()
        assert m.applied == []  # one read is not enough (PATIENCE)
        m.window(busy=2.0, own=1.3)
        g.poll()
        assert m.applied == [1] and g.threads == 1
        for _ in range(3):  # one thread beside it: the loop holds its CPU, ours the other
            m.window(busy=2.0, own=1.0)
            g.poll()
        assert m.applied == [1] and g.other == pytest.approx(1.0)
        m.window(busy=1.0, own=1.0)  # gone: every thread again at once
        g.poll()
    assert m.applied == [1, 2] and g.threads == 2 and g.changes == 2
    assert [r.getMessage() for r in caplog.records] == [
        "cpu: 1 thread now (was 2): other work holds 0.7 of the 2 usable CPU(s)",
        "cpu: 2 threads now (was 1): the other work is gone"]


def test_a_job_started_beside_other_work_takes_every_cpu_once_it_is_gone(caplog):
    """A busy start runs one spinning thread (``start_threads``) where passive threads on every
    CPU ran before, 1.25-1.4x slower than spinning at batch 1 once the neighbours left."""
    m = _Neighbours()
    g = m.governor(start=1)
    assert g.threads == 1 and g.base == 2
    for _ in range(3):  # one thread beside the loop: it holds its CPU, ours the other
        m.window(busy=2.0, own=1.0)
        g.poll()
    assert m.applied == [] and g.other == pytest.approx(1.0)
    with caplog.at_level("INFO", logger="specbatch"):
        m.window(busy=1.0, own=1.0)
        g.poll()
    assert m.applied == [2] and g.threads == 2
    assert [r.getMessage() for r in caplog.records] == [
        "cpu: 2 threads now (was 1): the other work is gone"]


def test_governor_reads_once_per_interval_and_ignores_a_blip():
    m = _Neighbours()
    g = m.governor()
    assert m.reads == 1  # the first window starts at the choice
    m.window(busy=2.0, own=2.0, seconds=g.INTERVAL / 4)
    g.poll()
    assert m.reads == 1  # within the interval: a clock read only
    m.window(busy=2.0, own=1.3, seconds=g.INTERVAL)
    g.poll()  # one busy window ...
    m.window(busy=2.0, own=2.0)
    g.poll()  # ... then quiet again: the count never moved
    m.window(busy=2.0, own=1.3)
    g.poll()
    assert m.reads == 4 and m.applied == [] and g.threads == 2
    m.window(busy=2.0, own=1.95)  # daemons: under SLACK of a CPU
    g.poll()
    assert m.applied == []


def test_held_runs_every_chosen_thread_and_stops_reading(monkeypatch):
    """A calibration inside ``held()`` times the engine a quiet machine runs (the fit's
    fingerprint says the chosen count, whatever runs now)."""
    from specbatch import cpu_threads
    from specbatch.auto.costmodel import engine_fingerprint

    m = _Neighbours()
    g = m.governor()
    monkeypatch.setattr(cpu_threads, "governor", g)
    for _ in range(2):
        m.window(busy=2.0, own=1.3)
        cpu_threads.poll()
    assert g.threads == 1 and cpu_threads.chosen_threads() == 2
    assert ", 2 threads, " in engine_fingerprint()
    with cpu_threads.held():
        assert m.applied == [1, 2] and g.threads == 2
        reads = m.reads
        for _ in range(3):
            m.window(busy=2.0, own=1.3)
            cpu_threads.poll()
        assert m.reads == reads and m.applied == [1, 2]
    assert not g.held
    for _ in range(2):  # the neighbour is still there: one thread again
        m.window(busy=2.0, own=1.3)
        cpu_threads.poll()
    assert m.applied == [1, 2, 1]


@pytest.mark.parametrize("env, load, governed", [
    ({}, 0.0, True),  # the process's own choice on a quiet machine
    ({"OMP_NUM_THREADS": "2"}, 0.0, False),  # the user's count is kept
    ({}, 99.0, True),  # busy at start: one spinning thread, more when the others go
    ({"OMP_NUM_THREADS": "2"}, 99.0, False),  # the user's count: threads wait passively
    ({"OMP_WAIT_POLICY": "PASSIVE"}, 0.0, False),
])
def test_a_governor_acts_only_on_a_spinning_count_the_process_chose(env, load, governed):
    import subprocess
    import sys

    script = f"""
import sys
import specbatch.cpu_threads as c
c.usable_cpus = lambda: 2
c.other_load = lambda *a, **k: {load}
c.choose_threads()
assert "torch" not in sys.modules
print("GOVERNED", c.governor is not None and c.governor.base == 2)
"""
    base = {k: v for k, v in os.environ.items()
            if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env={**base, **env}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"GOVERNED {governed}" in out.stdout, out.stdout


C_BACKENDS = [case for case in __import__("tests.helpers", fromlist=["x"]).backend_cases()
              if case.id.startswith("c-")]


@pytest.mark.parametrize("case", C_BACKENDS, ids=lambda c: c.id)
def test_threads_changing_between_steps_change_no_token(case, monkeypatch):
    """The governor may change the count between any two steps: a run whose count flips
    2 -> 1 -> 2 ... at every step (neighbours that come and go each window) gives the tokens of
    a run on a fixed count, speculative and plain."""
    import torch

    from specbatch import cpu_threads
    from specbatch.config import SamplingParams
    from tests.helpers import repeating_prompts, run_engine, tiny_llama

    forward = case.forward(case.convert(tiny_llama(96, seed=5)))
    prompts = repeating_prompts(96, 6, seed=7)
    sampling = SamplingParams(max_tokens=24)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with case.switches():
            fixed = [run_engine(forward, prompts, k, 4, sampling) for k in (0, 5)]
        m = _Neighbours()
        counts = []
        g = cpu_threads.ThreadGovernor(2, cpus=2, reader=m.reader, own=lambda: m.own_s,
                                       clock=lambda: m.now,
                                       set_threads=lambda n: (counts.append(n),
                                                              torch.set_num_threads(n)))
        g.PATIENCE = 1
        real_poll = g.poll

        def poll():  # a window per step: a neighbour beside two threads, gone beside one
            m.window(busy=2.0, own=1.2) if g.threads == 2 else m.window(busy=1.0, own=1.0)
            real_poll()

        g.poll = poll
        monkeypatch.setattr(cpu_threads, "governor", g)
        with case.switches():
            flipped = [run_engine(forward, prompts, k, 4, sampling) for k in (0, 5)]
    finally:
        torch.set_num_threads(before)
    assert len(counts) > 20 and set(counts) == {1, 2}, counts
    for a, b in zip(fixed, flipped):
        assert [c.output_ids for c in a] == [c.output_ids for c in b]


def test_more_threads_than_cpus_are_said():
    """``--threads 64`` on a 2-CPU machine is taken as asked, and the line says it is more
    than the usable CPUs (a typo or a count copied from another machine shows)."""
    cpus = usable_cpus()
    choice = choose_threads(cpus + 1, load=0.0, environ={})
    assert choice.threads == cpus + 1
    assert choice.line().endswith(f"(--threads; the machine is quiet; more threads than the "
                                  f"{cpus} usable CPU(s))"), choice.line()
    assert "more threads" not in choose_threads(cpus, load=0.0, environ={}).line()


def test_a_load_above_the_cpu_count_reads_as_all_of_them():
    """``other_load`` may exceed the usable CPUs (its runnable-thread read: 3 threads on 2
    CPUs); a message then says all of them are held, not "3.0 of the 2"."""
    assert holds(3.0, 2) == "other work holds all 2 usable CPU(s) (3 threads runnable)"
    assert holds(1.5, 2) == "other work holds 1.5 of the 2 usable CPU(s)"
    assert holds(2.0, 2) == "other work holds 2.0 of the 2 usable CPU(s)"
