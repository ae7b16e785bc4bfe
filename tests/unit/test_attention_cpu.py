"""The C decode/verify attention (kernels/attention_cpu.py) and the float32 forward on it:
the plain-torch reference's values, a token's bits independent of what shares the step, and a
verify step of k + 1 tokens equal to k + 1 one-token decode steps through the whole model."""

from __future__ import annotations

import pytest
import torch

from specbatch.kernels import attention_cpu
from specbatch.kernels.attention import attention_reference
from specbatch.models.llama import LlamaForward
from tests.helpers import tiny_llama, tiny_qwen2

pytestmark = pytest.mark.skipif(not attention_cpu.available(64),
                                reason="needs an AVX2/FMA CPU and a C compiler")


def caches(gen, rows=5, hkv=2, cap=300, d=64):
    return (torch.randn(rows, hkv, cap, d, generator=gen),
            torch.randn(rows, hkv, cap, d, generator=gen))


@pytest.mark.parametrize("heads,hkv,d", [(6, 2, 64), (4, 4, 128), (3, 1, 24), (8, 2, 256)])
def test_matches_the_torch_reference(heads, hkv, d):
    gen = torch.Generator().manual_seed(heads * d)
    k, v = caches(gen, hkv=hkv, d=d)
    q = torch.randn(7, heads, d, generator=gen) * 3  # peaked softmax rows too
    rows = torch.tensor([0, 4, 4, 2, 1, 3, 0])
    pos = torch.tensor([0, 7, 8, 299, 64, 150, 5])  # one key only; a tail of 1..7 keys
    got = attention_cpu.attention(q, k, v, rows, pos)
    ref = attention_reference(q, k, v, rows, pos)
    assert (got - ref).abs().max() < 1e-5
    assert (ref[1] - ref[2]).abs().max() > 1e-3  # rows and positions do matter


def test_a_token_is_the_same_whatever_shares_the_step():
    """Alone, among 40 other tokens in any order, with keys past its position changed, on a
    cache with more capacity, with a strided q: the same bits."""
    gen = torch.Generator().manual_seed(1)
    k, v = caches(gen)
    q = torch.randn(41, 6, 64, generator=gen)
    rows = torch.randint(0, 5, (41,), generator=gen)
    pos = torch.randint(0, 300, (41,), generator=gen)
    full = attention_cpu.attention(q, k, v, rows, pos)
    for t in (0, 17, 40):
        alone = attention_cpu.attention(q[t:t + 1], k, v, rows[t:t + 1], pos[t:t + 1])
        assert torch.equal(alone, full[t:t + 1])
    perm = torch.randperm(41, generator=gen)
    assert torch.equal(attention_cpu.attention(q[perm], k, v, rows[perm], pos[perm]), full[perm])
    k2, v2 = torch.randn(5, 2, 600, 64, generator=gen), torch.randn(5, 2, 600, 64, generator=gen)
    k2[:, :, :300], v2[:, :, :300] = k, v
    assert torch.equal(attention_cpu.attention(q, k2, v2, rows, pos), full)
    wide = torch.randn(41, 9, 64, generator=gen)
    wide[:, 1:7] = q
    assert torch.equal(attention_cpu.attention(wide[:, 1:7], k, v, rows, pos), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(attention_cpu.attention(q, k, v, rows, pos), full)
    finally:
        torch.set_num_threads(threads)


def test_keys_past_the_position_are_never_read():
    gen = torch.Generator().manual_seed(2)
    k, v = caches(gen)
    q = torch.randn(3, 6, 64, generator=gen)
    rows, pos = torch.tensor([1, 1, 3]), torch.tensor([10, 11, 200])
    before = attention_cpu.attention(q, k, v, rows, pos)
    k[1, :, 12:], v[1, :, 12:] = float("nan"), float("nan")
    k[3, :, 201:], v[3, :, 201:] = float("inf"), float("nan")
    assert torch.equal(attention_cpu.attention(q, k, v, rows, pos), before)


def test_bad_arguments_are_refused():
    gen = torch.Generator().manual_seed(3)
    k, v = caches(gen)
    q = torch.randn(2, 6, 64, generator=gen)
    rows = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="outside the cache"):
        attention_cpu.attention(q, k, v, rows, torch.tensor([0, 300]))
    with pytest.raises(ValueError, match="outside the cache"):
        attention_cpu.attention(q, k, v, torch.tensor([0, 5]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="H a multiple of Hkv"):
        attention_cpu.attention(torch.randn(2, 5, 64), k, v, rows, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="float32"):
        attention_cpu.attention(q.double(), k.double(), v.double(), rows, torch.tensor([0, 1]))
    assert attention_cpu.attention(q[:0], k, v, rows[:0], rows[:0]).shape == (0, 6, 64)


@pytest.mark.parametrize("make", [lambda: tiny_llama(96, seed=1), lambda: tiny_qwen2(96, seed=4)],
                         ids=["llama", "qwen2"])
def test_float32_forward_on_it(make):
    """The float32 forward takes the C attention; its logits are transformers' (float32, to
    float32 rounding), and verifying 5 tokens in one step (packed or padded, beside another row)
    gives each token the bits 5 one-token steps give it."""
    model = make().float()
    fwd = LlamaForward(model)
    assert fwd.backend.attention is attention_cpu.attention
    gen = torch.Generator().manual_seed(5)
    seq = torch.randint(1, 96, (30,), generator=gen)
    other = torch.randint(1, 96, (30,), generator=gen)
    with torch.no_grad():
        ref = model(seq[None]).logits[0]
    steps = fwd.new_cache(2, 64)
    fwd.forward(seq[None, :25], torch.arange(25)[None], steps, torch.tensor([0]))
    one = [fwd.forward(seq[None, p:p + 1].expand(1, 1), torch.tensor([[p]]), steps,
                       torch.tensor([0]))[0, 0] for p in range(25, 30)]
    one = torch.stack(one)
    assert (one - ref[25:30]).abs().max() < 1e-4
    picked = fwd.new_cache(1, 64)  # a draft model's prefill: logits of chosen queries only
    sel = fwd.forward(seq[None, :25], torch.arange(25)[None], picked, torch.tensor([0]),
                      logits_index=torch.tensor([[24, 3]]))
    assert sel.shape == (1, 2, 96) and (sel[0] - ref[[24, 3]]).abs().max() < 1e-4
    for packed in (False, True):
        cache = fwd.new_cache(2, 64)
        fwd.forward(seq[None, :25], torch.arange(25)[None], cache, torch.tensor([0]))
        fwd.forward(other[None, :12], torch.arange(12)[None], cache, torch.tensor([1]))
        ids = torch.stack([seq[25:30], torch.cat([other[12:14], torch.zeros(3, dtype=torch.long)])])
        pos = torch.stack([torch.arange(25, 30), torch.arange(12, 17)])
        out = fwd.forward(ids, pos, cache, torch.tensor([0, 1]),
                          num_fed=torch.tensor([5, 2]) if packed else None)
        # packed: the 7 real tokens' logits [7, V] (row 0's 5 first), never padded
        assert out.shape == ((7, 96) if packed else (2, 5, 96))
        assert torch.equal(out[:5] if packed else out[0], one), packed


def test_float16_caches_give_the_bits_of_their_values_in_float32():
    """A float16 cache (dtype int8's) is widened exactly as it is read: the same outputs as a
    float32 cache holding the same values."""
    gen = torch.Generator().manual_seed(31)
    k = torch.randn(3, 2, 40, 64, generator=gen).half()
    v = torch.randn(3, 2, 40, 64, generator=gen).half()
    q = torch.randn(5, 6, 64, generator=gen)
    rows, pos = torch.tensor([0, 2, 1, 2, 0]), torch.tensor([0, 39, 17, 5, 22])
    half = attention_cpu.attention(q, k, v, rows, pos)
    assert torch.equal(half, attention_cpu.attention(q, k.float(), v.float(), rows, pos))


@pytest.mark.parametrize("heads,hkv,d,f16", [(9, 3, 64, True), (9, 3, 64, False),
                                             (6, 3, 64, True), (3, 3, 96, False),
                                             (6, 2, 32, True), (8, 2, 64, True),
                                             (3, 1, 40, True), (4, 2, 24, False)])
def test_avx512_and_avx2_forms_give_each_token_the_same_bits(heads, hkv, d, f16):
    """The AVX-512 form (512-bit passes, two consecutive tokens of a row sharing them) and the
    AVX2 one, on runs of consecutive tokens (a verify step: 1 + 10 tokens; a prompt: 1..37;
    rows interleaved; a lone token) and on each token alone: the same bits."""
    if not attention_cpu.avx512():
        pytest.skip("no AVX-512 here: the AVX2 form only")
    gen = torch.Generator().manual_seed(heads * d + hkv)
    k = torch.randn(3, hkv, 80, d, generator=gen)
    v = torch.randn(3, hkv, 80, d, generator=gen)
    if f16:
        k, v = k.half(), v.half()
    rows = [0] * 11 + [1] * 37 + [2, 0, 0, 1]
    pos = list(range(60, 71)) + list(range(37)) + [5, 71, 72, 40]
    rows, pos = torch.tensor(rows), torch.tensor(pos)
    q = torch.randn(len(rows), heads, d, generator=gen)
    try:
        shared = attention_cpu.attention(q, k, v, rows, pos)
        attention_cpu.avx512(False)
        alone = attention_cpu.attention(q, k, v, rows, pos)
    finally:
        attention_cpu.avx512(True)
    assert torch.equal(shared, alone)
    for t in (0, 1, 10, 11, 12, 47, 50):
        one = attention_cpu.attention(q[t:t + 1], k, v, rows[t:t + 1], pos[t:t + 1])
        assert torch.equal(one[0], shared[t])
    assert (shared - attention_reference(q, k.float(), v.float(), rows, pos)).abs().max() < 1e-5
