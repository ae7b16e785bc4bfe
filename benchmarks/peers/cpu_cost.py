"""Per-token CPU time and wall time of batch-1 arms, interleaved: a measure that a shared,
loaded machine disturbs less than tok/s (``run.py``'s figure).

    python benchmarks/peers/cpu_cost.py --work /work/qwen-run \
        --records benchmarks/peers/code_edit20.jsonl --threads 1 --limit 2 --max-tokens 64 \
        --rounds 5 --arms specbatch:none:1,llamacpp:none:1

Each arm is ``run.py``'s worker (same command line, models from ``WORK/model.json``), the
others stopped (SIGSTOP) while it runs. Per round and arm, in ``run.round_order``: a
job of ``--limit`` prompts with max_tokens 1 (prefill and the first token), then the same
prompts with ``--max-tokens``. The decode cost per token is the difference of the two jobs'
seconds over the difference of their output tokens (the prompts' prefill cancels out); CPU
seconds are the worker process's (every thread: ``time.process_time``), so time taken from it
by other processes on the machine does not count, while its own spinning threads do. Prints
per arm the best and median over rounds of: prefill seconds per prompt, decode milliseconds per
token (wall and CPU), and the whole job's tok/s (wall and CPU); then each ratio to the last
arm's (``--base``, default the last one listed). Outputs are checked to agree between arms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from run import LABELS, Worker, parse_arms, round_order  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--records", default=str(HERE / "records16.jsonl"))
    ap.add_argument("--arms", required=True, help="as run.py's, batch 1 (engine:method:1)")
    ap.add_argument("--base", default=None, help="the arm ratios are to (default: the last)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--limit", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--out", default=None, help="results JSON")
    for name in ("--model", "--draft", "--gguf", "--draft-gguf"):
        ap.add_argument(name, default=None)
    args = ap.parse_args()
    arms = parse_arms(args.arms)
    base = parse_arms(args.base)[0] if args.base else arms[-1]
    log_dir = Path(args.work) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    workers = {arm: Worker(arm, args, log_dir) for arm in arms}
    rows: dict = {arm: [] for arm in arms}
    outputs: dict = {}
    try:
        for w in workers.values():
            w.wait_ready()
            print(f"ready {w.arm}: {w.info}", file=sys.stderr)
            w.pause()
        for arm, w in workers.items():  # warm-up, untimed
            w.resume()
            w.run(1, 8)
            w.pause()
        for rnd in range(args.rounds):
            for arm in round_order(arms, rnd):
                w = workers[arm]
                w.resume()
                load = os.getloadavg()[0]
                first = w.run(args.limit, 1)
                full = w.run(args.limit, args.max_tokens)
                w.pause()
                n1 = sum(map(len, first["outputs"]))
                n = sum(map(len, full["outputs"]))
                outputs.setdefault(arm, full["outputs"])
                row = {"round": rnd, "load": load, "load_after": os.getloadavg()[0],
                       "tokens": n, "prefill_s": first["seconds"] / args.limit,
                       "prefill_cpu_s": first["cpu_seconds"] / args.limit,
                       "decode_ms": 1e3 * (full["seconds"] - first["seconds"]) / (n - n1),
                       "decode_cpu_ms": 1e3 * (full["cpu_seconds"] - first["cpu_seconds"])
                       / (n - n1),
                       "tok_s": n / full["seconds"], "cpu_tok_s": n / full["cpu_seconds"]}
                rows[arm].append(row)
                print(f"round {rnd + 1} {arm}: decode {row['decode_ms']:.1f} ms/token wall, "
                      f"{row['decode_cpu_ms']:.1f} CPU; prefill {row['prefill_s']:.2f} s/prompt"
                      f"; {row['tok_s']:.2f} tok/s; load {load:.2f}", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    keys = [("prefill_s", "prefill s/prompt", min), ("prefill_cpu_s", "prefill CPU s", min),
            ("decode_ms", "decode ms/token", min), ("decode_cpu_ms", "decode CPU ms/token", min),
            ("tok_s", "job tok/s", max), ("cpu_tok_s", "job tok/CPU s", max)]
    print(f"{args.limit} prompts, max_tokens {args.max_tokens}, threads {args.threads}, "
          f"{args.rounds} rounds; best (median) per arm; ratio: base / arm for times, arm / "
          f"base for rates (> 1: the arm is faster than {LABELS[base[0]]} {base[1]})")
    print("| engine | method | " + " | ".join(label for _, label, _ in keys)
          + " | load | same outputs as base |")
    print("|---|---|" + "---|" * (len(keys) + 2))
    best = {arm: {k: pick(r[k] for r in rows[arm]) for k, _, pick in keys} for arm in arms}
    for arm in arms:
        cells = []
        for k, _, pick in keys:
            b, med = best[arm][k], statistics.median(r[k] for r in rows[arm])
            ratio = (best[base][k] / b) if pick is min else (b / best[base][k])
            cells.append(f"{b:.3g} ({med:.3g}) {ratio:.2f}x")
        loads = [r[x] for r in rows[arm] for x in ("load", "load_after")]
        same = sum(a == b for a, b in zip(outputs[arm], outputs[base]))
        print(f"| {LABELS[arm[0]]} | {arm[1]} | " + " | ".join(cells)
              + f" | {min(loads):.1f}-{max(loads):.1f} | {same}/{len(outputs[base])} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": {
            "%s:%s:%d:%s" % a: r for a, r in rows.items()}, "outputs": {
            "%s:%s:%d:%s" % a: o for a, o in outputs.items()},
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}, indent=1))


if __name__ == "__main__":
    main()
