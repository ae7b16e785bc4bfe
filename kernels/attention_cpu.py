"""Decode/verify attention over the KV cache in place on x86-64 CPUs, float32, in C
(``csrc/attention_f32.c``): the CPU counterpart of ``kernels/attention.py``, same contract.

Each query token reads its own cache row up to its own position, in one fixed order per
(token, query head), so its output has the same bits whatever other rows or tokens share the
step and however many keys past its position the cache holds (see the C file). It replaces, for
a float32 model on such a CPU, the torch path's padded masks, per-block matmuls and segment
plans (``TorchBackend._attention`` in ``specbatch/models/backends/reference.py``). Built and
loaded by ``kernels/cpu_build.py``; ``SPECBATCH_CPU_ATTENTION=torch`` keeps the torch path.
"""

from __future__ import annotations

import torch

from specbatch import settings

from . import check, cpu_build

MAX_HEAD_DIM = 256  # csrc/attention_f32.c, MAX_D


def _library():
    if not settings.cpu_attention():
        return None
    return cpu_build.library()


def available(head_dim: int) -> bool:
    """Whether ``attention`` runs here for this head size (a multiple of 8 up to 256)."""
    return head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM and _library() is not None


def avx512(enable: bool | None = None) -> bool:
    """Whether the AVX-512 form runs (CPUs with AVX-512 F/VL/DQ; ``SPECBATCH_CPU_AVX512=0``
    starts it off, as for the matmuls): two keys' sums or sixteen output dims per register, and
    two consecutive tokens of a row (a verify step's, a prompt's) sharing each pass over the
    keys and values they both read (``attend_run`` in the C file). The same bits as the AVX2
    form. ``enable`` turns it on or off first (tests and A/B timings)."""
    lib = _library()
    if lib is None:
        return False
    return bool(lib.sb_attention_avx512(-1 if enable is None else int(enable)))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              rows: torch.Tensor, positions: torch.Tensor, scale: float | None = None,
              out: torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """Query token t attends to ``k_cache[rows[t], :, :positions[t] + 1]``.

    q: ``[T, H, D]`` float32 CPU (last dim contiguous); k_cache, v_cache: ``[R, Hkv, C, D]``
    float32 or float16 (widened exactly as they are read), last dim contiguous, the same strides; H a multiple of Hkv (query head h reads kv
    head ``h // (H // Hkv)``); D a multiple of 8, at most 256; rows, positions: ``[T]`` int64
    (``0 <= positions[t] < C``, ``0 <= rows[t] < R``: checked here, since the C code trusts
    them; ``validate=False`` skips that pass for a caller that checked them already, as the
    forward does once per step for all layers). scale: default ``D ** -0.5``. Returns ``[T, H, D]`` float32 (``out`` if given).
    Raises ``ValueError`` for a shape, dtype, device or layout mismatch, ``RuntimeError`` if
    the kernel is not available or runs out of memory.
    """
    lib = _library()
    if lib is None:
        raise RuntimeError("the CPU attention kernel is not available here")
    if not _fits(q, k_cache, v_cache):  # the message is built only for a bad call
        raise ValueError(
            f"q: [T, H, D] float32 and caches [R, Hkv, C, D] float32 or float16 on the CPU, last dims "
            f"contiguous, H a multiple of Hkv, D a multiple of 8 up to {MAX_HEAD_DIM}; got q "
            f"{tuple(q.shape)} {q.dtype} on {q.device}, caches {tuple(k_cache.shape)} "
            f"{k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    t, h, d = q.shape
    r, hkv, c, _ = k_cache.shape
    rows = rows.to(torch.int64).contiguous()
    positions = positions.to(torch.int64).contiguous()
    check(rows.shape == positions.shape == (t,), "rows, positions: [T] each")
    if out is None:
        out = torch.empty(t, h, d, dtype=torch.float32)
    check(out.shape == q.shape and out.dtype == torch.float32 and out.stride(2) == 1,
          "out: like q, last dim contiguous")
    if t == 0:
        return out
    if validate:
        check(int(rows.min()) >= 0 and int(rows.max()) < r and int(positions.min()) >= 0
              and int(positions.max()) < c, "rows or positions outside the cache")
    scale = d ** -0.5 if scale is None else float(scale)
    if lib.sb_attention_f32(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                            v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                            k_cache.stride(2), rows.data_ptr(), positions.data_ptr(),
                            out.data_ptr(), out.stride(0), out.stride(1), t, h, hkv, d,
                            scale, int(k_cache.dtype == torch.float16)) != 0:
        raise RuntimeError("the CPU attention kernel could not allocate its scratch memory")
    return out


def _fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the tensors have the shapes, dtype, device and layout the C kernel reads."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        return False
    d = q.shape[2]
    return (k_cache.stride() == v_cache.stride() and k_cache.shape[3] == d
            and q.shape[1] % k_cache.shape[1] == 0 and d % 8 == 0 and d <= MAX_HEAD_DIM
            and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in (torch.float32, torch.float16)
            and q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and q.stride(2) == 1 and k_cache.stride(3) == 1)
