"""How the dense layers of one decode/verify step cost with the rows (tokens) they carry.

    python benchmarks/dense_rows.py [--rows 2 4 8 16 64] [--threads 2]

Times every dense matmul of one SmolLM2-135M step (30 layers of q/k/v, o, gate/up and down,
plus lm_head; float32, random weights of the model's shapes) at each row count, with the
kernel the engine uses for float32 on CPU (specbatch's own, ``kernels/linear_cpu.c``, where it
builds) on the weights' exact 4-bit / 8-bit codes (the weights are made exactly Q4_1, lm_head
Q8_0, as in the bundled GGUF model), on the same codes with 8-bit activations
(``--dtype int8``, ``kernels/csrc/linear_q8.c``) and on the same weights in float32, oneDNN's inner product on prepacked weights (the fall-back, ``models/dense.py``) and
``F.linear`` (MKL sgemm, not row-invariant) beside it; mean of the best 3 of 5 passes,
milliseconds, the three interleaved per row count. At batch 1 a verify step of n fed tokens runs these matmuls with n rows (at least
2), so the growth from 2 to 16 rows is what a draft token costs; a kernel bound by streaming the
weights would stay near the 2-row time up to ~16 rows.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbatch.kernels import linear_cpu  # noqa: E402
from specbatch.models import dense  # noqa: E402

# (in_features, out_features) of one SmolLM2-135M layer: fused q/k/v, o, fused gate/up, down
LAYER = ((576, 960), (576, 576), (576, 3072), (1536, 576))
NUM_LAYERS = 30
LM_HEAD = (576, 49152)


def exact_q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random ``[n, k]`` float32 weight quantised to Q4_1 and back, as GGUF's quantiser does
    (per 32: m = min, d = (max - min) / 15, both stored as float16; q = trunc((x - m) / d + 0.5))."""
    x = (torch.randn(n, k // 32, 32, generator=gen) / k ** 0.5)
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    d = (hi - lo) / 15
    q = ((x - lo) / d + 0.5).trunc().clamp(0, 15)
    return (d.half().float() * q + lo.half().float()).view(n, k)


def exact_q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A random ``[n, k]`` float32 weight quantised to Q8_0 and back (per 32: d = max |x| / 127
    as float16, q = round(x / d))."""
    x = (torch.randn(n, k // 32, 32, generator=gen) / k ** 0.5)
    d = x.abs().amax(-1, keepdim=True) / 127
    return (d.half().float() * ((x / d).round() + 0.0)).view(n, k)  # + 0.0: no -0.0, as int8 codes


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
    weights = [[exact_q4_1(n, k, gen) for k, n in LAYER] for _ in range(NUM_LAYERS)]
    lm_head = exact_q8_0(LM_HEAD[1], LM_HEAD[0], gen)
    kernels = {"kernel, codes": linear_cpu.linear if linear_cpu.available() else None,
               "kernel, float32": None, "oneDNN": dense._onednn_linear,
               "F.linear (MKL)": F.linear}
    if linear_cpu.available():  # the same values as separate tensors, packed as float32
        f32 = [[w.clone() for w in layer] for layer in weights], lm_head.clone()
        os.environ["SPECBATCH_CPU_WEIGHTS"] = "float32"
        for w in [w for layer in f32[0] for w in layer] + [f32[1]]:
            linear_cpu.packed(w)  # cached as float32 panels
        del os.environ["SPECBATCH_CPU_WEIGHTS"]
        kernels["kernel, float32"] = linear_cpu.linear
        x8 = [[w.clone() for w in layer] for layer in weights], lm_head.clone()
        for w in [w for layer in x8[0] for w in layer] + [x8[1]]:
            linear_cpu.use_int8_activations(w)  # cached in linear_q8.c's layout
        kernels["codes, int8 x"] = linear_cpu.linear
    sets = {name: f32 if name == "kernel, float32" else x8 if name == "codes, int8 x"
            else (weights, lm_head) for name in kernels}
    print(f"{'rows':>5}" + "".join(f" {name + ' ms':>20}" for name in kernels))
    for rows in args.rows:
        cells = [step_ms(rows, fn, *sets[name]) if fn is not None else float("nan")
                 for name, fn in kernels.items()]
        print(f"{rows:>5}" + "".join(f" {c:>20.1f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
