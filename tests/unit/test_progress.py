"""What a run says before its first record (issue 16): loading the model, the model ready,
calibrating and why; on stderr from the CLI, on the ``specbatch`` logger from the library."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli import main
from specbatch.config import EngineConfig
from specbatch.auto import costmodel
from tests.unit.test_calibration import TRUE
from tests.unit.test_loader import write_tiny_gguf



def loading_line(model: Path) -> str:
    """What the start-up line says of ``model`` under --dtype auto on this machine (the dtype
    and why: int8 for the tiny Q8_0 GGUF where the C kernels run; test_dtype_auto.py)."""
    engine = EngineConfig().for_model(str(model))
    return f"loading model {model} ({engine.dtype}, cpu; auto: {engine.dtype_auto}) ..."


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny GGUF model and a cache folder (converted once for the module's tests)."""
    folder = tmp_path_factory.mktemp("progress")
    model = folder / "m.gguf"
    write_tiny_gguf(model)
    return model, folder / "cache"


@pytest.fixture
def fast_calibration(monkeypatch):
    """``calibrate`` with a made-up step time instead of timing the model (seconds to
    minutes): what is said around it is under test, not the timings."""
    real = costmodel.calibrate

    def calibrate(forward, **kwargs):
        return real(forward, **{**kwargs, "progress": False, "time_fn": TRUE.step_time})

    monkeypatch.setattr(costmodel, "calibrate", calibrate)
    # and no load average: the line would name a busy machine's load
    monkeypatch.setattr(costmodel, "load_average", lambda: None)


def _in(tmp_path: Path) -> Path:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc abc"}\n{"id": 2, "prompt": "hello"}\n')
    return src


def test_run_says_what_it_loads_before_the_bar(tiny, tmp_path):
    """Before the progress bar: ``loading model NAME (dtype, device) ...`` and ``model ready in
    S s``, on stderr (stdout keeps only the result); afterwards the ``specbatch`` logger is as
    it was (a library user's logging setup, and caplog, still see its records)."""
    model, cache = tiny
    log = logging.getLogger("specbatch")
    before = (log.level, log.propagate, list(log.handlers))
    result = CliRunner().invoke(main, ["run", str(_in(tmp_path)), "-o",
                                       str(tmp_path / "out.jsonl"), "--model", str(model),
                                       "--cache-dir", str(cache), "--method", "ngram",
                                       "--max-tokens", "2"])
    assert result.exit_code == 0, result.output
    err = result.stderr
    loading = err.index(loading_line(model) + "\n")
    ready = err.index("model ready in ")
    assert loading < ready < err.index("2/2"), err  # then the bar
    assert "loading" not in result.stdout and "ready" not in result.stdout
    assert (log.level, log.propagate, list(log.handlers)) == before


def test_the_library_logs_its_progress(tiny, caplog):
    """``LLM(...)`` says what it loads on the ``specbatch`` logger at INFO, as vLLM and
    transformers do: a library user sees it by enabling logging."""
    from specbatch import LLM

    model, cache = tiny
    with caplog.at_level(logging.INFO, logger="specbatch"):
        LLM(model=str(model), method="ngram", cache_dir=str(cache))
    messages = [r.getMessage() for r in caplog.records if r.name == "specbatch"
                and not r.getMessage().startswith("cpu: ")]  # the first LLM of a process
    assert messages[0] == loading_line(model), messages
    assert messages[-1].startswith("model ready in ") and messages[-1].endswith(" s"), messages


def test_the_first_progress_line_comes_before_torch_is_imported(tmp_path):
    """Importing torch takes seconds (tens on a loaded machine): ``loading model`` is said
    before it, not after. The script stops at that line (the file is no model)."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"")
    script = ("import logging, os, sys\n"
              "class Stop(logging.Handler):\n"
              "    def emit(self, record):\n"
              "        print(record.getMessage(), '|', 'torch' in sys.modules, flush=True)\n"
              "        if not record.getMessage().startswith('cpu: '):\n"
              "            os._exit(0)\n"
              "log = logging.getLogger('specbatch')\n"
              "log.addHandler(Stop())\nlog.setLevel(logging.INFO)\n"
              "from specbatch import LLM\n"
              "LLM(model=sys.argv[1], method='none')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(model)], capture_output=True,
                          text=True, timeout=120)
    cpu, loading = proc.stdout.splitlines()  # the thread choice, then the model, before torch
    assert cpu.startswith("cpu: ") and cpu.endswith(" | False"), (proc.stdout, proc.stderr)
    assert loading == loading_line(model) + " | False", (proc.stdout, proc.stderr)


def test_plan_only_says_it_calibrates_and_why(tiny, tmp_path, fast_calibration):
    """``--plan-only`` needs the step cost (each bucket's k and predicted speedup come from
    it): it says it is calibrating, where the fit is cached, and that the plan waits for it,
    on stderr; the plan table goes to stdout. A second run reads the cache and says nothing
    about calibrating."""
    model, _ = tiny
    cache = tmp_path / "cache"  # its own: no calibration cached yet
    args = ["run", str(_in(tmp_path)), "--model", str(model), "--cache-dir", str(cache),
            "--method", "auto", "--max-tokens", "2", "--plan-only"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    err = result.stderr
    line = next((x for x in err.splitlines() if x.startswith("calibrating")), "")
    assert line.startswith("calibrating this machine's step cost for "), err
    assert f"cached in {cache / 'calibration'}" in line, line
    assert ": the plan's k and predicted speedup per bucket depend on it" in line, line
    assert line.endswith(" ..."), line
    # the plan is the result: on stdout (``> plan.txt`` keeps it), the notes on stderr
    assert result.stdout.startswith("plan: k_max"), result.stdout
    assert "plan: k_max" not in err and "pred speedup" not in err, err
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0 and "calibrating" not in again.output, again.output
    assert again.stdout.startswith("plan: k_max") and "plan: k_max" not in again.stderr


def test_calibration_file_pins_the_fit(tiny, tmp_path, fast_calibration):
    """``--calibration FILE``: auto plans with that fit and measures nothing (an empty cache
    says no ``calibrating`` line); a file that is no calibration is one error line, exit 2;
    with another method it is a usage error."""
    model, _ = tiny
    first = tmp_path / "first"
    args = ["run", str(_in(tmp_path)), "--model", str(model), "--method", "auto",
            "--max-tokens", "2", "--plan-only"]
    assert CliRunner().invoke(main, [*args, "--cache-dir", str(first)]).exit_code == 0
    (fit,) = (first / "calibration").glob("*.json")
    pinned = CliRunner().invoke(main, [*args, "--cache-dir", str(tmp_path / "empty"),
                                       "--calibration", str(fit)])
    assert pinned.exit_code == 0, pinned.output
    assert "calibrating" not in pinned.stderr and pinned.stdout.startswith("plan: k_max")
    assert not (tmp_path / "empty" / "calibration").exists()
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    r = CliRunner().invoke(main, [*args, "--cache-dir", str(first), "--calibration", str(bad)])
    assert r.exit_code == 2 and "error: --calibration " in r.stderr, r.output
    assert "not a specbatch calibration file (no 'coef' field; write one with `specbatch " \
        "calibrate -o FILE`)" in r.stderr and "Traceback" not in r.output, r.stderr
    r = CliRunner().invoke(main, [*args[:5], "ngram", "--calibration", str(fit)])
    assert r.exit_code == 2 and "--calibration needs --method auto" in r.output, r.output


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_counts_tokens_in_flight_and_time_left_comes_from_tokens():
    """8 records of up to 100 tokens; 20 s in, none finished but 60 tokens generated: the rate
    is 3.0 tok/s (issue 36: finished records only read 0 tok/s), and the time left is the
    800 - 60 tokens still to come at that rate; once records finish, their mean length
    replaces max_tokens."""
    import io

    from specbatch.progress import Progress
    from specbatch.spec_decode.stats import SpecStats

    clock, log = _Clock(), io.StringIO()
    p = Progress(8, max_tokens=100, stream=log, tty=False, interval=10, clock=clock)
    clock.now = 20.0
    p.tick(60)
    assert p.tokens_per_second == pytest.approx(3.0)
    assert p.seconds_left() == pytest.approx((800 - 60) / 3.0)
    stats = SpecStats()
    stats.record_step(4, 3)
    for _ in range(4):  # 4 records of 20 tokens finished; 20 more tokens in flight
        p.answer_done(20, stats)
        p.record_done(20)
    clock.now = 40.0
    p.tick(100)
    assert p.tokens_per_second == pytest.approx(2.5)
    assert p.seconds_left() == pytest.approx((4 * 20 - 20) / 2.5)
    # a two-turn record's first turn (15 tokens) finished: its tokens are still in flight (the
    # record is not done), and the records done still average 20 tokens
    p.answer_done(15, stats)
    clock.now = 50.0
    p.tick(115)
    assert p.in_flight == 35 and p.line().startswith("progress: 4/8 records, 115 tokens (35 in")
    assert p.seconds_left() == pytest.approx((4 * 20 - 35) / 2.3)
    p.answer_done(10, stats)
    p.record_done(25)
    assert p.in_flight == 115 - 105 and p.seconds_left() == pytest.approx((3 * 21 - 10) / 2.3)


def test_a_log_gets_plain_periodic_lines():
    """stderr not a terminal: one line every ``interval`` seconds (none between), no ``\\r``,
    with records, tokens, the token rate and the time left; one final line at close."""
    import io

    from specbatch.progress import Progress
    from specbatch.spec_decode.stats import SpecStats

    clock, log = _Clock(), io.StringIO()
    p = Progress(3, max_tokens=10, stream=log, tty=False, interval=10, clock=clock)
    for t, tokens in ((4.0, 4), (9.0, 9), (10.0, 10), (15.0, 15), (20.5, 20)):
        clock.now = t
        p.tick(tokens)
    p.answer_done(10, SpecStats())
    p.record_done()
    clock.now = 31.0
    p.tick(25)
    p.close()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert lines == [
        "progress: 0/3 records, 10 tokens (10 in flight), 1.0 tok/s, 0:10 elapsed, ~0:20 left",
        "progress: 0/3 records, 20 tokens (20 in flight), 1.0 tok/s, 0:20 elapsed, ~0:10 left",
        "progress: 1/3 records, 25 tokens (15 in flight), 0.8 tok/s, 0:31 elapsed, ~0:06 left",
        "progress: 1/3 records, 25 tokens, 0.8 tok/s, 0:31 elapsed",
    ], lines


@pytest.mark.parametrize("skipped", [False, True])
def test_a_run_whose_stderr_is_a_file_logs_readable_progress(tiny, tmp_path, skipped):
    """``specbatch run ... 2> log``: periodic ``progress:`` lines with a token rate and time
    left, no ``\\r`` anywhere (a tqdm bar in a file was one long line joined by ``\\r``). A
    record ``--on-error skip`` leaves out after the load (token ids outside the vocabulary)
    is not counted: the last line's count is what ``wrote N records`` says (it read 7/7 before
    ``wrote 6``, fresh-user finding)."""
    model, cache = tiny
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "count {i} {i} {i}"}}\n' for i in range(6))
                   + ('{"id": 6, "prompt_token_ids": [1000000000]}\n' if skipped else ""))
    log = tmp_path / "stderr.log"
    with open(log, "w") as err:
        proc = subprocess.run([sys.executable, "-m", "specbatch.cli", "run", str(src), "-o",
                               str(tmp_path / "out.jsonl"), "--model", str(model),
                               "--cache-dir", str(cache), "--method", "ngram",
                               "--max-tokens", "48", "--ignore-eos", "--max-batch-size", "2",
                               "--progress-interval", "0.01", "--on-error", "skip"],
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "\r" not in text, repr(text[-500:])
    lines = [x for x in text.splitlines() if x.startswith("progress: ")]
    assert len(lines) >= 3, text
    assert re.fullmatch(r"progress: \d/6 records, \d+ tokens( \(\d+ in flight\))?, "
                        r"[0-9.]+ tok/s(, accept len [0-9.]+)?, \d+:\d\d elapsed, "
                        r"(~\d+:\d\d left|time left \?)", lines[0]), lines[0]
    assert any("in flight" in x and "left" in x for x in lines[:-1]), lines
    assert lines[-1].startswith("progress: 6/6 records, 288 tokens, "), lines[-1]
    assert proc.stdout.startswith("wrote 6 records to "), proc.stdout


def test_a_line_logged_during_a_run_goes_above_the_bar(monkeypatch):
    """A library line while the bar is drawn (the thread governor's ``cpu: 1 thread now ...``)
    clears the bar, is written on a line of its own and the bar is drawn again below it."""
    import io

    from specbatch.cli import _StderrHandler
    from specbatch.progress import Progress

    term = io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    bar = Progress(4, tty=True)
    bar.record_done(10)
    before = term.getvalue()
    assert "1/4" in before
    record = logging.LogRecord("specbatch", logging.INFO, __file__, 0, "cpu: 1 thread now",
                               None, None)
    _StderrHandler().emit(record)
    after = term.getvalue()[len(before):]
    head, line, tail = after.partition("cpu: 1 thread now\n")
    assert line and head.endswith("\r") and head.strip() == "", repr(after)  # the bar cleared
    assert "1/4" in tail, repr(after)  # and drawn again
    bar.close()
