"""Lookup cost of the suffix proposer with a large job-wide index, against a batch-16 step.

    PYTHONPATH=. python benchmarks/suffix_lookup.py [--records 10000] [--rounds 5] [--dtype auto]

1. Builds a ``SuffixIndex`` over ``--records`` synthetic finished outputs of the templated
   extraction job (recipes/json_extraction.toml): JSON objects with the recipe's keys whose
   values are phrases cut from the Spec-Bench articles of recipes/prompts/json_extraction.jsonl,
   tokenised with SmolLM2's tokenizer (~70 tokens each). Reports build time per token, states
   per token and approximate bytes per token (``SuffixAutomaton.nbytes``), and, on the first
   1,000 records, the node count a depth-24 suffix trie (SuffixDecoding's tree without path
   compression) would need for the same tokens.
2. 16 rows: an extraction prompt (article + instruction) plus a partial JSON answer each,
   ``start``ed in a ``SuffixProposer`` over that index.
3. Interleaved, ``--rounds`` + 1 times: one batch-16 decode step of SmolLM2-135M (``--dtype``,
   the rows' prompts prefilled, timed ``ModelRunner.verify`` with no drafts: the cheapest step,
   so the ratio is an upper bound; it also pushes the index out of the CPU caches, as in a
   run) and one ``propose`` call for the 16 rows at the suffix cap (15), after which each row
   commits its first draft token; in the last ``--rounds`` rounds one more synthetic answer
   joins the index before the call (a record finished: every row's match is walked again).
   Prints the step's median, the first propose call's time (rows just started: a full walk
   of each row's tail), the median of the calls after a commit (each row's match advanced by
   its new token) and of those after a join, their ratios to the step and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("title", "people", "organizations", "locations", "date", "topic")


def synthetic_outputs(articles: list[str], n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = [a.split() for a in articles]
    out = []
    for _ in range(n):
        w = rng.choice(words)

        def phrase(lo: int, hi: int) -> str:
            i = rng.randrange(max(1, len(w) - hi))
            return " ".join(w[i:i + rng.randint(lo, hi)]).strip(".,\"'")

        obj = {"title": phrase(3, 8), "people": [phrase(2, 2) for _ in range(rng.randint(0, 3))],
               "organizations": [phrase(1, 3) for _ in range(rng.randint(0, 2))],
               "locations": [phrase(1, 2) for _ in range(rng.randint(0, 2))],
               "date": rng.choice([None, f"{rng.randint(1990, 2024)}"]),
               "topic": phrase(1, 2)}
        out.append("```json\n" + json.dumps(obj, indent=2) + "\n```")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="auto", help="the step's dtype (auto: what specbatch "
                    "run picks on this machine)")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import tomllib

    import torch

    from specbatch.config import SamplingParams
    from specbatch.engine.runner import ModelRunner
    from specbatch.engine.sequence import Request, Sequence
    from specbatch.models.llama import LlamaForward
    from specbatch.models.loader import load_model
    from specbatch.spec_decode.suffix import SuffixIndex, SuffixProposer

    recs = [json.loads(line) for line in
            (ROOT / "recipes/prompts/json_extraction.jsonl").read_text().splitlines()]
    template = tomllib.loads((ROOT / "recipes/json_extraction.toml").read_text())["input"][
        "template"]
    from specbatch.config import resolve_dtype

    dtype = resolve_dtype(args.dtype, "cpu")
    loaded = load_model("smollm2-135m", dtype=dtype)
    tok = loaded.tokenizer

    texts = synthetic_outputs([r["article"] for r in recs], args.records)
    docs = [tok.encode(t, add_special_tokens=False) for t in texts]
    num_tokens = sum(map(len, docs))
    index = SuffixIndex(max_tokens=num_tokens + 10_000)  # room for the joins below
    t0 = time.perf_counter()
    for d in docs:
        index.add(d)
    build = time.perf_counter() - t0
    sam = index.sam
    print(f"index: {len(docs)} records, {num_tokens} tokens ({num_tokens / len(docs):.0f}/record)"
          f", built in {build:.1f} s ({1e6 * build / num_tokens:.1f} us/token), "
          f"{sam.num_states} states ({sam.num_states / num_tokens:.2f}/token), "
          f"~{sam.nbytes() / num_tokens:.0f} bytes/token ({sam.nbytes() / 2**20:.0f} MiB)")
    sub = docs[:1000]
    trie = set()
    for d in sub:
        for i in range(len(d)):
            for n in range(1, min(24, len(d) - i) + 1):
                trie.add(tuple(d[i:i + n]))
    sub_sam = SuffixIndex(max_tokens=num_tokens)
    for d in sub:
        sub_sam.add(d)
    sub_tokens = sum(map(len, sub))
    print(f"first 1000 records ({sub_tokens} tokens): depth-24 suffix trie {len(trie)} nodes "
          f"({len(trie) / sub_tokens:.1f}/token) vs automaton {sub_sam.sam.num_states} states "
          f"({sub_sam.sam.num_states / sub_tokens:.2f}/token)")

    prop = SuffixProposer(index)
    runner = ModelRunner(LlamaForward(loaded.model), 16, loaded.max_model_len)
    rng = random.Random(1)
    seqs = []
    for i in range(16):
        r = recs[i * 7 % len(recs)]
        msg = [{"role": "user", "content": template.format(**r)}]
        ids = tok.encode(tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
        partial = tok.encode(rng.choice(texts)[:rng.randint(20, 120)], add_special_tokens=False)
        seq = Sequence(Request(i, ids + partial, SamplingParams()), "suffix", 15)
        seq.row = i
        seqs.append(seq)
    with torch.no_grad():
        runner.prefill(seqs)
    for s in seqs:  # cache invariant: every token but the last, which a step feeds
        runner.rollback(s)
    # the proposer's rows: copies that commit a token per round (the model's rows stay put)
    pseqs = []
    for s in seqs:
        p = Sequence(Request(s.seq_id, list(s.token_ids), SamplingParams()), "suffix", 15)
        prop.start(p)
        pseqs.append(p)
    steps, lookups, joined = [], [], []
    extra = iter(synthetic_outputs([r["article"] for r in recs], 2 * args.rounds + 2, seed=1))
    for r in range(2 * args.rounds + 1):
        with torch.no_grad():
            t0 = time.perf_counter()
            runner.verify(seqs, [[] for _ in seqs])
            steps.append(time.perf_counter() - t0)
        for s in seqs:
            runner.rollback(s)
        if r > args.rounds:  # a record finished since the last step: every row walks again
            index.add(tok.encode(next(extra), add_special_tokens=False))
        t0 = time.perf_counter()
        drafts = prop.propose(pseqs, [15] * 16)
        (joined if r > args.rounds else lookups).append(time.perf_counter() - t0)
        for p, d in zip(pseqs, drafts):  # commit the first draft token, as a verify step may
            p.token_ids.append(d[0] if d else 0)
            prop.on_commit(p, 1)
    step, first, look = statistics.median(steps), lookups[0], statistics.median(lookups[1:])
    join = statistics.median(joined)
    print(f"batch-16 decode step {1e3 * step:.1f} ms (median of {len(steps)}); propose for "
          f"16 rows right after the step: {1e3 * look:.2f} ms ({100 * look / step:.2f}% of the "
          f"step; median of the {args.rounds} calls after a commit), after a record joined the "
          f"index {1e3 * join:.2f} ms ({100 * join / step:.2f}%, median of {len(joined)}), "
          f"first call (rows just started) {1e3 * first:.2f} ms ({100 * first / step:.2f}%); "
          f"mean draft {sum(map(len, drafts)) / 16:.1f} tokens; load average "
          f"{os.getloadavg()}")


if __name__ == "__main__":
    main()
