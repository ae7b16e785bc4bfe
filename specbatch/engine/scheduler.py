"""Continuous batching over a fixed number of cache rows. Policy only: no tensors here.

Waiting requests are admitted in the order given (the caller sorts or buckets them); a row
freed by a finished sequence takes the next waiting request at the start of the next step.
Follow-up requests (the next turn of a multi-turn record) go to the front of the queue.
"""

from __future__ import annotations

from collections import deque

from specbatch.engine.sequence import Request, Sequence


class Scheduler:
    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.waiting: deque[Request] = deque()
        self.free_rows: list[int] = list(range(num_rows - 1, -1, -1))  # pop() gives row 0 first
        self.running: dict[int, Sequence] = {}  # row -> sequence

    def add(self, request: Request, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(request)

    def admit(self, make_sequence) -> list[Sequence]:
        """Move waiting requests into free rows. ``make_sequence(request) -> Sequence``."""
        admitted = []
        while self.waiting and self.free_rows:
            seq = make_sequence(self.waiting.popleft())
            seq.row = self.free_rows.pop()
            self.running[seq.row] = seq
            admitted.append(seq)
        return admitted

    def release(self, seq: Sequence) -> None:
        del self.running[seq.row]
        self.free_rows.append(seq.row)
        self.free_rows.sort(reverse=True)

    def running_sequences(self) -> list[Sequence]:
        """Running sequences in row order (so a full batch maps onto rows 0..B-1 as a slice)."""
        return [self.running[r] for r in sorted(self.running)]

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
