"""GGUF Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 weights in the 8-bit-activation matmul
(kernels/kquant.py, csrc/linear_q8.c): codes read from the GGUF (by tensor name, or by value)
that give the float32 weights bit for bit, outputs within 8-bit rounding of a
dequantise-then-float matmul, the same bits at every row count and on AVX-512 VNNI, AVX2 and
portable C, and K-quant / Q5_0 GGUFs whose engine outputs do not depend on the proposer or the
batch."""

from __future__ import annotations

import gc

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
    if kind in ("Q5_0", "Q5_1"):  # blocks of 32: float16 d (and m), 4 bytes qh, 16 bytes qs
        nb = k // 32
        nbytes = kquant.Q5_0_BYTES if kind == "Q5_0" else kquant.Q5_1_BYTES
        b = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
        b[..., 0:2] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 10 / k ** 0.5)
        if kind == "Q5_1":
            b[..., 2:4] = _f16_bytes(-rng.uniform(0.5, 1.5, (rows, nb)) * scale * 1.6 / k ** 0.5)
        return b.reshape(rows, -1)
    if kind in ("Q4_K", "Q5_K"):
        nbytes = kquant.Q4_K_BYTES if kind == "Q4_K" else kquant.Q5_K_BYTES
        b = rng.integers(0, 256, (rows, nb, nbytes), dtype=np.uint8)
        b[..., 0:2] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 300 / k ** 0.5)
        b[..., 2:4] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 300 / k ** 0.5)
    else:
        b = rng.integers(0, 256, (rows, nb, kquant.Q6_K_BYTES), dtype=np.uint8)
        b[..., 208:210] = _f16_bytes(rng.uniform(0.5, 1.5, (rows, nb)) * scale / 1000 / k ** 0.5)
    return b.reshape(rows, -1)


def quantize_k(kind: str, w: np.ndarray) -> np.ndarray:
    """float32 ``[rows, k]`` -> Q4_K / Q6_K super-blocks ``[rows, k / 256 * bytes]`` uint8 in
    llama.cpp's layout (ggml-common.h), scales from each sub-block's range (a plain quantiser,
    not llama.cpp's search: any valid blocks do for these tests)."""
    rows, k = w.shape
    nb = k // 256
    f16 = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    if kind == "Q4_K":
        sub = w.reshape(rows, nb, 8, 32)
        lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
        d = f16((hi - lo).max(-1) / 15 / 63)
        dmin = f16((-lo).max(-1) / 63)
        sc = np.clip(np.rint((hi - lo) / 15 / np.where(d > 0, d, 1)[..., None]), 0, 63)
        mn = np.clip(np.rint(-lo / np.where(dmin > 0, dmin, 1)[..., None]), 0, 63)
        D, M = d[..., None] * sc, dmin[..., None] * mn
        q = np.clip(np.rint((sub + M[..., None]) / np.where(D > 0, D, 1)[..., None]), 0, 15)
        sc, mn, q = sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)
        out = np.zeros((rows, nb, kquant.Q4_K_BYTES), np.uint8)
        out[..., 0:2], out[..., 2:4] = _f16_bytes(d), _f16_bytes(dmin)
        out[..., 4:8] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
        out[..., 8:12] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
        out[..., 12:16] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
        q = q.reshape(rows, nb, 4, 2, 32)  # run i: sub-block 2i low nibbles, 2i + 1 high
        out[..., 16:] = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, nb, 128)
        return out.reshape(rows, -1)
    sub = w.reshape(rows, nb, 16, 16)
    amax = np.abs(sub).max(-1)
    d = f16(amax.max(-1) / 32 / 127)
    sc = np.clip(np.rint(amax / 32 / np.where(d > 0, d, 1)[..., None]), -128, 127)
    D = d[..., None] * sc
    q = np.clip(np.rint(sub / np.where(D > 0, D, 1)[..., None]), -32, 31) + 32
    q = q.astype(np.uint8).reshape(rows, nb, 2, 128)  # two halves of 128 k
    out = np.zeros((rows, nb, kquant.Q6_K_BYTES), np.uint8)
    low, high = q & 15, q >> 4
    out[..., :128] = (low[..., :64] | (low[..., 64:] << 4)).reshape(rows, nb, 128)
    h = high.reshape(rows, nb, 2, 4, 32)  # element 32 s + t of a half: bits 2s of byte t
    out[..., 128:192] = (h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4)
                         | (h[:, :, :, 3] << 6)).reshape(rows, nb, 64)
    out[..., 192:208] = sc.astype(np.int8).view(np.uint8)
    out[..., 208:210] = _f16_bytes(d)
    return out.reshape(rows, -1)


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
            "down": ("Q6_K", random_k_blocks("Q6_K", 96, 768, rng)),
            "q5": ("Q5_K", random_k_blocks("Q5_K", 50, 512, rng)),
            "q5_0": ("Q5_0", random_k_blocks("Q5_0", 70, 96, rng)),
            "q5_1": ("Q5_1", random_k_blocks("Q5_1", 40, 96, rng))}
    path = tmp_path_factory.mktemp("kquant") / "codes.gguf"
    write_gguf(path, raws)
    floats = {name: _dequantized(kind, raw) for name, (kind, raw) in raws.items()}
    floats["qkv"] = torch.cat([floats["q"], floats["k"], floats["v"]])
    floats["q5_mix"] = torch.cat([floats["q5_0"], floats["q5_1"]])
    # rows in another order (as transformers un-permutes llama's q/k heads)
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1))
    floats["shuffled"] = floats["q"][order]
    return kquant.GGUFCodes(path), floats


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_quantiser_round_trip(kind):
    """The tests' quantiser writes blocks that the gguf package reads back close to the input
    (so the engine test's model has ordinary zero-mean weights)."""
    w = np.random.default_rng(2).standard_normal((8, 512)).astype(np.float32)
    back = _dequantized(kind, quantize_k(kind, w)).numpy()
    rel = np.abs(back - w).max() / np.abs(w).max()
    assert rel < 0.08, rel  # a 4-bit step is 1/15 of a sub-block range


def test_codes_match_the_gguf_dequantisation(weights):
    source, floats = weights
    assert len(source) == 200 + 40 + 40 + 96 + 50 + 70 + 40
    for name, kind in (("q", "Q4_K"), ("v", "Q6_K"), ("down", "Q6_K"), ("shuffled", "Q4_K"),
                       ("q5", "Q5_K"), ("q5_0", "Q5_0"), ("q5_1", "Q5_1")):
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


def _same_runs(a, b) -> bool:
    return len(a) == len(b) and all(
        ra[:3] == rb[:3] and all(torch.equal(x, y) for x, y in zip(ra[3], rb[3]))
        for ra, rb in zip(a, b))


def test_codes_by_name_are_the_codes_found_by_value(weights):
    """``GGUFCodes.named`` (the engine's int8 load: llama.cpp's tensor names) gives the codes
    ``find`` matches by value, stacked in the order named, with rows reordered as told (a
    llama q / k un-permuted by transformers); a probe weight that is not those codes' values
    (another tensor, rows in another order, one ulp off in a probed row), a missing name or
    mismatched K give None."""
    source, floats = weights
    for name in ("q", "v", "down", "q5", "q5_0", "q5_1"):
        assert _same_runs(source.named([name], probes=[floats[name]]), source.find(floats[name]))
    qkv = source.named(["q", "k", "v"], probes=[floats["q"], floats["k"], floats["v"]])
    assert [r[:3] for r in qkv] == [(0, 240, "Q4_K"), (240, 280, "Q6_K")]
    assert _same_runs(qkv, source.find(floats["qkv"]))
    assert _same_runs(source.named(["q5_0", "q5_1"]), source.find(floats["q5_mix"]))
    order = torch.randperm(200, generator=torch.Generator().manual_seed(1))
    assert _same_runs(source.named(["q"], [order], [floats["shuffled"]]),
                      source.find(floats["shuffled"]))
    assert source.named(["q"], None, [floats["shuffled"]]) is None
    assert source.named(["k"], probes=[floats["v"]]) is None
    nudged = floats["q5_0"].clone()
    nudged[1, 40] = torch.nextafter(nudged[1, 40], torch.tensor(1.0))
    assert source.named(["q5_0"], probes=[nudged]) is None
    assert source.named(["q", "nope"]) is None and source.kind("nope") is None
    assert source.named(["q", "down"]) is None  # K 512 and 768


def _reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("name,kind", [("q", linear_cpu.Q4_K_X8), ("down", linear_cpu.Q6_K_X8),
                                       ("qkv", linear_cpu.SEGMENTS),
                                       ("q5", linear_cpu.Q5_K_X8),
                                       ("q5_0", linear_cpu.Q8_0_X8),
                                       ("q5_1", linear_cpu.Q5_K_X8),
                                       ("q5_mix", linear_cpu.SEGMENTS),
                                       ("shuffled", linear_cpu.Q4_K_X8)])
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


@pytest.mark.parametrize("name", ["q", "down", "qkv", "q5", "q5_0", "q5_1", "q5_mix"])
def test_every_kernel_gives_the_same_bits(weights, name):
    """AVX-512 VNNI (where the CPU has it), AVX2 and the portable C loop: equal outputs at 1-21
    rows (AVX2 tiles of 4, VNNI tiles of 8, partial column groups)."""
    source, floats = weights
    w = floats[name].clone()
    linear_cpu.use_int8_activations(w, source)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(21, w.shape[1], generator=gen) * torch.rand(21, 1, generator=gen) * 10
    from tests.unit.test_linear_q8 import assert_same_bits_on_every_isa

    assert_same_bits_on_every_isa(x, w)


def _fma32(a, b, c) -> np.float32:
    """fmaf: a * b + c (float32 values) rounded once to float32, to nearest even (exact
    rational arithmetic, so no double rounding)."""
    from fractions import Fraction

    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    best = np.float32(float(exact))
    for near in (np.nextafter(best, np.float32(-np.inf)), np.nextafter(best, np.float32(np.inf))):
        gap, now = abs(Fraction(float(near)) - exact), abs(Fraction(float(best)) - exact)
        if gap < now or (gap == now and int(near.view(np.int32)) % 2 == 0):
            best = near
    return best


def _documented(kind: str, form: tuple, x: np.ndarray, cols: list[int]) -> np.ndarray:
    """csrc/linear_q8.c's arithmetic, one output element at a time: each row of x rounded to
    8 bits per block of 32 (d_x = max |x| / 127, q_x = rint(x / d_x) as x * (1 / d_x)), exact
    integer sums per block (Q6_K: per half), and per block in order acc = fma(sum, d_w * d_x,
    acc) then Q4_K's acc = fma(m_w, d_x * S, acc) or Q6_K's acc = fma(sum_hi, d_hi * d_x, acc),
    with d_w, m_w (d_lo, d_hi) the float32 values of ``kquant``'s form. -> ``[rows, cols]``"""
    f32 = np.float32
    rows, k = x.shape
    out = np.zeros((rows, len(cols)), np.float32)
    for i in range(rows):
        for col, c in enumerate(cols):
            acc = f32(0)
            for b in range(k // 32):
                xb = x[i, 32 * b:32 * b + 32]
                dx = f32(np.abs(xb).max()) / f32(127)
                qx = np.rint(xb * (f32(1) / dx if dx > 0 else f32(0))).astype(np.int64)
                if kind == "Q4_K":
                    dw, mw, q = form[0][c, b], form[1][c, b], form[2][c, 32 * b:32 * b + 32]
                    acc = _fma32(f32(int(q.astype(np.int64) @ qx)), dw * dx, acc)
                    acc = _fma32(mw, dx * f32(int(qx.sum())), acc)
                else:
                    d, q = form[0][c], form[1][c, 32 * b:32 * b + 32].astype(np.int64)
                    acc = _fma32(f32(int(q[:16] @ qx[:16])), d[2 * b] * dx, acc)
                    acc = _fma32(f32(int(q[16:] @ qx[16:])), d[2 * b + 1] * dx, acc)
            out[i, col] = acc
    return out


@pytest.mark.parametrize("name,kind", [("q", "Q4_K"), ("down", "Q6_K")])
def test_every_kernel_computes_the_documented_arithmetic(weights, name, kind):
    """Q4_K and Q6_K keep the GGUF's float16 super-block scales and integer sub-scales and
    multiply them back in the kernel: every kernel's outputs equal, bit for bit, the
    documented per-element arithmetic on d_w = d sc and m_w = -(dmin m) (exact float32
    products) of kquant's form, at 1 and 5 rows, for a full and the last, partial column
    group."""
    source, floats = weights
    w = floats[name].clone()
    (_, _, got, form), = source.find(w)
    assert got == kind
    form = [t.numpy() if t.dtype != torch.float16 else t for t in form]
    if kind == "Q4_K":  # the parts give d_w and m_w exactly
        assert np.array_equal(form[0], np.repeat(form[3].float().numpy(), 8, 1) * form[5])
        assert np.array_equal(form[1], -(np.repeat(form[4].float().numpy(), 8, 1) * form[6]))
    else:
        assert np.array_equal(form[0], np.repeat(form[2].float().numpy(), 16, 1) * form[3])
    linear_cpu.use_int8_activations(w, source)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, w.shape[1], generator=gen) * torch.rand(5, 1, generator=gen) * 4
    n = w.shape[0]
    cols = [0, 1, 7, 15, 16, n - 1]
    want = _documented(kind, form, x.numpy(), cols)
    before = linear_cpu.int8_kernel()
    kernels = ["portable", "avx2"] + (["vnni"] if linear_cpu.int8_kernel("vnni") == "vnni" else [])
    try:
        for isa in kernels:
            linear_cpu.int8_kernel(isa)
            for m in (1, 5):
                got = linear_cpu.linear(x[:m], w)[:, cols].numpy()
                assert np.array_equal(got.view(np.int32), want[:m].view(np.int32)), (isa, m)
    finally:
        linear_cpu.int8_kernel(before)


def test_q4_k_layout_gives_q4_1s_bits(weights):
    """Q4_K's compact layout (float16 d, dmin per 256 k and 6-bit sc, m per 32, multiplied in
    the kernel) gives the bits of the same weights in Q4_1's layout (float32 d_w, m_w per
    block): the same numbers in the same arithmetic."""
    source, floats = weights
    w = floats["q"].clone()
    (_, _, _, form), = source.find(w)
    n, k = w.shape
    as_q4_1 = linear_cpu._q4_1_x8(form[0], form[1], form[2], n, k // 32)
    assert as_q4_1[0] == linear_cpu.Q4_1_X8
    linear_cpu.use_int8_activations(w, source)
    assert linear_cpu.packed(w)[0] == linear_cpu.Q4_K_X8
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(12))
    lib = linear_cpu._library()
    y = torch.empty(13, n)
    assert lib.sb_linear_quant(x.data_ptr(), k, as_q4_1[0], as_q4_1[1].data_ptr(),
                               as_q4_1[2].data_ptr(), None, y.data_ptr(), n, 13, n, k) == 0
    assert torch.equal(linear_cpu.linear(x, w), y)
    # and the bytes a weight takes: 296 per 512 weights against 384
    assert linear_cpu.form_bytes(w) == -(-n // 16) * (k // 32) * (288 + 8)


# GGUF type per tensor: Q4_K_M's mix, and what llama.cpp writes for Q4_K_M where a row length
# is not a multiple of 256 (Q5_0 for Q4_K, Q8_0 for Q6_K: most of the Qwen2.5-Coder 0.5B)
MIXES = {"Q4_K_M": {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
                    "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
                    "ffn_up": "Q4_K", "ffn_down": "Q6_K"},
         "Q5_0": {"token_embd": "Q8_0", "attn_q": "Q5_0", "attn_k": "Q5_0", "attn_v": "Q8_0",
                  "attn_output": "Q5_0", "ffn_gate": "Q5_0", "ffn_up": "Q5_0",
                  "ffn_down": "Q8_0"}}


def write_tiny_kquant_gguf(path, seed: int = 0, mix: str = "Q4_K_M") -> None:
    """A 2-layer Llama GGUF as ``test_loader.write_tiny_gguf``'s, at hidden 256 / ffn 512 (K a
    multiple of 256) with the tensor types of ``MIXES[mix]``: Q4_K_M's (Q4_K q, k, o, gate,
    up and embedding; Q6_K v, down and output, so the fused q/k/v holds both kinds) or Q5_0's
    (Q5_0 and Q8_0, no output.weight: the lm_head is the embedding)."""
    import gguf

    from tests.unit.test_loader import tiny_llama_gguf_writer

    hidden, num_layers, num_heads, num_kv_heads, ffn = 256, 2, 4, 2, 512
    writer, tokens = tiny_llama_gguf_writer(path, "tiny-kquant", hidden, num_layers, num_heads,
                                            num_kv_heads, ffn)
    rng = np.random.default_rng(seed)
    kinds = MIXES[mix]

    def add(name: str, rows: int, cols: int) -> None:
        kind = kinds[name.split(".")[-2]]
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        w = (rng.standard_normal((rows, cols)) / cols ** 0.5).astype(np.float32)
        raw = quantize_k(kind, w) if kind.endswith("_K") else gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, raw, raw_dtype=qtype)

    add("token_embd.weight", len(tokens), hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if "output" in kinds:
        add("output.weight", len(tokens), hidden)
    head_dim = hidden // num_heads
    for i in range(num_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (
                ("attn_q", hidden, hidden), ("attn_k", num_kv_heads * head_dim, hidden),
                ("attn_v", num_kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            add(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_q5_0_gguf_runs_int8_by_default_on_its_codes(tmp_path):
    """A Q5_0 + Q8_0 GGUF (most of the Qwen2.5-Coder 0.5B's mix; a tied lm_head): ``--dtype auto``
    takes int8 and says so; every dense weight runs on the file's codes (Q5_0 as the Q8_0
    kind, codes q - 16), the fused q/k/v as segments of Q5_0 and Q8_0 rows; greedy outputs
    do not depend on the proposer or the batch."""
    from specbatch.config import auto_dtype
    from specbatch.models.llama import LlamaForward
    from specbatch.models.loader import load_model
    from tests.unit.test_linear_q8 import engine_runs_agree

    path = tmp_path / "tiny-q5_0.gguf"
    write_tiny_kquant_gguf(path, mix="Q5_0")
    assert auto_dtype("cpu", str(path)) == ("int8", "GGUF Q5_0 + Q8_0 codes on the int8 kernels")
    fwd = LlamaForward(load_model(str(path), dtype="int8", cache_dir=tmp_path / "cache").model)
    kind = lambda w: linear_cpu._PACKED[w][1][0]  # noqa: E731
    layer = fwd.layers[0]
    assert fwd.lm_head is fwd.embed
    assert kind(fwd.qkv[0][0]) == linear_cpu.SEGMENTS
    assert {p[0] for p in linear_cpu._PACKED[fwd.qkv[0][0]][1][3]} == {linear_cpu.Q8_0_X8}
    assert (kind(fwd.gate_up[0]) == kind(layer.self_attn.o_proj.weight)
            == kind(layer.mlp.down_proj.weight) == kind(fwd.lm_head) == linear_cpu.Q8_0_X8)
    assert linear_cpu.released(fwd.gate_up[0]) and not linear_cpu.released(fwd.embed)
    engine_runs_agree(fwd, vocab=256)


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_0", "Q4_1", "Q8_0"])
def test_int8_load_takes_codes_by_name_with_the_bits_of_value_matching(tmp_path, monkeypatch,
                                                                        mix):
    """The int8 load takes every dense weight's codes by its GGUF tensor names: no row is
    matched by value (``GGUFCodes.find``) and no q/k/v or gate/up is concatenated from float32
    values (``dense.fused_weight``); the logits are those of the earlier load (matching by
    value; Q4_1 / Q8_0: codes derived from the floats) bit for bit, with llama's q / k rows
    un-permuted as transformers does. (Q5_0 + Q8_0: by value, the q/k/v of both kinds found
    no codes.)"""
    from specbatch.kernels import kquant
    from specbatch.models import dense
    from specbatch.models.llama import LlamaForward
    from specbatch.models.loader import load_model
    from tests.unit.test_loader import write_tiny_gguf

    path = tmp_path / f"tiny-{mix}.gguf"
    if mix in MIXES:
        write_tiny_kquant_gguf(path, mix=mix)
    else:  # the SmolLM2 kinds: layers Q4_1 or Q8_0, embedding and lm_head F32
        write_tiny_gguf(path, linear_type=mix)
    ids, pos = torch.tensor([[3, 17, 42, 7, 99, 5, 200]]), torch.arange(7)[None]

    def logits() -> torch.Tensor:
        model = load_model(str(path), dtype="int8", cache_dir=tmp_path / "cache").model
        fwd = LlamaForward(model)
        held.append(linear_cpu.released(fwd.qkv[1][0]) and linear_cpu.released(fwd.gate_up[1]))
        return fwd.forward(ids, pos, fwd.new_cache(1, 16), torch.tensor([0]))

    held = []

    find = kquant.GGUFCodes.find

    def find_nothing(self, weight):  # (an F32 lm_head is looked up, and not found)
        assert find(self, weight) is None, "codes matched by value"

    def refuse(*args, **kwargs):
        raise AssertionError("float32 values concatenated")

    with monkeypatch.context() as m:
        m.setattr(kquant.GGUFCodes, "find", find_nothing)
        m.setattr(dense, "fused_weight", refuse)
        by_name = logits()
    monkeypatch.setattr(kquant.GGUFCodes, "named", lambda self, *a, **k: None)
    by_value = logits()
    if mix == "Q5_0":  # by value, a q/k/v of Q5_0 and Q8_0 rows has no codes: float32 panels
        assert held == [True, False] and not torch.equal(by_value, by_name)
    else:
        assert held == [True, True] and torch.equal(by_value, by_name)


def test_kquant_gguf_engine_outputs_do_not_depend_on_proposer_or_batch(tmp_path):
    """A Q4_K / Q6_K GGUF loaded with dtype int8 runs every dense layer on its K-quant codes;
    greedy outputs are equal for none / ngram k 3 at batch 1 and 4, and the logits are near
    the float32 ones (the same GGUF, dequantised) but not equal."""
    from specbatch.models.llama import LlamaForward
    from specbatch.models.loader import load_model
    from tests.unit.test_linear_q8 import engine_runs_agree

    path = tmp_path / "tiny-kquant.gguf"
    write_tiny_kquant_gguf(path)
    fwd = LlamaForward(load_model(str(path), dtype="int8", cache_dir=tmp_path / "cache").model)
    assert fwd.activations == "int8"
    kind = lambda w: linear_cpu._PACKED[w][1][0]  # noqa: E731
    layer = fwd.layers[0]
    assert kind(fwd.qkv[0][0]) == linear_cpu.SEGMENTS  # Q4_K q, k rows; Q6_K v rows
    assert kind(fwd.gate_up[0]) == kind(layer.self_attn.o_proj.weight) == linear_cpu.Q4_K_X8
    assert kind(layer.mlp.down_proj.weight) == kind(fwd.lm_head) == linear_cpu.Q6_K_X8
    prompts, runs = engine_runs_agree(fwd, vocab=256)
    assert len({tuple(ids) for ids in runs[0]}) > 1  # not one degenerate output for all
    f32 = LlamaForward(load_model(str(path), dtype="float32", cache_dir=tmp_path / "cache").model)
    logits = [f.forward(torch.tensor([prompts[0][:8]]), torch.arange(8)[None],
                        f.new_cache(1, 16), torch.tensor([0])) for f in (fwd, f32)]
    gap = (logits[0] - logits[1]).abs().max().item()
    assert 0 < gap < 0.05 * logits[1].abs().max().item()


def test_int8_model_holds_codes_not_float32(tmp_path, monkeypatch):
    """dtype int8 releases the float32 values of every dense weight the kernels hold codes of
    (fused q/k/v and gate/up with their parameters, o, down, an untied lm_head), one weight at
    a time; the embedding and norms stay float32. Releasing changes no logit bit, a second
    forward of the same model reuses the codes, ``weight_bytes`` counts what is held (codes +
    float32 left), and transformers' forward on the model is refused."""
    from specbatch.models.llama import LlamaForward
    from specbatch.models.loader import load_model
    from specbatch.spec_decode.draft import weight_bytes

    path = tmp_path / "tiny-kquant.gguf"
    write_tiny_kquant_gguf(path)
    model = load_model(str(path), dtype="int8", cache_dir=tmp_path / "cache").model
    float32_bytes = weight_bytes(model)
    fwd = LlamaForward(model)
    layer = fwd.layers[0]
    a, mlp = layer.self_attn, layer.mlp
    released = [fwd.qkv[0][0], fwd.gate_up[0], a.q_proj.weight, a.k_proj.weight,
                a.v_proj.weight, a.o_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                mlp.down_proj.weight, fwd.lm_head]
    for w in released:
        assert linear_cpu.released(w) and w.untyped_storage().nbytes() == 4, w.shape
    assert a.q_proj.weight.shape == (256, 256) and fwd.qkv[0][0].shape == (256 + 2 * 128, 256)
    kept = [fwd.embed, layer.input_layernorm.weight, fwd.norm.weight]
    assert not any(linear_cpu.released(w) for w in kept)
    # nothing left on transformers' memory map of the cached float32 file: it is unmapped
    gc.collect()
    with open("/proc/self/maps") as maps:
        assert not [line for line in maps if str(tmp_path) in line and "safetensors" in line]
    assert fwd.embed.untyped_storage().nbytes() == fwd.embed.numel() * 4
    # held: the storage left (embedding, norms, rotary buffer, 4-byte stubs) plus the codes
    dense_weights = {id(w): w for w in [fwd.qkv[i][0] for i in range(2)] + fwd.gate_up
                     + [fwd.lm_head] + [m for lay in fwd.layers for m in
                                        (lay.self_attn.o_proj.weight, lay.mlp.down_proj.weight)]}
    codes = sum(linear_cpu.form_bytes(w) for w in dense_weights.values())
    assert codes > 0 and fwd.weight_bytes == weight_bytes(model) + codes
    left = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers())
               if not linear_cpu.released(t))
    stubs = {t.untyped_storage().data_ptr() for t in model.parameters()
             if linear_cpu.released(t)}  # one per released weight: a fused one's views share it
    assert len(stubs) == 2 * 4 + 1 and weight_bytes(model) == left + 4 * len(stubs)
    assert fwd.weight_bytes < float32_bytes / 2
    # a second forward (the memory fit's, then the runner's) takes the same codes
    again = LlamaForward(model)
    assert again.qkv[0][0] is fwd.qkv[0][0] and again.weight_bytes == fwd.weight_bytes
    ids, pos = torch.tensor([[3, 17, 42, 7, 99]]), torch.arange(5)[None]
    logits = fwd.forward(ids, pos, fwd.new_cache(1, 16), torch.tensor([0]))
    assert torch.equal(again.forward(ids, pos, again.new_cache(1, 16), torch.tensor([0])),
                       logits)
    # the same bits as a model whose float32 values are kept
    from specbatch.models.backends import cpu

    monkeypatch.setattr(cpu.Int8Weights, "release", False)
    kept_model = load_model(str(path), dtype="int8", cache_dir=tmp_path / "cache").model
    full = LlamaForward(kept_model)
    assert not linear_cpu.released(full.qkv[0][0])
    assert torch.equal(full.forward(ids, pos, full.new_cache(1, 16), torch.tensor([0])), logits)
    with pytest.raises(RuntimeError, match="loaded with dtype int8.*load it in float32"):
        model(ids)
    kept_model(ids)  # nothing released: transformers' forward runs
    # a released weight whose codes are gone cannot be packed again from its zeros
    linear_cpu._PACKED.pop(fwd.lm_head)
    with pytest.raises(RuntimeError, match="values were released"):
        linear_cpu.packed(fwd.lm_head)
