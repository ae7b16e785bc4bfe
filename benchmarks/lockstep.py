"""Arms in lockstep: their engine steps interleaved by output progress, in one process, timed.

    python benchmarks/lockstep.py benchmarks/peers/records16.jsonl --batch 16 --dtype int8 \
        --arms none,ngram,suffix,auto [--rounds 3] [--max-tokens 128] [--limit N]
        [--template T --json-schema SCHEMA.json]

``specbatch bench`` interleaves whole runs of each arm; on a shared VM whose speed drifts by
10-40% over seconds to minutes (2-core EPYC, docs/benchmarks.md "noise floor"), two arms a
few percent apart then trade places from run to run. Here every arm's job runs at once, as a
greenlet (one OS thread: one OpenMP team, no thread waits while another arm runs), and they
take turns by ``Engine.step`` (admission and prefill, the proposer, the verify forward, the
commit): the next step is always the arm's that has committed the fewest output tokens so far
(ties: the tied arm that has gone first of equals the fewest times this round, then the round's
order, so arms tied step for step, as none and an auto that drafts nothing, take the first
place in turn). Every arm gives the same tokens, so the arms move through the same job side by
side, and each stretch of the job meets the same machine in every arm whatever its steps per
token. An arm's time is the sum of its own steps (wall seconds, ``time.perf_counter``);
outside the steps (building each job, writing output fields) nothing is timed. The arms' order
changes from round to round as in ``bench`` (``run_order``); an untimed job of two records runs
first (the first forward of a process packs the weights for the C kernels).

Printed: per arm its output tokens, engine steps, seconds building its job and between its
steps (untimed), step seconds, the part of them in the proposer's hooks (``prop s``: drafting,
and auto's weighing and learning; host time), tok/s per round and pooled (tokens / step
seconds over all rounds), their spread ((max - min) / mean of the rounds' tok/s, as ``bench``
prints it), and the ratio to the first arm pooled and per round; whether every
arm's token ids equal the first arm's; for an auto arm, its ratio to the best static arm, and
that ratio with both arms' proposer seconds taken out (what its decisions alone would give:
above the ratio by what auto's host time costs). An A/A check (``--arms none,none:k=1``, plain
decoding twice) gives the floor of this measurement.

What differs from a run alone: the arms share the CPU caches step by step (each arm's step
starts where another arm's step left the caches; the weights are shared), and every arm's
KV cache is allocated at once. Needs ``greenlet`` (``pip install greenlet``; not a
dependency of specbatch).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from auto_decisions import job_args, load_job, warm_up  # noqa: E402
from peers.run import round_order  # noqa: E402


# the engine's calls into its proposer (``spec_decode.proposer.Proposer``)
PROPOSER_HOOKS = ("start", "propose", "on_verify", "on_commit", "finish")


def lockstep(llm, records, specs: dict, order: list[str]) -> dict:
    """One round: every arm's job, stepped in turns (the arm with the fewest output tokens
    committed next; of tied arms, the one first of equals the fewest times so far, then
    ``order``) until all finish. Of two arms tied step for step beside a third, the first of
    each tie always stepped right after the third arm and the second right after its twin
    when ties went by ``order`` alone; an A/A check with that rule (none, none:k=1, ngram:k=5;
    16 peer records, batch 16, int8, 4 rounds, Zen 2) read none:k=1 at 1.001-1.004x of none
    (pooled 1.002x), and 1.000-1.002x (1.001x) with this one.
    Returns arm -> {"seconds": its steps' wall seconds, "steps": engine steps, "proposer":
    seconds of them in the proposer's hooks (``PROPOSER_HOOKS``), "prepare": seconds building
    its job (``LLM.prepare``, before the steps), "between": seconds of its job between its
    steps (output fields), "tokens": output tokens, "ids": record index -> output token ids}."""
    from greenlet import greenlet, getcurrent

    from specbatch.engine.engine import Engine

    clock: dict = {}
    committed: dict = {}  # greenlet -> its engine's output tokens so far
    hooks: dict = {}  # greenlet -> seconds in its proposer's hooks
    step0 = Engine.step

    def timed(hook):
        def call(*a, **kw):
            t0 = time.perf_counter()
            try:
                return hook(*a, **kw)
            finally:
                me = getcurrent()
                hooks[me] = hooks.get(me, 0.0) + time.perf_counter() - t0
        return call

    def step(self):
        me = getcurrent()
        if me not in clock:  # the arm's first step: time its proposer's hooks
            for name in PROPOSER_HOOKS:
                setattr(self.proposer, name, timed(getattr(self.proposer, name)))
        t0 = time.perf_counter()
        done = step0(self)
        seconds, steps = clock.get(me, (0.0, 0))
        clock[me] = (seconds + time.perf_counter() - t0, steps + 1)
        committed[me] = self.num_output_tokens
        me.parent.switch()  # the next arm's turn
        return done

    results: dict = {}

    def job(arm, prepared):
        results[arm] = {rec.index: f for rec, f in prepared.run(seed=0)}

    lets, prep = {}, {}
    for arm in order:
        t0 = time.perf_counter()
        prepared = llm.prepare(records, specs[arm], echo=lambda _l: None)
        prep[arm] = time.perf_counter() - t0
        lets[arm] = greenlet(lambda a=arm, p=prepared: job(a, p))
    active = dict.fromkeys(order, 0.0)
    firsts = dict.fromkeys(order, 0)  # times each arm went first of tied arms
    Engine.step = step
    try:
        while live := [a for a in order if not lets[a].dead]:
            least = min(committed.get(lets[a], 0) for a in live)
            tied = [a for a in live if committed.get(lets[a], 0) == least]
            arm = min(tied, key=lambda a: firsts[a])  # then the round's order
            if len(tied) > 1:
                firsts[arm] += 1
            t0 = time.perf_counter()
            lets[arm].switch()
            active[arm] += time.perf_counter() - t0
    finally:
        Engine.step = step0
    out = {}
    for arm, g in lets.items():
        seconds, steps = clock.get(g, (0.0, 0))
        fields = results[arm]
        out[arm] = {"seconds": seconds, "steps": steps, "proposer": hooks.get(g, 0.0),
                    "prepare": prep[arm],
                    "between": active[arm] - seconds,
                    "tokens": sum(f["usage"]["completion_tokens"] for f in fields.values()),
                    "ids": {i: f["output_token_ids"] for i, f in fields.items()}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    job_args(ap)
    ap.add_argument("--arms", default="none,ngram:k=5,suffix,auto",
                    help="as specbatch bench --configs (the first is the ratios' base)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit(f"error: --rounds {args.rounds}: at least 1")
    try:
        import greenlet  # noqa: F401
    except ImportError:
        raise SystemExit("error: lockstep.py needs greenlet: pip install greenlet") from None
    import torch

    torch.set_num_threads(2)
    from specbatch import LLM
    from specbatch.commands.bench import parse_configs, spread
    from specbatch.config import ConfigError, SpecConfig

    try:
        specs = dict(parse_configs(args.arms))
    except (ValueError, ConfigError) as e:
        if "--draft-model" in str(e):  # bench's advice; lockstep loads no draft model
            e = "lockstep.py runs no draft model (draft arms: specbatch bench --draft-model)"
        raise SystemExit(f"error: --arms {args.arms}: {e}") from None
    records, engine = load_job(args)
    arms = list(specs)
    llm = LLM.from_config(None, SpecConfig(method="none"), engine, echo=lambda _l: None)
    llm.calibrate(echo=lambda _l: None)
    warm_up(llm, records)
    rounds = []
    for rnd in range(args.rounds):
        rounds.append(lockstep(llm, records, specs, round_order(arms, rnd)))
        print(f"round {rnd + 1}: " + ", ".join(
            f"{a} {r['tokens'] / r['seconds']:.1f} tok/s" for a, r in rounds[-1].items()),
            f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
    first = arms[0]

    def rate(arm, rs, less_proposer=False):
        return sum(r[arm]["tokens"] for r in rs) / sum(
            r[arm]["seconds"] - less_proposer * r[arm]["proposer"] for r in rs)

    print(f"{len(records)} records, batch {args.batch}, dtype {args.dtype}, max_tokens "
          f"{args.max_tokens}, {args.rounds} rounds in lockstep; ratios to {first}")
    print(f"{'arm':<12}{'tokens':>7}{'steps':>7}{'prep s':>7}{'betw s':>7}{'step s':>8}"
          f"{'prop s':>7}{'tok/s':>8}{'ratio':>7}{'spread':>7}  per round (ratio)  same ids")
    for arm in arms:
        per = [rate(arm, [r]) for r in rounds]
        var = spread(per)
        ratios = [p / rate(first, [r]) for p, r in zip(per, rounds)]
        same = all(r[arm]["ids"] == r[first]["ids"] for r in rounds)
        mean = {k: sum(r[arm][k] for r in rounds) / len(rounds)
                for k in ("prepare", "between", "seconds", "proposer")}
        if len({r[arm]["steps"] for r in rounds}) > 1:  # auto decides alike in every round
            print(f"{arm}: steps per round " + " ".join(str(r[arm]["steps"]) for r in rounds))
        print(f"{arm:<12}{rounds[0][arm]['tokens']:>7}{rounds[0][arm]['steps']:>7}"
              f"{mean['prepare']:>7.2f}{mean['between']:>7.2f}{mean['seconds']:>8.2f}"
              f"{mean['proposer']:>7.2f}{rate(arm, rounds):>8.1f}"
              f"{rate(arm, rounds) / rate(first, rounds):>7.3f}"
              + (f"{var:>7.1%}" if var is not None else f"{'-':>7}") + "  "
              + " ".join(f"{p:.1f} ({x:.3f})" for p, x in zip(per, ratios)) + f"  {same}")
    statics = [a for a in arms if a.split(":")[0] != "auto"]
    for arm in (a for a in arms if a.split(":")[0] == "auto" and statics):
        best = max(statics, key=lambda a: rate(a, rounds))
        print(f"{arm} / best static arm ({best}): {rate(arm, rounds) / rate(best, rounds):.3f}"
              " pooled; per round " + " ".join(
                  f"{rate(arm, [r]) / rate(best, [r]):.3f}" for r in rounds))
        print(f"{arm} / {best} less both arms' proposer seconds (decisions alone): "
              f"{rate(arm, rounds, True) / rate(best, rounds, True):.3f} pooled")


if __name__ == "__main__":
    main()
