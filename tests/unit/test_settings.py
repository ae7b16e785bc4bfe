"""Every ``SPECBATCH_*`` variable is read in ``specbatch/settings.py`` alone, when asked for."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specbatch import settings

REPO = Path(__file__).resolve().parents[2]
NAME = re.compile(r"SPECBATCH_[A-Z0-9_]+")


def _variable_names_in_code(path: Path) -> list[str]:
    """String constants of ``path`` that are exactly a SPECBATCH_ variable's name (so not a
    docstring or a message that mentions one)."""
    return [node.value for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and NAME.fullmatch(node.value)]


def test_the_environment_is_read_in_settings_only():
    sources = sorted((REPO / "specbatch").rglob("*.py")) + sorted((REPO / "kernels").rglob("*.py"))
    assert len(sources) > 40
    found = {str(p.relative_to(REPO)): names for p in sources
             if (names := _variable_names_in_code(p))}
    assert set(found) == {"specbatch/settings.py"}, found
    assert sorted(set(found["specbatch/settings.py"])) == sorted(settings.VARIABLES)
    for c_file in (REPO / "kernels" / "csrc").glob("*.c"):
        assert "getenv" not in c_file.read_text(), c_file.name
    # each variable is documented in the module's table
    for name in settings.VARIABLES:
        assert f"| ``{name}`` |" in settings.__doc__, name


def test_settings_are_read_at_each_call(monkeypatch, tmp_path):
    for name in settings.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    defaults = (settings.cache_dir(), settings.triton_kernels(), settings.cpu_kernels(),
                settings.cpu_linear(), settings.cpu_attention(), settings.cpu_decode(),
                settings.cpu_code_weights(), settings.cpu_avx512(), settings.cpu_vnni(),
                settings.cpu_switches())
    assert defaults == (None, None, True, True, True, True, True, True, True, "")
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("SPECBATCH_KERNELS", "1")
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "0")
    monkeypatch.setenv("SPECBATCH_CPU_LINEAR", "oneDNN")
    monkeypatch.setenv("SPECBATCH_CPU_ATTENTION", "torch")
    monkeypatch.setenv("SPECBATCH_CPU_DECODE", "TORCH")
    monkeypatch.setenv("SPECBATCH_CPU_WEIGHTS", "float32")
    monkeypatch.setenv("SPECBATCH_CPU_AVX512", "0")
    monkeypatch.setenv("SPECBATCH_CPU_VNNI", "0")
    assert settings.cuda_linear() == "auto"
    monkeypatch.setenv("SPECBATCH_CUDA_LINEAR", "triton")
    assert settings.cuda_linear() == "triton"
    assert settings.cache_dir() == tmp_path and settings.triton_kernels() is True
    assert not any((settings.cpu_kernels(), settings.cpu_linear(), settings.cpu_attention(),
                    settings.cpu_decode(), settings.cpu_code_weights(), settings.cpu_avx512(),
                    settings.cpu_vnni()))
    # the calibration's fingerprint keeps the values as set (cached fits are keyed by them)
    assert settings.cpu_switches() == (" SPECBATCH_CPU_DECODE=TORCH SPECBATCH_CPU_WEIGHTS=float32"
                                       " SPECBATCH_CPU_AVX512=0")
    monkeypatch.setenv("SPECBATCH_KERNELS", "0")
    monkeypatch.setenv("SPECBATCH_CACHE", "")
    assert settings.triton_kernels() is False and settings.cache_dir() is None


def _fresh_python(code: str, **env: str) -> str:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SPECBATCH_CPU")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full, cwd=REPO, check=True, timeout=300).stdout.strip()


def test_c_kernels_start_on_the_isa_the_environment_names():
    """SPECBATCH_CPU_AVX512=0 / SPECBATCH_CPU_VNNI=0 reach the C kernels through settings.py
    (the C code reads no environment): a fresh process starts on the AVX2 forms."""
    from specbatch.kernels import linear_cpu

    if not linear_cpu.available():
        pytest.skip("needs specbatch's C kernels (x86-64 with AVX2 + FMA, a C compiler)")
    code = ("from specbatch.kernels import attention_cpu, linear_cpu; "
            "print(linear_cpu.avx512(), attention_cpu.avx512(), linear_cpu.int8_kernel())")
    assert _fresh_python(code, SPECBATCH_CPU_AVX512="0",
                         SPECBATCH_CPU_VNNI="0").split() == ["False", "False", "avx2"]
    if linear_cpu.avx512(None) and linear_cpu.int8_kernel() == "vnni":  # this CPU has both
        assert _fresh_python(code).split() == ["True", "True", "vnni"]


def test_validating_int8_builds_nothing_and_imports_no_torch(tmp_path):
    """``EngineConfig(dtype="int8")`` decides from the switches, the CPU flags and a compiler on
    the PATH: no C build, no torch import (validation stays instant)."""
    code = ("import sys; from specbatch.config import EngineConfig, _cpu_kernels; "
            "ok = _cpu_kernels(); "
            "print(ok, EngineConfig(dtype='int8', device='cpu').dtype if ok else '-', "
            "'torch' in sys.modules)")
    ok, dtype, torch_loaded = _fresh_python(code, SPECBATCH_CACHE=str(tmp_path)).split()
    assert torch_loaded == "False" and not (tmp_path / "kernels").exists()
    assert dtype == ("int8" if ok == "True" else "-")
    refused = ("from specbatch.config import EngineConfig\n"
               "try:\n    EngineConfig(dtype='int8', device='cpu')\n"
               "except ValueError as e:\n    print(e)")
    assert "not SPECBATCH_CPU_KERNELS=0" in _fresh_python(refused, SPECBATCH_CPU_KERNELS="0")
