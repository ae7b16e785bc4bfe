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
(``CpuBackend.min_dense_rows``); the others are padded to two rows. ``row_invariant``
re-checks the property at load time on the machine at hand.

On CUDA (and wherever ``specbatch.kernels.enabled``): ``choose_cuda_linear`` takes cuBLAS with
vLLM's no-split-K setting only if ``probe_row_invariance`` finds it invariant on the model's
shapes at load time, else the Triton matmul ``kernels.matmul.linear`` (docs/design.md, "On a
GPU").
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from specbatch import settings

try:
    from specbatch.kernels import linear_cpu
except ImportError:  # an install without the kernels package: oneDNN
    linear_cpu = None

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
_log = logging.getLogger(__name__)


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
    key = _fused_key(params)
    entry = _FUSED.get(params[0])
    if entry is not None and entry[0] == key:
        return entry[1]
    if any(released(p) for p in params):
        raise RuntimeError("fused_weight: the weights' values were released "
                           "(release_float32); load the model again")
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in params])
        start = 0
        for p in params:
            p.data = fused[start:start + p.shape[0]]
            start += p.shape[0]
    _FUSED[params[0]] = (_fused_key(params), fused)
    return fused


def cached_fused(params: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The fused tensor ``fused_weight`` made of ``params`` and still holds (they are its
    views, or its released stubs), else None."""
    entry = _FUSED.get(params[0])
    return entry[1] if entry is not None and entry[0] == _fused_key(params) else None


def released_fused(params: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A released fused weight (``release_float32``'s stub, ``[sum N_i, K]``) for ``params``
    without reading their values: for weights whose kernel form comes from elsewhere (the
    GGUF's codes by name, ``backends.cpu.Int8Weights``). The parameters become stubs of
    their shapes; ``fused_weight`` returns the stub for them from then on."""
    shape = (sum(p.shape[0] for p in params), *params[0].shape[1:])
    with torch.no_grad():
        stub = params[0].new_zeros(1)
        fused = stub.expand(shape)
        for p in params:
            p.data = stub.expand(p.shape)
    _FUSED[params[0]] = (_fused_key(params), fused)
    return fused


def _fused_key(params: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((p._version, p.data_ptr(), tuple(p.shape), p.dtype) for p in params)


def released(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s values were released (``release_float32``): a zero-stride view of
    one float, its shape kept."""
    return weight.numel() > 1 and all(s == 0 for s in weight.stride())


def release_float32(weight: torch.Tensor, views: tuple[torch.Tensor, ...] = ()) -> int:
    """Free ``weight``'s values once a kernel holds its own form of them (``--dtype int8``:
    the 4/8-bit codes, ``kernels.linear_cpu.packed``): ``weight`` and ``views`` (the
    parameters ``fused_weight`` made views of it, in order) are pointed at a zero-stride view
    of one zero float32, so that shapes, dtypes and the identity the kernels' caches key on
    stay, and the storage is freed (or, for a tensor memory-mapped from a safetensors file,
    unmapped) once nothing else holds it. Reading the values afterwards gives zeros: callers
    guard against it (``released``; ``linear_cpu.packed`` raises, the transformers model
    refuses its forward: ``models.llama``). ``fused_weight`` keeps returning ``weight`` for
    ``views``. Returns the bytes the weight's values took."""
    freed = weight.numel() * weight.element_size()
    with torch.no_grad():
        stub = weight.new_zeros(1)
        for p in views:
            p.data = stub.expand(p.shape)
        if not released(weight):
            weight.data = stub.expand(weight.shape)
    if views:
        _FUSED[views[0]] = (_fused_key(views), weight)
    return freed


def form_bytes(weight: torch.Tensor) -> int:
    """Bytes of the copies the dense matmuls hold of ``weight``: the C kernels' form
    (``linear_cpu.form_bytes``) and oneDNN's reordered one (an opaque MKL-DNN tensor, which
    has no storage to ask: its elements' bytes); 0 where none was made."""
    total = 0 if linear_cpu is None else linear_cpu.form_bytes(weight)
    entry = _PACKED.get(weight)
    if entry is not None and entry[1] is not weight:
        packed = entry[1]
        total += (packed.numel() * packed.element_size() if packed.is_mkldnn
                  else packed.untyped_storage().nbytes())
    return total


def own_storage(module: torch.nn.Module) -> int:
    """Give every parameter and buffer of ``module`` that is neither released
    (``release_float32``) nor one of several views of a fused tensor (``fused_weight``) its
    own copy; returns the bytes copied. transformers loads a safetensors file as one memory
    map, each tensor a storage on it, and the map stays (with every page loading touched
    resident) while any one of them lives: after the int8 release, the embedding and the
    norms kept 6 GB of the 1.5B Qwen's float32 file in RSS, 0.5 GB of SmolLM2's."""
    used: dict[int, list] = {}
    for t in (*module.parameters(), *module.buffers()):
        if not released(t):
            used.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    copied = 0
    with torch.no_grad():
        for group in used.values():
            if len({(t.storage_offset(), t.numel()) for t in group}) == 1:  # not fused views
                for t in group:  # (a tied weight: one tensor, found twice)
                    t.data = group[0].detach().clone() if t is group[0] else group[0].data
                copied += group[0].numel() * group[0].element_size()
    return copied


def _has_onednn() -> bool:
    try:
        return (torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


def linear_for(dtype: torch.dtype, device: torch.device | str,
               shapes: tuple[tuple[int, int], ...] | None = None) -> Linear:
    """The dense matmul a forward in ``dtype`` on ``device`` uses.

    - Where the Triton kernels are enabled (``specbatch.kernels.enabled``: CUDA, or
      ``SPECBATCH_KERNELS=1``) and the dtype is float16/bfloat16/float32: a row-count-invariant
      matmul, ``choose_cuda_linear`` on CUDA (cuBLAS if it passes the row-invariance probe on
      ``shapes``, else ``kernels.matmul.linear``), ``kernels.matmul.linear`` elsewhere.
    - float32 on CPU: specbatch's C kernel (``kernels.linear_cpu``) where it is available,
      else oneDNN (when torch was built with it).
    - ``F.linear`` otherwise (bfloat16 and float64 on CPU; CUDA without triton).

    shapes: the model's ``(in_features, out_features)`` pairs, for the CUDA probe (None: no
    probe, the Triton matmul)."""
    dev = torch.device(device)
    triton_linear = _triton_linear(dtype, dev)
    if triton_linear is not None:
        if dev.type == "cuda":
            return choose_cuda_linear(dtype, dev, shapes)
        return triton_linear
    if dev.type == "cpu" and dtype == torch.float32:
        if linear_cpu is not None and linear_cpu.available():
            return linear_cpu.linear
        if _has_onednn():
            return _onednn_linear
    return F.linear


def _triton_linear(dtype: torch.dtype, device: torch.device) -> Linear | None:
    """``kernels.matmul.linear`` where the kernels are enabled for ``device`` and ``dtype``."""
    try:
        from specbatch import kernels
    except ImportError:  # an install without the kernels package
        return None
    if dtype not in (torch.float16, torch.bfloat16, torch.float32) or not kernels.enabled(device):
        return None
    from specbatch.kernels import matmul
    return matmul.linear


def linear_name(linear: Linear) -> str:
    """A short name of a matmul ``linear_for`` returns: ``cublas``, ``triton``, ``c``,
    ``onednn`` or ``torch``."""
    if linear is F.linear:
        return "cublas"  # on CUDA; torch's CPU BLAS elsewhere
    if linear is _onednn_linear:
        return "onednn"
    if linear_cpu is not None and linear is linear_cpu.linear:
        return "c"
    if getattr(linear, "__module__", "") == "specbatch.kernels.matmul":
        return "triton"
    return "torch"


# vLLM's VLLM_BATCH_INVARIANT=1 on Hopper/Blackwell (vllm/model_executor/layers/batch_invariant.py)
# keeps cuBLAS and removes split-K, its one source of row-count variance there, by starving it
# of workspace; it also turns off reduced-precision reductions and TF32
CUBLAS_INVARIANT_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}


def apply_cublas_batch_invariant() -> dict[str, object]:
    """Apply vLLM's batch-invariant cuBLAS setting for Hopper (``VLLM_BATCH_INVARIANT=1``):
    ``CUBLAS_WORKSPACE_CONFIG=:16:8`` and ``CUBLASLT_WORKSPACE_SIZE=1`` (a 1-byte cuBLASLt
    workspace: no split-K), ``allow_fp16/bf16_reduced_precision_reduction = False`` and no
    TF32 for float32 matmuls. The two variables are read when torch creates its cuBLAS
    handles/workspaces, i.e. at the first CUDA matmul of the process: call this before any.
    Returns the settings as they were before (variable -> value or None, flag -> bool), for
    the record."""
    before: dict[str, object] = {name: os.environ.get(name) for name in CUBLAS_INVARIANT_ENV}
    os.environ.update(CUBLAS_INVARIANT_ENV)
    m = torch.backends.cuda.matmul
    before["allow_fp16_reduced_precision_reduction"] = m.allow_fp16_reduced_precision_reduction
    before["allow_bf16_reduced_precision_reduction"] = m.allow_bf16_reduced_precision_reduction
    before["allow_tf32"] = m.allow_tf32
    m.allow_fp16_reduced_precision_reduction = False
    m.allow_bf16_reduced_precision_reduction = False
    m.allow_tf32 = False
    return before


PROBE_ROWS = (1, 2, 3, 4, 6, 8, 16, 32, 64, 100, 128, 256)
# rows the load-time probe of cuBLAS checks: a decode/verify step's tokens (rows x (k + 1)) and
# a prefill forward's (EngineConfig.max_prefill_tokens, 2048 by default)
LOAD_PROBE_ROWS = PROBE_ROWS + (5, 7, 12, 24, 48, 96, 192, 320, 384, 512, 1024, 2048)


def probe_row_invariance(linear: Linear, shapes, dtype: torch.dtype,
                         device: torch.device | str,
                         rows=PROBE_ROWS, seed: int = 0) -> dict[str, dict]:
    """Whether ``linear`` gives every row the same bits at every row count, in any row order.

    For each ``(in_features, out_features)`` in shapes: random x ``[max(rows), K]`` and weight
    ``[N, K]`` in ``dtype`` on ``device`` (the property is the kernel's, not the weights');
    the reference is one call on all ``max(rows)`` rows; for each count m in rows, a call on m
    rows drawn in a random order (a full permutation at m = max(rows)) must give exactly the
    reference's rows.
    Returns ``{"KxN": {"in_features": K, "out_features": N, "invariant": bool,
    "mismatched_rows": [m, ...], "max_abs_diff": float}}`` (JSON-ready), one entry per shape.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = sorted(set(int(r) for r in rows))
    top = rows[-1]
    report = {}
    for k, n in shapes:
        w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
        x = torch.randn(top, k, generator=gen).to(dtype).to(device)
        full = linear(x, w, None)
        bad, worst = [], 0.0
        for m in rows:
            pick = torch.randperm(top, generator=gen)[:m].to(device)
            got = linear(x[pick], w, None)
            if not torch.equal(got, full[pick]):
                bad.append(m)
                worst = max(worst, (got.double() - full[pick].double()).abs().max().item())
        report[f"{k}x{n}"] = {"in_features": k, "out_features": n, "invariant": not bad,
                              "mismatched_rows": bad, "max_abs_diff": worst}
    return report


_CUDA_CHOICE: dict[tuple, Linear] = {}


def choose_cuda_linear(dtype: torch.dtype, device: torch.device | str,
                       shapes: tuple[tuple[int, int], ...] | None,
                       probe: Callable[..., dict] = probe_row_invariance) -> Linear:
    """The dense matmul of a CUDA forward, chosen once per (dtype, device, shapes) and logged
    in one line: ``F.linear`` (cuBLAS with ``apply_cublas_batch_invariant``) when ``probe``
    finds it row-invariant on every shape at ``LOAD_PROBE_ROWS`` rows, else the Triton matmul
    (``kernels.matmul.linear``, invariant by construction). ``SPECBATCH_CUDA_LINEAR=triton``
    or ``=cublas`` skips the probe and forces one (cublas: at the user's risk). Without
    shapes there is nothing to probe: Triton."""
    from specbatch.kernels import matmul
    key = (dtype, str(device), tuple(shapes or ()), probe)
    if key in _CUDA_CHOICE:
        return _CUDA_CHOICE[key]
    name = str(dtype).removeprefix("torch.")
    forced = settings.cuda_linear()
    if forced not in ("auto", "triton", "cublas"):
        raise ValueError(f"SPECBATCH_CUDA_LINEAR={forced!r}: expected auto, triton or cublas")
    if forced != "auto":
        choice = F.linear if forced == "cublas" else matmul.linear
        why = "set by SPECBATCH_CUDA_LINEAR"
    elif not shapes:
        choice, why = matmul.linear, "no shapes to probe cuBLAS on"
    else:
        apply_cublas_batch_invariant()
        report = probe(F.linear, shapes, dtype, device, rows=LOAD_PROBE_ROWS)
        failed = [f"{s} at {r['mismatched_rows'][:4]} rows" for s, r in report.items()
                  if not r["invariant"]]
        if failed:
            choice, why = matmul.linear, "cuBLAS is not row-invariant: " + "; ".join(failed)
        else:
            choice = F.linear
            why = (f"cuBLAS (no split-K) is row-invariant on {len(report)} shapes at "
                   f"1..{max(LOAD_PROBE_ROWS)} rows")
    _log.info("dense layers (%s, %s): %s (%s)", name, device, linear_name(choice), why)
    _CUDA_CHOICE[key] = choice
    return choice


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
