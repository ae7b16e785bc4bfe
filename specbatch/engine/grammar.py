"""Structured output with xgrammar: check a ``response_format`` schema, compile it for a
tokenizer, and give each sequence a ``GrammarMatcher`` whose token masks ``engine.logits``
applies at every verify position.

xgrammar (Dong et al. 2024, arXiv 2411.15100) is imported only when a record asks for
structured output: install it with ``pip install -c constraints.txt -e '.[json]'`` in the checkout.
"""

from __future__ import annotations

import json
import re
import weakref

import torch

_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency
        raise ValueError("response_format needs xgrammar: pip install -c constraints.txt -e "
                         "'.[json]' in the specbatch checkout (or pip install xgrammar)") from e
    return xgrammar


def schema_text(schema: dict | bool) -> str | None:
    """JSON text of a schema (``None`` for ``json_object``: any JSON object)."""
    if schema is True:
        return None
    return json.dumps(schema, ensure_ascii=False)  # key order is property order


def check_schema(schema: dict | bool) -> None:
    """Raise ``ValueError`` with xgrammar's reason if ``schema`` cannot be turned into a grammar
    (no tokenizer needed: records are checked before the model loads)."""
    text = schema_text(schema)
    if text is None:
        return
    xgr = _xgr()
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with its reason
        reason = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else "")
        raise ValueError(f"response_format: the JSON schema does not compile: "
                         f"{reason or type(e).__name__}") from None


class GrammarCompiler:
    """Compiles schemas for one tokenizer, once per distinct schema.

    Schemas compile with ``any_whitespace=False``: JSON on one line with ``", "`` and ``": "``
    between items (vLLM's ``disable_any_whitespace``), since small models otherwise spend their
    tokens on whitespace.

    tokenizer: a transformers tokenizer, or an ``xgrammar.TokenizerInfo`` (tests use a raw
    character vocabulary). vocab_size: the model's vocabulary (rows of lm_head), which may
    exceed the tokenizer's.
    """

    def __init__(self, tokenizer, vocab_size: int) -> None:
        xgr = _xgr()
        info = (tokenizer if isinstance(tokenizer, xgr.TokenizerInfo)
                else xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._compiled: dict[str | None, object] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int) -> GrammarCompiler:
        """The compiler of ``tokenizer`` (a transformers tokenizer) and ``vocab_size``, built
        once per process and kept while the tokenizer lives, with the schemas it compiled:
        building xgrammar's ``TokenizerInfo`` reads the whole vocabulary (~70 ms for
        SmolLM2's 49k tokens, once per ``generate`` call before)."""
        from specbatch.prompts import per_tokenizer

        return per_tokenizer(_COMPILERS, tokenizer, vocab_size,
                             lambda: cls(tokenizer, vocab_size))

    def compile(self, schema: dict | bool):
        """An ``xgrammar.CompiledGrammar`` for ``schema`` (``True``: any JSON object, OpenAI's
        ``json_object``; its properties are free, so it compiles without strict mode)."""
        text = schema_text(schema)
        if text not in self._compiled:
            self._compiled[text] = self._compiler.compile_json_schema(
                text or '{"type": "object"}', any_whitespace=False, strict_mode=text is not None)
        return self._compiled[text]


_COMPILERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def new_matcher(compiled, stop_ids: frozenset[int]):
    """A fresh ``xgrammar.GrammarMatcher``; ``stop_ids`` (the EOS ids,
    ``StopRules.grammar_stop_ids``) are the tokens allowed once the JSON is complete; without
    any, the matcher terminates at the JSON's end (ignore_eos)."""
    xgr = _xgr()
    if stop_ids:
        return xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids))
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


_BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(matcher, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` bool: the tokens ``matcher`` accepts next."""
    bitmask = _xgr().allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
    matcher.fill_next_token_bitmask(bitmask, 0)
    return unpack_bitmask(bitmask, vocab_size)[0]


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[n, W]`` int32 packed bitmask (bit ``t % 32`` of word ``t // 32``: token t allowed) ->
    ``[n, vocab_size]`` bool."""
    bits = (bitmask[:, :, None] >> _BITS) & 1  # [n, W, 32]
    return bits.flatten(1)[:, :vocab_size].bool()


def packed_tokens(ids, vocab_size: int) -> torch.Tensor:
    """``[ceil(vocab_size / 32)]`` int32 bitmask with exactly the bits of ``ids`` (< vocab_size)
    set."""
    words = [0] * ((vocab_size + 31) // 32)
    for t in ids:
        if 0 <= t < vocab_size:
            words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32)
