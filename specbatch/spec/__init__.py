"""Speculation by role: proposers draft, ``verify`` accepts, ``sampler`` chooses, ``stats`` counts."""

from __future__ import annotations

from specbatch.config import SpecConfig
from specbatch.spec.ngram import NgramProposer
from specbatch.spec.proposer import NoProposer, Proposer


def make_proposer(config: SpecConfig) -> Proposer:
    """The proposer for ``config.method``; raises ``ValueError`` for an unknown method."""
    if config.method == "none":
        return NoProposer()
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"unknown method {config.method!r}")
