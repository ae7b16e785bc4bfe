"""What the C decode/verify attention costs per step, by the tokens a row feeds.

    python benchmarks/attention_cpu.py [--context 600] [--tokens 1 2 6 11] [--rows 1]

Times ``kernels.attention_cpu.attention`` over the 30 layers of one SmolLM2-135M step (9 query
heads, 3 kv heads, head_dim 64, float16 KV cache as ``--dtype int8`` keeps it, random values):
``--rows`` cache rows, each feeding ``t`` tokens at positions ``context .. context + t - 1``;
median of 7 passes, milliseconds, and the arithmetic rate (4 * heads * head_dim * keys read
per token, over all layers). At batch 1 the growth from 1 token to k + 1 is what a verify step's
draft tokens cost in attention.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbatch.kernels import attention_cpu  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=600, help="cached tokens before the step")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 6, 11])
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    if not attention_cpu.available(HEAD_DIM):
        sys.exit("the C attention kernel is not available here (needs AVX2/FMA and a compiler)")
    cap = args.context + max(args.tokens) + 1
    gen = torch.Generator().manual_seed(0)
    ks = [torch.randn(args.rows, KV_HEADS, cap, HEAD_DIM, generator=gen).half()
          for _ in range(LAYERS)]
    vs = [torch.randn(args.rows, KV_HEADS, cap, HEAD_DIM, generator=gen).half()
          for _ in range(LAYERS)]
    print(f"{'tokens/row':>10} {'ms/step':>8} {'GFLOP/s':>8}")
    for t in args.tokens:
        rows = torch.tensor([r for r in range(args.rows) for _ in range(t)])
        pos = torch.tensor([args.context + i for _ in range(args.rows) for i in range(t)])
        q = torch.randn(len(rows), HEADS, HEAD_DIM, generator=gen)
        out = torch.empty_like(q)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for layer in range(LAYERS):
                attention_cpu.attention(q, ks[layer], vs[layer], rows, pos, out=out,
                                        validate=False)
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times)
        flops = 4 * HEADS * HEAD_DIM * int((pos + 1).sum()) * LAYERS
        print(f"{t:>10} {1e3 * ms:8.2f} {flops / ms / 1e9:8.1f}")


if __name__ == "__main__":
    main()
