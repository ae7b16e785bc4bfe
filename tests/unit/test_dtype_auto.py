"""``--dtype auto`` for the model it is given (issue 35, point 2): int8 for a GGUF whose matmul
weights the int8 kernels take as codes, on x86-64 CPUs where they run; float32 for a float GGUF,
a Hugging Face folder, a named dtype, or without the C kernels. Said in the start-up line and
saved in ``OUT.config.json``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from specbatch import config
from specbatch.cli import main
from specbatch.config import EngineConfig, auto_dtype
from specbatch.models import gguf_header
from tests.unit.test_loader import write_tiny_gguf, write_tiny_hf_folder

needs_kernels = pytest.mark.skipif(not config._cpu_kernels(),
                                   reason="the int8 kernels need x86-64 AVX2 + FMA + F16C and cc")
# where the device alone gives float32 (x86-64 with AVX2 + FMA, most other CPUs)
cpu_float32 = pytest.mark.skipif(config.resolve_dtype("auto", "cpu") != "float32",
                                 reason="this CPU takes bfloat16 before any model")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """Tiny models: GGUFs whose layers are Q8_0, Q4_1, Q4_0, F16 or F32 (embedding and lm_head
    F32), and a Hugging Face folder."""
    folder = tmp_path_factory.mktemp("dtype_auto")
    out = {}
    for kind in ("Q8_0", "Q4_1", "Q4_0", "F16", "F32"):
        out[kind] = folder / f"tiny-{kind}.gguf"
        write_tiny_gguf(out[kind], linear_type=kind)
    out["hf"] = folder / "hf"
    write_tiny_hf_folder(out["hf"])
    return out


def test_the_header_gives_every_tensor_type_as_gguf_reads_them(models):
    """``tensor_table`` (the header only) agrees with ``gguf.GGUFReader`` (the whole file):
    names, types, shapes and data offsets."""
    import gguf

    for kind in ("Q8_0", "Q4_1", "F16"):
        reader = gguf.GGUFReader(str(models[kind]))
        want = [(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), t.data_offset)
                for t in reader.tensors]
        assert gguf_header.tensor_table(models[kind]) == want  # kernels/kquant reads offsets
        assert gguf_header.tensor_types(models[kind]) == [w[:3] for w in want]
    for kind in gguf_header.INT8_CODE_TYPES:
        assert gguf_header.GGML_TYPES[int(gguf.GGMLQuantizationType[kind])] == kind


def test_int8_code_types_are_the_types_whose_weights_pack_q8_takes(models):
    """The table ``auto`` reads (``INT8_CODE_TYPES``) against the kernels' own test
    (``pack_q8``: exact codes): every layer weight of a Q8_0 / Q4_1 file is taken as codes,
    none of a Q4_0, F16 or F32 one."""
    from specbatch.kernels import linear_cpu
    from specbatch.models.loader import load_model

    for kind in ("Q8_0", "Q4_1", "Q4_0", "F16", "F32"):
        model = load_model(str(models[kind]), cache_dir=models["hf"].parent / "cache").model
        layer = model.model.layers[0]
        weights = [layer.self_attn.q_proj.weight, layer.self_attn.o_proj.weight,
                   layer.mlp.up_proj.weight, layer.mlp.down_proj.weight]
        taken = [linear_cpu.pack_q8(w.detach()) is not None for w in weights]
        assert taken == [kind in gguf_header.INT8_CODE_TYPES] * 4, (kind, taken)
        assert gguf_header.int8_code_types(models[kind]) == (
            (kind,) if kind in gguf_header.INT8_CODE_TYPES else ())


def test_k_quant_types_are_taken_with_the_files_codes(tmp_path):
    """Q4_K / Q5_K / Q6_K / Q5_0 / Q5_1 weights (dequantised as transformers loads them) are taken by
    ``pack_q8`` with the file's codes (``kquant.GGUFCodes``), and ``int8_code_types`` names
    them; without the file, their floats alone give no codes (so the file is needed: the
    loader hands it over for int8)."""
    from specbatch.kernels import kquant, linear_cpu
    from tests.unit.test_linear_kquant import _dequantized, random_k_blocks, write_gguf

    rng = np.random.default_rng(35)
    for kind in ("Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1"):
        raw = random_k_blocks(kind, 32, 512, rng)
        path = tmp_path / f"{kind}.gguf"
        write_gguf(path, {"blk.0.ffn_up.weight": (kind, raw)})
        weight = _dequantized(kind, raw)
        assert linear_cpu.pack_q8(weight, kquant.GGUFCodes(path)) is not None, kind
        assert linear_cpu.pack_q8(weight) is None, kind
        assert kind in gguf_header.INT8_CODE_TYPES
        assert gguf_header.int8_code_types(path) == (kind,)


@needs_kernels
def test_a_q4_k_m_gguf_runs_int8_on_its_codes_by_default(tmp_path):
    """Q4_K_M's mix (Q4_K and Q6_K, as the Qwen2.5-Coder pair): ``LLM()`` with no dtype runs
    int8, every dense weight on its K-quant codes."""
    from specbatch import LLM
    from specbatch.kernels import linear_cpu
    from specbatch.models.llama import LlamaForward
    from tests.unit.test_linear_kquant import write_tiny_kquant_gguf

    path = tmp_path / "tiny-q4_k_m.gguf"
    write_tiny_kquant_gguf(path)
    llm = LLM(model=str(path), method="none", cache_dir=str(tmp_path / "cache"))
    assert (llm.engine_config.dtype, llm.engine_config.dtype_auto) == (
        "int8", "GGUF Q4_K + Q6_K codes on the int8 kernels")
    fwd = LlamaForward(llm.loaded.model)
    weights = ([w for w, _ in fwd.qkv] + fwd.gate_up + [fwd.lm_head]
               + [layer.mlp.down_proj.weight for layer in fwd.layers])
    assert {linear_cpu._PACKED[w][1][0] for w in weights} == {
        linear_cpu.SEGMENTS, linear_cpu.Q4_K_X8, linear_cpu.Q6_K_X8}


def test_int8_code_types_counts_the_matmul_weights_only(tmp_path):
    """Norms (1-D) do not count; the token embedding counts only where it is the lm_head (no
    ``output.weight``); the taken types must hold at least half the matmul weights."""
    rows = [("token_embd.weight", "F32", (64, 1000)), ("output_norm.weight", "F32", (64,)),
            ("blk.0.attn_q.weight", "Q4_1", (64, 64)), ("blk.0.ffn_up.weight", "Q8_0", (64, 128))]
    weights = gguf_header.matmul_weights(rows)
    assert [w[0] for w in weights] == ["token_embd.weight", "blk.0.attn_q.weight",
                                       "blk.0.ffn_up.weight"]  # tied: the embedding is lm_head
    untied = gguf_header.matmul_weights(rows + [("output.weight", "Q8_0", (64, 1000))])
    assert [w[0] for w in untied] == ["blk.0.attn_q.weight", "blk.0.ffn_up.weight",
                                      "output.weight"]
    assert [w[2] for w in untied] == [4096, 8192, 64000]


@cpu_float32
def test_a_file_that_is_no_gguf_header_has_no_codes(tmp_path):
    for data in (b"", b"GGUF", b"GGUF\x03\x00\x00\x00" + b"\xff" * 16, b"not a model"):
        path = tmp_path / "x.gguf"
        path.write_bytes(data)
        assert gguf_header.int8_code_types(path) == ()
        assert auto_dtype("cpu", str(path)) == ("float32", "GGUF of unread types, no codes the "
                                                "int8 kernels take")


@needs_kernels
@pytest.mark.parametrize("kind, want", [
    ("Q8_0", ("int8", "GGUF Q8_0 codes on the int8 kernels")),
    ("Q4_1", ("int8", "GGUF Q4_1 codes on the int8 kernels")),
    ("Q4_0", ("float32", "GGUF Q4_0 + F32, no codes the int8 kernels take")),
    ("F16", ("float32", "GGUF F16 + F32, no codes the int8 kernels take")),
    ("F32", ("float32", "GGUF F32, no codes the int8 kernels take")),
    ("hf", ("float32", "a Hugging Face folder")),
])
def test_auto_picks_int8_for_a_gguf_of_codes_and_float32_otherwise(models, kind, want):
    assert auto_dtype("cpu", str(models[kind])) == want
    engine = EngineConfig(dtype="auto").for_model(str(models[kind]))
    assert (engine.dtype, engine.dtype_auto) == want
    assert engine.dtype_text == f"{want[0]} (auto: {want[1]})"
    # a named dtype is kept, and says nothing about auto
    named = EngineConfig(dtype="float32").for_model(str(models[kind]))
    assert (named.dtype, named.dtype_auto, named.dtype_text) == ("float32", None, "float32")


@needs_kernels
def test_the_default_model_runs_int8(monkeypatch):
    """The bundled SmolLM2-135M is Q4_1 with a Q8_0 embedding (its lm_head)."""
    from specbatch.models.registry import DEFAULT_MODEL, REGISTRY

    try:
        REGISTRY[DEFAULT_MODEL].check_installed()
    except ValueError:
        pytest.skip("the default model is not installed")
    engine = EngineConfig().for_model(None)
    assert (engine.dtype, engine.dtype_auto) == ("int8",
                                                 "GGUF Q4_1 + Q8_0 codes on the int8 kernels")


@cpu_float32
@pytest.mark.parametrize("switch", ["SPECBATCH_CPU_KERNELS=0", "SPECBATCH_CPU_LINEAR=onednn",
                                    "SPECBATCH_CPU_WEIGHTS=float32"])
def test_without_the_int8_kernels_auto_keeps_float32(models, monkeypatch, switch):
    name, value = switch.split("=")
    monkeypatch.setenv(name, value)
    dtype, why = auto_dtype("cpu", str(models["Q4_1"]))
    assert dtype == "float32"
    assert why.startswith("GGUF Q4_1, but "), why
    if name == "SPECBATCH_CPU_WEIGHTS":
        assert why == "GGUF Q4_1, but SPECBATCH_CPU_WEIGHTS=float32"


def test_auto_follows_the_device_before_the_model_and_on_a_gpu(models, monkeypatch):
    monkeypatch.setattr(config, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    engine = EngineConfig()
    assert (engine.dtype, engine.dtype_auto) == ("float32", "an x86-64 CPU with AVX2 + FMA")
    assert auto_dtype("cuda", str(models["Q4_1"])) == ("bfloat16", "a GPU")
    monkeypatch.setattr(config, "_cpu_flags", lambda: frozenset({"avx512_bf16"}))
    assert auto_dtype("cpu", str(models["Q4_1"]))[0] == "bfloat16"  # no C kernels: as before
    monkeypatch.setattr(config, "_cpu_flags", lambda: frozenset())
    assert auto_dtype("cpu", str(models["Q4_1"]))[0] == "float32"


@needs_kernels
def test_run_says_and_saves_the_choice(models, tmp_path):
    """``specbatch run`` with no --dtype on a Q8_0 GGUF: int8, said in the start-up line and
    saved in OUT.config.json; --dtype float32 keeps float32 and saves no ``dtype_auto``; an
    F32 GGUF stays float32 under auto."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc abc"}\n')
    cache = tmp_path / "cache"
    seen = {}
    for label, model, extra in (("auto", "Q8_0", []), ("named", "Q8_0", ["--dtype", "float32"]),
                                ("f32", "F32", [])):
        out = tmp_path / f"{label}.jsonl"
        result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                           str(models[model]), "--cache-dir", str(cache),
                                           "--method", "ngram", "--max-tokens", "4",
                                           "--no-progress", *extra])
        assert result.exit_code == 0, result.output
        cfg = json.loads(out.with_name(out.name + ".config.json").read_text())
        loading = next(line for line in result.stderr.splitlines()
                       if line.startswith("loading model "))
        seen[label] = cfg, loading
    cfg, loading = seen["auto"]
    assert (cfg["dtype"], cfg["dtype_auto"]) == ("int8", "GGUF Q8_0 codes on the int8 kernels")
    assert loading == (f"loading model {models['Q8_0']} (int8, cpu; auto: GGUF Q8_0 codes on "
                       "the int8 kernels) ...")
    cfg, loading = seen["named"]
    assert cfg["dtype"] == "float32" and "dtype_auto" not in cfg
    assert loading == f"loading model {models['Q8_0']} (float32, cpu) ..."
    cfg, loading = seen["f32"]
    assert (cfg["dtype"], cfg["dtype_auto"]) == ("float32", "GGUF F32, no codes the int8 "
                                                 "kernels take")


@needs_kernels
def test_the_python_api_follows_the_same_rule(models, caplog):
    """``LLM(dtype="auto")`` resolves for its model (and runs it: the forward is marked int8);
    ``LLM.from_config`` takes the config as resolved (what a Ray replica gets from its driver)
    and never resolves again."""
    from specbatch import LLM
    from specbatch.config import SpecConfig
    from specbatch.models.llama import LlamaForward

    cache = str(models["hf"].parent / "cache")
    with caplog.at_level(logging.INFO, logger="specbatch"):
        llm = LLM(model=str(models["Q4_1"]), method="none", cache_dir=cache)
    assert (llm.engine_config.dtype, llm.engine_config.dtype_auto) == (
        "int8", "GGUF Q4_1 codes on the int8 kernels")
    assert LlamaForward(llm.loaded.model).activations == "int8"
    hf = LLM(model=str(models["hf"]), method="none", cache_dir=cache)
    assert (hf.engine_config.dtype, hf.engine_config.dtype_auto) == ("float32",
                                                                     "a Hugging Face folder")
    driver = EngineConfig().for_model(str(models["F32"]))  # resolved: float32, said why
    replica = LLM.from_config(str(models["Q4_1"]), SpecConfig(method="none"), driver,
                              cache_dir=cache)
    assert replica.engine_config == driver


@needs_kernels
def test_reference_says_which_dtypes_it_compares(models, tmp_path):
    """An int8 run is compared with transformers in float32 on the same weights, and the
    reference says so (with why auto chose int8); a float32 run with float32."""
    from specbatch.reference import compare_outputs, compared_dtypes

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc abc"}\n')
    cache = tmp_path / "cache"
    for extra in ([], ["--dtype", "float32"]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                           str(models["Q4_1"]), "--cache-dir", str(cache),
                                           "--method", "none", "--max-tokens", "6",
                                           "--no-progress", *extra])
        assert result.exit_code == 0, result.output
        line = compared_dtypes(out)
        rows = compare_outputs(out, cache_dir=str(cache))
        assert len(rows) == 1 and rows[0].replay_ok in (None, True), rows
        if extra:
            assert line == "comparing specbatch float32 with transformers float32 on the " \
                "same weights"
        else:
            assert line.startswith("comparing specbatch int8 (dtype auto: GGUF Q4_1 codes on "
                                   "the int8 kernels) with transformers float32 on the same "
                                   "weights: int8 is llama.cpp's scheme"), line


@needs_kernels
def test_int8_from_auto_gives_the_outputs_of_int8_by_name(models, tmp_path):
    """auto's int8 is ``--dtype int8``, not something in between: the same tokens."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc abc"}\n{"id": 2, "prompt": "hello"}\n')
    ids = []
    for extra in ([], ["--dtype", "int8"]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                           str(models["Q4_1"]), "--cache-dir",
                                           str(tmp_path / "c"), "--method", "ngram",
                                           "--max-tokens", "8", "--no-progress", *extra])
        assert result.exit_code == 0, result.output
        ids.append([json.loads(x)["output_token_ids"] for x in out.read_text().splitlines()])
    assert ids[0] == ids[1]


@cpu_float32
def test_a_dummy_model_keeps_float32_and_says_why():
    """``dummy:SHAPE`` models have random float32 weights: no codes, float32, named as such."""
    from specbatch.models.registry import find_model

    try:
        find_model("dummy:smollm2-135m")
    except ValueError as e:
        pytest.skip(f"no dummy model here: {e}")
    assert auto_dtype("cpu", "dummy:smollm2-135m") == ("float32",
                                                       "random float32 weights (dummy model)")


def test_the_header_is_read_once_per_version_of_a_file(tmp_path, monkeypatch):
    """Every engine reads the tensor table (the int8 codes): a file's table is parsed once,
    and again when the file is rewritten; a copy comes back, so a caller cannot edit the
    cache."""
    parsed = []
    real_parse = gguf_header._parse
    monkeypatch.setattr(gguf_header, "_parse",
                        lambda buf, where: parsed.append(where) or real_parse(buf, where))
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, linear_type="Q8_0")
    first = gguf_header.tensor_table(path)
    first.clear()
    again = gguf_header.tensor_table(str(path))
    assert len(parsed) == 1 and again and {t[1] for t in again} >= {"Q8_0"}
    write_tiny_gguf(path, linear_type="F16")  # rewritten in place
    assert {t[1] for t in gguf_header.tensor_table(path)} >= {"F16"}
    assert len(parsed) == 2
