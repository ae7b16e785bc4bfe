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
    prompt_lookup: whether (some of) the method's drafts come from prompt lookup, configured by
        ``prompt_lookup_min`` / ``max`` (n-gram sizes): ``analyze`` names those sizes only
        for such a run.
    resume: ``hook(proposer, finished_records)`` run before a resumed job continues, with the
        output lines written before (suffix: re-index them), or None.
    replay_schedule: whether the drafts depend on the schedule (which answers finished before
        a step, which rows share it: suffix), so ``specbatch run`` keeps each record's schedule
        in the work file and a resume replays it (``pipeline.generate_records``): the resumed
        job's ``spec`` stats are then those of an uninterrupted run.
    memory: ``line(proposer) -> str | None``: the method's part of ``pipeline.memory_summary``
        (a draft model's weights and KV), or None.
    auto: whether ``--method auto`` may choose this method's drafts: auto then builds the
        method's proposer too (``build``, with auto's ``SpecConfig``; a method that "needs" a
        draft model only when one is given) and offers its ``candidate`` rows every step.
    candidate: ``candidate(proposer, setup) -> auto.candidate.Candidate``: how auto values
        the proposer's drafts (confidence per draft position, cost per step, acceptance pool);
        setup: an ``auto.candidate.Setup``. Required with ``auto=True``. The ``ngram`` entry's
        is auto's base (prompt lookup, drafted every step); the others are offered rows in
        registration order.
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
    prompt_lookup: bool = False
    resume: Callable[[Any, Any], None] | None = None
    replay_schedule: bool = False
    memory: Callable[[Any], str | None] | None = None
    auto: bool = False
    candidate: Callable[[Any, Any], Any] | None = None

    def draft_cap(self, k: int) -> int:
        """The engine's per-row draft cap (tokens) for ``k``."""
        return min(32, self.draft_cap_factor * k)


_METHODS: dict[str, Method] = {}


def register_method(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to the registry and return it. Raises ``ValueError`` for a name already
    registered (unless ``replace``), a name that is not one word of ``[a-z0-9_-]`` (a
    ``bench`` label is ``NAME:key=N``), an unknown ``draft_model`` use, or ``auto=True``
    without a ``candidate`` builder."""
    name = method.name
    if not name or not all(c.isalnum() or c in "_-" for c in name) or name != name.lower():
        raise ValueError(f"method name {name!r}: expected lowercase letters, digits, _ or -")
    if name in _METHODS and not replace:
        raise ValueError(f"method {name!r} is already registered")
    if method.draft_model not in DRAFT_MODEL_USES:
        raise ValueError(f"method {name!r}: draft_model {method.draft_model!r} is not one of "
                         f"{', '.join(DRAFT_MODEL_USES)}")
    if method.auto and method.candidate is None:
        raise ValueError(f"method {name!r}: auto=True needs a candidate builder (how auto "
                         "values its drafts, auto.candidate.Candidate)")
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
    """Every method auto may choose (``auto=True``), prompt lookup first: the auto policy
    chooses among them per row and step (``auto.proposer``; a method that needs a draft model
    joins only when one is given)."""
    from specbatch.auto.proposer import AutoProposer

    chosen = [m for m in _METHODS.values() if m.auto]
    chosen.sort(key=lambda m: m.name != "ngram")  # the base first, then registration order
    members = []
    for m in chosen:
        uses = m.draft_model in ("needs", "optional")
        if m.draft_model == "needs" and draft_forward is None:
            continue
        members.append((m.name, m.build(config, draft_forward if uses else None, num_rows)))
    return AutoProposer(members)


def _reindex_finished(proposer, finished_records) -> None:
    """Suffix drafts on resume: index the outputs finished before (``SuffixProposer``)."""
    from specbatch.spec_decode.suffix import finished_outputs

    proposer.add_finished(finished_outputs(finished_records))


def _auto_resume(proposer, finished_records) -> None:
    """Each of auto's members' own resume hook (suffix: re-index the finished outputs)."""
    for name, member in proposer.members:
        hook = _METHODS[name].resume
        if hook is not None:
            hook(member, finished_records)


def _draft_memory(draft) -> str:
    from specbatch.pipeline import _gib

    return f"draft weights {_gib(draft.weight_bytes)}, KV {_gib(draft.cache.nbytes)}"


def _auto_memory(proposer) -> str | None:
    """auto's members' own memory lines (the draft model's weights and KV), or None."""
    lines = [_METHODS[name].memory(member) for name, member in proposer.members
             if _METHODS[name].memory is not None]
    return "; ".join(line for line in lines if line) or None


def _lookup_candidate(proposer, setup):
    from specbatch.auto.candidate import LookupCandidate

    return LookupCandidate(proposer, setup.k_max, setup.prior_for, probe=setup.probe)


def _draft_candidate(proposer, setup):
    from specbatch.auto.candidate import DraftModelCandidate

    if setup.draft_cost is None:
        raise ValueError("auto's draft model needs its step cost (Setup.draft_cost)")
    return DraftModelCandidate(proposer, setup.draft_cost, setup.k_max)


def _suffix_candidate(proposer, setup):
    from specbatch.auto.candidate import SuffixCandidate

    return SuffixCandidate(proposer)


_SUFFIX_NOTE = ("suffix drafts depend on the records that finished before (job order), so they "
                "cannot be replayed exactly")

for _m in (
    Method("none", _none, drafts=False, draft_model="ignored"),
    Method("ngram", _ngram, drafts_by="prompt lookup drafts", whatif_self_check=True,
           prompt_lookup=True, auto=True, candidate=_lookup_candidate),
    Method("draft", _draft, draft_model="needs", memory=_draft_memory, auto=True,
           candidate=_draft_candidate),
    Method("auto", _auto, draft_model="optional", draft_cap_factor=SUFFIX_CAP_FACTOR,
           whatif_note=_SUFFIX_NOTE, resume=_auto_resume, replay_schedule=True,
           memory=_auto_memory, prompt_lookup=True),
    Method("suffix", _suffix, drafts_by="suffix lookup drafts", draft_cap_factor=SUFFIX_CAP_FACTOR,
           whatif_note=_SUFFIX_NOTE, resume=_reindex_finished, replay_schedule=True,
           auto=True, candidate=_suffix_candidate),
):
    register_method(_m)
del _m
