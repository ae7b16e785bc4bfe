"""The float32 decode/verify step in one C call (kernels/decode_cpu.py): the model's function
(transformers' logits; the torch loop it replaces), a token's bits independent of the step it is
in and of the thread count, and exact 4/8-bit weights changing no bit."""

from __future__ import annotations

import copy

import pytest
import torch

from specbatch.kernels import decode_cpu
from specbatch.models.llama import LlamaForward
from tests.helpers import gguf_exact, tiny_llama, tiny_qwen2

pytestmark = pytest.mark.skipif(not decode_cpu.available(64, 16),
                                reason="needs an AVX2/FMA CPU and a C compiler")

MAKERS = [lambda: tiny_llama(96, seed=1), lambda: tiny_qwen2(96, seed=4)]


def _prefilled(fwd: LlamaForward, prompts: list[torch.Tensor]):
    cache = fwd.new_cache(len(prompts), 64)
    for row, p in enumerate(prompts):
        fwd.forward_prefill(p, cache, [(row, 0, len(p))], [])
    return cache


@pytest.mark.parametrize("make", MAKERS, ids=["llama", "qwen2"])
def test_a_step_is_one_c_call_and_computes_the_model(make, monkeypatch):
    model = make().float()
    fwd = LlamaForward(model)
    assert fwd.backend.decode is not None and fwd.backend.min_query_len == 1
    monkeypatch.setenv("SPECBATCH_CPU_DECODE", "torch")
    loop = LlamaForward(model)  # the torch loop around the same C matmul and attention
    assert loop.backend.decode is None and loop.backend.min_query_len == 2
    seq = torch.randint(1, 96, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(seq[None]).logits[0]
    caches = [_prefilled(f, [seq[:20]]) for f in (fwd, loop)]
    for p in range(20, 30):
        ids, pos = seq[None, p:p + 1], torch.tensor([[p]])
        c_out = fwd.forward(ids, pos, caches[0], torch.tensor([0]))[0, 0]
        loop_out = loop.forward(ids, pos, caches[1], torch.tensor([0]))[0, 0]
        assert (c_out - ref[p]).abs().max() < 1e-4
        assert (c_out - loop_out).abs().max() < 1e-5
    # a 10-token verify step reads the keys the one-token steps wrote, and gives their bits
    verify = fwd.forward(seq[None, 20:30], torch.arange(20, 30)[None], caches[0],
                         torch.tensor([0]))[0]
    assert torch.equal(verify, torch.stack([
        fwd.forward(seq[None, p:p + 1], torch.tensor([[p]]), caches[0], torch.tensor([0]))[0, 0]
        for p in range(20, 30)]))


def test_a_tokens_bits_do_not_depend_on_the_step_or_threads():
    """20 rows in one step (the glue's multi-threaded branch from 16 tokens) against each row's
    token alone, at 1 and 2 threads, rows in any order."""
    fwd = LlamaForward(tiny_llama(96, seed=3).float())
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 96, (int(n),), generator=gen)
               for n in torch.randint(3, 40, (20,), generator=gen)]
    nxt = torch.randint(1, 96, (20, 1), generator=gen)
    pos = torch.tensor([[len(p)] for p in prompts])
    before = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            cache = _prefilled(fwd, prompts)
            order = torch.randperm(20, generator=gen)
            out = torch.empty(20, 96)
            out[order] = fwd.forward(nxt[order], pos[order], cache, order)[:, 0]
            outs.append(out)
            for row in (0, 7, 19):
                alone = _prefilled(fwd, prompts)
                got = fwd.forward(nxt[row:row + 1], pos[row:row + 1], alone, torch.tensor([row]))
                assert torch.equal(got[0, 0], out[row]), (threads, row)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])


def test_exact_low_bit_weights_change_no_bit(monkeypatch):
    """The same model with its weights streamed as 4/8-bit codes and as float32 panels: the
    logits of decode and verify steps are equal bit for bit."""
    from specbatch.kernels import linear_cpu

    base = gguf_exact(tiny_llama(96, seed=5).float())
    other = copy.deepcopy(base)
    seq = torch.randint(1, 96, (24,), generator=torch.Generator().manual_seed(6))
    outs = []
    for model, weights in ((base, ""), (other, "float32")):  # packed at first use
        monkeypatch.setenv("SPECBATCH_CPU_WEIGHTS", weights)
        fwd = LlamaForward(model)
        cache = _prefilled(fwd, [seq[:12]])
        outs.append(fwd.forward(seq[None, 12:18], torch.arange(12, 18)[None], cache,
                                torch.tensor([0])))
    assert torch.equal(outs[0], outs[1])
    forms = [linear_cpu._PACKED[m.model.layers[0].mlp.down_proj.weight][1][0]
             for m in (base, other)]
    assert forms == [linear_cpu.Q4_1, 0]
    assert linear_cpu._PACKED[base.lm_head.weight][1][0] == linear_cpu.Q8_0


def test_rows_or_positions_outside_the_cache_are_refused():
    fwd = LlamaForward(tiny_llama(96, seed=1).float())
    cache = fwd.new_cache(1, 16)
    h = torch.zeros(1, 64)
    cs = torch.zeros(1, 16)
    with pytest.raises(ValueError, match="outside the cache"):
        fwd.backend.decode(h, cs, cs, cache.k, cache.v, torch.tensor([0]),
                           torch.tensor([cache.capacity]), 0.25)
    with pytest.raises(ValueError, match="outside the cache"):
        fwd.backend.decode(h, cs, cs, cache.k, cache.v, torch.tensor([1]), torch.tensor([0]),
                           0.25)


def test_a_lone_decode_step_feeds_one_token_only_in_c(monkeypatch):
    """A batch-1 decode step pads to two query slots on the torch path (one-row matmuls round
    differently there), and feeds its one token on the C path."""
    from specbatch.engine.runner import ModelRunner

    model = tiny_llama(96, seed=1).float()
    runner = ModelRunner(LlamaForward(model), 2, 64)
    assert [runner.query_len(d) for d in ([[]], [[5, 6]], [[], []])] == [1, 3, 1]
    monkeypatch.setenv("SPECBATCH_CPU_DECODE", "torch")
    runner = ModelRunner(LlamaForward(model), 2, 64)
    assert [runner.query_len(d) for d in ([[]], [[5, 6]], [[], []])] == [2, 3, 1]


def test_prefill_runs_the_decode_step_so_a_prompt_prefilled_equals_one_fed_token_by_token():
    """Prefill is the C step over every prompt token: a prompt prefilled at once, in two
    chunks, or fed one token a step gives the same last logits and the same keys, bit for bit."""
    fwd = LlamaForward(tiny_llama(96, seed=21).float())
    assert fwd.backend.decode is not None
    seq = torch.randint(1, 96, (20,), generator=torch.Generator().manual_seed(22))
    whole = fwd.new_cache(1, 32)
    at_once = fwd.forward_prefill(seq, whole, [(0, 0, 20)], [19])
    split = fwd.new_cache(1, 32)
    fwd.forward_prefill(seq[:7], split, [(0, 0, 7)], [])
    chunked = fwd.forward_prefill(seq[7:], split, [(0, 7, 13)], [12])
    stepped = fwd.new_cache(1, 32)
    fwd.forward_prefill(seq[:1], stepped, [(0, 0, 1)], [])
    for p in range(1, 20):
        last = fwd.forward(seq[None, p:p + 1], torch.tensor([[p]]), stepped, torch.tensor([0]))
    assert torch.equal(at_once[0], chunked[0]) and torch.equal(at_once[0], last[0, 0])
    assert all(torch.equal(a[:, :, :20], b[:, :, :20])
               for a, b in zip(whole.k + whole.v, stepped.k + stepped.v))
