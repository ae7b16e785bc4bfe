"""vLLM worker for ``run.py`` (run with the vLLM venv's python, never the project's).

    /work/peer-venvs/vllm/bin/python worker_vllm.py PROMPTS_JSON HF_FOLDER --method ngram --k 5 \
        --batch 16 --threads 2

``LLM.generate`` on the prompt token ids (``TokensPrompt``), greedy, ``max_num_seqs`` = batch,
prefix caching off (specbatch has none, and rounds repeat the same prompts), bfloat16. ngram:
``speculative_config={"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}`` (specbatch's defaults).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import arg, load_prompts, peer_args, protocol_channel, serve  # noqa: E402


def main() -> None:
    args = peer_args(
        arg("--batch", type=int, default=16),
        arg("--dtype", default="bfloat16"),
        arg("--max-model-len", type=int, default=4096),
    )
    channel = protocol_channel()

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [p["prompt_ids"] for p in load_prompts(args.prompts)]
    spec = None
    if args.method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.batch, seed=0,
              max_model_len=args.max_model_len, enable_prefix_caching=False,
              speculative_config=spec)

    def run(n: int, max_tokens: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts[:n]], sp,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    import torch

    serve(channel, {"engine": "vllm", "version": vllm.__version__, "torch": torch.__version__,
                    "threads": torch.get_num_threads()}, run, len(prompts))


if __name__ == "__main__":
    main()
