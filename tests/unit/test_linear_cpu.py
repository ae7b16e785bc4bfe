"""specbatch's float32 CPU matmul (kernels/linear_cpu.c): the product F.linear computes, a row's
bits independent of the rows beside it, its packed weight following in-place changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbatch.kernels import linear_cpu
from tests.helpers import at_thread_counts

pytestmark = pytest.mark.skipif(not linear_cpu.available(),
                                reason="needs an AVX2/FMA CPU and a C compiler")

# (K, N): SmolLM2-135M's fused q/k/v, o, gate/up, down, a slice of lm_head; odd sizes hit the
# last partial chunk of 8 k and the last partial panel of 3 columns
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 4096), (577, 100), (13, 37),
          (3, 2))


@pytest.mark.parametrize("k,n", SHAPES)
def test_product_and_row_invariance(k, n):
    gen = torch.Generator().manual_seed(k * 7 + n)
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    b = torch.randn(n, generator=gen)
    x = torch.randn(150, k, generator=gen)
    full = linear_cpu.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert (full.double() - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())
    nobias = linear_cpu.linear(x, w)
    assert (nobias.double() - (ref - b.double())).abs().max() < 1e-4
    for rows in list(range(1, 18)) + [33, 64, 149]:
        pick = torch.randperm(150, generator=gen)[:rows]
        assert torch.equal(linear_cpu.linear(x[pick], w, b), full[pick]), rows


def test_thread_count_does_not_change_bits():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(1000, 576, generator=gen) / 24
    x = torch.randn(9, 576, generator=gen)
    outs = at_thread_counts(lambda: linear_cpu.linear(x, w))
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_strided_and_broadcast_inputs():
    """x views the forward passes: a row broadcast (``expand``, row stride 0), leading dims, a
    column slice (copied), no rows at all."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 40, generator=gen)
    x = torch.randn(5, 40, generator=gen)
    full = linear_cpu.linear(x, w)
    assert torch.equal(linear_cpu.linear(x[1:2].expand(3, -1), w), full[1:2].expand(3, -1))
    assert torch.equal(linear_cpu.linear(x.view(5, 1, 40), w), full.view(5, 1, 64))
    wide = torch.randn(5, 80, generator=gen)
    wide[:, ::2] = x
    assert torch.equal(linear_cpu.linear(wide[:, ::2], w), full)
    assert linear_cpu.linear(x[:0], w).shape == (0, 64)
    with pytest.raises(ValueError, match="do not match"):
        linear_cpu.linear(x, w[:, :39])
    with pytest.raises(ValueError, match="float32"):
        linear_cpu.linear(x.double(), w)


def test_packed_once_and_repacked_when_the_weight_changes():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(100, 64, generator=gen)
    x = torch.randn(4, 64, generator=gen)
    first = linear_cpu.linear(x, w)
    packed = linear_cpu._PACKED[w][1]
    linear_cpu.linear(x, w)
    assert linear_cpu._PACKED[w][1] is packed
    with torch.no_grad():
        w.mul_(2)
    assert torch.equal(linear_cpu.linear(x, w), first * 2)  # exact: scaling by 2 is exact
    assert linear_cpu._PACKED[w][1] is not packed


def test_build_failure_falls_back(monkeypatch, tmp_path, caplog):
    """A compiler that fails leaves the C kernels unavailable (the engine then uses oneDNN and
    torch attention), with the compiler's message in the warning; nothing half-built is left in
    the cache. A build says it starts and how long it took (a first run waits for it).
    SPECBATCH_CPU_KERNELS=0 and SPECBATCH_CPU_LINEAR=onednn turn them off."""
    import logging

    from specbatch.kernels import cpu_build

    caplog.set_level(logging.INFO, logger=cpu_build._log.name)

    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(cpu_build, "library", cpu_build.library.__wrapped__)
    assert cpu_build.library() is None and not linear_cpu.available()
    with pytest.raises(RuntimeError, match=r"false failed: exit status 1, no message"):
        cpu_build.build()
    assert list((tmp_path / "kernels").iterdir()) == []
    monkeypatch.setenv("CC", "")
    caplog.clear()
    assert cpu_build.library() is not None  # the same sources build into the empty cache
    assert len(list((tmp_path / "kernels").iterdir())) == 1
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == f"building the C kernels (once on this machine) into {tmp_path / 'kernels'}"
    assert said[1].startswith("built the C kernels in ") and said[1].endswith(" s"), said
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "0")
    assert cpu_build.library() is None
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "")
    monkeypatch.setenv("SPECBATCH_CPU_LINEAR", "onednn")
    assert not linear_cpu.available()


def test_unwritable_cache_falls_back_to_the_temp_folder(monkeypatch, tmp_path):
    from specbatch.kernels import cpu_build

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SPECBATCH_CACHE", str(blocker))  # mkdir under a file fails
    monkeypatch.setattr(cpu_build.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    lib = cpu_build.build()
    assert lib.parent == tmp_path / "tmp" / "specbatch-kernels" and lib.exists()


def _gguf_roundtrip(w: torch.Tensor, kind: str) -> torch.Tensor:
    """w quantised with gguf's own Q4_1 / Q8_0 quantiser and dequantised back to float32: the
    values a GGUF model's weights have once transformers has loaded them."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = gguf.quants.quantize(w.numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).copy()).view(w.shape)


@pytest.mark.parametrize("kind,code", [("Q4_1", linear_cpu.Q4_1), ("Q8_0", linear_cpu.Q8_0)])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (100, 64), (7, 32)])
def test_exact_codes_give_the_float32_bits(kind, code, n, k, monkeypatch):
    """A GGUF-quantised weight is streamed as its codes; every output is the float32 kernel's,
    bit for bit, at every row count (the per-panel path up to 4 rows, the block path above)."""
    gen = torch.Generator().manual_seed(n + k)
    w = _gguf_roundtrip(torch.randn(n, k, generator=gen) / k ** 0.5, kind)
    b = torch.randn(n, generator=gen)
    form = linear_cpu.pack_quantized(w)
    assert form is not None and form[0] == code
    x = torch.randn(40, k, generator=gen)
    codes = linear_cpu.linear(x, w, b)
    assert linear_cpu._PACKED[w][1][0] == code
    monkeypatch.setenv("SPECBATCH_CPU_WEIGHTS", "float32")
    w32 = w.clone()
    assert torch.equal(linear_cpu.linear(x, w32, b), codes)
    assert linear_cpu._PACKED[w32][1][0] == 0
    monkeypatch.delenv("SPECBATCH_CPU_WEIGHTS")
    for rows in (1, 2, 3, 4, 5, 9, 17):
        pick = torch.randperm(40, generator=gen)[:rows]
        assert torch.equal(linear_cpu.linear(x[pick], w, b), codes[pick]), rows


def test_weights_without_exact_codes_stay_float32():
    gen = torch.Generator().manual_seed(4)
    assert linear_cpu.pack_quantized(torch.randn(64, 64, generator=gen)) is None
    q = _gguf_roundtrip(torch.randn(64, 64, generator=gen), "Q4_1")
    assert linear_cpu.pack_quantized(q) is not None
    assert linear_cpu.pack_quantized(q[:, :40].contiguous()) is None  # K not a multiple of 32
    nudged = q.clone()
    nudged[3, 17] = torch.nextafter(nudged[3, 17], torch.tensor(1.0))  # one ulp off one weight
    assert linear_cpu.pack_quantized(nudged) is None
    signed = torch.zeros(2, 32)
    signed[0, 5] = -0.0  # -0.0 is not d * q: its sign would be lost
    assert linear_cpu.pack_quantized(signed) is None
    assert linear_cpu.pack_quantized(torch.zeros(2, 32))[0] == linear_cpu.Q8_0
    x = torch.randn(3, 64, generator=gen)
    nudged_out = linear_cpu.linear(x, nudged)
    assert linear_cpu._PACKED[nudged][1][0] == 0
    assert (nudged_out - x @ nudged.t()).abs().max() < 1e-5


@pytest.mark.skipif(not linear_cpu.avx512(), reason="needs a CPU with AVX-512 F/VL/DQ")
@pytest.mark.parametrize("quantised,from_rows",
                         [(None, 4), ("Q4_1", 4), ("Q8_0", 4), ("Q4_1", 1), ("Q8_0", 1)])
def test_avx512_path_gives_the_avx2_bits(quantised, from_rows):
    """Where the CPU has AVX-512, matmuls of 8 rows and more (and code weights in passes of up to
    8 rows from ``avx512_from_rows()`` rows: 1 on Intel CPUs, else 4) take the AVX-512
    micro-kernels: every output element has the AVX2 kernels' bits (float32 and code weights;
    whole and partial groups of 8 rows, passes of 1-3 rows on either kernel, an odd panel left
    over, a partial last chunk of k), so the two can share a run."""
    default = linear_cpu.avx512_from_rows()
    assert default == (1 if _intel() else 4)
    assert linear_cpu.avx512_from_rows(from_rows) == from_rows
    gen = torch.Generator().manual_seed(5)
    shapes = [(960, 576), (1536, 576), (576, 1536), (103, 64)] + (
        [] if quantised else [(17, 1000), (11, 13)])
    try:
        for n, k in shapes:
            w = torch.randn(n, k, generator=gen) / k ** 0.5
            if quantised:
                w = _gguf_roundtrip(w, quantised)
                assert linear_cpu.pack_quantized(w) is not None
            b = torch.randn(n, generator=gen)
            x = torch.randn(97, k, generator=gen)
            for rows in (1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 16, 17, 21, 48, 49, 97):
                assert linear_cpu.avx512(False) is False
                avx2 = linear_cpu.linear(x[:rows], w, b)
                assert linear_cpu.avx512(True) is True
                assert torch.equal(linear_cpu.linear(x[:rows], w, b), avx2), (n, k, rows)
    finally:
        linear_cpu.avx512(True)
        linear_cpu.avx512_from_rows(default)


def _intel() -> bool:
    """Whether this is an Intel CPU (``/proc/cpuinfo``'s vendor_id)."""
    try:
        with open("/proc/cpuinfo") as f:
            return "GenuineIntel" in f.read(4096)
    except OSError:
        return False
