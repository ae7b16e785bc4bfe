"""Records -> prompts: the token ids each answer of a record is generated from.

A record's prompt is ``prompt`` (plain text, tokenised as is), ``messages`` (a chat list,
rendered with the tokenizer's chat template), ``turns`` (user turns answered in order, each
with the earlier turns and answers in context, as Spec-Bench does) or ``prompt_token_ids``
(the ids as given, vLLM's ``TokensPrompt``). No model code: ``analyze``
re-renders prompts with this module and the run's tokenizer, without importing torch.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def per_tokenizer(cache: weakref.WeakKeyDictionary, tokenizer, key, build: Callable[[], T]) -> T:
    """``build()`` once per tokenizer object and ``key`` (the last one asked for is kept), in
    ``cache`` while the tokenizer lives: what a ``generate`` call used to rebuild from the
    whole vocabulary. Built again when the tokenizer's length changes (tokens added); not kept
    for an object without a length or that takes no weak reference."""
    if not hasattr(tokenizer, "__len__"):
        return build()
    full = (len(tokenizer), key)
    try:
        known = cache.get(tokenizer)
    except TypeError:
        return build()
    if known is not None and known[0] == full:
        return known[1]
    value = build()
    cache[tokenizer] = (full, value)
    return value


class PromptRenderer:
    """Tokenises a record's prompt for each turn. ``tokenizer``: a transformers tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        # record index -> (the record, its first prompt ids, its chat so far)
        self._first: dict[int, tuple[object, list[int], list[dict] | None]] = {}

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def first_prompt(self, record) -> tuple[list[int], list[dict] | None]:
        """Prompt ids of the first (or only) answer, and the chat so far (None for ``prompt``).
        Remembered per record (by index, for that same record object): length checks, the
        planner and generation tokenise once, and a later batch reusing an index is rendered
        anew."""
        cached = self._first.get(record.index)
        if cached is None or cached[0] is not record:
            cached = self._first[record.index] = (record, *self._render_first(record))
        _, ids, messages = cached
        return ids, (list(messages) if messages is not None else None)

    def _render_first(self, record) -> tuple[list[int], list[dict] | None]:
        if record.prompt_token_ids is not None:
            return list(record.prompt_token_ids), None
        if record.prompt is not None:
            return self.tokenizer.encode(record.prompt), None
        messages = (list(record.messages) if record.messages is not None
                    else [{"role": "user", "content": record.turns[0]}])
        return self.encode_chat(messages), messages

    def count_tokens(self, record) -> int:
        return len(self.first_prompt(record)[0])

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
