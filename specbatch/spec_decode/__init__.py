"""Speculation by role: proposers draft, ``verify`` accepts, ``sampler`` chooses, ``stats`` counts.

Proposers are built by method name from the registry in ``specbatch.methods`` (the names
``--method`` accepts): a new proposer is its own module (the ``proposer.Proposer`` protocol)
plus one ``methods.register_method(Method(...))`` entry.
"""

from __future__ import annotations

from specbatch import methods
from specbatch.config import SpecConfig
from specbatch.methods import Builder
from specbatch.spec_decode.proposer import Proposer

__all__ = ["Builder", "make_proposer"]


def make_proposer(config: SpecConfig, draft_forward=None, num_rows: int = 1) -> Proposer:
    """The proposer for ``config.method`` (its registry entry's builder); raises ``ValueError``
    for an unknown method, or for ``draft`` without ``draft_forward`` (the draft model's
    ``LlamaForward``; its KV cache gets ``num_rows`` rows, the target's row count). ``auto``
    drafts by prompt lookup and may verify suffix drafts (and, with a draft model, the model's)
    instead, row by row (``auto.proposer``; its policy is set by ``auto.planner.plan_auto``)."""
    entry = methods.get(config.method)
    if entry is None:
        raise ValueError(f"unknown method {config.method!r}")
    return entry.build(config, draft_forward, num_rows)
