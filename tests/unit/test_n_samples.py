"""``n`` samples per prompt (pipeline.generate_records on tiny float64 models): lists with one
entry per sample, each sample its own noise, sample 0 equal to n = 1, and n-gram k = 5 at
batch 8 equal to plain decoding at batch 1."""

from __future__ import annotations

import pytest

from specbatch.config import SamplingParams
from specbatch.io.records import Record
from specbatch.pipeline import generate_records
from tests.helpers import cycle_prompt, cyclic_llama, make_engine


class _Renderer:
    """Token-id prompts: a record's ``prompt`` is already a list of ids."""

    tokenizer = None

    def first_prompt(self, record):
        return list(record.prompt), None


def _records(prompts, sampling):
    return [Record(i, i + 1, i, {}, p, None, None, sampling) for i, p in enumerate(prompts)]


def _run(model, prompts, sampling, k, batch_size):
    engine = make_engine(model, k, batch_size)
    out = dict((rec.index, o) for rec, o in
               generate_records(engine, _Renderer(), _records(prompts, sampling), run_seed=3))
    return [out[i] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def setup():
    model = cyclic_llama(32, peak=0.4, seed=3)
    prompts = [cycle_prompt(model.succ, s, 34 + s % 5) for s in range(8)]
    sp = SamplingParams(max_tokens=16, temperature=0.8, n=3)
    return model, prompts, sp, _run(model, prompts, sp, 0, 1)


def test_n_samples_are_lists_and_differ(setup):
    model, prompts, sp, base = setup
    for prompt, out in zip(prompts, base):
        for key in ("output", "output_token_ids", "finish_reason", "stop_reason"):
            assert isinstance(out[key], list) and len(out[key]) == 3, key
        assert [len(ids) for ids in out["output_token_ids"]] == [16, 16, 16]
        assert out["usage"]["completion_tokens"] == 48
        assert out["usage"]["prompt_tokens"] == len(prompt)  # counted once, as OpenAI does
        per = out["spec"]["per_sample"]
        assert len(per) == 3 and sum(p["num_steps"] for p in per) == out["spec"]["num_steps"]
    # samples of one prompt do not share noise
    distinct = sum(len({tuple(ids) for ids in out["output_token_ids"]}) for out in base)
    assert distinct >= 3 * len(base) - 2
    # sample 0 is what n = 1 gives
    one = _run(model, prompts, SamplingParams(max_tokens=16, temperature=0.8), 0, 4)
    assert [o["output_token_ids"] for o in one] == [o["output_token_ids"][0] for o in base]
    assert isinstance(one[0]["output"], str) and "per_sample" not in one[0]["spec"]


def test_n_spec_equals_plain(setup):
    model, prompts, sp, base = setup
    out = _run(model, prompts, sp, 5, 8)
    assert [o["output_token_ids"] for o in out] == [o["output_token_ids"] for o in base]
    assert sum(o["spec"]["num_accepted_tokens"] for o in out) > 50
