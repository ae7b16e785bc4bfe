"""Kernel tests: every Triton kernel against its torch reference, on fresh random inputs.

With a GPU they run the compiled kernels on CUDA tensors. Without one they run them under
Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1`` must be set before any kernel module
is imported (Triton reads it when a function is decorated), so it is set here, at collection,
unless the environment says otherwise. Without ``triton`` installed every test here skips.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton", reason="the kernel tests need triton (pip install -e '.[test]')")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)


@pytest.fixture
def device() -> torch.device:
    return DEVICE
