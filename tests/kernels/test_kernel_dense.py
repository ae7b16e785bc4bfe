"""kernels.matmul and kernels.rmsnorm: equal to their torch references within rounding, and a
row's bits the same at every row count and in any row order (what speculation needs on a GPU:
an M = 1 decode step and an M = k + 1 verify step of the same token agree).

Under the interpreter the invariance tests run the GPU's tile shapes (``config_for(...,
interpreted=False)``) on a slice of the weight's columns (two N tiles, the second partial):
the tiles of one N slice never read the others, so this is the full shape's kernel, cheaper.
Tolerances: float32 1e-5; float16/bfloat16 two units in the last place of the output (the
reference sums in another order; the interpreter also truncates float32 -> bfloat16 where a GPU
rounds to nearest).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels import matmul, rmsnorm
from specbatch.kernels.matmul import MatmulConfig, config_for, linear, linear_reference
from specbatch.kernels.rmsnorm import rms_norm, rms_norm_reference
from specbatch.models import dense
from specbatch.models.dense import choose_cuda_linear, probe_row_invariance

ROWS = (1, 2, 6, 16, 64, 100)
# float32: the torch reference itself is 1.7e-6 off a float64 product at K = 576 on an AMX Xeon
# (2 ** -20, the tolerance before, failed there at 1.6e-6); a wrong kernel is off by O(1)
EPS = {torch.float32: 1e-5, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}
# (in_features, out_features): SmolLM2-135M (hidden 576, inter 1536, 9 x 64 heads, 3 x 64 kv,
# vocab 49152) and Llama-1.5B (hidden 2048, inter 8192; fused gate/up, down)
SMOL = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576),
        "lm_head": (576, 49152)}
BIG = {"gate_up": (2048, 16384), "down": (8192, 2048)}


def _close(got, want, dtype):
    tol = EPS[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_linear_equals_reference(device, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 576, generator=gen).to(dtype).to(device)  # [..., K], 21 rows
    w = (torch.randn(200, 576, generator=gen) / 24).to(dtype).to(device)
    bias = torch.randn(200, generator=gen).to(dtype).to(device)
    for cfg in (None, config_for(200, 576, dtype, interpreted=False)):
        got = linear(x, w, bias, config=cfg)
        assert got.shape == (3, 7, 200) and got.dtype == dtype
        _close(got, linear_reference(x, w, bias), dtype)
        _close(linear(x, w, config=cfg), linear_reference(x, w), dtype)
    # strided inputs: a transposed x and a slice of a fused weight (q/k/v views)
    xt = torch.randn(576, 5, generator=gen).to(dtype).to(device).t()
    _close(linear(xt, w[40:120]), linear_reference(xt, w[40:120]), dtype)
    assert linear(x[:, :0], w).shape == (3, 0, 200)  # no rows: an empty result


def test_config_depends_on_the_weight_only():
    assert config_for(2048, 8192, torch.bfloat16, interpreted=False) == \
        MatmulConfig(16, 16, 256, num_warps=2, num_stages=4)  # Llama-1.5B down: 128 N tiles
    assert config_for(16384, 2048, torch.bfloat16, interpreted=False).block_n == 128
    assert config_for(960, 576, torch.bfloat16, interpreted=False).block_k == 64  # 576 = 9 x 64


def _sliced(shape, dtype):
    """(in, out) of a two-tile slice of ``shape``'s columns, and the full shape's tiles."""
    k, n = shape
    cfg = config_for(n, k, dtype, interpreted=False)
    return (k, cfg.block_n + cfg.block_n // 2), functools.partial(linear, config=cfg)


@pytest.mark.parametrize("model,layer", [("smol", name) for name in SMOL]
                         + [("1.5b", name) for name in BIG])
def test_linear_rows_are_invariant(device, model, layer):
    shape = (SMOL if model == "smol" else BIG)[layer]
    dtype = torch.bfloat16
    sliced, fn = _sliced(shape, dtype)
    report = probe_row_invariance(fn, [sliced], dtype, device, rows=ROWS, seed=3)
    entry = report[f"{sliced[0]}x{sliced[1]}"]
    assert entry["invariant"], entry
    # and the rows are right, not merely stable
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(6, sliced[0], generator=gen).to(dtype).to(device)
    w = (torch.randn(sliced[1], sliced[0], generator=gen) / sliced[0] ** 0.5).to(dtype).to(device)
    _close(fn(x, w), linear_reference(x, w), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_rows_are_invariant_in_other_dtypes(device, dtype):
    sliced, fn = _sliced(SMOL["qkv"], dtype)
    report = probe_row_invariance(fn, [sliced], dtype, device, rows=ROWS, seed=5)
    assert all(e["invariant"] for e in report.values()), report


def _split_k(matmul_fn):
    """A mutant of ``matmul_fn``: split-K whose split count grows with the row count, partial
    sums added after (as a BLAS may choose split-K for some M)."""
    def mutant(x, w, bias=None):
        splits = 1 if x.shape[0] <= 8 else 3
        parts = [matmul_fn(xc, wc) for xc, wc in zip(x.chunk(splits, -1), w.chunk(splits, -1))]
        return sum(parts[1:], parts[0])
    return mutant


@pytest.mark.parametrize("inner", ["torch", "triton"])
def test_probe_catches_row_count_dependent_reductions(device, inner):
    mutant = _split_k(F.linear if inner == "torch" else linear)
    report = probe_row_invariance(mutant, [(576, 24)], torch.float32, device, rows=ROWS, seed=6)
    entry = report["576x24"]
    assert not entry["invariant"] and entry["max_abs_diff"] > 0
    # the unsplit small calls differ from the split 100-row one
    assert set(entry["mismatched_rows"]) & {1, 2, 6}


def test_linear_checks_its_arguments(device):
    w = torch.ones(8, 16, device=device)
    with pytest.raises(ValueError, match="features"):
        linear(torch.ones(2, 15, device=device), w)
    with pytest.raises(ValueError, match="dtypes differ"):
        linear(torch.ones(2, 16, device=device).half(), w)
    with pytest.raises(ValueError, match="bias"):
        linear(torch.ones(2, 16, device=device), w, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="not one of"):
        linear(torch.ones(2, 16, device=device).double(), w.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("hidden", [576, 2048])
def test_rms_norm_equals_reference(device, dtype, hidden):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 9, hidden, generator=gen) * 3).to(dtype).to(device)
    w = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype).to(device)
    got = rms_norm(x, w, 1e-5)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, rms_norm_reference(x, w, 1e-5), dtype)
    if dtype == torch.float32:  # the engine's float32 op
        _close(got, F.rms_norm(x, (hidden,), w, 1e-5), dtype)


@pytest.mark.parametrize("per_program", [1, 16])  # 1 on a GPU, 16 under the interpreter
def test_rms_norm_rows_are_invariant(device, monkeypatch, per_program):
    monkeypatch.setattr(rmsnorm, "rows_per_program", lambda: per_program)
    gen = torch.Generator().manual_seed(8)
    dtype = torch.bfloat16
    x = (torch.randn(100, 576, generator=gen) * 2).to(dtype).to(device)
    w = (1 + torch.randn(576, generator=gen) / 4).to(dtype).to(device)
    full = rms_norm(x, w, 1e-5)
    for m in ROWS:
        pick = torch.randperm(100, generator=gen)[:m].to(device)
        assert torch.equal(rms_norm(x[pick], w, 1e-5), full[pick]), m
    with pytest.raises(ValueError, match="dtypes differ"):
        rms_norm(x, w.float(), 1e-5)


def _fake_probe(bad_shape=None):
    calls = []

    def probe(linear_fn, shapes, dtype, device, rows):
        calls.append((linear_fn, tuple(shapes), rows))
        return {f"{k}x{n}": {"invariant": (k, n) != bad_shape,
                             "mismatched_rows": [] if (k, n) != bad_shape else [1, 3]}
                for k, n in shapes}
    return probe, calls


def test_cuda_choice_takes_cublas_only_where_the_probe_passes(monkeypatch, caplog):
    applied = []
    monkeypatch.setattr(dense, "apply_cublas_batch_invariant", lambda: applied.append(1))
    monkeypatch.delenv("SPECBATCH_CUDA_LINEAR", raising=False)
    shapes = ((64, 128), (128, 64))
    caplog.set_level(logging.INFO, logger="specbatch.models.dense")
    probe, calls = _fake_probe()
    assert choose_cuda_linear(torch.bfloat16, "cuda", shapes, probe=probe) is F.linear
    assert applied and calls[0][0] is F.linear and calls[0][1] == shapes
    assert max(calls[0][2]) >= 2048  # up to a prefill forward's tokens
    assert "cublas" in caplog.text and "row-invariant" in caplog.text
    probe, calls = _fake_probe(bad_shape=(128, 64))
    assert choose_cuda_linear(torch.bfloat16, "cuda", shapes, probe=probe) is matmul.linear
    assert "128x64 at [1, 3] rows" in caplog.text
    assert len([r for r in caplog.records if "dense layers" in r.message]) == 2  # one line each
    monkeypatch.setenv("SPECBATCH_CUDA_LINEAR", "triton")
    probe, calls = _fake_probe()
    assert choose_cuda_linear(torch.float16, "cuda", shapes, probe=probe) is matmul.linear
    assert not calls
    monkeypatch.setenv("SPECBATCH_CUDA_LINEAR", "fast")
    with pytest.raises(ValueError, match="SPECBATCH_CUDA_LINEAR='fast'"):
        choose_cuda_linear(torch.float16, "cuda", ((8, 8),), probe=probe)


def test_linear_for_takes_the_triton_kernels_where_enabled(monkeypatch):
    monkeypatch.setenv("SPECBATCH_KERNELS", "1")
    assert dense.linear_for(torch.bfloat16, "cpu") is matmul.linear
    assert dense.linear_name(matmul.linear) == "triton"
    monkeypatch.setenv("SPECBATCH_KERNELS", "0")
    assert dense.linear_for(torch.bfloat16, "cpu") is F.linear


_COMPILE_FOR_HOPPER = """
import json, sys, torch, triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:
    sys.exit("SKIP: this triton has no ahead-of-time compile API")
from specbatch.kernels import matmul, rmsnorm
cfg = matmul.config_for(2048, 8192, torch.bfloat16)
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32",
       "N": "i32", "K": "i32", "s_xm": "i32", "s_xk": "constexpr", "s_wn": "i32",
       "s_wk": "constexpr", "s_om": "i32", "HAS_BIAS": "constexpr", "IEEE": "constexpr",
       "UPCAST": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
       "BLOCK_K": "constexpr"}
consts = {"s_xk": 1, "s_wk": 1, "HAS_BIAS": True, "IEEE": False, "UPCAST": False,
          "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6, 7, 9, 11)}
target = GPUTarget("cuda", 90, 32)
try:
    mm = triton.compile(ASTSource(matmul._linear_kernel, sig, consts, attrs), target=target,
                        options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
except Exception as err:
    if "ptxas" in str(err) or "backend" in str(err).lower():
        sys.exit(f"SKIP: cannot compile for sm_90 here: {err}")
    raise
sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "H": "i32",
       "s_xm": "i32", "s_om": "i32", "eps": "fp32", "ROWS": "constexpr", "BLOCK": "constexpr"}
rn = triton.compile(ASTSource(rmsnorm._rms_norm_kernel, sig, {"ROWS": 1, "BLOCK": 2048}),
                    target=target, options={"num_warps": 4})
print(json.dumps({"mma": "mma.sync" in mm.asm["ptx"], "cp_async": "cp.async" in mm.asm["ptx"],
                  "rms_store": "st.global" in rn.asm["ptx"]}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile them")
def test_kernels_compile_for_hopper():
    """Without a GPU: compile both kernels ahead of time for sm_90 (Triton's bundled ptxas; in a
    child without the interpreter), with the specializations the JIT makes for contiguous
    tensors, so a GPU-only compile error shows here; and the matmul's K loop is
    software-pipelined (cp.async loads), as its speed needs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode and "SKIP:" in done.stderr:
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == \
        {"mma": True, "cp_async": True, "rms_store": True}
