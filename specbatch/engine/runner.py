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
    """Owns the model forward and its KV cache (``num_rows`` rows).

    The cache starts small and doubles as longer sequences arrive, up to
    ``max_model_len + max_query`` positions (padding slots of a verify step may reach past a
    row's last real position).
    """

    def __init__(self, forward: LlamaForward, num_rows: int, max_model_len: int,
                 prefill_chunk: int = 1024, initial_capacity: int = 512,
                 pack: bool = True) -> None:
        self.forward = forward
        self.pack = pack  # verify: dense layers on real tokens only (LlamaForward num_fed)
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.cache: KVCache = forward.new_cache(num_rows, initial_capacity)
        self.device = forward.device

    @property
    def vocab_size(self) -> int:
        return self.forward.vocab_size

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Write each sequence's tokens into its cache row, in chunks of ``prefill_chunk``.

        Returns logits ``[len(seqs), vocab]`` (model dtype) at each sequence's last token.
        """
        out = []
        for seq in seqs:
            ids = seq.token_ids
            self.cache.ensure_capacity(len(ids))
            rows = torch.tensor([seq.row], device=self.device)
            logits = None
            for start in range(0, len(ids), self.prefill_chunk):
                chunk = ids[start:start + self.prefill_chunk]
                inp = torch.tensor([chunk], device=self.device)
                pos = torch.arange(start, start + len(chunk), device=self.device)[None]
                last = torch.tensor([[len(chunk) - 1]], device=self.device)
                logits = self.forward.forward(inp, pos, self.cache, rows, logits_index=last)
            self.cache.seq_lens[seq.row] = len(ids)
            out.append(logits[0, 0])
        return torch.stack(out)

    def query_len(self, drafts: list[list[int]]) -> int:
        """Q, the padded queries per row of a verify step feeding ``drafts``.

        Never a one-row matmul: on this CPU a [1, K] x [K, N] bfloat16 matmul with K = 1536
        takes another kernel than 2+ rows and rounds differently, which would make a lone
        plain-decode step disagree with a verify step (measured; see tests/unit/test_forward).
        """
        return max(1 + max(len(d) for d in drafts), 2 if len(drafts) == 1 else 1)

    def verify(self, seqs: list[Sequence], drafts: list[list[int]],
               meta: StepMetadata | None = None) -> torch.Tensor:
        """One verify step: row i feeds its last committed token then ``drafts[i]``.

        meta: the step's packed metadata (``StepMetadata.build`` with ``query_len(drafts)``),
        already on the device: the padded ids and positions are made there, without a copy.
        Built here if not given.
        Returns logits ``[B, Q, vocab]`` (model dtype), Q = ``meta.query_len``; query j of row
        i predicts the token after ``drafts[i][j-1]`` (j = 0: after the last committed token).
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
        logits = self.forward.forward(ids.view(bsz, qlen), positions, self.cache, meta.rows,
                                      num_fed=num_fed)
        for seq, draft in zip(seqs, drafts):
            self.cache.seq_lens[seq.row] = len(seq.token_ids) + len(draft)
        return logits

    def clear_row(self, row: int) -> None:
        """Zero a failed row's cache (see ``KVCache.clear``) before another sequence gets it."""
        self.cache.clear(row)

    def rollback(self, seq: Sequence) -> None:
        """Restore the invariant after a commit: cache holds all but the last committed token."""
        self.cache.truncate(seq.row, len(seq.token_ids) - 1)
