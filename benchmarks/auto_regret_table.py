"""The table of ``benchmarks/auto_regret.sh``: per regime, each arm's output tok/s pooled over
the rounds (tokens / seconds), auto over the best static arm, and the round-to-round spread of
auto and of prompt lookup: (max - min) / mean of the per-round tok/s and, in brackets, of the
per-round ratio to none (a round's arms run minutes apart, so the VM's state is mostly common
to them). Per-round auto / best static ratios go to stderr.

    python benchmarks/auto_regret_table.py /tmp/regret
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PER_ROUND = re.compile(r"^(\S+)\s+tok/s per round \(all categories\): ([\d., ]+);", re.M)


def spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / (sum(xs) / len(xs))


def peer_regimes(path: Path) -> list[tuple[str, dict]]:
    """(regime, {arm: (pooled tok/s, per-round tok/s)}) of the peer harness's results JSON."""
    results = json.loads(path.read_text())["results"]
    out = []
    for dtype in ("int8", "float32"):
        for batch in (16, 1):
            arms = {}
            for method in ("none", "ngram", "auto"):
                rs = results[f"specbatch:{method}:{batch}:{dtype}"]
                pooled = sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs)
                arms["ngram:k=5" if method == "ngram" else method] = (
                    pooled, [r["tokens"] / r["seconds"] for r in rs])
            out.append((f"16 peer records, batch {batch}, {dtype}", arms))
    return out


def bench_arms(path: Path) -> dict:
    """{config: (pooled tok/s, per-round tok/s)} of a ``specbatch bench`` log: the table's
    last row (all categories, or the one category) and the per-round lines under it."""
    lines = path.read_text().splitlines()
    head = [ln for ln in lines if ln.startswith("| category")][-1]
    row = [ln for ln in lines
           if ln.startswith("| ") and not ln.startswith(("| category", "|---"))][-1]
    cols = [c.strip() for c in head.strip("|").split("|")]
    vals = [c.strip() for c in row.strip("|").split("|")]
    pooled = {c[:-len(" tok/s")]: float(v) for c, v in zip(cols, vals) if c.endswith(" tok/s")}
    per = {m[1]: [float(x) for x in m[2].split(",")] for m in PER_ROUND.finditer("\n".join(lines))}
    return {k: (pooled[k], per[k]) for k in pooled}


def main() -> None:
    w = Path(sys.argv[1])
    regimes = peer_regimes(w / "peer16.json")
    regimes.append(("130 Spec-Bench records, batch 16, int8", bench_arms(w / "b130.log")))
    for b in (1, 16):
        regimes.append((f"extraction recipe, 48 records, batch {b}, int8",
                        bench_arms(w / f"ext{b}.log")))
    print("| regime | none | ngram | suffix | auto | auto / best static "
          "| auto spread (per-round ratio) | ngram spread (per-round ratio) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, arms in regimes:
        none = arms["none"][1]
        static = {k: v for k, v in arms.items() if k != "auto"}
        best = max(static, key=lambda k: static[k][0])
        auto = arms["auto"]

        def sp(arm):
            ratio = [x / y for x, y in zip(arm[1], none)]
            return f"{100 * spread(arm[1]):.1f}% ({100 * spread(ratio):.1f}%)"

        def cell(k):
            if k not in arms:
                return "-"
            text = f"{arms[k][0]:.1f}"
            return f"**{text}**" if k == best else text

        ngrams = [k for k in arms if k.startswith("ngram")]
        ng = " / ".join(f"{cell(k)} (k{k.split('=')[1]})" for k in ngrams)
        ng_spread = " / ".join((f"k{k.split('=')[1]}: " if len(ngrams) > 1 else "") + sp(arms[k])
                               for k in ngrams)
        print(f"| {name} | {cell('none')} | {ng} | {cell('suffix')} | {auto[0]:.1f} | "
              f"{auto[0] / static[best][0]:.3f}x | {sp(auto)} | {ng_spread} |")
        print(f"{name}: auto / {best} per round "
              + ", ".join(f"{a / b:.3f}" for a, b in zip(auto[1], static[best][1])),
              file=sys.stderr)


if __name__ == "__main__":
    main()
