"""Decode/verify forward of ``LlamaForward`` with the Triton kernels (``kernels/``), for CUDA.

Same math as ``LlamaForward.forward`` (projections, RoPE, RMSNorm, MLP are the same torch ops),
except for the KV cache: keys and values are written by ``kernels.kv_write`` and attention reads
the rows in place with ``kernels.attention`` (no gathered copy, no mask tensor, no host sync).
Every query slot of the padded ``[B, Q]`` layout runs (padded slots too, at the positions that
continue their row, as the unpacked torch path does): on a GPU the dense layers of a decode or
verify step cost the weights' bytes, not the token count, and packing would need a host sync.

Batch invariance on the GPU: attention is invariant by construction (``kernels.attention``);
the matmuls are cuBLAS's, whose kernel choice may change with the token count (split-K), the
open part (see docs/design.md).
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


@torch.inference_mode()
def forward_with_kernels(forward, input_ids: torch.Tensor, positions: torch.Tensor, cache,
                         rows: torch.Tensor) -> torch.Tensor:
    """``LlamaForward.forward`` for a decode/verify step (no ``logits_index``).

    input_ids, positions: ``[B, Q]`` int64; rows: ``[B]`` int64 cache rows; cache: the
    ``KVCache`` (contiguous ``[R, Hkv, C, D]`` per layer). Returns logits ``[B, Q, vocab]``
    float32.
    """
    from specbatch.kernels.attention import attention
    from specbatch.kernels.kv_write import kv_write

    bsz, qlen = input_ids.shape
    num_tokens = bsz * qlen
    tok_rows = rows[:, None].expand(bsz, qlen).reshape(num_tokens).contiguous()  # [T]
    tok_pos = positions.reshape(num_tokens).contiguous()  # [T]
    cos, sin = forward._rope(positions)  # [B, Q, 1, D]
    h = F.embedding(input_ids, forward.embed)  # [B, Q, hidden]
    heads, kv_heads, dim = forward.num_heads, forward.num_kv_heads, forward.head_dim
    for i, layer in enumerate(forward.layers):
        attn = layer.self_attn
        x = forward._rms_norm(h, layer.input_layernorm.weight)
        q = F.linear(x, attn.q_proj.weight, attn.q_proj.bias).view(bsz, qlen, heads, dim)
        k = F.linear(x, attn.k_proj.weight, attn.k_proj.bias).view(bsz, qlen, kv_heads, dim)
        v = F.linear(x, attn.v_proj.weight, attn.v_proj.bias).view(num_tokens, kv_heads, dim)
        q = forward._rotate(q, cos, sin).reshape(num_tokens, heads, dim)
        k = forward._rotate(k, cos, sin).reshape(num_tokens, kv_heads, dim)
        kv_write(k, v, cache.k[i], cache.v[i], tok_rows, tok_pos)
        o = attention(q, cache.k[i], cache.v[i], tok_rows, tok_pos, scale=dim ** -0.5)
        h = h + F.linear(o.view(bsz, qlen, heads * dim), attn.o_proj.weight, attn.o_proj.bias)
        mlp = layer.mlp
        x = forward._rms_norm(h, layer.post_attention_layernorm.weight)
        gated = F.silu(F.linear(x, mlp.gate_proj.weight)) * F.linear(x, mlp.up_proj.weight)
        h = h + F.linear(gated, mlp.down_proj.weight)
    h = forward._rms_norm(h, forward.norm.weight)
    return F.linear(h, forward.lm_head).float()
