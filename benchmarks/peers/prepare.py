"""Prepare the peer benchmark inputs (run with the project's venv).

Writes ``OUT/prompts.json`` (each record's question id, category and prompt token ids, rendered
by specbatch's own chat-template path, so every engine gets the same token ids) and
``OUT/hf-model/`` (the packaged SmolLM2-135M GGUF loaded with transformers and saved as a
Hugging Face folder with its tokenizer and generation config, which vLLM loads), and prints the
GGUF path llama.cpp runs.

    python benchmarks/peers/prepare.py benchmarks/peers/records16.jsonl --out /work/peer-run
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", help="JSONL of Spec-Bench-style records (turns[0] is the prompt)")
    ap.add_argument("--out", required=True, help="folder for prompts.json and hf-model/")
    args = ap.parse_args()

    from specbatch.config import SamplingParams
    from specbatch.io.records import read_records
    from specbatch.models.loader import load_model, resolve_model
    from specbatch.models.registry import DEFAULT_MODEL
    from specbatch.prompts import PromptRenderer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, errors = read_records(args.records, defaults=SamplingParams())
    if errors:
        raise SystemExit(f"bad records: {errors[0]}")
    loaded = load_model(DEFAULT_MODEL, dtype="float32")
    renderer = PromptRenderer(loaded.tokenizer)
    prompts = [{"question_id": r.fields.get("question_id", r.id),
                "category": r.fields.get("category"),
                "prompt_ids": renderer.first_prompt(r)[0]} for r in records]
    (out / "prompts.json").write_text(json.dumps(prompts))
    hf = out / "hf-model"
    if not (hf / "config.json").exists():
        # float32 weights (dequantised Q4_1): vLLM casts them to bfloat16 on load exactly as
        # specbatch does (round to nearest even), so both run the same bfloat16 weights
        loaded.model.save_pretrained(hf)
        loaded.tokenizer.save_pretrained(hf)
    source = resolve_model(DEFAULT_MODEL)
    gguf = Path(source.path) / source.gguf_file
    (out / "gguf-path.txt").write_text(str(gguf) + "\n")
    print(json.dumps({"prompts": len(prompts), "hf_model": str(hf), "gguf": str(gguf),
                      "eos_token_ids": list(loaded.eos_token_ids),
                      "prompt_tokens": [len(p["prompt_ids"]) for p in prompts]}))


if __name__ == "__main__":
    main()
