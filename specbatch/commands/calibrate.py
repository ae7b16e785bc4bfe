"""``specbatch calibrate`` and ``specbatch predict-eval``: the planner's two measured inputs."""

from __future__ import annotations

import os
from collections import defaultdict

import click

from specbatch.commands.common import file_age


def run_calibrate(model: str | None, dtype: str, cache_dir: str | None, output: str | None,
                  recalibrate: bool, device: str = "cpu", cpu=None) -> int:
    from specbatch.config import EngineConfig, SpecConfig
    from specbatch.llm import LLM, ModelLoadError

    def err(line: str) -> None:
        click.echo(line, err=True)

    if output is not None:  # before a measurement of ~20 s, not after it
        why = _unwritable(output)
        if why:
            err(f"error: cannot write {output!r}: {why}")
            return 2
    if cpu is not None:  # cpu_threads.ThreadChoice
        err(cpu.line())
    try:
        engine = EngineConfig(dtype=dtype, device=device).for_model(model, cache_dir)
        llm = LLM.from_config(model, SpecConfig(method="none"), engine, cache_dir=cache_dir,
                              echo=err)
    except ModelLoadError as e:
        click.echo(f"error: {e}", err=True)
        return 2
    cost, path, measured = llm.calibrate(recalibrate=recalibrate, echo=err)
    if measured or not path or not os.path.exists(path):
        click.echo(f"{'measured' if measured else 'cached'}: {path}")
    else:
        click.echo(f"cached: {path}, measured {file_age(path)} (--recalibrate measures again)")
    click.echo("rows: rows of the step; q: tokens its longest row feeds; ctx: keys per row; "
               "tokens: tokens fed in all (fewer than rows x q: a packed step, drafts on a few "
               "rows)")
    click.echo(f"{'rows':>5}{'q':>4}{'ctx':>6}{'tokens':>7}{'measured ms':>13}{'fit ms':>9}")
    # one row per timed shape, by context, rows, q, tokens (files written before calibrate kept
    # the grid's order list a shape timed again last), outliers labelled in their place; a
    # packed shape (fewer real tokens than rows x q) lists its tokens
    rows = [(s, "") for s in cost.samples] + [(s, "  outlier, left out") for s in cost.rejected]
    for s, note in sorted(rows, key=lambda row: (row[0][2], row[0][0], row[0][1],
                                                 _tokens(row[0]))):
        r, q, c, sec, t = *s[:4], _tokens(s)
        click.echo(f"{r:>5}{q:>4}{c:>6}{t:>7}{sec * 1e3:>13.1f}"
                   f"{cost.step_time(r, q, c, num_tokens=t) * 1e3:>9.1f}{note}")
    noisy = cost.noise()
    click.echo("fit (a step's ms: the sum of each term times its count; median deviation "
               f"{cost.median_residual:.1%} from the timings above"
               + (f"; load average {cost.load_average:.1f} while measuring"
                  if cost.load_average is not None else "")
               + (f"; {cost.calibrations} calibrations merged" if cost.calibrations > 1
                  else "") + "):")
    terms = cost.terms()
    width = max(len(what) for what, _ in terms)
    for what, ms in terms:
        if ms > 0:
            click.echo(f"  {what:<{width}}  {ms:8.3f} ms")
    zero = [what for what, ms in terms if ms <= 0]
    if zero:
        click.echo("  fitted at 0 (no cost of their own on this machine): " + "; ".join(zero))
    if noisy:
        click.echo(f"noisy: {noisy} (--recalibrate on a quiet machine measures again)")
    if output is not None:
        try:
            cost.save(output)
        except OSError as e:
            click.echo(f"error: cannot write {output!r}: {e.strerror or e}", err=True)
            return 2
        click.echo(f"wrote {output}")
    return 0


def _tokens(sample) -> int:
    """Real tokens of a calibration sample ``[rows, q, ctx, seconds(, tokens)]``."""
    return int(sample[4]) if len(sample) == 5 else int(sample[0]) * int(sample[1])


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (empty, a folder, a file where a folder should be, no
    permission), or None: creates its folder and a temporary file in it as ``CostModel.save``
    will, then removes that file (no file of the user's is touched)."""
    import os
    import tempfile
    from pathlib import Path

    if not path:
        return "an empty path"
    p = Path(path)
    if p.is_dir():
        return "it is a folder"
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{str(parent)!r} is a file, not a folder"
            break
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        return e.strerror or str(e)
    return None


def run_predict_eval(paths, k: int, model: str | None, cache_dir: str | None,
                     refit: bool = False, probe_tokens: int | None = None) -> int:
    """How well acceptance is predicted, on output files (any T: outputs do not depend on
    drafting, so replay is exact; a run of another method than ngram is measured by replaying
    prompt lookup at ``k`` over each first answer). Two predictions, each scored by Spearman
    rank correlation over records:

    - before generation, from the prompt (``predict``), against the record's measured
      ``spec.mean_acceptance_length``;
    - after the probe (``auto.candidate.Probe``): prompt lookup replayed over the first
      ``probe_tokens`` output tokens of the first turn, combined with the prompt prediction as
      the policy combines them (``RowAcceptance``), against the acceptance length replayed over
      the rest of that turn (positions >= probe_tokens), which the probe never saw.

    ``refit``: also fit the prompt weights to these files by least squares on logit(alpha) and
    report the rank correlation of the refitted predictor out of sample (2-fold: fit on even
    records, score odd, and back)."""
    from specbatch import methods
    from specbatch.analyze.load import load_run
    from specbatch.models.loader import load_model
    from specbatch.models.registry import DEFAULT_MODEL
    from specbatch.prompts import PromptRenderer
    from specbatch.auto.planner import PROBE_TOKENS, Plan
    from specbatch.auto.candidate import RowAcceptance
    from specbatch.auto.predict import instruction_text, predict, spearman
    from specbatch.spec_decode.replay import NgramReplay

    probe_tokens = PROBE_TOKENS if probe_tokens is None else probe_tokens
    preds, meas, cats, feats = [], [], [], []
    probe_pred, probe_meas = [], []
    replayed_runs: list[str] = []
    tokenizer = None
    for path in paths:
        # as analyze reads it: the run's config (beside OUT) gives the prompt field or template
        # and the sampling defaults, so a recipe's or a --template job's records render again
        try:
            run = load_run(path)
        except ValueError as e:
            click.echo(f"error: {e}", err=True)
            return 2
        cfg = run.config or {}
        if tokenizer is None:
            name = model or (cfg.get("model", "").split("@")[0] or DEFAULT_MODEL)
            tokenizer = load_model(name, cache_dir=cache_dir).tokenizer
        renderer = PromptRenderer(tokenizer)
        lookup_min = cfg.get("prompt_lookup_min", 2)
        lookup_max = cfg.get("prompt_lookup_max", 4)
        max_model_len = cfg.get("max_model_len") or 1 << 30
        # the prediction is prompt lookup's at k: a run of another method (auto, suffix, draft:
        # drafts up to 3k, from other sources) is measured by replaying lookup at k over each
        # first answer (exact: outputs do not depend on drafting)
        own = methods.get(cfg.get("method", "ngram"))  # its stats are lookup's at k (ngram)
        replayed = own is None or not own.whatif_self_check
        if replayed:
            replayed_runs.append(f"{path} (method {cfg.get('method')})")
        for rec in run.records:
            mal = rec.fields.get("spec", {}).get("mean_acceptance_length")
            out = rec.fields.get("output_token_ids") or []
            first = out[0] if out and isinstance(out[0], list) else out
            ids, _ = renderer.first_prompt(rec)
            if replayed and first:
                mal = NgramReplay(ids, first, lookup_min, lookup_max, k).stats(
                    k, rec.sampling.max_tokens, max_model_len).mean_acceptance_length
            if mal is None:
                continue
            p = predict(ids, instruction_text(rec, renderer), rec.sampling.temperature, lookup_min)
            preds.append(p.acceptance_length(k))
            feats.append(p.values)
            meas.append(mal)
            cats.append(str(rec.fields.get("category", "")))
            if len(first) <= probe_tokens:
                continue
            replay = NgramReplay(ids, first, lookup_min, lookup_max, k)
            rest = replay.stats(k, rec.sampling.max_tokens, max_model_len, start=probe_tokens)
            if rest.mean_acceptance_length is None:
                continue
            acc = RowAcceptance(Plan.prior_from_alpha(p.alpha, k))
            for draft, accepted, emitted in replay.steps(k, rec.sampling.max_tokens,
                                                         max_model_len, end=probe_tokens):
                acc.count(len(draft), accepted, emitted, decay=1.0)
            probe_pred.append(acc.expected_tokens(k))
            probe_meas.append(rest.mean_acceptance_length)
    if len(preds) < 3:
        click.echo("error: fewer than 3 records with drafting stats", err=True)
        return 2
    click.echo(f"Spearman rank correlation, predicted vs measured acceptance length (k={k}):")
    for name in replayed_runs:
        click.echo(f"  {name}: measured = prompt lookup replayed at k={k} over each first "
                   "answer, not the run's own drafts")
    click.echo(f"  from the prompt, before generation:   {spearman(preds, meas):6.3f}  "
               f"({len(preds)} records, vs the whole answer)")
    if len(probe_pred) >= 3:
        click.echo(f"  after the probe ({probe_tokens} tokens replayed): "
                   f"{spearman(probe_pred, probe_meas):6.3f}  ({len(probe_pred)} records, vs the "
                   f"rest of the first answer)")
    if refit:
        _refit(feats, meas, k)
    by = defaultdict(list)
    for p, m, c in zip(preds, meas, cats):
        by[c].append((p, m))
    click.echo(f"{'category':<16}{'records':>8}{'predicted':>10}{'measured':>10}")
    for c, pm in sorted(by.items(), key=lambda kv: -sum(m for _, m in kv[1]) / len(kv[1])):
        click.echo(f"{c or '-':<16}{len(pm):>8}{sum(p for p, _ in pm) / len(pm):>10.2f}"
                   f"{sum(m for _, m in pm) / len(pm):>10.2f}")
    return 0


def _alpha_from_length(length: float, k: int) -> float:
    """Invert 1 + a + ... + a^k = length by bisection (a in [0.001, 0.999])."""
    lo, hi = 0.001, 0.999
    for _ in range(50):
        mid = (lo + hi) / 2
        if 1 + sum(mid ** i for i in range(1, k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _refit(feats: list[tuple], meas: list[float], k: int) -> None:
    import math

    import torch

    from specbatch.auto.predict import FEATURES, spearman

    x = torch.tensor(feats, dtype=torch.float64)
    alpha = [_alpha_from_length(m, k) for m in meas]
    y = torch.tensor([math.log(a / (1 - a)) for a in alpha], dtype=torch.float64)

    def solve(idx):
        return torch.linalg.lstsq(x[idx], y[idx, None]).solution[:, 0]

    def score(w, idx):
        z = x[idx] @ w
        lengths = [1 + sum((1 / (1 + math.exp(-v))) ** i for i in range(1, k + 1))
                   for v in z.tolist()]
        return spearman(lengths, [meas[i] for i in idx])

    even, odd = list(range(0, len(meas), 2)), list(range(1, len(meas), 2))
    cv = (score(solve(even), odd) + score(solve(odd), even)) / 2
    w = solve(list(range(len(meas))))
    click.echo(f"refitted weights ({', '.join(FEATURES)}):\n  "
               f"({', '.join(f'{v:.3f}' for v in w.tolist())})")
    click.echo(f"2-fold out-of-sample Spearman of the refitted predictor: {cv:.3f}")


def command(model, dtype, device, cache_dir, output, recalibrate) -> int:
    """``specbatch calibrate`` from its parsed flags (``cli.calibrate``): check the model and
    the device before anything loads, then ``run_calibrate``. Returns the exit status. Raises
    ``click.UsageError`` (a device that is not there) and ``common.StopError`` (an unknown
    model)."""
    from specbatch.commands.common import as_flags, check_model, choose_threads
    from specbatch.config import resolve_device

    cpu = choose_threads(None)  # first: before anything imports torch
    check_model(model)
    try:
        device = resolve_device(device)
    except ValueError as e:
        raise click.UsageError(as_flags(str(e))) from None
    return run_calibrate(model, dtype, cache_dir, output, recalibrate, device=device, cpu=cpu)


def predict_eval_command(paths, k, model, cache_dir, refit, probe_tokens) -> int:
    """``specbatch predict-eval`` from its parsed flags (``cli.predict_eval``): check the model
    (``common.StopError``), then ``run_predict_eval``. Returns the exit status."""
    from specbatch.commands.common import check_model

    if model is not None:
        check_model(model)
    return run_predict_eval(paths, k, model, cache_dir, refit, probe_tokens)
