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

import torch
import torch.nn.functional as F

from specbatch.engine.kv_cache import KV_BLOCK, KVCache, KVSegment, plan_segments
from specbatch.models import dense
from specbatch.models.dense import (fused_weight, linear_for, linear_name, min_attention_rows,
                                    row_invariant)
from specbatch.models.llama_kernels import (can_use_kernels, forward_with_kernels,
                                           rms_norm_kernel_for)

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


class LlamaForward:
    """Runs a transformers ``LlamaForCausalLM``-like model with our KV cache.

    Raises ``ValueError`` for an architecture outside the Llama family.
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
        self.max_exact_rows = 256  # query rows (heads x tokens) up to which _attention is exact
        # row-count-invariant dense matmuls (the C kernel or oneDNN for float32 on CPU; on CUDA
        # cuBLAS if the load-time probe finds it invariant on these shapes, else Triton) and
        # the query rows the attention matmuls are padded to (see models/dense.py)
        inter = self.layers[0].mlp.up_proj.weight.shape[0]
        hidden = self.embed.shape[1]
        shapes = ((hidden, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim),
                  (self.num_heads * self.head_dim, hidden), (hidden, 2 * inter),
                  (inter, hidden), (hidden, self.vocab_size))
        self.linear = linear_for(self.dtype, self.device, shapes)
        self.dense_backend = linear_name(self.linear)  # cublas / triton / c / onednn / torch
        self.min_attention_rows = min_attention_rows(self.dtype)
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
        # decode/verify with the Triton kernels (CUDA; see models/llama_kernels.py)
        self.use_kernels = can_use_kernels(self)
        # decode/verify attention in C for float32 on an AVX2 CPU (kernels/attention_cpu.py)
        self.cpu_attention = cpu_attention_for(self)
        # q/k/v and gate/up as one matmul each (the parameters become views of the fused weights)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.gate_up: list[torch.Tensor] = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            projs = (a.q_proj, a.k_proj, a.v_proj)
            bias = (fused_weight(tuple(m.bias for m in projs))
                    if a.q_proj.bias is not None else None)
            self.qkv.append((fused_weight(tuple(m.weight for m in projs)), bias))
            self.gate_up.append(fused_weight((mlp.gate_proj.weight, mlp.up_proj.weight)))
        # dtype int8 (models/loader.py marks the model): the code-weight matmuls take 8-bit
        # activations; marked before DecodeLayers takes the weights' kernel forms
        self.activations = getattr(hf_model, "specbatch_activations", "float32")
        if self.activations == "int8":
            _use_int8_activations(self, getattr(hf_model, "specbatch_gguf", None))
        # ... and every layer of such a step in one C call (kernels/decode_cpu.py)
        self.cpu_decode = cpu_decode_for(self)
        # the KV cache's dtype: the model's, except that int8 keeps keys and values in float16
        # (as llama.cpp does: half the bytes a decode step's attention reads), which only the C
        # step reads (prefill and decode/verify both run it then)
        self.kv_dtype = (torch.float16 if self.activations == "int8" and self._c_decode()
                         else self.dtype)

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

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   mask: torch.Tensor, exact: bool) -> torch.Tensor:
        """q: ``[B, Hkv, rows, D]``; keys, values: ``[B, Hkv, kv_len, D]`` (views into the cache;
        kv_len a multiple of ``KV_BLOCK`` when ``exact``); mask: ``[B, 1, rows', kv_len]`` bool,
        or, for a float32/float64 model's exact steps, the plan's additive bias ``[B * Hkv,
        rows', kv_len]`` (0 where a key is seen, -inf where masked: one ``baddbmm`` multiplies,
        scales and masks, the same op in every step, so the invariance below holds as for the
        bool path; it holds one float per (row, kv head, query row, key) for the forward, the
        size of one layer's scores); rows' >= rows (extra mask rows: the queries are padded to
        them, outputs dropped).
        Returns ``[B, Hkv, rows, D]``.

        Prefill chunks of more than ``max_exact_rows`` query rows use the fused SDPA kernel
        (each chunk alone, the same whatever the speculation config or batch). Decode and verify
        steps use a batch-invariant form, so that a token's result does not depend on how many
        tokens or rows share the step, nor on how many masked keys pad it (measured on AMX and
        AVX2 CPUs, the fused kernel and a single ``probs @ values`` matmul both round
        differently as kv_len changes, by ~1 bfloat16 ulp, enough to flip greedy ties): scores
        by matmul over head_dim, softmax in float32, then ``probs @ values`` in blocks of
        ``KV_BLOCK`` keys (fully masked blocks give exact zeros), and the blocks' partial sums
        added in float32 in block order, one at a time, so extra masked blocks add exact zeros
        at the end
        (``tests/unit/test_forward.py::test_attention_is_invariant_to_padding_and_batch``).
        """
        scale = self.head_dim ** -0.5
        rows = q.shape[2]
        if not exact:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
        target = max(self.min_attention_rows, mask.shape[-2])
        if rows < target:  # few-row matmuls take other kernels (dense.py): pad the queries
            # (the plan pads the masks once per forward; a direct caller's mask is padded here)
            if mask.dtype == torch.bool:
                mask = _pad_rows(mask, target)
            return self._attention(_pad_rows(q, target), keys, values, mask, exact)[:, :, :rows]
        acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        if mask.dtype != torch.bool:  # the plan's additive bias: scale, matmul, mask in one op
            n, hkv, _, dim = q.shape
            scores = torch.baddbmm(mask, q.reshape(n * hkv, rows, dim),
                                   keys.reshape(n * hkv, -1, dim).transpose(1, 2), alpha=scale)
            scores = scores.view(n, hkv, rows, -1)
        else:
            scores = torch.matmul(q, keys.transpose(-1, -2)).to(acc_dtype)
            scores = scores.mul_(scale).masked_fill_(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        # one matmul per block of KV_BLOCK keys (K fixed), partial sums added in block order;
        # each operand is a strided view (batch stride of the cache row), so nothing is copied
        out = None
        for lo in range(0, keys.shape[2], KV_BLOCK):
            part = torch.matmul(probs[..., lo:lo + KV_BLOCK], values[:, :, lo:lo + KV_BLOCK])
            out = part.to(acc_dtype) if out is None else out.add_(part)
        return out.to(q.dtype)

    def _plan_reads(self, rows: torch.Tensor, positions: torch.Tensor, group: int,
                    exact: bool) -> list[tuple]:
        """Which cache views each layer's attention reads, planned once per forward.

        Returns ``(segment, mask, take, src, dst)`` per ``KVSegment``: mask ``[n, 1, rows,
        kv_len]`` bool, rows = group * Q (exact steps: at least ``min_attention_rows``; a
        float32/float64 model's exact steps get the additive bias ``[n * Hkv, rows, kv_len]``
        instead, see ``_attention``); take ``[n]`` int64 batch rows whose queries the segment's rows get
        (None: the slice ``segment.first_batch_row`` onwards); src / dst ``[m]`` int64: the
        segment rows whose outputs are kept and the batch rows they go to (None with take).
        Exact steps read views of consecutive rows padded to whole KV blocks
        (``plan_segments``); SDPA chunks read each row alone up to its own last key, as a
        record prefilled alone would.
        """
        qlen = positions.shape[1]
        row_list = rows.tolist()
        kv_lens = (positions.max(dim=1).values + 1).tolist()
        if exact:
            segments = plan_segments(row_list, kv_lens)
        else:
            segments = [KVSegment(r, r + 1, n, (b,))
                        for b, (r, n) in enumerate(zip(row_list, kv_lens))]
        plans = []
        for seg in segments:
            b0, n = seg.first_batch_row, seg.hi - seg.lo
            if b0 is not None:
                seg_pos, take, src, dst = positions[b0:b0 + n], None, None, None
            else:
                served = [i for i, b in enumerate(seg.batch_rows) if b >= 0]
                filler = seg.batch_rows[served[0]]  # idle rows borrow a real row's queries
                take = torch.tensor([b if b >= 0 else filler for b in seg.batch_rows],
                                    device=positions.device)
                seg_pos = positions[take]
                idle = torch.tensor([b < 0 for b in seg.batch_rows], device=positions.device)
                seg_pos = seg_pos.masked_fill(idle[:, None], 0)  # idle rows see key 0 only
                src = torch.tensor(served, device=positions.device)
                dst = torch.tensor([seg.batch_rows[i] for i in served], device=positions.device)
            key_pos = torch.arange(seg.kv_len, device=positions.device)
            mask = key_pos[None, None, :] <= seg_pos[:, :, None]  # [n, Q, kv_len]
            mask = mask[:, None, None].expand(n, 1, group, qlen, seg.kv_len).reshape(
                n, 1, group * qlen, seg.kv_len)
            if exact:  # as _attention pads the queries
                mask = _pad_rows(mask, self.min_attention_rows)
                if self.dtype in (torch.float32, torch.float64):  # scores in the model dtype:
                    # an additive bias per (row, kv head), 0 or -inf (see _attention)
                    bias = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device)
                    bias.masked_fill_(~mask, float("-inf"))
                    mask = bias.expand(n, self.num_kv_heads, *mask.shape[2:]).reshape(
                        n * self.num_kv_heads, *mask.shape[2:])
            plans.append((seg, mask, take, src, dst))
        return plans

    def _attend(self, layer: int, q: torch.Tensor, cache: KVCache, plans: list[tuple],
                exact: bool) -> torch.Tensor:
        """Attention of one layer for the whole batch, reading every row's keys and values
        where they sit (``KVCache.view``): q ``[B, Hkv, group * Q, D]`` -> same shape."""
        outs = []
        for seg, mask, take, _, _ in plans:
            keys, values = cache.view(layer, seg)  # [n, Hkv, kv_len, D], no copy
            b0 = seg.first_batch_row
            q_seg = q[b0:b0 + seg.hi - seg.lo] if take is None else q[take]
            outs.append(self._attention(q_seg, keys, values, mask, exact))
        if len(plans) == 1 and plans[0][2] is None and outs[0].shape[0] == q.shape[0]:
            return outs[0]
        o = torch.empty_like(q)
        for (seg, _, take, src, dst), out in zip(plans, outs):
            if take is None:
                b0 = seg.first_batch_row
                o[b0:b0 + seg.hi - seg.lo] = out
            else:
                o[dst] = out[src]
        return o

    @torch.inference_mode()
    def forward_prefill(self, input_ids: torch.Tensor, cache: KVCache,
                        chunks: list[tuple[int, int, int]], logits_at: list[int]) -> torch.Tensor:
        """Prompt chunks of several rows in one forward, packed without padding.

        input_ids: ``[T]`` int64, the chunks' tokens back to back (chunk j is
            ``input_ids[cu_j : cu_j + length_j]``).
        chunks: ``(row, start, length)`` per chunk: cache row, position of its first token, and
            its token count. A row's keys before ``start`` must already be in the cache or come
            from an earlier chunk of the same call (keys/values are written before attention
            in every layer). Each chunk attends alone, over its own row's cache view
            ``0 .. start + length - 1``, as a forward of that chunk alone would (``forward``
            with one row; a prompt's first chunk of more than ``max_exact_rows / group`` tokens
            runs SDPA with ``is_causal`` instead of a mask: it skips the masked half, 1.5x
            faster at 767 tokens), so a record's keys, values and logits do not depend on
            which other chunks share the call. The dense layers see ``[T, hidden]``; bfloat16
            matmuls do not depend on the row count on this CPU, and a one-token call is run as
            two rows (see ``runner.verify``).
        logits_at: indices into ``[T]`` whose logits are wanted (e.g. each finished prompt's
            last token).
        Returns logits ``[len(logits_at), vocab]``, float32 (float64 for a float64 model).
        """
        if self.prefill_per_token:
            return self._prefill_c(input_ids, cache, chunks, logits_at)
        group = self.num_heads // self.num_kv_heads
        num_tokens = input_ids.shape[0]
        dev = input_ids.device
        positions = torch.cat([torch.arange(start, start + n, device=dev)
                               for _, start, n in chunks])
        cache_rows = torch.cat([torch.full((n,), row, device=dev, dtype=torch.int64)
                                for row, _, n in chunks])
        cu = [0]
        for _, _, n in chunks:
            cu.append(cu[-1] + n)
        # per chunk: the same plan a one-row forward of it would make
        plans = []
        for (row, start, n), c0 in zip(chunks, cu):
            exact = n * group <= self.max_exact_rows
            if not exact and start == 0:  # a prompt's long first chunk: plain causal attention
                plans.append((c0, n, exact, row))
                continue
            plans.append((c0, n, exact, self._plan_reads(
                torch.tensor([row], device=dev), positions[c0:c0 + n][None], group, exact)))
        cos, sin = self._rope(positions[None])
        cos, sin = cos[0], sin[0]  # [T, 1, D]
        ids = input_ids if num_tokens >= 2 else input_ids.expand(2)  # no one-row matmuls
        h = F.embedding(ids, self.embed)  # [T, hidden]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, cos, sin, num_tokens)
            cache.write_tokens(i, cache_rows, positions, k, v)
            o = torch.empty(num_tokens, self.num_heads * self.head_dim, dtype=q.dtype,
                            device=dev)
            for c0, n, exact, plan in plans:
                if isinstance(plan, int):  # keys 0 .. n-1 of row `plan` are this chunk's own
                    keys = cache.k[i][plan:plan + 1, :, :n]
                    values = cache.v[i][plan:plan + 1, :, :n]
                    oc = F.scaled_dot_product_attention(
                        q[c0:c0 + n].transpose(0, 1)[None], keys, values, is_causal=True,
                        scale=self.head_dim ** -0.5, enable_gqa=True)  # [1, H, n, D]
                    o[c0:c0 + n] = oc[0].transpose(0, 1).reshape(n, self.num_heads * self.head_dim)
                    continue
                # [1, Hkv, group * n, D], as forward lays out one row
                qc = q[c0:c0 + n].view(1, n, self.num_kv_heads, group, self.head_dim).permute(
                    0, 2, 3, 1, 4).reshape(1, self.num_kv_heads, group * n, self.head_dim)
                oc = self._attend(i, qc, cache, plan, exact)
                o[c0:c0 + n] = oc.view(self.num_kv_heads, group, n, self.head_dim).permute(
                    2, 0, 1, 3).reshape(n, self.num_heads * self.head_dim)
            if num_tokens < 2:
                o = o.expand(2, -1)
            h = self._mlp(i, h + self.linear(o, layer.self_attn.o_proj.weight,
                                             layer.self_attn.o_proj.bias))
        if not logits_at:
            return h.new_zeros(0, self.vocab_size,
                               dtype=torch.float64 if h.dtype == torch.float64 else torch.float32)
        h = h[torch.tensor(logits_at, dtype=torch.int64, device=dev)]
        h = self._rms_norm(h, self.norm.weight)
        logits = self.linear(h if h.shape[0] >= 2 else h.expand(2, -1),
                             self.lm_head)[:len(logits_at)]
        return logits if logits.dtype == torch.float64 else logits.float()

    def _prefill_c(self, input_ids: torch.Tensor, cache: KVCache,
                   chunks: list[tuple[int, int, int]], logits_at: list[int]) -> torch.Tensor:
        """``forward_prefill`` (same arguments and result) as one C call over every prompt
        token (``self.cpu_decode``, the decode/verify step's own code): token t of a chunk is a
        token at position ``start + t`` of its row, and attends to keys ``0 .. start + t`` of
        that row (this chunk's own are written before attention in every layer). A prompt
        token's bits then depend on its own row alone, never on the chunks beside it, and its
        keys and values are the ones a decode step would write for it."""
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in chunks])
        rows = torch.cat([torch.full((n,), row, dtype=torch.int64) for row, _, n in chunks])
        cos, sin = self._rope(positions[None])  # [1, T, 1, D]
        h = F.embedding(input_ids, self.embed)  # [T, hidden], updated in place
        self.cpu_decode(h, cos[0].flatten(1), sin[0].flatten(1), cache.k, cache.v, rows,
                        positions, self.head_dim ** -0.5)
        if not logits_at:
            return h.new_zeros(0, self.vocab_size)
        h = self._rms_norm(h[torch.tensor(logits_at, dtype=torch.int64)], self.norm.weight)
        return self.linear(h, self.lm_head)

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

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                rows: torch.Tensor, logits_index: torch.Tensor | None = None,
                num_fed: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over new tokens of ``B`` rows; writes their keys/values into ``cache``.

        input_ids: ``[B, Q]`` int64, new tokens per row, right-padded (pad with any id).
        positions: ``[B, Q]`` int64, absolute position of each new token; a row's positions are
            consecutive from its current cache length. Padded slots continue the count and must
            stay below ``cache.capacity``; their outputs are meaningless.
        rows: ``[B]`` int64, the cache row of each batch row.
        logits_index: optional ``[B, M]`` int64 query indices whose logits are wanted (e.g. the
            last prompt token at prefill); ``None`` returns logits for every query.
        num_fed: optional ``[B]`` int64 (on ``input_ids``' device), real tokens per row (the rest
            of the row is padding). Given (and not with ``logits_index``), the projections, MLP
            and lm_head run on the real tokens only, packed ``[sum(num_fed), hidden]``; only
            attention sees the padded ``[B, Q]`` layout. A verify step whose rows draft
            different lengths then costs by its total tokens, not by ``B x`` the longest row.
            Padded queries' logits are returned as zeros. Needs ``sum(num_fed) >= 2`` (see
            ``runner.verify``: no one-row matmuls).
        Returns logits ``[B, Q or M, vocab]``, float32 (float64 for a float64 model).

        In bfloat16 every op of a decode/verify step gives a token the same result whatever the
        other rows and tokens in the call (checked on this CPU: AMX matmuls do not depend on the
        row count, see ``_attention``), so speculation cannot change greedy output.
        A query at position p attends to keys at positions ``0 .. p`` of its row.
        """
        if self.use_kernels and logits_index is None:
            return forward_with_kernels(self, input_ids, positions, cache, rows)
        bsz, qlen = input_ids.shape
        group = self.num_heads // self.num_kv_heads
        exact = qlen * group <= self.max_exact_rows
        if self.cpu_attention is not None and exact:  # C kernel: each token reads its own row
            return self._forward_cpu_attention(input_ids, positions, cache, rows, logits_index,
                                               num_fed)
        plans = self._plan_reads(rows, positions, group, exact)
        cos, sin = self._rope(positions)
        # packed: token t of the flat [T] layout is (row, query) = real.nonzero()[t]
        real = None
        if num_fed is not None and logits_index is None:
            real = torch.arange(qlen, device=input_ids.device)[None, :] < num_fed[:, None]
            cos, sin = cos[real], sin[real]  # [T, 1, D]
            cache_rows, cache_pos = rows[:, None].expand_as(positions)[real], positions[real]
            h = F.embedding(input_ids[real], self.embed)  # [T, hidden]
            lead = (h.shape[0],)
        else:
            h = F.embedding(input_ids, self.embed)  # [B, Q, hidden]
            lead = (bsz, qlen)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, cos, sin)
            if real is None:
                cache.write(i, rows, positions, k, v)
            else:
                cache.write_tokens(i, cache_rows, cache_pos, k, v)
                padded = q.new_zeros(bsz, qlen, self.num_heads, self.head_dim)
                padded[real] = q
                q = padded
            # group query heads per kv head instead of repeating keys: [B, Hkv, group * Q, D]
            q = q.view(bsz, qlen, self.num_kv_heads, group, self.head_dim).permute(
                0, 2, 3, 1, 4).reshape(bsz, self.num_kv_heads, group * qlen, self.head_dim)
            o = self._attend(i, q, cache, plans, exact)
            o = o.view(bsz, self.num_kv_heads, group, qlen, self.head_dim).permute(
                0, 3, 1, 2, 4).reshape(bsz, qlen, self.num_heads * self.head_dim)
            if real is not None:
                o = o[real]  # [T, hidden]
            h = self._mlp(i, h + self.linear(o, layer.self_attn.o_proj.weight,
                                             layer.self_attn.o_proj.bias))
        if logits_index is not None:
            h = torch.gather(h, 1, logits_index[:, :, None].expand(-1, -1, h.shape[-1]))
        h = self._rms_norm(h, self.norm.weight)
        logits = self.linear(h, self.lm_head)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        if real is not None:
            out = logits.new_zeros(bsz, qlen, logits.shape[-1])
            out[real] = logits
            logits = out
        return logits

    def _forward_cpu_attention(self, input_ids: torch.Tensor, positions: torch.Tensor,
                               cache: KVCache, rows: torch.Tensor,
                               logits_index: torch.Tensor | None,
                               num_fed: torch.Tensor | None) -> torch.Tensor:
        """``forward`` (same arguments and result) with attention by ``self.cpu_attention``:
        every token reads its own cache row up to its own position, so no segment plan, mask
        or query padding is needed, and a token's result does not depend on what shares the
        step (kernels/csrc/attention_f32.c)."""
        bsz, qlen = input_ids.shape
        cos, sin = self._rope(positions)  # [B, Q, 1, D]
        tok_rows = rows[:, None].expand(bsz, qlen)
        real = None
        if num_fed is not None and logits_index is None:  # packed: the real tokens only
            real = torch.arange(qlen, device=input_ids.device)[None, :] < num_fed[:, None]
            cos, sin, ids = cos[real], sin[real], input_ids[real]  # [T, 1, D], [T]
            tok_rows, tok_pos = tok_rows[real], positions[real]
        else:  # every slot, padded ones included (their outputs are dropped by the caller)
            cos, sin, ids = cos.flatten(0, 1), sin.flatten(0, 1), input_ids.flatten()
            tok_rows, tok_pos = tok_rows.flatten(), positions.flatten()
        num_tokens = ids.shape[0]
        tok_rows, tok_pos = tok_rows.contiguous(), tok_pos.contiguous()
        if self._c_decode():  # every layer in one C call (kernels/decode_cpu.py)
            h = F.embedding(ids, self.embed)  # [T, hidden], a fresh tensor: updated in place
            self.cpu_decode(h, cos.flatten(1), sin.flatten(1), cache.k, cache.v, tok_rows,
                            tok_pos, self.head_dim ** -0.5)
            return self._cpu_logits(h, bsz, qlen, real, logits_index)
        h = F.embedding(ids if num_tokens >= 2 else ids.expand(2), self.embed)  # [T, hidden]
        hidden = self.num_heads * self.head_dim
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(i, h, cos, sin, num_tokens)
            cache.write_tokens(i, tok_rows, tok_pos, k, v)
            o = self.cpu_attention(q, cache.k[i], cache.v[i], tok_rows, tok_pos,
                                   scale=self.head_dim ** -0.5,
                                   validate=i == 0).view(num_tokens, hidden)
            if num_tokens < 2:  # no one-row matmuls (models/dense.py)
                o = o.expand(2, -1)
            h = self._mlp(i, h + self.linear(o, layer.self_attn.o_proj.weight,
                                             layer.self_attn.o_proj.bias))
        return self._cpu_logits(h[:num_tokens], bsz, qlen, real, logits_index)

    @property
    def packed_attention(self) -> bool:
        """Whether a packed verify step (``forward`` with ``num_fed``) runs attention on its real
        tokens only (the CPU C attention: each token reads its own row), so a step's attention
        costs by its tokens, not by its rows padded to the longest (``CostModel.packed``)."""
        return self.cpu_attention is not None and not self.use_kernels

    @property
    def min_dense_rows(self) -> int:
        """Rows a dense matmul is padded to: 1 on the C kernel (row-invariant from one row),
        else 2 (oneDNN and bfloat16 round a one-row matmul differently; models/dense.py)."""
        return 1 if dense.linear_cpu is not None and self.linear is dense.linear_cpu.linear else 2

    @property
    def min_query_len(self) -> int:
        """Query slots a one-row decode step is padded to (``ModelRunner.query_len``): 1 where
        the step runs wholly in C (every op row-invariant from one token), else 2."""
        return 1 if self._c_decode() else 2

    @property
    def prefill_per_token(self) -> bool:
        """Whether prefill runs the C decode step over each prompt token (``_prefill_c``; float16
        keys and values run only there): a token's keys and values then depend on the tokens
        before it in its row alone, not on where the prompt was cut, so a row may start its
        prefill from keys another prompt with the same prefix wrote (``ModelRunner``'s prefix
        caching). Elsewhere a prompt's first chunk runs one fused causal attention, whose
        rounding depends on the chunk."""
        return self._c_decode() or (self.cpu_decode is not None and self.kv_dtype != self.dtype)

    def _c_decode(self) -> bool:
        """Whether a float32 decode/verify step runs wholly in C (``self.cpu_decode``): only
        with the C matmul and attention in use (a caller that swapped either keeps torch)."""
        if self.cpu_decode is None:
            return False
        from specbatch.kernels import attention_cpu, linear_cpu
        return self.linear is linear_cpu.linear and self.cpu_attention is attention_cpu.attention

    def _cpu_logits(self, h: torch.Tensor, bsz: int, qlen: int, real: torch.Tensor | None,
                    logits_index: torch.Tensor | None) -> torch.Tensor:
        """Logits of ``_forward_cpu_attention``'s final hidden states h ``[T, hidden]`` (T =
        real tokens when ``real`` is given, else ``bsz * qlen``)."""
        if real is not None:
            logits = self.linear(self._rms_norm(h, self.norm.weight), self.lm_head)
            out = logits.new_zeros(bsz, qlen, logits.shape[-1])
            out[real] = logits
            return out
        h = h.view(bsz, qlen, -1)
        if logits_index is not None:
            h = torch.gather(h, 1, logits_index[:, :, None].expand(-1, -1, h.shape[-1]))
        h = self._rms_norm(h, self.norm.weight)
        if h.shape[0] * h.shape[1] < 2 and self.min_dense_rows > 1:
            return self.linear(h.expand(2, -1, -1), self.lm_head)[:1]
        return self.linear(h, self.lm_head)


def _use_int8_activations(forward: LlamaForward, gguf_path: str | None = None) -> None:
    """Mark every dense weight of ``forward`` (fused q/k/v, o, fused gate/up, down, lm_head) for
    8-bit activations (``kernels.linear_cpu.use_int8_activations``), with the Q4_K / Q6_K codes
    of ``gguf_path`` (the GGUF the model was loaded from, if any: ``kernels.kquant``). Raises
    ``ValueError`` where the C matmul cannot run (int8 needs it: a float32 CPU model, x86-64
    with AVX2)."""
    try:
        from specbatch.kernels import linear_cpu
    except ImportError:
        linear_cpu = None
    if linear_cpu is None or not linear_cpu.available():
        raise ValueError("dtype int8 needs specbatch's C kernels (an x86-64 CPU with AVX2 + FMA "
                         "and a C compiler); use float32")
    weights = [w for w, _ in forward.qkv] + forward.gate_up + [forward.lm_head]
    for layer in forward.layers:
        weights += [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
    source = None
    if gguf_path is not None:
        from specbatch.kernels import kquant

        source = kquant.GGUFCodes(gguf_path)
        if not len(source):
            source = None  # no K-quant tensors: the floats give every code
    for w in weights:
        linear_cpu.use_int8_activations(w, source)


def cpu_decode_for(forward: LlamaForward):
    """``kernels.decode_cpu.DecodeLayers`` over ``forward``'s layers when it can run them (the
    C attention is in use and the sizes fit), else None."""
    if forward.cpu_attention is None:
        return None
    try:
        from specbatch.kernels import decode_cpu
    except ImportError:  # an install without the kernels package
        return None
    hidden = forward.embed.shape[1]
    if not decode_cpu.available(hidden, forward.head_dim):
        return None
    layers = [(wqkv, bqkv, layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, wgu,
               layer.mlp.down_proj.weight, layer.input_layernorm.weight,
               layer.post_attention_layernorm.weight)
              for (wqkv, bqkv), wgu, layer in zip(forward.qkv, forward.gate_up, forward.layers)]
    return decode_cpu.DecodeLayers(layers, forward.num_heads, forward.num_kv_heads,
                                   forward.head_dim, forward.eps)


def cpu_attention_for(forward: LlamaForward):
    """``kernels.attention_cpu.attention`` when ``forward`` can use it (a float32 model on a
    CPU where the C kernels build, a head size it takes), else None."""
    if forward.device.type != "cpu" or forward.dtype != torch.float32:
        return None
    try:
        from specbatch.kernels import attention_cpu
    except ImportError:  # an install without the kernels package
        return None
    return attention_cpu.attention if attention_cpu.available(forward.head_dim) else None


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ``[B, H, n, ...]`` with its last row repeated up to ``rows`` rows (unchanged when
    it has that many already)."""
    n = t.shape[2]
    if n >= rows:
        return t
    return torch.cat([t, t[:, :, -1:].expand(-1, -1, rows - n, *t.shape[3:])], dim=2)
