"""llama.cpp worker for ``run.py`` (run with the llama-cpp-python venv's python).

    /work/peer-venvs/llamacpp/bin/python worker_llamacpp.py PROMPTS_JSON MODEL.gguf \
        --method ngram --k 5 --threads 2 [--draft-gguf DRAFT.gguf]

The GGUF run directly with its own quantisation, one sequence at a time (the Python binding's
``Llama.generate`` decodes a single sequence: batch 1 only). Greedy (``temp=0``: llama.cpp's
greedy sampler; no repeat penalty). ngram: ``LlamaPromptLookupDecoding(num_pred_tokens=k,
max_ngram_size=4)``. draft: the binding has no draft-model proposer of its own (0.3.36 ships
only prompt lookup behind its ``draft_model`` hook, a ``LlamaDraftModel`` that maps the ids so
far to draft ids), so ``DraftModel`` below runs the draft GGUF in a second ``Llama`` through
that hook: k greedy tokens per verify step, its KV cache kept across steps (cut back to the
prefix the target accepted). The KV cache is reset before each prompt, so no prompt prefix is
reused. Output ids end at the first end-of-generation token (kept, as specbatch keeps EOS) or
at max_tokens.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arg, load_prompts, peer_args, protocol_channel, serve  # noqa: E402


def main() -> None:
    args = peer_args(arg("--n-ctx", type=int, default=4096),
                     arg("--draft-gguf", default=None), methods=("none", "ngram", "draft"))
    channel = protocol_channel()

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    class DraftModel(LlamaDraftModel):
        """k greedy draft ids from a second ``Llama`` (the draft GGUF), for ``draft_model``."""

        def __init__(self, path: str, k: int) -> None:
            self.k = k
            self.llm = Llama(model_path=path, n_ctx=args.n_ctx, n_threads=args.threads,
                             n_threads_batch=args.threads, n_batch=512, seed=0,
                             verbose=False)

        def reset(self) -> None:
            self.llm.reset()

        def __call__(self, input_ids, /, **kwargs):
            llm = self.llm
            ids = [int(t) for t in input_ids]
            # keep the KV of the longest prefix this model already holds (the accepted tokens)
            held = llm.input_ids[:llm.n_tokens]
            n = 0
            for a, b in zip(held, ids):
                if a != b:
                    break
                n += 1
            n = min(n, len(ids) - 1)  # re-evaluate at least the last id, for its logits
            llm.n_tokens = n  # eval drops the KV past n_tokens first
            llm.eval(ids[n:])
            out = []
            for i in range(self.k):
                # the last evaluated position's logits (without logits_all the binding keeps
                # no scores: read the context's one output row)
                logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
                tok = int(np.argmax(logits))
                out.append(tok)
                if i + 1 < self.k:
                    llm.eval([tok])
            return np.array(out, dtype=np.intc)

    prompts = [p["prompt_ids"] for p in load_prompts(args.prompts)]
    if args.method == "draft" and not args.draft_gguf:
        raise SystemExit("--method draft needs --draft-gguf")
    draft = (LlamaPromptLookupDecoding(num_pred_tokens=args.k, max_ngram_size=4)
             if args.method == "ngram" else
             DraftModel(args.draft_gguf, args.k) if args.method == "draft" else None)
    # logits_all with a draft: the binding switches it on itself for drafting but sizes its
    # logits buffer from the argument (n_batch rows), so a prompt past 512 tokens failed with
    # "could not broadcast input array ... into shape (0,)" (llama-cpp-python 0.3.36)
    llm = Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=512, seed=0, verbose=False,
                draft_model=draft, logits_all=draft is not None)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def run(n: int, max_tokens: int) -> list[list[int]]:
        outs = []
        for ids in prompts[:n]:
            llm.reset()  # no prefix reuse from the previous prompt
            if isinstance(draft, DraftModel):
                draft.reset()
            out = []
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                    repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                if llama_cpp.llama_vocab_is_eog(vocab, tok) or len(out) >= max_tokens:
                    break
            outs.append(out)
        return outs

    serve(channel, {"engine": "llama.cpp", "version": llama_cpp.__version__,
                    "threads": args.threads, "model": args.model,
                    "draft": args.draft_gguf if args.method == "draft" else None},
          run, len(prompts))


if __name__ == "__main__":
    main()
