"""Prepare the peer benchmark inputs (run with the project's venv).

Writes ``OUT/prompts.json`` (each record's question id, category and prompt token ids, rendered
by specbatch's own chat-template path for ``--model``, so every engine gets the same token ids),
``OUT/model.json`` (``{"model", "draft", "gguf", "draft_gguf"}``: the registry names specbatch
loads and the GGUF files llama.cpp runs; ``run.py`` reads it), ``OUT/gguf-path.txt`` and, unless
``--no-hf-model``, ``OUT/hf-model/`` (the GGUF loaded with transformers, dequantised to float32
and saved as a Hugging Face folder with its tokenizer and generation config, which vLLM loads).

    python benchmarks/peers/prepare.py benchmarks/peers/records16.jsonl --out /work/peer-run
    python benchmarks/peers/prepare.py benchmarks/peers/code_edit20.jsonl --out /work/qwen-run \
        --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --no-hf-model

``--model`` / ``--draft``: registry names of GGUF models (default: the packaged SmolLM2-135M,
no draft). The draft must share the target's tokenizer (the Qwen2.5-Coder pair does).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("records", help="JSONL of Spec-Bench-style records (turns[0] is the prompt)")
    ap.add_argument("--out", required=True, help="folder for prompts.json and hf-model/")
    ap.add_argument("--model", default=None, help="target model, a registry name of a GGUF "
                    "model (default: the packaged SmolLM2-135M)")
    ap.add_argument("--draft", default=None, help="draft model for the draft / auto arms "
                    "(registry name of a GGUF model with the target's tokenizer)")
    ap.add_argument("--no-hf-model", action="store_true", help="skip hf-model/ (only vLLM "
                    "reads it; a 1.5B model is ~6 GB of float32)")
    args = ap.parse_args()

    from specbatch.config import SamplingParams
    from specbatch.io.records import read_records
    from specbatch.models.loader import load_model, load_tokenizer, resolve_model
    from specbatch.models.registry import DEFAULT_MODEL
    from specbatch.prompts import PromptRenderer

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records, errors = read_records(args.records, defaults=SamplingParams())
    if errors:
        raise SystemExit(f"bad records: {errors[0]}")
    model = args.model or DEFAULT_MODEL
    hf = out / "hf-model"
    want_hf = not args.no_hf_model and not (hf / "config.json").exists()
    loaded = load_model(model, dtype="float32") if want_hf else None
    tokenizer = loaded.tokenizer if loaded else load_tokenizer(model)[0]
    if args.draft:
        draft_tok = load_tokenizer(args.draft)[0]
        if draft_tok.get_vocab() != tokenizer.get_vocab():
            raise SystemExit(f"--draft {args.draft}: its tokenizer is not {model}'s")
    renderer = PromptRenderer(tokenizer)
    prompts = [{"question_id": r.fields.get("question_id", r.id),
                "category": r.fields.get("category"),
                "prompt_ids": renderer.first_prompt(r)[0]} for r in records]
    (out / "prompts.json").write_text(json.dumps(prompts))
    if want_hf:
        # float32 weights (dequantised Q4_1): vLLM casts them to bfloat16 on load exactly as
        # specbatch does (round to nearest even), so both run the same bfloat16 weights
        loaded.model.save_pretrained(hf)
        loaded.tokenizer.save_pretrained(hf)

    def gguf_of(name: str) -> str:
        source = resolve_model(name)
        if source.gguf_path is None:
            raise SystemExit(f"{name}: not a GGUF model (llama.cpp runs GGUF files only)")
        return str(source.gguf_path)

    gguf = gguf_of(model)
    (out / "gguf-path.txt").write_text(gguf + "\n")
    info = {"model": model, "draft": args.draft, "gguf": gguf,
            "draft_gguf": gguf_of(args.draft) if args.draft else None}
    (out / "model.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps({"prompts": len(prompts), **info,
                      "hf_model": str(hf) if (hf / "config.json").exists() else None,
                      "prompt_tokens": [len(p["prompt_ids"]) for p in prompts]}))


if __name__ == "__main__":
    main()
