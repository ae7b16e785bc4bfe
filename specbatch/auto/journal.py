"""``--method auto``'s decision journal, ``OUT.decisions.jsonl``: what a resume needs to decide
every row as the interrupted run did.

Auto's choices are joint over the rows of a step (the step cap with its hysteresis, the rate
the cuts are priced at, whether a candidate is used at all, acceptance pooled over rows). A
resumed job replays the records finished before the kill as placeholders (``sequence.Replay``:
no model work, so they are not rows of the policy's step); a record that was in flight at the
kill runs again beside them and, left to the policy, would be decided differently. So the job
journals each verify step's choice per row, and a resume makes the rows take the journaled
choices until the journal ends, then sets the pooled state the interrupted run had there
(``AdaptivePolicy.force``); from then on the rows and the state are those of the
uninterrupted run, and so are the decisions.

One JSON line per verify step (``orjson``, no spaces):

    {"rows": [[record index, turn, sample, source, draft length], ...]}

(the request id, ``Request.request_id``, then the choice; a request id that is not a tuple is
one value).
``source`` is the candidate that drafted (``ngram``, ``suffix``, ``draft``), ``none``, or
``idle`` (a step the policy slept through: only prompt lookup proposed, ``auto.policy``). Lines
are buffered and appended ``FLUSH_STEPS`` at a time, and before each finished record is written
to the work file (``flush``), so the journal always covers the steps of the records the work
file holds; the last line of every append also holds ``"state"`` (``AdaptivePolicy.state``, at
the end of that step). On reading, a truncated last line and the lines after the last ``state``
are dropped (the file is cut there). Size: only the steps since the first step of the oldest
record not yet in the work file are needed; when the file is over ``COMPACT_BYTES`` and twice
what is needed, it is rewritten with those lines only (a temporary file renamed over it).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import orjson

FLUSH_STEPS = 256  # steps buffered before an append (a finished record appends at once)
COMPACT_BYTES = 1 << 20  # the file is rewritten with the needed lines only past this size


def journal_path(out_path: str | os.PathLike) -> Path:
    """``OUT.decisions.jsonl`` beside ``out_path``."""
    p = Path(out_path)
    return p.with_name(p.name + ".decisions.jsonl")


class DecisionJournal:
    """Append auto's per-step choices to ``path``; on resume, read them back for the policy.

    resume: whether the job continues an interrupted one (the writer continued its work file):
    the journal there is read (``decisions``, ``state``); otherwise any file there is removed.
    done: the record indices already in the work file (their rows are placeholders now; a
    request id's first value, ``Request.tag`` in ``pipeline``).
    Raises ``ValueError`` (one line naming the file and line) for a corrupt line that is not
    the last; the file is then left as it was.
    """

    def __init__(self, path: str | os.PathLike, *, resume: bool, done: set[int]) -> None:
        self.path = Path(path)
        self.policy = None
        self.decisions: dict[tuple, list[tuple[str, int]]] = defaultdict(list)
        self.state: dict | None = None
        self._written = set(done)  # record indices in the work file
        self._lines: list[tuple[bytes, frozenset]] = []  # appended lines still needed, in order
        self._pending: list[tuple[list, frozenset]] = []  # steps not appended yet
        self._size = 0
        if resume and self.path.exists():
            self._read()
        else:
            self.path.unlink(missing_ok=True)
        self._fh = open(self.path, "ab")

    def _read(self) -> None:
        data = self.path.read_bytes()
        raw_lines = data.split(b"\n")
        complete = raw_lines[:-1]  # the part after the last newline is cut short (or empty)
        items, end, offset = [], 0, 0
        for n, raw in enumerate(complete):
            offset += len(raw) + 1
            try:
                item = orjson.loads(raw)
                rows = [(tuple(row[:-2]), str(row[-2]), int(row[-1])) for row in item["rows"]]
                if any(not rid for rid, _, _ in rows):
                    raise ValueError("a row without its request id")
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{self.path}: line {n + 1} is not a decision line "
                                 f"({e})") from None
            items.append((raw, rows, item.get("state")))
            if item.get("state") is not None:
                end = offset
                last_state = len(items)
        if end == 0:  # nothing usable: start the journal afresh
            self.path.write_bytes(b"")
            return
        items = items[:last_state]
        with open(self.path, "r+b") as f:
            f.truncate(end)
        self._size = end
        for raw, rows, _ in items:
            for rid, src, k in rows:
                if rid[0] not in self._written:
                    self.decisions[rid].append((src, k))
            self._lines.append((raw, frozenset(rid[0] for rid, _, _ in rows)))
        self.state = items[-1][2]

    def attach(self, policy) -> None:
        """Journal ``policy``'s steps (``step``) and make it replay what was read
        (``AdaptivePolicy.force``)."""
        self.policy = policy
        policy.force(dict(self.decisions), self.state)

    def step(self, policy) -> None:
        """The end of a verify step: buffer its choices (``AdaptivePolicy.decisions``); a step
        replayed from the journal is in it already."""
        if policy.replaying:
            return
        rows = [[*rid, src, n] for rid, src, n in policy.decisions]
        self._pending.append((rows, frozenset(r[0] for r in rows)))
        if len(self._pending) >= FLUSH_STEPS:
            self.flush()

    def flush(self) -> None:
        """Append the buffered steps, the last with the policy's state, and fsync. Call it
        between steps only (the state is the last step's end): before writing a finished
        record to the work file, so the journal covers it."""
        if not self._pending or self.policy is None:
            return
        lines = [orjson.dumps({"rows": rows}) for rows, _ in self._pending[:-1]]
        lines.append(orjson.dumps({"rows": self._pending[-1][0], "state": self.policy.state()}))
        data = b"".join(line + b"\n" for line in lines)
        self._fh.write(data)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._size += len(data)
        self._lines.extend(zip(lines, (tags for _, tags in self._pending)))
        self._pending.clear()
        self._compact()

    def written(self, index: int) -> None:
        """Record ``index`` is in the work file: its steps are no longer needed."""
        self._written.add(index)

    def _compact(self) -> None:
        """Forget the lines before the first one with a record not in the work file (the last
        line, which holds the state, always stays); rewrite the file when it is over
        ``COMPACT_BYTES`` and more than twice what is kept."""
        first = next((i for i, (_, tags) in enumerate(self._lines) if tags - self._written),
                     len(self._lines) - 1)
        if first > 0:
            del self._lines[:first]
        kept = sum(len(raw) + 1 for raw, _ in self._lines)
        if self._size <= COMPACT_BYTES or self._size <= 2 * kept:
            return
        from specbatch.io.writer import _atomic_write

        self._fh.close()
        _atomic_write(self.path, b"".join(raw + b"\n" for raw, _ in self._lines))
        self._fh = open(self.path, "ab")
        self._size = kept

    def close(self) -> None:
        """Close the file without appending what is buffered (an interrupt may come mid-step,
        when the policy's state is not a step's end)."""
        if not self._fh.closed:
            self._fh.close()

    def remove(self) -> None:
        """The job is finished: close and delete the journal."""
        self.close()
        self.path.unlink(missing_ok=True)
