"""What row-count-invariant dense layers cost against plain cuBLAS, per layer and per step.

    python benchmarks/gpu/dense_cost.py [--rows 1 16 64] [--dtype bfloat16] [--iters 50]
        [--vllm-cublas] [--probe]
    TRITON_INTERPRET=1 python benchmarks/gpu/dense_cost.py --device cpu   # smoke test, tiny shapes

Times ``F.linear`` (cuBLAS) and ``specbatch.kernels.matmul.linear`` (the invariant Triton
matmul) on the Llama-1.5B dense shapes (hidden 2048, 16 layers, 32 x 64 query heads, 8 x 64 kv
heads, intermediate 8192, vocab 49152): fused q/k/v 2048 -> 3072, o 2048 -> 2048, fused
gate/up 2048 -> 16384, down 8192 -> 2048, lm_head 2048 -> 49152; random weights. Per shape and
row count: the mean of ``--iters`` back-to-back calls between two CUDA events, best of 3
repeats, microseconds (``*_us``: eager, Python's launch cost included, as the engine runs them;
``*_graph_us``: the same calls replayed from a CUDA graph, the kernels' own time). ``step``
adds one step's eager matmuls (16 layers + lm_head). The goal (issue 33) is ``ratio`` =
triton / cublas <= 1.25 at 16 and 64 rows.

--vllm-cublas applies ``models.dense.apply_cublas_batch_invariant`` (vLLM's Hopper setting:
no split-K) before any matmul, so ``cublas`` is then the invariant cuBLAS (run the script twice
to get both). --probe adds ``probe_row_invariance`` of both matmuls on these shapes.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LAYERS = 16
SHAPES = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384),
          "down": (8192, 2048), "lm_head": (2048, 49152)}  # (in_features, out_features)
TINY = {"qkv": (64, 96), "o": (64, 64), "gate_up": (64, 256), "down": (128, 64),
        "lm_head": (64, 384)}  # --device cpu: the interpreter's speed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--vllm-cublas", action="store_true",
                    help="cuBLAS with vLLM's batch-invariant Hopper setting (no split-K)")
    ap.add_argument("--probe", action="store_true", help="add the row-invariance probe")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton sees a kernel
    if args.iters < 1 or min(args.rows) < 1:
        ap.error("--iters and --rows must be >= 1")

    import torch
    import torch.nn.functional as F

    from specbatch.models import dense
    if args.vllm_cublas:
        dense.apply_cublas_batch_invariant()
    from specbatch.kernels.matmul import config_for, linear

    if args.device == "cuda" and not torch.cuda.is_available():
        print("dense_cost: no CUDA device (use --device cpu for the smoke test)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    shapes = SHAPES if args.device == "cuda" else TINY
    iters = args.iters if args.device == "cuda" else min(args.iters, 2)
    gen = torch.Generator().manual_seed(0)

    def timed(fn) -> float:
        """Microseconds per call: mean of ``iters`` calls, best of 3 repeats."""
        fn()  # compile / warm up
        best = float("inf")
        for _ in range(3):
            if dev.type == "cuda":
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    fn()
                end.record()
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(end) * 1e3 / iters)
            else:
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                best = min(best, (time.perf_counter() - t0) * 1e6 / iters)
        return best

    def timed_graph(fn) -> float | None:
        """Microseconds per call with ``iters`` calls replayed from one CUDA graph (the GPU's
        time without Python's launch cost), best of 3; None where capture fails."""
        if dev.type != "cuda":
            return None
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(iters):
                    fn()
        except RuntimeError:
            return None
        return timed(graph.replay) / iters

    out = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "dtype": args.dtype, "rows": args.rows, "iters": iters,
           "cublas_setting": "vllm-hopper" if args.vllm_cublas else "default",
           "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1", "shapes": {}}
    step = {"cublas_us": {}, "triton_us": {}}
    for name, (k, n) in shapes.items():
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(dev)
        cfg = config_for(n, k, dtype)
        entry = {"in_features": k, "out_features": n, "config": cfg.__dict__,
                 "cublas_us": {}, "triton_us": {}, "ratio": {}, "max_abs_diff": {},
                 "cublas_graph_us": {}, "triton_graph_us": {}, "graph_ratio": {}}
        for m in args.rows:
            x = torch.randn(m, k, generator=gen).to(dtype).to(dev)
            c = timed(lambda: F.linear(x, w))
            t = timed(lambda: linear(x, w))
            diff = (F.linear(x, w).float() - linear(x, w).float()).abs().max().item()
            entry["cublas_us"][m], entry["triton_us"][m] = round(c, 2), round(t, 2)
            entry["ratio"][m] = round(t / c, 3)
            entry["max_abs_diff"][m] = diff
            cg, tg = timed_graph(lambda: F.linear(x, w)), timed_graph(lambda: linear(x, w))
            if cg is not None and tg is not None:
                entry["cublas_graph_us"][m] = round(cg, 2)
                entry["triton_graph_us"][m] = round(tg, 2)
                entry["graph_ratio"][m] = round(tg / cg, 3)
            times = 1 if name == "lm_head" else LAYERS
            step["cublas_us"][m] = step["cublas_us"].get(m, 0.0) + times * c
            step["triton_us"][m] = step["triton_us"].get(m, 0.0) + times * t
        out["shapes"][name] = entry
        del w
    out["step"] = {key: {m: round(v, 1) for m, v in val.items()} for key, val in step.items()}
    out["step"]["ratio"] = {m: round(step["triton_us"][m] / step["cublas_us"][m], 3)
                            for m in args.rows}
    if args.probe:
        rows = dense.PROBE_ROWS if dev.type == "cuda" else (1, 2, 6, 16)
        out["probe"] = {lname: dense.probe_row_invariance(fn, list(shapes.values()), dtype, dev,
                                                          rows=rows)
                        for lname, fn in (("cublas", F.linear), ("triton", linear))}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
