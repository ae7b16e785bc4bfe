"""Speculation by role: proposers draft, ``verify`` accepts, ``sampler`` chooses, ``stats`` counts."""

from __future__ import annotations

from specbatch.config import SpecConfig
from specbatch.spec_decode.ngram import NgramProposer
from specbatch.spec_decode.proposer import NoProposer, Proposer


def make_proposer(config: SpecConfig, draft_forward=None, num_rows: int = 1) -> Proposer:
    """The proposer for ``config.method``; raises ``ValueError`` for an unknown method, or for
    ``draft`` without ``draft_forward`` (the draft model's ``LlamaForward``; its KV cache gets
    ``num_rows`` rows, the target's row count). ``auto`` with a draft model may draft with
    either, row by row (``spec_decode.composite``)."""
    if config.method == "none":
        return NoProposer()
    if config.method == "auto" and draft_forward is not None:  # lookup or the model, per row
        from specbatch.spec_decode.composite import LookupAndDraftProposer
        from specbatch.spec_decode.draft import DraftProposer

        return LookupAndDraftProposer(
            NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max),
            DraftProposer(draft_forward, num_rows))
    if config.method in ("ngram", "auto"):  # auto: lookup drafts, length chosen per step
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from specbatch.spec_decode.suffix import SuffixIndex, SuffixProposer

        return SuffixProposer(SuffixIndex(config.suffix_max_tokens))
    if config.method == "draft":
        if draft_forward is None:
            raise ValueError("method 'draft' needs a draft model (--draft-model NAME)")
        from specbatch.spec_decode.draft import DraftProposer

        return DraftProposer(draft_forward, num_rows)
    raise ValueError(f"unknown method {config.method!r}")
