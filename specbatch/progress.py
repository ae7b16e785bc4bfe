"""Progress of a ``specbatch run`` on stderr: a bar on a terminal, plain lines in a log.

The rate counts every output token generated in this run, the rows still in flight included
(``tick`` gets the engine's running total each verify step): a job of long answers finishes few
records for minutes, and a rate of finished records only read 0.7 tok/s where the run made 6.8
(issue 36). The time left is estimated from tokens, not records: the records not finished yet
times the mean output tokens of the records finished in this run (``max_tokens`` before any
finished), less the tokens of the records in flight (a finished turn of one included), at the
token rate so far.

On a terminal a tqdm bar over records is redrawn at most every ``redraw`` seconds. Elsewhere
(stderr redirected to a file, a cron log) a plain line is written every ``interval`` seconds
and one at the end, e.g.

    progress: 3/8 records, 412 tokens (57 in flight), 6.8 tok/s, accept len 2.31, 1:02 elapsed, ~0:40 left
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from specbatch.spec_decode.stats import SpecStats


def _clock(seconds: float) -> str:
    """``75`` -> ``1:15``; ``3725`` -> ``1:02:05``."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Progress:
    """total: the job's records; initial: those finished before this run (a resume) or
    skipped; max_tokens: the most output tokens a record may take (the estimate before any
    record finished). stream: stderr; tty: whether it is a terminal (default:
    ``stream.isatty()``); interval: seconds between plain lines; clock: ``time.monotonic``
    (tests pass their own)."""

    def __init__(self, total: int, initial: int = 0, max_tokens: int = 1,
                 stream: TextIO | None = None, tty: bool | None = None,
                 interval: float = 10.0, redraw: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.initial, self.max_tokens = total, initial, max_tokens
        self.interval, self.redraw, self.clock = interval, redraw, clock
        self.start = clock()
        self.last_shown = self.start
        self.num_records = 0  # finished in this run
        self.num_tokens = 0  # generated in this run, in-flight rows included
        self.num_finished_tokens = 0  # of the finished answers
        self.num_record_tokens = 0  # of the finished records
        self.stats = SpecStats()
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="rec", file=self.stream,
                            dynamic_ncols=True,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")

    # ---- what the run reports --------------------------------------------------------------
    def tick(self, num_tokens: int) -> None:
        """The engine's running total of output tokens committed in this run (every step)."""
        self.num_tokens = max(self.num_tokens, num_tokens)
        self._maybe_show()

    def answer_done(self, num_tokens: int, stats: SpecStats) -> None:
        """An answer (a sample, a turn) finished with ``num_tokens`` output tokens."""
        self.num_finished_tokens += num_tokens
        self.num_tokens = max(self.num_tokens, self.num_finished_tokens)
        self.stats.merge(stats)

    def record_done(self, num_tokens: int | None = None) -> None:
        """A record finished with ``num_tokens`` output tokens (all its answers; default: every
        finished answer's tokens not yet counted in a record)."""
        self.num_records += 1
        self.num_record_tokens += (self.num_finished_tokens - self.num_record_tokens
                                   if num_tokens is None else num_tokens)
        if self.bar is not None:
            self.bar.update(1)
        self._maybe_show(force=self.bar is not None)

    def close(self) -> None:
        """The final line (plain) or the bar's last draw."""
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(final=True), refresh=True)
            self.bar.close()
            self.bar = None
        elif self.stream is not None:
            print(self.line(final=True), file=self.stream, flush=True)
            self.stream = None

    # ---- numbers ---------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        return max(self.clock() - self.start, 1e-9)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.elapsed

    def seconds_left(self) -> float | None:
        """Estimated from tokens (module docstring); None before any token."""
        left = self.total - self.initial - self.num_records
        if left <= 0:
            return 0.0
        if not self.num_tokens:
            return None
        per_record = (self.num_record_tokens / self.num_records if self.num_records
                      else self.max_tokens)
        return max(left * per_record - self.in_flight, 0.0) / self.tokens_per_second

    def _postfix(self, final: bool = False) -> str:
        parts = [f"{self.num_tokens} tok", f"{self.tokens_per_second:.1f} tok/s"]
        if (mal := self.stats.mean_acceptance_length) is not None:
            parts.append(f"accept len {mal:.2f}")
        left = self.seconds_left()
        if not final:
            parts.append("left ?" if left is None else f"~{_clock(left)} left")
        return ", ".join(parts)

    @property
    def in_flight(self) -> int:
        """Output tokens of the records not finished yet (a finished turn of one included)."""
        return self.num_tokens - self.num_record_tokens

    def line(self, final: bool = False) -> str:
        """The plain progress line."""
        done = self.initial + self.num_records
        in_flight = self.in_flight
        out = (f"progress: {done}/{self.total} records, {self.num_tokens} tokens"
               + (f" ({in_flight} in flight)" if in_flight and not final else "")
               + f", {self.tokens_per_second:.1f} tok/s")
        if (mal := self.stats.mean_acceptance_length) is not None:
            out += f", accept len {mal:.2f}"
        out += f", {_clock(self.elapsed)} elapsed"
        if not final:
            left = self.seconds_left()
            out += ", time left ?" if left is None else f", ~{_clock(left)} left"
        return out

    def _maybe_show(self, force: bool = False) -> None:
        now = self.clock()
        if self.bar is not None:
            if force or now - self.last_shown >= self.redraw:
                self.last_shown = now
                self.bar.set_postfix_str(self._postfix(), refresh=True)
        elif self.stream is not None and now - self.last_shown >= self.interval:
            self.last_shown = now
            print(self.line(), file=self.stream, flush=True)


__all__ = ["Progress"]
