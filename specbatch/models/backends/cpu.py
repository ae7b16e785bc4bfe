"""The CPU C-kernel step backend: float32 and int8 (8-bit activations) on x86-64 with AVX2 +
FMA and a C compiler (``kernels/cpu_build.py``).

Two modes, chosen once (``decode_for``):

- **one C call** (``CpuBackend.decode``: ``kernels/decode_cpu.py``): every layer of a decode or
  verify step in one call over the real tokens (``csrc/decode_f32.c`` with the
  ``linear_f32.c`` / ``linear_q8.c`` matmuls and ``attention_f32.c``); prefill runs the same C
  step over each prompt token, so prefix caching is on; int8 keeps keys and values in float16.
  Needs the C matmul (``forward.linear``) and attention in use, hidden % 8 == 0, head_dim % 16
  == 0 and <= 256; ``SPECBATCH_CPU_DECODE=torch`` turns it off.
- **torch loop, C attention** otherwise: ``LlamaForward.run_layers`` with torch glue, the dense
  layers on ``forward.linear`` (the C matmul, or oneDNN with ``SPECBATCH_CPU_LINEAR=onednn``)
  and the C attention (``kernels/attention_cpu.py``); prefill on the torch reference.

In both, every token reads its own cache row up to its own position (no segment plan, mask or
query padding), so a packed verify step's attention runs on its real tokens only
(``packed_attention``). Steps of more than ``max_exact_rows`` query rows (a draft model's
prompt through ``logits_index``) run on the torch reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specbatch import cpu_threads
from specbatch.engine.kv_cache import KVCache
from specbatch.models.backends.reference import TorchBackend


class CpuBackend(TorchBackend):
    """``StepBackend`` on specbatch's C kernels (module docstring).

    attention: ``kernels.attention_cpu.attention``; decode: a ``kernels.decode_cpu.DecodeLayers``
    over the forward's layers (the one-call mode) or None (the torch-loop mode).
    """

    packed_attention = True

    def __init__(self, forward, name: str, attention, decode) -> None:
        super().__init__(forward, name)
        self.attention = attention
        self.decode = decode
        # int8 on the one-call step keeps keys and values in float16 (as llama.cpp does: half
        # the bytes a decode step's attention reads); only the C step reads them (prefill and
        # decode/verify both run it then)
        if forward.activations == "int8" and decode is not None:
            self.kv_dtype = torch.float16
        # a one-row decode step feeds one token where the step runs wholly in C (every op
        # row-invariant from one token), else two
        self.min_query_len = 1 if decode is not None else 2
        # prefill runs the C step over each prompt token (``prefill``): a token's keys and
        # values then depend on the tokens before it in its row alone, not on where the
        # prompt was cut (``ModelRunner``'s prefix caching); elsewhere a prompt's first chunk
        # runs one fused causal attention, whose rounding depends on the chunk
        self.prefill_per_token = decode is not None
        # rows a dense matmul is padded to: 1 on the C kernel (row-invariant from one row),
        # else 2 (oneDNN rounds a one-row matmul differently; models/dense.py)
        self.min_dense_rows = 1 if _is_c_linear(forward.linear) else 2
        # tokens the dense matmuls multiply per pass over a weight, the tile of the step-cost
        # fit (``auto.costmodel.CostModel.tile_tokens``): ``_row_tile``
        self.row_tile = _row_tile(forward)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: KVCache,
                chunks: list[tuple[int, int, int]], logits_at: list[int]) -> torch.Tensor:
        """``TorchBackend.prefill`` (same arguments and result); in the one-call mode one C
        call over every prompt token (the decode/verify step's own code): token t of a chunk is
        a token at position ``start + t`` of its row, and attends to keys ``0 .. start + t`` of
        that row (this chunk's own are written before attention in every layer). A prompt
        token's bits then depend on its own row alone, never on the chunks beside it, and its
        keys and values are the ones a decode step would write for it."""
        cpu_threads.poll()  # fewer threads while other work holds the CPUs (ThreadGovernor)
        if self.decode is None:
            return super().prefill(input_ids, cache, chunks, logits_at)
        f = self.forward
        positions = torch.cat([torch.arange(start, start + n) for _, start, n in chunks])
        rows = torch.cat([torch.full((n,), row, dtype=torch.int64) for row, _, n in chunks])
        cos, sin = f._rope(positions[None])  # [1, T, 1, D]
        h = F.embedding(input_ids, f.embed)  # [T, hidden], updated in place
        self.decode(h, cos[0].flatten(1), sin[0].flatten(1), cache.k, cache.v, rows,
                    positions, self.head_dim ** -0.5)
        if not logits_at:
            return h.new_zeros(0, f.vocab_size)
        h = f._rms_norm(h[torch.tensor(logits_at, dtype=torch.int64)], f.norm.weight)
        return f.linear(h, f.lm_head)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             rows: torch.Tensor, logits_index: torch.Tensor | None = None,
             num_fed: torch.Tensor | None = None) -> torch.Tensor:
        """``TorchBackend.step`` (same arguments and result) with attention by the C kernel:
        every token reads its own cache row up to its own position, so a token's result does
        not depend on what shares the step (kernels/csrc/attention_f32.c); in the one-call mode
        every layer in one C call."""
        cpu_threads.poll()
        f = self.forward
        bsz, qlen = input_ids.shape
        if (qlen * (self.num_heads // self.num_kv_heads) > self.max_exact_rows
                and self.kv_dtype == f.dtype):  # (a float16 cache of int8: the C step only)
            return super().step(input_ids, positions, cache, rows, logits_index, num_fed)
        cos, sin = f._rope(positions)  # [B, Q, 1, D]
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
        scale = self.head_dim ** -0.5
        if self.decode is not None:  # every layer in one C call (kernels/decode_cpu.py)
            h = F.embedding(ids, f.embed)  # [T, hidden], a fresh tensor: updated in place
            self.decode(h, cos.flatten(1), sin.flatten(1), cache.k, cache.v, tok_rows, tok_pos,
                        scale)
            return self._logits(h, bsz, qlen, real, logits_index)
        h = F.embedding(ids if num_tokens >= 2 else ids.expand(2), f.embed)  # [T, hidden]
        hidden = self.num_heads * self.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_tokens(i, tok_rows, tok_pos, k, v)
            return self.attention(q, cache.k[i], cache.v[i], tok_rows, tok_pos, scale=scale,
                                  validate=i == 0).view(num_tokens, hidden)

        h = f.run_layers(h, cos, sin, attend, num_tokens)
        return self._logits(h[:num_tokens], bsz, qlen, real, logits_index)

    def _logits(self, h: torch.Tensor, bsz: int, qlen: int, real: torch.Tensor | None,
                logits_index: torch.Tensor | None) -> torch.Tensor:
        """Logits of ``step``'s final hidden states h ``[T, hidden]`` (T = real tokens when
        ``real`` is given, else ``bsz * qlen``): ``[T, vocab]`` when ``real`` is given (packed),
        else ``[B, Q or M, vocab]``."""
        f = self.forward
        if real is not None:  # packed: the real tokens' logits [T, vocab], never padded
            return f.linear(f._rms_norm(h, f.norm.weight), f.lm_head)
        h = h.view(bsz, qlen, -1)
        if logits_index is not None:
            h = torch.gather(h, 1, logits_index[:, :, None].expand(-1, -1, h.shape[-1]))
        h = f._rms_norm(h, f.norm.weight)
        if h.shape[0] * h.shape[1] < 2 and self.min_dense_rows > 1:
            return f.linear(h.expand(2, -1, -1), f.lm_head)[:1]
        return f.linear(h, f.lm_head)


def _row_tile(forward) -> int:
    """Tokens the C matmul multiplies per pass over a weight: 8 on its AVX-512 kernels
    (kernels/csrc/linear_q8.c ``MRQ`` with VNNI, linear_f32.c ``MR512``), 4 on AVX2 (``MRA``,
    ``MR_MAX``); a step of 17 tokens then pays a fifth pass on AVX2 where a third on AVX-512.
    8 for another matmul (oneDNN's blocking is its own)."""
    if not _is_c_linear(forward.linear):
        return 8
    from specbatch.kernels import linear_cpu

    if forward.activations == "int8":
        return 8 if linear_cpu.int8_kernel() == "vnni" else 4
    return 8 if linear_cpu.avx512() else 4


def _is_c_linear(linear) -> bool:
    try:
        from specbatch.kernels import linear_cpu
    except ImportError:  # an install without the kernels package
        return False
    return linear is linear_cpu.linear


class Int8Weights:
    """Marks ``forward``'s dense weights for 8-bit activations one at a time (``fuse``,
    ``take``) with the codes of ``gguf_path`` (the GGUF the model was loaded from, if any:
    ``kernels.kquant``), and releases the float32 values of each weight the kernels then hold
    codes of (``dense.release_float32``). ``LlamaForward`` takes each layer's weights in
    turn, so that the load's peak holds one layer's forms, not the whole model's.

    A weight named by its GGUF tensors (``blk.3.attn_q.weight``: ``names``) gets the file's
    codes of those tensors (``GGUFCodes.named``), checked against a few of its rows, and its
    float32 values are never read: the fused q/k/v and gate/up are not concatenated
    (``dense.released_fused``), and the pages of the memory-mapped float32 cache that hold
    them are never touched. A weight without named codes falls back to matching its values
    (``kquant.GGUFCodes.find``) or to codes derived from its floats (Q4_1 / Q8_0).

    Nothing reads the released values: every step, prefill and the torch-loop fallback
    multiply through ``forward.linear`` on the codes. Kept: the token embedding (a lookup; a
    tied lm_head is the same tensor), the norms and biases, and weights without codes (they
    run on float32 panels). Raises ``ValueError`` where the C matmul cannot run (int8 needs
    it: a float32 CPU model, x86-64 with AVX2)."""

    release = True  # release the float32 values of weights with codes (tests turn it off)

    def __init__(self, forward, gguf_path: str | None = None) -> None:
        try:
            from specbatch.kernels import linear_cpu
        except ImportError:
            linear_cpu = None
        if linear_cpu is None or not linear_cpu.available():
            raise ValueError("dtype int8 needs specbatch's C kernels (an x86-64 CPU with AVX2 + "
                             "FMA and a C compiler); use float32")
        self._linear_cpu = linear_cpu
        self._embed = forward.embed
        self.source = None
        if gguf_path is not None:
            from specbatch.kernels import kquant

            self.source = kquant.GGUFCodes(gguf_path)  # indexed at its first find only
            if not self.source.has_codes():
                self.source = None  # no tensors of code kinds: nothing to read from the file
        # transformers un-permutes a llama GGUF's q / k heads (LlamaTensorProcessor): the
        # file row of each model row, per projection
        self._heads = {}
        if forward.hf_model.config.model_type in ("llama", "mistral"):
            self._heads = {"attn_q": forward.num_heads, "attn_k": forward.num_kv_heads}
        self.released_bytes = 0  # float32 bytes released so far (0 on a model's 2nd forward)
        self.named = 0  # weights that took the file's codes by name

    def _order(self, tensor: str, rows: int) -> torch.Tensor | None:
        heads = self._heads.get(tensor.split(".")[-2])
        if heads is None:
            return None
        # transformers' _reverse_permute_weights on the row indices: model row r is file row
        # order[r]
        return (torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2)
                .reshape(rows))

    def _named_runs(self, names: tuple[str, ...], params: tuple[torch.Tensor, ...]):
        """The file's codes of ``names`` for ``params`` (checked on a few rows), or None."""
        if self.source is None or any(self._linear_cpu.released(p) for p in params):
            return None
        orders = [self._order(name, p.shape[0]) for name, p in zip(names, params)]
        runs = self.source.named(names, orders, params)
        if runs is None and any(o is not None for o in orders):  # another head layout
            runs = self.source.named(names, None, params)
        return runs

    def fuse(self, params: tuple[torch.Tensor, ...], names: tuple[str, ...] = ()
             ) -> torch.Tensor:
        """``dense.fused_weight(params)`` (q/k/v or gate/up, each ``[N_i, K]``), marked for
        8-bit activations as ``take`` marks it; with ``names`` (their GGUF tensors) and
        the file's codes for all of them, made without reading the float32 values."""
        from specbatch.models import dense

        fused = dense.cached_fused(params)
        if fused is None and names:
            runs = self._named_runs(names, params)
            if runs is not None:
                form = self._linear_cpu.pack_runs(runs, params[0].shape[1])
                if self.release:
                    fused = dense.released_fused(params)
                    self.released_bytes += sum(p.numel() * 4 for p in params)
                else:
                    fused = dense.fused_weight(params)
                self._linear_cpu.set_int8_form(fused, form)
                self.named += 1
                return fused
        fused = dense.fused_weight(params)
        self.take(fused, params)
        return fused

    def take(self, weight: torch.Tensor, views: tuple[torch.Tensor, ...] = (),
             names: tuple[str, ...] = ()) -> bool:
        """Mark ``weight`` ``[N, K]`` (``views``: the parameters that are views of it, for a
        fused weight; ``names``: its GGUF tensors, for the file's codes by name) and release
        its float32 values if it has codes. Returns whether it has."""
        from specbatch.models.dense import release_float32

        lc = self._linear_cpu
        entry = lc._PACKED.get(weight)
        fresh = entry is None or entry[0] != (weight._version, True)
        runs = self._named_runs(names, (weight,)) if names and fresh else None
        if runs is not None:
            lc.set_int8_form(weight, lc.pack_runs(runs, weight.shape[1]))
            self.named += 1
        elif not lc.use_int8_activations(weight, self.source):
            return False
        if self.release and weight is not self._embed and not lc.released(weight):
            self.released_bytes += release_float32(weight, views)
        return True


def attention_for(forward):
    """``kernels.attention_cpu.attention`` when ``forward`` can use it (a float32 model on a
    CPU where the C kernels build, a head size it takes), else None."""
    if forward.device.type != "cpu" or forward.dtype != torch.float32:
        return None
    try:
        from specbatch.kernels import attention_cpu
    except ImportError:  # an install without the kernels package
        return None
    return attention_cpu.attention if attention_cpu.available(forward.head_dim) else None


def decode_for(forward, attention):
    """``kernels.decode_cpu.DecodeLayers`` over ``forward``'s layers when a step can run wholly
    in C: the C matmul (``forward.linear``) and ``attention`` (the C attention) in use, and the
    sizes fit; else None."""
    try:
        from specbatch.kernels import attention_cpu, decode_cpu
    except ImportError:  # an install without the kernels package
        return None
    hidden = forward.embed.shape[1]
    if (attention is not attention_cpu.attention or not _is_c_linear(forward.linear)
            or not decode_cpu.available(hidden, forward.head_dim)):
        return None
    layers = [(wqkv, bqkv, layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, wgu,
               layer.mlp.down_proj.weight, layer.input_layernorm.weight,
               layer.post_attention_layernorm.weight)
              for (wqkv, bqkv), wgu, layer in zip(forward.qkv, forward.gate_up, forward.layers)]
    return decode_cpu.DecodeLayers(layers, forward.num_heads, forward.num_kv_heads,
                                   forward.head_dim, forward.eps)
