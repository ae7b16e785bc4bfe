"""The method registry: one ``Method`` entry per ``--method`` name, read by every place that
needs to know a method (``SpecConfig`` validation, ``--method``'s choices, ``bench --configs``,
the proposer factory ``spec_decode.make_proposer``, run's resume, ``analyze --what-if``,
``pipeline.memory_summary``). Adding a method = its proposer module plus one
``register_method(Method(...))`` call; nothing else names it.

This module imports nothing heavy (``config`` reads it while validating): builders and hooks
import their proposer modules when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# builder(config, draft_forward, num_rows) -> Proposer; config: a ``SpecConfig``;
# draft_forward: the draft model's ``LlamaForward`` or None (given only to methods whose
# ``draft_model`` is "needs" or "optional", when a draft model is loaded); num_rows: the target's
# KV row count (the draft cache's rows)
Builder = Callable[[Any, Any, int], Any]

DRAFT_MODEL_USES = ("needs", "optional", "refused", "ignored")
SUFFIX_CAP_FACTOR = 3  # suffix drafts may reach this many times k where a match is long
BENCH_KEYS = {"k": "num_speculative_tokens", "min": "prompt_lookup_min",
              "max": "prompt_lookup_max"}


@dataclass(frozen=True)
class Method:
    """One speculative decoding method.

    name: the ``--method`` value, the ``SpecConfig.method`` and the name ``bench --configs``
        labels start with; the method's proposer reports it as ``Proposer.name``.
    build: ``builder(config, draft_forward, num_rows) -> Proposer`` (see ``Builder``).
    drafts: False for a method that never drafts (``none``: k = 0, and the baseline ``bench``
        takes ratios to); True requires k >= 1.
    draft_model: what the method does with ``--draft-model``: "needs" (refused without one),
        "optional" (drafts with it when given; ``bench`` label ``NAME:draft``), "refused" (it
        would go unused) or "ignored" (``none``: a baseline may share the draft run's flags).
    drafts_by: a few words on what drafts without a model, for the refusal of a draft model.
    draft_cap_factor: the engine's per-row draft cap is ``min(32, factor * k)`` (tokens);
        more than 1 where a long match may draft past k (suffix).
    validate: extra checks of a ``SpecConfig`` of this method; raises ``config.ConfigError``.
    bench_keys: ``bench --configs`` keys -> ``SpecConfig`` fields (integer values).
    whatif_self_check: ``analyze --what-if`` replays n-gram settings over any greedy run's
        output tokens; True where this method's own stats equal the n-gram replay at its own
        (k, min, max), so the replay checks them (ngram).
    whatif_note: why the method's own drafts cannot be replayed (shown as a note), or None.
    resume: ``hook(proposer, finished_records)`` run before a resumed job continues, with the
        output lines written before (suffix: re-index them), or None.
    replay_schedule: whether the drafts depend on the schedule (which answers finished before
        a step, which rows share it: suffix), so ``specbatch run`` keeps each record's schedule
        in the work file and a resume replays it (``pipeline.generate_records``): the resumed
        job's ``spec`` stats are then those of an uninterrupted run.
    memory: ``line(proposer) -> str | None``: the method's part of ``pipeline.memory_summary``
        (a draft model's weights and KV), or None.
    auto: whether ``--method auto`` may choose this method's drafts. Auto knows ngram, suffix
        and draft only (``spec_decode.composite``, ``plan.policy``); ``register_method`` refuses
        True for any other method until auto chooses through a candidate protocol.
    """

    name: str
    build: Builder
    drafts: bool = True
    draft_model: str = "refused"
    drafts_by: str = ""
    draft_cap_factor: int = 1
    validate: Callable[[Any], None] | None = None
    bench_keys: dict[str, str] = field(default_factory=lambda: dict(BENCH_KEYS))
    whatif_self_check: bool = False
    whatif_note: str | None = None
    resume: Callable[[Any, Any], None] | None = None
    replay_schedule: bool = False
    memory: Callable[[Any], str | None] | None = None
    auto: bool = False

    def draft_cap(self, k: int) -> int:
        """The engine's per-row draft cap (tokens) for ``k``."""
        return min(32, self.draft_cap_factor * k)


_METHODS: dict[str, Method] = {}
AUTO_CANDIDATES = frozenset({"ngram", "suffix", "draft"})  # what auto's policy can choose


def register_method(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to the registry and return it. Raises ``ValueError`` for a name already
    registered (unless ``replace``), a name that is not one word of ``[a-z0-9_-]`` (a
    ``bench`` label is ``NAME:key=N``), an unknown ``draft_model`` use, or ``auto=True`` for a
    method auto's policy does not know."""
    name = method.name
    if not name or not all(c.isalnum() or c in "_-" for c in name) or name != name.lower():
        raise ValueError(f"method name {name!r}: expected lowercase letters, digits, _ or -")
    if name in _METHODS and not replace:
        raise ValueError(f"method {name!r} is already registered")
    if method.draft_model not in DRAFT_MODEL_USES:
        raise ValueError(f"method {name!r}: draft_model {method.draft_model!r} is not one of "
                         f"{', '.join(DRAFT_MODEL_USES)}")
    if method.auto and name not in AUTO_CANDIDATES:
        raise ValueError(f"method {name!r}: auto chooses only among "
                         f"{', '.join(sorted(AUTO_CANDIDATES))} (auto=False)")
    _METHODS[name] = method
    return method


def unregister_method(name: str) -> None:
    """Remove a registered method (tests); a name not registered is ignored."""
    _METHODS.pop(name, None)


def get(name: str) -> Method | None:
    """The entry named ``name``, or None."""
    return _METHODS.get(name)


def names() -> tuple[str, ...]:
    """Every registered method name, in registration order."""
    return tuple(_METHODS)


def uses_draft_model(name: str) -> bool:
    """Whether method ``name`` drafts with ``--draft-model`` when one is given."""
    m = _METHODS.get(name)
    return m is not None and m.draft_model in ("needs", "optional")


# ---- the built-in methods -----------------------------------------------------------------

def _none(config, draft_forward, num_rows: int):
    from specbatch.spec_decode.proposer import NoProposer

    return NoProposer()


def _ngram(config, draft_forward, num_rows: int):
    from specbatch.spec_decode.ngram import NgramProposer

    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


def _suffix(config, draft_forward, num_rows: int):
    """SuffixDecoding's drafts; steps of many rows cut at k (``suffix.SuffixProposer``), except
    under ``auto``, whose policy cuts them by the measured step cost."""
    from specbatch.spec_decode.suffix import SuffixIndex, SuffixProposer

    return SuffixProposer(SuffixIndex(config.suffix_max_tokens),
                          many_rows_cap=None if config.method == "auto" else config.k)


def _draft(config, draft_forward, num_rows: int):
    if draft_forward is None:
        raise ValueError("method 'draft' needs a draft model (--draft-model NAME)")
    from specbatch.spec_decode.draft import DraftProposer

    return DraftProposer(draft_forward, num_rows)


def _auto(config, draft_forward, num_rows: int):
    """Prompt lookup, plus the draft model when there is one, plus suffix drafts: the auto
    policy chooses per row and step (``spec_decode.composite``)."""
    from specbatch.spec_decode.composite import LookupAndDraftProposer, WithSuffix

    inner = _ngram(config, None, num_rows)
    if draft_forward is not None:
        inner = LookupAndDraftProposer(inner, _draft(config, draft_forward, num_rows))
    return WithSuffix(inner, _suffix(config, None, num_rows))


def _reindex_finished(proposer, finished_records) -> None:
    """Suffix drafts on resume: index the outputs finished before (``SuffixProposer`` or
    auto's ``Router`` over ``WithSuffix``)."""
    from specbatch.spec_decode.suffix import finished_outputs

    proposer.add_finished(finished_outputs(finished_records))


def _draft_memory(draft) -> str:
    from specbatch.pipeline import _gib

    return f"draft weights {_gib(draft.weight_bytes)}, KV {_gib(draft.cache.nbytes)}"


def _auto_memory(proposer) -> str | None:
    """The draft model's part under auto: ``Router`` -> ``WithSuffix`` -> lookup (and draft
    model: ``LookupAndDraftProposer``)."""
    from specbatch.spec_decode.composite import LookupAndDraftProposer, WithSuffix
    from specbatch.spec_decode.router import Router

    p = proposer.candidates if isinstance(proposer, Router) else proposer
    inner = p.inner if isinstance(p, WithSuffix) else p
    return _draft_memory(inner.model) if isinstance(inner, LookupAndDraftProposer) else None


_SUFFIX_NOTE = ("suffix drafts depend on the records that finished before (job order), so they "
                "cannot be replayed exactly")

for _m in (
    Method("none", _none, drafts=False, draft_model="ignored"),
    Method("ngram", _ngram, drafts_by="prompt lookup drafts", whatif_self_check=True,
           auto=True),
    Method("draft", _draft, draft_model="needs", memory=_draft_memory, auto=True),
    Method("auto", _auto, draft_model="optional", draft_cap_factor=SUFFIX_CAP_FACTOR,
           whatif_note=_SUFFIX_NOTE, resume=_reindex_finished, memory=_auto_memory),
    Method("suffix", _suffix, drafts_by="suffix lookup drafts", draft_cap_factor=SUFFIX_CAP_FACTOR,
           whatif_note=_SUFFIX_NOTE, resume=_reindex_finished, replay_schedule=True,
           auto=True),
):
    register_method(_m)
del _m
