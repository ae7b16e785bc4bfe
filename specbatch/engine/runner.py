"""Model runner: turns sequences and drafts into tensors, runs the forward, returns logits.

No policy here: which rows run, how many draft tokens each gets, and what is accepted are
decided by the engine.
"""

from __future__ import annotations

import torch

from specbatch.engine.kv_cache import KVCache
from specbatch.engine.sequence import Sequence
from specbatch.engine.step_metadata import StepMetadata
from specbatch.models.llama import LlamaForward

PAD_ID = 0  # placeholder fed in padded query slots; their outputs are never read


class ModelRunner:
    """Owns the model forward and its KV cache (``num_rows`` rows); runs prefill and verify
    steps on the forward's backend (``forward.backend``, a ``StepBackend``).

    The cache starts at ``initial_capacity`` positions (``LLM.prepare``: the job's longest row,
    ``pipeline.kv_capacity``) and doubles if a longer sequence arrives, up to
    ``max_model_len + max_query`` positions (padding slots of a verify step may reach past a
    row's last real position).
    """

    def __init__(self, forward: LlamaForward, num_rows: int, max_model_len: int,
                 prefill_chunk: int = 1024, initial_capacity: int = 512,
                 pack: bool = True, max_prefill_tokens: int = 2048,
                 prefix_caching: bool = True) -> None:
        self.forward = forward
        self.backend = forward.backend  # runs the steps (models/backends: StepBackend)
        self.pack = pack  # verify: dense layers on real tokens only (LlamaForward num_fed)
        self.max_model_len = max_model_len
        # attention granule of prefill: a prompt is cut at multiples of prefill_chunk, whatever
        # else runs, so its numerics never depend on the batch (see prefill_step)
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens  # prompt tokens per prefill forward
        self.cache: KVCache = forward.new_cache(num_rows, initial_capacity)
        self.device = forward.device
        # prefix caching (``start``): only where a prompt token's keys and values do not depend
        # on where its prefill started (``StepBackend.prefill_per_token``)
        self.prefix_caching = prefix_caching and self.backend.prefill_per_token
        self.held: list[list[int]] = [[] for _ in range(num_rows)]  # a free row's valid keys
        self.num_prompt_tokens = 0  # prompt tokens of the sequences started (tokens)
        self.num_prefix_reused = 0  # of those, not prefilled: their keys were in a row already

    @property
    def vocab_size(self) -> int:
        return self.forward.vocab_size

    def start(self, seq: Sequence, others: list[Sequence]) -> int:
        """Prefix caching: before ``seq`` (just given ``seq.row``) is prefilled, find the row
        whose cache holds the longest prefix of its prompt, capped at all but the prompt's
        last token (whose logits the first output token needs): ``seq.row`` itself (the keys
        of the sequence it held before: a templated job's next record there shares the
        instruction), a row another running sequence of ``others`` fills, or another free
        row's leftovers. Copies those keys and values into ``seq.row`` when they are elsewhere
        (one slice per layer) and starts the prefill after them (``seq.num_prefilled``).

        Exact, not approximate: on the backends where it is on (``StepBackend.prefill_per_token``)
        a token's keys and values are a function of the tokens up to it in its row, so the
        copied ones are the bits its own prefill would write. Like vLLM's automatic prefix
        caching, but over the rows' own caches (no block table): what a finished record leaves
        in its row stays usable until another sequence writes there. Returns the prompt tokens
        reused.
        """
        prompt = seq.token_ids[:seq.num_prompt_tokens]
        self.num_prompt_tokens += len(prompt)
        row = seq.row
        best, src = 0, row
        if self.prefix_caching and len(prompt) >= 2:
            # (row, its tokens, how many of them its cache holds); the own row first: it wins
            # ties (no copy)
            candidates = [(row, self.held[row], len(self.held[row]))]
            candidates += [(s.row, s.token_ids, self.cache.seq_lens[s.row]) for s in others
                           if s.row != row]
            candidates += [(r, held, len(held)) for r, held in enumerate(self.held)
                           if r != row and held]
            for r, tokens, valid in candidates:
                n = _common_prefix(prompt, tokens, min(valid, len(prompt) - 1))
                if n > best:
                    best, src = n, r
            if src != row:
                self._copy_positions(src, row, 0, best)
        self.held[row] = []
        self.cache.seq_lens[row] = best
        seq.num_prefilled = best
        self.num_prefix_reused += best
        return best

    def release(self, seq: Sequence) -> None:
        """``seq`` leaves its row: what its cache holds (positions ``0 .. seq_lens - 1``, the
        tokens it fed) stays for ``start`` to reuse. (A running row's ``held`` is empty:
        ``start`` reads its tokens from its sequence.)"""
        self.held[seq.row] = seq.token_ids[:self.cache.seq_lens[seq.row]]

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Write every prompt whole into its cache row (as many packed forwards as the token
        budget needs). Returns logits ``[len(seqs), vocab]`` at each sequence's last token."""
        for seq in seqs:
            seq.num_prefilled = seq.prefill_charged = 0
        logits: dict[int, torch.Tensor] = {}
        pending = list(seqs)
        while pending:
            done, out = self.prefill_step(pending)
            logits.update({s.seq_id: row for s, row in zip(done, out)})
            pending = [s for s in pending if s.num_prefilled < len(s.token_ids)]
        return torch.stack([logits[s.seq_id] for s in seqs])

    def prefill_step(self, seqs: list[Sequence], max_tokens: int | None = None,
                     others: list[Sequence] = ()) -> tuple[list[Sequence], torch.Tensor]:
        """One packed prefill forward: the next prompt chunks of ``seqs``, in order, while they
        fit in ``max_tokens`` (default ``max_prefill_tokens``; the first chunk always runs).

        A chunk runs from ``seq.num_prefilled`` to the next multiple of ``prefill_chunk`` (or
        the prompt's end), so where a prompt is cut never depends on the budget or on the other
        prompts: a record's keys, values and first-token logits are the same in every batch
        (``StepBackend.prefill``). Advances ``num_prefilled`` and the rows' cache
        lengths. Returns the sequences whose prompt is now complete and their logits ``[n,
        vocab]`` at the prompt's last token.

        With prefix caching, a chunk is not computed where another row has (or computes in
        this forward) the same tokens from position 0: the n samples of a record, or records
        with the same prompt, admitted together, prefill it once. Positions another row's
        cache holds already (a row of ``others``, the running sequences, or of ``seqs``; never
        a resumed job's placeholder) are copied before the forward, as ``start`` copies at
        admission (a sibling's prefill had not run then), up to all but the prompt's last
        token; a prompt's last chunk equal to another's computed in this forward (same
        positions, same tokens up to its end, where that prompt ends too) is copied after it,
        with that prompt's last-token logits (the same bits: ``StepBackend.prefill_per_token``). The
        budget charges every chunk whether computed or copied (``prefill_charged``), so the
        steps prompts prefill at never depend on what the caches hold.
        """
        budget = self.max_prefill_tokens if max_tokens is None else max_tokens
        chunks, ids, done, last = [], [], [], []
        charged = 0  # the step's prompt tokens as if none were cached (``prefill_charged``)
        sources = [s for s in (*others, *seqs) if s.replay is None] if self.prefix_caching else []
        before: dict[int, int] = {}  # row -> positions valid before this forward
        computed: list[tuple[Sequence, int, int, int]] = []  # (seq, start, end, last id index)
        twins: list[tuple[int, int, int, int]] = []  # (row, source row, start, end): copied
        for seq in seqs:
            pos, prompt, n = seq.prefill_charged, seq.token_ids, seq.num_prompt_tokens
            ghost = seq.replay is not None  # a resumed job's placeholder: charged, not run
            finished_at = None  # index of the prompt's last token in ``ids`` (its logits)
            while pos < n:
                end = min(n, (pos // self.prefill_chunk + 1) * self.prefill_chunk)
                if charged and charged + end - pos > budget:
                    break
                charged += end - pos
                start = max(pos, seq.num_prefilled)  # the cached tokens are not computed
                if start < end and not ghost:
                    if sources:
                        start = self._copy_held(seq, start, end, sources, before)
                        before.setdefault(seq.row, start)
                    # a twin: the prompt's last chunk, computed in this forward for another
                    # prompt that ends there too (an earlier chunk copied after the forward
                    # would be read by this row's next chunk in it)
                    twin = next((c for c in computed if end == n == c[0].num_prompt_tokens
                                 and c[1] == start and c[2] == end
                                 and c[0].token_ids[:end] == prompt[:end]), None) \
                        if sources else None
                    if twin is not None:
                        twins.append((seq.row, twin[0].row, start, end))
                        finished_at = twin[3]
                    elif start < end:
                        chunks.append((seq.row, start, end - start))
                        ids.extend(prompt[start:end])
                        finished_at = len(ids) - 1
                        if sources:
                            computed.append((seq, start, end, finished_at))
                pos = end
            if pos == seq.prefill_charged:
                break  # over budget: later prompts wait for the next step
            seq.prefill_charged = pos
            if ghost:
                continue
            pos = max(pos, seq.num_prefilled)
            self.cache.ensure_capacity(pos)
            seq.num_prefilled = pos
            self.cache.seq_lens[seq.row] = pos
            if pos == n:
                done.append(seq)
                last.append(finished_at)
        if not chunks:  # only cached tokens or placeholders charged (a prompt's last token is
            # never cached, and a twin has a computed source, so nothing finished)
            return done, torch.empty(0, self.vocab_size, device=self.device)
        logits = self.backend.prefill(torch.tensor(ids, device=self.device), self.cache, chunks,
                                      last)
        for row, src, start, end in twins:
            self._copy_positions(src, row, start, end)
            self.num_prefix_reused += end - start
        return done, logits

    def _copy_held(self, seq: Sequence, start: int, end: int, sources: list[Sequence],
                   before: dict[int, int]) -> int:
        """``prefill_step``: copy into ``seq``'s row the longest run of its prompt's positions
        ``start ..`` (below ``end``, and below its last token) that another source row holds
        now (valid before this forward: ``before``); returns where computing starts."""
        cap = min(end, seq.num_prompt_tokens - 1)
        best, src = start, None
        for s in sources:
            if s.row == seq.row or s is seq:
                continue
            valid = before.get(s.row, self.cache.seq_lens[s.row])
            if valid <= best:
                continue
            n = _common_prefix(seq.token_ids, s.token_ids, min(valid, cap))
            if n > best:
                best, src = n, s.row
        if src is not None:
            self._copy_positions(src, seq.row, start, best)
            self.num_prefix_reused += best - start
        return best

    def _copy_positions(self, src: int, row: int, start: int, end: int) -> None:
        """Keys and values of positions ``start .. end - 1`` from cache row ``src`` to ``row``
        (one slice per layer)."""
        for store in (self.cache.k, self.cache.v):
            for t in store:
                t[row, :, start:end] = t[src, :, start:end]

    def query_len(self, drafts: list[list[int]]) -> int:
        """Q, the padded queries per row of a verify step feeding ``drafts``.

        Never a one-row matmul unless the forward allows it (``StepBackend.min_query_len``):
        on this CPU a [1, K] x [K, N] bfloat16 matmul with K = 1536 takes another kernel than 2+
        rows and rounds differently, which would make a lone plain-decode step disagree with a
        verify step (measured; see tests/unit/test_forward). The float32 C decode step is
        row-invariant from one token, so a batch-1 decode step there feeds one token, not two.
        """
        lone = self.backend.min_query_len if len(drafts) == 1 else 1
        return max(1 + max(len(d) for d in drafts), lone)

    def verify(self, seqs: list[Sequence], drafts: list[list[int]],
               meta: StepMetadata | None = None) -> torch.Tensor:
        """One verify step: row i feeds its last committed token then ``drafts[i]``.

        meta: the step's packed metadata (``StepMetadata.build`` with ``query_len(drafts)``),
        already on the device: the padded ids and positions are made there, without a copy.
        Built here if not given.
        Returns the fed positions' logits ``[T, vocab]`` (model dtype), in row order (row i's
        ``1 + len(drafts[i])`` from ``meta.cu_num_fed_host[i]``), as vLLM's rejection sampler
        takes them: position j of row i predicts the token after ``drafts[i][j-1]`` (j = 0:
        after the last committed token). A backend that runs the padded ``[B, Q]`` layout
        returns ``[B, Q, vocab]`` and the fed queries are picked out here (``meta.token_index``;
        a view where no query is padded); a packed step (``num_fed``) returns them as they are,
        never padded: the CPU's zeroed ``[16, 6, 49152]`` grid and its scatter cost ~3 ms of a
        ~30 ms batch-16 step, ~16 ms where one row drafts 15.
        Afterwards the rows' cache lengths count every fed token; the engine rolls back.
        """
        if meta is None:
            meta = StepMetadata.build(seqs, drafts, None, self.device, self.query_len(drafts))
        bsz, qlen = meta.num_rows, meta.query_len
        for seq in seqs:
            assert self.cache.seq_lens[seq.row] == len(seq.token_ids) - 1, \
                "cache out of step with sequence"
        self.cache.ensure_capacity(meta.max_position + 1)
        ids = torch.full((bsz * qlen,), PAD_ID, dtype=torch.int64, device=self.device)
        ids[meta.token_index] = meta.input_ids
        positions = meta.starts[:, None] + torch.arange(qlen, device=self.device)[None, :]
        # rows drafting fewer tokens than the longest: run the dense layers on real tokens only
        num_fed = (meta.cu_num_fed.diff()
                   if self.pack and bsz >= 2 and min(meta.num_fed) < qlen else None)
        logits = self.backend.step(ids.view(bsz, qlen), positions, self.cache, meta.rows,
                                   num_fed=num_fed)
        for seq, draft in zip(seqs, drafts):
            self.cache.seq_lens[seq.row] = len(seq.token_ids) + len(draft)
        if logits.dim() == 2:  # packed: the fed positions already
            return logits
        logits = logits.reshape(bsz * qlen, logits.shape[-1])
        return logits if meta.num_tokens == bsz * qlen else logits[meta.token_index]

    def clear_row(self, row: int) -> None:
        """Zero a failed row's cache (see ``KVCache.clear``) before another sequence gets it."""
        self.cache.clear(row)
        self.held[row] = []

    def rollback(self, seq: Sequence) -> None:
        """Restore the invariant after a commit: cache holds all but the last committed token."""
        self.cache.truncate(seq.row, len(seq.token_ids) - 1)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit`` (``b`` past it is
    never read)."""
    n = min(len(a), len(b), limit)
    if a[:n] == b[:n]:  # the usual case for a shared template: one C-speed compare
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
