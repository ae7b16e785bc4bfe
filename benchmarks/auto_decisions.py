"""What ``--method auto`` decides, step by step, against the static arms on the same records.

    python benchmarks/auto_decisions.py benchmarks/peers/records16.jsonl --batch 16 --dtype int8 \
        --arms none,ngram,suffix,auto [--max-tokens 128] [--limit N] [--fixed-cost | --cost FIT.json]
        [--json OUT] [--template T --json-schema SCHEMA.json]

Load-independent measures first: per arm the verify steps, output tokens, draft tokens and
accepted tokens summed over the records (tokens per step; draft tokens not accepted are the
wasted ones), the verify forwards and their seconds as the machine's cached step-cost fit
(measured and cached first where there is none, ~20 s) prices them (``fit s``: what auto
optimises, the same whatever the load; beside it the forwards' and the prefill steps'
measured seconds; per range of fed tokens, the median of a verify step's measured seconds
over the fit's: where drafting steps sit further above the fit than plain ones, auto drafts
too much), whether every arm's token ids equal ``none``'s, and for auto the per-step
step cap K and drafted tokens (the first steps in full), and the time spent in the policy
(``select`` / ``observe``) and in the proposers as a share of the run's wall time.
auto prices steps with the job's calibration, fixed for the job (``--fixed-cost``, for the
command lines of trees that refitted it online, is what it does anyway);
--cost FILE: with that cost model instead (a ``CostModel`` JSON, e.g. fitted from timings taken
on a quiet machine).
Wall times are printed with the load average: on a busy machine they are noise. An untimed
job of two records runs first (the first forward packs the weights for the C kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import replace

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def job_args(ap: argparse.ArgumentParser) -> None:
    """The job's arguments (records, batch, dtype, ...), shared with ``lockstep.py``."""
    ap.add_argument("records")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--template", default=None, help="as specbatch run --template")
    ap.add_argument("--json-schema", default=None, help="as specbatch run --json-schema")


def load_job(args):
    """``(records, engine)``: the job's records (``--limit``, ``--max-tokens`` applied) and its
    ``EngineConfig``, all checked before the model loads: bad input is one line, no
    traceback."""
    from specbatch.config import ConfigError, EngineConfig, SamplingParams
    from specbatch.io.records import error_lines, read_records

    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"error: --limit {args.limit}: at least 1")
    try:
        engine = EngineConfig(max_batch_size=args.batch, dtype=args.dtype, device="cpu")
        defaults = SamplingParams(max_tokens=args.max_tokens)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    if args.json_schema:
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            raise SystemExit("error: --json-schema needs xgrammar: pip install -c "
                             "constraints.txt -e '.[json]'") from None
        try:
            with open(args.json_schema) as f:
                schema = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: --json-schema {args.json_schema}: {e}") from None
        defaults = replace(defaults, response_format={
            "type": "json_schema", "json_schema": {"schema": schema}})
    kwargs = {"template": args.template} if args.template else {}
    records, errors = read_records(args.records, defaults=defaults, **kwargs)
    if errors:
        raise SystemExit("\n".join(error_lines(errors, "fail", can_skip=False,
                                                none_valid=not records)))
    records = records[:args.limit] if args.limit else records
    records = [replace(r, sampling=replace(r.sampling, max_tokens=args.max_tokens))
               for r in records]
    return records, engine


def warm_up(llm, records) -> None:
    """An untimed job of two records, 4 tokens each, plain decoding: the first forward of a
    process packs the weights for the C kernels, and the arm that ran it carried that."""
    from specbatch.config import SpecConfig

    warm = [replace(r, sampling=replace(r.sampling, max_tokens=4)) for r in records[:2]]
    list(llm.prepare(warm, SpecConfig(method="none"), echo=lambda _l: None).run(seed=0))


def main() -> None:
    ap = argparse.ArgumentParser()
    job_args(ap)
    ap.add_argument("--arms", default="none,ngram,suffix,auto")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--fixed-cost", action="store_true")
    ap.add_argument("--cost", default=None,
                    help="a CostModel JSON (CostModel.save) that auto prices steps with, fixed")
    ap.add_argument("--show-steps", type=int, default=12)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(2)
    from specbatch import LLM
    from specbatch.config import ConfigError, SpecConfig
    from specbatch.auto import costmodel

    # every arm and record checked before the model loads: one line each, no traceback
    arms = [a for a in args.arms.split(",") if a]
    if not arms:
        raise SystemExit(f"error: --arms {args.arms!r}: no arms given")
    if len(set(arms)) != len(arms):
        raise SystemExit(f"error: --arms {args.arms}: each arm at most once")
    try:
        specs = {arm: SpecConfig(method="none") if arm == "none"
                 else SpecConfig(method=arm, num_speculative_tokens=args.k) for arm in arms}
    except ConfigError as e:
        raise SystemExit(f"error: --arms {args.arms}: {e}") from None
    records, engine = load_job(args)
    fixed_cost = None
    if args.cost:
        try:
            fixed_cost = costmodel.load(args.cost)
        except ValueError as e:
            raise SystemExit(f"error: --cost {e}") from None
    llm = LLM.from_config(None, SpecConfig(method="none"), engine, echo=lambda _l: None)
    results = {}
    fit = llm.calibrate(echo=lambda _l: None)[0]
    warm_up(llm, records)
    for arm, spec in specs.items():
        prepared = llm.prepare(records, spec, echo=lambda _l: None)
        log = {"K": [], "drafted": [], "rows": [], "fit_ms": []}
        timers = {"select": 0.0, "observe": 0.0, "propose": 0.0, "commit": 0.0}
        policy = prepared.plan.policy if prepared.plan is not None else None
        if policy is not None:
            policy._base_cost = (policy.cost.model if hasattr(policy.cost, "model")
                                 else policy.cost)
            if fixed_cost is not None:
                policy.cost = fixed_cost
            elif args.fixed_cost:
                policy.cost = policy.cost.model if hasattr(policy.cost, "model") else policy.cost
            _instrument(policy, timers, log)
        t0 = time.perf_counter()
        with _priced(fit) as priced:
            outs = {rec.index: fields for rec, fields in prepared.run(seed=0)}
        wall = time.perf_counter() - t0
        tot = {"steps": 0, "tokens": 0, "draft": 0, "accepted": 0}
        for f in outs.values():
            s = f["spec"]
            tot["steps"] += s["num_steps"]
            tot["draft"] += s["num_draft_tokens"]
            tot["accepted"] += s["num_accepted_tokens"]
            tot["tokens"] += f["usage"]["completion_tokens"]
        ids = {i: f["output_token_ids"] for i, f in outs.items()}
        results[arm] = {"ids": ids, "tot": tot, "wall": wall, "timers": timers, "log": log,
                        "proposer_steps": {i: f["spec"].get("proposer_steps") for i, f in
                                           outs.items()},
                        "load": os.getloadavg()[0], "priced": priced,
                        "calib_ms": _calib_ms(policy, log)}
    base = results.get("none")
    print(f"batch {args.batch}, dtype {llm.engine_config.dtype if hasattr(llm, 'engine_config') else args.dtype}, "
          f"{len(records)} records, max_tokens {args.max_tokens}")
    print(f"{'arm':<8}{'steps':>7}{'tokens':>8}{'tok/step':>9}{'draft':>7}{'accepted':>9}"
          f"{'wasted':>7}{'fwds':>6}{'fit s':>7}{'fwd s':>7}{'pre s':>7}{'wall s':>8}{'tok/s':>7}"
          f"{'load':>6}  same ids as none")
    for arm, r in results.items():
        t, p = r["tot"], r["priced"]
        same = "-" if base is None else (r["ids"] == base["ids"])
        print(f"{arm:<8}{t['steps']:>7}{t['tokens']:>8}{t['tokens'] / t['steps']:>9.2f}"
              f"{t['draft']:>7}{t['accepted']:>9}{t['draft'] - t['accepted']:>7}"
              f"{p['steps']:>6}{p['fit']:>7.2f}{p['measured']:>7.2f}{p['prefill']:>7.2f}"
              f"{r['wall']:>8.2f}{t['tokens'] / r['wall']:>7.1f}{r['load']:>6.1f}  {same}")
    print("fwds: verify forwards; fit s: their seconds as the job's calibrated step-cost fit "
          "prices them (load-independent); fwd s: as measured; pre s: prefill steps, measured")
    for arm, r in results.items():
        print(f"{arm}: measured / fit per verify step, median, by the longest row's fed tokens "
              f"(steps): {_by_q(r['priced']['by_q'])}")
    for arm, r in results.items():
        if not r["log"]["K"]:
            continue
        tm, n_steps = r["timers"], len(r["log"]["K"])
        per = {k: v / n_steps * 1e3 for k, v in tm.items()}
        print(f"{arm}: CPU ms per verify step ({n_steps} steps, thread time): policy select "
              f"{per['select']:.3f} (suffix lookup included), lookup propose "
              f"{per['propose']:.3f}, observe {per['observe']:.3f}, candidates' on_commit "
              f"{per['commit']:.3f}; total "
              f"{sum(per.values()):.3f}; calibrated step "
              f"{r['calib_ms']:.2f} ms at the run's mean rows, q=1")
        n = args.show_steps
        print(f"  first steps: K {r['log']['K'][:n]} drafted {r['log']['drafted'][:n]} "
              f"rows {r['log']['rows'][:n]}")
        drafted = r["log"]["drafted"]
        print(f"  drafted tokens per step, quarters: "
              + " ".join(str(sum(q)) for q in _quarters(drafted)))
        if r["log"]["fit_ms"]:
            print("  fit: predicted ms of a (rows, q=1, ctx 300) step at each refit: "
                  + " ".join(f"{x:.1f}" for x in r["log"]["fit_ms"][:40]))
        print("  proposer steps per record: " + json.dumps(r["proposer_steps"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({a: {k: v for k, v in r.items()} for a, r in results.items()}, f)


def _calib_ms(policy, log) -> float:
    """The calibration's (quiet machine) step time at the run's mean rows, q = 1, ctx 300."""
    if policy is None or not log["rows"]:
        return 0.0
    cost = policy.cost.model if hasattr(policy.cost, "model") else policy.cost
    base = getattr(policy, "_base_cost", None) or cost
    rows = round(sum(log["rows"]) / len(log["rows"]))
    return base.step_time(rows, 1 if rows > 1 else 2, 300) * 1e3


@contextlib.contextmanager
def _priced(fit):
    """Verify forwards of the run, priced by ``fit`` as auto prices a step (``CostModel.
    step_time`` of its rows, longest fed row, real tokens, at ``policy._context``) and as
    measured (wall seconds); prefill steps measured."""
    from specbatch.auto.policy import _context
    from specbatch.engine.runner import ModelRunner

    verify0, prefill0 = ModelRunner.verify, ModelRunner.prefill_step
    out = {"steps": 0, "fit": 0.0, "measured": 0.0, "prefill": 0.0, "by_q": {}}

    def prefill_step(self, *a, **kw):
        t0 = time.perf_counter()
        res = prefill0(self, *a, **kw)
        out["prefill"] += time.perf_counter() - t0
        return res

    def verify(self, seqs, drafts, meta=None):
        fed, ctx = [1 + len(d) for d in drafts], _context(seqs)
        t0 = time.perf_counter()
        logits = verify0(self, seqs, drafts, meta)
        seconds = time.perf_counter() - t0
        priced = fit.step_time(len(seqs), max(fed), ctx, num_tokens=sum(fed),
                               drafting_rows=sum(1 for f in fed if f > 1))
        out["measured"] += seconds
        out["fit"] += priced
        out["steps"] += 1
        out["by_q"].setdefault(_q_bin(max(fed)), []).append(seconds / priced)
        return logits

    ModelRunner.verify, ModelRunner.prefill_step = verify, prefill_step
    try:
        yield out
    finally:
        ModelRunner.verify, ModelRunner.prefill_step = verify0, prefill0


# (label, fewest, most fed tokens of a step's longest row)
Q_BINS = (("1", 1, 1), ("2-3", 2, 3), ("4-6", 4, 6), ("7-10", 7, 10), ("11+", 11, 1 << 30))


def _q_bin(q: int) -> str:
    """The label of the ``Q_BINS`` range holding q (a step's longest fed row, tokens)."""
    return next(label for label, lo, hi in Q_BINS if lo <= q <= hi)


def _by_q(by_q: dict) -> str:
    """Median measured / fit of the verify steps per ``Q_BINS`` range (steps in brackets)."""
    import statistics

    return ", ".join(f"q {label}: {statistics.median(by_q[label]):.2f} ({len(by_q[label])})"
                     for label, _, _ in Q_BINS if label in by_q)


def _quarters(xs):
    n = max(len(xs), 1)
    return [xs[i * n // 4:(i + 1) * n // 4] for i in range(4)]


def _instrument(policy, timers, log) -> None:
    from specbatch.auto import costmodel

    online_cost = getattr(costmodel, "OnlineCost", None)  # trees that refitted online

    def timed(obj, name, key, after=None):
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t0 = time.thread_time()  # this thread's CPU time: other processes add none
            out = fn(*a, **kw)
            timers[key] += time.thread_time() - t0
            if after is not None:
                after(a, out)
            return out
        setattr(obj, name, wrapper)

    last_refits = [-1]

    def after_select(a, out):
        seqs = a[0]
        log["K"].append(policy.current_k)
        log["drafted"].append(sum(len(d) for d in out))
        log["rows"].append(len(seqs))

    def after_step(a, out):
        cost = policy.cost
        if online_cost is not None and isinstance(cost, online_cost) \
                and cost.num_observed != last_refits[0]:
            n = cost.num_observed
            if n % (8 if n <= 64 else cost.refit_every) == 0:
                log["fit_ms"].append(cost.step_time(len(a[0]), 1, 300) * 1e3)
            last_refits[0] = n

    timed(policy, "select", "select", after_select)
    timed(policy, "observe", "observe")
    if hasattr(policy, "observe_step"):  # a tree that refitted the step cost online
        timers["observe_step"] = 0.0
        timed(policy, "observe_step", "observe_step", after_step)
    timed(policy.lookup.proposer, "propose", "propose")  # prompt lookup's
    for cand in policy.candidates:  # each candidate's index of the committed tokens
        timed(cand, "on_commit", "commit")


if __name__ == "__main__":
    main()
