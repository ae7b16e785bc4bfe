"""The Python API is vLLM-shaped where vLLM users port code (issue 36, item 9): vLLM's offline
example runs unchanged apart from its import line and model name; ``generate`` returns
``RequestOutput``s with ``.outputs[i].text`` / ``.token_ids`` / ``.finish_reason`` /
``.cumulative_logprob`` / ``.logprobs``, ``.prompt`` and ``.prompt_token_ids``, with
specbatch's ``usage`` and ``spec`` stats beside them; ``LLM(...)`` takes vLLM's common kwargs.
"""

from __future__ import annotations

import math
import runpy

import pytest

from specbatch.config import ConfigError
from tests.unit.test_progress import fast_calibration, tiny  # noqa: F401 (fixtures)

# vLLM's examples/offline_inference/basic/basic.py, as a vLLM user has it; only the import line
# and the model name differ (MODEL is replaced by the tiny model's path).
VLLM_BASIC = '''
from specbatch import LLM, SamplingParams

# Sample prompts.
prompts = [
    "Hello, my name is",
    "The president of the United States is",
    "The capital of France is",
    "The future of AI is",
]
# Create a sampling params object.
sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


def main():
    # Create an LLM.
    llm = LLM(model="MODEL")
    # Generate texts from the prompts.
    # The output is a list of RequestOutput objects
    # that contain the prompt, generated text, and other information.
    outputs = llm.generate(prompts, sampling_params)
    # Print the outputs.
    print("\\nGenerated Outputs:\\n" + "-" * 60)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
        print(f"Prompt:    {prompt!r}")
        print(f"Output:    {generated_text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
'''
PROMPTS = ["Hello, my name is", "The president of the United States is",
           "The capital of France is", "The future of AI is"]


def test_vllm_basic_example_runs_unchanged(tiny, tmp_path, capsys,  # noqa: F811
                                           fast_calibration):  # noqa: F811
    """The example (method auto, as ``LLM(model=...)`` defaults) prints each prompt and its
    text; the texts are those of a plain ``none`` run of the same prompts and sampling (the
    record seeds come from the run seed and the ids: speculation never changes the tokens)."""
    from specbatch import LLM, SamplingParams

    model, cache = tiny
    script = tmp_path / "basic.py"
    script.write_text(VLLM_BASIC.replace("MODEL", str(model)))
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    ref = LLM(model=str(model), method="none", cache_dir=str(cache)).generate(
        PROMPTS, SamplingParams(temperature=0.8, top_p=0.95))
    expected = "".join(f"Prompt:    {o.prompt!r}\nOutput:    {o.outputs[0].text!r}\n"
                       + "-" * 60 + "\n" for o in ref)
    assert printed == "\nGenerated Outputs:\n" + "-" * 60 + "\n" + expected
    assert [o.prompt for o in ref] == PROMPTS
    assert all(o.outputs[0].token_ids for o in ref)


def test_request_output_is_vllm_shaped(tiny):  # noqa: F811
    """n = 2 with logprobs, and a two-turn record: one ``CompletionOutput`` per sample with
    its index, text, ids, reasons and logprobs; the prompt and its ids; the CLI's fields and
    ``spec`` stats beside them (``.text`` and friends as before)."""
    from specbatch import LLM, SamplingParams

    model, cache = tiny
    llm = LLM(model=str(model), method="ngram", k=3, cache_dir=str(cache))
    sp = SamplingParams(temperature=0.7, max_tokens=6, n=2, logprobs=2, seed=3)
    plain, turns = llm.generate(["abc abc abc", {"id": "t", "turns": ["one", "two"]}], sp)

    assert plain.request_id == "1" and plain.id == 1 and plain.finished
    assert plain.prompt == "abc abc abc"
    assert plain.prompt_token_ids == llm.tokenizer.encode("abc abc abc")
    assert plain.prompt_logprobs is None
    assert [o.index for o in plain.outputs] == [0, 1]
    for s, o in enumerate(plain.outputs):
        assert o.text == plain.fields["output"][s] == plain.text[s]
        assert o.token_ids == plain.fields["output_token_ids"][s] and 1 <= len(o.token_ids) <= 6
        assert o.finish_reason == plain.finish_reason[s] and o.finished()
        assert o.stop_reason == plain.stop_reason[s]
        assert len(o.logprobs) == len(o.token_ids)
        for pos, tok, entry in zip(o.logprobs, o.token_ids, plain.fields["logprobs"][s]):
            assert next(iter(pos)) == tok  # the chosen token first, then the top-2
            assert pos[tok].logprob == entry["logprob"] <= 0
            assert {t for t, _ in entry["top"]} <= set(pos) and len(pos) <= 3
            assert [pos[t].rank for t, _ in entry["top"]] == [1, 2]
            assert pos[tok].decoded_token == llm.tokenizer.decode([tok])
        assert math.isclose(o.cumulative_logprob,
                            sum(e["logprob"] for e in plain.fields["logprobs"][s]))
    assert plain.usage["completion_tokens"] == sum(len(o.token_ids) for o in plain.outputs)
    assert plain.spec["proposer"] == "ngram" and len(plain.spec["per_sample"]) == 2

    assert turns.request_id == "t"
    assert turns.prompt_token_ids == llm.renderer.encode_chat([{"role": "user",
                                                                "content": "one"}])
    assert turns.prompt == llm.tokenizer.decode(turns.prompt_token_ids)
    assert "one" in turns.prompt
    for s, o in enumerate(turns.outputs):
        assert len(o.text) == len(o.token_ids) == len(o.finish_reason) == 2  # one per turn
        assert o.token_ids == turns.fields["output_token_ids"][s]
        assert [len(lp) for lp in o.logprobs] == [len(t) for t in o.token_ids]
        assert len(o.cumulative_logprob) == 2


def test_greedy_output_without_logprobs(tiny):  # noqa: F811
    """Without ``logprobs``, ``.logprobs`` and ``.cumulative_logprob`` are None (as vLLM's);
    n = 1 gives one output and the CLI-shaped fields stay plain values."""
    from specbatch import LLM, SamplingParams

    model, cache = tiny
    out, = LLM(model=str(model), method="none", cache_dir=str(cache)).generate(
        "abc", SamplingParams(max_tokens=4))
    assert len(out.outputs) == 1
    o = out.outputs[0]
    assert (o.logprobs, o.cumulative_logprob) == (None, None)
    assert o.text == out.text and o.token_ids == out.token_ids and isinstance(o.text, str)


def test_vllm_constructor_kwargs(tiny):  # noqa: F811
    """``max_num_seqs``, ``speculative_config``, dtype ``float``, ``trust_remote_code`` and
    ``tensor_parallel_size=1`` are taken; what specbatch cannot do is refused naming it."""
    from specbatch import LLM

    model, cache = tiny
    llm = LLM(model=str(model), cache_dir=str(cache), dtype="float", max_num_seqs=3,
              trust_remote_code=True, tensor_parallel_size=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert llm.engine_config.dtype == "float32" and llm.engine_config.max_batch_size == 3
    sc = llm.spec_config
    assert (sc.method, sc.num_speculative_tokens, sc.prompt_lookup_min,
            sc.prompt_lookup_max) == ("ngram", 4, 1, 3)
    with pytest.raises(ConfigError, match="tensor_parallel_size=2"):
        LLM(model=str(model), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="method 'eagle' is not supported"):
        LLM(model=str(model), speculative_config={"method": "eagle", "model": "x"})
    with pytest.raises(ConfigError, match="unsupported key.*draft_tensor_parallel_size"):
        LLM(model=str(model), speculative_config={"method": "ngram",
                                                  "draft_tensor_parallel_size": 1})


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_spec_stats_hold_k_and_the_draft_cap(tiny, fast_calibration, method):  # noqa: F811
    """``spec.num_speculative_tokens`` is the k asked for, ``spec.max_spec_tokens`` the per-row
    draft cap (min(32, 3k) for suffix and auto; it was written as num_speculative_tokens);
    the tokens are plain decoding's (n = 2 samples, each sample's stats too)."""
    from specbatch import LLM, SamplingParams

    model, cache = tiny
    prompts = ["abc abc abc abc", "one two one two one", {"id": "t", "turns": ["ab ab", "ab"]}]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    ref = LLM(model=str(model), method="none", cache_dir=str(cache)).generate(prompts, sp)
    out = LLM(model=str(model), method=method, k=2, cache_dir=str(cache)).generate(prompts, sp)
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    for o in out:
        s = o.spec
        assert (s["proposer"], s["num_speculative_tokens"], s["max_spec_tokens"]) == (
            method, 2, 6)
        longest = max((int(k) for k, n in s["k_histogram"].items() if n), default=0)
        assert len(s["num_accepted_tokens_per_pos"]) == max(2, longest) <= 6
    plain = LLM(model=str(model), method="none", cache_dir=str(cache)).generate(
        prompts[:1], SamplingParams(temperature=0.5, seed=1, max_tokens=8, n=2))[0]
    multi = LLM(model=str(model), method=method, k=2, cache_dir=str(cache)).generate(
        prompts[:1], SamplingParams(temperature=0.5, seed=1, max_tokens=8, n=2))[0]
    assert multi.token_ids == plain.token_ids
    assert [(s["num_speculative_tokens"], s["max_spec_tokens"])
            for s in multi.spec["per_sample"]] == [(2, 6), (2, 6)]


def test_the_cache_is_allocated_once_at_what_the_job_needs(tiny, monkeypatch):
    """``prepare`` allocates the KV cache at the job's longest row plus a verify step's
    queries (``pipeline.kv_capacity``), rounded to the cache block: a short job takes one
    block (it took 512 positions whatever the job), a long one what it needs, and no job grows
    it (a grow copies every layer: 0.3-0.5 s for 16 rows of SmolLM2-135M)."""
    from specbatch import LLM, SamplingParams
    from specbatch.engine import kv_cache

    grows = []
    monkeypatch.setattr(kv_cache.KVCache, "grow",
                        lambda self, cap, _g=kv_cache.KVCache.grow: (grows.append(cap),
                                                                     _g(self, cap)))
    model, cache = tiny
    llm = LLM(model=str(model), method="ngram", k=3, cache_dir=str(cache))
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    long = " ".join(["abc"] * 70)
    n = len(llm.tokenizer.encode(long))
    for prompts, want in (([long, "abc"], kv_cache.round_capacity(n + 40 + 1 + 3)),
                          (["abc", "abc abc"], kv_cache.KV_BLOCK)):
        out = llm.generate(prompts, sp)
        assert [len(o.outputs[0].token_ids) for o in out] == [40, 40]
        assert llm.engine.runner.cache.capacity == want, (n, want)
    assert n + 44 > kv_cache.KV_BLOCK and grows == []
