"""specbatch worker for ``run.py`` (project venv). One engine configuration per process.

    python worker_specbatch.py RECORDS PROMPTS_JSON --method ngram --k 5 --batch 16 --threads 2

``--dtype auto`` (default) is what ``specbatch run`` picks: bfloat16 on a CPU with AMX,
float32 on other x86-64 CPUs; the ready line reports the resolved dtype.

Runs the records as ``specbatch run`` does (``specbatch.LLM``: memory check, planning for
``auto``, generation), timed from the first record in to the last record out; the model is
loaded once, a fresh engine is built per run (as ``specbatch bench`` does).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import load_prompts, protocol_channel, serve  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("records")
    ap.add_argument("prompts")
    ap.add_argument("--method", default="none")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    channel = protocol_channel()

    import torch

    torch.set_num_threads(args.threads)
    from importlib.metadata import version

    from specbatch import LLM
    from specbatch.config import EngineConfig, SamplingParams, SpecConfig
    from specbatch.io.records import read_records

    spec = (SpecConfig(method="none") if args.method == "none"
            else SpecConfig(method=args.method, num_speculative_tokens=args.k))
    engine = EngineConfig(max_batch_size=args.batch, dtype=args.dtype, device="cpu")
    llm = LLM.from_config(None, spec, engine, echo=lambda line: print(line, file=sys.stderr))
    records, errors = read_records(args.records, defaults=SamplingParams(max_tokens=128))
    errors += llm.check_records(records)
    assert not errors, errors
    want = [p["prompt_ids"] for p in load_prompts(args.prompts)]
    assert [llm.renderer.first_prompt(r)[0] for r in records] == want, \
        "records and prompts.json disagree: rerun prepare.py"

    def run(n: int, max_tokens: int) -> list[list[int]]:
        """One ``specbatch run`` of the first n records: engine built and fitted to them
        (planned, for auto; calibration is cached), generated, output ids in record order."""
        from dataclasses import replace

        recs = [replace(r, sampling=replace(r.sampling, max_tokens=max_tokens))
                for r in records[:n]]
        outs = {rec.index: out["output_token_ids"][0] if rec.turns else out["output_token_ids"]
                for rec, out in llm.generate_records(recs, seed=0, echo=lambda line: None)}
        return [outs[r.index] for r in recs]

    serve(channel, {"engine": "specbatch", "version": version("specbatch"),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "dtype": engine.dtype},
          run, len(records))


if __name__ == "__main__":
    main()
