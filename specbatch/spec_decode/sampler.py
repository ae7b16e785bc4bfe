"""Position-keyed sampling: the token at output position t depends only on the target's logits
there, the sampling parameters and the record seed, never on how the position was reached.

    token_t = argmax_v( logits_t[v] / T + g(seed, t, v) )        (T > 0)
    token_t = argmax_v( logits_t[v] )                           (T = 0, lowest id wins ties)

``g`` is standard Gumbel noise made from a counter-based hash of (seed, t, v): a pure function,
no RNG state, so a position decoded alone and the same position verified inside a draft get the
same noise. By the Gumbel-max trick the token is an exact sample of softmax(logits / T) (after
top-k / top-p masking). A draft token is accepted iff it equals this token; the first mismatch
emits this token (the recovered token). For deterministic drafts this accepts with probability
p(draft), as the rejection rule of Leviathan et al. 2023 (arXiv 2211.17192) does, and the output
is independent of the drafter (Daliri, Musco, Suresh 2024, arXiv 2408.07978).

The hash is ``lowbias32`` (Chris Wellons, "Prospecting for Hash Functions", 2018,
github.com/skeeto/hash-prospector), on 32-bit words. All integer steps are exact in int64
(products are split so nothing overflows) and map one-to-one onto uint32 arithmetic in a GPU
kernel; only the final ``-log(-log(u))`` is floating point (float64 here).
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32), without int64 overflow."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _M32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor holding uint32 values; returns uint32 values in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def position_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """32-bit key per (seed, position). seeds: ``[N]`` int64 (any 63-bit value); positions: ``[N]``
    int64 output positions (tokens, 0-based). Returns ``[N]`` int64 in [0, 2**32)."""
    seed_lo = seeds & _M32
    seed_hi = (seeds >> 32) & _M32
    key = mix32((positions & _M32) ^ _GOLDEN)
    key = mix32(key ^ seed_hi)
    return mix32((key + seed_lo) & _M32)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise ``[N, vocab_size]`` float64 for each (seed, position) row.

    u = (top 24 bits of mix32(key ^ mix32(v)) + 0.5) / 2**24 lies in (0, 1); g = -log(-log(u)).
    """
    vocab_hash = mix32(torch.arange(vocab_size, dtype=torch.int64, device=seeds.device))
    h = mix32(position_keys(seeds, positions)[:, None] ^ vocab_hash[None, :])
    u = ((h >> 8).double() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(-torch.log(u))


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from ints/strings (run seed, record id, turn index): stable across runs,
    machines and Python hash randomisation."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(repr(p).encode())
        h.update(b"\x00")
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


def argmax_lowest(scores: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim; ties go to the lowest index (torch documents first-max). The one
    tie rule used on the speculative and the plain path alike."""
    return torch.argmax(scores, dim=-1)


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                     top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside the kept set to -inf.

    logits: ``[N, V]`` float (already divided by temperature); top_k: ``[N]`` int64 (0 = off);
    top_p: ``[N]`` float (1 = off). The most likely token is always kept; ties in sort order
    go to the lower id (stable sort), so the kept set is deterministic.
    """
    if bool((top_k == 0).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k_eff = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= k_eff[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # probability mass of strictly better ranks
    drop |= (mass_before >= top_p[:, None]) & (rank > 0)
    masked_sorted = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, masked_sorted)


def mask_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set logits whose probability is below ``min_p`` times the top token's to -inf.

    logits: ``[N, V]`` float (already divided by temperature); min_p: ``[N]`` float (0 = off).
    As vLLM's ``MinPLogitsProcessor`` (Nguyen et al. 2024, arXiv 2407.01082): applied before
    top-k / top-p, and the most likely token is always kept.
    """
    probs = torch.softmax(logits, dim=-1)  # min_p = 0 rows: threshold 0, nothing dropped
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           banned: torch.Tensor | None = None, min_p: torch.Tensor | None = None,
           want_scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Choose the token at each of N positions.

    logits: ``[N, V]`` float32/float64 target logits (penalties, bias and grammar masks already
    applied, ``engine.logits``); temperature, top_p: ``[N]`` float;
    top_k: ``[N]`` int64; seeds, positions: ``[N]`` int64 (record seed, output position);
    banned: optional ``[N, V]`` bool, tokens that may not be chosen here (EOS before min_tokens);
    min_p: optional ``[N]`` float (``mask_min_p``; greedy rows ignore it, their argmax is kept).
    Returns (token ids ``[N]`` int64, scaled logits ``[N, V]`` float64: logits / T, or logits at
    T = 0, with bans applied, before top-k/p and noise; the logprob source; None unless
    ``want_scaled``).
    """
    is_greedy = temperature == 0
    all_greedy = bool(is_greedy.all())
    if all_greedy and banned is None:
        # the argmax of the logits as they are (widening to float64 and dividing by 1 keep
        # every value, so the order and the ties), without the [N, V] copies
        return argmax_lowest(logits), logits.double() if want_scaled else None
    logits = logits.double()
    if banned is not None:
        logits = logits.masked_fill(banned, float("-inf"))
    scaled = logits / torch.where(is_greedy, torch.ones_like(temperature), temperature)[:, None]
    if all_greedy:
        return argmax_lowest(scaled), scaled
    scores = scaled if min_p is None else mask_min_p(scaled, min_p)
    scores = mask_top_k_top_p(scores, top_k, top_p)
    random_rows = ~is_greedy
    noise = gumbel_noise(seeds[random_rows], positions[random_rows], logits.shape[-1])
    scores = scores.clone()
    scores[random_rows] += noise
    return argmax_lowest(scores), scaled


def count_accepted(target_ids: torch.Tensor, draft_ids: torch.Tensor,
                   num_draft: torch.Tensor) -> torch.Tensor:
    """Accepted draft tokens per row.

    target_ids: ``[B, Q]`` int64, the target's token at each fed position (Q >= K + 1).
    draft_ids: ``[B, K]`` int64, right-padded with any id. num_draft: ``[B]`` int64.
    Returns ``[B]`` int64 in ``[0, num_draft]``.

    Example: target [5, 7, 9, 2], draft [5, 7, 1], num_draft 3 -> 2 accepted; emitted 5, 7 and
    the recovered token 9.
    """
    k = draft_ids.shape[1]
    if k == 0:
        return torch.zeros(target_ids.shape[0], dtype=torch.int64, device=target_ids.device)
    valid = torch.arange(k, device=draft_ids.device)[None, :] < num_draft[:, None]
    match = (draft_ids == target_ids[:, :k]) & valid
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)
