"""The engine on the kernel path (``SPECBATCH_KERNELS=1``: the Triton kernels on CPU tensors
under the interpreter, as on CUDA): outputs identical across proposer, k and batch size, and
equal to the torch path's."""

from __future__ import annotations

import pytest

from specbatch.config import SamplingParams
from tests.helpers import repeating_prompts, run_engine, tiny_llama


def _outputs(model, prompts, sampling, k, batch_size):
    return [c.output_ids for c in run_engine(model, prompts, k, batch_size, sampling,
                                             eos_ids=(3,))]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_engine_with_kernels_gives_the_same_outputs(monkeypatch, temperature):
    model = tiny_llama(vocab_size=64, seed=5).float()  # head_dim 16: the kernels' smallest
    prompts = repeating_prompts(64, 4, seed=1, min_len=6, max_len=70)  # 2 key tiles
    sampling = SamplingParams(temperature=temperature, top_p=0.95, min_tokens=2, max_tokens=8)
    monkeypatch.setenv("SPECBATCH_KERNELS", "0")
    torch_path = _outputs(model, prompts, sampling, 3, 4)
    monkeypatch.setenv("SPECBATCH_KERNELS", "1")
    from specbatch.models.llama import LlamaForward
    assert LlamaForward(model).use_kernels
    got = {(k, b): _outputs(model, prompts, sampling, k, b) for k, b in [(3, 4), (0, 4), (3, 1)]}
    assert got[(3, 4)] == got[(0, 4)] == got[(3, 1)]
    assert got[(3, 4)] == torch_path
    assert all(len(ids) >= 2 for ids in torch_path)
