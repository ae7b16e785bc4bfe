"""Replay the suffix proposer's source choice over recorded greedy outputs, without the model.

    PYTHONPATH=. python benchmarks/suffix_replay.py OUT.jsonl [--token-cost 0.055 0.28]

At temperature 0 the target's output is fixed, and a proposer's draft is a function of the
committed tokens (and, for suffix, of the answers finished before), so the acceptance of any
drafting rule can be replayed exactly from a run's output file (any method; the outputs are the
same), one row at a time, the records finishing in file order (as at batch 1). For each rule it
prints the tokens committed per verify step and a relative throughput: output tokens per unit of
step cost, where a step costs ``1 + token_cost * draft tokens`` (``--token-cost``: one fed draft
token as a share of a step. Batch 1 on the 2-core VM: ~0.055, the calibration's 2.6 ms per token
over a 47 ms step; a full batch-16 step: ~0.28 of a row's share). Rules:

    ngram k3, ngram k5    prompt lookup, k = 3 or 5, prompt_lookup_min/max 2/4 (``NgramProposer``)
    suffix (paper)        own text vs job index by the sum of path probabilities, factor 1
    suffix (1 row)        ``SuffixProposer`` as shipped, in steps of 1 row
    suffix (16 rows)      ``SuffixProposer`` as ``--method suffix`` builds it at k 5, in steps
                          of 16 rows (cut at k and path probability 0.7)

``--step-ms T0 T1 ...`` (with ``--prefill-ms P``) models batch 1 on a measured machine instead:
a verify step with d draft tokens costs ``T_d`` ms (the last entry for longer drafts; e.g. the
runner's verify at d = 0..15 plus the commit's per-position cost, as in docs/benchmarks.md) and
each record ``P`` ms of prefill. It prints each rule's modeled tok/s and its ratio to ngram k5,
and two bounds for the best suffix rule: drafts free (every step costs ``T_0``) and no prefill.

The output file's ``OUT.config.json`` names the model (its tokenizer re-renders the prompts, as
``analyze --what-if`` does). Records ending in ``error`` and ``turns`` records' later turns are
left out.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specbatch.analyze.load import answers, load_run  # noqa: E402
from specbatch.commands.analyze import load_tokenizer  # noqa: E402
from specbatch.analyze.whatif import prompt_ids_per_answer  # noqa: E402
from specbatch.config import SamplingParams  # noqa: E402
from specbatch.engine.sequence import Request, Sequence  # noqa: E402
from specbatch.prompts import PromptRenderer  # noqa: E402
from specbatch.spec_decode import suffix  # noqa: E402
from specbatch.spec_decode.ngram import NgramProposer  # noqa: E402

CAP = 15  # the suffix cap at k 5: min(32, 3k)


class PaperChoice(suffix.SuffixProposer):
    """SuffixDecoding's choice: the higher sum of path probabilities wins (ties: own text), the
    own-text factor 1 whatever the step's rows."""

    def draft(self, seq, cap, num_rows=1):
        own = self.rows[seq.seq_id].draft(cap, self.min_token_prob, self.max_spec_factor)
        sam = self.index.sam
        if not sam.num_tokens:
            return own
        state, n = sam.match(seq.token_ids[-self.max_match:])
        job = suffix.draft_from(sam, state, n, cap, "job", self.min_token_prob,
                                self.max_spec_factor)
        return job if sum(job.probs) > sum(own.probs) else own


def load(path: str) -> list[tuple[list[int], list[int]]]:
    run = load_run(path)
    if run.config is None:
        sys.exit(f"{path}: no OUT.config.json beside it (it names the model)")
    renderer = PromptRenderer(load_tokenizer(run.config["model"]))
    out = []
    for rec in run.records:
        if answers(rec.fields, "finish_reason")[0] == "error":
            continue
        ids = answers(rec.fields, "output_token_ids")[0]
        if ids:
            out.append((prompt_ids_per_answer(rec, renderer)[0], list(ids)))
    return out


def replay(data, proposer, cap: int, num_rows: int, step_cost: Callable[[int], float],
           record_cost: float = 1.0) -> tuple[float, float]:
    """(tokens per verify step, output tokens per unit of cost) over ``data``: a verify step
    with d draft tokens costs ``step_cost(d)``, a record's prefill ``record_cost``."""
    steps = tokens = 0
    cost = 0.0
    fillers = []  # idle rows, so that ``propose`` sees a step of num_rows rows
    for i in range(num_rows - 1):
        f = Sequence(Request(-1 - i, [1, 2, 3], SamplingParams()), "suffix", cap)
        proposer.start(f)
        fillers.append(f)
    for n_rec, (prompt, out) in enumerate(data):
        seq = Sequence(Request(n_rec, list(prompt), SamplingParams()), "suffix", cap)
        seq.token_ids.append(out[0])  # prefill emits the first token
        proposer.start(seq)
        n, steps, cost = 1, steps + 1, cost + record_cost
        while n < len(out):
            draft = proposer.propose([seq, *fillers], [cap] * num_rows)[0][:cap]
            a = 0
            while a < len(draft) and n + a < len(out) and draft[a] == out[n + a]:
                a += 1
            e = min(a + 1, len(out) - n)
            seq.token_ids.extend(out[n:n + e])
            n += e
            proposer.on_commit(seq, e)
            steps += 1
            cost += step_cost(len(draft))
        seq.finish_reason = "stop"
        proposer.finish(seq)
        tokens += len(out)
    return tokens / steps, tokens / cost


def linear_cost(token_cost: float) -> Callable[[int], float]:
    """A step of d draft tokens costs ``1 + token_cost * d`` steps."""
    return lambda d: 1.0 + token_cost * d


def modeled(data, rules, step_ms: list[float], prefill_ms: float) -> None:
    """Batch-1 tok/s of each rule with measured step times (``--step-ms``), ratios to ngram k5,
    and the bounds of the best suffix rule with free drafts and without prefill."""
    def ms(d: int) -> float:
        return step_ms[min(d, len(step_ms) - 1)]

    def tok_s(make, cap, cost, prefill):
        return 1000.0 * replay(data, make(), cap, 1, cost, prefill)[1]

    base = tok_s(rules[1][1], rules[1][2], ms, prefill_ms)
    print(f"{'rule (batch 1)':18} {'tok/s':>8} {'/ ngram k5':>10}")
    best = None
    for name, make, cap, _ in rules[:-1]:
        r = tok_s(make, cap, ms, prefill_ms)
        print(f"{name:18} {r:8.1f} {r / base:10.3f}")
        if name.startswith("suffix") and (best is None or r > best[0]):
            best = (r, name, make, cap)
    _, name, make, cap = best
    free = tok_s(make, cap, lambda d: ms(0), prefill_ms) / tok_s(
        rules[1][1], rules[1][2], lambda d: ms(0), prefill_ms)
    bare = tok_s(make, cap, ms, 0.0) / tok_s(rules[1][1], rules[1][2], ms, 0.0)
    print(f"bounds of {name}: drafts free {free:.3f}x, no prefill {bare:.3f}x ngram k5")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", help="a run's OUT.jsonl (greedy)")
    ap.add_argument("--token-cost", type=float, nargs="+", default=[0.055, 0.28])
    ap.add_argument("--step-ms", type=float, nargs="+",
                    help="batch-1 verify step time (ms) by draft tokens 0, 1, ...")
    ap.add_argument("--prefill-ms", type=float, default=0.0, help="prefill per record (ms)")
    args = ap.parse_args()
    data = load(args.output)
    print(f"{len(data)} answers, {sum(len(o) for _, o in data)} output tokens")
    rules = [("ngram k3", lambda: NgramProposer(2, 4), 3, 1),
             ("ngram k5", lambda: NgramProposer(2, 4), 5, 1),
             ("suffix (paper)", PaperChoice, CAP, 1),
             ("suffix (1 row)", suffix.SuffixProposer, CAP, 1),
             ("suffix (16 rows)", lambda: suffix.SuffixProposer(many_rows_cap=5), CAP, 16)]
    if args.step_ms:
        modeled(data, rules, args.step_ms, args.prefill_ms)
        return
    head = " ".join(f"{'tok/cost @' + str(c):>14}" for c in args.token_cost)
    print(f"{'rule':18} {'tok/step':>8} {head}")
    for name, make, cap, rows in rules:
        res = [replay(data, make(), cap, rows, linear_cost(c)) for c in args.token_cost]
        print(f"{name:18} {res[0][0]:8.3f} " + " ".join(f"{r[1]:14.3f}" for r in res))


if __name__ == "__main__":
    main()
