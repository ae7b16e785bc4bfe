"""GGUF Q4_K / Q6_K weights in the 8-bit-activation matmul (kernels/kquant.py, csrc/linear_q8.c):
codes read from the GGUF that give the float32 weights bit for bit, outputs within 8-bit
rounding of a dequantise-then-float matmul, the same bits at every row count and on AVX-512
VNNI, AVX2 and portable C, and a K-quant GGUF whose engine outputs do not depend on the proposer
or the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.kernels import kquant, linear_cpu
from tests.helpers import at_thread_counts

pytestmark = pytest.mark.skipif(not linear_cpu.available(),
                                reason="needs an AVX2/FMA CPU and a C compiler")


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return np.frombuffer(values.astype(np.float16).tobytes(), np.uint8).reshape(*values.shape, 2)


def random_k_blocks(kind: str, rows: int, k: int, rng: np.random.Generator,
                    scale: float = 1.0) -> np.ndarray:
    """Random valid super-blocks ``[rows, k / 256 * bytes]`` uint8: every code, sub-scale and
    min drawn uniformly, float16 d (and dmin) sized so that |w| ~ scale / sqrt(k)."""
    nb = k // 256
    if kind == "Q4_K":
        b = rng.integers(0, 256, (rows, nb, kquant.Q4_K_BYTES), dtype=np.uint8)
        b[..., 0:2] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 300 / k ** 0.5)
        b[..., 2:4] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 300 / k ** 0.5)
    else:
        b = rng.integers(0, 256, (rows, nb, kquant.Q6_K_BYTES), dtype=np.uint8)
        b[..., 208:210] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 1000 / k ** 0.5)
    return b.reshape(rows, -1)


def _dequantized(kind: str, raw: np.ndarray) -> torch.Tensor:
    """What transformers loads: the gguf package's own dequantisation, float32 [rows, k]"""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).copy())


def write_gguf(path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    """A GGUF holding only ``name -> (kind, raw blocks)`` tensors (no model: for GGUFCodes)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(GGUFCodes, {name: float32 weight}) for a Q4_K, a Q6_K and a fused q/k/v of both."""
    rng = np.random.default_rng(35)
    raws = {"q": ("Q4_K", random_k_blocks("Q4_K", 200, 512, rng)),
            "k": ("Q4_K", random_k_blocks("Q4_K", 40, 512, rng)),
            "v": ("Q6_K", random_k_blocks("Q6_K", 40, 512, rng)),
            "down": ("Q6_K", random_k_blocks("Q6_K", 96, 768, rng))}
    path = tmp_path_factory.mktemp("kquant") / "codes.gguf"
    write_gguf(path, raws)
    floats = {name: _dequantized(kind, raw) for name, (kind, raw) in raws.items()}
    floats["qkv"] = torch.cat([floats["q"], floats["k"], floats["v"]])
    # rows in another order (as transformers un-permutes llama's q/k heads)
    floats["shuffled"] = floats["q"][torch.randperm(200, generator=torch.Generator().manual_seed(1))]
    return kquant.GGUFCodes(path), floats


def test_codes_match_the_gguf_dequantisation(weights):
    source, floats = weights
    assert len(source) == 200 + 40 + 40 + 96
    for name, kind in (("q", "Q4_K"), ("v", "Q6_K"), ("down", "Q6_K"), ("shuffled", "Q4_K")):
        runs = source.find(floats[name])
        assert runs is not None and len(runs) == 1, name
        r0, r1, got, form = runs[0]
        assert (r0, r1, got) == (0, floats[name].shape[0], kind)
        assert torch.equal(kquant.dequantize(kind, form).view(torch.int32),
                           floats[name].view(torch.int32))
    runs = source.find(floats["qkv"])
    assert [(r0, r1, kind) for r0, r1, kind, _ in runs] == [(0, 240, "Q4_K"), (240, 280, "Q6_K")]
    # a row changed by one ulp, or rows of no K-quant tensor: no codes (the float32 path)
    nudged = floats["q"].clone()
    nudged[7, 300] = torch.nextafter(nudged[7, 300], torch.tensor(1.0))
    assert source.find(nudged) is None
    assert source.find(torch.randn(8, 512)) is None


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("name,kind", [("q", linear_cpu.Q4_1_X8), ("down", linear_cpu.Q6_K_X8),
                                       ("qkv", linear_cpu.SEGMENTS),
                                       ("shuffled", linear_cpu.Q4_1_X8)])
def test_close_to_the_dequantised_matmul_and_row_invariant(weights, name, kind):
    """Within 8-bit activation rounding of the float64 matmul of the dequantised weights
    (stated tolerance: 2% of the largest output, as for Q4_1 / Q8_0; the weights themselves are
    exact), and a row's bits the same at 1..17 and 64 rows, in any order."""
    source, floats = weights
    w = floats[name].clone()
    n, k = w.shape
    gen = torch.Generator().manual_seed(n + k)
    b = torch.randn(n, generator=gen)
    x = torch.randn(64, k, generator=gen)
    x[5, :32] = 0.0  # a block of zeros: d = 0
    assert linear_cpu.use_int8_activations(w, source)
    assert linear_cpu._PACKED[w][1][0] == kind
    full = linear_cpu.linear(x, w, b)
    exact = _reference(x, w).double() + b.double()
    err = (full.double() - exact).abs().max().item() / exact.abs().max().item()
    assert 1e-5 < err < 2e-2, err
    for rows in list(range(1, 18)) + [64]:
        pick = torch.randperm(64, generator=gen)[:rows]
        assert torch.equal(linear_cpu.linear(x[pick], w, b), full[pick]), rows
    outs = at_thread_counts(lambda: linear_cpu.linear(x[:11], w, b))
    assert all(torch.equal(o, full[:11]) for o in outs)


def test_segments_are_the_runs_apart(weights):
    """A fused q/k/v of Q4_K and Q6_K rows: each output column has the bits of its own rows'
    weight run alone."""
    source, floats = weights
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(3))
    fused = floats["qkv"].clone()
    linear_cpu.use_int8_activations(fused, source)
    apart = []
    for name in ("q", "k", "v"):
        w = floats[name].clone()
        linear_cpu.use_int8_activations(w, source)
        apart.append(linear_cpu.linear(x, w))
    assert torch.equal(linear_cpu.linear(x, fused), torch.cat(apart, dim=1))


@pytest.mark.parametrize("name", ["q", "down", "qkv"])
def test_every_kernel_gives_the_same_bits(weights, name):
    """AVX-512 VNNI (where the CPU has it), AVX2 and the portable C loop: equal outputs at 1-21
    rows (AVX2 tiles of 4, VNNI tiles of 8, partial column groups)."""
    source, floats = weights
    w = floats[name].clone()
    linear_cpu.use_int8_activations(w, source)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(21, w.shape[1], generator=gen) * torch.rand(21, 1, generator=gen) * 10
    before = linear_cpu.int8_kernel()
    kernels = ["portable", "avx2"] + (["vnni"] if linear_cpu.int8_kernel("vnni") == "vnni" else [])
    try:
        outs = {}
        for kernel in kernels:
            assert linear_cpu.int8_kernel(kernel) == kernel
            outs[kernel] = [linear_cpu.linear(x[:m], w) for m in (1, 3, 5, 8, 21)]
    finally:
        linear_cpu.int8_kernel(before)
    for kernel in kernels[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[kernel], outs["portable"])), kernel
    assert all(torch.equal(o, outs["portable"][-1][:o.shape[0]]) for o in outs["portable"])
