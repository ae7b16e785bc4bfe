"""How the dense layers of one decode/verify step cost with the rows (tokens) they carry.

    python benchmarks/dense_rows.py [--rows 2 4 8 16 64] [--threads 2]

Times every dense matmul of one SmolLM2-135M step (30 layers of q/k/v, o, gate/up and down,
plus lm_head; float32, random weights of the model's shapes) at each row count, with the
kernel the engine uses for float32 on CPU (specbatch's own, ``kernels/linear_cpu.c``, where it
builds), oneDNN's inner product on prepacked weights (the fall-back, ``models/dense.py``) and
``F.linear`` (MKL sgemm, not row-invariant) beside it; mean of the best 3 of 5 passes,
milliseconds, the three interleaved per row count. At batch 1 a verify step of n fed tokens runs these matmuls with n rows (at least
2), so the growth from 2 to 16 rows is what a draft token costs; a kernel bound by streaming the
weights would stay near the 2-row time up to ~16 rows.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernels import linear_cpu  # noqa: E402
from specbatch.models import dense  # noqa: E402

# (in_features, out_features) of one SmolLM2-135M layer: fused q/k/v, o, fused gate/up, down
LAYER = ((576, 960), (576, 576), (576, 3072), (1536, 576))
NUM_LAYERS = 30
LM_HEAD = (576, 49152)


def step_ms(rows: int, linear, weights, lm_head) -> float:
    """Best-3-of-5 mean milliseconds of all dense matmuls of one step at ``rows`` rows."""
    gen = torch.Generator().manual_seed(0)
    xs = {k: torch.randn(rows, k, generator=gen) for k, _ in LAYER}

    def once():
        for layer in weights:
            for (k, _), w in zip(LAYER, layer):
                linear(xs[k], w)
        linear(xs[LM_HEAD[0]], lm_head)

    once()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    times.sort()
    return sum(times[:3]) / 3 * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(1)
    weights = [[torch.randn(n, k, generator=gen) / k ** 0.5 for k, n in LAYER]
               for _ in range(NUM_LAYERS)]
    lm_head = torch.randn(LM_HEAD[1], LM_HEAD[0], generator=gen) / LM_HEAD[0] ** 0.5
    kernels = {"specbatch kernel": linear_cpu.linear if linear_cpu.available() else None,
               "oneDNN": dense._onednn_linear, "F.linear (MKL)": F.linear}
    print(f"{'rows':>5}" + "".join(f" {name + ' ms':>20}" for name in kernels))
    for rows in args.rows:
        cells = [step_ms(rows, fn, weights, lm_head) if fn is not None else float("nan")
                 for fn in kernels.values()]
        print(f"{rows:>5}" + "".join(f" {c:>20.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
