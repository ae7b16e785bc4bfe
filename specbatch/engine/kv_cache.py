"""KV cache with one row per batch slot and per-row lengths.

A row holds one sequence's keys and values at positions ``0 .. capacity-1``; ``seq_lens[row]`` is
how many positions are valid. Rolling back rejected draft tokens is only ``seq_lens[row] = n``:
the entries past ``n`` are stale and get overwritten by the next forward, and the attention mask
(key position <= query position) never lets a valid query see them.

A proposer with a model of its own (a draft model) keeps a second ``KVCache`` of the same shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_BLOCK = 256  # capacity granule (positions); the batch-invariant attention reads whole blocks
# What reading one more segment costs (per layer: its own mask, matmuls and softmax launches),
# in units of one row's KV block read. Measured on the 2-core AVX2 VM (bfloat16, SmolLM2-135M):
# a segment's fixed cost ~0.1 ms per layer, a row-block (256 keys x 3 heads, keys and values)
# ~0.03 ms; see docs/benchmarks.md.
SEGMENT_COST_BLOCKS = 3


def round_capacity(n: int) -> int:
    return -(-n // KV_BLOCK) * KV_BLOCK


@dataclass(frozen=True)
class KVSegment:
    """Cache rows ``lo .. hi-1`` read as one view, keys ``0 .. kv_len-1``, no copy.

    batch_rows: for each cache row ``lo + i``, the batch row whose queries it serves, or -1 for
    a row that is idle in this forward (its outputs are computed and dropped: cheaper than
    splitting the view there).
    """

    lo: int
    hi: int
    kv_len: int
    batch_rows: tuple[int, ...]

    @property
    def first_batch_row(self) -> int | None:
        """``b`` when the segment serves batch rows ``b, b+1, ...`` in order and has no idle
        row (its queries are then a slice of the batch, no index needed); else None."""
        b = self.batch_rows[0]
        return b if self.batch_rows == tuple(range(b, b + len(self.batch_rows))) else None


def plan_segments(rows: list[int], kv_lens: list[int], block: int = KV_BLOCK,
                  segment_cost: float = SEGMENT_COST_BLOCKS) -> list[KVSegment]:
    """Split the batch's cache rows into views of consecutive rows, each read up to its longest
    row (rounded up to ``block``), minimising ``sum(rows spanned x blocks read) +
    segment_cost x number of segments`` (dynamic programming over the rows in cache order).

    rows: cache row of each batch row (distinct); kv_lens: keys each batch row must see.
    Example (segment_cost 3): rows ``[0, 1, 2, 4]`` with
    kv_lens ``[2000, 300, 300, 300]`` (blocks 8, 2, 2, 2) give ``[0, 1)`` with 2048 keys and
    ``[1, 5)`` with 512 keys, row 3 idle: (8 + 3) + (4 x 2 + 3) = 22, against 23 for also
    splitting at the idle row and 5 x 8 + 3 = 43 for one view of rows 0-4.
    """
    order = sorted(range(len(rows)), key=rows.__getitem__)
    r = [rows[b] for b in order]
    nb = [-(-kv_lens[b] // block) for b in order]
    n = len(r)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j rows (cache order)
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        top = 0
        for i in range(j - 1, -1, -1):  # segment = sorted rows i .. j-1
            top = max(top, nb[i])
            cost = best[i] + (r[j - 1] - r[i] + 1) * top + segment_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    segments = []
    j = n
    while j > 0:
        i = cut[j]
        lo, hi = r[i], r[j - 1] + 1
        serve = [-1] * (hi - lo)
        for t in range(i, j):
            serve[r[t] - lo] = order[t]
        segments.append(KVSegment(lo, hi, max(nb[i:j]) * block, tuple(serve)))
        j = i
    return segments[::-1]


class KVCache:
    """Preallocated keys and values for ``num_rows`` rows.

    Layout per layer: ``k[layer]``, ``v[layer]`` of shape
    ``[num_rows, num_kv_heads, capacity, head_dim]``, dtype and device of the model.
    Memory: ``2 * num_layers * num_rows * num_kv_heads * capacity * head_dim * itemsize`` bytes.
    """

    def __init__(self, num_layers: int, num_rows: int, num_kv_heads: int, capacity: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        capacity = round_capacity(capacity)
        shape = (num_rows, num_kv_heads, capacity, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.seq_lens = [0] * num_rows  # valid positions per row (tokens)

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def write(self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store new keys/values.

        rows: ``[B]`` int64 cache rows; positions: ``[B, Q]`` int64; k, v: ``[B, Q, Hkv, D]``.
        """
        b_idx = rows[:, None].expand_as(positions)
        self.k[layer][b_idx, :, positions] = k
        self.v[layer][b_idx, :, positions] = v

    def write_tokens(self, layer: int, rows: torch.Tensor, positions: torch.Tensor,
                     k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values of packed tokens: rows, positions ``[T]`` int64; k, v
        ``[T, Hkv, D]``."""
        self.k[layer][rows, :, positions] = k
        self.v[layer][rows, :, positions] = v

    def view(self, layer: int, segment: KVSegment) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of a segment's rows, positions ``0 .. kv_len-1``, as views into the
        cache (no copy): ``[hi - lo, Hkv, kv_len, D]`` each."""
        s = segment
        return self.k[layer][s.lo:s.hi, :, :s.kv_len], self.v[layer][s.lo:s.hi, :, :s.kv_len]

    def ensure_capacity(self, needed: int) -> None:
        """Grow (doubling) until ``needed`` positions fit; contents are kept."""
        if needed > self.capacity:
            cap = self.capacity
            while cap < needed:
                cap *= 2
            self.grow(cap)

    def grow(self, capacity: int) -> None:
        """Reallocate every layer to ``capacity`` positions, keeping the contents."""
        capacity = round_capacity(capacity)
        if capacity <= self.capacity:
            return
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                new = t.new_zeros((t.shape[0], t.shape[1], capacity, t.shape[3]))
                new[:, :, :self.capacity] = t
                store[i] = new
        self.capacity = capacity

    def truncate(self, row: int, length: int) -> None:
        """Roll a row back to ``length`` valid positions (drops rejected draft tokens)."""
        assert 0 <= length <= self.seq_lens[row], (row, length, self.seq_lens[row])
        self.seq_lens[row] = length

    def reset(self, row: int) -> None:
        self.seq_lens[row] = 0

    def clear(self, row: int) -> None:
        """Empty a row and zero its keys/values. A NaN left in a row would reach the row's next
        user: attention gives masked positions probability 0, and 0 * NaN is NaN."""
        for store in (self.k, self.v):
            for t in store:
                t[row].zero_()
        self.seq_lens[row] = 0
