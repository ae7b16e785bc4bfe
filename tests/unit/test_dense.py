"""The dense and attention matmuls give a row the same bits whatever rows share the call
(models/dense.py), in the dtypes the CPU engine runs: bfloat16 and float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbatch.models.dense import linear_for, min_attention_rows, row_invariant
from specbatch.models.llama import LlamaForward
from tests.helpers import tiny_llama

SMOLLM2_SHAPES = ((576, 576), (576, 1536), (1536, 576), (576, 8192))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernels_are_row_invariant_on_this_cpu(dtype):
    """The dtype ``--dtype auto`` takes on this CPU is row-invariant at SmolLM2's shapes.
    bfloat16 is checked only where auto would take it: on an Intel Xeon with AMX oneDNN's
    bfloat16 matmuls are not (docs/design.md "Which CPU"), so auto takes float32 there."""
    from specbatch.config import resolve_dtype

    if str(dtype).removeprefix("torch.") != resolve_dtype("auto", "cpu"):
        pytest.skip(f"--dtype auto does not take {dtype} on this CPU")
    assert row_invariant(dtype, SMOLLM2_SHAPES, 64)


@pytest.mark.parametrize("backend", ["kernel", "onednn"])
def test_float32_linear_equals_f_linear_closely_and_is_row_invariant(backend, monkeypatch):
    """float32 on CPU takes specbatch's kernel where it builds, oneDNN otherwise (MKL's sgemm
    rounds 1-3, 5-7, 9-11-row calls differently); either computes the same product: within
    float32 rounding of F.linear, a row's bits independent of the row count."""
    from specbatch.kernels import linear_cpu
    from specbatch.models import dense

    if backend == "onednn":
        monkeypatch.setattr(linear_cpu, "available", lambda: False)
    linear = linear_for(torch.float32, "cpu")
    assert linear is (linear_cpu.linear if backend == "kernel" else dense._onednn_linear)
    assert linear_for(torch.bfloat16, "cpu") is F.linear
    assert linear_for(torch.float64, "cpu") is F.linear
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((7, 576), (1536, 576), (1536,)))
    w = w / 24  # unit-scale outputs (K = 576)
    assert torch.allclose(linear(x, w, b), F.linear(x, w, b), rtol=1e-4, atol=1e-5)
    assert linear(x.view(7, 1, 576), w, b).shape == (7, 1, 1536)
    # the property the engine relies on: a row's bits do not depend on the row count
    full = linear(x, w, b)
    assert all(torch.equal(linear(x[:n], w, b), full[:n]) for n in range(2, 8))


def test_kernel_is_what_float32_uses_on_an_avx2_cpu_with_a_compiler():
    """On x86-64 with AVX2/FMA and a C compiler (this machine, CI) the kernel must build: a
    silent fall-back to oneDNN would cost 1.3-1.5x per step unnoticed."""
    import shutil

    from specbatch.kernels import cpu_build, linear_cpu

    if not (cpu_build.cpu_has_avx2_fma() and (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("needs an AVX2 CPU and a C compiler")
    assert linear_cpu.available()
    assert linear_for(torch.float32, "cpu") is linear_cpu.linear


def test_few_query_rows_are_padded_in_attention():
    """A decode step of one token has group (here 2) query rows per kv head; float32's batched
    matmul rounds 1-3-row calls differently from 4+, so _attention pads them to 4: the rows'
    outputs equal the same rows computed among 8."""
    assert min_attention_rows(torch.float32) == 4 and min_attention_rows(torch.bfloat16) == 2
    fwd = LlamaForward(tiny_llama(96, seed=5).float())
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 8, fwd.head_dim, generator=gen)
    keys, values = (torch.randn(2, 2, 512, fwd.head_dim, generator=gen) for _ in range(2))
    mask = torch.ones(2, 1, 8, 512, dtype=torch.bool)
    mask[1, :, :, 300:] = False
    full = fwd.backend._attention(q, keys, values, mask, exact=True)
    for rows in (1, 2, 3, 5):
        got = fwd.backend._attention(q[:, :, :rows], keys, values, mask[:, :, :rows], exact=True)
        assert torch.equal(got, full[:, :, :rows]), rows


def test_float32_weights_are_packed_once_and_repacked_when_changed():
    """oneDNN runs on a copy of the weight reordered once (not per call); the copy follows
    in-place changes of the weight, and packed results equal the plain weight's bit for bit."""
    from specbatch.models import dense

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(1536, 576, generator=gen) / 24
    x = torch.randn(5, 576, generator=gen)
    linear = dense._onednn_linear
    first = linear(x, w, None)
    packed = dense._PACKED[w][1]
    assert torch.equal(first, torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
    linear(x, w, None)
    assert dense._PACKED[w][1] is packed  # not reordered again
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(linear(x, w, None), first * 2)  # exact: scaling by 2 is exact
    assert dense._PACKED[w][1] is not packed


def test_the_memory_line_counts_onednn_packed_weights(monkeypatch):
    """``form_bytes`` of a weight oneDNN packed (the float32 path without the C kernels): the
    packed copy is an opaque MKL-DNN tensor with no storage to ask; its bytes are its
    elements'. It raised ``NotImplementedError`` there, after a run had written its output."""
    from specbatch.models import dense

    monkeypatch.setattr(dense, "linear_cpu", None)  # the C kernels hold no form of it
    w = torch.randn(96, 64)
    assert dense.form_bytes(w) == 0  # not packed yet
    dense._onednn_linear(torch.randn(3, 64), w, None)
    packed = dense._PACKED[w][1]
    assert packed is not w and packed.is_mkldnn
    assert dense.form_bytes(w) == 96 * 64 * 4


def test_fused_qkv_and_gate_up_are_views_and_follow_weight_changes():
    """q/k/v and gate/up run as one matmul each on a fused weight that the model's own
    parameters become views of (no second copy); the transformers model still gives the same
    logits; a second LlamaForward reuses the fused weight; changing a parameter in place or
    replacing it (``model.to``) rebuilds it, and the forward follows."""
    from specbatch.models import dense
    from tests.helpers import tiny_qwen2

    model = tiny_qwen2(seed=2).float()
    ids = torch.tensor([[5, 9, 17, 3]])
    before = model(ids).logits
    fwd = LlamaForward(model)
    attn = model.model.layers[0].self_attn
    w_qkv, b_qkv = fwd.qkv[0]
    assert w_qkv.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(w_qkv[attn.q_proj.weight.shape[0]:][:attn.k_proj.weight.shape[0]],
                       attn.k_proj.weight)
    assert b_qkv is not None and torch.equal(b_qkv[-attn.v_proj.bias.shape[0]:], attn.v_proj.bias)
    assert torch.equal(model(ids).logits, before)
    assert LlamaForward(model).qkv[0][0] is w_qkv
    with torch.no_grad():
        attn.v_proj.weight.mul_(2)
    again = LlamaForward(model).qkv[0][0]
    assert again is not w_qkv and torch.equal(again[-attn.v_proj.weight.shape[0]:],
                                              attn.v_proj.weight)
    model.double()
    assert LlamaForward(model).qkv[0][0].dtype == torch.float64
    mlp = model.model.layers[1].mlp
    gate_up = dense.fused_weight((mlp.gate_proj.weight, mlp.up_proj.weight))
    assert torch.equal(gate_up, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


def test_a_cpu_that_is_not_row_invariant_is_warned_about_once(monkeypatch, caplog):
    """A run builds several forwards over one model (memory fit, runner, calibration, draft):
    the warning that this CPU's bfloat16 matmuls round a row differently with the rows beside
    it is said once per process, not once per forward (a fresh user saw it twice a run)."""
    import logging

    from specbatch.models import llama

    monkeypatch.setattr(llama, "row_invariant", lambda *a: False)
    monkeypatch.setattr(llama, "_WARNED_NOT_INVARIANT", set(), raising=False)
    model = tiny_llama().to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="specbatch"):
        LlamaForward(model)
        LlamaForward(model)
        LlamaForward(tiny_llama(seed=1).to(torch.bfloat16))  # a draft model in the same dtype
    said = [r for r in caplog.records if "round a row differently" in r.getMessage()]
    assert len(said) == 1 and said[0].getMessage().startswith("bfloat16 matmuls"), said
