"""The torch reference step backend: every dtype and device (bfloat16, float64, float32
without the C attention, CUDA without Triton); the C and Triton backends fall back to it for
the steps they do not take.

Dense layers by ``forward.linear`` (``models/dense.linear_for``) on the real tokens; attention
batch-invariant in the blocked form of ``_attention`` over ``plan_segments`` views of the cache
(exact steps), fused SDPA for prefill chunks of more than ``max_exact_rows`` query rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specbatch.engine.kv_cache import KV_BLOCK, KVCache, KVSegment, plan_segments
from specbatch.models.dense import min_attention_rows


class TorchBackend:
    """``StepBackend`` of ``forward`` (a ``LlamaForward``) in torch ops.

    name: the calibration key ``select_backend`` gives it (``backends.cpu_backend_name`` on the
    CPU: ``ckernels`` when ``forward.linear`` is the C matmul, else ``torch``).
    """

    min_query_len = 2
    prefill_per_token = False
    packed_attention = False

    def __init__(self, forward, name: str = "torch") -> None:
        self.forward = forward
        self.name = name
        self.kv_dtype = forward.dtype
        self.dtype = forward.dtype
        self.num_heads, self.num_kv_heads = forward.num_heads, forward.num_kv_heads
        self.head_dim = forward.head_dim
        self.max_exact_rows = 256  # query rows (heads x tokens) up to which _attention is exact
        # query rows the attention matmuls are padded to (see models/dense.py)
        self.min_attention_rows = min_attention_rows(self.dtype)

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
        instead, see ``_attention``); take ``[n]`` int64 batch rows whose queries the segment's
        rows get (None: the slice ``segment.first_batch_row`` onwards); src / dst ``[m]``
        int64: the segment rows whose outputs are kept and the batch rows they go to (None
        with take).
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
    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
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
            Needs ``sum(num_fed) >= 2`` (see ``runner.verify``: no one-row matmuls).
        Returns logits ``[B, Q or M, vocab]``, float32 (float64 for a float64 model); packed
        (``num_fed``), the real tokens' logits ``[sum(num_fed), vocab]`` in row order.

        In bfloat16 every op of a decode/verify step gives a token the same result whatever the
        other rows and tokens in the call (checked on this CPU: AMX matmuls do not depend on the
        row count, see ``_attention``), so speculation cannot change greedy output.
        A query at position p attends to keys at positions ``0 .. p`` of its row.
        """
        f = self.forward
        bsz, qlen = input_ids.shape
        group = self.num_heads // self.num_kv_heads
        exact = qlen * group <= self.max_exact_rows
        plans = self._plan_reads(rows, positions, group, exact)
        cos, sin = f._rope(positions)
        # packed: token t of the flat [T] layout is (row, query) = real.nonzero()[t]
        real = None
        if num_fed is not None and logits_index is None:
            real = torch.arange(qlen, device=input_ids.device)[None, :] < num_fed[:, None]
            cos, sin = cos[real], sin[real]  # [T, 1, D]
            cache_rows, cache_pos = rows[:, None].expand_as(positions)[real], positions[real]
            h = F.embedding(input_ids[real], f.embed)  # [T, hidden]
        else:
            h = F.embedding(input_ids, f.embed)  # [B, Q, hidden]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
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
            return o if real is None else o[real]  # [T, hidden] when packed

        h = f.run_layers(h, cos, sin, attend)
        if logits_index is not None:
            h = torch.gather(h, 1, logits_index[:, :, None].expand(-1, -1, h.shape[-1]))
        h = f._rms_norm(h, f.norm.weight)
        logits = f.linear(h, f.lm_head)
        return logits if logits.dtype == torch.float64 else logits.float()

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: KVCache,
                chunks: list[tuple[int, int, int]], logits_at: list[int]) -> torch.Tensor:
        """Prompt chunks of several rows in one forward, packed without padding.

        input_ids: ``[T]`` int64, the chunks' tokens back to back (chunk j is
            ``input_ids[cu_j : cu_j + length_j]``).
        chunks: ``(row, start, length)`` per chunk: cache row, position of its first token, and
            its token count. A row's keys before ``start`` must already be in the cache or come
            from an earlier chunk of the same call (keys/values are written before attention
            in every layer). Each chunk attends alone, over its own row's cache view
            ``0 .. start + length - 1``, as a forward of that chunk alone would (``step``
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
        f = self.forward
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
        cos, sin = f._rope(positions[None])
        cos, sin = cos[0], sin[0]  # [T, 1, D]
        ids = input_ids if num_tokens >= 2 else input_ids.expand(2)  # no one-row matmuls
        h = F.embedding(ids, f.embed)  # [T, hidden]
        hidden = self.num_heads * self.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write_tokens(i, cache_rows, positions, k, v)
            o = torch.empty(num_tokens, hidden, dtype=q.dtype, device=dev)
            for c0, n, exact, plan in plans:
                if isinstance(plan, int):  # keys 0 .. n-1 of row `plan` are this chunk's own
                    keys = cache.k[i][plan:plan + 1, :, :n]
                    values = cache.v[i][plan:plan + 1, :, :n]
                    oc = F.scaled_dot_product_attention(
                        q[c0:c0 + n].transpose(0, 1)[None], keys, values, is_causal=True,
                        scale=self.head_dim ** -0.5, enable_gqa=True)  # [1, H, n, D]
                    o[c0:c0 + n] = oc[0].transpose(0, 1).reshape(n, hidden)
                    continue
                # [1, Hkv, group * n, D], as step lays out one row
                qc = q[c0:c0 + n].view(1, n, self.num_kv_heads, group, self.head_dim).permute(
                    0, 2, 3, 1, 4).reshape(1, self.num_kv_heads, group * n, self.head_dim)
                oc = self._attend(i, qc, cache, plan, exact)
                o[c0:c0 + n] = oc.view(self.num_kv_heads, group, n, self.head_dim).permute(
                    2, 0, 1, 3).reshape(n, hidden)
            return o

        h = f.run_layers(h, cos, sin, attend, num_tokens)
        if not logits_at:
            return h.new_zeros(0, f.vocab_size,
                               dtype=torch.float64 if h.dtype == torch.float64 else torch.float32)
        h = h[torch.tensor(logits_at, dtype=torch.int64, device=dev)]
        h = f._rms_norm(h, f.norm.weight)
        logits = f.linear(h if h.shape[0] >= 2 else h.expand(2, -1),
                          f.lm_head)[:len(logits_at)]
        return logits if logits.dtype == torch.float64 else logits.float()


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` ``[B, H, n, ...]`` with its last row repeated up to ``rows`` rows (unchanged when
    it has that many already)."""
    n = t.shape[2]
    if n >= rows:
        return t
    return torch.cat([t, t[:, :, -1:].expand(-1, -1, rows - n, *t.shape[3:])], dim=2)
