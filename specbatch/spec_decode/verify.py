"""Verification: which draft tokens the target accepts.

The target's token at every fed position is chosen first, by ``sampler.sample`` (argmax at
T = 0, position-keyed Gumbel-max above), exactly as plain decoding would choose it. Then:

- draft token j is **accepted** iff it equals the target's token at j and drafts 0..j-1 were;
- at the first mismatch the target's token there is emitted: the **recovered** token;
- if all drafts match, the target's token after the last draft is emitted: the **bonus** token.

So a step emits ``num_accepted + 1`` tokens, all equal to what k = 0 decoding would produce
(Leviathan et al. 2023, arXiv 2211.17192, with one-hot drafts; see ``sampler``).
"""

from __future__ import annotations

import torch


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
        return torch.zeros(target_ids.shape[0], dtype=torch.int64)
    valid = torch.arange(k)[None, :] < num_draft[:, None]
    match = (draft_ids == target_ids[:, :k]) & valid
    return match.to(torch.int64).cumprod(dim=1).sum(dim=1)
