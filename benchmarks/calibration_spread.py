"""How far apart back-to-back calibrations price a draft token: the spread auto's fixed fit
carries into a job (docs/benchmarks.md, "auto against the best static arm").

    python benchmarks/calibration_spread.py --dtype int8 [--model smollm2-135m] [--runs 4]
        [--sweeps 3] [--context 700]

Runs ``auto.costmodel.calibrate`` ``--runs`` times in one process, one after another (each
``--sweeps`` sweeps of the grid, as ``specbatch calibrate`` does with 3; nothing is cached),
and prints for each fit the prices auto's choices turn on, at ``--context`` keys per row:

- ``b16 +24``: what 24 draft tokens packed into a 16-row step add, per token, over a plain
  16-row step's seconds per row (the step's rate: below 1, a token accepted with at least
  this chance pays);
- ``b16 +4``: the same for 4 draft tokens (a few rows drafting);
- ``b1 +4``: what 4 draft tokens add to a plain one-row step, per token, over that step.

then each price's mean and coefficient of variation over the runs. A static arm's speed does
not depend on these; auto's choices do, through the fit the job starts with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def prices(cost, ctx: int) -> tuple[float, float, float]:
    """(b16 +24, b16 +4, b1 +4) of ``cost`` (a ``CostModel``) at ``ctx`` keys: module doc."""
    plain16 = cost.step_time(16, 1, ctx, num_tokens=16)
    per_row = plain16 / 16
    b16_24 = (cost.step_time(16, 6, ctx, num_tokens=40) - plain16) / 24 / per_row
    b16_4 = (cost.step_time(16, 2, ctx, num_tokens=20) - plain16) / 4 / per_row
    plain1 = cost.step_time(1, 1, ctx)
    b1_4 = (cost.step_time(1, 5, ctx) - plain1) / 4 / plain1
    return b16_24, b16_4, b1_4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name or path, as run's")
    ap.add_argument("--dtype", default="int8", help="as run's --dtype (default int8)")
    ap.add_argument("--runs", type=int, default=4, help="calibrations, back to back (4)")
    ap.add_argument("--sweeps", type=int, default=3,
                    help="timing sweeps of the grid per calibration (3, as specbatch calibrate)")
    ap.add_argument("--context", type=int, default=700,
                    help="keys per row at which the prices are read (700)")
    args = ap.parse_args()

    import torch

    from specbatch.auto import costmodel
    from specbatch.config import EngineConfig, SpecConfig
    from specbatch.llm import LLM
    from specbatch.models.llama import LlamaForward

    engine = EngineConfig(dtype=args.dtype, device="cpu").for_model(args.model, None)
    llm = LLM.from_config(args.model, SpecConfig(method="none"), engine, echo=lambda _l: None)
    forward = LlamaForward(llm.loaded.model)
    names = ("b16 +24", "b16 +4", "b1 +4")
    print(f"{args.model} {engine.dtype}, {args.runs} calibrations of {args.sweeps} sweeps, "
          f"context {args.context}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'run':>4}{'s':>6}{'plain b16 ms':>14}{'plain b1 ms':>13}"
          + "".join(f"{n:>9}" for n in names))
    rows = []
    with torch.no_grad():
        for i in range(args.runs):
            t0 = time.perf_counter()
            cost = costmodel.calibrate(forward, args.model, engine.dtype, repeats=args.sweeps,
                                       budget_seconds=None)
            seconds = time.perf_counter() - t0
            rows.append(prices(cost, args.context))
            print(f"{i + 1:>4}{seconds:>6.1f}"
                  f"{cost.step_time(16, 1, args.context, num_tokens=16) * 1e3:>14.2f}"
                  f"{cost.step_time(1, 1, args.context) * 1e3:>13.2f}"
                  + "".join(f"{x:>9.3f}" for x in rows[-1]))
    print("b16 +24 / b16 +4: seconds one of 24 / 4 draft tokens packed into a 16-row step adds,"
          " over a plain 16-row step's seconds per row; b1 +4: one of 4 draft tokens over a "
          "plain 1-row step (a token accepted with at least this chance pays)")
    for name, values in zip(names, zip(*rows)):
        mean = statistics.mean(values)
        cv = statistics.stdev(values) / mean if len(values) > 1 and mean else 0.0
        print(f"{name}: mean {mean:.3f}, coefficient of variation {cv:.1%}, "
              f"range {min(values):.3f}-{max(values):.3f}")


if __name__ == "__main__":
    main()
