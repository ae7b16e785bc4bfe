"""Speculation by role: proposers draft, ``verify`` accepts, ``sampler`` chooses, ``stats`` counts."""

from __future__ import annotations

from specbatch.config import SpecConfig
from specbatch.spec_decode.ngram import NgramProposer
from specbatch.spec_decode.proposer import NoProposer, Proposer


def make_proposer(config: SpecConfig, draft_forward=None, num_rows: int = 1) -> Proposer:
    """The proposer for ``config.method``; raises ``ValueError`` for an unknown method, or for
    ``draft`` without ``draft_forward`` (the draft model's ``LlamaForward``; its KV cache gets
    ``num_rows`` rows, the target's row count). ``auto`` drafts by prompt lookup and may verify
    suffix drafts (and, with a draft model, the model's) instead, row by row
    (``spec_decode.composite``)."""
    if config.method == "none":
        return NoProposer()
    lookup = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "ngram":
        return lookup
    if config.method == "auto":  # lookup, the draft model or suffix drafts, chosen per row
        from specbatch.spec_decode.composite import LookupAndDraftProposer, WithSuffix
        from specbatch.spec_decode.suffix import SuffixIndex, SuffixProposer

        inner = lookup
        if draft_forward is not None:
            from specbatch.spec_decode.draft import DraftProposer

            inner = LookupAndDraftProposer(lookup, DraftProposer(draft_forward, num_rows))
        return WithSuffix(inner, SuffixProposer(SuffixIndex(config.suffix_max_tokens)))
    if config.method == "suffix":
        from specbatch.spec_decode.suffix import SuffixIndex, SuffixProposer

        return SuffixProposer(SuffixIndex(config.suffix_max_tokens))
    if config.method == "draft":
        if draft_forward is None:
            raise ValueError("method 'draft' needs a draft model (--draft-model NAME)")
        from specbatch.spec_decode.draft import DraftProposer

        return DraftProposer(draft_forward, num_rows)
    raise ValueError(f"unknown method {config.method!r}")
