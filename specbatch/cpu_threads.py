"""CPU threads and the OpenMP wait policy, chosen before torch (and its OpenMP runtime) loads.

On the CPU every model step runs in OpenMP parallel regions (torch's and the C kernels', which
share torch's ``libgomp``). Between regions libgomp's threads spin-wait by default; when other
processes hold the cores, a spinning thread keeps the core from the sibling it waits for, and
each barrier waits for a descheduled thread. Measured on the 2-core EPYC (issue 36), the
example records at 32 tokens, ngram k5, beside other jobs (load average 5): 95.5 s with the
default policy, 13.0 s with ``OMP_WAIT_POLICY=PASSIVE`` (2 threads), 12.2 s with one thread.

The policy is chosen once, at start-up, and where the process chooses its own thread count
(no ``--threads``, no ``OMP_NUM_THREADS``, no ``OMP_WAIT_POLICY``) its threads spin and
``ThreadGovernor`` fits their number to the neighbours for the whole run: every
``ThreadGovernor.INTERVAL`` s it reads how much CPU time others took and, while they hold
cores, runs the engine on fewer threads; all of them again once they are gone (the CPU backend
calls ``poll()`` every step; the first window starts when the threads are chosen). A job that
starts beside other work starts on the CPUs they leave (``start_threads``, at least one).
Measured on the 2-core Xeon (model 207), 6 of the peer records at 64 tokens, plain decoding,
int8, one busy loop beside the job: 16.8 s spinning on 2 threads, 5.5 s on 1 thread, 5.6 s
passive on 2 threads, 2.5 s alone on 2 threads. Two such jobs (8 records) started together:
52.5 s for both spinning, 21.1 s with the governor (each settles on one thread).

A job that started beside other work used to wait passively on every CPU for its whole run:
a 0.3 s burst at start-up (another command finishing) slowed a night's job by ~1.3x. Measured
(8 peer records, 96 tokens, batch 1, int8, ngram k5; generation seconds, 2 rounds, loops
started 1 s before the job): alone, spinning 4.1, 4.1 against passive 5.3, 5.2; one busy loop
gone when generation starts, one spinning thread raised to 2 by the governor 5.0, 4.7 against
passive 5.5, 5.1; one busy loop for the whole run 8.5, 7.5 against passive 6.7, 7.2; two loops
12.3, 12.8 against 12.8, 9.7. Passive threads on every CPU take a larger share from a
neighbour that never yields (~1.15x faster beside it); one that leaves gives its CPU back to
spinning threads for the rest of the run.
Where the user fixed the count (``--threads``, ``OMP_NUM_THREADS``) and other work holds the
CPUs at start-up, threads wait passively: no governor can give the neighbours their cores.

libgomp reads ``OMP_WAIT_POLICY`` and ``OMP_NUM_THREADS`` once, when it is loaded (with torch),
so ``choose_threads`` sets them in the environment and must run before torch is imported
(the CLI calls it first thing in ``run``, ``bench`` and ``calibrate``). Where torch is already
imported (a test calling the CLI in-process), the thread count is set with
``torch.set_num_threads`` and the wait policy stays as it is. Outputs do not depend on the
thread count (the same token ids with 1 and 2 threads in the measurement above).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass

from specbatch import settings

BUSY_SHARE = 0.5  # other work on at least this share of the usable CPUs: the machine is busy


@dataclass(frozen=True)
class ThreadChoice:
    """threads: OpenMP threads (None: the runtime's default, one per usable CPU); wait:
    ``"active"`` (spin-wait, the default) or ``"passive"``; why: what decided, for the
    start-up line."""

    threads: int
    wait: str
    why: str

    def line(self) -> str:
        """The start-up line, e.g. ``cpu: 2 threads, OpenMP threads wait passively (...)``."""
        how = "wait passively" if self.wait == "passive" else "spin-wait"
        noun = "thread" if self.threads == 1 else "threads"
        return f"cpu: {self.threads} {noun}, OpenMP threads {how} ({self.why})"


def _usable_cpu_ids() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def usable_cpus() -> int:
    return len(_usable_cpu_ids())


def _cpu_jiffies(cpus: set[int], stat: str = "/proc/stat") -> tuple[int, int] | None:
    """(busy, total) clock ticks of the CPUs ``cpus`` since boot (``/proc/stat``'s ``cpuN``
    lines: busy = user + nice + system + irq + softirq; total adds idle, iowait and steal), or
    None where they cannot be read."""
    busy = total = 0
    try:
        with open(stat) as f:
            for line in f:
                name, *fields = line.split()
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
                    continue
                t = [int(x) for x in fields[:8]]
                busy += t[0] + t[1] + t[2] + t[5] + t[6]
                total += sum(t)
    except (OSError, ValueError, IndexError):
        return None
    return (busy, total) if total else None


def holds(load: float, cpus: int) -> str:
    """``other_load``'s figure in words: a share of the usable CPUs, or all of them and the
    threads runnable (a figure above the CPU count is the runnable threads: 3 on 2 CPUs)."""
    if load > cpus:
        return f"other work holds all {cpus} usable CPU(s) ({load:.0f} threads runnable)"
    return f"other work holds {load:.1f} of the {cpus} usable CPU(s)"


def other_load(samples: int = 13, interval: float = 0.025,
               loadavg: str = "/proc/loadavg", stat: str = "/proc/stat") -> float | None:
    """How many of the usable CPUs other work holds now: the larger of two reads over the same
    ``samples * interval`` s (0.3 s) window:

    - the threads runnable, less this one (``loadavg``'s 4th field, the median of ``samples``
      reads ``interval`` s apart);
    - the usable CPUs' busy share over the window (``stat``'s ticks) times their count, less
      this process's own CPU time in it.

    The runnable count alone read 0 beside a test suite that held one of 2 CPUs most of the
    time (a moment between its tests), and threads spin-waited beside it: the plain decode of a
    run went 4.7x slower than passive waiting would have. The 1-minute load average only where
    neither can be read: it lags by a minute both ways, and counted the job that ran just
    before this one (a script running jobs back to back, or a benchmark's interleaved arms,
    load 1.2-1.5 on 2 quiet CPUs) as other work, which made threads wait passively on a quiet
    machine: ngram k5 int8 at batch 16 ran at 0.65x of spinning threads. None where the OS has
    none of them."""
    cpus = _usable_cpu_ids()
    start, own, t0 = _cpu_jiffies(cpus, stat), _own_cpu_seconds(), time.monotonic()
    runnable = []
    for i in range(samples):
        try:
            with open(loadavg) as f:
                runnable.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, IndexError, ValueError):
            break
        if i + 1 < samples:
            time.sleep(interval)
    end, own, seconds = (_cpu_jiffies(cpus, stat), _own_cpu_seconds() - own,
                         time.monotonic() - t0)
    reads = []
    if runnable:
        reads.append(float(sorted(runnable)[len(runnable) // 2]))
    if start is not None and end is not None and end[1] > start[1] and seconds > 0:
        share = (end[0] - start[0]) / (end[1] - start[1])
        reads.append(max(0.0, share * len(cpus) - own / seconds))
    if reads:
        return max(reads)
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _own_cpu_seconds() -> float:
    """CPU seconds this process (all its threads) has used."""
    t = os.times()
    return t.user + t.system


def choose_threads(threads: int | None = None, load: float | None = None,
                   environ: dict | None = None) -> ThreadChoice:
    """Choose the thread count and the wait policy and put them in ``environ`` (default
    ``os.environ``) for torch's OpenMP runtime to read when it loads.

    threads: ``--threads N`` (None: ``OMP_NUM_THREADS`` if set, else one per usable CPU).
    load: CPUs held by other work (default: ``other_load()``). Where other work holds at least
    ``BUSY_SHARE`` of the usable CPUs: a count the process chooses itself starts at
    ``start_threads`` spinning threads, which its ``ThreadGovernor`` raises when the others
    leave; a count the user set waits passively (unless ``OMP_WAIT_POLICY`` is set: a user's
    policy is kept as it is). Raises ``ValueError`` for threads < 1."""
    global governor
    env = os.environ if environ is None else environ
    cpus = usable_cpus()
    # this process's own choice, made before its OpenMP runtime starts: a governor may act
    fresh = environ is None and "torch" not in sys.modules
    _forget_start(env)
    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads={threads}: expected an integer >= 1")
        env["OMP_NUM_THREADS"] = str(threads)
        why_threads = "--threads"
    else:
        try:
            threads = int(env.get("OMP_NUM_THREADS", "").split(",")[0])
            why_threads = "OMP_NUM_THREADS"
        except ValueError:
            threads, why_threads = cpus, None
    if environ is None and "torch" in sys.modules:  # its OpenMP runtime read the environment
        import torch

        if why_threads:
            torch.set_num_threads(threads)
        threads = torch.get_num_threads()
    user_policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    if user_policy:
        wait = "passive" if user_policy == "passive" else "active"
        why = "OMP_WAIT_POLICY is set"
    else:
        load = other_load() if load is None else load
        if (load is not None and load >= BUSY_SHARE * cpus and fresh and why_threads is None
                and threads > 1):
            start = start_threads(threads, cpus, load)
            governor = ThreadGovernor(threads, start=start)
            env["OMP_NUM_THREADS"] = str(start)
            env[settings.START_THREADS] = str(start)
            return ThreadChoice(start, "active", (
                f"{holds(load, cpus)}; all {threads} once it is gone"))
        if load is not None and load >= BUSY_SHARE * cpus:
            wait = "passive"
            why = (f"{holds(load, cpus)}; spin-waiting threads of several jobs slow each "
                   "other ~7x")
            if environ is None and "torch" in sys.modules:
                wait, why = "active", why + "; torch was loaded already, so they spin"
            else:
                env["OMP_WAIT_POLICY"] = "PASSIVE"
        else:
            wait = "active"
            why = ("the machine is quiet" if load is not None else "no load average here")
    if why_threads:
        why = f"{why_threads}; {why}"
        if threads > cpus:  # said, not changed: ``--threads 4`` on 2 CPUs ran 8.2-10.7 s
            # spinning and 8.7-10.0 s waiting passively against 8.4-8.5 s on 2 (6 peer records)
            why += f"; more threads than the {cpus} usable CPU(s)"
    if fresh and why_threads is None and wait == "active" and threads > 1:
        governor = ThreadGovernor(threads)
    return ThreadChoice(threads, wait, why)


def start_threads(threads: int, cpus: int, load: float) -> int:
    """The spinning threads a job of ``threads`` starts on beside ``load`` CPUs of other work
    (of ``cpus`` usable): what ``ThreadGovernor`` would run there, ``cpus - ceil(load -
    SLACK)``, at least 1 and at most ``threads``."""
    return max(1, min(threads, cpus - math.ceil(load - ThreadGovernor.SLACK)))


def _forget_start(env) -> None:
    """Remove an ``OMP_NUM_THREADS`` that a ``choose_threads`` set (a start beside other work,
    marked ``settings.START_THREADS``), so that it does not read as the user's count: in a
    later choice of this process, or of a child that inherits the environment (a Ray worker
    started by the driver)."""
    count = env.pop(settings.START_THREADS, None)
    if count is not None and env.get("OMP_NUM_THREADS") == count:
        del env["OMP_NUM_THREADS"]


class ThreadGovernor:
    """Fewer OpenMP threads while other work holds the CPUs; all of them again when it is gone.

    base: the threads chosen at start-up; start: the threads it runs first (default base:
    fewer where other work held the CPUs at start-up, ``start_threads``). Every ``INTERVAL`` s
    (``poll``) it reads the CPU
    time other processes took on the usable CPUs since the last read: the CPUs' busy ticks
    (``/proc/stat``) less this process's own CPU time, in CPUs. Where that is at least
    ``SLACK`` of a CPU in ``PATIENCE`` reads in a row, it runs ``usable_cpus() - ceil(other -
    SLACK)`` threads (at least 1, at most ``base``); a read that allows more threads raises the
    count at once. Two spinning threads beside one busy loop on 2 CPUs read ~0.6-0.7 (the three
    share the cores); one thread beside it reads ~1.0 and keeps one; alone, ~0.01. Two jobs
    started together on a quiet machine each read the other and settle on one thread each.

    Token ids do not depend on the thread count (the C kernels and torch's ops split work by
    rows and columns, never a sum: ``tests/helpers.at_thread_counts``), so the count may change
    between any two steps.

    reader() -> (busy, total) ticks of the usable CPUs, or None; own() -> this process's CPU
    seconds; clock() -> seconds; set_threads(n): applies a count (default
    ``torch.set_num_threads``); all injectable for tests. Changes are logged on the
    ``specbatch`` logger (INFO), and counted in ``changes``.
    """

    # seconds between reads (a read: ~50 us). A busy loop started beside a batch-1 run on 2
    # cores got its CPU 1.1-2.0 s later: PATIENCE reads, and the call in progress (a long
    # prompt's prefill is one call, slow while the threads contend)
    INTERVAL = 0.25
    SLACK = 0.3  # CPUs of other work ignored: daemons, this job's own helper processes
    PATIENCE = 2  # reads in a row that must see the neighbours before threads are given up

    def __init__(self, base: int, cpus: int | None = None, reader=None, own=None, clock=None,
                 set_threads=None, start: int | None = None) -> None:
        ids = _usable_cpu_ids()
        self.base = base
        self.threads = base if start is None else start
        self.cpus = cpus if cpus is not None else len(ids)
        self._reader = reader or (lambda: _cpu_jiffies(ids))
        self._own = own or _own_cpu_seconds
        self._clock = clock or time.monotonic
        self._set_threads = set_threads
        self._busy_reads = 0
        self._start_window()  # the first window starts at the choice
        self.changes = 0
        self.held = False  # ``hold()``: the base count, no reads
        self.other = 0.0  # CPUs other work held in the last window

    def _start_window(self) -> None:
        self._last = (self._clock(), self._reader(), self._own())

    def poll(self) -> None:
        """Cheap (a clock read) except once per ``INTERVAL``: then reads the CPU counters and
        changes the thread count where the neighbours call for it."""
        now = self._clock()
        if now - self._last[0] < self.INTERVAL:
            return
        ticks, own = self._reader(), self._own()
        last, self._last = self._last, (now, ticks, own)
        if ticks is None or last[1] is None or ticks[1] <= last[1][1]:
            return
        share = (ticks[0] - last[1][0]) / (ticks[1] - last[1][1])
        self.other = max(0.0, share * self.cpus - (own - last[2]) / (now - last[0]))
        want = max(1, min(self.base, self.cpus - math.ceil(self.other - self.SLACK)))
        if want < self.threads:
            self._busy_reads += 1
            if self._busy_reads < self.PATIENCE:
                return
        self._busy_reads = 0
        if want != self.threads:
            self._apply(want)

    @contextlib.contextmanager
    def hold(self):
        """The base count for the block, no reads (``held``); a fresh window after it."""
        self.held = True
        if self.threads != self.base:
            self._apply(self.base, "a calibration times all of them")
        try:
            yield
        finally:
            self.held = False
            self._start_window()

    def _apply(self, threads: int, why: str | None = None) -> None:
        if self._set_threads is None:
            import torch

            self._set_threads = torch.set_num_threads
        self._set_threads(threads)
        self.changes += 1
        why = why or (holds(self.other, self.cpus) if threads < self.threads
                      else "the other work is gone")
        logging.getLogger("specbatch").info(
            "cpu: %d thread%s now (was %d): %s", threads, "" if threads == 1 else "s",
            self.threads, why)
        self.threads = threads


governor: ThreadGovernor | None = None  # set by ``choose_threads`` where it may act


def poll() -> None:
    """``governor.poll()`` where ``choose_threads`` installed one and no ``held()`` block runs
    (the CPU backend calls it every step), else nothing."""
    if governor is not None and not governor.held:
        governor.poll()


def chosen_threads() -> int:
    """The threads this process chose (the governor's ``base``, whatever it runs now), else
    torch's current count: what a step-cost fit is measured for (``engine_fingerprint``)."""
    if governor is not None:
        return governor.base
    import torch

    return torch.get_num_threads()


@contextlib.contextmanager
def held():
    """The chosen thread count (``chosen_threads``) for the block, whatever the neighbours do:
    a step-cost calibration times the engine that runs on a quiet machine, not a count of the
    moment (``auto.costmodel.calibrate``). Nothing where there is no governor."""
    if governor is None or governor.held:
        yield
    else:
        with governor.hold():
            yield


__all__ = ["ThreadChoice", "ThreadGovernor", "choose_threads", "chosen_threads", "held",
           "other_load", "poll", "usable_cpus"]
