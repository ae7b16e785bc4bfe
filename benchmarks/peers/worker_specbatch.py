"""specbatch worker for ``run.py`` (project venv). One engine configuration per process.

    python worker_specbatch.py RECORDS PROMPTS_JSON --method ngram --k 5 --batch 16 --threads 2 \
        [--model NAME] [--draft-model NAME]

``--dtype auto`` (default) is what ``specbatch run`` picks for the model
(``EngineConfig.for_model``: int8 for a GGUF whose codes the int8 kernels take, on an x86-64 CPU
with AVX2); the ready line reports the resolved dtype and why. ``--model`` (default: the
packaged SmolLM2-135M) and ``--draft-model`` (for ``draft``, optional for ``auto``) are registry
names or paths, as ``specbatch run`` takes them.

Runs the records as ``specbatch run`` does (``specbatch.LLM``: memory check, planning for
``auto``, generation), timed from the first record in to the last record out; the model is
loaded once, a fresh engine is built per run (as ``specbatch bench`` does). A run command's
``method`` / ``batch`` (``run.py --share-workers``) override ``--method`` / ``--batch`` for that
run, so one process (one copy of the weights) serves every arm of a dtype: the draft model is
then loaded whenever ``--draft-model`` is given, and given to the draft and auto arms.
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
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    args = ap.parse_args()
    channel = protocol_channel()

    import torch

    torch.set_num_threads(args.threads)
    from importlib.metadata import version

    from specbatch import LLM
    from specbatch.config import EngineConfig, SamplingParams, SpecConfig
    from specbatch.io.records import read_records

    def spec_for(method: str) -> SpecConfig:
        if method == "none":
            return SpecConfig(method="none")
        return SpecConfig(method=method, num_speculative_tokens=args.k,
                          draft_model=args.draft_model if method in ("draft", "auto")
                          else None)

    # with a draft model given, load it whatever --method says (a shared worker's later arms)
    spec = spec_for("auto" if args.draft_model and args.method != "draft" else args.method)
    # dtype auto resolved for the model, as specbatch run does (int8 for a GGUF on its codes)
    engine = EngineConfig(max_batch_size=args.batch, dtype=args.dtype,
                          device="cpu").for_model(args.model)
    llm = LLM.from_config(args.model, spec, engine,
                          echo=lambda line: print(line, file=sys.stderr))
    records, errors = read_records(args.records, defaults=SamplingParams(max_tokens=128))
    errors += llm.check_records(records)
    assert not errors, errors
    want = [p["prompt_ids"] for p in load_prompts(args.prompts)]
    assert [llm.renderer.first_prompt(r)[0] for r in records] == want, \
        "records and prompts.json disagree: rerun prepare.py"

    def run(n: int, max_tokens: int, method: str | None = None,
            batch: int | None = None) -> list[list[int]]:
        """One ``specbatch run`` of the first n records: engine built and fitted to them
        (planned, for auto; calibration is cached), generated, output ids in record order.
        method, batch: this run's arm (default: the command line's)."""
        from dataclasses import replace

        recs = [replace(r, sampling=replace(r.sampling, max_tokens=max_tokens))
                for r in records[:n]]
        fitted = llm.fit_engine_config(
            recs, replace(engine, max_batch_size=batch or args.batch), echo=lambda line: None)
        outs = {rec.index: out["output_token_ids"][0] if rec.turns else out["output_token_ids"]
                for rec, out in llm.generate_records(recs, seed=0, echo=lambda line: None,
                                                     spec=spec_for(method or args.method),
                                                     engine=fitted)}
        return [outs[r.index] for r in recs]

    serve(channel, {"engine": "specbatch", "version": version("specbatch"),
                    "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "dtype": engine.dtype, "dtype_auto": engine.dtype_auto,
                    "model": args.model, "draft_model": args.draft_model},
          run, len(records))


if __name__ == "__main__":
    main()
