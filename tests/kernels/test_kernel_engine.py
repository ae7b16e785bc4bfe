"""The engine on the kernel path (``SPECBATCH_KERNELS=1``: the Triton kernels on CPU tensors
under the interpreter, as on CUDA: attention, KV write, sampling, the dense layers and RMSNorm,
prefill included): outputs identical across proposer, k and batch size, and equal to the torch
path's."""

from __future__ import annotations

import pytest

from specbatch.config import SamplingParams
from tests.helpers import repeating_prompts, run_engine, tiny_llama


def _outputs(model, prompts, sampling, k, batch_size, with_logprobs=False):
    done = run_engine(model, prompts, k, batch_size, sampling, eos_ids=(3,))
    if with_logprobs:
        return [c.output_ids for c in done], [c.logprobs for c in done]
    return [c.output_ids for c in done]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_with_kernels_gives_the_same_outputs(monkeypatch, temperature):
    model = tiny_llama(vocab_size=64, seed=5).float()  # head_dim 16: the kernels' smallest
    prompts = repeating_prompts(64, 4, seed=1, min_len=6, max_len=70)  # 2 key tiles
    sampling = SamplingParams(temperature=temperature, top_p=0.95, min_tokens=2, max_tokens=8,
                              logprobs=2)
    monkeypatch.setenv("SPECBATCH_KERNELS", "0")
    torch_path, torch_logprobs = _outputs(model, prompts, sampling, 3, 4, with_logprobs=True)
    monkeypatch.setenv("SPECBATCH_KERNELS", "1")
    from specbatch.models.llama import LlamaForward
    forward = LlamaForward(model)
    # every reducing op on the Triton kernels: attention, dense layers, RMSNorm
    assert forward.backend.name == "triton" and forward.dense_backend == "triton"
    assert forward.rms_norm_kernel is not None
    got = {(k, b): _outputs(model, prompts, sampling, k, b) for k, b in [(0, 4), (3, 1)]}
    got[(3, 4)], logprobs = _outputs(model, prompts, sampling, 3, 4, with_logprobs=True)
    assert got[(3, 4)] == got[(0, 4)] == got[(3, 1)]
    assert got[(3, 4)] == torch_path
    assert all(len(ids) >= 2 for ids in torch_path)
    # logprobs on the kernel path (scaled logits made beside the fused kernel): the same
    # tokens and top-2, values within float32 attention rounding
    assert [len(lp) for lp in logprobs] == [len(ids) for ids in torch_path]
    for ours, theirs in zip(logprobs, torch_logprobs):
        assert [(e.token_id, [t for t, _ in e.top]) for e in ours] == \
            [(e.token_id, [t for t, _ in e.top]) for e in theirs]
        for e, f in zip(ours, theirs):
            assert abs(e.logprob - f.logprob) < 1e-4
