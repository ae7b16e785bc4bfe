"""Per-sequence state and the stop rules applied as tokens are committed.

A ``Request`` is what the engine is asked to generate (one answer: one turn of a record). A
``Sequence`` is its state while it runs: tokens, cache row, counters, and how it finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specbatch.config import SamplingParams
from specbatch.spec_decode.stats import SpecStats

_seq_ids = itertools.count()


# characters at the end of the text searched again for stop strings: a detokenizer may rewrite
# them as tokens arrive (``StopRules._check_stop_strings``)
STOP_TEXT_MARGIN = 16


@dataclass
class Request:
    """One answer to generate.

    prompt_ids: the full prompt (tokens). seed: the record seed for this answer (already
    derived per turn). max_k: cap on draft tokens per step for this request (None: the
    engine's k). tag: anything the caller wants back with the result. grammar: an
    ``xgrammar.CompiledGrammar`` the output must follow (``response_format``), or None.
    replay: set for a placeholder of an answer an interrupted run already finished (a
    ``Replay``): it holds a row from its recorded admission to its recorded finish without
    model work, so a resumed job's schedule is the interrupted one's (``Engine``).
    follow_ups: the turns of its record after this one (the engine queues the next when this
    answer finishes): while a row has one, its job is not draining (``Engine.draining``).
    """

    request_id: Any
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int = 0
    max_k: int | None = None
    tag: Any = None
    grammar: Any = None
    replay: Replay | None = None
    follow_ups: int = 0


@dataclass
class Replay:
    """Where an answer finished in an earlier run ran, from its work-file ``schedule`` entry
    (``Engine``: ``Completion.schedule``). Steps count the engine's steps from 1.

    admit: the step it took a row; verify: the first step it was in a verify step (None: it
    never was); finish: the step it finished; row: its cache row; phase: ``"admit"`` when it
    finished while rows were admitted and prefilled, ``"verify"`` when at a verify step;
    output_ids / finish_reason: its answer (the job-wide suffix index takes the output ids at
    the finish unless the reason is ``"error"``); next: the placeholder of the record's next
    turn, queued at the finish as the real one was.
    """

    admit: int
    verify: int | None
    finish: int
    row: int
    phase: str
    output_ids: list[int]
    finish_reason: str
    next: Request | None = None


@dataclass
class LogprobEntry:
    """Logprob of a committed token (from logits / T, before noise) and the top-N alternatives
    as ``[(token_id, logprob), ...]``."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Sequence:
    """Running state of one ``Request``. ``token_ids`` = prompt + output (tokens).

    Cache invariant between steps: the KV rows hold positions ``0 .. len(token_ids) - 2``;
    the last committed token is fed at the next step.
    """

    def __init__(self, request: Request, proposer_name: str, k: int,
                 num_speculative_tokens: int | None = None) -> None:
        self.seq_id = next(_seq_ids)
        self.request = request
        self.sampling = request.sampling
        self.token_ids: list[int] = list(request.prompt_ids)
        self.num_prompt_tokens = len(request.prompt_ids)
        self.k = k  # current draft cap; the planner may change it per step
        self.row: int | None = None
        self.num_prefilled = 0  # prompt tokens written to the cache so far (chunked prefill)
        # prompt tokens the prefill budget has charged so far, cached ones included (a resumed
        # job's placeholder is charged its prompt too, with nothing computed)
        self.prefill_charged = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "error"
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.text: str | None = None  # final text, set at finish
        self.stop_text_end: int | None = None  # char offset the text is cut at (stop string)
        # chars of the text of the first min_tokens output tokens: a stop string must end after
        self.stop_search_floor = 0
        self.stop_searched = 0  # chars of the text at the last stop-string search
        self.logprobs: list[LogprobEntry] = []
        self.matcher = None  # xgrammar GrammarMatcher at the committed length (engine.grammar)
        # k as the user asked (the stats' num_speculative_tokens) beside the row's cap
        self.stats = SpecStats(proposer=proposer_name, max_spec_tokens=k,
                               num_speculative_tokens=k if num_speculative_tokens is None
                               else min(k, num_speculative_tokens))
        # the schedule (engine steps): where it took a row, first verified, finished
        self.replay: Replay | None = request.replay
        self.admit_step = 0
        self.verify_step: int | None = None
        if self.replay is not None:  # a placeholder: its answer is known, nothing runs
            self.token_ids += self.replay.output_ids
            self.finish_reason = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefilled(self) -> bool:
        """The whole prompt is in the cache (and the first token has been sampled)."""
        return self.num_prefilled >= self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StopRules:
    """Everything that ends a sequence. eos_ids: the model's EOS ids (from its generation config).
    max_model_len: the context cap (tokens). detokenize: ids -> text, needed for stop strings."""

    eos_ids: frozenset[int]
    max_model_len: int
    detokenize: Callable[[list[int]], str] | None = None
    _cache: dict = field(default_factory=dict)

    def stop_ids(self, sp: SamplingParams) -> frozenset[int]:
        key = (sp.ignore_eos, sp.stop_token_ids)
        if key not in self._cache:
            ids = set(sp.stop_token_ids)
            if not sp.ignore_eos:
                ids |= self.eos_ids
            self._cache[key] = frozenset(ids)
        return self._cache[key]

    def grammar_stop_ids(self, sp: SamplingParams) -> frozenset[int]:
        """The ids a response_format grammar allows once its JSON is complete: the EOS ids,
        none with ignore_eos. ``stop_token_ids`` are ordinary tokens to the grammar (allowed
        where the JSON allows them) that stop the row where the model emits them, as in vLLM."""
        return frozenset() if sp.ignore_eos else self.eos_ids

    def commit(self, seq: Sequence, new_ids: list[int]) -> int:
        """Append ``new_ids`` to ``seq`` one at a time, as if each had been decoded alone.

        Order per token: append; EOS / stop ids (the sampler bans them before ``min_tokens``,
        so they cannot arrive early); stop strings (the
        one that completes earliest in the text wins; the text is cut before it); then the
        ``max_tokens`` cap and the context cap. Tokens after the first stop are dropped.
        Returns how many of ``new_ids`` were committed.

        ``min_tokens`` holds stop strings back as vLLM v1's detokenizer does
        (``vllm/v1/engine/detokenizer.py``, PR 22014): they are checked only once more than
        ``min_tokens`` tokens are out, and only an occurrence that ends after the text of the
        first ``min_tokens`` tokens counts (one inside that text never does; one straddling it
        does, and the text is cut where it starts).
        """
        sp = seq.sampling
        stop_ids = self.stop_ids(sp)
        for n, tok in enumerate(new_ids, start=1):
            seq.token_ids.append(tok)
            num_out = seq.num_output_tokens
            if tok in stop_ids:
                seq.finish_reason, seq.stop_reason = "stop", tok
                return n
            if sp.stop and num_out == sp.min_tokens:
                seq.stop_search_floor = len(self.detokenize(seq.output_ids))
            if sp.stop and num_out > sp.min_tokens and self._check_stop_strings(seq):
                return n
            if num_out >= sp.max_tokens or len(seq.token_ids) >= self.max_model_len:
                seq.finish_reason = "length"
                return n
        return len(new_ids)

    def _check_stop_strings(self, seq: Sequence) -> bool:
        """Search the stop strings in the output text, only where an occurrence can be new:
        ending after the text the last search covered, less ``STOP_TEXT_MARGIN`` characters
        (a detokenizer may rewrite the end of the text as tokens arrive: an incomplete UTF-8
        character shown as up to 3 U+FFFD becomes one character). A search of the whole text
        per token cost 1.3 ms a token with 1,000 stop strings at 512 tokens (issue 36); the
        window makes it independent of the output's length."""
        assert self.detokenize is not None, "stop strings need a detokenizer"
        text = self.detokenize(seq.output_ids)
        floor = max(seq.stop_search_floor, seq.stop_searched - STOP_TEXT_MARGIN)
        seq.stop_searched = len(text)
        best: tuple[int, int, str] | None = None  # (end, start, stop string)
        for s in seq.sampling.stop:
            start = text.find(s, max(0, floor - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            return False
        seq.finish_reason, seq.stop_reason = "stop", best[2]
        seq.stop_text_end = best[1]
        return True
