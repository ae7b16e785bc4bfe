"""LlamaForward against transformers' own forward, in float64 (max abs diff < 1e-8).

Covers plain Llama, llama3 rope scaling, yarn (attention scaling != 1), Qwen2 (q/k/v biases,
tied embeddings); ragged rows (different numbers of new tokens at different positions in one
forward); a subset of cache rows; and KV rollback (truncate, re-feed).
"""

from __future__ import annotations

import copy

import pytest
import torch

from specbatch.models.llama import LlamaForward
from tests.helpers import LLAMA3_ROPE, tiny_llama, tiny_qwen2

TOL = 1e-8
DTYPE_ID = lambda d: str(d).removeprefix("torch.")  # noqa: E731
VOCAB = 96
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64}

MODELS = {
    "llama": lambda: tiny_llama(VOCAB, seed=1),
    "llama3_rope": lambda: tiny_llama(VOCAB, seed=2, rope_parameters=LLAMA3_ROPE),
    "yarn_rope": lambda: tiny_llama(VOCAB, seed=3, rope_parameters=YARN_ROPE),
    "qwen2": lambda: tiny_qwen2(VOCAB, seed=4),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits for one sequence: ``[len(ids), vocab]`` float64."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=gen).tolist()


def feed(fwd: LlamaForward, cache, rows: list[int], starts: list[int],
         new_ids: list[list[int]], pad_id: int = 0, packed: bool = False) -> torch.Tensor:
    """One forward where row ``rows[b]`` feeds ``new_ids[b]`` at positions ``starts[b]...``,
    right-padded (``packed``: dense layers on the real tokens only); returns logits
    ``[B, Q, vocab]`` (packed: the forward's ``[T, vocab]`` laid out so, zeros padded)."""
    # as runner.query_len: never a one-token forward (a one-row matmul takes another kernel)
    qlen = max(max(len(x) for x in new_ids), 2 if len(rows) == 1 else 1)
    ids = torch.full((len(rows), qlen), pad_id, dtype=torch.int64)
    for b, x in enumerate(new_ids):
        ids[b, :len(x)] = torch.tensor(x)
    positions = torch.tensor(starts)[:, None] + torch.arange(qlen)[None, :]
    num_fed = torch.tensor([len(x) for x in new_ids]) if packed else None
    out = fwd.forward(ids, positions, cache, torch.tensor(rows), num_fed=num_fed)
    if not packed:
        return out
    # packed: the real tokens' logits [T, V] in row order, never padded; laid out here as
    # [B, Q, V] (zeros in the padded slots) to compare with a padded step
    real = torch.arange(qlen)[None, :] < num_fed[:, None]
    assert out.shape == (int(num_fed.sum()), out.shape[-1])
    grid = out.new_zeros(len(rows), qlen, out.shape[-1])
    grid[real] = out
    return grid


def test_rope_variants_are_really_scaled():
    """Guards the rope parametrisations: they must change the inverse frequencies / scaling,
    or the llama3 and yarn cases would test nothing beyond plain rope."""
    plain = tiny_llama(VOCAB).model.rotary_emb
    llama3 = tiny_llama(VOCAB, rope_parameters=LLAMA3_ROPE).model.rotary_emb
    yarn = tiny_llama(VOCAB, rope_parameters=YARN_ROPE).model.rotary_emb
    assert (llama3.inv_freq - plain.inv_freq).abs().max() > 1e-3
    assert (yarn.inv_freq - plain.inv_freq).abs().max() > 1e-3
    assert abs(yarn.attention_scaling - 1.0) > 1e-3


def test_prefill_and_decode_match_transformers(model):
    """Prefill in two chunks, then 3 tokens, then 1: every position's logits equal HF's."""
    gen = torch.Generator().manual_seed(10)
    seqs = [random_ids(gen, 40) for _ in range(3)]
    ref = [hf_logits(model, s) for s in seqs]
    fwd = LlamaForward(model)
    cache = fwd.new_cache(3, 64)
    rows = [0, 1, 2]
    got = [feed(fwd, cache, rows, [0] * 3, [s[:20] for s in seqs]),
           feed(fwd, cache, rows, [20] * 3, [s[20:36] for s in seqs]),
           feed(fwd, cache, rows, [36] * 3, [s[36:39] for s in seqs]),
           feed(fwd, cache, rows, [39] * 3, [s[39:40] for s in seqs])]
    got = torch.cat(got, dim=1)
    assert got.dtype == torch.float64
    for b in range(3):
        assert (got[b] - ref[b]).abs().max().item() < TOL
    # the comparison is not vacuous: logits differ across positions and rows
    assert (ref[0][1:] - ref[0][:-1]).abs().max() > 0.1


def test_logits_index_selects_queries(model):
    gen = torch.Generator().manual_seed(11)
    seq = random_ids(gen, 12)
    fwd = LlamaForward(model)
    cache = fwd.new_cache(1, 16)
    idx = torch.tensor([[11, 3]])
    out = fwd.forward(torch.tensor([seq]), torch.arange(12)[None], cache, torch.tensor([0]), idx)
    ref = hf_logits(model, seq)
    assert out.shape == (1, 2, VOCAB)
    assert (out[0] - ref[[11, 3]]).abs().max().item() < TOL


def test_ragged_rows_in_one_forward(model):
    """Four rows at different lengths take 3, 1, 5 and 2 new tokens in one padded forward,
    with the batch rows in a different order from the cache rows."""
    gen = torch.Generator().manual_seed(12)
    prompt_lens = [5, 17, 2, 9]
    num_new = [3, 1, 5, 2]
    seqs = [random_ids(gen, p + n) for p, n in zip(prompt_lens, num_new)]
    fwd = LlamaForward(model)
    cache = fwd.new_cache(4, 32)
    for row, (s, p) in enumerate(zip(seqs, prompt_lens)):
        feed(fwd, cache, [row], [0], [s[:p]])
    order = [2, 0, 3, 1]  # batch row b works on cache row order[b]
    logits = feed(fwd, cache, order, [prompt_lens[r] for r in order],
                  [seqs[r][prompt_lens[r]:] for r in order], pad_id=7)
    for b, r in enumerate(order):
        ref = hf_logits(model, seqs[r])[prompt_lens[r]:]
        assert (logits[b, :num_new[r]] - ref).abs().max().item() < TOL


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32], ids=DTYPE_ID)
def test_packed_rows_equal_padded_rows(model, dtype):
    """Rows feeding 3, 1, 5 and 2 tokens: with ``num_fed`` the dense layers see only the 11
    real tokens. Logits at real queries and the cache rows' keys/values equal the padded
    forward's: float64 to transformers, bfloat16 and float32 bit for bit (no row-count
    dependence, see models/dense.py)."""
    ref_model, model = model, copy.deepcopy(model).to(dtype)
    gen = torch.Generator().manual_seed(21)
    prompt_lens, num_new = [5, 17, 2, 9], [3, 1, 5, 2]
    seqs = [random_ids(gen, p + n) for p, n in zip(prompt_lens, num_new)]
    fwd = LlamaForward(model)
    caches, outs = [], []
    for packed in (False, True):
        cache = fwd.new_cache(4, 32)
        for row, (s, p) in enumerate(zip(seqs, prompt_lens)):
            feed(fwd, cache, [row], [0], [s[:p]])
        order = [2, 0, 3, 1]
        outs.append(feed(fwd, cache, order, [prompt_lens[r] for r in order],
                         [seqs[r][prompt_lens[r]:] for r in order], pad_id=7, packed=packed))
        caches.append(cache)
    for b, r in enumerate([2, 0, 3, 1]):
        n = num_new[r]
        same = torch.equal if dtype != torch.float64 else (
            lambda a, b: (a - b).abs().max().item() < 1e-12)
        assert same(outs[1][b, :n], outs[0][b, :n])
        assert not outs[1][b, n:].any()  # padded queries: zeros
        if dtype == torch.float64:
            ref = hf_logits(ref_model, seqs[r])[prompt_lens[r]:]
            assert (outs[1][b, :n] - ref).abs().max().item() < TOL
        end = prompt_lens[r] + n
        for layer in range(fwd.num_layers):
            assert same(caches[1].k[layer][r, :, :end], caches[0].k[layer][r, :, :end])
            assert same(caches[1].v[layer][r, :, :end], caches[0].v[layer][r, :, :end])


def test_subset_of_cache_rows(model):
    """A forward over rows 3 and 1 of a 4-row cache leaves rows 0 and 2 untouched and reads
    only its own rows' keys."""
    gen = torch.Generator().manual_seed(13)
    seqs = [random_ids(gen, 14) for _ in range(4)]
    fwd = LlamaForward(model)
    cache = fwd.new_cache(4, 32)
    feed(fwd, cache, [0, 1, 2, 3], [0] * 4, [s[:10] for s in seqs])
    before = [t.clone() for t in cache.k + cache.v]
    logits = feed(fwd, cache, [3, 1], [10, 10], [seqs[3][10:14], seqs[1][10:12]])
    for row in (3, 1):
        b = [3, 1].index(row)
        n = 4 if row == 3 else 2
        ref = hf_logits(model, seqs[row][:10 + n])[10:]
        assert (logits[b, :n] - ref).abs().max().item() < TOL
    for old, new in zip(before, cache.k + cache.v):
        assert torch.equal(old[[0, 2]], new[[0, 2]])
        assert not torch.equal(old[[1, 3]], new[[1, 3]])


def test_kv_rollback_then_refeed(model):
    """Verify-style: row 1 feeds 4 draft tokens, keeps 1, rolls back and feeds 2 other tokens,
    in one forward with row 0 further along (so row 1's stale key at the last rejected
    position is inside the keys read, and must be masked). Logits equal a clean run's and
    HF's; re-feeding the rejected drafts after the rollback reproduces their first logits."""
    gen = torch.Generator().manual_seed(14)
    prompt = random_ids(gen, 11)
    other = random_ids(gen, 22)
    rejected = random_ids(gen, 4)
    refeed = random_ids(gen, 2)
    fwd = LlamaForward(model)
    cache = fwd.new_cache(2, 32)
    feed(fwd, cache, [0, 1], [0, 0], [other[:18], prompt])
    cache.seq_lens[:] = [18, len(prompt)]
    first = feed(fwd, cache, [1], [len(prompt)], [rejected])[0]
    cache.seq_lens[1] = len(prompt) + 4
    cache.truncate(1, len(prompt) + 1)
    assert cache.seq_lens[1] == len(prompt) + 1
    got = feed(fwd, cache, [0, 1], [18, len(prompt) + 1], [other[18:22], refeed])

    full = prompt + rejected[:1] + refeed
    ref = hf_logits(model, full)[len(prompt) + 1:]
    clean = feed(fwd, fwd.new_cache(1, 32), [0], [0], [full])[0, len(prompt) + 1:]
    assert (got[1, :2] - clean).abs().max().item() < 1e-12
    assert (got[1, :2] - ref).abs().max().item() < TOL
    assert (got[0] - hf_logits(model, other)[18:22]).abs().max().item() < TOL
    # roll back again and re-feed the original drafts: the same logits as the first time
    cache.truncate(1, len(prompt))
    again = feed(fwd, cache, [1], [len(prompt)], [rejected])[0]
    assert (again - first).abs().max().item() < 1e-12
    assert (again - hf_logits(model, prompt + rejected)[len(prompt):]).abs().max().item() < TOL


def test_unsupported_architecture_raises():
    model = tiny_llama(VOCAB)
    model.config.model_type = "gpt2"
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LlamaForward(model)


def _prefilled_cache(fwd: LlamaForward, lens: list[int], gen: torch.Generator, capacity: int):
    """A cache whose row r holds ``lens[r]`` random tokens (0: an idle row with stale keys)."""
    cache = fwd.new_cache(len(lens), capacity)
    for row, n in enumerate(lens):
        feed(fwd, cache, [row], [0], [random_ids(gen, max(n, 8))])
        cache.seq_lens[row] = n
    return cache


def _clone(cache):
    out = copy.copy(cache)
    out.k, out.v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    out.seq_lens = list(cache.seq_lens)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=DTYPE_ID)
def test_attention_is_invariant_to_padding_and_batch(dtype):
    """bfloat16 and float32: a row's verify logits and the keys/values it writes are bit-identical whether
    it runs alone or with rows of other lengths: in one cache view padded to a longer row's
    blocks (up to 18 blocks of 256 keys, past the 16 where torch's block sum cascades), beside
    an idle row whose queries are computed and dropped, or in a view of its own; cache rows in
    any batch order, padded or packed."""
    from specbatch.engine.kv_cache import plan_segments

    model = tiny_llama(VOCAB, seed=31).to(dtype)
    fwd = LlamaForward(model)
    gen = torch.Generator().manual_seed(32)
    lens = [4400, 4000, 40, 0, 700, 20]  # row 3 idle
    base = _prefilled_cache(fwd, lens, gen, 4608)
    feeds = {r: random_ids(gen, n) for r, n in zip(range(6), [2, 4, 3, 1, 6, 1])}

    def step(rows, packed=False):
        cache = _clone(base)
        out = feed(fwd, cache, rows, [lens[r] for r in rows], [feeds[r] for r in rows],
                   packed=packed)
        return {r: out[b, :len(feeds[r])] for b, r in enumerate(rows)}, cache

    alone = {r: step([r]) for r in (0, 1, 2, 4, 5)}
    batches = [[0, 1, 2, 4, 5], [5, 2, 0, 4, 1], [1, 2], [2, 5], [4, 5, 2]]
    plans = {tuple(b): plan_segments(b, [lens[r] + len(feeds[r]) for r in b]) for b in batches}
    # the batches exercise merged views, idle rows inside a view and several views
    assert any(len(p) > 1 for p in plans.values())
    assert any(-1 in s.batch_rows for p in plans.values() for s in p)
    need = {r: -(-(lens[r] + len(feeds[r])) // 256) * 256 for r in feeds}
    padded = {s.lo + i for p in plans.values() for s in p
              for i, b in enumerate(s.batch_rows) if b >= 0 and s.kv_len > need[s.lo + i]}
    assert 1 in padded  # 4,004 keys (16 blocks) read as 18 blocks beside row 0
    for rows in batches:
        for packed in (False, True):
            got, cache = step(rows, packed)
            for r in rows:
                logits, ref_cache = alone[r]
                assert torch.equal(got[r], logits[r]), (rows, packed, r)
                end = lens[r] + len(feeds[r])
                for layer in range(fwd.num_layers):
                    assert torch.equal(cache.k[layer][r, :, :end], ref_cache.k[layer][r, :, :end])
                    assert torch.equal(cache.v[layer][r, :, :end], ref_cache.v[layer][r, :, :end])
    # not vacuous: rows' logits differ
    assert not torch.equal(alone[2][0][2], alone[5][0][5])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32], ids=DTYPE_ID)
def test_packed_prefill_equals_prefill_alone(model, dtype):
    """Prompts of 5, 300, 40 and 600 tokens prefilled together in packed forwards of at most 100
    or 500 tokens (chunks of 256: a chunk over the budget runs alone) give the same first-token logits and cache rows as each
    prompt prefilled alone in one go: bit for bit in bfloat16 and float32; in float64 equal to
    transformers' logits."""
    from specbatch.config import SamplingParams
    from specbatch.engine.runner import ModelRunner
    from specbatch.engine.sequence import Request, Sequence

    model_d = copy.deepcopy(model).to(dtype)
    fwd = LlamaForward(model_d)
    gen = torch.Generator().manual_seed(33)
    prompts = [random_ids(gen, n) for n in (5, 300, 40, 600)]

    def seqs():
        out = []
        for row, p in enumerate(prompts):
            s = Sequence(Request(row, p, SamplingParams()), "none", 0)
            s.row = row
            out.append(s)
        return out

    def run(budget, together):
        runner = ModelRunner(fwd, 4, 1024, prefill_chunk=256, initial_capacity=16,
                             max_prefill_tokens=budget)
        if together:
            steps, pending, logits = 0, seqs(), {}
            while pending:
                done, out = runner.prefill_step(pending)
                logits.update({s.row: x for s, x in zip(done, out)})
                pending = [s for s in pending if not s.is_prefilled]
                steps += 1
            return torch.stack([logits[r] for r in range(4)]), runner.cache, steps
        out = torch.cat([runner.prefill([s]) for s in seqs()])
        return out, runner.cache, 4

    ref, ref_cache, _ = run(100_000, together=False)
    assert ref_cache.seq_lens == [len(p) for p in prompts]
    for budget in (100, 500):
        got, cache, steps = run(budget, together=True)
        assert steps >= (6 if budget == 100 else 2)  # really split across forwards
        same = torch.equal if dtype != torch.float64 else (
            lambda a, b: (a - b).abs().max().item() < 1e-12)
        assert same(got, ref)
        for r, p in enumerate(prompts):
            for layer in range(fwd.num_layers):
                assert same(cache.k[layer][r, :, :len(p)], ref_cache.k[layer][r, :, :len(p)])
                assert same(cache.v[layer][r, :, :len(p)], ref_cache.v[layer][r, :, :len(p)])
    if dtype == torch.float64:
        for r, p in enumerate(prompts):
            assert (ref[r] - hf_logits(model, p)[-1]).abs().max().item() < TOL


def test_building_a_forward_settles_torchs_kernels_first(monkeypatch):
    """Before any forward, torch's cos / sin / exp / log run once on a small tensor (one
    thread): a process's first cos over a tensor split across threads gave other bits in part
    of it (``settle_torch_kernels``; the subprocess check is tests/e2e/test_first_call.py)."""
    from specbatch.models import llama

    calls = []
    for name in ("cos", "sin", "exp", "log"):
        fn = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda x, _fn=fn, _n=name: (calls.append(
            (_n, x.numel(), x.dtype)), _fn(x))[1])
    monkeypatch.setattr(llama, "_TORCH_KERNELS_SETTLED", False)
    LlamaForward(tiny_llama(96, seed=1).float())
    for name in ("cos", "sin", "exp", "log"):
        for dtype in (torch.float32, torch.float64):
            assert (name, 64, dtype) in calls, (name, dtype, calls)
    assert llama._TORCH_KERNELS_SETTLED
    calls.clear()
    LlamaForward(tiny_llama(96, seed=1).float())  # once per process
    assert not calls
