"""Each verify step of a run against auto's cost model: per (rows, fed tokens), the steps, their
mean measured time and the mean time the job's fit predicts. Where they part, auto decides on
wrong prices (the batch-1 fit of 15906e9 said 4.62 ms for a 1-token step that took 3.5).

    python benchmarks/step_fit.py benchmarks/peers/records16.jsonl --method auto --batch 1
    python benchmarks/step_fit.py recipes/prompts/json_extraction.jsonl --method auto --batch 16 \\
        --template "$T" --json-schema recipes/json_extraction.schema.json --limit 48

The fit is the cached calibration of the model and dtype (``specbatch calibrate``), the one
``--method auto`` plans with; ``--method`` other than auto is priced by it too. Times the
target's decode/verify forward (``CpuBackend.step``) alone, after an untimed warm-up of 2 records.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import replace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records")
    ap.add_argument("--method", default="auto")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--template", default=None, help="as specbatch run --template")
    ap.add_argument("--json-schema", default=None, help="as specbatch run --json-schema")
    args = ap.parse_args()

    from specbatch import LLM
    from specbatch.config import EngineConfig, SamplingParams, SpecConfig
    from specbatch.io.records import read_records
    from specbatch.models.backends import cpu as cpu_backend

    steps = []  # (rows, query slots, real tokens, mean position, seconds)
    inner = cpu_backend.CpuBackend.step

    def step(self, input_ids, positions, cache, rows, logits_index=None, num_fed=None):
        t0 = time.perf_counter()
        out = inner(self, input_ids, positions, cache, rows, logits_index, num_fed)
        seconds = time.perf_counter() - t0
        b, q = input_ids.shape
        fed = int(num_fed.sum()) if num_fed is not None else b * q
        steps.append((b, q, fed, float(positions[:, 0].float().mean()), seconds))
        return out

    cpu_backend.CpuBackend.step = step
    spec = (SpecConfig(method="none") if args.method == "none"
            else SpecConfig(method=args.method, num_speculative_tokens=args.k))
    engine = EngineConfig(max_batch_size=args.batch, dtype=args.dtype, device="cpu").for_model(None)
    llm = LLM.from_config(None, spec, engine, echo=lambda line: None)
    defaults = SamplingParams(max_tokens=args.max_tokens)
    if args.json_schema:
        import json

        defaults = replace(defaults, response_format={
            "type": "json_schema", "json_schema": {"schema": json.load(open(args.json_schema))}})
    kwargs = {"template": args.template} if args.template else {}
    records, errors = read_records(args.records, defaults=defaults, **kwargs)
    assert not errors, errors
    records = records[:args.limit]
    warm = [replace(r, sampling=replace(r.sampling, max_tokens=8)) for r in records[:2]]
    list(llm.generate_records(warm, seed=0, echo=lambda line: None))
    steps.clear()
    fit, _, _ = llm.calibrate()
    t0 = time.perf_counter()
    list(llm.generate_records(records, seed=0, echo=lambda line: None))
    wall = time.perf_counter() - t0
    by: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for b, q, fed, ctx, seconds in steps:
        cell = by[(b, fed)]
        cell[0] += 1
        cell[1] += seconds
        cell[2] += fit.step_time(b, q, ctx, num_tokens=fed)
    measured, predicted = sum(c[1] for c in by.values()), sum(c[2] for c in by.values())
    print(f"{args.method} batch {args.batch} {engine.dtype}: {len(records)} records, "
          f"{wall:.2f} s; {len(steps)} verify steps, {measured:.2f} s measured, "
          f"{predicted:.2f} s predicted")
    print("| rows | fed tokens | steps | measured ms | predicted ms |\n|---|---|---|---|---|")
    for (b, fed), (n, s, p) in sorted(by.items()):
        print(f"| {b} | {fed} | {n} | {1e3 * s / n:.2f} | {1e3 * p / n:.2f} |")


if __name__ == "__main__":
    main()
