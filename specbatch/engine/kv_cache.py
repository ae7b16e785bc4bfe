"""KV cache with one row per batch slot and per-row lengths.

A row holds one sequence's keys and values at positions ``0 .. capacity-1``; ``seq_lens[row]`` is
how many positions are valid. Rolling back rejected draft tokens is only ``seq_lens[row] = n``:
the entries past ``n`` are stale and get overwritten by the next forward, and the attention mask
(key position <= query position) never lets a valid query see them.

A proposer with a model of its own (a draft model) keeps a second ``KVCache`` of the same shape.
"""

from __future__ import annotations

import torch

KV_BLOCK = 256  # capacity granule (positions); the batch-invariant attention reads whole blocks


def round_capacity(n: int) -> int:
    return -(-n // KV_BLOCK) * KV_BLOCK


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

    def read(self, layer: int, rows: torch.Tensor, length: int,
             rows_are_all: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of ``rows`` for positions ``0 .. length-1``: ``[B, Hkv, length, D]`` each."""
        if rows_are_all:
            return self.k[layer][:, :, :length], self.v[layer][:, :, :length]
        return self.k[layer][rows, :, :length], self.v[layer][rows, :, :length]

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
