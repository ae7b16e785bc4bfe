"""Device discipline: every tensor an engine step creates names its device.

A real engine runs on the CPU while ``torch.set_default_device("meta")`` is in force, so a
tensor created without ``device=`` lands on the meta device and the first op mixing it with the
model's CPU tensors (or reading it back with ``.tolist()``) raises. On a CUDA engine such a
tensor would silently land on the host (a device-mismatch error or a hidden copy); here it
fails loudly without a GPU. Host-only bookkeeping tensors must say ``device="cpu"``.
"""

from __future__ import annotations

import torch

from specbatch.config import SamplingParams
from tests.helpers import repeating_prompts, run_engine, tiny_llama


def _run(model, prompts, sampling, k, batch_size):
    return [c.output_ids for c in run_engine(model, prompts, k, batch_size, sampling,
                                             eos_ids=(3,))]


def test_engine_steps_create_no_tensor_on_the_default_device():
    model = tiny_llama(vocab_size=64, seed=4)
    prompts = repeating_prompts(64, 5, seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    # T > 0 with top-k / top-p and min_tokens: the noise, the masks and the EOS ban run too
    sampled = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_tokens=4, max_tokens=12)
    expected = {(k, b, sp.temperature): _run(model, prompts, sp, k, b)
                for k in (0, 3) for b in (1, 4) for sp in (greedy, sampled)}
    assert expected[(0, 4, 0.0)] == expected[(3, 4, 0.0)] == expected[(3, 1, 0.0)]
    assert expected[(0, 4, 0.8)] == expected[(3, 4, 0.8)] == expected[(3, 1, 0.8)]
    assert all(len(ids) >= 4 for ids in expected[(3, 4, 0.8)])
    torch.set_default_device("meta")
    try:
        got = {(k, b, sp.temperature): _run(model, prompts, sp, k, b)
               for k in (0, 3) for b in (1, 4) for sp in (greedy, sampled)}
    finally:
        torch.set_default_device(None)
    assert got == expected
