"""What a packed verify step costs by how its draft tokens are spread over the rows, against
the step-cost fit auto prices it with (docs/benchmarks.md, Zen 2).

    python benchmarks/packed_layout.py --dtype int8 [--model smollm2-135m] [--rows 16]
        [--context 300] [--rounds 3] [--repeats 7]

Times one forward (``LlamaForward.forward``, what calibration's ``measure`` times) of ``--rows``
rows at ``--context`` keys for each layout below, the median of ``--repeats`` timings after 2
untimed ones, ``--rounds`` rounds of all layouts in turn, and prints per layout its real tokens,
its drafting rows (rows that feed more than one token), its median over rounds (ms) and the
cached fit's price of it (``CostModel.step_time`` at its rows, longest row, real tokens and
drafting rows: what auto's policy asks; the fit is calibrated first where there is none,
~20 s). Fits before calibration version 7 knew the tokens and the longest row, not how many
rows draft, and priced 8 rows drafting a token each 3-5% low (2-core Zen 2).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def layouts(rows: int) -> dict[str, list[int]]:
    """Tokens fed per row: plain, then 1, 5 and 8 draft tokens on one row against the same
    count spread over several rows."""
    def fed(*drafts: int) -> list[int]:
        return [1 + d for d in drafts] + [1] * (rows - len(drafts))

    return {"plain": fed(), "1 row +1": fed(1), "1 row +5": fed(5), "5 rows +1": fed(*[1] * 5),
            "1 row +8": fed(8), "4 rows +2": fed(*[2] * 4), "8 rows +1": fed(*[1] * 8)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="a model name or path, as run's")
    ap.add_argument("--dtype", default="int8", help="as run's --dtype (default int8)")
    ap.add_argument("--rows", type=int, default=16, help="rows of the step (16; at least 8)")
    ap.add_argument("--context", type=int, default=300, help="keys per row (300)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all layouts (3)")
    ap.add_argument("--repeats", type=int, default=7, help="timings per layout and round (7)")
    args = ap.parse_args()
    if args.rows < 8:
        raise SystemExit("error: --rows: at least 8 (a layout drafts on 8 rows)")

    import torch

    from specbatch.config import EngineConfig, SpecConfig
    from specbatch.llm import LLM
    from specbatch.models.llama import LlamaForward

    engine = EngineConfig(dtype=args.dtype, device="cpu").for_model(args.model, None)
    llm = LLM.from_config(args.model, SpecConfig(method="none"), engine, echo=lambda _l: None)
    forward = LlamaForward(llm.loaded.model)
    with torch.no_grad():
        fit = llm.calibrate(forward=forward)[0]
    cache = forward.new_cache(args.rows, args.context + 16)
    gen = torch.Generator().manual_seed(0)

    def timed(fed: list[int]) -> float:
        q = max(fed)
        for r in range(args.rows):
            cache.seq_lens[r] = args.context
        ids = torch.randint(0, forward.vocab_size, (args.rows, q), generator=gen)
        pos = (args.context + torch.arange(q))[None, :].expand(args.rows, -1)
        num_fed = torch.tensor(fed) if min(fed) < q else None
        times = []
        for i in range(args.repeats + 2):
            t0 = time.perf_counter()
            forward.forward(ids, pos, cache, torch.arange(args.rows), num_fed=num_fed)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    shapes = layouts(args.rows)
    got: dict[str, list[float]] = {name: [] for name in shapes}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, fed in shapes.items():
                got[name].append(timed(fed))
    print(f"{args.model} {engine.dtype}, {args.rows} rows at {args.context} keys, "
          f"{args.rounds} rounds, load average {os.getloadavg()[0]:.1f}; fit: {fit.describe()}")
    print(f"{'layout':<11}{'tokens':>7}{'drafting rows':>14}{'ms':>8}{'fit ms':>8}{'/ fit':>7}")
    for name, fed in shapes.items():
        ms = statistics.median(got[name])
        priced = fit.step_time(args.rows, max(fed), args.context, num_tokens=sum(fed),
                               drafting_rows=sum(f > 1 for f in fed)) * 1e3
        print(f"{name:<11}{sum(fed):>7}{sum(f > 1 for f in fed):>14}{ms:>8.1f}{priced:>8.1f}"
              f"{ms / priced:>7.2f}")


if __name__ == "__main__":
    main()
