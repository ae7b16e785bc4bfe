"""Calibration under load (issues 16, 36): outliers re-timed or left out, no negative
coefficient, a bounded time, a noisy fit cached with a note and timed again on a quiet
machine (issue 35), a bad cached fit not reused, a sound cached fit kept whatever the load."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from specbatch.auto import costmodel
from specbatch.auto.costmodel import (CostModel, calibrate, fit, load,
                                      load_or_calibrate)

TRUE = CostModel((0.035, 0.0012, 2e-7, 1e-8))  # SmolLM2-135M-like, seconds
# calibrate only reads .device and .backend.packed_attention with time_fn
FORWARD = SimpleNamespace(device=torch.device("cpu"),
                          backend=SimpleNamespace(packed_attention=False))


def _timer(inflate: dict | None = None):
    """time_fn: the true step time; ``inflate[(rows, q, ctx)]``: factors for its successive
    timings (then 1.0), as if another process took the CPU during them."""
    calls: dict = {}

    def time_fn(r, q, c, t=None):  # t: a packed shape's real tokens
        n = calls[(r, q, c)] = calls.get((r, q, c), 0) + 1
        factors = (inflate or {}).get((r, q, c), ())
        return TRUE.step_time(r, q, c, t) * (factors[n - 1] if n <= len(factors) else 1.0)
    time_fn.calls = calls
    return time_fn


SHAPES = [(r, q, c) for c in (256, 700, 1024) for r in (1, 2, 4, 7, 16, 24) for q in (1, 2, 3, 6, 9)]


def _recovers(cost: CostModel, true: CostModel = TRUE) -> None:
    """The fit predicts the true step time at every shape, on the grid and off it."""
    for shape in SHAPES:
        assert cost.step_time(*shape) == pytest.approx(true.step_time(*shape), rel=1e-6), shape


def test_fit_has_no_negative_coefficient():
    """Timings from a loaded machine: the 1-row shapes at the long context slowed 1.6x. Plain
    least squares answers with a negative coefficient (it did for the cached 1.5B fit); the
    fit does not."""
    samples = [(r, q, c, TRUE.step_time(r, q, c) * (1.6 if r == 1 and c == 1024 else 1.0))
               for c in (256, 1024) for r in (1, 4, 16) for q in (1, 2, 4, 6, 9)]
    feats = torch.tensor([[1.0, r * q, r * c, r * q * c] for r, q, c, _ in samples],
                         dtype=torch.float64)
    t = torch.tensor([s[3] for s in samples], dtype=torch.float64)
    plain = torch.linalg.lstsq(feats / t[:, None], torch.ones(len(t), 1,
                                                              dtype=torch.float64)).solution
    assert (plain < 0).any()  # what the old fit cached
    coef = fit(samples)
    assert all(c >= 0 for c in coef), coef
    assert CostModel(coef).problem() is None or "negative" not in CostModel(coef).problem()
    # and an exact linear model is still recovered exactly
    exact = [(r, q, c, TRUE.step_time(r, q, c)) for r, q, c, _ in samples]
    assert fit(exact) == pytest.approx(TRUE.coef, rel=1e-6)


def test_an_inflated_timing_is_timed_again():
    """A shape timed 4.4x slow in every sweep (a 0.5B sample sat 4.4x above its fit) is timed
    again and, quiet then, kept with its true time: the fit is exact and cacheable."""
    timer = _timer({(4, 6, 1024): (4.4, 4.4, 4.4)})
    cost = calibrate(FORWARD, time_fn=timer)
    assert timer.calls[(4, 6, 1024)] == 4  # three sweeps, then once more
    assert cost.rejected == ()
    assert dict(((r, q, c), t) for r, q, c, t in cost.samples)[(4, 6, 1024)] == pytest.approx(
        TRUE.step_time(4, 6, 1024))
    _recovers(cost)
    assert cost.problem() is None


def test_a_timing_that_stays_slow_is_left_out():
    timer = _timer({(16, 9, 256): (4.4,) * 10})
    cost = calibrate(FORWARD, time_fn=timer)
    assert [s[:3] for s in cost.rejected] == [(16, 9, 256)]
    assert (16, 9, 256) not in [s[:3] for s in cost.samples]
    _recovers(cost)  # the fit ignores it
    assert cost.problem() is None  # one outlier of 30 is not a noisy machine


def test_a_noisy_fit_is_cached_with_one_consistent_message(tmp_path, monkeypatch):
    """Half the shapes slowed 1.5-3x in every timing: the fit is used and cached (the next run
    reuses it, and prices its steps with it), and what is said never contradicts itself: the
    line before says where it is cached, the line after how long it took and that it is
    noisy (issue 36: "once (cached in ...)" was followed by "not cached (too noisy)")."""
    shapes = [(r, q, c) for c in (256, 1024) for r in (1, 4, 16) for q in (1, 2, 4, 6, 9)]
    slow = {s: (1.5 + (i % 4) * 0.5,) * 10 for i, s in enumerate(shapes) if i % 2}
    monkeypatch.setattr(costmodel, "load_average", lambda: 0.0)
    lines = []
    cost, path, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path,
                                             echo=lines.append, progress=False,
                                             time_fn=_timer(slow), purpose="the plan needs it")
    assert measured and cost.problem() is None and cost.noise() is not None
    assert all(c >= 0 for c in cost.coef)
    assert path.exists()
    assert lines[0] == (f"calibrating this machine's step cost for m (bfloat16): the plan needs "
                        f"it; at most ~{costmodel.BUDGET_SECONDS:.0f} s after one sweep of its "
                        f"shapes, cached in {path} for "
                        "later runs ..."), lines
    assert len(lines) == 2 and lines[1].startswith("calibrated in "), lines
    assert "; note: 14 of 28 timings slowed by other processes" in lines[1], lines
    assert "recalibrate" in lines[1], lines
    assert not any("not cached" in line or "warning" in line for line in lines), lines
    # the machine still busy (load average above its CPUs): the noisy fit is reused as it is
    monkeypatch.setattr(costmodel, "load_average", lambda: 9.0)
    timer, lines = _timer(), []
    again, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                           time_fn=timer, echo=lines.append)
    assert not measured and not timer.calls and again.coef == pytest.approx(cost.coef)
    cpus = costmodel.os.cpu_count()
    assert lines == [f"note: the cached calibration {path} is noisy (14 of 28 timings slowed by "
                     "other processes); used as it is, and timed again by a run on a quieter "
                     f"machine (load average 9.0 on {cpus} CPUs now)"], lines


def test_a_noisy_cached_fit_is_timed_again_on_a_quiet_machine(tmp_path, monkeypatch):
    """A fit timed while other work slowed half the grid (cached, noisy) is timed again by the
    next run on a quiet machine, each shape's fastest timing kept: that run's fit is exact,
    cached, and the run after reuses it without timing."""
    shapes = [(r, q, c) for c in (256, 1024) for r in (1, 4, 16) for q in (1, 2, 4, 6, 9)]
    slow = {s: (1.5 + (i % 4) * 0.5,) * 10 for i, s in enumerate(shapes) if i % 2}
    monkeypatch.setattr(costmodel, "load_average", lambda: 0.5)
    noisy, path, _ = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                       time_fn=_timer(slow))
    assert noisy.noise() is not None and noisy.calibrations == 1
    lines, timer = [], _timer()
    healed, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                            time_fn=timer, echo=lines.append)
    assert measured and timer.calls
    assert lines[0] == (f"the cached calibration {path} is noisy (14 of 28 timings slowed by "
                        "other processes); the machine is quieter now: timing it again, each "
                        "shape's fastest timing kept"), lines
    assert healed.noise() is None and healed.rejected == () and healed.calibrations == 2
    _recovers(healed)
    assert load(path) == healed
    timer = _timer()
    assert load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                             time_fn=timer)[2] is False and not timer.calls


def test_two_noisy_calibrations_merge_into_an_exact_fit():
    """Each calibration had a different half of the grid slowed in every timing (neither fit is
    usable alone); the second, given the first as ``prior``, keeps each shape's fastest timing
    and recovers the true step time."""
    shapes = [(r, q, c) for c in (256, 1024) for r in (1, 4, 16) for q in (1, 2, 4, 6, 9)]
    first = calibrate(FORWARD, time_fn=_timer({s: (2.5,) * 10 for i, s in enumerate(shapes)
                                               if i % 2}))
    second_timer = _timer({s: (2.5,) * 10 for i, s in enumerate(shapes) if not i % 2})
    alone = calibrate(FORWARD, time_fn=second_timer)
    assert first.noise() is not None and alone.noise() is not None
    merged = calibrate(FORWARD, time_fn=_timer({s: (2.5,) * 10 for i, s in enumerate(shapes)
                                                if not i % 2}), prior=first)
    assert merged.noise() is None and merged.calibrations == 2
    _recovers(merged)


def test_a_machine_that_stays_noisy_is_not_timed_at_every_run(tmp_path, monkeypatch):
    """Noisy again and again on a quiet load average (e.g. a VM's neighbours): after
    ``HEAL_CALIBRATIONS`` merged calibrations the fit is reused as it is, and the last note
    does not promise another try."""
    slow = {(r, q, c): (3.0,) * 10 for c in (256, 1024) for r in (1, 4, 16)
            for q in (1, 2, 4, 6, 9) if (q + r) % 2}
    monkeypatch.setattr(costmodel, "load_average", lambda: 0.5)
    timed, said = [], []
    for _ in range(costmodel.HEAL_CALIBRATIONS + 2):
        said.append([])
        cost, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path,
                                              progress=False, time_fn=_timer(slow),
                                              echo=said[-1].append)
        timed.append(measured)
        assert cost.noise() is not None
    assert timed == [True] * costmodel.HEAL_CALIBRATIONS + [False, False]
    assert cost.calibrations == costmodel.HEAL_CALIBRATIONS
    assert "a later run on a quieter machine times it again" in said[0][-1]
    last = said[costmodel.HEAL_CALIBRATIONS - 1][-1]
    assert f"in {costmodel.HEAL_CALIBRATIONS} calibrations: it is used as measured" in last
    assert "again" not in last
    path = costmodel.cache_path(tmp_path, "m", "bfloat16", "cpu")
    assert said[-1] == [f"note: the cached calibration {path} is noisy ({cost.noise()}) in 3 "
                        "calibrations; used as it is (`specbatch calibrate --recalibrate` on "
                        "a quiet machine measures afresh)"], said[-1]


@pytest.mark.parametrize("edit, says", [
    ({"samples": [["x", None]]}, "samples[0] is not a list of numbers"),
    ({"samples": [[16, 2, 256]]}, "samples[0] is not [rows, q, ctx, seconds]"),
    ({"rejected": [[16, 2, 256, -1.0]]}, "rejected[0] is not [rows, q, ctx, seconds]"),
    ({"calibrations": -5}, "calibrations is -5, not a whole number >= 1"),
    ({"calibrations": "two"}, "calibrations is 'two', not a whole number >= 1"),
    ({"coef": "abc"}, "coef is not a list of numbers"),
])
def test_a_malformed_cached_calibration_is_one_line_and_measured_again(tmp_path, monkeypatch,
                                                                       edit, says):
    """A hand-edited or damaged cache file (a noisy one too, which would be merged into the
    next calibration) is named in one line saying what is wrong, and measured afresh: never a
    traceback, and never a merge count that lifts the limit of timing it again."""
    monkeypatch.setattr(costmodel, "load_average", lambda: 0.5)
    slow = {(r, q, c): (3.0,) * 10 for c in (256, 1024) for r in (1, 4, 16)
            for q in (1, 2, 4, 6, 9) if (q + r) % 2}
    _, path, _ = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                   time_fn=_timer(slow))
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    with pytest.raises(ValueError, match=r"not a specbatch calibration file \(" + says.replace(
            "[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        load(path)
    lines = []
    cost, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                          time_fn=_timer(), echo=lines.append)
    assert measured and cost.calibrations == 1 and cost.noise() is None
    assert lines[0].startswith(f"warning: {path}: not a specbatch calibration file ("), lines


def test_a_non_finite_coefficient_is_not_called_negative(tmp_path):
    path = tmp_path / "fit.json"
    CostModel((0.035, float("nan"), 2e-7, 1e-8)).save(path)
    assert load(path).problem().startswith("a coefficient that is not a finite number")
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="a JSON list, not an object"):
        load(path)


def test_calibration_stops_sweeping_when_its_time_is_up(monkeypatch):
    """Each timing takes 1 s of the clock: after the first sweep (28 shapes, 28 s > the 20 s
    budget) no second sweep and no retake; the fit comes from what was measured."""
    clock = [0.0]

    def time_fn(r, q, c):
        clock[0] += 1.0
        return TRUE.step_time(r, q, c)

    monkeypatch.setattr(costmodel.time, "perf_counter", lambda: clock[0])
    cost = calibrate(FORWARD, time_fn=time_fn)
    assert clock[0] == len(GRID)  # one timing per shape
    _recovers(cost)
    clock[0] = 0.0
    calibrate(FORWARD, time_fn=time_fn, budget_seconds=None)
    assert clock[0] == 3 * len(GRID)  # no limit: three sweeps


def test_a_cached_bad_fit_is_not_reused(tmp_path):
    """A calibration cached by an older specbatch (plain least squares, no checks) with a
    negative coefficient is measured again, with a warning naming the file."""
    path = costmodel.cache_path(tmp_path, "m", "bfloat16", "cpu")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"coef": [0.05, -0.001, 3e-7, 1e-8], "model_id": "m",
                                "samples": [[1, 1, 256, 0.05]]}))
    assert "negative" in load(path).problem()
    lines = []
    cost, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path,
                                          echo=lines.append, progress=False, time_fn=_timer())
    assert measured
    _recovers(cost)
    assert any("is not used (a negative coefficient" in line for line in lines), lines
    assert load(path).problem() is None  # replaced by the sound fit
    # an old-format file with sane coefficients is still re-measured (no outlier check then)
    path.write_text(json.dumps({"coef": list(TRUE.coef), "samples": [[1, 1, 256, 0.05]]}))
    assert "older specbatch" in load(path).problem()


def _tiles(r: int, q: int, c: int) -> float:
    """A step whose matmuls fill their tiles as tokens grow (SmolLM2-135M int8 on AVX-512
    VNNI, session 10: 16 rows, q 1 -> 2 cost 1.4 ms a token, q 6 -> 9 0.9 ms): 1.4 ms a token up
    to 32 tokens, 0.9 ms from there, plus attention."""
    t = r * q
    return 0.004 + 1.4e-3 * min(t, 32) + 0.9e-3 * max(t - 32, 0) + 2e-7 * r * c + 1e-8 * t * c


def test_the_dense_cost_is_piecewise_in_the_tokens():
    """Where a token costs more at 16 -> 32 tokens than at 64 -> 144, one slope prices the first
    draft token of a batch-16 step too low (and so drafted where it did not pay, session 10);
    the slope per segment between ``TOKEN_KNOTS`` gets both ends right."""
    cost = calibrate(FORWARD, time_fn=_tiles)
    assert cost.knots == (4, 8, 16, 32, 64)  # all below the grid's 144 tokens
    assert cost.token_cost(16) == pytest.approx(1.4e-3, rel=1e-3)  # 16 rows, first draft token
    assert cost.token_cost(96) == pytest.approx(0.9e-3, rel=1e-3)
    for r, q, c in SHAPES:
        assert cost.step_time(r, q, c) == pytest.approx(_tiles(r, q, c), rel=1e-6)
    assert cost.problem() is None
    # the one-slope model of the same timings: off by over 10% at 16 rows x 2 tokens
    linear = CostModel(fit([(*s[:3], s[3]) for s in cost.samples]))
    assert linear.token_cost(16) < 1.25e-3
    first = (_tiles(16, 2, 256) - _tiles(16, 1, 256)) / 16
    assert (linear.step_time(16, 2, 256) - linear.step_time(16, 1, 256)) / 16 < 0.9 * first
    # the knots travel through the cache file
    assert load_roundtrip(cost) == cost


def load_roundtrip(cost: CostModel) -> CostModel:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        cost.save(Path(d) / "c.json")
        return load(Path(d) / "c.json")


def test_a_fit_measured_under_load_is_kept_when_quiet(tmp_path, monkeypatch):
    """Cached while the machine was busy (load above its CPUs): reused once it is quiet too;
    load alone is no reason to measure again (issue 36: a fit cached by one run was thrown
    away 30 s later when the load went from 2.0 to 1.8)."""
    import os

    cpus = os.cpu_count() or 1
    monkeypatch.setattr(costmodel, "load_average", lambda: 3.0 * cpus)
    busy, path, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path,
                                             progress=False, time_fn=_timer())
    assert measured and path.exists() and busy.load_average == 3.0 * cpus
    monkeypatch.setattr(costmodel, "load_average", lambda: 0.1)
    timer, lines = _timer(), []
    _, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, echo=lines.append,
                                       progress=False, time_fn=timer)
    assert not measured and not timer.calls and lines == []


def test_the_one_row_shape_is_timed_as_it_runs(tmp_path):
    """Where a 1-row step feeds 2 tokens (no one-row matmuls: ``min_query_len`` 2),
    calibration times (1, 2, ctx) once, not a (1, 1, ctx) that costs the same and looks like an
    outlier of the fit. On the C step (``min_query_len`` 1) plain batch-1 decoding feeds one
    token, and (1, 1, ctx) is timed as such: timed as 2 tokens, the fit priced plain decoding
    at a 2-token step and a batch-1 draft token looked free."""
    timer = _timer()
    cost = calibrate(FORWARD, time_fn=timer)
    assert (1, 1, 256) not in timer.calls and (1, 2, 256) in timer.calls
    assert [s[:3] for s in cost.samples].count((1, 2, 256)) == 1
    one_token = SimpleNamespace(device=FORWARD.device, backend=SimpleNamespace(
        packed_attention=False, min_query_len=1))
    timer = _timer()
    cost = calibrate(one_token, time_fn=timer)
    assert (1, 1, 256) in timer.calls and (1, 2, 256) in timer.calls
    assert [s[:3] for s in cost.samples if s[0] == 1 and s[2] == 256] == [
        (1, q, 256) for q in costmodel.QUERY_LENS]
    # the fit says so (analyze's what-if prices plain batch-1 decoding by it), and keeps it
    assert cost.min_query_len == 1
    assert calibrate(FORWARD, time_fn=_timer()).min_query_len == 2
    cost.save(tmp_path / "c.json")
    assert load(tmp_path / "c.json").min_query_len == 1


def test_each_group_of_shapes_is_timed_after_warm_up_steps(monkeypatch):
    """The first shape of each (rows, ctx) group, in every sweep, is timed after
    ``SHAPE_WARMUP_STEPS`` untimed steps on its cache (after another group's steps the next 2-3
    ran slow while the weights came back into the CPU's cache: timed after one warm-up, the
    first shape of every group read 6-17% slow in all sweeps); the other shapes of the group
    reuse the warm cache without a warm-up."""
    calls = []

    def fake_measure(forward, rows, q, ctx, repeats=3, cache=None, warmup=1, num_tokens=None):
        calls.append(((rows, q, ctx), warmup, cache))
        return TRUE.step_time(rows, q, ctx, num_tokens)

    monkeypatch.setattr(costmodel, "measure", fake_measure)
    forward = SimpleNamespace(device=FORWARD.device, new_cache=lambda rows, n: object(),
                              backend=SimpleNamespace(packed_attention=False, min_query_len=1))
    calibrate(forward, budget_seconds=None)
    assert costmodel.SHAPE_WARMUP_STEPS >= 3
    groups = [(s[0], s[2]) for s, _, _ in calls]
    for i, ((shape, warmup, cache), group) in enumerate(zip(calls, groups)):
        first = i == 0 or groups[i - 1] != group
        assert warmup == (costmodel.SHAPE_WARMUP_STEPS if first else 0), (i, shape, warmup)
        assert first or cache is calls[i - 1][2]  # the group's cache, warm
    assert len(calls) == 3 * 30 and sum(1 for _, w, _ in calls if w) == 3 * 6


def test_an_llm_measures_a_fit_once_even_when_it_cannot_cache_it(monkeypatch, tmp_path):
    """On a busy machine a fit fails its checks and is not written to disk; an ``LLM`` that
    generates again (the API, bench's configurations, a peer-benchmark worker) reuses the fit
    it measured instead of recalibrating before every ``generate`` (which made auto 2x slower
    than none in the peer benchmark)."""
    from specbatch.llm import LLM

    calls = []

    def fake(forward, model_id, dtype, root, recalibrate=False, **kw):
        calls.append((model_id, recalibrate))
        return CostModel((0.05, 0.001, 0.0, 0.0)), tmp_path / f"{model_id}.json", True

    monkeypatch.setattr(costmodel, "load_or_calibrate", fake)
    llm = LLM.__new__(LLM)
    llm.engine_config, llm.cache_dir, llm.echo = SimpleNamespace(dtype="float32"), None, None
    forward = SimpleNamespace()
    first = llm.calibrate(forward=forward, model_id="m")
    again = llm.calibrate(forward=forward, model_id="m")
    assert first[2] is True and again[2] is False and again[0] is first[0]
    llm.calibrate(forward=forward, model_id="draft")  # another model: its own fit
    llm.calibrate(forward=forward, model_id="m", recalibrate=True)
    assert calls == [("m", False), ("draft", False), ("m", True)]


def test_a_fit_of_another_engine_build_or_thread_count_is_measured_again(tmp_path,
                                                                          monkeypatch):
    """The cached fit records the engine fingerprint (engine revision, torch, threads, OpenMP
    wait policy): a fit written without one, or with another thread count, is measured again
    with a line saying why; under the same fingerprint it is reused, and so it is under
    another wait policy (the CLI waits passively on a busy machine: a choice of the moment, as
    the load is)."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cost, path, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path,
                                             progress=False, time_fn=_timer())
    assert measured and load(path).engine == costmodel.engine_fingerprint()
    assert "OpenMP wait default" in load(path).engine
    timer = _timer()
    _, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                       time_fn=timer)
    assert not measured and not timer.calls
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    _, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, progress=False,
                                       time_fn=timer)
    assert not measured and not timer.calls
    threads = torch.get_num_threads()
    monkeypatch.setattr(costmodel.torch, "get_num_threads", lambda: threads + 1)
    lines = []
    _, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, echo=lines.append,
                                       progress=False, time_fn=_timer())
    assert measured and f"{threads + 1} threads" in load(path).engine
    assert any("measured with another engine build or setting" in line for line in lines), lines
    old = json.loads(path.read_text())
    del old["engine"]  # a file from before the fingerprint
    path.write_text(json.dumps(old))
    lines = []
    _, _, measured = load_or_calibrate(FORWARD, "m", "bfloat16", tmp_path, echo=lines.append,
                                       progress=False, time_fn=_timer())
    assert measured and any("not recorded" in line for line in lines), lines


GRID = [(r, max(q, 2) if r == 1 else q, c) for c in costmodel.CONTEXTS for r in costmodel.ROWS
        for q in costmodel.QUERY_LENS if not (r == 1 and q == 1)]


def test_a_timing_taken_again_keeps_its_place_in_the_grid():
    """The first shape (1 row, 2 tokens, 256 keys) timed slow in every sweep, then quiet when
    timed again: kept, in its place (it came after the 1024-key shapes, and ``specbatch
    calibrate`` printed it as a stray ``1 2 256`` row below them)."""
    timer = _timer({(1, 2, 256): (4.4, 4.4, 4.4)})
    cost = calibrate(FORWARD, time_fn=timer)
    assert timer.calls[(1, 2, 256)] == 4 and cost.rejected == ()
    assert [s[:3] for s in cost.samples] == GRID


def test_the_calibrate_table_lists_shapes_by_context(monkeypatch, capsys):
    """``specbatch calibrate``'s table: one row per timed shape, by context, rows, q (also for
    a cached file whose samples are out of order), its real tokens (rows x q for a uniform
    shape), an outlier labelled where it belongs."""
    from specbatch import llm as llm_module
    from specbatch.commands.calibrate import run_calibrate

    samples = [(*s, TRUE.step_time(*s)) for s in GRID if s != (4, 6, 1024)]
    samples.append(samples.pop(0))  # (1, 2, 256) last, as a re-timed shape was
    cost = CostModel(TRUE.coef, samples=tuple(samples),
                     rejected=((4, 6, 1024, 5 * TRUE.step_time(4, 6, 1024)),))
    fake = SimpleNamespace(calibrate=lambda recalibrate, echo: (cost, "cal.json", False))
    monkeypatch.setattr(llm_module.LLM, "from_config", staticmethod(lambda *a, **k: fake))
    assert run_calibrate("m", "float32", None, None, False) == 0
    out = capsys.readouterr().out.splitlines()
    header = out.index(next(line for line in out
                            if line.split()[:4] == ["rows", "q", "ctx", "tokens"]))
    table = [line.split() for line in out[header + 1:header + 1 + len(GRID)]]
    assert [tuple(int(v) for v in row[:3]) for row in table] == GRID
    assert [int(row[3]) for row in table] == [r * q for r, q, _ in GRID]
    assert [row[6:] for row in table if row[6:]] == [["outlier,", "left", "out"]]
    assert table[GRID.index((4, 6, 1024))][6:] == ["outlier,", "left", "out"]
    fit_line = out[header + 1 + len(GRID)]
    assert fit_line.startswith("fit (a step's ms: the sum of each term") and "0.0%" in fit_line
    # TRUE's four terms, each on its line with its value (ms; the attention terms per 1,000 keys)
    terms = [line.rsplit(None, 2) for line in out[header + 2 + len(GRID):]]
    assert [(what.strip(), ms, unit) for what, ms, unit in terms] == [
        ("every step", "35.000", "ms"), ("per fed token", "1.200", "ms"),
        ("per row, per 1,000 keys", "0.200", "ms"),
        ("per query slot (rows x q), per 1,000 keys of its row", "0.010", "ms")]


def test_the_fit_terms_add_up_to_the_step_time(monkeypatch, capsys):
    """``CostModel.terms``: each term's ms times its count (the context terms per 1,000 keys)
    sums to ``step_time`` for every shape, a fit with knots, tiles and a drafting-row term too;
    ``specbatch calibrate`` lists the terms the fit put at 0 on one line."""
    knots = costmodel.TOKEN_KNOTS
    cost = CostModel((0.004, 0.002, 7e-7, 9e-7, 0.0028, 0.0, 0.0021, 0.0021, 0.002, 0.0044,
                      0.0, 0.0005), knots=knots, packed=True, tiled=True, tile_tokens=4,
                     drafting=True)
    names = [what for what, _ in cost.terms()]
    assert names[:2] == ["every step", "per fed token, tokens 0-4 of the step"]
    assert names[6] == "per fed token, tokens past 64 of the step"
    assert names[-3:] == ["per 4-token matmul tile started",
                          "per query slot of a packed step (rows x q)",
                          "per drafting row (a row feeding more than one token)"]
    for rows, q, ctx, tokens in ((1, 1, 256, 1), (16, 2, 300, 24), (16, 9, 1024, 144),
                                 (4, 6, 700, 11)):
        x = costmodel._features(rows, q, ctx, tokens, knots, packed=True, tiled=True, tile=4,
                                drafting=True)
        # _features' order: 1, the first slope, the two context terms, the later slopes, ...
        counts = [x[0], x[1], *x[4:4 + len(knots)], x[2] / 1e3, x[3] / 1e3, *x[4 + len(knots):]]
        ms = [m for _, m in cost.terms()]
        assert sum(m * n for m, n in zip(ms, counts)) / 1e3 == pytest.approx(
            cost.step_time(rows, q, ctx, num_tokens=tokens), rel=1e-12)
    from specbatch import llm as llm_module
    from specbatch.commands.calibrate import run_calibrate

    fake = SimpleNamespace(calibrate=lambda recalibrate, echo: (cost, "cal.json", False))
    monkeypatch.setattr(llm_module.LLM, "from_config", staticmethod(lambda *a, **k: fake))
    assert run_calibrate("m", "float32", None, None, False) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("  fitted at 0 (no cost of their own on this machine): per fed token, "
                       "tokens 8-16 of the step; per query slot of a packed step (rows x q)")
    assert sum(line.startswith("  ") and line.endswith(" ms") for line in out) == len(names) - 2


def test_calibrate_says_how_old_the_cached_fit_is(tmp_path, monkeypatch, capsys):
    """A cached fit is named with its age (a VM's speed drifts within hours); a fresh one as
    measured."""
    from specbatch import llm as llm_module
    from specbatch.commands.calibrate import run_calibrate

    path = tmp_path / "cal.json"
    TRUE.save(path)
    for measured, first in ((False, f"cached: {path}, measured 0 min ago (--recalibrate "
                                    "measures again)"), (True, f"measured: {path}")):
        fake = SimpleNamespace(calibrate=lambda recalibrate, echo, m=measured:
                               (TRUE, str(path), m))
        monkeypatch.setattr(llm_module.LLM, "from_config", staticmethod(lambda *a, **k: fake))
        assert run_calibrate("m", "float32", None, None, False) == 0
        assert capsys.readouterr().out.splitlines()[0] == first


def test_each_cpu_kernel_path_keeps_its_own_calibration(tmp_path, monkeypatch):
    """Runs with the C kernels and with ``SPECBATCH_CPU_KERNELS=0`` (torch's kernels, ~1.6x
    slower batch-16 steps) each keep their own cached fit, as do int8 runs on the AVX2 and the
    portable 8-bit matmul: switching back and forth measures each once (a shared file was
    measured again at every switch, and int8's kernels read each other's step costs). A file
    named before the kernel path was part of the key is ignored."""
    from specbatch.kernels import cpu_build, linear_cpu

    if not linear_cpu.available():
        pytest.skip("needs specbatch's C kernels (x86-64 with AVX2 + FMA, a C compiler)")
    monkeypatch.setattr(costmodel, "load_average", lambda: None)  # no re-measuring when quiet
    monkeypatch.setattr(cpu_build, "library", cpu_build.library.__wrapped__)  # reads the env
    monkeypatch.delenv("SPECBATCH_CPU_LINEAR", raising=False)
    old_name = "".join(ch if ch.isalnum() or ch in "-_." else "_"
                       for ch in f"m-float32-cpu-{costmodel.host_id()}")
    legacy = tmp_path / "calibration" / f"{old_name}.json"
    legacy.parent.mkdir(parents=True)
    legacy.write_text("{}")

    def measured(dtype: str) -> tuple[bool, object]:
        _, path, was_measured = load_or_calibrate(FORWARD, "m", dtype, tmp_path, progress=False,
                                                  time_fn=_timer())
        return was_measured, path

    paths = {}
    for kernels in ("", "0", "", "0"):
        monkeypatch.setenv("SPECBATCH_CPU_KERNELS", kernels)
        was_measured, path = measured("float32")
        assert was_measured == (kernels not in paths), kernels  # each measured on first use
        assert paths.setdefault(kernels, path) == path
    assert paths[""] != paths["0"] and legacy.read_text() == "{}"
    assert "-torch-" in paths["0"].name and "-ckernels-" in paths[""].name
    # bfloat16 and float64 never run on the C kernels: their files say torch
    for dtype in ("bfloat16", "float64"):
        assert f"-{dtype}-cpu-torch-" in costmodel.cache_path(tmp_path, "m", dtype, "cpu").name
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "")
    was = linear_cpu.int8_kernel()
    try:
        first = {}
        for name in ("avx2", "portable", "avx2", "portable"):
            linear_cpu.int8_kernel(name)
            was_measured, path = measured("int8")
            assert was_measured == (name not in first), name
            assert first.setdefault(name, path) == path
            assert f"-ckernels_{name}-" in path.name, path.name
    finally:
        linear_cpu.int8_kernel(was)


def test_packed_attention_prices_the_real_tokens_not_the_padded_rows(tmp_path):
    """Where the forward runs attention on a packed step's real tokens (the CPU C attention),
    a step with one long row costs by its tokens x keys, not every row padded to the longest;
    a row's extra token then also pays its own attention. The flag survives save/load, and
    calibrate takes it from the forward."""
    coef = (0.004, 0.0003, 1e-6, 5e-7)
    padded, packed = CostModel(coef), CostModel(coef, packed=True)
    # 16 rows, one drafting 15 tokens, fifteen drafting 2: 61 real tokens, q = 16
    t, ctx = 16 + 15 + 15 * 2, 450
    dense_and_rows = 0.004 + 0.0003 * t + 1e-6 * 16 * ctx
    assert packed.step_time(16, 16, ctx, t) == pytest.approx(dense_and_rows + 5e-7 * t * ctx)
    assert padded.step_time(16, 16, ctx, t) == pytest.approx(dense_and_rows + 5e-7 * 16 * 16 * ctx)
    # uniform rows: the two agree (the calibration grid cannot tell them apart)
    assert packed.step_time(16, 3, ctx) == pytest.approx(padded.step_time(16, 3, ctx))
    assert padded.token_cost(t, ctx) == pytest.approx(0.0003)
    assert packed.token_cost(t, ctx) == pytest.approx(0.0003 + 5e-7 * ctx)
    packed.save(tmp_path / "c.json")
    assert load(tmp_path / "c.json").packed
    padded.save(tmp_path / "p.json")
    assert not load(tmp_path / "p.json").packed
    forward = SimpleNamespace(device=torch.device("cpu"),
                              backend=SimpleNamespace(packed_attention=True))
    assert calibrate(forward, time_fn=_timer()).packed
    assert not calibrate(FORWARD, time_fn=_timer()).packed


def test_packed_shapes_price_a_partly_filled_tile_and_padded_logits():
    """The uniform grid's token counts at 16 rows are whole matmul tiles (16, 32, 64 ...):
    a step where a few rows draft (17-28 tokens) starts a tile and lays out padded logits
    that no uniform shape has, and a fit of the grid alone priced it low (SmolLM2-135M int8,
    1 thread: 16 -> 17 tokens cost 2.25 ms, the uniform fit said 1.19; auto's drafting steps
    ran 2-3.6% further above the fit than its plain steps). Where the forward packs, calibration
    times packed shapes too and fits the tile and padded-slot terms: a step of such a cost
    is recovered on and off the grid, the token price includes a tile's share, the fit
    survives the cache file, and the uniform-only fit of the same machine misprices it."""
    true = CostModel((0.004, 0.0003, 1e-6, 5e-7, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008,
                      0.0009, 8e-6, 4e-4), knots=(4, 8, 16, 32, 64), packed=True, tiled=True,
                     drafting=True)
    forward = SimpleNamespace(device=torch.device("cpu"),
                              backend=SimpleNamespace(packed_attention=True))
    shapes = []

    def time_fn(r, q, c, t=None):
        shapes.append((r, q, c, t))
        return true.step_time(r, q, c, t)

    cost = calibrate(forward, time_fn=time_fn)
    assert cost.tiled and cost.drafting and cost.packed and cost.problem() is None
    assert {(r, q, t) for r, q, _, t in shapes if t} == set(costmodel.PACKED_SHAPES)
    assert sum(len(s) == 5 for s in cost.samples) == 2 * len(costmodel.PACKED_SHAPES)
    assert cost.coef == pytest.approx(true.coef, rel=1e-6)
    for r, q, c, t in [(16, 2, 300, 17), (16, 6, 300, 22), (16, 1, 300, 16), (16, 9, 700, 40),
                       (12, 4, 500, 20), (4, 6, 256, 11)]:
        assert cost.step_time(r, q, c, t) == pytest.approx(true.step_time(r, q, c, t), rel=1e-6)
    # one more token at 20 tokens: the segment's slope, a tile's share, its keys
    assert cost.token_cost(20, 300) == pytest.approx(0.0006 + 0.0009 / 8 + 5e-7 * 300)
    assert load_roundtrip(cost) == cost
    # the uniform grid alone: the first drafted token at 16 rows priced at under 3/4 its cost
    uniform = calibrate(forward, time_fn=time_fn, packed_grid=())
    assert not uniform.tiled and len(uniform.coef) == 9
    first = true.step_time(16, 2, 300, 17) - true.step_time(16, 1, 300)
    assert uniform.step_time(16, 2, 300, 17) - uniform.step_time(16, 1, 300) < 0.75 * first
    # a model without the terms (a file of the uniform fit) has 4 + knots coefficients
    with pytest.raises(ValueError, match="tile terms has 11 coefficients"):
        CostModel(true.coef[:9], knots=true.knots, tiled=True)


def test_the_tile_is_the_kernels_row_pass():
    """On AVX2 the C matmuls pass over a weight once per 4 rows (8 on AVX-512): a 16-row step
    of 17 tokens pays a fifth pass. Calibration fits the tile the step backend reports
    (``row_tile``; 8 where it reports none) and keeps it in the file; a fit with 8-token
    tiles of a machine whose passes are 4 rows prices the first drafted token at 16 rows low
    (float32 on a 2-core Zen 2: 5.3 ms measured, 2.2 ms fitted) and a pass begun at 21 tokens
    at under half its cost."""
    true = CostModel((0.004, 0.0003, 1e-6, 5e-7, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008,
                      0.0016, 8e-6, 4e-4), knots=(4, 8, 16, 32, 64), packed=True, tiled=True,
                     tile_tokens=4, drafting=True)

    def forward(**tile):
        return SimpleNamespace(device=torch.device("cpu"),
                               backend=SimpleNamespace(packed_attention=True, **tile))

    cost = calibrate(forward(row_tile=4), time_fn=lambda r, q, c, t=None: true.step_time(
        r, q, c, t))
    assert cost.tile_tokens == 4 and cost.coef == pytest.approx(true.coef, rel=1e-6)
    assert load_roundtrip(cost).tile_tokens == 4
    first = true.step_time(16, 2, 300, 17) - true.step_time(16, 1, 300)
    assert cost.step_time(16, 2, 300, 17) - cost.step_time(16, 1, 300) == \
        pytest.approx(first, rel=1e-6)
    assert cost.token_cost(20, 300) == pytest.approx(0.0006 + 0.0016 / 4 + 5e-7 * 300)
    eights = calibrate(forward(), time_fn=lambda r, q, c, t=None: true.step_time(r, q, c, t))
    assert eights.tile_tokens == 8
    assert eights.step_time(16, 2, 300, 17) - eights.step_time(16, 1, 300) < 0.9 * first
    fifth = true.step_time(16, 6, 300, 21) - true.step_time(16, 6, 300, 20)  # a pass begun
    assert eights.step_time(16, 6, 300, 21) - eights.step_time(16, 6, 300, 20) < 0.5 * fifth


def test_drafting_rows_are_priced():
    """The same draft tokens cost more spread over rows than on one (2-core Zen 2, 16 rows at
    300 keys, 24 tokens, float32: 9 on one row 61.5 ms, 2 on each of 8 rows 65.0 ms;
    ``benchmarks/packed_layout.py``). Calibration's packed shapes lay the drafts on as few
    rows as they fit in (``packed_fed``: 16 x 2 at 24 tokens is 8 drafting rows, 16 x 6 at 21
    one), so the fit gets a term per drafting row; ``step_time`` takes the step's drafting
    rows (the policy counts its rows with a draft), by default that layout's."""
    from specbatch.auto.costmodel import _drafting_rows, packed_fed

    true = CostModel((0.004, 0.0003, 1e-6, 5e-7, 0.0004, 0.0005, 0.0006, 0.0007, 0.0008,
                      0.0009, 8e-6, 5e-4), knots=(4, 8, 16, 32, 64), packed=True, tiled=True,
                     drafting=True)
    forward = SimpleNamespace(device=torch.device("cpu"),
                              backend=SimpleNamespace(packed_attention=True))
    cost = calibrate(forward, time_fn=lambda r, q, c, t=None: true.step_time(r, q, c, t))
    assert cost.drafting and cost.coef[-1] == pytest.approx(5e-4, rel=1e-6)
    assert load_roundtrip(cost).drafting
    spread = cost.step_time(16, 2, 300, 24, drafting_rows=8)
    one_row = cost.step_time(16, 9, 300, 24, drafting_rows=1)
    assert spread - one_row == pytest.approx(7 * 5e-4 + 8e-6 * (32 - 144), rel=1e-6)
    for rows, q, t in [(16, 2, 24), (16, 6, 21), (16, 6, 28), (4, 6, 11), (16, 1, 16),
                       (4, 2, 8)]:
        assert _drafting_rows(rows, q, t) == sum(
            f > 1 for f in (packed_fed(rows, q, t) if t < rows * q else [q] * rows))
    assert cost.step_time(16, 2, 300, 24) == spread  # the default: packed_fed's layout
    # a file of the fit before the term: older, measured again (``problem``), never misread
    old = CostModel(true.coef[:-1], knots=true.knots, packed=True, tiled=True, version=6)
    assert old.problem() == "written by an older specbatch, with another fit"


def test_cpu_backend_row_tile_follows_the_matmul_kernel():
    """``CpuBackend``'s ``row_tile``: 4 on the AVX2 kernels, 8 on the AVX-512 ones, switched
    with them (``linear_cpu.avx512``, ``int8_kernel``); 8 for another matmul."""
    from specbatch.models.backends.cpu import _row_tile

    linear_cpu = pytest.importorskip("specbatch.kernels.linear_cpu")
    if not linear_cpu.available():
        pytest.skip("no C kernels on this machine")
    f32 = SimpleNamespace(linear=linear_cpu.linear, activations=None)
    int8 = SimpleNamespace(linear=linear_cpu.linear, activations="int8")
    was_avx512, was_int8 = linear_cpu.avx512(), linear_cpu.int8_kernel()
    try:
        assert _row_tile(f32) == (8 if was_avx512 else 4)
        assert _row_tile(int8) == (8 if was_int8 == "vnni" else 4)
        linear_cpu.avx512(False)
        linear_cpu.int8_kernel("avx2")
        assert _row_tile(f32) == 4 and _row_tile(int8) == 4
    finally:
        linear_cpu.avx512(was_avx512)
        linear_cpu.int8_kernel(was_int8)
    assert _row_tile(SimpleNamespace(linear=torch.nn.functional.linear, activations=None)) == 8


def test_step_time_is_the_dot_of_the_fitted_regressors_bit_for_bit():
    """``CostModel.step_time`` computes the dot of ``coef`` with ``_features`` (what ``fit``
    regresses on) without building the list; its float operations are the same, in the same
    order, so every prediction, and every choice auto makes from them, keeps its bits. Checked
    on models with and without knots, packed attention and the tile terms, over shapes of 1-16
    rows, 1-16 queries, packed and not, fractional (mean) contexts."""
    import math
    import operator
    import random

    from specbatch.auto.costmodel import _features

    rng = random.Random(7)
    models = [CostModel((4e-3, 3e-4, 1e-6, 5e-7)),
              CostModel((4e-3, 0.0, 1e-6, 6e-7, 2e-4, 5e-4, 3e-4, 4e-4, 0.0),
                        knots=(4, 8, 16, 32, 64), packed=True),
              CostModel((4.4e-3, 1.3e-5, 9.4e-7, 6.0e-7, 2.4e-4, 4.7e-4, 3.7e-4, 4.8e-4,
                         4.2e-4, 4.2e-4, 3.1e-5), knots=(4, 8, 16, 32, 64), packed=True,
                        tiled=True),
              CostModel((1e-3, 2e-4, 1e-6, 5e-7, 3e-4, 1e-4, 2e-4, 7e-5), knots=(8, 32),
                        tiled=True),
              CostModel((1e-3, 2e-4, 1e-6, 5e-7, 3e-4, 1e-4, 2e-4, 7e-5), knots=(8, 32),
                        tiled=True, tile_tokens=4),
              CostModel((1e-3, 2e-4, 1e-6, 5e-7, 3e-4, 1e-4, 2e-4, 7e-5, 4e-4), knots=(8, 32),
                        tiled=True, tile_tokens=4, drafting=True)]
    checked = 0
    for m in models:
        for _ in range(400):
            rows, q = rng.randint(1, 16), rng.randint(1, 16)
            tokens = rng.choice([None, rng.randint(rows, rows * q)])
            ctx = rng.choice([rng.randint(1, 4000), rng.uniform(1, 4000)])
            t = rows * q if tokens is None else tokens
            want = max(sum(map(operator.mul, m.coef, _features(
                rows, q, ctx, t, m.knots, m.packed, m.tiled, m.tile_tokens,
                m.drafting))), 1e-6)
            got = m.step_time(rows, q, ctx, tokens)
            assert got == want and math.copysign(1, got) == math.copysign(1, want)
            checked += 1
    assert checked == 2400
    # the shortcut is what the file's model computes too
    assert load_roundtrip(models[2]).step_time(16, 6, 300.5, 40) == \
        models[2].step_time(16, 6, 300.5, 40)
