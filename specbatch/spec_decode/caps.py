"""How many draft tokens a verify step may carry: the one cap shared by the engine and replay."""

from __future__ import annotations


def draft_cap(k: int, max_tokens: int, num_output_tokens: int, max_model_len: int,
              num_tokens: int) -> int:
    """Draft length for one row's next verify step: ``k``, capped so the step (which emits at
    most draft + 1 tokens) cannot pass ``max_tokens`` or the context.

    k: the row's draft cap (tokens). max_tokens: the record's completion cap (tokens).
    num_output_tokens: completion tokens committed so far. max_model_len: context cap (tokens).
    num_tokens: prompt + completion tokens committed so far.

    Example: k = 5, max_tokens = 10 with 7 tokens out -> 2 drafts (the step emits at most 3).
    """
    return max(0, min(k, max_tokens - num_output_tokens - 1, max_model_len - num_tokens - 1))
