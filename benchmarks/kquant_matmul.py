"""One K-quant / Q5_0 / Q5_1 matmul, int8 codes vs the float32 weights it dequantises to
(``--dtype int8`` vs ``float32`` on a Q4_K_M GGUF).

    python benchmarks/kquant_matmul.py [--shape 2048 8192] [--rows 1 16] [--threads 2] \
        [--kinds Q4_K Q6_K Q5_0]

A random ``[N, K]`` weight quantised to each kind (Q4_K / Q6_K: the test quantiser of
``tests/unit/test_linear_kquant.py``; Q5_0 / Q5_1: ``gguf.quants.quantize``) and written to a temporary GGUF; the float32 path runs the
``gguf`` package's dequantisation on specbatch's float32 kernel (``linear_cpu``, float32 panels:
K-quant floats have no Q4_1 / Q8_0 codes), the int8 path the same weight's codes from the GGUF
(``kernels/kquant.py``, ``csrc/linear_q8.c``, the kernel ``int8_kernel()`` picks). Milliseconds
per matmul, the best of 3 passes of 24 calls, the two paths interleaved; the calls cycle through
``--copies`` copies of the weight so that, as in a model's step, the weights come from memory
and not from the last-level cache.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbatch.kernels import kquant, linear_cpu  # noqa: E402
from tests.unit.test_linear_kquant import _dequantized, quantize_k, write_gguf  # noqa: E402


def timed(fn, weights: list, calls: int = 24, passes: int = 3) -> float:
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        for i in range(calls):
            fn(weights[i % len(weights)])
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=2, default=(2048, 8192), metavar=("N", "K"))
    parser.add_argument("--rows", type=int, nargs="+", default=(1, 16))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--copies", type=int, default=6)
    parser.add_argument("--kinds", nargs="+", default=("Q4_K", "Q6_K"),
                        choices=("Q4_K", "Q6_K", "Q5_0", "Q5_1"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n, k = args.shape
    w = (np.random.default_rng(0).standard_normal((n, k)) / k ** 0.5).astype(np.float32)
    print(f"[{n}, {k}] weight, {args.threads} threads, int8 kernel {linear_cpu.int8_kernel()}")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            if kind.endswith("_K"):
                raw = quantize_k(kind, w)
            else:
                import gguf

                raw = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind))
            path = Path(tmp) / f"{kind}.gguf"
            write_gguf(path, {"w": (kind, raw)})
            source = kquant.GGUFCodes(path)
            floats = _dequantized(kind, raw)
            w32 = [floats.clone() for _ in range(args.copies)]
            w8 = [floats.clone() for _ in range(args.copies)]
            for a, b in zip(w32, w8):
                linear_cpu.use_int8_activations(b, source)
                assert linear_cpu.packed(a)[0] == 0 and linear_cpu.packed(b)[0] != 0
            for m in args.rows:
                x = torch.randn(m, k)
                f32, i8 = [], []
                for _ in range(2):
                    f32.append(timed(lambda w: linear_cpu.linear(x, w), w32))
                    i8.append(timed(lambda w: linear_cpu.linear(x, w), w8))
                a, b = min(f32), min(i8)
                print(f"{kind} rows {m:3d}: float32 {a:7.2f} ms  int8 {b:7.2f} ms  "
                      f"float32 / int8 {a / b:5.2f}x")


if __name__ == "__main__":
    main()
