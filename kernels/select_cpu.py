"""Greedy choice at a step's fed positions on the CPU, in C (``csrc/select_f32.c``): the argmax
among the tokens a grammar bitmask allows, ties to the lowest id, and a NaN flag per position,
in one pass over each position's logits.

``greedy_select`` gives exactly what the torch sequence gives (gather the fed positions, mask
with xgrammar, argmax, NaN check); ``reference`` is that sequence, for the tests. Used by
``spec_decode.verify.greedy_accept`` for all-greedy steps on the CPU where the C kernels build.
"""

from __future__ import annotations

import torch

from . import cpu_build


def available() -> bool:
    """Whether the C kernels built (x86-64 with AVX2 + FMA and a compiler)."""
    return cpu_build.library() is not None


def greedy_select(logits: torch.Tensor, index: torch.Tensor | None = None,
                  bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: ``[N, V]`` float32 on the CPU, rows contiguous (e.g. a step's fed positions
    ``[T, V]``); index: ``[T]`` int64, the row of each position to choose at (None: every row,
    in order); bitmask: ``[T, ceil(V / 32)]`` int32, xgrammar's packed masks (bit ``v % 32`` of
    word ``v // 32``: token v allowed), or None for every token. Returns (ids ``[T]`` int64, nan
    ``[T]`` bool). Raises ``RuntimeError`` when the C kernels are not built."""
    lib = cpu_build.library()
    if lib is None:
        raise RuntimeError("the C kernels are not built")
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
    if index is None:
        index = torch.arange(logits.shape[0])
    index = index.to(torch.int64).contiguous()
    t, v = index.numel(), logits.shape[1]
    if bitmask is not None:
        bitmask = bitmask.to(torch.int32).contiguous()
        assert bitmask.shape == (t, (v + 31) // 32)
    ids = torch.empty(t, dtype=torch.int64)
    nan = torch.empty(t, dtype=torch.uint8)
    lib.sb_greedy_select(logits.data_ptr(), logits.stride(0), index.data_ptr(), t, v,
                         None if bitmask is None else bitmask.data_ptr(),
                         0 if bitmask is None else bitmask.shape[1], ids.data_ptr(),
                         nan.data_ptr())
    return ids, nan.bool()


def reference(logits: torch.Tensor, index: torch.Tensor,
              bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``greedy_select`` in torch: gather, mask (unpacked bits), argmax, NaN check."""
    flat = logits.index_select(0, index)
    nan = torch.isnan(flat).any(dim=-1)
    if bitmask is not None:
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.reshape(len(index), -1)[:, :logits.shape[1]].bool()
        flat = flat.masked_fill(~allowed, float("-inf"))
    return torch.argmax(flat, dim=-1), nan
