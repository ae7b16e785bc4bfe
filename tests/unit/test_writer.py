"""OutputWriter: nothing lost, nothing duplicated, same bytes whether interrupted or not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from specbatch.io.records import RecordError
from specbatch.io.writer import OutputWriter, check_resume

CONFIG = {"model": "smollm2-135m", "dtype": "float32", "method": "ngram", "k": 5,
          "sampling": {"temperature": 0.0, "stop": ("\n\n",)}}
N = 10
ROOT = Path(__file__).parents[2]


def _out(i: int) -> dict:
    # key order is kept; floats and unicode must survive the work-file round trip
    return {"id": f"q{i}", "text": f"answer {i} ✓", "logprob": -0.1 * i / 3,
            "stats": {"num_accepted_tokens": i * 7, "acceptance_length": 1 + i / 7}}


def _uninterrupted(path) -> bytes:
    w = OutputWriter(path, CONFIG, resume=False, force=False, num_records=N)
    for i in reversed(range(N)):  # finishing order differs from input order
        w.write(i, _out(i))
    assert w.finish() == N
    return path.read_bytes()


def test_uninterrupted_output_is_in_index_order(tmp_path):
    data = _uninterrupted(tmp_path / "out.jsonl")
    assert data == b"".join(orjson.dumps(_out(i)) + b"\n" for i in range(N))
    assert not (tmp_path / "out.jsonl.work.jsonl").exists()
    assert orjson.loads((tmp_path / "out.jsonl.config.json").read_bytes())["k"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.config.json"]


@pytest.mark.parametrize("resume", [True, False])  # same config: a plain rerun continues too
def test_interrupted_and_resumed_is_byte_identical(tmp_path, resume):
    reference = _uninterrupted(tmp_path / "ref.jsonl")
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, fsync_every=3, num_records=N)
    for i in (4, 0, 7, 1):
        w.write(i, _out(i))
    del w  # killed: no finish, no close
    w = OutputWriter(out, CONFIG, resume=resume, force=False, num_records=N)
    assert w.done_indices() == {0, 1, 4, 7}
    for i in range(N):
        if i not in w.done_indices():
            w.write(i, _out(i))
    w.finish()
    assert out.read_bytes() == reference


def test_schedules_are_kept_in_the_work_file_only(tmp_path):
    """A record's ``schedule`` (``--method suffix``) survives a kill in the work file, a resume
    reads it back per index (records written without one have none), and OUT has the records'
    bytes only."""
    reference = _uninterrupted(tmp_path / "ref.jsonl")
    out = tmp_path / "out.jsonl"
    sched = {i: [{"id": [i, 0, 0], "admit": i + 1, "verify": i + 1, "finish": i + 5, "row": i % 3,
                  "phase": "verify", "output_ids": [i, 2 * i], "finish_reason": "length"}]
             for i in range(N)}
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    for i in (4, 0, 7):
        w.write(i, _out(i), schedule=sched[i])
    w.write(1, _out(1))  # no schedule
    del w  # killed
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    assert w.finished_schedules() == {i: sched[i] for i in (4, 0, 7)}
    for i in range(N):
        if i not in w.done_indices():
            w.write(i, _out(i), schedule=sched[i])
    w.finish()
    assert out.read_bytes() == reference


def test_killed_process_loses_nothing_written(tmp_path):
    reference = _uninterrupted(tmp_path / "ref.jsonl")
    out = tmp_path / "out.jsonl"
    child = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        from tests.unit.test_writer import CONFIG, N, _out
        from specbatch.io.writer import OutputWriter, check_resume
        w = OutputWriter({str(out)!r}, CONFIG, resume=False, force=False, num_records=N)
        for i in (5, 2, 8):
            w.write(i, _out(i))
        os._exit(9)  # no close, no finish
    """)
    assert subprocess.run([sys.executable, "-c", child]).returncode == 9
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    assert w.done_indices() == {2, 5, 8}
    for i in range(N):
        w.write(i, _out(i))
    w.finish()
    assert out.read_bytes() == reference


def test_truncated_last_line_is_dropped(tmp_path):
    reference = _uninterrupted(tmp_path / "ref.jsonl")
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(0, _out(0))
    w.write(1, _out(1))
    w.close()
    work = tmp_path / "out.jsonl.work.jsonl"
    line = orjson.dumps({"index": 2, "record": _out(2)})
    with open(work, "ab") as f:
        f.write(line[: len(line) // 2])  # killed mid-write
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=N)
    assert w.done_indices() == {0, 1}
    for i in range(2, N):
        w.write(i, _out(i))
    w.finish()
    assert out.read_bytes() == reference


def test_whole_last_line_without_newline_is_kept(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=3)
    w.write(0, _out(0))
    w.close()
    work = tmp_path / "out.jsonl.work.jsonl"
    with open(work, "ab") as f:
        f.write(orjson.dumps({"index": 1, "record": _out(1)}))
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=3)
    assert w.done_indices() == {0, 1}
    w.write(2, _out(2))
    w.finish()
    assert out.read_bytes() == b"".join(orjson.dumps(_out(i)) + b"\n" for i in range(3))


def test_corrupt_middle_line_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    OutputWriter(out, CONFIG, resume=False, force=False, num_records=3).close()
    (tmp_path / "out.jsonl.work.jsonl").write_bytes(
        b'{"index": 0, "rec\n' + orjson.dumps({"index": 1, "record": {}}) + b"\n")
    with pytest.raises(ValueError, match="line 1 is corrupt"):
        OutputWriter(out, CONFIG, resume=True, force=False, num_records=3)


def test_index_beyond_the_input_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=3)
    w.write(1, _out(1))
    w.close()
    with pytest.raises(ValueError, match=r"line 1: index 1 is not in \[0, 1\)"):
        OutputWriter(out, CONFIG, resume=True, force=False, num_records=1)


def test_config_mismatch_refused_and_force_starts_over(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(3, _out(3))
    w.close()
    changed = {**CONFIG, "k": 3, "sampling": {"temperature": 0.7, "stop": ["\n\n"]}}
    for resume in (True, False):
        with pytest.raises(ValueError, match=r"differs in: k, sampling\.temperature"):
            OutputWriter(out, changed, resume=resume, force=False, num_records=N)
    w = OutputWriter(out, changed, resume=True, force=True, num_records=N)
    assert w.done_indices() == set()  # results of the old config are never mixed in
    w.close()
    saved = orjson.loads((tmp_path / "out.jsonl.config.json").read_bytes())
    assert saved["k"] == 3


def test_resume_with_other_options_is_refused_before_the_model_loads(tmp_path):
    """``check_resume`` (run before the load) compares the options it is given with the saved
    config and refuses with the writer's own message; keys it is not given (the model's) are
    not compared; no work file, or no saved config, is left to the writer."""
    out = tmp_path / "out.jsonl"
    check_resume(out, {"k": 3})  # nothing on disk: nothing to refuse
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(3, _out(3))
    w.close()
    check_resume(out, {k: v for k, v in CONFIG.items() if k != "model"})
    early = {"k": 3, "sampling": {"temperature": 0.7, "stop": ["\n\n"]}}
    with pytest.raises(ValueError) as refused:
        check_resume(out, early)
    with pytest.raises(ValueError) as later:
        OutputWriter(out, {**CONFIG, **early}, resume=True, force=False, num_records=N)
    assert str(refused.value) == str(later.value)
    assert "differs in: k, sampling.temperature" in str(refused.value)
    (tmp_path / "out.jsonl.config.json").unlink()
    check_resume(out, early)  # unreadable config: the writer's decision (--resume)


def test_resume_of_an_old_float32_output_says_which_dtype_to_add(tmp_path):
    """A work file written in float32 (the default before ``--dtype auto`` picked int8 for a
    GGUF: no ``dtype_auto`` saved) resumed under auto's int8 is refused, before the load and by
    the writer, with the flag that continues it; resuming with that flag is accepted. Other
    keys differing too: the same hint inside "rerun with the same options"."""
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(3, _out(3))
    w.close()
    auto = {**CONFIG, "dtype": "int8", "dtype_auto": "GGUF Q8_0 codes on the int8 kernels"}
    with pytest.raises(ValueError) as refused:
        check_resume(out, auto)
    with pytest.raises(ValueError) as later:
        OutputWriter(out, auto, resume=True, force=False, num_records=N)
    work, config = tmp_path / "out.jsonl.work.jsonl", tmp_path / "out.jsonl.config.json"
    assert str(refused.value) == str(later.value) == (
        f"cannot continue {work}: the saved config {config} differs in: dtype, dtype_auto; it "
        "was written in float32 and --dtype auto now picks int8 for this model (GGUF Q8_0 codes "
        "on the int8 kernels): resume with --dtype float32, or --force to start over")
    with pytest.raises(ValueError) as both:
        check_resume(out, {**auto, "k": 3})
    assert ("differs in: dtype, k, dtype_auto; rerun with the same options (it was written in "
            "float32 and --dtype auto now picks int8 for this model (GGUF Q8_0 codes on the "
            "int8 kernels): --dtype float32), or --force") in str(both.value)
    with pytest.raises(ValueError, match="it was written in float32 and this run asks for "
                       "float64: resume with --dtype float32"):
        check_resume(out, {**CONFIG, "dtype": "float64"})
    check_resume(out, CONFIG)  # --dtype float32: the saved config's own
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=N)
    assert w.done_indices() == {3}
    w.close()


def test_missing_config_needs_resume(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(2, _out(2))
    w.close()
    (tmp_path / "out.jsonl.config.json").unlink()
    with pytest.raises(ValueError, match="missing or unreadable"):
        OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=N)
    assert w.done_indices() == {2}
    w.close()


def test_force_without_resume_starts_over(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(2, _out(2))
    w.close()
    w = OutputWriter(out, CONFIG, resume=False, force=True, num_records=N)
    assert w.done_indices() == set()
    w.close()


def test_finished_output_is_not_overwritten_without_force(tmp_path):
    out = tmp_path / "out.jsonl"
    _uninterrupted(out)
    for resume in (True, False):
        with pytest.raises(ValueError, match="exists from a finished run"):
            OutputWriter(out, CONFIG, resume=resume, force=False, num_records=N)
    w = OutputWriter(out, CONFIG, resume=False, force=True, num_records=1)
    w.write(0, {"x": 1})
    w.finish()
    assert out.read_bytes() == b'{"x":1}\n'


def test_duplicates_are_ignored(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=2)
    assert w.write(0, _out(0)) is True
    assert w.write(0, {"other": "value"}) is False
    w.close()
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=2)
    assert w.write(0, _out(0)) is False
    w.write(1, _out(1))
    w.finish()
    assert out.read_bytes() == orjson.dumps(_out(0)) + b"\n" + orjson.dumps(_out(1)) + b"\n"


def test_missing_records_and_bad_indices(tmp_path):
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=3)
    with pytest.raises(ValueError, match="index=3"):
        w.write(3, {})
    w.write(0, _out(0))
    with pytest.raises(RuntimeError, match=r"2 records never written \(indices \[1, 2\]\)"):
        w.finish()
    assert not out.exists()
    w.write(2, _out(2))
    assert w.finish(skipped=[1]) == 2  # e.g. prompt too long, --on-error skip
    assert out.read_bytes() == orjson.dumps(_out(0)) + b"\n" + orjson.dumps(_out(2)) + b"\n"


def test_fsync_every(tmp_path, monkeypatch):
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    w = OutputWriter(tmp_path / "out.jsonl", CONFIG, resume=False, force=False, fsync_every=4,
                     num_records=N)
    calls.clear()  # the config file's fsync
    for i in range(9):
        w.write(i, _out(i))
    assert len(calls) == 2
    w.close()
    assert len(calls) == 3


def test_parquet_round_trip(tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "out.parquet"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    for i in (3, 1, 2):
        w.write(i, _out(i))
    w.close()
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=N)
    for i in range(N):
        w.write(i, _out(i))
    w.finish()
    rows = list(datasets.Dataset.from_parquet(str(out), cache_dir=str(tmp_path / "cache")))
    assert rows == [_out(i) for i in range(N)]


def test_parquet_output_with_mixed_column_types(tmp_path):
    """pyarrow refused a column whose values share no type (ids 1 and "a" from a JSONL input,
    a stop_reason that is an EOS id in one row and a stop string in another) with ArrowInvalid
    when OUT.parquet was written, at the end of the run. Such a column is written as text (a
    string as it is, another value as its JSON); a field only some rows have is kept (null in
    the others), where ``Dataset.from_list`` took the first row's fields only."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "out.parquet"
    rows = [{**_out(0), "id": 1, "stop_reason": 2, "meta": {"k": 1}},
            {**_out(1), "id": "a", "stop_reason": "###", "meta": [1, 2]},
            {**_out(2), "id": None, "stop_reason": None, "error": "NaN logits"}]
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=3)
    for i, row in enumerate(rows):
        w.write(i, row)
    assert w.finish() == 3
    assert not w.work_path.exists()
    back = list(datasets.Dataset.from_parquet(str(out), cache_dir=str(tmp_path / "cache")))
    assert [r["id"] for r in back] == ["1", "a", None]
    assert [r["stop_reason"] for r in back] == ["2", "###", None]
    assert [r["meta"] for r in back] == ['{"k":1}', "[1,2]", None]
    assert [r["error"] for r in back] == [None, None, "NaN logits"]
    assert [(r["text"], r["stats"]) for r in back] == [(o["text"], o["stats"]) for o in rows]


def test_errors_file(tmp_path):
    w = OutputWriter(tmp_path / "out.jsonl", CONFIG, resume=False, force=False, num_records=1)
    w.write_errors([RecordError("in.jsonl", 3, 7, "prompt is empty"),
                    RecordError("in.jsonl", 4, None, "invalid JSON: x")])
    assert w.errors_path == tmp_path / "out.jsonl.errors.jsonl"
    assert w.errors_path.read_bytes() == (b'{"line":3,"id":7,"reason":"prompt is empty"}\n'
                                          b'{"line":4,"id":null,"reason":"invalid JSON: x"}\n')
    w.write_errors([])  # a rerun with no errors leaves no stale file
    assert not w.errors_path.exists()
    w.close()


def test_unknown_output_extension(tmp_path):
    with pytest.raises(ValueError, match="expected a name ending in .jsonl or .parquet"):
        OutputWriter(tmp_path / "out.csv", CONFIG, resume=False, force=False, num_records=1)


def test_output_and_config_get_the_mode_open_gives(tmp_path):
    """mkstemp's 0600 must not reach the final files: others in the group can read them."""
    old = os.umask(0o022)
    try:
        _uninterrupted(tmp_path / "out.jsonl")
        w = OutputWriter(tmp_path / "e.jsonl", CONFIG, resume=False, force=False, num_records=1)
        w.write_errors([RecordError(path="in.jsonl", line=3, id="x", reason="empty prompt")])
    finally:
        os.umask(old)
    for name in ("out.jsonl", "out.jsonl.config.json", "e.jsonl.errors.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name


def test_output_may_not_be_the_input(tmp_path):
    from specbatch.io.writer import check_output_path

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    for out in (inp, tmp_path / "sub" / ".." / "in.jsonl"):
        with pytest.raises(ValueError, match="is the input file"):
            check_output_path(out, inp)
    check_output_path(tmp_path / "out.jsonl", inp)


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_unwritable_output_is_found_by_trying(tmp_path):
    """/proc passes ``os.access`` for root, yet nothing can be created in it: the check tries
    (the folders, then a file), so the run stops before the model loads, not after."""
    from specbatch.io.writer import check_output_path

    with pytest.raises(ValueError, match=r"cannot create the output folder '/proc/x': "):
        check_output_path("/proc/x/y.jsonl")
    with pytest.raises(ValueError, match=r"cannot write the output '/proc/y.jsonl': folder "
                                         r"/proc is not writable \("):
        check_output_path("/proc/y.jsonl")


def test_output_check_leaves_nothing_behind(tmp_path):
    """The folders it made to try are removed (the run makes them), nothing else is touched."""
    from specbatch.io.writer import check_output_path

    (tmp_path / "keep").mkdir()
    check_output_path(tmp_path / "keep" / "a" / "b" / "out.jsonl")
    check_output_path(tmp_path / "out.parquet")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["keep"]
    w = OutputWriter(tmp_path / "keep" / "a" / "out.jsonl", CONFIG, resume=False, force=False,
                     num_records=1)
    w.write(0, _out(0))
    w.finish()
    assert (tmp_path / "keep" / "a" / "out.jsonl").is_file()


def test_replica_work_files_are_absorbed_on_open(tmp_path):
    """Ray replicas append to ``OUT.work.NAME.jsonl``; the driver's writer takes their records
    (a replica killed mid-line loses only that line), removes the files, and the final file is
    byte-identical to one process's; ``force`` discards them with the work file."""
    from specbatch.io.writer import WorkShard

    reference = _uninterrupted(tmp_path / "ref.jsonl")
    out = tmp_path / "out.jsonl"
    w = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    w.write(2, _out(2))
    a, b = WorkShard(out, "host-11", N), WorkShard(out, "host-12", N)
    for i in (5, 2, 0):  # 2 is also in the driver's work file: its first record is kept
        a.write(i, _out(i))
    b.write(9, _out(9))
    b.sync()
    b._fh.write(orjson.dumps({"index": 3, "record": _out(3)})[:20])  # killed mid-line
    b._fh.flush()
    del w, a, b  # the whole job killed
    assert sorted(p.name for p in tmp_path.glob("out.jsonl.work.*.jsonl")) == [
        "out.jsonl.work.host-11.jsonl", "out.jsonl.work.host-12.jsonl"]
    w = OutputWriter(out, CONFIG, resume=True, force=False, num_records=N)
    assert w.done_indices() == {0, 2, 5, 9}
    assert list(tmp_path.glob("out.jsonl.work.*.jsonl")) == []
    for i in range(N):
        if i not in w.done_indices():
            w.write(i, _out(i))
    w.finish()
    assert out.read_bytes() == reference
    with pytest.raises(ValueError, match="index=10"):
        WorkShard(out, "host-13", N).write(N, _out(0))
    (tmp_path / "out.jsonl.work.host-13.jsonl").unlink()
    WorkShard(tmp_path / "new.jsonl", "host-14", N).write(1, _out(1))
    w = OutputWriter(tmp_path / "new.jsonl", CONFIG, resume=False, force=True, num_records=N)
    assert w.done_indices() == set() and not list(tmp_path.glob("new.jsonl.work.*.jsonl"))


def test_a_second_run_on_the_same_output_is_refused_while_the_first_writes(tmp_path):
    """Two runs with one ``-o`` would append to one work file (and the second one's finish
    removed it under the first): the second is refused at open, naming the first's process;
    once the first is done (or killed), OUT opens again."""
    out = tmp_path / "out.jsonl"
    first = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    first.write(3, _out(3))
    script = textwrap.dedent(f"""
        from specbatch.io.writer import OutputWriter
        try:
            OutputWriter({str(out)!r}, {CONFIG!r}, resume=False, force=False, num_records={N})
        except ValueError as e:
            print(e)
    """)
    said = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, check=True).stdout
    assert f"is being written by another specbatch run (process {os.getpid()}," in said
    assert (out.parent / "out.jsonl.work.jsonl").read_bytes().count(b"\n") == 1
    del first  # killed: the lock goes with the process's files
    second = OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    assert second.done_indices() == {3}
    for i in range(N):
        if i not in second.done_indices():
            second.write(i, _out(i))
    second.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl", "out.jsonl.config.json"]
    with pytest.raises(ValueError, match="exists from a finished run"):
        OutputWriter(out, CONFIG, resume=False, force=False, num_records=N)
    assert not (tmp_path / "out.jsonl.lock").exists()


def test_resume_at_another_batch_size_says_which_to_give(tmp_path):
    """The saved ``max_batch_size`` differing alone: the refusal names the flag and the value
    that continue the job (a user resuming on a smaller machine)."""
    out = tmp_path / "out.jsonl"
    saved = {**CONFIG, "max_batch_size": 16}
    w = OutputWriter(out, saved, resume=False, force=False, num_records=N)
    w.write(3, _out(3))
    w.close()
    with pytest.raises(ValueError) as refused:
        check_resume(out, {**saved, "max_batch_size": 8})
    assert str(refused.value).endswith(
        "differs in: max_batch_size; the run asked for 16 rows (outputs do not depend on it, "
        "suffix's and auto's spec stats do): resume with --max-batch-size 16, or --force to "
        "start over"), str(refused.value)
    with pytest.raises(ValueError, match="k, max_batch_size; rerun with the same options"):
        check_resume(out, {**saved, "max_batch_size": 8, "k": 2})
    check_resume(out, saved)
