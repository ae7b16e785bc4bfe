"""Where a specbatch run's wall time goes: forward (prefill / verify, attention inside them),
proposer, sampler + acceptance, and the rest (Python bookkeeping: scheduling, stop rules,
stats, building step metadata).

    OMP_NUM_THREADS=2 python benchmarks/peers/profile_steps.py benchmarks/peers/records16.jsonl \
        --method ngram --k 5 --batch 16
    OMP_NUM_THREADS=2 python benchmarks/peers/profile_steps.py benchmarks/peers/code_edit20.jsonl \
        --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b --method draft --batch 1

Wraps the stage functions with wall-clock timers (no profiler overhead on the rest) and prints
one table row per stage: seconds, share of the run, calls. Load once, one untimed warm-up of 2
records and 8 tokens, then the timed run.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records")
    ap.add_argument("--method", default="none")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="target (default: the packaged SmolLM2)")
    ap.add_argument("--draft-model", default=None, help="draft model (method draft / auto)")
    ap.add_argument("--limit", type=int, default=None, help="first N records only")
    ap.add_argument("--dense", action="store_true",
                    help="also time the dense layers and attention apart (float32 steps then "
                         "run the torch loop around the C kernels, not the one C call)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import specbatch.engine.engine as engine_mod
    from specbatch import LLM
    from specbatch.config import EngineConfig, SamplingParams, SpecConfig
    from specbatch.io.records import read_records

    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)

    def timed(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    from specbatch.models.backends import cpu as cpu_backend
    from specbatch.models.backends.reference import TorchBackend
    from specbatch.models.backends.triton_cuda import TritonBackend

    depth: dict[str, int] = defaultdict(int)

    def timed_outer(name, fn):  # the outermost call only: a backend may call its fallback's
        inner = timed(name, fn)

        @functools.wraps(fn)
        def wrapper(*a, **kw):
            if depth[name]:
                return fn(*a, **kw)
            depth[name] += 1
            try:
                return inner(*a, **kw)
            finally:
                depth[name] -= 1
        return wrapper

    for cls in (TorchBackend, cpu_backend.CpuBackend, TritonBackend):
        cls.step = timed_outer("forward: decode/verify", cls.__dict__["step"])
        cls.prefill = timed_outer("forward: prefill", cls.__dict__["prefill"])

    TorchBackend._attend = timed("  of which attention (both)", TorchBackend._attend)
    TorchBackend._plan_reads = timed("  of which read planning", TorchBackend._plan_reads)
    engine_mod.sample_and_accept = timed("sampler + acceptance", engine_mod.sample_and_accept)
    engine_mod.fetch_step_results = timed("sampler + acceptance", engine_mod.fetch_step_results)
    propose = timed("proposer (+ policy)", engine_mod.Engine._propose)

    def propose_only(*a, **kw):  # a draft model's forwards count as the proposer's time
        for name in ("forward: decode/verify", "forward: prefill"):
            depth[name] += 1
        try:
            return propose(*a, **kw)
        finally:
            for name in ("forward: decode/verify", "forward: prefill"):
                depth[name] -= 1

    engine_mod.Engine._propose = propose_only
    import specbatch.models.llama as llama_mod

    if args.dense:  # wraps the matmul, so a float32 step can no longer run wholly in C
        linear_for = llama_mod.linear_for
        llama_mod.linear_for = lambda dt, dev, shapes=None: timed(
            "  of which dense layers (all)", linear_for(dt, dev, shapes))
        cpu_attention_for = cpu_backend.attention_for  # the C attention (float32, x86-64)

        def timed_cpu_attention(forward):
            fn = cpu_attention_for(forward)
            return None if fn is None else timed("  of which attention (both)", fn)

        cpu_backend.attention_for = timed_cpu_attention
    try:
        from specbatch.kernels import decode_cpu

        decode_cpu.DecodeLayers.__call__ = timed("  of which C decoder layers",
                                                 decode_cpu.DecodeLayers.__call__)
    except ImportError:
        pass

    spec = (SpecConfig(method="none") if args.method == "none"
            else SpecConfig(method=args.method, num_speculative_tokens=args.k,
                            draft_model=args.draft_model))
    engine = EngineConfig(max_batch_size=args.batch, dtype=args.dtype,
                          device="cpu").for_model(args.model)  # dtype auto: as specbatch run
    llm = LLM.from_config(args.model, spec, engine, echo=lambda line: None)
    records, errors = read_records(args.records,
                                   defaults=SamplingParams(max_tokens=args.max_tokens))
    assert not errors, errors
    records = records[:args.limit]
    from dataclasses import replace

    warm = [replace(r, sampling=replace(r.sampling, max_tokens=8)) for r in records[:2]]
    list(llm.generate_records(warm, seed=0))
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    tokens = sum(sum(len(t) for t in out["output_token_ids"]) if r.turns
                 else len(out["output_token_ids"])
                 for r, out in llm.generate_records(records, seed=0))
    wall = time.perf_counter() - t0
    fwd = spent["forward: decode/verify"] + spent["forward: prefill"]
    sampler = spent["sampler + acceptance"]
    rest = wall - fwd - spent["proposer (+ policy)"] - sampler
    rows = [(name, spent[name], calls[name]) for name in
            ("forward: prefill", "forward: decode/verify", "  of which C decoder layers",
             "  of which attention (both)", "  of which dense layers (all)",
             "  of which read planning",
             "proposer (+ policy)", "sampler + acceptance")]
    rows.append(("Python bookkeeping (the rest)", rest, 0))
    import os

    print(f"{args.method} k={args.k} batch {args.batch} {engine.dtype}, {len(records)} records, "
          f"{tokens} output tokens in {wall:.1f} s ({tokens / wall:.1f} tok/s), threads "
          f"{args.threads}, load average {os.getloadavg()[0]:.2f}")
    print("| stage | seconds | share | calls |\n|---|---|---|---|")
    for name, s, n in rows:
        print(f"| {name.strip()} | {s:.2f} | {100 * s / wall:.1f}% | {n or '-'} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
