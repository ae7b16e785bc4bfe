"""Draft-model proposer (``--method draft --draft-model NAME``): a small model of the target's
family, sharing its tokenizer, drafts k tokens per verify step (Leviathan et al. 2023,
arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318).

The draft runs our own ``LlamaForward`` on a ``KVCache`` of its own with as many rows as the
target's; a sequence uses the same row number (``seq.row``) in both.

Drafts are deterministic, so speculation cannot change the output (the verifier decides every
token; see ``spec_decode.sampler``): at T = 0 the draft's argmax; at T > 0 the draft's own Gumbel-max
with the same position-keyed noise the target uses at that output position (record seed,
temperature, top-k and top-p of the record), so a draft that agrees with the target's
distribution draws the target's token.

Draft cache invariant (asserted in tests/unit/test_draft.py): between engine steps a row holds
the keys/values of ``seq.token_ids[:n]``, ``n <= len(token_ids) - 1``: at least one committed
token is always unseen. After a step in which the row drafted, ``n >= len(token_ids) - 2``
(after ``start``: the prompt, n = len - 1). A proposal feeds the unseen committed tokens (1, or
2 after a step that accepted every draft: the last draft was never fed, and the bonus token
follows it; more after steps in which the row got k = 0) in its first draft step, then one
draft token per step; the k-th draft is not fed. At ``on_commit`` the row is rolled back to the
committed tokens it holds: the prompt and earlier output, plus the fed drafts that were
accepted.

Memory: weights (``weight_bytes``) plus KV rows (``cache.nbytes``; per token per row
``kv_bytes_per_token``). The run summary reports both models, and ``pipeline.fit_batch_size``
counts the draft's KV rows beside the target's when it sizes the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from specbatch.spec_decode import sampler
from specbatch.spec_decode.proposer import Proposer

if TYPE_CHECKING:
    from specbatch.engine.sequence import Sequence
    from specbatch.models.llama import LlamaForward

PAD_ID = 0  # placeholder fed in padded query slots; their outputs are never read


@dataclass
class _RowState:
    """A sequence's place in the draft cache.

    fed_from: ``len(token_ids)`` when the last proposal began (committed tokens fed before it).
    fed_drafts: draft tokens whose keys/values that proposal wrote after them (all but the last).
    """

    row: int
    fed_from: int
    fed_drafts: list[int] = field(default_factory=list)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storage a model's parameters and buffers hold, each storage once (tied
    weights, and views of one fused tensor, count once; a weight released for int8,
    ``dense.release_float32``, counts its 4-byte stub). Without the kernels' own forms of the
    weights: ``LlamaForward.weight_bytes`` adds those."""
    storages = {}
    for t in (*model.parameters(), *model.buffers()):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class DraftProposer(Proposer):
    """``--method draft``. forward: the draft model's ``LlamaForward``; num_rows: the target
    cache's row count; max_model_len: the draft's context (tokens; default its config's
    ``max_position_embeddings``), rows past it get no drafts."""

    name = "draft"

    def __init__(self, forward: LlamaForward, num_rows: int, max_model_len: int | None = None,
                 prefill_chunk: int = 1024, initial_capacity: int = 512) -> None:
        self.forward = forward
        self.cache = forward.new_cache(num_rows, initial_capacity)
        self.max_model_len = max_model_len or int(forward.hf_model.config.max_position_embeddings)
        self.prefill_chunk = prefill_chunk
        self.device = forward.device
        self.states: dict[int, _RowState] = {}  # seq_id -> state

    # ---- memory ---------------------------------------------------------------------------
    @property
    def weight_bytes(self) -> int:
        return self.forward.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one cached token of one row takes (all layers, keys and values)."""
        return self.forward.kv_bytes_per_token

    # ---- proposer interface ---------------------------------------------------------------
    def start(self, seq: Sequence) -> None:
        """Prefill the prompt (every committed token but the last) into the draft cache."""
        row = seq.row
        assert row is not None
        self.cache.reset(row)
        self.states[seq.seq_id] = _RowState(row, fed_from=len(seq.token_ids))
        ids = seq.token_ids[:-1]
        if len(ids) >= self.max_model_len:
            return  # past the draft's context: this row never drafts (see propose)
        self.cache.ensure_capacity(len(ids))
        rows = torch.tensor([row], device=self.device)
        for begin in range(0, len(ids), self.prefill_chunk):
            chunk = ids[begin:begin + self.prefill_chunk]
            inp = torch.tensor([chunk], device=self.device)  # [1, chunk]
            pos = torch.arange(begin, begin + len(chunk), device=self.device)[None]  # [1, chunk]
            last = torch.tensor([[len(chunk) - 1]], device=self.device)  # [1, 1]
            self.forward.forward(inp, pos, self.cache, rows, logits_index=last)
            self.cache.seq_lens[row] = begin + len(chunk)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        """``ks[i]`` draft tokens for ``seqs[i]`` in ``max(ks)`` batched draft steps; a row leaves
        the batch when it has its ``ks[i]``. Returns one list per row (empty where k = 0)."""
        drafts: list[list[int]] = [[] for _ in seqs]
        active: list[tuple[int, int]] = []  # (index into seqs, drafts wanted)
        feeds: dict[int, list[int]] = {}  # index -> tokens to feed this draft step
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self.states[seq.seq_id]
            st.fed_from, st.fed_drafts = len(seq.token_ids), []
            k = min(k, self.max_model_len - len(seq.token_ids))
            if k > 0:
                active.append((i, k))
                feeds[i] = seq.token_ids[self.cache.seq_lens[st.row]:]
        while active:
            batch = [seqs[i] for i, _ in active]
            logits = self._step(batch, [feeds[i] for i, _ in active])  # [B', vocab]
            tokens = self._choose(batch, [len(drafts[i]) for i, _ in active], logits).tolist()
            still = []
            for (i, k), tok in zip(active, tokens):
                drafts[i].append(tok)
                if len(drafts[i]) < k:
                    still.append((i, k))
                    feeds[i] = [tok]
                    self.states[seqs[i].seq_id].fed_drafts.append(tok)
            active = still
        return drafts

    def on_commit(self, seq: Sequence, num_new_tokens: int) -> None:
        """Roll the row back to the committed tokens it holds (fed drafts that were accepted)."""
        st = self.states[seq.seq_id]
        ids = seq.token_ids
        valid = st.fed_from
        for tok in st.fed_drafts:
            if valid >= len(ids) or ids[valid] != tok:
                break
            valid += 1
        self.cache.truncate(st.row, min(self.cache.seq_lens[st.row], valid, len(ids) - 1))
        st.fed_from, st.fed_drafts = len(ids), []

    def finish(self, seq: Sequence) -> None:
        st = self.states.pop(seq.seq_id, None)
        if st is not None:
            self.cache.reset(st.row)

    # ---- helpers --------------------------------------------------------------------------
    def _step(self, seqs: list[Sequence], feeds: list[list[int]]) -> torch.Tensor:
        """One draft forward: row i feeds ``feeds[i]`` (1+ tokens) after its cached tokens.

        Returns logits ``[B, vocab]`` (float32; float64 for a float64 model) at each row's last
        fed token; the rows' cache lengths then count every fed token.
        """
        bsz = len(seqs)
        # never a one-row, one-token forward: it takes another matmul kernel (see runner.verify)
        qlen = max(max(len(f) for f in feeds), 2 if bsz == 1 else 1)
        ids = torch.full((bsz, qlen), PAD_ID, dtype=torch.int64)  # [B, Q]
        starts = torch.empty(bsz, dtype=torch.int64)  # [B]
        last = torch.empty((bsz, 1), dtype=torch.int64)  # [B, 1]
        rows = []
        for i, (seq, feed) in enumerate(zip(seqs, feeds)):
            row = self.states[seq.seq_id].row
            ids[i, :len(feed)] = torch.tensor(feed)
            starts[i] = self.cache.seq_lens[row]
            last[i, 0] = len(feed) - 1
            rows.append(row)
        positions = starts[:, None] + torch.arange(qlen)[None, :]  # [B, Q]
        self.cache.ensure_capacity(int(positions.max()) + 1)
        logits = self.forward.forward(ids.to(self.device), positions.to(self.device), self.cache,
                                      torch.tensor(rows, device=self.device),
                                      logits_index=last.to(self.device))
        for row, feed in zip(rows, feeds):
            self.cache.seq_lens[row] += len(feed)
        return logits[:, 0]

    @staticmethod
    def _choose(seqs: list[Sequence], num_drafted: list[int], logits: torch.Tensor) -> torch.Tensor:
        """Draft token per row: the target's sampling rule applied to the draft's logits, at the
        output position the draft token would take (``num_output_tokens + num_drafted``).

        logits: ``[B, vocab]``. Returns ``[B]`` int64.
        """
        sps = [s.sampling for s in seqs]
        tokens, _ = sampler.sample(
            logits.cpu(),
            torch.tensor([sp.temperature for sp in sps], dtype=torch.float64),
            torch.tensor([sp.top_k for sp in sps], dtype=torch.int64),
            torch.tensor([sp.top_p for sp in sps], dtype=torch.float64),
            torch.tensor([s.request.seed for s in seqs], dtype=torch.int64),
            torch.tensor([s.num_output_tokens + j for s, j in zip(seqs, num_drafted)],
                         dtype=torch.int64))
        return tokens


def check_same_vocab(target_tokenizer: Any, draft_tokenizer: Any, target_name: str = "target",
                     draft_name: str = "draft") -> None:
    """Refuse a draft model whose tokenizer maps any token to another id than the target's.

    Compares the full ``get_vocab()`` dicts (added and special tokens included). Raises
    ``ValueError`` naming both models, the vocabulary sizes and a few differing tokens.
    """
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    differ = sorted((tok for tok in target_vocab.keys() | draft_vocab.keys()
                     if target_vocab.get(tok) != draft_vocab.get(tok)),
                    key=lambda tok: (min(target_vocab.get(tok, 1 << 62),
                                         draft_vocab.get(tok, 1 << 62)), tok))
    examples = ", ".join(f"{tok!r}: {target_vocab.get(tok)} vs {draft_vocab.get(tok)}"
                         for tok in differ[:3])
    raise ValueError(f"draft model {draft_name!r} does not share the vocabulary of target "
                     f"{target_name!r} ({len(target_vocab)} vs {len(draft_vocab)} tokens; "
                     f"{len(differ)} tokens have different ids, e.g. {examples}); a draft model "
                     f"must use the target's tokenizer")


def load_draft_model(name: str, target: Any, dtype: str, device: str = "cpu",
                     cache_dir: str | None = None) -> Any:
    """Load ``--draft-model`` like ``--model`` (same dtype and device) and check it against the
    loaded target (a ``LoadedModel``). Raises ``ValueError`` if it cannot be found or loaded, or
    its vocabulary differs from the target's."""
    from specbatch.models.loader import load_model

    draft = load_model(name, dtype=dtype, device=device, cache_dir=cache_dir)
    check_same_vocab(target.tokenizer, draft.tokenizer, target.source.name, draft.source.name)
    return draft
