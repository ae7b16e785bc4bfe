"""Write outputs so that nothing is lost and nothing is duplicated, across kills and reruns.

Next to the output ``OUT`` live:
    OUT.work.jsonl    one line ``{"index": i, "record": {...}}`` per finished record, appended as
                      records finish (flushed every write, fsynced every ``fsync_every``);
                      ``--method suffix`` adds ``"schedule": [...]``, where each of its answers
                      ran (``pipeline.generate_records``), which a resume replays. OUT gets
                      the records only.
    OUT.config.json   the effective config of the run (kept after the run, for ``analyze``).
    OUT.calibration.json  ``--method auto``: the step-cost fits its decisions use
                      (``auto.costmodel.save_job_fits``), written when the job starts; a
                      resume prices its steps with them, whatever the cache holds by then.
                      Kept after the run (``--calibration`` reads it: another job priced
                      alike).
    OUT.decisions.jsonl  ``--method auto``: each verify step's choice per row
                      (``auto.journal``), which a resume replays for the records that were in
                      flight; removed by ``finish``.
    OUT.errors.jsonl  the skipped records, ``{"line", "id", "reason"}`` (``--on-error skip``).
    OUT.lock          held (``flock``) while a run writes OUT, holding its process id: a second
                      run on the same OUT is refused at open (``ValueError``), not mixed in.
    OUT.work.NAME.jsonl  a replica's own work file (``WorkShard``, ``specbatch run --ray``), in
                      the work file's format; opening ``OutputWriter`` (and ``absorb_shards``)
                      moves its records into the work file, so a resumed run skips them.

``finish()`` writes ``OUT`` in index order to a temporary file in the same folder, fsyncs it,
renames it over ``OUT`` (atomic) and removes the work file. The final file is always built from
the work file, so a run that was killed and resumed gives the same bytes as one that was not.
A kill inside ``finish`` leaves at worst a ``.OUT.*.tmp`` file (removed at the next open) and the
work file, from which the next run writes ``OUT`` again.

What happens on open (``force`` means start over; ``resume`` means trust an existing work file):
    force and not resume           start over: the work file is discarded, OUT replaced at finish.
    work file, same saved config   continue (rerunning the same command resumes it).
    work file, no saved config     continue if ``resume``, else ``ValueError``.
    work file, different config    ``ValueError`` naming the differing keys; with ``force``,
                                   start over (results of another config are never mixed in).
    no work file, OUT exists       ``ValueError`` (a finished run) unless ``force``.
"""

from __future__ import annotations

import os
import tempfile

try:
    import fcntl
except ImportError:  # not POSIX: no lock (one run per OUT is then the user's to keep)
    fcntl = None
from collections.abc import Iterable
from glob import escape as glob_escape
from pathlib import Path

import orjson

from specbatch.io.records import RecordError

# The same flags for every line ever written: the final bytes depend only on the records.
JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY
OUTPUT_FORMATS = (".jsonl", ".parquet")


def check_output_path(out_path: str | os.PathLike,
                      input_path: str | os.PathLike | None = None, *,
                      force: bool | None = None) -> None:
    """Raise ``ValueError`` naming the problem if ``out_path`` cannot be written: the input
    file itself (never overwritten, not even with ``--force``), an extension other than
    ``OUTPUT_FORMATS``, a folder in its place, or a parent that cannot be created (a file in
    the way) or written; and, when ``force`` is given and False, an ``OUT`` from a finished
    run (no work file beside it), which ``OutputWriter`` would refuse. Writability is tried,
    not inferred from permission bits (root passes ``os.access`` on ``/proc``): the missing
    folders are created and a temporary file is created in the parent and removed, as the run
    would; the folders this check created are removed again (the run creates them when it
    starts). Cheap, so callers check before loading a model."""
    path = Path(out_path)
    if str(out_path) == "-":
        raise ValueError("-o -: writing the output to standard output is not supported (the "
                         "output is written as records finish and renamed at the end, so a "
                         "killed job resumes); name a file, e.g. -o out.jsonl")
    if input_path is not None and Path(input_path).resolve() == path.resolve():
        raise ValueError(f"output {str(out_path)!r} is the input file; choose another -o")
    if path.suffix.lower() not in OUTPUT_FORMATS:
        raise ValueError(f"output {str(out_path)!r}: expected a name ending in "
                         f"{' or '.join(OUTPUT_FORMATS)}")
    if path.is_dir():
        raise ValueError(f"output {str(out_path)!r} is a folder; expected a file name")
    parent = path.absolute().parent
    while not parent.exists():  # the folders that do not exist yet are created at open
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"cannot create the output folder {str(path.parent)!r}: {parent} is "
                         "not a folder")
    if force is False and path.is_file() and not _beside(path, ".work.jsonl").exists():
        raise ValueError(f"{path} exists from a finished run; --force to overwrite")
    _try_writing(path, out_path)


def _lock(out_path: Path, create: bool = True):
    """``OUT.lock`` opened and locked (``flock``, exclusive): the open file, which holds the
    lock until closed; None without ``fcntl``, or when ``create`` is False and there is no lock
    file. Raises ``ValueError`` naming the process that holds it."""
    path = _beside(out_path, ".lock")
    if fcntl is None or not (create or path.exists()):
        return None
    fh = open(path, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise ValueError(f"{out_path} is being written by another specbatch run (process "
                         f"{holder}, {path}); wait for it to end or choose another -o") from None
    return fh


class OutLock:
    """``OUT.lock`` taken before the model loads (``specbatch run``), so that of two runs started
    on one ``-o`` together the second is refused at once, not after its model load: raises
    ``ValueError`` naming the process that holds it. Creates the missing folders of OUT (to
    hold the lock file). An ``OutputWriter`` given it (``lock=``) holds it from then on;
    ``release`` lets a run that ends before that go, removing the lock file and the folders
    it created (those still empty)."""

    def __init__(self, out_path: str | os.PathLike) -> None:
        self.path = _beside(Path(out_path), ".lock")
        self.adopted = False
        self._created: list[Path] = []  # deepest first
        folder = Path(out_path).absolute().parent
        missing = []
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        try:
            for f in reversed(missing):
                f.mkdir(exist_ok=True)
                self._created.insert(0, f)
            self.fh = _lock(Path(out_path))
        except (OSError, ValueError):
            self._remove_folders()
            raise
        if self.fh is not None:
            self.fh.seek(0)
            self.fh.truncate()
            self.fh.write(f"{os.getpid()}\n")
            self.fh.flush()

    def release(self) -> None:
        """Unless an ``OutputWriter`` holds it now: let the lock go, remove the lock file and
        the folders made for it."""
        if self.adopted:
            return
        if self.fh is not None:
            self.fh.close()
            self.fh = None
            self.path.unlink(missing_ok=True)
        self._remove_folders()

    def _remove_folders(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:
                pass  # something else is in it now
        self._created = []


def check_not_in_use(out_path: str | os.PathLike) -> None:
    """Raise ``ValueError`` (as ``OutputWriter`` would at open) when another run writes
    ``out_path`` now, so that a run can refuse before it loads its model. Creates nothing."""
    fh = _lock(Path(out_path), create=False)
    if fh is not None:
        fh.close()


def _try_writing(path: Path, out_path: str | os.PathLike) -> None:
    """Create the missing folders of ``path`` and a temporary file beside it, as ``OutputWriter``
    does, then remove both; raise ``ValueError`` with the system's reason if either fails."""
    parent = path.absolute().parent
    missing = []  # the folders that do not exist yet, deepest first
    folder = parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    created = []  # the folders made here, deepest first
    try:
        for folder in reversed(missing):
            try:
                folder.mkdir()
            except OSError as e:
                if isinstance(e, FileExistsError) and folder.is_dir():
                    continue  # made meanwhile by someone else: not ours to remove
                raise ValueError(f"cannot create the output folder {str(path.parent)!r}: "
                                 f"{e.strerror or e}") from None
            created.insert(0, folder)
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        except OSError as e:
            raise ValueError(f"cannot write the output {str(out_path)!r}: folder {parent} is "
                             f"not writable ({e.strerror or e})") from None
        os.close(fd)
        os.unlink(tmp)
    finally:
        for folder in created:  # deepest first; a folder someone filled meanwhile stays
            try:
                folder.rmdir()
            except OSError:
                pass


def check_resume(out_path: str | os.PathLike, config: dict) -> None:
    """Refuse early, before a model loads, to continue a work file whose saved config differs
    from ``config`` in one of ``config``'s keys (the options known without the model): the
    same ``ValueError`` ``OutputWriter`` raises later. Nothing is checked or changed when there
    is no work file or no readable saved config (``OutputWriter`` decides those)."""
    out_path = Path(out_path)
    work_path = _beside(out_path, ".work.jsonl")
    config_path = _beside(out_path, ".config.json")
    if not work_path.exists() and not _shard_paths(out_path):
        return
    try:
        saved = orjson.loads(config_path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return
    config = _as_saved(orjson.loads(orjson.dumps(config, option=JSON_OPTIONS)), saved)
    keys = _diff({k: saved.get(k) for k in config}, config)
    if keys:
        raise ValueError(_refusal(work_path, _differs(config_path, saved, config, keys)))


def _shard_paths(out_path: Path) -> list[Path]:
    """The replicas' work files of ``out_path`` (``WorkShard``)."""
    return sorted(out_path.parent.glob(f"{glob_escape(out_path.name)}.work.*.jsonl"))


def _differs(config_path: Path, saved: dict, config: dict, keys: list[str]) -> str:
    """Why a work file is not continued: the keys in which its saved config differs from this
    run's, and, where the dtype differs, the flag that resumes it: an output written in float32
    before ``--dtype auto`` picked int8 for a GGUF is continued with ``--dtype float32``."""
    why = f"the saved config {config_path} differs in: {', '.join(keys)}; "
    was, now = saved.get("dtype"), config.get("dtype")
    if "dtype" in keys and isinstance(was, str):
        picked = (f"--dtype auto now picks {now} for this model ({config['dtype_auto']})"
                  if config.get("dtype_auto") else f"this run asks for {now}")
        said = f"it was written in {was} and {picked}"
        if set(keys) <= {"dtype", "dtype_auto"}:
            return why + f"{said}: resume with --dtype {was}"
        return why + f"rerun with the same options ({said}: --dtype {was})"
    if "input_sha256" in keys and config.get("input") == "-":
        return why + "pipe the same input again (and the same options)"
    if keys == ["max_batch_size"] and isinstance(saved.get("max_batch_size"), int):
        return why + (f"the run asked for {saved['max_batch_size']} rows (outputs do not depend "
                      "on it, suffix's and auto's spec stats do): resume with "
                      f"--max-batch-size {saved['max_batch_size']}")
    return why + "rerun with the same options"


def _refusal(work_path: Path, why: str) -> str:
    return f"cannot continue {work_path}: {why}, or --force to start over"


class OutputWriter:
    """Append finished records to the work file; ``finish()`` writes the final output.

    out_path: ``.jsonl`` or ``.parquet`` (by extension). config: JSON-serialisable dict of the
    effective run config, compared key by key with the saved one on resume. num_records: the
    number of valid input records; indices are ``0 .. num_records - 1``.
    Raises ``ValueError`` on open when the existing files may not be reused (see module doc).
    lock: ``OUT.lock`` as an ``OutLock`` took it (before the model loaded); default: taken
    here.
    """

    def __init__(self, out_path: str | os.PathLike, config: dict, *, resume: bool, force: bool,
                 fsync_every: int = 8, num_records: int, lock: OutLock | None = None) -> None:
        self.out_path = Path(out_path)
        check_output_path(out_path)
        if fsync_every < 1:
            raise ValueError(f"fsync_every={fsync_every!r}: expected an integer >= 1")
        self.work_path = _beside(self.out_path, ".work.jsonl")
        self.config_path = _beside(self.out_path, ".config.json")
        self.errors_path = _beside(self.out_path, ".errors.jsonl")
        self.fits_path = _beside(self.out_path, ".calibration.json")
        self.decisions_path = _beside(self.out_path, ".decisions.jsonl")
        self.resumed = False
        self.config = orjson.loads(orjson.dumps(config, option=JSON_OPTIONS))
        self.num_records = num_records
        self.fsync_every = fsync_every
        self._done: set[int] = set()
        self._finished: dict[int, dict] = {}  # index -> record, from the work file
        self._schedules: dict[int, list] = {}  # index -> its "schedule", where there is one
        self._num_unsynced = 0
        self._fh = None
        self._lock = None
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        if lock is not None:  # taken before the model loaded: this writer holds it now
            lock.adopted = True
            self._lock = lock.fh
        else:
            self._take_lock()
        try:
            self._open(resume, force)
        except BaseException:
            if self._fh is None:  # refused: nothing of this run is beside OUT
                _beside(self.out_path, ".lock").unlink(missing_ok=True)
            self.close()
            raise

    def _open(self, resume: bool, force: bool) -> None:
        """Check the files beside OUT against this run (module doc), load the work file, write
        the config and open the work file for appending."""
        if force and not resume:
            self._discard_work()
        elif self.work_path.exists() or self._shard_paths():
            saved = self._saved_config()
            if saved is None and not resume:
                self._refuse_or_discard(force, f"{self.config_path} is missing or unreadable; "
                                        "--resume to continue anyway")
            elif saved is not None and saved != _as_saved(self.config, saved):
                config = _as_saved(self.config, saved)
                self._refuse_or_discard(force, _differs(self.config_path, saved, config,
                                                        _diff(saved, config)))
        elif self.out_path.exists() and not force:
            raise ValueError(f"{self.out_path} exists from a finished run; --force to overwrite")
        self.resumed = self.work_path.exists()  # an interrupted job continues
        if self.work_path.exists():
            self._finished = self._load_work()
            self._done = set(self._finished)
        self._remove_stale_temp_files()
        _atomic_write(self.config_path, orjson.dumps(self.config, option=orjson.OPT_INDENT_2)
                      + b"\n")
        self._fh = open(self.work_path, "ab")
        self.absorb_shards()

    def absorb_shards(self) -> int:
        """Move the records of the replicas' work files (``WorkShard``) into the work file (an
        index already done keeps its first record) and remove those files; returns the records
        added. Call it when no replica is writing any more. A last line cut short by a kill is
        dropped; a corrupt line elsewhere raises ``ValueError``."""
        added = 0
        for path in self._shard_paths():
            for index, record in _read_shard(path, self.num_records):
                added += self.write(index, record)
            self._sync()
            path.unlink(missing_ok=True)
        return added

    def _shard_paths(self) -> list[Path]:
        return _shard_paths(self.out_path)

    def done_indices(self) -> set[int]:
        """``Record.index`` values already finished (skip these)."""
        return set(self._done)

    def finished_records(self) -> list[dict]:
        """The output records of an earlier run's finished records, in the order they finished
        (the work file's order): what a resumed ``--method suffix`` job re-indexes."""
        return list(self._finished.values())

    def finished_schedules(self) -> dict[int, list]:
        """index -> the ``schedule`` an earlier run wrote with that finished record (records
        written without one are absent): what a resumed ``--method suffix`` job replays."""
        return dict(self._schedules)

    def write(self, index: int, out: dict, schedule: list | None = None) -> bool:
        """Append one finished record (and, given, its ``schedule``, kept in the work file
        only); returns False (and writes nothing) if already done."""
        if index in self._done:
            return False
        if not 0 <= index < self.num_records:
            raise ValueError(f"index={index}: expected 0 <= index < {self.num_records}")
        item = {"index": index, "record": out}
        if schedule is not None:
            item["schedule"] = schedule
        self._fh.write(orjson.dumps(item, option=JSON_OPTIONS) + b"\n")
        self._fh.flush()  # a killed process loses nothing the OS has; fsync guards power loss
        self._done.add(index)
        self._num_unsynced += 1
        if self._num_unsynced >= self.fsync_every:
            self._sync()
        return True

    def finish(self, skipped: Iterable[int] = ()) -> int:
        """Write OUT in index order, atomically; remove the work file. Returns records written.

        skipped: indices deliberately not generated (e.g. prompts too long, ``--on-error
        skip``). Raises ``RuntimeError`` if any other index was never written.
        """
        self._sync()
        missing = sorted(set(range(self.num_records)) - self._done - set(skipped))
        if missing:
            raise RuntimeError(f"{len(missing)} records never written (indices {missing[:10]}"
                               f"{' ...' if len(missing) > 10 else ''})")
        records = self._load_work()
        rows = [records[i] for i in sorted(records)]
        fd, tmp = _temp_beside(self.out_path)
        try:
            with os.fdopen(fd, "wb") as f:
                if self.out_path.suffix.lower() == ".parquet":
                    _to_parquet(rows, f)
                else:
                    f.write(b"".join(orjson.dumps(r, option=JSON_OPTIONS) + b"\n" for r in rows))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.out_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _fsync_dir(self.out_path.parent)
        _beside(self.out_path, ".lock").unlink(missing_ok=True)  # still held: nobody is in
        self.close()
        self.work_path.unlink(missing_ok=True)
        self.decisions_path.unlink(missing_ok=True)
        return len(rows)

    def write_errors(self, errors: list[RecordError]) -> None:
        """Replace ``OUT.errors.jsonl`` with these errors; with none, remove a stale file."""
        if not errors:
            self.errors_path.unlink(missing_ok=True)
            return
        _atomic_write(self.errors_path, b"".join(
            orjson.dumps({"line": e.line, "id": e.id, "reason": e.reason}) + b"\n"
            for e in errors))

    def close(self) -> None:
        """Flush and fsync what is written (call on interrupt); ``finish`` calls it too. Lets
        the lock go."""
        if self._fh is not None and not self._fh.closed:
            self._sync()
            self._fh.close()
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None

    def _take_lock(self) -> None:
        """Hold ``OUT.lock`` for as long as this writer is open; raise ``ValueError`` naming
        the process that holds it."""
        fh = _lock(self.out_path)
        if fh is not None:
            fh.seek(0)
            fh.truncate()
            fh.write(f"{os.getpid()}\n")
            fh.flush()
        self._lock = fh

    def __enter__(self) -> OutputWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _sync(self) -> None:
        if self._fh is not None and not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
        self._num_unsynced = 0

    def _saved_config(self) -> dict | None:
        try:
            return orjson.loads(self.config_path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None

    def _refuse_or_discard(self, force: bool, why: str) -> None:
        if not force:
            raise ValueError(_refusal(self.work_path, why))
        self._discard_work()

    def _remove_stale_temp_files(self) -> None:
        """A run killed inside ``finish`` (or ``_atomic_write``) leaves ``.OUT.*.tmp``; the
        final file is rebuilt from the work file, so such a leftover is never needed."""
        for name in (self.out_path.name, self.config_path.name, self.errors_path.name,
                     self.fits_path.name, self.decisions_path.name):
            for tmp in self.out_path.parent.glob(f".{glob_escape(name)}.*.tmp"):
                tmp.unlink(missing_ok=True)

    def _discard_work(self) -> None:
        self.work_path.unlink(missing_ok=True)
        self.decisions_path.unlink(missing_ok=True)
        self.fits_path.unlink(missing_ok=True)
        for path in self._shard_paths():
            path.unlink(missing_ok=True)

    def _load_work(self) -> dict[int, dict]:
        """index -> record from the work file; the first line of an index wins.

        A last line cut short by a kill is dropped (the file is truncated before it, so the
        next append starts on a fresh line); a bad line elsewhere raises ``ValueError``.
        """
        data = self.work_path.read_bytes()
        lines = data.split(b"\n")
        last = max((n for n, raw in enumerate(lines) if raw.strip()), default=-1)
        records, offset = {}, 0
        for n, raw in enumerate(lines):
            if raw.strip():
                try:
                    item = orjson.loads(raw)
                except orjson.JSONDecodeError as e:
                    if n != last:
                        raise ValueError(f"{self.work_path}: line {n + 1} is corrupt ({e}); "
                                         "--force to start over") from e
                    with open(self.work_path, "r+b") as f:
                        f.truncate(offset)
                    return records
                try:
                    index, record = _check_item(item, self.num_records)
                except ValueError as e:
                    raise ValueError(f"{self.work_path}: line {n + 1}: {e}; --force to start "
                                     "over") from e
                if index not in records and isinstance(item.get("schedule"), list):
                    self._schedules[index] = item["schedule"]
                records.setdefault(index, record)
            offset += len(raw) + 1
        if data and not data.endswith(b"\n"):  # a whole last line that lost only its newline
            with open(self.work_path, "ab") as f:
                f.write(b"\n")
        return records


class WorkShard:
    """One replica's work file, ``OUT.work.NAME.jsonl``: finished records appended as they
    finish (flushed every write, fsynced every ``fsync_every``), in the work file's format, so
    a killed job loses at most the replica's unfinished records. The driver's ``OutputWriter``
    absorbs it (``absorb_shards``). name: unique per replica (host, pid)."""

    def __init__(self, out_path: str | os.PathLike, name: str, num_records: int,
                 fsync_every: int = 8) -> None:
        if not name or "/" in name:
            raise ValueError(f"shard name {name!r}: expected a non-empty file-name part")
        self.path = _beside(Path(out_path), f".work.{name}.jsonl")
        self.num_records = num_records
        self.fsync_every = fsync_every
        self._num_unsynced = 0
        self._fh = open(self.path, "ab")

    def write(self, index: int, record: dict) -> None:
        if not 0 <= index < self.num_records:
            raise ValueError(f"index={index}: expected 0 <= index < {self.num_records}")
        self._fh.write(orjson.dumps({"index": index, "record": record}, option=JSON_OPTIONS)
                       + b"\n")
        self._fh.flush()
        self._num_unsynced += 1
        if self._num_unsynced >= self.fsync_every:
            os.fsync(self._fh.fileno())
            self._num_unsynced = 0

    def sync(self) -> None:
        """fsync what is written."""
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._num_unsynced = 0

    def close(self) -> None:
        self.sync()
        self._fh.close()


def _read_shard(path: Path, num_records: int) -> list[tuple[int, dict]]:
    """``(index, record)`` of a replica's work file; its last line, if cut short by a kill, is
    dropped. Raises ``ValueError`` for a corrupt line elsewhere."""
    lines = [raw for raw in path.read_bytes().split(b"\n") if raw.strip()]
    items = []
    for n, raw in enumerate(lines):
        try:
            item = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            if n == len(lines) - 1:
                break
            raise ValueError(f"{path}: line {n + 1} is corrupt ({e}); --force to start "
                             "over") from e
        try:
            items.append(_check_item(item, num_records))
        except ValueError as e:
            raise ValueError(f"{path}: line {n + 1}: {e}; --force to start over") from e
    return items


def _check_item(item, num_records: int) -> tuple[int, dict]:
    if not isinstance(item, dict) or not isinstance(item.get("record"), dict):
        raise ValueError("expected {\"index\": ..., \"record\": {...}}")
    index = item.get("index")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_records:
        raise ValueError(f"index {index!r} is not in [0, {num_records}): did the input change?")
    return index, item["record"]


# config keys recorded since a release: a work file whose saved config lacks one was written
# before it and resumes whatever this run's value (the job was not started with another)
ADDED_LATER = ("max_batch_size",)


def _as_saved(config: dict, saved: dict) -> dict:
    """``config`` without the ``ADDED_LATER`` keys that ``saved`` lacks."""
    return {k: v for k, v in config.items() if k in saved or k not in ADDED_LATER}


def _diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ, e.g. ``['sampling.temperature', 'k']``."""
    keys = []
    for k in list(a) + [k for k in b if k not in a]:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += _diff(va, vb, f"{prefix}{k}.")
        elif k not in a or k not in b or va != vb:
            keys.append(f"{prefix}{k}")
    return keys


def _to_parquet(rows: list[dict], f) -> None:
    """Write ``rows`` as a Parquet table: one column per field of any row, in the order fields
    first appear (a row without one holds null: ``Dataset.from_list`` took only the first
    row's fields). A column whose values share no Arrow type (ids ``1`` and ``"a"``, a
    ``stop_reason`` that is an id in one row and a stop string in another, a string ``output``
    beside an ``n`` > 1 list) is written as text: a string as it is, any other value as its
    JSON (docs/output.md); pyarrow refused such a column at the end of the run."""
    import datasets  # slow import; only parquet output needs it
    import pyarrow

    columns = {}
    for name in dict.fromkeys(k for row in rows for k in row):
        values = [row.get(name) for row in rows]
        try:
            pyarrow.array(values)
        except (pyarrow.ArrowInvalid, pyarrow.ArrowTypeError, TypeError, OverflowError):
            values = [_as_text(v) for v in values]
        columns[name] = values
    datasets.Dataset.from_dict(columns).to_parquet(f)


def _as_text(value) -> str | None:
    """A value of a mixed Parquet column: a string as it is, null as null, else its JSON."""
    if value is None or isinstance(value, str):
        return value
    return orjson.dumps(value, option=JSON_OPTIONS).decode()


def _beside(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _temp_beside(path: Path) -> tuple[int, str]:
    """A temp file next to ``path`` (same folder, so ``os.replace`` is atomic), with the mode a
    plain ``open`` would give (``mkstemp`` makes it 0600, which the final file would keep)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    return fd, tmp


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not every platform can open a folder
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["OutputWriter", "OutLock", "WorkShard", "check_output_path", "check_not_in_use", "JSON_OPTIONS", "OUTPUT_FORMATS"]
