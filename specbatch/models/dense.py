"""Dense matmuls whose rows do not depend on how many other rows share the call.

Speculation is output-neutral only if a token's logits are the same in a one-token decode step
and in a verify step of k + 1 tokens beside other rows (docs/design.md, "Batch invariance").
For the dense layers (q/k/v/o projections, MLP, lm_head) that means: row ``i`` of
``linear(x, w)`` is bit-identical for every row count ``n >= 2`` and every thread count.
Which kernel gives that depends on the dtype and the CPU (torch 2.13, SmolLM2-135M shapes,
measured on an AMD EPYC Zen 3 with AVX2 only, 1 and 2 threads):

- bfloat16 through ``F.linear``: invariant for ``n >= 1`` on AVX2 (torch's own fallback kernel)
  and ``n >= 2`` on AMX (oneDNN); scalar speed on AVX2: a ``[96, 576] x [576, 1536]`` matmul
  19.5 ms.
- float32 through ``F.linear`` (MKL sgemm): rows of 1-3, 5-7 and 9-11-row matmuls differ from
  the same rows in a larger call by ~1 ulp, so float32 was not invariant.
- float32 through oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``, the op
  torch.compile's CPU backend emits for ``nn.Linear``): invariant for ``n >= 2``, at any thread
  count and any row order, and as fast as MKL: 2.8 ms for the matmul above, lm_head
  ``[16, 576] x [576, 49152]`` 26 ms (bfloat16: 108 ms).

- float32 through specbatch's own kernel (``kernels/csrc/linear_f32.c``, AVX2 + FMA): invariant
  for ``n >= 1`` by construction (one fixed reduction order per output element), and faster
  than oneDNN from 1 to 16 rows, where oneDNN pays for every extra row although the step is
  bound by streaming the weights (``python benchmarks/dense_rows.py``; docs/benchmarks.md).

So float32 on CPU uses the kernel where it builds (x86-64 with AVX2 and a C compiler), oneDNN
otherwise (``SPECBATCH_CPU_LINEAR=onednn`` forces oneDNN). Only the C kernel gets one-row calls
(``LlamaForward.min_dense_rows``); the others are padded to two rows. ``row_invariant``
re-checks the property at load time on the machine at hand.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

try:
    from specbatch.kernels import linear_cpu
except ImportError:  # an install without the kernels package: oneDNN
    linear_cpu = None

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


# weight -> (its version, the weight reordered once into oneDNN's blocked layout); the packed
# copy lives as long as the weight (float32 SmolLM2-135M: +540 MB)
_PACKED = WeakIdKeyDictionary()
PACK_BATCH_HINT = 16  # rows the blocked layout is chosen for (any row count runs on it)


def _packed(weight: torch.Tensor) -> torch.Tensor:
    entry = _PACKED.get(weight)
    if entry is None or entry[0] != weight._version:
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_BATCH_HINT)
        except (RuntimeError, AttributeError):
            packed = weight
        entry = (weight._version, packed)
        _PACKED[weight] = entry
    return entry[1]


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN's float32 inner product, on the weight prepacked once.
    x: ``[..., K]`` float32 CPU; weight: ``[N, K]``; bias: ``[N]`` or None. Returns
    ``[..., N]`` float32. Prepacked and plain weights give the same bits (checked 2..2,048
    rows); the prepacked call skips a per-call reorder: a 2-row ``[2, 1536] x [1536, 576]``
    took 0.13 ms instead of 0.70 ms, lm_head ``[2, 576] x [576, 49152]`` 24 ms instead of 38 ms
    (2 threads, machine busy)."""
    return torch.ops.mkldnn._linear_pointwise(x, _packed(weight), bias, "none", [], "")


# first weight of a group -> (the group's identity, the fused tensor the group is a view of)
_FUSED = WeakIdKeyDictionary()


def fused_weight(params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The weights (or biases) of layers that read the same input, concatenated along the
    output dim: ``[sum N_i, K]`` from ``[N_i, K]`` each (``[sum N_i]`` from biases), so that
    q/k/v (or gate/up) run as one matmul, as vLLM's ``QKVParallelLinear`` does.

    Made once per group: the parameters are rebound (``p.data``) to views of the fused tensor,
    so it costs no memory and the transformers model still runs on them. Remade when a
    parameter changed since (in place: its ``_version``; or replaced: its storage), e.g. by
    ``load_state_dict`` or ``model.to(dtype)``. The fused matmul's column ``j`` is a dot product
    over the same K as the separate layer's, so row invariance (checked by ``row_invariant``
    with the fused shapes) carries over; its bits may differ from the separate matmul's.
    """
    key = tuple((p._version, p.data_ptr(), tuple(p.shape), p.dtype) for p in params)
    entry = _FUSED.get(params[0])
    if entry is not None and entry[0] == key:
        return entry[1]
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = fused[start:start + p.shape[0]]
            start += p.shape[0]
    key = tuple((p._version, p.data_ptr(), tuple(p.shape), p.dtype) for p in params)
    _FUSED[params[0]] = (key, fused)
    return fused


def _has_onednn() -> bool:
    try:
        return (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def linear_for(dtype: torch.dtype, device: torch.device | str) -> Linear:
    """The dense matmul a forward in ``dtype`` on ``device`` uses: for float32 on CPU
    specbatch's kernel (``kernels.linear_cpu``) where it is available, else oneDNN (when torch
    was built with it); ``F.linear`` otherwise (bfloat16, float64, CUDA)."""
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        if linear_cpu is not None and linear_cpu.available():
            return linear_cpu.linear
        if _has_onednn():
            return _onednn_linear
    return F.linear


# query rows of the attention matmuls below which a row may round differently (MKL's batched
# sgemm: 1-3 rows differ from 4+; bfloat16: a one-row matmul takes another kernel on AMX)
MIN_ATTENTION_ROWS = {torch.float32: 4}


def min_attention_rows(dtype: torch.dtype) -> int:
    """Query rows per (row, kv head) that ``_attention`` pads its matmuls to (tokens x heads)."""
    return MIN_ATTENTION_ROWS.get(dtype, 2)


@lru_cache(maxsize=None)
def row_invariant(dtype: torch.dtype, shapes: tuple[tuple[int, int], ...],
                  head_dim: int) -> bool:
    """Whether ``linear_for(dtype, "cpu")`` and the attention matmuls give every row the same
    bits at 2..17 and 64 rows, in any order, at this machine's thread count.

    shapes: ``(in_features, out_features)`` of the model's dense layers. Random inputs, a few
    milliseconds per shape; cached per process. The property is the kernels', not the weights',
    so random weights of the model's shapes test it."""
    gen = torch.Generator().manual_seed(0)
    linear = linear_for(dtype, "cpu")
    for k, n in shapes:
        w = torch.randn(n, k, generator=gen).to(dtype) / k ** 0.5
        x = torch.randn(64, k, generator=gen).to(dtype)
        full = linear(x, w, None)
        for rows in list(range(2, 18)) + [64]:
            pick = torch.randperm(64, generator=gen)[:rows]
            if not torch.equal(linear(x[pick], w, None), full[pick]):
                return False
    lo = min_attention_rows(dtype)
    q = torch.randn(2, 3, 40, head_dim, generator=gen).to(dtype)
    keys = torch.randn(2, 3, 512, head_dim, generator=gen).to(dtype)
    full = torch.matmul(q, keys.transpose(-1, -2))
    for rows in range(lo, 20):
        pick = torch.randperm(40, generator=gen)[:rows]
        if not torch.equal(torch.matmul(q[:, :, pick], keys.transpose(-1, -2)),
                           full[:, :, pick]):
            return False
    return True
