"""The Triton step backend: decode/verify steps with the Triton kernels (``kernels/``), for CUDA.

Same math as ``TorchBackend.step`` (the same ``LlamaForward.run_layers``, ``_qkv``, ``_mlp``
and ``_rms_norm``, hence ``forward.linear`` for q/k/v, o, gate/up, down and lm_head; prefill
and ``logits_index`` steps run on the backend it wraps), except for the KV cache: keys and
values are written by ``kernels.kv_write`` and attention reads the rows in place with
``kernels.attention`` (no gathered copy, no mask tensor, no host sync).
Every query slot of the padded ``[B, Q]`` layout runs (padded slots too, at the positions that
continue their row, as the unpacked torch path does): on a GPU the dense layers of a decode or
verify step cost the weights' bytes, not the token count, and packing would need a host sync.

Batch invariance on the GPU: every op that reduces gives a token the same bits whatever shares
the step. Attention by construction (``kernels.attention``); RMSNorm one program per row
(``kernels.rmsnorm``); the dense layers through ``forward.linear``, which on CUDA is cuBLAS only
where the load-time probe found it row-invariant on the model's shapes, else the fixed-order
Triton matmul (``kernels.matmul``; ``models.dense.choose_cuda_linear``). RoPE, SiLU, the
residual adds and the embedding are per element.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def can_use_kernels(forward) -> bool:
    """Whether ``forward`` (a ``LlamaForward``) runs decode/verify steps with the kernels: the
    device asks for them (``kernels.enabled``), the dtype is 16/32-bit float and head_dim a
    power of 2 >= 16."""
    try:
        from specbatch import kernels
    except ImportError:  # an install without the kernels package
        return False
    d = forward.head_dim
    return (kernels.enabled(forward.device) and forward.dtype in KERNEL_DTYPES
            and d >= 16 and d & (d - 1) == 0)


def rms_norm_kernel_for(dtype: torch.dtype, device: torch.device | str):
    """``kernels.rmsnorm.rms_norm`` where the kernels are enabled for ``device`` and the dtype
    is 16/32-bit float, else None (the torch RMSNorm)."""
    try:
        from specbatch import kernels
    except ImportError:  # an install without the kernels package
        return None
    if dtype not in KERNEL_DTYPES or not kernels.enabled(device):
        return None
    from specbatch.kernels.rmsnorm import rms_norm
    return rms_norm


class TritonBackend:
    """``StepBackend`` on the Triton kernels. fallback: the backend ``select_backend`` would
    give the model without them (the torch reference on CUDA), which runs prefill and the
    steps with ``logits_index`` (a draft model's prompt) and sets the KV cache's dtype."""

    name = "triton"
    packed_attention = False

    def __init__(self, forward, fallback) -> None:
        self.forward = forward
        self.fallback = fallback
        self.kv_dtype = fallback.kv_dtype
        self.min_query_len = fallback.min_query_len
        self.prefill_per_token = fallback.prefill_per_token

    def prefill(self, input_ids: torch.Tensor, cache, chunks: list[tuple[int, int, int]],
                logits_at: list[int]) -> torch.Tensor:
        """``TorchBackend.prefill``, on the fallback backend."""
        return self.fallback.prefill(input_ids, cache, chunks, logits_at)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, rows: torch.Tensor,
             logits_index: torch.Tensor | None = None,
             num_fed: torch.Tensor | None = None) -> torch.Tensor:
        """``TorchBackend.step`` for a decode/verify step: every slot of the padded ``[B, Q]``
        layout runs (``num_fed`` is not used: no host sync); with ``logits_index`` the
        fallback's step.

        input_ids, positions: ``[B, Q]`` int64; rows: ``[B]`` int64 cache rows; cache: the
        ``KVCache`` (contiguous ``[R, Hkv, C, D]`` per layer). Returns logits ``[B, Q, vocab]``
        float32.
        """
        if logits_index is not None:
            return self.fallback.step(input_ids, positions, cache, rows, logits_index, num_fed)
        from specbatch.kernels.attention import attention
        from specbatch.kernels.kv_write import kv_write

        forward = self.forward
        bsz, qlen = input_ids.shape
        num_tokens = bsz * qlen
        tok_rows = rows[:, None].expand(bsz, qlen).reshape(num_tokens).contiguous()  # [T]
        tok_pos = positions.reshape(num_tokens).contiguous()  # [T]
        cos, sin = forward._rope(positions)  # [B, Q, 1, D]
        h = F.embedding(input_ids, forward.embed)  # [B, Q, hidden]
        heads, kv_heads, dim = forward.num_heads, forward.num_kv_heads, forward.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            q = q.reshape(num_tokens, heads, dim)
            k = k.reshape(num_tokens, kv_heads, dim)
            v = v.reshape(num_tokens, kv_heads, dim)
            kv_write(k, v, cache.k[i], cache.v[i], tok_rows, tok_pos)
            o = attention(q, cache.k[i], cache.v[i], tok_rows, tok_pos, scale=dim ** -0.5)
            return o.view(bsz, qlen, heads * dim)

        h = forward.run_layers(h, cos, sin, attend)
        h = forward._rms_norm(h, forward.norm.weight)
        return forward.linear(h, forward.lm_head, None).float()
