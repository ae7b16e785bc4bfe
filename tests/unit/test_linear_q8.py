"""The 8-bit-activation matmul (kernels/csrc/linear_q8.c, ``--dtype int8``): the documented
arithmetic, the same bits on AVX-512 VNNI, AVX2 and in portable C, a row's bits independent of the
rows beside it and of the thread count, and an engine whose outputs do not depend on the
proposer or the batch."""

from __future__ import annotations

import copy

import pytest
import torch

from specbatch.kernels import linear_cpu
from tests.helpers import at_thread_counts, gguf_exact, run_engine, tiny_llama
from tests.unit.test_linear_cpu import _gguf_roundtrip

from specbatch.config import SamplingParams
from specbatch.models.llama import LlamaForward

pytestmark = pytest.mark.skipif(not linear_cpu.available(),
                                reason="needs an AVX2/FMA CPU and a C compiler")

# (N, K): SmolLM2-135M's fused q/k/v, down, a slice of lm_head; N not a multiple of 16
SHAPES = ((960, 576), (576, 1536), (100, 64), (7, 32))


def _reference(x: torch.Tensor, w: torch.Tensor, kind: str) -> torch.Tensor:
    """The module docstring's arithmetic in float64 (fma as an exact product and one sum, so
    it can differ from the kernel's float32 fma by an ulp): [M, K] x [N, K]^T."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127  # float32, as the kernel divides
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None])  # round half to even, as rint
    s = q.sum(-1)
    wb = w.view(w.shape[0], k // 32, 32)
    if kind == "Q4_1":
        mw = wb.amin(-1)
        form = linear_cpu._q4_1_codes(w.reshape(-1, 32))
        dw, _, qw = (t.view(w.shape[0], k // 32, *t.shape[1:]) for t in form)
        qw = qw.double()
    else:
        dw, qw = (t.view(w.shape[0], k // 32, *t.shape[1:]) for t in linear_cpu._q8_0_codes(
            w.reshape(-1, 32)))
        qw, mw = qw.double(), None
    dots = torch.einsum("mbj,nbj->mnb", q.double(), qw)  # exact integers
    acc = torch.zeros(m, w.shape[0], dtype=torch.float64)
    for b in range(k // 32):
        scale = (dw[None, :, b] * d[:, None, b]).float().double()  # one float32 product
        acc = (acc + dots[:, :, b] * scale).float().double()
        if mw is not None:
            acc = (acc + mw[None, :, b].double() * (d[:, b] * s[:, b]).float().double()[:, None]
                   ).float().double()
    return acc.float()


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", SHAPES)
def test_documented_arithmetic_and_row_invariance(kind, n, k):
    gen = torch.Generator().manual_seed(n + 3 * k)
    w = _gguf_roundtrip(torch.randn(n, k, generator=gen) / k ** 0.5, kind)
    x = torch.randn(40, k, generator=gen)
    x[3, :32] = 0.0  # a block of zeros: d = 0, codes 0
    b = torch.randn(n, generator=gen)
    assert linear_cpu.use_int8_activations(w)
    assert linear_cpu._PACKED[w][1][0] == (linear_cpu.Q4_1_X8 if kind == "Q4_1"
                                           else linear_cpu.Q8_0_X8)
    full = linear_cpu.linear(x, w, b)
    ref = _reference(x, w, kind) + b
    assert (full - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    # ~0.3% of the largest output from 8-bit activations (float32 product: 1e-6)
    exact = x.double() @ w.double().t() + b.double()
    err = (full.double() - exact).abs().max().item() / exact.abs().max().item()
    assert 1e-5 < err < 2e-2
    for rows in list(range(1, 18)) + [33, 39]:
        pick = torch.randperm(40, generator=gen)[:rows]
        assert torch.equal(linear_cpu.linear(x[pick], w, b), full[pick]), rows


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_every_kernel_gives_the_same_bits(kind):
    """AVX-512 VNNI (where the CPU has it), AVX2 and the portable C loop: equal outputs, 1-21
    rows (the AVX2 kernel's tiles of 4, VNNI's of 8, partial column groups)."""
    gen = torch.Generator().manual_seed(7)
    w = _gguf_roundtrip(torch.randn(200, 576, generator=gen) / 24, kind)
    linear_cpu.use_int8_activations(w)
    x = torch.randn(21, 576, generator=gen) * torch.rand(21, 1, generator=gen) * 10
    assert_same_bits_on_every_isa(x, w)


def engine_runs_agree(fwd, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Greedy outputs of 6 prompts (random ids below ``vocab``, their first 5 ids repeated for
    prompt lookup) at k 0 / 3 x batch 1 / 4 on ``fwd``: asserts the four runs agree and
    returns the prompts and the runs' output ids."""
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, vocab, (int(n),), generator=gen).tolist()
               for n in torch.randint(4, 30, (6,), generator=gen)]
    prompts = [p + p[:5] for p in prompts]  # something for prompt lookup to draft from
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    runs = [[c.output_ids for c in run_engine(fwd, prompts, k, bsz, greedy)]
            for k, bsz in ((0, 1), (3, 1), (0, 4), (3, 4))]
    assert all(r == runs[0] for r in runs[1:])
    return prompts, runs


def assert_same_bits_on_every_isa(x: torch.Tensor, w: torch.Tensor) -> None:
    """``linear_cpu.linear(x[:m], w)`` of an int8 weight gives the same bits on the portable C,
    AVX2 and (where the CPU has it) VNNI kernels, at 1, 3, 5, 8 and 21 rows; x: ``[21, K]``."""
    before = linear_cpu.int8_kernel()
    kernels = ["portable", "avx2"] + (["vnni"] if linear_cpu.int8_kernel("vnni") == "vnni" else [])
    try:
        outs = {}
        for name in kernels:
            assert linear_cpu.int8_kernel(name) == name
            outs[name] = [linear_cpu.linear(x[:m], w) for m in (1, 3, 5, 8, 21)]
    finally:
        linear_cpu.int8_kernel(before)
    for name in kernels[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[name], outs["portable"])), name
    assert all(torch.equal(o, outs["portable"][-1][:o.shape[0]]) for o in outs["portable"])


def test_thread_count_and_unmarked_weights():
    gen = torch.Generator().manual_seed(8)
    w = _gguf_roundtrip(torch.randn(300, 576, generator=gen) / 24, "Q4_1")
    x = torch.randn(19, 576, generator=gen)
    float32 = linear_cpu.linear(x, w.clone())  # unmarked: the exact float32 codes path
    linear_cpu.use_int8_activations(w)
    outs = at_thread_counts(lambda: linear_cpu.linear(x, w))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert not torch.equal(outs[0], float32)
    # a weight without exact codes keeps the float32 panels
    plain = torch.randn(64, 64, generator=gen)
    assert not linear_cpu.use_int8_activations(plain)
    assert linear_cpu._PACKED[plain][1][0] == 0


def test_int8_engine_outputs_do_not_depend_on_proposer_or_batch():
    """A tiny model with exact Q4_1 / Q8_0 weights, marked int8 as the loader marks it (float16
    KV cache): greedy outputs equal for none / ngram k 3 at batch 1 and 4, and logits near the
    float32 ones but not equal."""
    base = gguf_exact(tiny_llama(96, seed=11).float())
    plain = copy.deepcopy(base)  # before the int8 forward releases base's float32 values
    base.specbatch_activations = "int8"
    fwd = LlamaForward(base)
    assert fwd.activations == "int8"
    assert linear_cpu._PACKED[fwd.gate_up[0]][1][0] == linear_cpu.Q4_1_X8
    assert linear_cpu._PACKED[fwd.lm_head][1][0] == linear_cpu.Q8_0_X8
    assert fwd.new_cache(1, 16).k[0].dtype == torch.float16  # keys and values in float16
    prompts, _ = engine_runs_agree(fwd, vocab=96)
    f32 = LlamaForward(plain)
    assert f32.activations == "float32"
    logits = [f.forward(torch.tensor([prompts[0][:8]]), torch.arange(8)[None],
                        f.new_cache(1, 16), torch.tensor([0])) for f in (fwd, f32)]
    gap = (logits[0] - logits[1]).abs().max().item()
    assert 0 < gap < 0.05 * logits[1].abs().max().item()


def test_a_row_with_a_nan_or_inf_gives_nan_outputs_and_leaves_the_others():
    """As in float32: a non-finite input makes its row's outputs NaN (the engine then ends the
    record with an error), on every kernel, and the other rows keep their bits."""
    gen = torch.Generator().manual_seed(9)
    w = _gguf_roundtrip(torch.randn(40, 64, generator=gen) / 8, "Q4_1")
    linear_cpu.use_int8_activations(w)
    x = torch.randn(5, 64, generator=gen)
    clean = linear_cpu.linear(x, w)
    x[1, 40], x[3, 2] = float("nan"), float("inf")
    before = linear_cpu.int8_kernel()
    try:
        for name in ("portable", "avx2", "vnni"):
            linear_cpu.int8_kernel(name)
            out = linear_cpu.linear(x, w)
            assert out[1].isnan().all() and out[3].isnan().all(), name
            assert torch.equal(out[[0, 2, 4]], clean[[0, 2, 4]]), name
    finally:
        linear_cpu.int8_kernel(before)
