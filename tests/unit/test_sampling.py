"""Sampling invariance (T > 0): position-keyed Gumbel-max makes speculation invisible.

(a) identity: per record seed, n-gram speculation at k in {1, 3, 8}, with the record decoded
    alone or among 15 others, gives exactly the tokens of plain decoding (T 0.7 and 1.0, with
    and without top_p 0.9), while drafts are both accepted and rejected;
(b) distribution: over 4000 seeds the tokens at output positions 0..3 follow the exact
    softmax(logits / T) given the tokens before them (chi-square per position, p > 1e-3),
    spec on and off; a sampler that reuses position 0's noise, or ignores the seed, fails;
(c) sampler parts: top-k / top-p kept sets, greedy ties, noise independent of batch shape,
    ``mix32`` / ``gumbel_noise`` equal to a pure-Python uint32 reference.
"""

from __future__ import annotations

import math
import random
from collections import Counter, defaultdict

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.spec_decode import sampler
from tests.helpers import cycle_prompt, cyclic_llama, run_engine, total

# ---- (a) identity ---------------------------------------------------------------------------

ID_VOCAB = 32
NUM_SEEDS = 200
ID_CONFIGS = [(0.7, 1.0), (0.7, 0.9), (1.0, 1.0), (1.0, 0.9)]  # (temperature, top_p)


@pytest.fixture(scope="module")
def identity_setup():
    """800 requests: 200 seeds x 4 sampling configs, each prompt a stretch of the model's
    cycle longer than the cycle, so every token has a continuation to draft. The baseline is
    plain decoding in batches of 16."""
    model = cyclic_llama(ID_VOCAB, peak=0.4, seed=3)
    prompts, sampling, seeds = [], [], []
    for temperature, top_p in ID_CONFIGS:
        for s in range(NUM_SEEDS):
            prompts.append(cycle_prompt(model.succ, s % ID_VOCAB, ID_VOCAB + 2 + s % 8))
            sampling.append(SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p))
            seeds.append(1000 + s)
    base = run_engine(model, prompts, 0, 16, sampling, seeds)
    return model, prompts, sampling, seeds, base


@pytest.mark.parametrize("batch_size", [1, 16], ids=["alone", "among_15_others"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_sample_identity(identity_setup, k, batch_size):
    model, prompts, sampling, seeds, base = identity_setup
    # a fresh order per run, so a record's neighbours differ from the baseline's
    order = list(range(len(prompts)))
    random.Random(k * 100 + batch_size).shuffle(order)
    out = run_engine(model, [prompts[i] for i in order], k, batch_size,
                     [sampling[i] for i in order], [seeds[i] for i in order])
    by_index = dict(zip(order, out))
    mismatched = [i for i in range(len(prompts)) if by_index[i].output_ids != base[i].output_ids]
    assert mismatched == []
    for g, config in enumerate(ID_CONFIGS):
        group = [by_index[i] for i in range(g * NUM_SEEDS, (g + 1) * NUM_SEEDS)]
        accepted = total(group, "num_accepted_tokens")
        drafted = total(group, "num_draft_tokens")
        assert accepted > NUM_SEEDS, config  # speculation was exercised ...
        assert drafted - accepted > NUM_SEEDS // 4, config  # ... and rejected drafts too
        assert sum(len(c.output_ids) == 16 for c in group) == NUM_SEEDS
    # the samples are random: different seeds, different outputs
    assert len({tuple(c.output_ids) for c in base[:NUM_SEEDS]}) > NUM_SEEDS // 2


# ---- (b) distribution -----------------------------------------------------------------------

DIST_VOCAB = 8
DIST_SEEDS = 4000
DIST_T = 1.0
NUM_POSITIONS = 4
P_THRESHOLD = 1e-3  # per position; the test is deterministic (fixed seeds), so no flakiness


@pytest.fixture(scope="module")
def dist_model():
    model = cyclic_llama(DIST_VOCAB, peak=0.35, seed=4)
    prompt = cycle_prompt(model.succ, 0, 12)  # every token occurs: any output can be drafted
    return model, prompt


def generate_samples(dist_model, k: int) -> tuple[list[list[int]], int]:
    """Outputs of 4000 seeds (max_tokens 4; with k = 5 the drafts are capped at 2, so output
    positions 2 and 3 come from draft positions when accepted). Returns (outputs, accepted)."""
    model, prompt = dist_model
    sp = SamplingParams(max_tokens=NUM_POSITIONS, temperature=DIST_T)
    out = run_engine(model, [prompt] * DIST_SEEDS, k, 64, sp, list(range(DIST_SEEDS)))
    return [c.output_ids for c in out], total(out, "num_accepted_tokens")


def chi_square(dist_model, outputs: list[list[int]], position: int,
               min_group: int = 30) -> tuple[float, int, float]:
    """Pearson chi-square of the tokens at ``position`` against softmax(logits / T) of the
    target given the prompt and the tokens before it, summed over prefixes seen at least
    ``min_group`` times. Cells with expected count < 5 are pooled (into the smallest other
    cell when the pool is still < 5). Returns (statistic, degrees of freedom, p-value)."""
    model, prompt = dist_model
    groups: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for out in outputs:
        groups[tuple(out[:position])][out[position]] += 1
    stat, dof = 0.0, 0
    for prefix, counts in groups.items():
        n = sum(counts.values())
        if n < min_group:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
        expected = (torch.softmax(logits / DIST_T, dim=-1) * n).tolist()
        cells, pool = [], [0.0, 0]
        for e, v in sorted((e, v) for v, e in enumerate(expected)):
            if e < 5:
                pool[0] += e
                pool[1] += counts[v]
            else:
                cells.append([e, counts[v]])
        if pool[0] > 0:
            if pool[0] < 5 and cells:
                cells[0][0] += pool[0]
                cells[0][1] += pool[1]
            else:
                cells.append(pool)
        if len(cells) < 2:
            continue
        stat += sum((o - e) ** 2 / e for e, o in cells)
        dof += len(cells) - 1
    assert dof > 0
    p = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                torch.tensor(stat / 2, dtype=torch.float64)).item()
    return stat, dof, p


@pytest.fixture(scope="module")
def plain_samples(dist_model):
    return generate_samples(dist_model, 0)


@pytest.mark.parametrize("k", [0, 5], ids=["spec_off", "spec_on"])
def test_distribution_matches_softmax(dist_model, plain_samples, k):
    outputs, accepted = generate_samples(dist_model, k) if k else plain_samples
    if k:
        assert accepted > DIST_SEEDS // 2  # positions 2, 3 often came from accepted drafts
        assert outputs == plain_samples[0]
    for position in range(NUM_POSITIONS):
        stat, dof, p = chi_square(dist_model, outputs, position)
        assert p > P_THRESHOLD, (position, stat, dof, p)
    # first position: every token is seen, none dominates (the check has something to see)
    first = Counter(o[0] for o in outputs)
    assert len(first) == DIST_VOCAB and max(first.values()) < 0.6 * DIST_SEEDS


def _reuse_position_0(orig):
    return lambda seeds, positions, vocab: orig(seeds, torch.zeros_like(positions), vocab)


def _ignore_seed(orig):
    return lambda seeds, positions, vocab: orig(torch.zeros_like(seeds), positions, vocab)


@pytest.mark.parametrize("broken", [_reuse_position_0, _ignore_seed],
                         ids=["reused_position_0_noise", "seed_ignored"])
def test_broken_sampler_fails_the_check(dist_model, monkeypatch, broken):
    monkeypatch.setattr(sampler, "gumbel_noise", broken(sampler.gumbel_noise))
    outputs, _ = generate_samples(dist_model, 5)
    stat, dof, p = chi_square(dist_model, outputs, 1)
    assert p < 1e-30 and stat > 20 * dof, (stat, dof, p)
    if broken is _reuse_position_0:
        # position 0's noise is still fresh per seed: only the later positions show it
        assert chi_square(dist_model, outputs, 0)[2] > P_THRESHOLD


# ---- (c) sampler parts ----------------------------------------------------------------------

PROBS = [0.05, 0.5, 0.1, 0.2, 0.15]  # sorted ids: 1, 3, 4, 2, 0

# (top_k, top_p, kept ids)
MASK_CASES = [
    (0, 1.0, {0, 1, 2, 3, 4}),
    (0, 0.45, {1}),
    (0, 0.55, {1, 3}),
    (0, 0.75, {1, 3, 4}),  # mass before id 4 is 0.70 < 0.75; before id 2 it is 0.85
    (0, 0.99, {0, 1, 2, 3, 4}),
    (0, 1e-9, {1}),  # the most likely token is always kept
    (2, 1.0, {1, 3}),
    (1, 1.0, {1}),
    (5, 1.0, {0, 1, 2, 3, 4}),
    (9, 1.0, {0, 1, 2, 3, 4}),
    (3, 0.6, {1, 3}),
]


def test_top_k_top_p_keeps_exactly_the_expected_set():
    """All cases as rows of one batch (each row's parameters apply to it alone); kept logits
    are unchanged, the rest are -inf."""
    # shifted log-probs: logits, not normalised
    logits = torch.tensor([PROBS] * len(MASK_CASES), dtype=torch.float64).log() + 3.0
    top_k = torch.tensor([c[0] for c in MASK_CASES])
    top_p = torch.tensor([c[1] for c in MASK_CASES], dtype=torch.float64)
    masked = sampler.mask_top_k_top_p(logits, top_k, top_p)
    for row, (_, _, kept) in enumerate(MASK_CASES):
        assert {v for v in range(5) if masked[row, v] > float("-inf")} == kept, MASK_CASES[row]
        for v in kept:
            assert masked[row, v] == logits[row, v]


def test_top_k_ties_keep_the_lowest_ids():
    logits = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0]] * 2, dtype=torch.float64)
    masked = sampler.mask_top_k_top_p(logits, torch.tensor([1, 2]),
                                      torch.tensor([1.0, 1.0], dtype=torch.float64))
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, False, False]
    assert torch.isfinite(masked[1]).tolist() == [False, True, False, True, False]


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 1.0, 7.0, 3.0, 7.0, 7.0],
                           [7.0, 1.0, 7.0, 3.0, 7.0, 7.0],
                           [0.0, 1.0, 2.0, 3.0, 4.0, 9.0]], dtype=torch.float64)
    n = logits.shape[0]
    seeds, positions = torch.arange(n), torch.zeros(n, dtype=torch.int64)
    off_k, off_p = torch.zeros(n, dtype=torch.int64), torch.ones(n, dtype=torch.float64)
    ids, _ = sampler.sample(logits, torch.zeros(n, dtype=torch.float64), off_k, off_p, seeds,
                            positions)
    assert ids.tolist() == [2, 0, 5]
    # the same rows next to a sampled row (the mixed path), and with top-k on
    temps = torch.tensor([0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    mixed = torch.cat([logits, logits[:1]])
    ids, _ = sampler.sample(mixed, temps, torch.tensor([2, 0, 0, 0]), torch.ones(4).double(),
                            torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert ids[:3].tolist() == [2, 0, 5]
    # float32 logits, all greedy (the argmax without widening), with -inf and NaN rows: the
    # ids and the scaled logits of the general path (a banned mask of nothing takes it)
    f32 = torch.cat([logits, torch.tensor([[-math.inf, 2.0, -math.inf, 2.0, 1.0, 0.5],
                                           [1.0, math.nan, 3.0, 3.0, 0.0, 0.0]],
                                          dtype=torch.float64)]).float()
    n = f32.shape[0]
    args = (torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.int64),
            torch.ones(n, dtype=torch.float64), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    fast_ids, fast_scaled = sampler.sample(f32, *args)
    ids, scaled = sampler.sample(f32, *args, banned=torch.zeros(f32.shape, dtype=torch.bool))
    assert fast_ids.tolist() == ids.tolist() == [2, 0, 5, 1, 1]
    assert torch.equal(fast_scaled.nan_to_num(), scaled.nan_to_num())
    assert fast_scaled.dtype == torch.float64
    assert sampler.sample(f32, *args, want_scaled=False)[1] is None


def test_sample_is_argmax_of_scaled_logits_plus_noise_within_kept_set():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 300, 12
    logits = torch.randn(n, vocab, generator=gen, dtype=torch.float64) * 2
    temps = torch.full((n,), 0.8, dtype=torch.float64)
    top_k = torch.full((n,), 4, dtype=torch.int64)
    top_p = torch.ones(n, dtype=torch.float64)
    seeds = torch.randint(0, 2**62, (n,), generator=gen)
    positions = torch.randint(0, 1000, (n,), generator=gen)
    banned = torch.zeros(n, vocab, dtype=torch.bool)
    banned[:, 3] = True
    ids, scaled = sampler.sample(logits, temps, top_k, top_p, seeds, positions, banned)
    expect_scaled = logits.masked_fill(banned, float("-inf")) / 0.8
    assert torch.equal(scaled, expect_scaled)
    top4 = torch.topk(expect_scaled, 4, dim=-1).indices
    scores = torch.full_like(expect_scaled, float("-inf"))
    scores.scatter_(1, top4, expect_scaled.gather(1, top4))
    expect = (scores + sampler.gumbel_noise(seeds, positions, vocab)).argmax(-1)
    assert torch.equal(ids, expect)
    assert not (ids == 3).any()
    assert len(set(ids.tolist())) > 4  # not all the argmax: noise matters


def test_noise_is_the_same_on_any_batch_shape():
    gen = torch.Generator().manual_seed(1)
    seeds = torch.randint(0, 2**63 - 1, (16,), generator=gen)
    seeds[:3] = torch.tensor([0, 1, 2**63 - 1])
    positions = torch.randint(0, 5000, (16,), generator=gen)
    full = sampler.gumbel_noise(seeds, positions, 64)
    for i in range(16):
        one = sampler.gumbel_noise(seeds[i:i + 1], positions[i:i + 1], 64)
        assert torch.equal(one, full[i:i + 1])
    perm = torch.randperm(16, generator=gen)[:7]
    assert torch.equal(sampler.gumbel_noise(seeds[perm], positions[perm], 64), full[perm])
    # the vocabulary size only adds columns
    assert torch.equal(sampler.gumbel_noise(seeds, positions, 200)[:, :64], full)
    # different positions and seeds get different noise
    assert not torch.equal(sampler.gumbel_noise(seeds, positions + 1, 64), full)
    assert not torch.equal(sampler.gumbel_noise(seeds + 1, positions, 64), full)


def test_noise_is_standard_gumbel():
    seeds = torch.arange(2000)
    noise = sampler.gumbel_noise(seeds, torch.full((2000,), 7), 100).flatten()  # 200k draws
    assert noise.mean().item() == pytest.approx(0.5772156649, abs=0.01)
    assert noise.var().item() == pytest.approx(math.pi ** 2 / 6, abs=0.03)
    # P(g <= 0) = exp(-1)
    assert (noise <= 0).double().mean().item() == pytest.approx(math.exp(-1), abs=0.005)


M32 = 0xFFFFFFFF


def lowbias32_ref(x: int) -> int:
    """lowbias32 (Wellons, hash-prospector) on Python ints, uint32 arithmetic."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def gumbel_ref(seed: int, position: int, v: int) -> float:
    key = lowbias32_ref((position & M32) ^ 0x9E3779B9)
    key = lowbias32_ref(key ^ ((seed >> 32) & M32))
    key = lowbias32_ref((key + (seed & M32)) & M32)
    h = lowbias32_ref(key ^ lowbias32_ref(v))
    u = ((h >> 8) + 0.5) / (1 << 24)
    return -math.log(-math.log(u))


def test_mix32_equals_uint32_reference():
    rng = random.Random(2)
    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, M32 - 1, M32]
    values += [rng.getrandbits(32) for _ in range(2000)]
    got = sampler.mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert got == [lowbias32_ref(v) for v in values]
    assert len(set(got)) == len(set(values))  # a bijection on uint32
    assert all(0 <= g <= M32 for g in got)


def test_gumbel_noise_equals_reference():
    rng = random.Random(3)
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63 - 1] + [rng.getrandbits(63) for _ in range(20)]
    positions = [0, 1, 7, 4095, 2**20] + [rng.randrange(100000) for _ in range(20)]
    noise = sampler.gumbel_noise(torch.tensor(seeds), torch.tensor(positions), 50)
    for i, (s, p) in enumerate(zip(seeds, positions)):
        for v in (0, 1, 17, 49):
            assert noise[i, v].item() == pytest.approx(gumbel_ref(s, p, v), rel=1e-13, abs=1e-13)


def test_derive_seed_is_stable_and_63_bit():
    a = sampler.derive_seed(0, "record-1", 2)
    assert a == sampler.derive_seed(0, "record-1", 2)
    assert a != sampler.derive_seed(0, "record-1", 3) != sampler.derive_seed(1, "record-1", 2)
    assert 0 <= a < 2**63


def test_job_sampling_written_to_the_output_reads_back():
    """The output file's config holds ``SamplingParams.to_dict()`` (lists, logit_bias as
    ``{"id": bias}``); ``reference`` and ``specbatch.ray`` read it back with ``from_dict``.
    Building ``SamplingParams(**d)`` directly failed on ``logit_bias={}``, so
    ``python -m specbatch.reference`` failed on every output file."""
    from specbatch.config import SamplingParams

    for p in (SamplingParams(), SamplingParams(stop=("a", "b"), stop_token_ids=(2, 7),
                                               logit_bias=((5, -100.0), (9, 2.5)), min_p=0.1)):
        assert SamplingParams.from_dict(p.to_dict()) == p


def test_ray_processor_takes_vllm_style_sampling_kwargs():
    """``build_processor(..., logit_bias={"5": -100}, stop=[...])`` as a vLLM user writes
    them; an unknown name is an error naming it."""
    pytest.importorskip("ray")
    from specbatch.ray import build_processor

    assert callable(build_processor(logit_bias={"5": -100}, stop=["x"], max_tokens=8))
    with pytest.raises(ValueError, match="temprature"):
        build_processor(temprature=0.5)
