"""Speculation never changes the output (greedy), on every step backend this machine runs
(``tests.helpers.backend_cases``: the torch reference in float64, the C kernels in float32 and
int8, Triton under its interpreter or on CUDA): n-gram speculation at k in {1, 2, 5, 8} and
batch sizes {1, 4, 16} gives exactly the tokens of plain decoding (k = 0, batch size 1) on the
same backend, which in float64 equal transformers' greedy ``generate``; and the stats add up.
Triton under the interpreter is slow: it runs plain decoding and one speculative case."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.engine.sequence import Request
from tests.helpers import (LLAMA3_ROPE, backend_cases, make_engine, repeating_prompts,
                           run_engine, tiny_llama, tiny_qwen2, total)

VOCAB = 96
MAX_TOKENS = 32
NUM_PROMPTS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS)
MODELS = {"llama": lambda: tiny_llama(VOCAB, seed=5, rope_parameters=LLAMA3_ROPE),
          "qwen2": lambda: tiny_qwen2(VOCAB, seed=6)}
BACKENDS = {case.id: case for case in backend_cases()}
# (model, backend) pairs; the slow backend runs the Llama model only
SETUPS = [(m, b) for b, case in BACKENDS.items() for m in MODELS
          if not case.slow or m == "llama"]
FAST_SETUPS = [s for s in SETUPS if not BACKENDS[s[1]].slow]
GRID = [(k, bsz) for bsz in (1, 4, 16) for k in (1, 2, 5, 8)]
SLOW_GRID = [(5, 4)]


def _id(setup) -> str:
    return "-".join(setup)


class Setup:
    """A model on one backend: its ``LlamaForward``, prompts, and plain-decoding completions
    at batch size 1 (a slow backend: 4 prompts of 12 tokens). ``run`` runs the engine on that
    backend (under its switches)."""

    def __init__(self, model_name: str, backend_id: str) -> None:
        self.backend = BACKENDS[backend_id]
        self.model = self.backend.convert(MODELS[model_name]())
        self.forward = self.backend.forward(self.model)
        slow = self.backend.slow
        self.prompts = repeating_prompts(VOCAB, 4 if slow else NUM_PROMPTS, seed=7)
        self.sampling = SamplingParams(max_tokens=12) if slow else GREEDY
        self.base = self.run(self.prompts, 0, 1, self.sampling)

    def run(self, prompts, k, batch_size, sampling):
        with self.backend.switches():
            return run_engine(self.forward, prompts, k, batch_size, sampling)

    def engine(self, k, batch_size):
        return make_engine(self.forward, k, batch_size)


@functools.cache  # one per (model, backend) for the module: the grid shares its base
def _setup(model_name: str, backend_id: str) -> Setup:
    return Setup(model_name, backend_id)


@pytest.fixture
def setup(request) -> Setup:
    return _setup(*request.param)


@pytest.mark.parametrize("setup", SETUPS, ids=_id, indirect=True)
def test_plain_decoding_equals_hf_generate(setup):
    base, prompts = setup.base, setup.prompts
    if setup.backend.id == "torch-float64":  # the reference computes the model's own tokens
        for i in (0, 3, 9):
            with torch.no_grad():
                ref = setup.model.generate(torch.tensor([prompts[i]]),
                                           max_new_tokens=MAX_TOKENS, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
            assert base[i].output_ids == ref[0, len(prompts[i]):].tolist()
    max_tokens = setup.sampling.max_tokens
    assert all(len(c.output_ids) == max_tokens and c.finish_reason == "length" for c in base)
    # plain decoding never drafts
    assert total(base, "num_draft_tokens") == 0
    assert all(c.stats.num_steps == max_tokens for c in base)


@pytest.mark.parametrize(
    "setup,k,batch_size",
    [pytest.param(s, k, bsz, id=f"{_id(s)}-k{k}-b{bsz}") for s in SETUPS
     for k, bsz in (SLOW_GRID if BACKENDS[s[1]].slow else GRID)], indirect=["setup"])
def test_spec_equals_plain(setup, k, batch_size):
    out = setup.run(setup.prompts, k, batch_size, setup.sampling)
    for c, b in zip(out, setup.base):
        assert c.output_ids == b.output_ids
        assert c.finish_reason == "length"
    # drafts really were accepted, so a verifier that mishandled them would show
    assert total(out, "num_accepted_tokens") >= 2 * len(setup.prompts)
    assert total(out, "num_draft_tokens") > total(out, "num_accepted_tokens")  # some rejected
    for c in out:
        check_stats(c, k)


def check_stats(c, k: int) -> None:
    s = c.stats
    assert s.num_speculative_tokens == k
    # no stop trimmed a step: each step emitted accepted + 1 tokens
    assert len(c.output_ids) == s.num_steps + s.num_accepted_tokens
    assert sum(s.num_accepted_tokens_per_pos) == s.num_accepted_tokens
    assert len(s.num_accepted_tokens_per_pos) <= k
    # a draft at position i is only accepted after the one at i - 1
    per_pos = s.num_accepted_tokens_per_pos
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:]))
    assert s.num_draft_tokens <= k * s.num_drafts
    assert s.num_accepted_tokens <= s.num_draft_tokens
    assert sum(s.k_histogram.values()) == s.num_steps - 1  # every step but the prefill
    assert s.num_drafts == sum(n for kk, n in s.k_histogram.items() if kk > 0)
    assert s.num_draft_tokens == sum(kk * n for kk, n in s.k_histogram.items())
    if s.num_drafts:
        assert s.mean_acceptance_length == pytest.approx(
            1 + s.num_accepted_tokens / s.num_drafts, abs=1e-12)
        assert s.acceptance_rate == pytest.approx(
            s.num_accepted_tokens / s.num_draft_tokens, abs=1e-12)
        d = s.to_dict()
        assert d["num_accepted_tokens_per_pos"][:len(per_pos)] == per_pos
        assert len(d["num_accepted_tokens_per_pos"]) == k


@pytest.mark.parametrize("setup", FAST_SETUPS, ids=_id, indirect=True)
def test_mixed_lengths_and_order_change_nothing(setup):
    """Requests in shuffled order with different max_tokens: rows finish at different steps
    and freed rows are refilled mid-run, so every record sees changing neighbours. Greedy
    output is a prefix of the full-length plain output."""
    prompts, base = setup.prompts, setup.base
    order = list(range(NUM_PROMPTS))
    random.Random(8).shuffle(order)
    caps = [3 + (7 * i) % (MAX_TOKENS - 2) for i in range(NUM_PROMPTS)]
    sampling = [SamplingParams(max_tokens=caps[i]) for i in order]
    out = setup.run([prompts[i] for i in order], 5, 3, sampling)
    for c, i in zip(out, order):
        assert c.output_ids == base[i].output_ids[:caps[i]]
        check_stats(c, 5)
    assert total(out, "num_accepted_tokens") > 0


@pytest.mark.parametrize("setup", FAST_SETUPS, ids=_id, indirect=True)
def test_max_k_per_request_caps_drafts(setup):
    """A request's max_k lowers its own draft length only; output is unchanged."""
    prompts, base = setup.prompts, setup.base
    engine = setup.engine(6, 4)
    reqs = [Request(i, p, GREEDY, seed=i, max_k=2 if i % 2 else None)
            for i, p in enumerate(prompts)]
    out = sorted(engine.generate(reqs), key=lambda c: c.request.request_id)
    for c, b in zip(out, base):
        assert c.output_ids == b.output_ids
        cap = 2 if c.request.request_id % 2 else 6
        assert max(c.stats.k_histogram) <= cap
        assert c.stats.num_speculative_tokens == cap
    assert max(max(c.stats.k_histogram) for c in out[::2]) == 6


@pytest.mark.parametrize("case", ["float64", "bfloat16", "float16"]
                         + [b for b in BACKENDS if b[:2] == "c-"])
def test_long_prompt_admitted_mid_run(case):
    """A 300-token prompt admitted while other rows decode is prefilled over several steps (a
    budget of 32 prompt tokens per forward: one attention chunk of 64 per step), each step beside the running rows'
    verify steps; every answer equals plain decoding at batch 1 with the prompts prefilled
    whole, in float64 and bit for bit in bfloat16 and float16 (torch's kernels, where a greedy
    flip needs one ulp), and on
    the C kernels (float32, int8), whose prefill runs the decode step per prompt token."""
    model = tiny_llama(VOCAB, seed=9)
    model = BACKENDS[case].convert(model) if case in BACKENDS else model.to(getattr(torch, case))
    gen = torch.Generator().manual_seed(10)
    phrase = torch.randint(0, VOCAB, (7,), generator=gen).tolist()
    long_prompt = (phrase * 50)[:300]
    prompts = repeating_prompts(VOCAB, 4, seed=11) + [long_prompt]
    order = [0, 1, 4, 2, 3]  # rows 0-1 start; the long prompt takes the row row 0 frees
    caps = {0: 3, 1: 30, 2: 12, 3: 20, 4: 24}
    reqs = [(prompts[i], SamplingParams(max_tokens=caps[i])) for i in order]
    base = run_engine(model, [p for p, _ in reqs], 0, 1, [sp for _, sp in reqs],
                      max_model_len=512)

    engine = make_engine(model, 5, 2, max_model_len=512, prefill_chunk=64, max_prefill_tokens=32)
    decoding_beside = []  # rows decoding while each prefill forward ran
    prefill_step = engine.runner.prefill_step

    def spy(seqs, max_tokens=None, others=()):
        decoding_beside.append(sum(s.is_prefilled for s in engine.scheduler.running.values()))
        return prefill_step(seqs, max_tokens, others)

    engine.runner.prefill_step = spy
    requests = [Request(j, p, sp, seed=j) for j, (p, sp) in enumerate(reqs)]
    out = sorted(engine.generate(requests), key=lambda c: c.request.request_id)
    for c, b in zip(out, base):
        assert c.output_ids == b.output_ids
        assert len(c.output_ids) == c.request.sampling.max_tokens
    assert sum(1 for n in decoding_beside if n) >= 300 // 64  # the long prompt, chunked mid-run
    assert total(out, "num_accepted_tokens") > 0
