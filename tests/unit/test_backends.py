"""Which step backend ``select_backend`` gives a model (specbatch/models/backends), what it
reports to the runner, and that its name is the calibration cache's key on the CPU."""

from __future__ import annotations

import pytest
import torch

from specbatch.models.backends.cpu import CpuBackend
from specbatch.models.backends.reference import TorchBackend
from specbatch.models.llama import LlamaForward
from specbatch.auto.costmodel import kernel_path
from tests.helpers import gguf_exact, tiny_llama

# (dtype, switches) -> (backend class, one-call C step, name or its prefix, KV dtype,
# min_query_len / prefill_per_token / packed_attention)
CASES = [
    ("float64", {}, TorchBackend, False, "torch", torch.float64, (2, False, False)),
    ("bfloat16", {}, TorchBackend, False, "torch", torch.bfloat16, (2, False, False)),
    ("float32", {}, CpuBackend, True, "ckernels", torch.float32, (1, True, True)),
    ("float32", {"SPECBATCH_CPU_DECODE": "torch"}, CpuBackend, False, "ckernels",
     torch.float32, (2, False, True)),
    ("float32", {"SPECBATCH_CPU_ATTENTION": "torch"}, TorchBackend, False, "ckernels",
     torch.float32, (2, False, False)),
    ("float32", {"SPECBATCH_CPU_LINEAR": "onednn"}, CpuBackend, False, "torch",
     torch.float32, (2, False, True)),
    ("float32", {"SPECBATCH_CPU_KERNELS": "0"}, TorchBackend, False, "torch", torch.float32,
     (2, False, False)),
    ("int8", {}, CpuBackend, True, "ckernels_", torch.float16, (1, True, True)),
    ("int8", {"SPECBATCH_CPU_DECODE": "torch"}, CpuBackend, False, "ckernels_", torch.float32,
     (2, False, True)),
]


@pytest.mark.parametrize("dtype,env,cls,one_call,name,kv_dtype,flags", CASES,
                         ids=[f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[1].items()) or 'default'}"
                              for c in CASES])
def test_select_backend(dtype, env, cls, one_call, name, kv_dtype, flags, monkeypatch):
    from specbatch.kernels import cpu_build, decode_cpu

    if dtype in ("float32", "int8") and not decode_cpu.available(64, 16):
        pytest.skip("needs an AVX2/FMA CPU and a C compiler")
    monkeypatch.setattr(cpu_build, "library", cpu_build.library.__wrapped__)  # reads the env
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    model = tiny_llama(96, seed=1)
    if dtype == "int8":
        model = gguf_exact(model.float())
        model.specbatch_activations = "int8"
    else:
        model = model.to(getattr(torch, dtype))
    backend = LlamaForward(model).backend
    assert type(backend) is cls
    assert (getattr(backend, "decode", None) is not None) == one_call
    assert backend.name.startswith(name) and (name.endswith("_") or backend.name == name)
    assert backend.name == kernel_path(dtype, "cpu")  # the calibration cache's key
    assert backend.kv_dtype == kv_dtype
    assert (backend.min_query_len, backend.prefill_per_token, backend.packed_attention) == flags


def test_int8_without_the_c_kernels_is_refused(monkeypatch):
    from specbatch.kernels import cpu_build

    monkeypatch.setattr(cpu_build, "library", cpu_build.library.__wrapped__)
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "0")
    model = tiny_llama(96, seed=1).float()
    model.specbatch_activations = "int8"
    with pytest.raises(ValueError, match="dtype int8 needs specbatch's C kernels"):
        LlamaForward(model)
