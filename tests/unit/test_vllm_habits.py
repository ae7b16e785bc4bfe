"""What users coming from vLLM / transformers write, taken as they mean it (fresh-user passes):
``top_k=-1`` for "off", ``max_tokens=None`` for "up to the context", vLLM's engine knobs that
mean nothing here, ``use_tqdm``, ``-`` for standard input, and the errors they meet next.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from specbatch.cli import main
from specbatch.config import ConfigError, SamplingParams
from tests.unit.test_progress import tiny  # noqa: F401 (fixture)


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM takes top_k = -1 (its old default) and 0 for "off"; both are 0 here, so a config
    that records it says 0 whichever was written; below -1 is still refused."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) == SamplingParams()
    assert SamplingParams(top_k=-1).to_dict()["top_k"] == 0
    assert SamplingParams.from_dict({"top_k": -1}).top_k == 0
    with pytest.raises(ConfigError, match="top_k"):
        SamplingParams(top_k=-2)


def test_run_top_k_minus_one_writes_what_no_top_k_writes(tmp_path, tiny_gguf):
    """``--top-k -1`` (sampled, so top-k would matter): the same output rows and the same
    recorded sampling config as leaving --top-k out."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc abc"}\n{"id": 2, "prompt": "x y z", "top_k": -1}\n')
    common = ["run", str(inp), "--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "c"),
              "--method", "none", "--max-tokens", "6", "--temperature", "1.5", "--no-progress"]
    outs = {}
    for name, extra in (("off", []), ("minus1", ["--top-k", "-1"])):
        out = tmp_path / f"{name}.jsonl"
        r = CliRunner().invoke(main, [*common, "-o", str(out), *extra])
        assert r.exit_code == 0, r.output
        outs[name] = ([json.loads(line)["output_token_ids"] for line in
                       out.read_text().splitlines()],
                      json.loads((tmp_path / f"{name}.jsonl.config.json").read_text())["sampling"])
    assert outs["minus1"] == outs["off"]
    assert outs["off"][1]["top_k"] == 0 and len(outs["off"][0]) == 2
    r = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "bad.jsonl"), "--top-k", "-2"])
    assert r.exit_code == 2 and "--top-k" in r.output


def test_max_tokens_none_runs_up_to_the_context(tiny):  # noqa: F811
    """vLLM's default ``max_tokens=None``: the output runs until the prompt and output fill
    the context (``max_model_len``, here 24), ``finish_reason`` ``length``; its tokens are those
    of the explicit cap that leaves exactly that room (ngram: speculation changes nothing)."""
    from specbatch import LLM

    model, cache = tiny
    llm = LLM(model=str(model), method="ngram", cache_dir=str(cache), max_model_len=24)
    prompts = ["abc abc abc", "hello"]
    up_to, = [llm.generate(prompts, SamplingParams(max_tokens=None, ignore_eos=True))]
    for out in up_to:
        assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 24
        assert out.outputs[0].finish_reason == "length"
        room = 24 - len(out.prompt_token_ids)
        capped, = llm.generate(out.prompt, SamplingParams(max_tokens=room, ignore_eos=True))
        assert capped.outputs[0].token_ids == out.outputs[0].token_ids
    assert SamplingParams(max_tokens=None, min_tokens=5).min_tokens == 5
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_vllm_engine_knobs_are_ignored_with_one_warning(tiny, caplog, monkeypatch):  # noqa: F811
    """``gpu_memory_utilization`` / ``enforce_eager`` (``VLLM_IGNORED``) are taken and named in
    one warning per process; any other unknown keyword is still a ``TypeError``."""
    import logging

    from specbatch import llm as llm_module
    from specbatch.llm import LLM, VLLM_IGNORED

    assert {"gpu_memory_utilization", "enforce_eager"} <= set(VLLM_IGNORED)
    monkeypatch.setattr(llm_module, "_WARNED_IGNORED", set())
    model, cache = tiny
    with caplog.at_level(logging.WARNING, logger="specbatch"):
        llm = LLM(model=str(model), method="none", cache_dir=str(cache),
                  gpu_memory_utilization=0.9, enforce_eager=True)
        LLM(model=str(model), method="none", cache_dir=str(cache), gpu_memory_utilization=0.5)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "gpu_memory_utilization, enforce_eager" in warned[0] and "ignoring" in warned[0]
    assert llm.generate("abc", SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids
    with pytest.raises(TypeError, match="'max_num_batched_tokenz'"):
        LLM(model=str(model), cache_dir=str(cache), max_num_batched_tokenz=8)


def test_use_tqdm_turns_the_progress_bar_on_and_off(tiny, monkeypatch):  # noqa: F811
    """On a terminal, ``generate`` draws ``specbatch run``'s bar over the prompts (2/2 at the
    end) unless ``use_tqdm=False``; the outputs are the same either way; not a bool: refused."""
    import io

    from specbatch import LLM

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    model, cache = tiny
    llm = LLM(model=str(model), method="ngram", cache_dir=str(cache))
    texts = {}
    for use_tqdm in (True, False):
        err = Terminal()
        monkeypatch.setattr("sys.stderr", err)
        outs = llm.generate(["abc abc", "hello"], SamplingParams(max_tokens=4),
                            use_tqdm=use_tqdm)
        texts[use_tqdm] = [o.outputs[0].token_ids for o in outs]
        drawn = err.getvalue()
        assert ("2/2" in drawn and "tok/s" in drawn) if use_tqdm else drawn == "", drawn
    assert texts[True] == texts[False]
    with pytest.raises(ValueError, match="use_tqdm"):
        llm.generate("abc", use_tqdm="yes")


def test_use_tqdm_draws_the_bar_in_a_jupyter_notebook(tiny, monkeypatch):  # noqa: F811
    """A Jupyter kernel's stderr is no terminal, but the notebook redraws the bar in place:
    ``generate`` draws it there (vLLM's ``use_tqdm`` does); in a plain pipe it writes nothing."""
    import io
    import sys
    import types

    from specbatch import LLM

    class ZMQInteractiveShell:  # the kernel's shell class, by name
        pass

    model, cache = tiny
    llm = LLM(model=str(model), method="ngram", cache_dir=str(cache))
    drawn = {}
    for notebook in (False, True):
        fake = types.ModuleType("IPython")
        fake.get_ipython = (lambda: ZMQInteractiveShell()) if notebook else (lambda: None)
        monkeypatch.setitem(sys.modules, "IPython", fake)
        err = io.StringIO()
        monkeypatch.setattr("sys.stderr", err)
        llm.generate(["abc abc", "hello"], SamplingParams(max_tokens=4))
        drawn[notebook] = err.getvalue()
    assert drawn[False] == ""
    assert "2/2" in drawn[True] and "tok/s" in drawn[True], drawn[True]


def test_run_reads_jsonl_from_standard_input(tmp_path, tiny_gguf):
    """``specbatch run - -o OUT``: the records of standard input, written as those of the same
    file; bad lines named ``<stdin>:N``; without -o, one line, exit 2. A rerun with the same
    standard input resumes the work file; with other input it is refused (its sha256)."""
    text = '{"id": 1, "prompt": "abc abc"}\n{"id": 2, "prompt": "x y z"}\n'
    src = tmp_path / "in.jsonl"
    src.write_text(text)
    common = ["--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "c"), "--method", "ngram",
              "--max-tokens", "4", "--no-progress"]
    from_file, from_stdin = tmp_path / "file.jsonl", tmp_path / "stdin.jsonl"
    r = CliRunner().invoke(main, ["run", str(src), "-o", str(from_file), *common])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["run", "-", "-o", str(from_stdin), *common], input=text)
    assert r.exit_code == 0, r.output
    assert from_stdin.read_text() == from_file.read_text()
    config = json.loads((tmp_path / "stdin.jsonl.config.json").read_text())
    assert config["input"] == "-"
    # -o is required: nothing to name the output after
    r = CliRunner().invoke(main, ["run", "-", *common], input=text)
    assert r.exit_code == 2
    assert r.output.splitlines()[0] == ("error: INPUT - (standard input) needs -o OUT.jsonl: "
                                        "there is no file name to name the output after")
    # a bad line is named by its line of standard input
    r = CliRunner().invoke(main, ["run", "-", "-o", str(tmp_path / "bad.jsonl"), *common],
                           input=text + '{"id": 3}\n')
    assert r.exit_code == 2 and "error: <stdin>:3: no prompt" in r.output, r.output
    # resume: as if killed after record 1 (the work file holds it)
    first = json.loads(from_stdin.read_text().splitlines()[0])
    from_stdin.unlink()
    (tmp_path / "stdin.jsonl.work.jsonl").write_text(
        json.dumps({"index": 0, "record": first}) + "\n")
    r = CliRunner().invoke(main, ["run", "-", "-o", str(from_stdin), *common],
                           input=text.replace("x y z", "other"))
    assert r.exit_code == 2 and "differs in: input_sha256" in r.output, r.output
    assert "pipe the same input again" in r.output, r.output
    r = CliRunner().invoke(main, ["run", "-", "-o", "-", *common], input=text)
    assert r.exit_code == 2 and "-o -: writing the output to standard output is not " \
        "supported" in r.output, r.output
    r = CliRunner().invoke(main, ["run", "-", "-o", str(from_stdin), *common], input=text)
    assert r.exit_code == 0, r.output
    assert "resuming: 1 of 2 records already done" in r.output, r.output
    assert from_stdin.read_text() == from_file.read_text()


def test_a_resume_at_another_batch_size_is_refused(tmp_path, tiny_gguf):
    """OUT.config.json records ``max_batch_size``: a resume at another ``--max-batch-size``
    is refused naming it (suffix's and auto's spec stats depend on the batch, so the file
    would not be an uninterrupted run's); at the same one it resumes, and so does a work file
    whose config predates the field, at any batch (an ngram run, whose work file a finished
    record stands in for: its stats do not depend on the schedule)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc"}\n{"id": 2, "prompt": "x y z x y"}\n')
    out = tmp_path / "out.jsonl"
    common = ["run", str(src), "-o", str(out), "--model", str(tiny_gguf), "--cache-dir",
              str(tmp_path / "c"), "--method", "ngram", "--max-tokens", "4", "--no-progress"]
    r = CliRunner().invoke(main, [*common, "--max-batch-size", "2"])
    assert r.exit_code == 0, r.output
    assert json.loads(Path(f"{out}.config.json").read_text())["max_batch_size"] == 2
    first = json.loads(out.read_text().splitlines()[0])
    whole = out.read_text()
    out.unlink()
    Path(f"{out}.work.jsonl").write_text(json.dumps({"index": 0, "record": first}) + "\n")
    r = CliRunner().invoke(main, [*common, "--max-batch-size", "1"])
    assert r.exit_code == 2 and "differs in: max_batch_size" in r.output, r.output
    r = CliRunner().invoke(main, [*common, "--max-batch-size", "2"])
    assert r.exit_code == 0 and "resuming: 1 of 2 records already done" in r.output, r.output
    assert out.read_text() == whole
    # a work file from before max_batch_size was recorded resumes at any batch
    config = json.loads(Path(f"{out}.config.json").read_text())
    del config["max_batch_size"]
    Path(f"{out}.config.json").write_text(json.dumps(config))
    out.unlink()
    Path(f"{out}.work.jsonl").write_text(json.dumps({"index": 0, "record": first}) + "\n")
    r = CliRunner().invoke(main, [*common, "--max-batch-size", "1"])
    assert r.exit_code == 0 and "resuming: 1 of 2 records already done" in r.output, r.output
    assert out.read_text() == whole


def test_a_negative_stop_token_id_is_named_as_typed():
    """``--stop-token-id -1`` names the flag and the value as typed, not a Python tuple
    (``--stop-token-id=(-1,)``)."""
    r = CliRunner().invoke(main, ["run", "x.jsonl", "--stop-token-id", "-1"])
    assert r.exit_code == 2, r.output
    assert "error: --stop-token-id -1: expected token ids (integers >= 0)" in r.output, r.output


def test_an_infinite_temperature_is_refused_as_not_finite():
    """``--temperature inf`` is a number >= 0 that is refused: the message says finite."""
    r = CliRunner().invoke(main, ["run", "x.jsonl", "--temperature", "inf"])
    assert r.exit_code == 2, r.output
    assert "error: --temperature=inf: expected a finite number >= 0" in r.output, r.output


@pytest.mark.parametrize("command", ["run", "bench"])
def test_stop_token_id_outside_the_vocabulary_is_one_flag_error(tmp_path, tiny_gguf, command):
    """``--stop-token-id 999999``: one ``error:`` line naming the flag and the vocabulary, exit
    2, once the model is loaded and before any record runs; not one line per record."""
    from specbatch.models.loader import load_model

    vocab = load_model(str(tiny_gguf), cache_dir=str(tmp_path / "c")).model.config.vocab_size
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc"}\n{"id": 2, "prompt": "x y"}\n')
    out = tmp_path / "o.jsonl"
    args = ["run", str(inp), "-o", str(out)] if command == "run" else ["bench", str(inp)]
    r = CliRunner().invoke(main, [*args, "--model", str(tiny_gguf), "--cache-dir",
                                  str(tmp_path / "c"), "--max-tokens", "2",
                                  "--stop-token-id", "3", "--stop-token-id", "999999"])
    assert r.exit_code == 2, r.output
    errors = [line for line in r.stderr.splitlines() if "error" in line]
    assert errors == [f"error: --stop-token-id 999999: not a token id of this model (its "
                      f"vocabulary has ids 0..{vocab - 1})"], r.stderr
    assert not out.exists() and "wrote" not in r.stdout


def test_context_errors_name_the_limit_the_user_set(tmp_path, tiny_gguf):
    """A prompt past ``--max-model-len 40`` says "the context limit is 40 (--max-model-len)"
    (before the run, and for a later turn during it); past the model's own context, "the
    model's context is N"; ``LLM(max_model_len=40)`` names its keyword."""
    from specbatch import LLM
    from specbatch.models.loader import load_model

    context = load_model(str(tiny_gguf), cache_dir=str(tmp_path / "c")).max_model_len
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "t", "turns": ["abc", "x" * 40]}) + "\n"
                   + json.dumps({"id": "long", "prompt": "x " * 60}) + "\n"
                   + json.dumps({"id": "huge", "prompt": "x " * (context + 10)}) + "\n")
    out = tmp_path / "out.jsonl"
    common = ["run", str(src), "-o", str(out), "--model", str(tiny_gguf), "--cache-dir",
              str(tmp_path / "c"), "--method", "none", "--max-tokens", "8", "--ignore-eos",
              "--no-progress", "--on-error", "skip"]
    r = CliRunner().invoke(main, [*common, "--max-model-len", "40"])
    assert r.exit_code == 0, r.output
    assert "id='long': prompt is" in r.stderr
    said = [line for line in r.stderr.splitlines() if "id='long'" in line or "id='huge'" in line]
    assert len(said) == 2 and all(
        line.endswith("the context limit is 40 (--max-model-len)") for line in said), said
    row, = map(json.loads, out.read_text().splitlines())
    assert row["error"].endswith("the context limit is 40 (--max-model-len)"), row["error"]
    r = CliRunner().invoke(main, [*common[:-2], "-o", str(tmp_path / "o2.jsonl"), "--force"])
    assert r.exit_code == 2, r.output
    assert "id='huge': prompt is" in r.stderr
    assert f"the model's context is {context}" in r.stderr and "limit" not in r.stderr
    llm = LLM(model=str(tiny_gguf), method="none", cache_dir=str(tmp_path / "c"),
              max_model_len=40)
    with pytest.raises(ValueError, match=r"the context limit is 40 \(max_model_len\)"):
        llm.generate("x " * 60)


def test_max_model_len_above_the_context_says_so_and_a_full_prompt_says_why(tmp_path,
                                                                           tiny_gguf):
    """``--max-model-len`` above the model's context runs at the context, saying so in one
    line (it was silent, vLLM refuses); a prompt that fills the context exactly says it leaves
    no room for output (it read "prompt is 40 tokens; the context limit is 40")."""
    from specbatch.models.loader import load_model

    context = load_model(str(tiny_gguf), cache_dir=str(tmp_path / "c")).max_model_len
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": "abc abc"}) + "\n")
    out = tmp_path / "out.jsonl"
    common = ["run", str(src), "--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "c"),
              "--method", "none", "--max-tokens", "4", "--no-progress"]
    r = CliRunner().invoke(main, [*common, "-o", str(out), "--max-model-len",
                                  str(context + 1000)])
    assert r.exit_code == 0, r.output
    said = [line for line in r.stderr.splitlines() if "above the model's context" in line]
    assert said == [f"warning: --max-model-len {context + 1000} is above the model's context "
                    f"({context} tokens): using {context}"], r.stderr
    assert json.loads(Path(f"{out}.config.json").read_text())["max_model_len"] == context
    from specbatch.config import prompt_too_long_text

    assert prompt_too_long_text(40, 40, "--max-model-len") == (
        "prompt is 40 tokens, leaving no room for output; the context limit is 40 "
        "(--max-model-len)")
    assert prompt_too_long_text(41, 40) == "prompt is 41 tokens; the model's context is 40"


def test_an_interrupted_stdin_run_says_the_same_input_must_be_piped_again(tmp_path, capsys):
    """Ctrl-C during a ``run -`` job: the resume hint asks for the same standard input (a pipe
    cannot be read again; the saved sha256 refuses other input); during a ``--force`` job, to
    drop ``--force`` (the same command would start over)."""
    import signal
    from types import SimpleNamespace

    from specbatch.commands import run

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    writer = SimpleNamespace(absorb_shards=lambda: None, close=lambda: None,
                             done_indices=lambda: {0}, work_path=tmp_path / "o.jsonl.work.jsonl")
    for from_stdin, force, hint in (
            (True, False, "Rerun the same command with the same standard input to resume."),
            (False, False, "Rerun the same command to resume."),
            (False, True, "Rerun the same command without --force to resume.")):
        job = run._Job(num_records=2, writer=writer, from_stdin=from_stdin, force=force)
        try:
            assert run._interrupted(job) == run.EXIT_INTERRUPTED
        finally:  # it ignores SIGINT / SIGTERM from then on (a second Ctrl-C): not in pytest
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == hint, err


@pytest.mark.parametrize("written", ["float16", "half"])
def test_float16_runs_from_the_cli_as_from_the_api(tmp_path, tiny_gguf, written):
    """``--dtype float16`` (and vLLM's ``half``) was no CLI choice while ``LLM(dtype=...)``
    took both: the one list (``config.DTYPE_CHOICES``) is now the CLI's choices and the API's
    check. A float16 run with ngram at batch 2 writes plain decoding's batch-1 tokens (the API,
    float16) and records dtype float16; a dtype neither knows is refused by both, listing the
    same choices."""
    from specbatch import LLM
    from specbatch.config import DTYPE_CHOICES, EngineConfig

    src = tmp_path / "in.jsonl"
    prompts = ["abc abc abc abc", "x y z x y z", "hello"]
    src.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                           for i, p in enumerate(prompts)))
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(tiny_gguf),
                                  "--cache-dir", str(tmp_path / "c"), "--dtype", written,
                                  "--method", "ngram", "--k", "3", "--max-batch-size", "2",
                                  "--max-tokens", "8", "--no-progress"])
    assert r.exit_code == 0, r.output
    assert json.loads(Path(f"{out}.config.json").read_text())["dtype"] == "float16"
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    llm = LLM(model=str(tiny_gguf), method="none", dtype=written, max_batch_size=1,
              cache_dir=str(tmp_path / "c"))
    assert llm.engine_config.dtype == "float16"
    assert str(llm.loaded.model.dtype) == "torch.float16"
    api = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert [row["output_token_ids"] for row in rows] == [o.token_ids for o in api]
    assert all(len(o.token_ids) >= 1 for o in api)
    r = CliRunner().invoke(main, ["run", str(src), "-o", str(tmp_path / "x.jsonl"),
                                  "--dtype", "fp16"])
    assert r.exit_code == 2
    with pytest.raises(ConfigError) as e:
        EngineConfig(dtype="fp16")
    assert str(e.value) == f"dtype='fp16': expected one of {', '.join(DTYPE_CHOICES)}"
    assert all(f"'{c}'" in r.output for c in DTYPE_CHOICES), r.output


def test_token_id_prompts_give_the_outputs_of_their_text(tmp_path, tiny_gguf):
    """vLLM's ``{"prompt_token_ids": [...]}`` (``TokensPrompt``): ``generate`` runs the ids as
    given, with the outputs (ids, text, greedy and sampled) of the text they encode;
    ``get_tokenizer()`` is the tokenizer that encoded it (vLLM's)."""
    from transformers import PreTrainedTokenizerBase

    from specbatch import LLM

    llm = LLM(model=str(tiny_gguf), method="ngram", k=3, max_batch_size=2,
              cache_dir=str(tmp_path / "c"))
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer and isinstance(tokenizer, PreTrainedTokenizerBase)
    texts = ["abc abc abc abc", "x y z x y z", "hello there"]
    for sp in (SamplingParams(max_tokens=8), SamplingParams(temperature=0.9, max_tokens=8)):
        by_text = llm.generate(texts, sp, use_tqdm=False)
        assert [o.prompt_token_ids for o in by_text] == [tokenizer.encode(t) for t in texts]
        by_ids = llm.generate([{"prompt_token_ids": o.prompt_token_ids} for o in by_text], sp,
                              use_tqdm=False)
        assert [o.prompt_token_ids for o in by_ids] == [o.prompt_token_ids for o in by_text]
        assert [o.token_ids for o in by_ids] == [o.token_ids for o in by_text]
        assert [o.text for o in by_ids] == [o.text for o in by_text]
        assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in by_ids)


def test_token_id_prompts_in_a_jsonl_file_and_their_errors(tmp_path, tiny_gguf):
    """``prompt_token_ids`` is a prompt field of ``specbatch run``'s records too: the same
    output as the text; an id past the vocabulary (once the model is loaded), an empty list, a
    negative id are one line naming the record, from the CLI as from the API."""
    from specbatch import LLM

    llm = LLM(model=str(tiny_gguf), method="none", cache_dir=str(tmp_path / "c"))
    vocab = llm.loaded.model.config.vocab_size
    ids = llm.get_tokenizer().encode("abc abc abc")
    src = tmp_path / "in.jsonl"
    good = [{"id": "text", "prompt": "abc abc abc"}, {"id": "ids", "prompt_token_ids": ids}]
    bad = [{"id": "oov", "prompt_token_ids": [1, vocab, vocab + 5]},
           {"id": "empty", "prompt_token_ids": []},
           {"id": "neg", "prompt_token_ids": [3, -1]},
           {"id": "both", "prompt": "a", "prompt_token_ids": [3]}]
    src.write_text("".join(json.dumps(r) + "\n" for r in good + bad))
    out = tmp_path / "out.jsonl"
    common = ["run", str(src), "--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "c"),
              "--method", "ngram", "--max-tokens", "6", "--no-progress"]
    r = CliRunner().invoke(main, [*common, "-o", str(out)])
    assert r.exit_code == 2
    said = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert said == [
        f"error: {src}:4: id='empty': prompt_token_ids is an empty list",
        f"error: {src}:5: id='neg': prompt_token_ids[1]=-1: expected a token id (an integer "
        ">= 0)",
        f"error: {src}:6: id='both': both prompt and prompt_token_ids are given; keep one"
    ], r.stderr  # the input's errors, before the model loads
    r = CliRunner().invoke(main, [*common, "-o", str(out), "--on-error", "skip"])
    assert r.exit_code == 0, r.output
    assert (f"warning: {src}:3: id='oov': prompt_token_ids [{vocab}, {vocab + 5}] are not "
            f"token ids of this model (its vocabulary has ids 0..{vocab - 1})"
            in r.stderr.splitlines()), r.stderr
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert rows["ids"]["output_token_ids"] == rows["text"]["output_token_ids"]
    assert rows["ids"]["output"] == rows["text"]["output"]
    assert rows["ids"]["usage"] == rows["text"]["usage"]
    assert rows["ids"]["prompt_token_ids"] == ids  # echoed as given
    api = llm.generate("abc abc abc", SamplingParams(max_tokens=6), use_tqdm=False)[0]
    assert api.token_ids == rows["ids"]["output_token_ids"]
    with pytest.raises(ValueError) as e:
        llm.generate([{"prompt_token_ids": ids}, *bad])
    assert str(e.value) == (
        "prompt 3: id='empty': prompt_token_ids is an empty list; "
        "prompt 4: id='neg': prompt_token_ids[1]=-1: expected a token id (an integer >= 0); "
        "prompt 5: id='both': both prompt and prompt_token_ids are given; keep one; "
        f"prompt 2: id='oov': prompt_token_ids [{vocab}, {vocab + 5}] are not token ids of "
        f"this model (its vocabulary has ids 0..{vocab - 1})")


def test_api_errors_name_the_prompt_by_its_place(tmp_path, tiny_gguf):
    """Every bad prompt of ``generate`` is named alike, ``prompt N:`` (N from 1), with
    ``id=ID`` where the prompt has its own id: they read ``<records>:2: id=2:``,
    ``<prompts>:5: id=5:`` (too long for the context) and ``prompt 3:`` (no dict, raised
    alone)."""
    from specbatch import LLM

    llm = LLM(model=str(tiny_gguf), method="none", cache_dir=str(tmp_path / "c"),
              max_model_len=40)
    n = len(llm.get_tokenizer().encode("x " * 60))
    with pytest.raises(ValueError) as e:
        llm.generate(["fine", "  ", 5, {"id": "a", "prompt": ""}, "x " * 60,
                      {"prompt": "ok", "temperature": -1}])
    assert str(e.value) == (
        "prompt 2: prompt is empty; "
        "prompt 3: expected a string or a dict, got a number; "
        "prompt 4: id='a': prompt is empty; "
        "prompt 6: invalid sampling field: temperature=-1: expected a finite number >= 0; "
        f"prompt 5: prompt is {n} tokens; the context limit is 40 (max_model_len)"), str(e.value)


def test_a_json_array_or_a_too_long_prompt_on_stdin_is_one_line(tmp_path, tiny_gguf):
    """``specbatch run - -o OUT`` given a JSON array (one line or several) or one prompt too
    long for the context prints one line, naming the line, exit 2 (a second line said "no
    valid records", or suggested --on-error skip "to run the others": there were none);
    several bad records end with the one summary line."""
    from specbatch.models.loader import load_tokenizer

    common = ["--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "c"), "--method", "none",
              "--max-model-len", "40", "--no-progress"]
    n = len(load_tokenizer(str(tiny_gguf), str(tmp_path / "c"))[0].encode("x " * 60))
    hint = ("standard input is read as JSONL: pass the array as a .json file, or pipe it "
            "through jq -c '.[]'")
    cases = [
        ('[{"prompt": "a"}, {"prompt": "b"}]\n',
         [f"error: <stdin>:1: expected one JSON object per line, got an array ({hint})"]),
        ('[\n {"prompt": "a"},\n {"prompt": "b"}\n]\n',
         ["error: <stdin>: expected one JSON object per line, got a JSON array over several "
          f"lines (from line 1); {hint}"]),
        (json.dumps({"prompt": "x " * 60}) + "\n",
         [f"error: <stdin>:1: prompt is {n} tokens; the context limit is 40 "
          "(--max-model-len)"]),
        ('hello\n{"prompt": ""}\n',
         ["error: <stdin>:1: invalid JSON at column 1: unexpected character, expected a JSON "
          "value", "error: <stdin>:2: prompt is empty",
          "error: no valid records; nothing to run."]),
    ]
    for i, (text, lines) in enumerate(cases):
        for on_error in ("fail", "skip"):
            out = tmp_path / f"o{i}{on_error}.jsonl"
            r = CliRunner().invoke(main, ["run", "-", "-o", str(out), *common, "--on-error",
                                          on_error], input=text)
            assert r.exit_code == 2, r.output
            said = [line for line in r.stderr.splitlines() if not line.startswith(
                ("cpu:", "loading model", "model ready", "warning: the machine is busy"))]
            assert said == lines, r.stderr
            assert not out.exists()


def test_token_ids_from_numpy_and_torch_dtypes_as_vllm_takes_them():
    """vLLM habits the fresh-user pass hit: numpy ids (an array, np.int64 items) are token ids;
    ``TokensPrompt`` imports from ``specbatch``; ``dtype=torch.float16`` is ``float16``; a
    record with ``prompt_token_ids`` under a template is refused in one line (the template
    builds the prompt: the ids were silently dropped)."""
    import numpy as np
    import torch

    from specbatch import TokensPrompt
    from specbatch.config import EngineConfig
    from specbatch.io.records import records_from_rows

    rows = [TokensPrompt(prompt_token_ids=np.array([5, 6, 7])),
            {"prompt_token_ids": [np.int64(5), np.int64(6), np.int64(7)]},
            {"prompt_token_ids": torch.tensor([5, 6, 7])}, {"prompt_token_ids": [5, 6, 7]}]
    records, errors = records_from_rows(rows)
    assert errors == [] and [r.prompt_token_ids for r in records] == [(5, 6, 7)] * 4
    assert all(type(t) is int for r in records for t in r.prompt_token_ids)
    _, errors = records_from_rows([{"prompt_token_ids": [np.int64(-1)]}])
    assert [str(e) for e in errors] == [
        "prompt 1: prompt_token_ids[0]=-1: expected a token id (an integer >= 0)"]
    assert EngineConfig(dtype=torch.float16, device="cpu").dtype == "float16"
    assert EngineConfig(dtype=torch.float, device="cpu").dtype == "float32"
    _, errors = records_from_rows([{"prompt_token_ids": [1, 2], "x": "hi"}], template="say {x}")
    assert [str(e) for e in errors] == [
        "prompt 1: prompt_token_ids is given with a template, which builds the prompt from the "
        "record's fields; keep one"]


@pytest.mark.parametrize("setup, shown", [("", True), ("import logging; logging.basicConfig()",
                                                       False)])
def test_the_api_shows_its_progress_lines_as_vllm_does(setup, shown):
    """A script that sets up no logging sees the ``specbatch`` logger's INFO lines on stderr
    (vLLM's habit for its logger): the first ``method="auto"`` call calibrated for 57 s in
    silence (fresh-user report). A script that configures logging keeps its own choice (here:
    WARNING, the root default)."""
    import os
    import subprocess
    import sys

    script = f"""
{setup}
from specbatch import LLM
from specbatch.llm import ModelLoadError
try:
    LLM("no-such-model")
except ModelLoadError:
    pass
import logging
logging.basicConfig()  # later: not a second copy of each line
logging.getLogger("specbatch").info("a line logged once")
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ("INFO specbatch: cpu: " in out.stderr) == shown, out.stderr
    # (the cpu line says "... once it is gone" on a busy machine: count the line itself)
    assert out.stderr.count("a line logged once") == (1 if shown else 0), out.stderr
