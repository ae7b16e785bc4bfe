"""Prefix caching (``ModelRunner.start``): a prompt whose prefix a row's cache already holds
starts its prefill after it, with the same bits as a prefill from token 0."""

import pytest
import torch

from specbatch.config import SamplingParams
from specbatch.engine.runner import _common_prefix
from specbatch.engine.sequence import Request
from specbatch.models.llama import LlamaForward
from tests.helpers import make_engine, tiny_llama

VOCAB = 96


def _generate(engine, prompts, sampling):
    out = {}
    reqs = [Request(i, list(p), sp, seed=i) for i, (p, sp) in enumerate(zip(prompts, sampling))]
    for c in engine.generate(reqs):
        out[c.request.request_id] = c
    return [out[i] for i in range(len(prompts))]


def _templated(num: int, template_len: int = 24, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    template = torch.randint(1, VOCAB, (template_len,), generator=gen).tolist()
    prompts = []
    for i in range(num):
        tail = torch.randint(1, VOCAB, (5 + 3 * i % 11,), generator=gen).tolist()
        prompts.append(template + tail)
    return prompts


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids
        assert [e.logprob for e in x.logprobs] == [e.logprob for e in y.logprobs]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=31).float()


@pytest.mark.parametrize("batch,k", [(1, 0), (1, 3), (2, 3), (3, 0)])
def test_outputs_and_logprobs_equal_a_run_without_it(model, batch, k):
    """Templated prompts (24 shared tokens), one of them twice and one that extends another:
    the tokens and their logprobs (the first from the prefill's last logits) are bit for bit
    those of a run that prefills every prompt from token 0; and it did reuse tokens."""
    prompts = _templated(7)
    prompts.append(list(prompts[2]))  # the same prompt again
    prompts.append(prompts[4] + prompts[5][-4:])  # a longer prompt holding another whole
    sps = [SamplingParams(max_tokens=6 + i % 4, logprobs=2, temperature=0.0 if i % 2 else 0.8)
           for i in range(len(prompts))]
    on = make_engine(model, k, batch)
    off = make_engine(model, k, batch, prefix_caching=False)
    assert on.runner.prefix_caching and not off.runner.prefix_caching
    _same(_generate(on, prompts, sps), _generate(off, prompts, sps))
    assert off.runner.num_prefix_reused == 0
    assert on.runner.num_prompt_tokens == sum(map(len, prompts))
    assert on.runner.num_prefix_reused >= 24 * (len(prompts) - batch)


def test_batch_one_reuses_the_rows_last_record_exactly(model):
    """Batch 1: each record finds the previous one's tokens in row 0. Reused: the shared
    template (24), a repeated prompt all but its last token, and a follow-up whose prompt is
    the previous record's prompt + output + more, everything the row fed (prompt + output
    but the last output token, which is never fed)."""
    a, b = _templated(2, seed=5)
    assert a[24] != b[24]
    engine = make_engine(model, 3, 1)
    sp = SamplingParams(max_tokens=5)
    first = _generate(engine, [a], [sp])[0]
    assert engine.runner.num_prefix_reused == 0
    _generate(engine, [b], [sp])
    assert engine.runner.num_prefix_reused == 24
    _generate(engine, [b], [sp])
    assert engine.runner.num_prefix_reused == 24 + len(b) - 1
    follow = a + first.output_ids + [7, 8]  # row 0 now holds b: only the template matches
    _generate(engine, [follow], [sp])
    assert engine.runner.num_prefix_reused == 24 + len(b) - 1 + 24
    second = _generate(engine, [a], [sp])[0]
    fed = len(follow) + len(second.output_ids) - 1  # follow's prompt + output, but the last
    again = follow + second.output_ids + [9]
    before = engine.runner.num_prefix_reused
    ref = _generate(make_engine(model, 3, 1, prefix_caching=False), [again], [sp])
    assert _generate(engine, [again], [sp])[0].output_ids == ref[0].output_ids
    # row 0 held a (the last record): a's prompt + output, not follow's; a is a prefix of again
    assert engine.runner.num_prefix_reused - before == len(a) + len(second.output_ids) - 1
    assert fed > 0


def test_a_running_rows_keys_are_copied_into_a_new_row(model):
    """Batch 2: record 0 stops at once, record 1 runs long; record 2 (record 1's prompt plus
    a few tokens) takes row 0 and copies record 1's prompt keys from row 1 (row 0 held only
    record 0's tokens, which share nothing with it)."""
    gen = torch.Generator().manual_seed(9)
    p0 = torch.randint(1, VOCAB, (12,), generator=gen).tolist()
    p1 = torch.randint(1, VOCAB, (30,), generator=gen).tolist()
    p1[0] = (p0[0] + 1) % VOCAB or 1
    p2 = p1 + [3, 4, 5]
    sps = [SamplingParams(max_tokens=1, logprobs=0),
           SamplingParams(max_tokens=20, ignore_eos=True, logprobs=0),
           SamplingParams(max_tokens=4, logprobs=0)]
    on = make_engine(model, 2, 2)
    off = make_engine(model, 2, 2, prefix_caching=False)
    _same(_generate(on, [p0, p1, p2], sps), _generate(off, [p0, p1, p2], sps))
    assert on.runner.num_prefix_reused == len(p1)


def test_off_where_prefill_depends_on_the_chunk():
    """float64 prefills a prompt's first chunk with one fused attention: no reuse there."""
    model64 = tiny_llama(VOCAB, seed=31).double()
    assert not LlamaForward(model64).backend.prefill_per_token
    engine = make_engine(model64, 2, 1)
    assert not engine.runner.prefix_caching
    prompts = _templated(3)
    _generate(engine, prompts, [SamplingParams(max_tokens=3)] * 3)
    assert engine.runner.num_prefix_reused == 0


def test_common_prefix():
    assert _common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 10) == 4
    assert _common_prefix([1, 2, 3, 4], [1, 2, 3, 4, 5], 3) == 3
    assert _common_prefix([1, 2, 3, 4], [1, 2, 9, 4], 10) == 2
    assert _common_prefix([1, 2], [], 10) == 0
    for n in range(0, 40):
        a = list(range(40))
        b = a[:n] + [-1] + a[n + 1:]
        assert _common_prefix(a, b, 100) == n


@pytest.mark.parametrize("bad", ["false", None, 0, 1])
def test_llm_names_enable_prefix_caching_in_its_error(bad):
    """A bad value is refused, before any model loads, under the name the caller used."""
    from specbatch import LLM
    from specbatch.config import ConfigError

    with pytest.raises(ConfigError, match=r"^enable_prefix_caching=.*expected True or False"):
        LLM(method="none", enable_prefix_caching=bad)


@pytest.mark.parametrize("chunk,budget,reused", [
    (1024, 2048, 3 * 40),  # one forward: each copy's one chunk copied after it, logits too
    (16, 2048, 3 * 8),  # chunks 0-16, 16-32 computed by all (read in the forward), 32-40 copied
    (1024, 40, 3 * 39),  # a prompt a step: the rows before hold it, all but the last token
])
def test_the_same_prompt_admitted_together_is_prefilled_once(model, chunk, budget, reused):
    """Four requests of one 40-token prompt (the n samples of a record) and one other, admitted
    together: at admission no row holds the prompt yet (``start`` finds nothing); the prefill
    then copies what a sibling computed, before or after the forward
    (``ModelRunner.prefill_step``). Sampled tokens and logprobs are those of a run without
    prefix caching, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    same = torch.randint(1, VOCAB, (40,), generator=gen).tolist()
    other = torch.randint(1, VOCAB, (23,), generator=gen).tolist()
    other[0] = (same[0] + 1) % VOCAB or 1
    prompts = [same, other, same, same, same]
    sps = [SamplingParams(max_tokens=6, logprobs=2, temperature=0.9)] * len(prompts)
    kw = dict(prefill_chunk=chunk, max_prefill_tokens=budget)
    on = make_engine(model, 2, 5, **kw)
    off = make_engine(model, 2, 5, prefix_caching=False, **kw)
    got = _generate(on, prompts, sps)
    _same(got, _generate(off, prompts, sps))
    assert len({tuple(c.output_ids) for c in got}) > 2  # the seeds differ: so do the samples
    assert on.runner.num_prefix_reused == reused
