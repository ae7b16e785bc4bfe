"""``--device auto|cpu|cuda``: the flag, the recipe key and ``EngineConfig.device``."""

from __future__ import annotations

import signal

import pytest
import torch
from click.testing import CliRunner

import specbatch.commands.run
from specbatch.cli import main
from specbatch.config import EngineConfig

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@pytest.fixture
def captured(monkeypatch):
    seen = []
    monkeypatch.setattr(specbatch.commands.run, "run_job", lambda opts: seen.append(opts) or 0)
    sigterm = signal.getsignal(signal.SIGTERM)  # ``run`` installs its own
    yield seen
    signal.signal(signal.SIGTERM, sigterm)


def test_help_lists_device():
    for command in ("run", "bench", "calibrate"):
        out = CliRunner().invoke(main, [command, "--help"]).output
        assert "--device [auto|cpu|cuda]" in out, out


@no_gpu
def test_auto_is_cpu_without_a_gpu_and_is_stored_resolved(captured):
    assert EngineConfig().device == "cpu"
    assert EngineConfig(device="auto").device == "cpu"
    assert CliRunner().invoke(main, ["run", "in.jsonl"]).exit_code == 0
    assert captured.pop().engine.device == "cpu"


@no_gpu
def test_cuda_without_a_gpu_is_one_error_line():
    result = CliRunner().invoke(main, ["run", "in.jsonl", "--device", "cuda"])
    assert result.exit_code == 2
    assert result.output.splitlines() == [
        f"error: --device='cuda': expected a visible GPU (torch {torch.__version__} sees 0)",
        "try 'main run --help'"]
    with pytest.raises(ValueError, match=r"device='cuda:1': expected a visible GPU"):
        EngineConfig(device="cuda:1")
    with pytest.raises(ValueError, match=r"device='gpu': expected auto, cpu, cuda or cuda:N"):
        EngineConfig(device="gpu")


def test_recipe_device_key(tmp_path, captured):
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "r"\nversion = 1\n[model]\ndevice = "cpu"\n')
    assert CliRunner().invoke(main, ["run", "--recipe", str(recipe), "in.jsonl"]).exit_code == 0
    assert captured.pop().engine.device == "cpu"
    recipe.write_text('name = "r"\nversion = 1\n[model]\ndevice = "tpu"\n')
    result = CliRunner().invoke(main, ["run", "--recipe", str(recipe), "in.jsonl"])
    assert result.exit_code == 2 and "tpu" in result.output, result.output


@pytest.mark.parametrize("flags, want", [
    ({"avx2", "fma", "amx_bf16", "avx512_bf16"}, "float32"),   # AMX: oneDNN's bf16 not invariant
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "float32"),    # AVX-512 BF16, no AMX: C kernels
    ({"avx2", "fma"}, "float32"),                               # AVX2 only (Zen 3)
    ({"avx512_bf16"}, "bfloat16"),                              # native bf16 without AVX2 + FMA
    (set(), "float32"),                                         # flags unreadable / other CPU
])
def test_auto_dtype_follows_the_cpu_flags(monkeypatch, flags, want):
    import specbatch.config as config

    monkeypatch.setattr(config, "_cpu_flags", lambda: frozenset(flags))
    assert config.resolve_dtype("auto", "cpu") == want
    assert config.resolve_dtype("auto", "cuda") == "bfloat16"
    assert config.resolve_dtype("float64", "cpu") == "float64"
