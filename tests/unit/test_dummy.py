"""Dummy-weights models (``--model dummy:SHAPE[:SEED]``): names, deterministic weights, a run.

The runs here take SmolLM2's tokenizer's place with a tiny word-level tokenizer folder
(``$SPECBATCH_TOKENIZER``): the weights are the real SmolLM2-135M shape, ids stay below 256.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from specbatch.models import dummy  # noqa: E402
from specbatch.models.loader import load_model, load_tokenizer, resolve_model  # noqa: E402
from specbatch.models.registry import find_model  # noqa: E402
from tests.cli_helpers import cli  # noqa: E402

torch.set_num_threads(1)  # as tests/helpers.py: intra-op threads only add contention here


def write_word_tokenizer(folder) -> None:
    """A word-level tokenizer (ids 0-255: <unk> <|im_start|> <|im_end|> w3..w255) with a chat
    template: what the runs need of SmolLM2's tokenizer, in a few kB."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"w{i}": i for i in range(3, 256)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|> {{ m['content'] }} "
                               "<|im_end|> {% endfor %}{% if add_generation_prompt %}"
                               "<|im_start|> {% endif %}")
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("word_tokenizer")
    write_word_tokenizer(folder)
    return folder


@pytest.fixture
def tokenizer_env(word_tokenizer, monkeypatch):
    monkeypatch.setenv(dummy.TOKENIZER_ENV, str(word_tokenizer))
    return word_tokenizer


@pytest.fixture(scope="module")
def smol_seed0():
    return dummy.build_model("smollm2-135m", 0, torch.float32, "cpu")


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("name, parsed", [
    ("dummy:smollm2-135m", ("smollm2-135m", 0)), ("dummy:llama-1.5b:7", ("llama-1.5b", 7)),
    ("smollm2-135m", None), ("/x/dummy:y", None)])
def test_parse_name(name, parsed) -> None:
    assert dummy.parse_name(name) == parsed


@pytest.mark.parametrize("name, message", [
    ("dummy:gpt-9", "unknown dummy model 'dummy:gpt-9': the shapes are dummy:smollm2-135m, "
                    "dummy:llama-1.5b"),
    ("dummy:llama-1.5b:-1", "the seed after the shape must be an integer >= 0"),
    ("dummy:llama-1.5b:x", "the seed after the shape must be an integer >= 0"),
    ("dummy:llama-1.5b:1:2", "the seed after the shape must be an integer >= 0")])
def test_bad_dummy_names_are_one_line(name, message, tokenizer_env) -> None:
    with pytest.raises(ValueError) as info:
        find_model(name)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_dummy_name_resolves_with_the_seed_written(tokenizer_env) -> None:
    assert find_model("dummy:smollm2-135m") == ("dummy", None)
    source = resolve_model("dummy:smollm2-135m")
    assert (source.kind, source.name, source.gguf_file) == ("dummy", "dummy:smollm2-135m:0",
                                                            None)
    assert source.path == tokenizer_env.resolve()


def test_a_tokenizer_env_without_tokenizer_json_is_an_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(dummy.TOKENIZER_ENV, str(tmp_path))
    with pytest.raises(ValueError, match=r"\$SPECBATCH_TOKENIZER=.* is not a tokenizer folder"):
        find_model("dummy:smollm2-135m")


# ---------------------------------------------------------------- weights


def test_same_seed_same_weights_other_seed_differs(smol_seed0) -> None:
    again = dummy.build_model("smollm2-135m", 0, torch.float32, "cpu")
    other = dummy.build_model("smollm2-135m", 1, torch.float32, "cpu")
    first = dict(smol_seed0.named_parameters())
    assert sum(p.numel() for p in first.values()) == 134_515_008  # SmolLM2-135M's count
    assert smol_seed0.lm_head.weight is smol_seed0.model.embed_tokens.weight  # tied
    for name, param in again.named_parameters():
        assert torch.equal(param, first[name]), name
    for name, param in other.named_parameters():
        if param.dim() >= 2:
            assert (param != first[name]).float().mean() > 0.99, name
        else:
            assert torch.equal(param, first[name]), name  # norms: ones


def test_weights_do_not_depend_on_threads_and_have_the_init_scale(smol_seed0) -> None:
    model = dummy.build_model("smollm2-135m", 0, torch.float32, "cpu")
    dummy.fill_weights(model, 0, threads=1)
    first = dict(smol_seed0.named_parameters())
    bound = torch.tensor(dummy.INIT_STD * 3 ** 0.5, dtype=torch.float32).item()  # as drawn
    for name, param in model.named_parameters():
        assert torch.equal(param, first[name]), name
        if param.dim() >= 2:
            assert abs(param.std().item() - dummy.INIT_STD) < 1e-3, name
            assert param.abs().max().item() <= bound, name
        else:
            assert name.endswith("norm.weight") and bool((param == 1).all()), name


def test_bfloat16_weights_are_the_float32_ones_rounded(smol_seed0) -> None:
    half = dummy.build_model("smollm2-135m", 0, torch.bfloat16, "cpu")
    first = dict(smol_seed0.named_parameters())
    for name, param in half.named_parameters():
        assert param.dtype == torch.bfloat16
        assert torch.equal(param, first[name].to(torch.bfloat16)), name
    inv_freq = half.model.rotary_emb.inv_freq
    assert inv_freq.dtype == torch.float32
    assert torch.equal(inv_freq, smol_seed0.model.rotary_emb.inv_freq)


def test_greedy_logits_are_finite_and_not_flat(smol_seed0) -> None:
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]])
    with torch.no_grad():
        logits = smol_seed0(ids).logits[0]  # [9, 49152]
    assert torch.isfinite(logits).all()
    assert 0.2 < logits.std().item() < 2.0
    assert len(set(logits.argmax(-1).tolist())) > 1


def test_model_id_keys_shape_and_seed(tokenizer_env) -> None:
    _, id0 = load_tokenizer("dummy:smollm2-135m")
    _, id0b = load_tokenizer("dummy:smollm2-135m:0")
    _, id1 = load_tokenizer("dummy:smollm2-135m:1")
    _, big = load_tokenizer("dummy:llama-1.5b")
    assert id0 == id0b and id0.startswith("dummy:smollm2-135m:0@sha256:")
    assert id1.startswith("dummy:smollm2-135m:1@sha256:")
    assert len({id0, id1, big}) == 3 and big.startswith("dummy:llama-1.5b:0@sha256:")


# ---------------------------------------------------------------- runs


def test_load_model_and_a_speculative_run_match_plain_decoding(tokenizer_env) -> None:
    from specbatch import LLM, SamplingParams

    loaded = load_model("dummy:smollm2-135m:2", dtype="float32")
    assert loaded.model_id.startswith("dummy:smollm2-135m:2@sha256:")
    assert loaded.eos_token_ids == (2,) and loaded.max_model_len == 8192
    prompts = ["w5 w6 w7 w5 w6 w7 w5 w6", "w40 w41 w42 w43 w40 w41"]
    params = SamplingParams(max_tokens=12)
    plain = LLM("dummy:smollm2-135m:2", method="none", dtype="float32", max_batch_size=1,
                max_model_len=128).generate(prompts, params)
    spec = LLM("dummy:smollm2-135m:2", method="ngram", k=5, dtype="float32", max_batch_size=2,
               max_model_len=128).generate(prompts, params)
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    assert all(len(o.token_ids) == 12 for o in plain)
    assert spec[0].spec["num_drafts"] > 0


def test_cli_run_with_a_dummy_model(tmp_path, tokenizer_env) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "w9 w10 w9 w10 w9"}\n')
    out = tmp_path / "out.jsonl"
    r = cli("run", src, "-o", out, "--model", "dummy:smollm2-135m:4", "--method", "ngram",
            "--max-tokens", "6", "--device", "cpu", "--dtype", "float32", "--max-model-len",
            "64", "--no-progress")
    assert r.returncode == 0, r.stderr
    record = json.loads(out.read_text())
    assert len(record["output_token_ids"]) == 6
    config = json.loads((tmp_path / "out.jsonl.config.json").read_text())
    assert config["model"].startswith("dummy:smollm2-135m:4@sha256:")
