"""Penalties, min_p and logit_bias (engine.logits, sampler.mask_min_p): n-gram speculation at
k = 5, batch 8 gives exactly the tokens of plain decoding at batch 1, and penalised plain
decoding equals a step-by-step reference on transformers' logits (tiny float64 models)."""

from __future__ import annotations

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.engine import logits as logits_processing
from specbatch.spec_decode import sampler
from tests.helpers import cycle_prompt, cyclic_llama, repeating_prompts, run_engine, tiny_llama, total

FEATURES = {
    "repetition_penalty": dict(repetition_penalty=1.3),
    "presence_frequency": dict(presence_penalty=0.5, frequency_penalty=0.5),
    "min_p": dict(min_p=0.1),
    "logit_bias": dict(logit_bias=((3, 5.0), (7, -100.0), (11, 2.0))),
}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cyclic():
    """A model whose text follows a cycle (drafts mostly accepted) and prompts along it."""
    model = cyclic_llama(32, peak=0.4, seed=3)
    return model, [cycle_prompt(model.succ, s % 32, 34 + s % 8) for s in range(16)]


@pytest.fixture(scope="module")
def random_model():
    """A random model and repeated-phrase prompts (drafts often rejected)."""
    return tiny_llama(96, seed=5), repeating_prompts(96, 16, seed=7)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_spec_equals_plain(cyclic, random_model, feature, temperature):
    accepted = rejected = 0
    for model, prompts in (cyclic, random_model):
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, **FEATURES[feature])
        base = run_engine(model, prompts, 0, 1, sp)
        out = run_engine(model, prompts, 5, 8, sp)
        assert [c.output_ids for c in out] == [c.output_ids for c in base]
        accepted += total(out, "num_accepted_tokens")
        rejected += total(out, "num_draft_tokens") - total(out, "num_accepted_tokens")
    assert accepted > 100 and rejected > 0  # drafts were accepted and rejected


def test_feature_changes_the_output(cyclic, random_model):
    """Each feature really acts (a no-op processor would pass the equality test above)."""
    for feature, kw in FEATURES.items():
        changed = 0
        for model, prompts in (cyclic, random_model):
            plain = run_engine(model, prompts[:6], 0, 6, SamplingParams(max_tokens=12,
                                                                        temperature=0.8))
            with_it = run_engine(model, prompts[:6], 0, 6,
                                 SamplingParams(max_tokens=12, temperature=0.8, **kw))
            changed += sum(a.output_ids != b.output_ids for a, b in zip(plain, with_it))
        assert changed >= 2, feature


def test_drafts_count_towards_penalties(cyclic, random_model, monkeypatch):
    """A processor that counts only committed tokens (not the drafts before each position)
    makes speculation change the output: the equality test above would catch it. (Not
    testable with repetition_penalty: an n-gram draft token is always in the prompt or output
    already.)"""
    feature = "presence_frequency"
    orig = logits_processing._apply_penalties
    monkeypatch.setattr(logits_processing, "_apply_penalties",
                        lambda rows, seq, drafts: orig(rows, seq, [0] * len(drafts)))
    mismatched = 0
    for model, prompts in (cyclic, random_model):
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, **FEATURES[feature])
        base = run_engine(model, prompts, 0, 1, sp)
        out = run_engine(model, prompts, 5, 8, sp)
        mismatched += sum(a.output_ids != b.output_ids for a, b in zip(out, base))
    assert mismatched >= 2


def reference_penalised(model, prompt: list[int], sp: SamplingParams, seed: int) -> list[int]:
    """Decode one token at a time on transformers' logits of the whole sequence, penalties and
    bias written out from vLLM's definitions, min_p and noise from the sampler."""
    ids = list(prompt)
    out: list[int] = []
    for t in range(sp.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].clone()  # [V] float64
        for tok, bias in sp.logit_bias:
            logits[tok] += bias
        for v in range(logits.shape[0]):
            if sp.repetition_penalty != 1.0 and (v in out or v in prompt):
                x = logits[v]
                logits[v] = x / sp.repetition_penalty if x > 0 else x * sp.repetition_penalty
            n = out.count(v)
            logits[v] -= sp.frequency_penalty * n + sp.presence_penalty * (n > 0)
        if sp.temperature == 0:
            tok = int(torch.argmax(logits))
        else:
            scaled = logits / sp.temperature
            probs = torch.softmax(scaled, -1)
            scaled[probs < sp.min_p * probs.max()] = float("-inf")
            noise = sampler.gumbel_noise(torch.tensor([seed]), torch.tensor([t]),
                                         logits.shape[0])[0]
            tok = int(torch.argmax(scaled + noise))
        out.append(tok)
        ids.append(tok)
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_equals_transformers_reference(random_model, feature, temperature):
    model, prompts = random_model
    sp = SamplingParams(max_tokens=12, temperature=temperature, **FEATURES[feature])
    out = run_engine(model, prompts[:4], 5, 4, sp)
    for i, c in enumerate(out):
        assert c.output_ids == reference_penalised(model, prompts[i], sp, seed=i)


def test_min_p_keeps_tokens_above_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.04, 0.16], [0.25, 0.25, 0.25, 0.25]],
                                    dtype=torch.float64))
    kept = sampler.mask_min_p(logits, torch.tensor([0.1, 1.0], dtype=torch.float64)) > -1e9
    # row 0: threshold 0.05 drops 0.04; row 1: min_p 1 keeps every token tied with the top
    assert kept.tolist() == [[True, True, False, True], [True, True, True, True]]


def test_penalties_count_drafts_before_each_position():
    """Row j of a step's logits counts the output plus drafts 0..j-1 (vLLM's formulas)."""
    from specbatch.engine.sequence import Request, Sequence

    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    seq = Sequence(Request(0, [1, 2], sp), "ngram", 3)
    seq.token_ids += [3, 3]  # output so far
    logits = torch.full((3, 6), 4.0, dtype=torch.float64)
    logits[:, 5] = -4.0
    out = logits_processing.process_logits(logits, [seq], [[5, 5]])
    # token 3: twice in the output -> 4/2 - 0.25*2 - 0.5; tokens 1, 2: prompt only -> 4/2
    assert out[:, 3].tolist() == [1.0, 1.0, 1.0]
    assert out[:, 1].tolist() == [2.0, 2.0, 2.0]
    assert out[:, 0].tolist() == [4.0, 4.0, 4.0]
    # token 5 (negative logit): untouched at j = 0, then seen once, then twice
    assert out[:, 5].tolist() == [-4.0, -8.0 - 0.25 - 0.5, -8.0 - 0.5 - 0.5]
    assert logits[0, 3] == 4.0  # the input is not modified
