"""Speculation by role: proposers draft, ``verify`` accepts, ``sampler`` chooses, ``stats`` counts.

Proposers are registered by method name in ``PROPOSERS`` (the names ``config.METHODS`` and
``--method`` accept; a test checks the two agree): a new proposer is its own module (the
``proposer.Proposer`` protocol) plus one builder here.
"""

from __future__ import annotations

from collections.abc import Callable

from specbatch.config import SpecConfig
from specbatch.spec_decode.ngram import NgramProposer
from specbatch.spec_decode.proposer import NoProposer, Proposer

# builder(config, draft_forward, num_rows) -> Proposer; draft_forward: the draft model's
# ``LlamaForward`` or None; num_rows: the target's KV row count (the draft cache's rows)
Builder = Callable[[SpecConfig, object, int], Proposer]


def _none(config: SpecConfig, draft_forward, num_rows: int) -> Proposer:
    return NoProposer()


def _ngram(config: SpecConfig, draft_forward, num_rows: int) -> Proposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _suffix(config: SpecConfig, draft_forward, num_rows: int) -> Proposer:
    """SuffixDecoding's drafts; steps of many rows cut at k (``suffix.SuffixProposer``), except
    under ``auto``, whose policy cuts them by the measured step cost."""
    from specbatch.spec_decode.suffix import SuffixIndex, SuffixProposer

    return SuffixProposer(SuffixIndex(config.suffix_max_tokens),
                          many_rows_cap=None if config.method == "auto" else config.k)


def _draft(config: SpecConfig, draft_forward, num_rows: int) -> Proposer:
    if draft_forward is None:
        raise ValueError("method 'draft' needs a draft model (--draft-model NAME)")
    from specbatch.spec_decode.draft import DraftProposer

    return DraftProposer(draft_forward, num_rows)


def _auto(config: SpecConfig, draft_forward, num_rows: int) -> Proposer:
    """Prompt lookup, plus the draft model when there is one, plus suffix drafts: the auto
    policy chooses per row and step (``spec_decode.composite``)."""
    from specbatch.spec_decode.composite import LookupAndDraftProposer, WithSuffix

    inner = _ngram(config, None, num_rows)
    if draft_forward is not None:
        inner = LookupAndDraftProposer(inner, _draft(config, draft_forward, num_rows))
    return WithSuffix(inner, _suffix(config, None, num_rows))


PROPOSERS: dict[str, Builder] = {"none": _none, "ngram": _ngram, "suffix": _suffix,
                                 "draft": _draft, "auto": _auto}


def make_proposer(config: SpecConfig, draft_forward=None, num_rows: int = 1) -> Proposer:
    """The proposer for ``config.method``; raises ``ValueError`` for an unknown method, or for
    ``draft`` without ``draft_forward`` (the draft model's ``LlamaForward``; its KV cache gets
    ``num_rows`` rows, the target's row count). ``auto`` drafts by prompt lookup and may verify
    suffix drafts (and, with a draft model, the model's) instead, row by row
    (``spec_decode.composite``)."""
    build = PROPOSERS.get(config.method)
    if build is None:
        raise ValueError(f"unknown method {config.method!r}")
    return build(config, draft_forward, num_rows)
