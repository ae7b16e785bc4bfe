"""Every decoder layer of a float32 decode/verify step in one C call (``csrc/decode_f32.c``).

A batch-1 step of SmolLM2-135M through torch ran ~20 ops per layer around the C matmul and
attention (norms, rope, cache writes, residual adds, SiLU): ~10 ms of a ~33 ms step in
per-op overhead, more than the attention itself. Here the whole stack of layers is one call:
the same C matmuls (``linear_cpu``: float32 panels or exact 4/8-bit codes) and attention
(``attention_cpu``), with the glue in C in a fixed per-token order (see the C file), so a
token's bits still depend only on its own inputs and cache row. The glue rounds differently from
torch's (the outputs agree to ~1e-6), so a step runs wholly here or wholly in torch.

``SPECBATCH_CPU_DECODE=torch`` keeps the torch loop; ``SPECBATCH_CPU_KERNELS=0`` all C kernels.
"""

from __future__ import annotations

import ctypes

import torch

from specbatch import settings

from . import cpu_build, linear_cpu

MAX_HEAD_DIM = 256


class _Weight(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("data", ctypes.c_void_p), ("codes", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Weight), ("o", _Weight), ("gate_up", _Weight), ("down", _Weight),
                ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


def _library():
    if not settings.cpu_decode():
        return None
    return cpu_build.library()


def available(hidden: int, head_dim: int) -> bool:
    """Whether ``DecodeLayers`` runs here for these sizes (hidden a multiple of 8, head_dim a
    multiple of 16 up to 256) with the C matmul in use."""
    return (hidden % 8 == 0 and head_dim % 16 == 0 and 0 < head_dim <= MAX_HEAD_DIM
            and _library() is not None and linear_cpu.available())


def _weight(w: torch.Tensor, bias: torch.Tensor | None, keep: list) -> _Weight:
    form = linear_cpu.packed(w)
    if bias is not None:
        bias = bias.detach().contiguous()
        keep.append(bias)
    n, k = w.shape
    if form[0]:
        return _Weight(form[0], form[1].data_ptr(), form[2].data_ptr(),
                       None if bias is None else bias.data_ptr(), n, k)
    return _Weight(0, form[1].data_ptr(), None, None if bias is None else bias.data_ptr(), n, k)


class DecodeLayers:
    """The decoder layers of a float32 Llama-family model on the CPU, as one C call.

    layers: per layer ``(qkv weight [Nq + 2 Nkv, hidden], qkv bias or None, o weight [hidden,
    Nq], o bias or None, gate/up weight [2 I, hidden], down weight [hidden, I], input norm
    weight [hidden], post-attention norm weight [hidden])``, float32 CPU tensors (the fused
    q/k/v and gate/up of ``LlamaForward``). The weights' kernel forms (``linear_cpu.packed``)
    are taken once and again whenever a weight changes in place.
    """

    def __init__(self, layers: list[tuple], num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        self.layers = layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps = float(eps)
        self._lib = cpu_build.library()
        self._array = None
        self._versions = None
        self._keep: list = []

    def _weights(self) -> ctypes.Array:
        versions = [t._version for layer in self.layers for t in layer if t is not None]
        if self._array is None or versions != self._versions:
            keep: list = []
            array = (_Layer * len(self.layers))()
            for entry, (wqkv, bqkv, wo, bo, wgu, wd, n_in, n_post) in zip(array, self.layers):
                entry.qkv = _weight(wqkv, bqkv, keep)
                entry.o = _weight(wo, bo, keep)
                entry.gate_up = _weight(wgu, None, keep)
                entry.down = _weight(wd, None, keep)
                for name, t in (("input_norm", n_in), ("post_norm", n_post)):
                    t = t.detach().contiguous()
                    keep.append(t)
                    setattr(entry, name, t.data_ptr())
            self._array, self._versions, self._keep = array, versions, keep
        return self._array

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_cache: list[torch.Tensor], v_cache: list[torch.Tensor], rows: torch.Tensor,
                 positions: torch.Tensor, scale: float) -> torch.Tensor:
        """Run every layer on h ``[T, hidden]`` float32 (updated in place and returned).

        cos, sin: ``[T, head_dim]`` float32 (``LlamaForward._rope``: sin's first half negated);
        k_cache, v_cache: per layer ``[R, Hkv, C, head_dim]``, float32 or float16 (keys and values
        rounded to float16 as they are written), all of one dtype and with the same strides
        (``KVCache``); rows, positions: ``[T]`` int64, token t's cache row and position (its keys
        and values are written there, and it attends to keys 0 .. its position). Raises
        ``ValueError`` for rows or positions outside the cache, ``MemoryError`` when the C code
        cannot allocate its buffers.
        """
        lib = self._lib
        t, hidden = h.shape
        r, hkv, c, d = k_cache[0].shape
        rows = rows.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        if t and (int(rows.min()) < 0 or int(rows.max()) >= r or int(positions.min()) < 0
                  or int(positions.max()) >= c):
            raise ValueError("rows or positions outside the cache")
        array = self._weights()
        for entry, k, v in zip(array, k_cache, v_cache):
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        cos, sin = cos.contiguous(), sin.contiguous()
        s = k_cache[0].stride()
        if t and lib.sb_decode_f32(array, len(self.layers), h.data_ptr(), t, hidden,
                                   cos.data_ptr(), sin.data_ptr(), rows.data_ptr(),
                                   positions.data_ptr(), self.num_heads, self.num_kv_heads, d,
                                   s[0], s[1], s[2], self.eps, scale,
                                   int(k_cache[0].dtype == torch.float16)):
            raise MemoryError("the C decode step could not allocate its buffers")
        return h
