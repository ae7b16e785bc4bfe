"""How close each arm's greedy outputs are to a reference arm's (by default specbatch's float32
``none``: the GGUF's exact weights in float32), from a ``run.py`` results file.

    python benchmarks/peers/agreement.py /work/peer-run/results-s10.json [--reference ARM]

Per arm: outputs identical to the reference, and the mean common prefix in tokens (the first
position where the two greedy outputs part; after it they are different texts, so a later
token-by-token comparison says nothing). bfloat16 (vLLM), 8-bit activations (specbatch int8,
llama.cpp's Q4_1 kernels) and float32 all round differently, and a greedy choice between two
near-equal logits then goes either way: this measures how soon that happens, not which text is
better. Standard library only.
"""

from __future__ import annotations

import argparse
import json


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--reference", default=None,
                    help="arm key (default: the first specbatch float32 none arm)")
    args = ap.parse_args()
    outputs = json.load(open(args.results))["outputs"]
    ref = args.reference or next(
        (k for k in outputs if k.startswith("specbatch:none:") and k.endswith(":float32")), None)
    if ref is None or ref not in outputs:
        raise SystemExit(f"no reference arm {ref!r}; arms: {', '.join(outputs)}")
    base = outputs[ref]
    print(f"reference {ref}: {len(base)} outputs, mean {sum(map(len, base)) / len(base):.1f} "
          "tokens")
    print("| arm | identical to reference | mean common prefix (tokens) | mean length |")
    print("|---|---|---|---|")
    for arm, outs in outputs.items():
        if arm == ref or len(outs) != len(base):
            continue
        same = sum(a == b for a, b in zip(outs, base))
        prefix = sum(common_prefix(a, b) for a, b in zip(outs, base)) / len(base)
        print(f"| {arm} | {same}/{len(base)} | {prefix:.1f} | "
              f"{sum(map(len, outs)) / len(outs):.1f} |")


if __name__ == "__main__":
    main()
