"""Forward pass of the Llama family (Llama, SmolLM2, Qwen2/Qwen2.5) over a ragged batch.

Weights are the transformers model's own parameters (no copy). Unlike transformers' forward,
every row of the batch may take a different number of new tokens at a different position, and
keys/values go to the rows of a ``KVCache`` named by the caller, so prefill, decode and verify
steps of different records share one code path.

Covers: grouped-query attention, q/k/v biases (Qwen2), tied embeddings, ``rope_theta`` and every
rope scaling transformers implements (the inverse frequencies and attention scaling are read
from the model's own rotary embedding module). Numerics follow transformers' eager/SDPA path
(RMSNorm in float32, rope tables in float32), so float64 logits agree to ~1e-15.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from specbatch.engine.kv_cache import KVCache
from specbatch.models.backends import StepBackend, select_backend
from specbatch.models.backends.cpu import Int8Weights
from specbatch.models.backends.triton_cuda import rms_norm_kernel_for
from specbatch.models.dense import (form_bytes, fused_weight, linear_for, linear_name,
                                    own_storage, row_invariant)

_log = logging.getLogger(__name__)
# dtypes whose matmuls were found not row-invariant here and said so: once per process (a
# run builds several forwards: the memory fit's, the runner's, a draft model's)
_WARNED_NOT_INVARIANT: set[str] = set()

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


_TORCH_KERNELS_SETTLED = False


def settle_torch_kernels() -> None:
    """Call torch's vectorised elementwise functions once each, on one thread, before a
    forward or the sampler calls them on a tensor large enough to be split over threads.

    Measured (torch 2.13 CPU, the AMX Xeon VM, 2 threads): the first ``cos`` of a process over a
    ``[1, 1758, 64]`` float32 tensor gave, in about one run in three, values differing from
    every later call in the half of the elements the calling thread computed (up to ~1e-4
    relative: another implementation of cos), so a job's first prefill wrote other keys for
    half its prompts and their outputs changed from run to run (the fresh-user check of
    session 13: Spec-Bench question 90, 4 of 9 runs). A first call on a small tensor, which
    stays on the calling thread, settles whatever torch picks lazily: 10 of 10 runs then
    matched. Once per process; idempotent and cheap (microseconds)."""
    global _TORCH_KERNELS_SETTLED
    if _TORCH_KERNELS_SETTLED:
        return
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.linspace(0.1, 2.0, 64, dtype=dtype)
        for fn in (torch.cos, torch.sin, torch.exp, torch.log, torch.rsqrt, torch.sqrt,
                   torch.tanh, torch.sigmoid, F.silu, torch.log1p, torch.expm1):
            fn(x)
        torch.softmax(x, dim=0)
        F.rms_norm(x[None], (64,), eps=1e-6)
    _TORCH_KERNELS_SETTLED = True


def _refuse_released_forward(module, args):
    raise RuntimeError("this model was loaded with dtype int8: the float32 values of its code "
                       "weights were released once specbatch's kernels held their 4/8-bit codes, "
                       "so transformers' forward cannot run on it; load it in float32 for that")


class LlamaForward:
    """Runs a transformers ``LlamaForCausalLM``-like model with our KV cache.

    Holds the weights (q/k/v and gate/up fused), RoPE, the norms, the dense matmul ``linear``
    and the one decoder-layer loop (``run_layers``); its steps run on ``backend``, the
    ``StepBackend`` chosen once here (``models.backends.select_backend``).
    Raises ``ValueError`` for an architecture outside the Llama family, or for dtype int8
    without the C kernels.
    """

    def __init__(self, hf_model: torch.nn.Module) -> None:
        settle_torch_kernels()
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported")
        self.hf_model = hf_model
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight
        self.layers = list(inner.layers)
        self.norm = inner.norm
        self.lm_head = hf_model.lm_head.weight
        self.num_layers = len(self.layers)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.vocab_size = self.lm_head.shape[0]
        self.eps = cfg.rms_norm_eps
        rotary = inner.rotary_emb
        self.inv_freq = rotary.inv_freq.float()  # [head_dim / 2]
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        # row-count-invariant dense matmuls (the C kernel or oneDNN for float32 on CPU; on CUDA
        # cuBLAS if the load-time probe finds it invariant on these shapes, else Triton; see
        # models/dense.py)
        inter = self.layers[0].mlp.up_proj.weight.shape[0]
        hidden = self.embed.shape[1]
        shapes = ((hidden, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim),
                  (self.num_heads * self.head_dim, hidden), (hidden, 2 * inter),
                  (inter, hidden), (hidden, self.vocab_size))
        self.linear = linear_for(self.dtype, self.device, shapes)
        self.dense_backend = linear_name(self.linear)  # cublas / triton / c / onednn / torch
        if (self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
                and self.dense_backend != "triton"):  # Triton: invariant by construction
            shapes = shapes[:-1] + ((hidden, min(self.vocab_size, 8192)),)
            name = str(self.dtype).removeprefix("torch.")
            if not row_invariant(self.dtype, shapes, self.head_dim) and (
                    name not in _WARNED_NOT_INVARIANT):
                _WARNED_NOT_INVARIANT.add(name)
                _log.warning("%s matmuls on this CPU round a row differently with the number "
                             "of rows beside it: speculation or batch size may change greedy "
                             "ties (see docs/design.md \"Which CPU\"; --dtype auto takes float32 "
                             "on x86-64 CPUs, specbatch's invariant C kernels)", name)
        # RMSNorm as one Triton program per row where the kernels are enabled (CUDA)
        self.rms_norm_kernel = rms_norm_kernel_for(self.dtype, self.device)
        # dtype int8 (models/loader.py marks the model): the code-weight matmuls take 8-bit
        # activations; each weight is marked (and its float32 values released: backends.cpu.
        # Int8Weights) right after it is fused, before the C backend takes the kernel forms
        self.activations = getattr(hf_model, "specbatch_activations", "float32")
        int8 = (Int8Weights(self, getattr(hf_model, "specbatch_gguf", None))
                if self.activations == "int8" else None)
        # q/k/v and gate/up as one matmul each (the parameters become views of the fused weights)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.gate_up: list[torch.Tensor] = []
        # int8: the GGUF tensors of each weight (llama.cpp's names), for the file's codes
        blk = lambda i, *names: tuple(f"blk.{i}.{n}.weight" for n in names)  # noqa: E731
        for i, layer in enumerate(self.layers):
            a, mlp = layer.self_attn, layer.mlp
            projs = (a.q_proj, a.k_proj, a.v_proj)
            bias = (fused_weight(tuple(m.bias for m in projs))
                    if a.q_proj.bias is not None else None)
            qkv = tuple(m.weight for m in projs)
            gate_up = (mlp.gate_proj.weight, mlp.up_proj.weight)
            if int8 is None:
                self.qkv.append((fused_weight(qkv), bias))
                self.gate_up.append(fused_weight(gate_up))
                continue
            self.qkv.append((int8.fuse(qkv, blk(i, "attn_q", "attn_k", "attn_v")), bias))
            int8.take(a.o_proj.weight, names=blk(i, "attn_output"))
            self.gate_up.append(int8.fuse(gate_up, blk(i, "ffn_gate", "ffn_up")))
            int8.take(mlp.down_proj.weight, names=blk(i, "ffn_down"))
        if int8 is not None:
            tied = self.lm_head is self.embed or self.lm_head.data_ptr() == self.embed.data_ptr()
            int8.take(self.lm_head, names=("token_embd.weight" if tied else "output.weight",))
            if int8.released_bytes:  # transformers' forward would read zeros: refuse it
                hf_model.register_forward_pre_hook(_refuse_released_forward)
                own_storage(hf_model)  # the rest off the weights file's memory map
        # the code that runs a step (Triton, the C kernels or torch), chosen once
        self.backend: StepBackend = select_backend(self)

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this forward holds: the storage of the model's parameters and
        buffers (each storage once: the fused q/k/v and gate/up once, a released weight's
        4-byte stub) plus the kernel forms the dense weights are multiplied in
        (``kernels.linear_cpu.form_bytes``: int8 codes and scales, float32 panels; oneDNN's
        reordered copies)."""
        from specbatch.spec_decode.draft import weight_bytes

        dense = [w for w, _ in self.qkv] + self.gate_up + [self.lm_head]
        for layer in self.layers:
            dense += [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
        return weight_bytes(self.hf_model) + sum(form_bytes(w) for w in
                                                 {id(w): w for w in dense}.values())

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (``backend.kv_dtype``): the model's, except float16 for int8
        on the one-call C step."""
        return self.backend.kv_dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes one token of one row takes (all layers, keys and values)."""
        return (2 * self.num_layers * self.num_kv_heads * self.head_dim
                * torch.empty(0, dtype=self.kv_dtype).element_size())

    def new_cache(self, num_rows: int, capacity: int) -> KVCache:
        return KVCache(self.num_layers, num_rows, self.num_kv_heads, capacity, self.head_dim,
                       self.kv_dtype, self.device)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.rms_norm_kernel is not None:  # one program per row (kernels/rmsnorm.py)
            return self.rms_norm_kernel(x, weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, the same bits as the lines below
            return F.rms_norm(x, weight.shape, weight, self.eps)
        h = x.float()  # as transformers does, whatever the model dtype
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, Q, 1, D]`` (model dtype) of positions ``[B, Q]`` int64; sin's first
        half is negated, as ``_rotate`` expects."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)  # [B, Q, D]
        cos = (emb.cos() * self.attention_scaling).to(self.dtype)
        sin = (emb.sin() * self.attention_scaling).to(self.dtype)
        half = sin.shape[-1] // 2  # the sign of rotate_half folded into sin (see _rotate)
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos[:, :, None, :], sin[:, :, None, :]  # [B, Q, 1, D]

    def _qkv(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             num_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s queries, keys and values of hidden states ``h`` ``[..., hidden]``: one
        fused q/k/v matmul, then rope on q and k together. cos, sin: ``[..., 1, D]``.
        num_tokens: keep only the first rows (a one-token prefill runs as two rows).
        Returns q ``[..., H, D]``, k and v ``[..., Hkv, D]`` (views)."""
        x = self._rms_norm(h, self.layers[i].input_layernorm.weight)
        qkv = self.linear(x, *self.qkv[i])
        if num_tokens is not None:
            qkv = qkv[:num_tokens]
        qk = qkv[..., :self.q_size + self.kv_size].unflatten(
            -1, (self.num_heads + self.num_kv_heads, self.head_dim))
        qk = self._rotate(qk, cos, sin)
        v = qkv[..., self.q_size + self.kv_size:].unflatten(-1, (self.num_kv_heads, self.head_dim))
        return qk[..., :self.num_heads, :], qk[..., self.num_heads:, :], v

    def run_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                   num_tokens: int | None = None) -> torch.Tensor:
        """Every decoder layer over hidden states h ``[..., hidden]`` (the one layer loop of
        every backend): RMSNorm, fused q/k/v and rope (``_qkv``), attention, o_proj plus the
        residual, the MLP (``_mlp``).

        cos, sin: ``[..., 1, D]`` (``_rope``); attend: the backend's attention of one layer,
        ``attend(i, q [..., H, D], k [..., Hkv, D], v [..., Hkv, D]) -> o [..., H * D]``, which
        writes layer i's keys and values into its cache first. num_tokens: h holds
        ``max(num_tokens, 2)`` rows (no one-row matmuls): q/k/v keep the first num_tokens, a
        one-token o is repeated to two rows. Returns h after the last layer."""
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, cos, sin, num_tokens)
            o = attend(i, q, k, v)
            if num_tokens is not None and num_tokens < 2:
                o = o.expand(2, -1)
            attn = layer.self_attn
            h = self._mlp(i, h + self.linear(o, attn.o_proj.weight, attn.o_proj.bias))
        return h

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor, logits_index: torch.Tensor | None = None,
                num_fed: torch.Tensor | None = None) -> torch.Tensor:
        """One decode/verify step on the backend (``backend.step``: ``[B, Q]`` int64 ids and
        positions, ``[B]`` cache rows; returns logits ``[B, Q or M, vocab]``, float32, float64
        for a float64 model; see ``TorchBackend.step``)."""
        return self.backend.step(input_ids, positions, cache, rows, logits_index, num_fed)

    def forward_prefill(self, input_ids: torch.Tensor, cache: KVCache,
                        chunks: list[tuple[int, int, int]], logits_at: list[int]) -> torch.Tensor:
        """Packed prompt chunks on the backend (``backend.prefill``: ``[T]`` int64 ids, ``(row,
        start, length)`` per chunk; returns logits ``[len(logits_at), vocab]``; see
        ``TorchBackend.prefill``)."""
        return self.backend.prefill(input_ids, cache, chunks, logits_at)

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """``h`` plus layer ``i``'s MLP of it (fused gate/up matmul, SiLU, down)."""
        x = self._rms_norm(h, self.layers[i].post_attention_layernorm.weight)
        gate_up = self.linear(x, self.gate_up[i])
        inter = gate_up.shape[-1] // 2
        return h + self.linear(F.silu(gate_up[..., :inter]) * gate_up[..., inter:],
                               self.layers[i].mlp.down_proj.weight)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope: transformers' ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
        cat(-x2, x1)``, here ``roll(x) * sin`` with the sign in ``sin`` (``_rope``: first half
        negated). Negation is exact, so the bits are the same, in two ops fewer."""
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin
