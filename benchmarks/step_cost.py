"""The step-cost model's predictions against measured verify steps.

    python benchmarks/step_cost.py run benchmarks/peers/records16.jsonl --batch 16 --dtype int8 \
        [--method auto] [--k 5] [--max-tokens 128] [--threads 2] [--cost FIT.json] [--log OUT.jsonl]
    python benchmarks/step_cost.py sweep --dtype int8 [--rows 16] [--tokens 16 17 ... 48]
        [--ctx 128 256 384] [--q 6] [--repeats 7] [--cost FIT.json]

``run``: runs the records (one arm) and logs every verify step: rows, q (the longest row's fed
tokens), the real tokens fed, the rows' mean context, the seconds of the forward alone
(``ModelRunner.verify``) and of the whole step (forward, then sampling, acceptance and commit:
what ``auto`` pays), and the calibrated model's prediction (``CostModel.step_time``, the fit
cached for this machine unless ``--cost``). Prints the medians per (q, token) bin, measured /
predicted.

``sweep``: times synthetic packed verify steps of ``--rows`` rows at each token count (the extra
tokens as drafts of up to ``q - 1`` tokens, filled row by row, as ``runner.verify`` packs them)
and context, interleaved, the fastest and the median of ``--repeats``; the forward alone
(``step``) and the forward plus the greedy selection of every fed position (``+select``, the
engine's all-greedy commit path), against the model.

Wall times: the load average is printed; other processes only add time (use the fastest).
``--clock cpu --threads 1``: steps timed on the process's CPU time, and the fit compared with
calibrated on it too (``--fit-out`` saves it; ``run`` then prices auto's steps with it, fixed):
on a shared machine the measure that does not follow the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _llm(dtype: str, batch: int, threads: int):
    import torch

    torch.set_num_threads(threads)
    from specbatch import LLM
    from specbatch.config import EngineConfig, SpecConfig

    engine = EngineConfig(max_batch_size=batch, dtype=dtype, device="cpu")
    return LLM.from_config(None, SpecConfig(method="none"), engine, echo=lambda _l: None)


CLOCK = time.perf_counter


def _cost(llm, args):
    """The fit to compare with: ``--cost FILE``; with ``--clock cpu`` one measured now on
    process CPU time (``--fit-out``: saved there); else the cached (or newly cached) fit."""
    from types import SimpleNamespace

    from specbatch.auto import costmodel
    from specbatch.models.llama import LlamaForward

    if args.cost:
        return costmodel.load(args.cost)
    if args.clock == "cpu":
        was = costmodel.time
        costmodel.time = SimpleNamespace(perf_counter=time.process_time)
        try:
            cost = costmodel.calibrate(LlamaForward(llm.loaded.model), model_id=llm.model_id,
                                       dtype=args.dtype, budget_seconds=None)
        finally:
            costmodel.time = was
        if args.fit_out:
            cost.save(args.fit_out)
        return cost
    return llm.calibrate(echo=lambda line: print(line, file=sys.stderr))[0]


def run(args) -> None:
    from specbatch.config import SamplingParams, SpecConfig
    from specbatch.engine.engine import Engine
    from specbatch.engine.runner import ModelRunner
    from specbatch.io.records import read_records

    llm = _llm(args.dtype, args.batch, args.threads)
    cost = _cost(llm, args)
    print(f"fit: {cost.describe()} (knots {cost.knots}, load at calibration "
          f"{cost.load_average})")
    records, errors = read_records(args.records,
                                   defaults=SamplingParams(max_tokens=args.max_tokens))
    assert not errors, errors
    records = [replace(r, sampling=replace(r.sampling, max_tokens=args.max_tokens))
               for r in records[:args.limit]]
    spec = (SpecConfig(method="none") if args.method == "none"
            else SpecConfig(method=args.method, num_speculative_tokens=args.k))
    steps: list[dict] = []
    pending: dict = {}
    verify0, commit0 = ModelRunner.verify, Engine._commit_step

    def verify(self, seqs, drafts, meta=None):
        t0 = CLOCK()
        out = verify0(self, seqs, drafts, meta)
        pending.update(t0=t0, forward=CLOCK() - t0, rows=len(seqs),
                       q=1 + max((len(d) for d in drafts), default=0),
                       tokens=sum(1 + len(d) for d in drafts),
                       ctx=sum(len(s.token_ids) for s in seqs) / len(seqs))
        return out

    def commit(self, seqs, drafts, logits, meta, is_prefill=False, ghosts=()):
        out = commit0(self, seqs, drafts, logits, meta, is_prefill, ghosts)
        if not is_prefill and pending:
            p = dict(pending)
            p["step"] = CLOCK() - p.pop("t0")
            p["predicted"] = cost.step_time(p["rows"], p["q"], p["ctx"], num_tokens=p["tokens"])
            steps.append(p)
        pending.clear()
        return out

    ModelRunner.verify, Engine._commit_step = verify, commit
    try:
        prepared = llm.prepare(records, spec, echo=lambda _l: None)
        if prepared.plan is not None and (args.cost or args.clock == "cpu"):
            pol = prepared.plan.policy
            pol.cost = cost  # priced by this fit, fixed
        elif prepared.plan is not None and args.fixed_cost:
            pol = prepared.plan.policy
            pol.cost = pol.cost.model if hasattr(pol.cost, "model") else pol.cost
        t0 = CLOCK()
        outs = [f for _, f in prepared.run(seed=0)]
        wall = CLOCK() - t0
    finally:
        ModelRunner.verify, Engine._commit_step = verify0, commit0
    tokens = sum(f["usage"]["completion_tokens"] for f in outs)
    print(f"{args.method}: {len(steps)} verify steps, {tokens} tokens, {wall:.1f} s, "
          f"load {os.getloadavg()[0]:.1f}")
    if args.log:
        with open(args.log, "w") as f:
            for s in steps:
                f.write(json.dumps(s) + "\n")
    summarize(steps)


def _bin(tokens: int) -> str:
    for lo, hi in ((1, 1), (2, 8), (9, 15), (16, 16), (17, 20), (21, 24), (25, 28), (29, 32),
                   (33, 40), (41, 48), (49, 64), (65, 1 << 30)):
        if lo <= tokens <= hi:
            return f"{lo}-{hi}" if hi != lo else str(lo)
    return "?"


def summarize(steps: list[dict]) -> None:
    groups: dict = {}
    for s in steps:
        groups.setdefault((s["rows"], _bin(s["tokens"])), []).append(s)
    print(f"{'rows':>4} {'tokens':>8} {'n':>5} {'q med':>6} {'ctx med':>8} {'fwd ms':>8} "
          f"{'step ms':>8} {'pred ms':>8} {'fwd/pred':>9} {'step/pred':>9}")
    for (rows, b), g in sorted(groups.items(), key=lambda kv: (kv[0][0], min(
            s["tokens"] for s in kv[1]))):
        med = {k: statistics.median(s[k] for s in g) for k in ("q", "ctx", "forward", "step",
                                                               "predicted")}
        rf = statistics.median(s["forward"] / s["predicted"] for s in g)
        rs = statistics.median(s["step"] / s["predicted"] for s in g)
        print(f"{rows:>4} {b:>8} {len(g):>5} {med['q']:>6.0f} {med['ctx']:>8.0f} "
              f"{med['forward'] * 1e3:>8.2f} {med['step'] * 1e3:>8.2f} "
              f"{med['predicted'] * 1e3:>8.2f} {rf:>9.3f} {rs:>9.3f}")
    tot = {k: sum(s[k] for s in steps) for k in ("forward", "step", "predicted")}
    print(f"sum over steps: forward {tot['forward']:.2f} s, step {tot['step']:.2f} s, "
          f"predicted {tot['predicted']:.2f} s")


def _fed(rows: int, tokens: int, q: int) -> list[int]:
    """Fed tokens per row: 1 each, the extra ones as drafts of up to q - 1, row by row."""
    fed, extra = [1] * rows, tokens - rows
    for i in range(rows):
        d = min(q - 1, extra)
        fed[i] += d
        extra -= d
    if extra:
        raise SystemExit(f"{tokens} tokens do not fit {rows} rows of at most {q}")
    return fed


def sweep(args) -> None:
    import torch

    from specbatch.kernels import select_cpu
    from specbatch.models.llama import LlamaForward

    llm = _llm(args.dtype, args.rows, args.threads)
    cost = _cost(llm, args)
    print(f"fit: {cost.describe()} (knots {cost.knots})")
    forward = LlamaForward(llm.loaded.model)
    rows = args.rows
    cache = forward.new_cache(rows, max(args.ctx) + args.q + 2)
    gen = torch.Generator().manual_seed(0)
    shapes = [(t, c) for c in args.ctx for t in args.tokens]
    times: dict = {s: [] for s in shapes}
    sel: dict = {s: [] for s in shapes}

    def one(t: int, c: int, warm: bool = False) -> None:
        fed = _fed(rows, t, args.q)
        q = max(fed)
        for r in range(rows):
            cache.seq_lens[r] = c
        ids = torch.randint(0, forward.vocab_size, (rows, q), generator=gen)
        positions = (c + torch.arange(q))[None, :].expand(rows, -1)
        num_fed = torch.tensor(fed, dtype=torch.int64)
        row_ids = torch.arange(rows)
        real = torch.arange(q)[None, :] < num_fed[:, None]
        token_index = torch.nonzero(real.flatten()).flatten()
        t0 = CLOCK()
        logits = forward.forward(ids, positions, cache, row_ids,
                                 num_fed=num_fed if min(fed) < q else None)
        t1 = CLOCK()
        if logits.dim() == 2:  # packed: the fed positions' logits [T, V]
            select_cpu.greedy_select(logits, None, None)
        else:
            select_cpu.greedy_select(logits.reshape(rows * q, -1), token_index, None)
        t2 = CLOCK()
        if not warm:
            times[(t, c)].append(t1 - t0)
            sel[(t, c)].append(t2 - t0)

    one(args.tokens[0], args.ctx[0], warm=True)
    for _ in range(args.repeats):
        for s in shapes:
            one(*s)
    print(f"rows {rows}, drafts of up to {args.q - 1} per row, {args.repeats} interleaved "
          f"sweeps, load {os.getloadavg()[0]:.1f}")
    print(f"{'ctx':>5} {'tokens':>6} {'min ms':>7} {'med ms':>7} {'+select':>8} {'pred ms':>8} "
          f"{'min/pred':>8}")
    for t, c in shapes:
        pred = cost.step_time(rows, max(_fed(rows, t, args.q)), c, num_tokens=t)
        lo = min(times[(t, c)])
        print(f"{c:>5} {t:>6} {lo * 1e3:>7.2f} {statistics.median(times[(t, c)]) * 1e3:>7.2f} "
              f"{min(sel[(t, c)]) * 1e3:>8.2f} {pred * 1e3:>8.2f} {lo / pred:>8.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("records")
    r.add_argument("--batch", type=int, default=16)
    r.add_argument("--method", default="auto")
    r.add_argument("--k", type=int, default=5)
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--limit", type=int, default=None)
    r.add_argument("--fixed-cost", action="store_true",
                   help="auto prices steps with the calibration only (no online refit)")
    r.add_argument("--log", default=None, help="write every step as a JSON line here")
    w = sub.add_parser("sweep")
    w.add_argument("--rows", type=int, default=16)
    w.add_argument("--tokens", type=int, nargs="+", default=list(range(16, 49, 2)))
    w.add_argument("--ctx", type=int, nargs="+", default=[128, 256, 384])
    w.add_argument("--q", type=int, default=6)
    w.add_argument("--repeats", type=int, default=7)
    for p in (r, w):
        p.add_argument("--dtype", default="int8")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--cost", default=None, help="a CostModel JSON instead of the cached fit")
        p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                       help="cpu: time steps on the process's CPU time (load-independent at "
                            "--threads 1) and calibrate the fit to compare with on it too")
        p.add_argument("--fit-out", default=None, help="with --clock cpu: save that fit here")
    args = ap.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    run(args) if args.cmd == "run" else sweep(args)


if __name__ == "__main__":
    main()
