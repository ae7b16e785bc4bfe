"""Frozen configuration dataclasses: sampling parameters, speculation and engine settings.

Every value a user can set is checked in ``__post_init__``; a wrong value raises ``ValueError``
naming the field and the value. Derived values are properties.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

METHODS = ("none", "ngram", "draft", "auto")
DTYPES = ("float32", "bfloat16", "float64", "float16")
# The integers a JSON file holds exactly (orjson reads and writes -2**63 .. 2**64 - 1; it reads
# a longer integer as a float): the range of a seed, which the output's config saves.
MIN_INT, MAX_INT = -2**63, 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one record's tokens are chosen and when its generation stops.

    temperature: 0 means greedy (argmax, lowest token id wins ties); > 0 means position-keyed
        Gumbel-max sampling (see ``specbatch.spec_decode.sampler``).
    top_p: nucleus mass kept, in (0, 1]; 1 keeps everything.
    top_k: number of most likely tokens kept; 0 keeps everything.
    seed: the record seed, an integer in [MIN_INT, MAX_INT]; ``None`` lets the run derive it
        from ``--seed`` and the record id.
    max_tokens: cap on completion tokens (tokens) per generated answer.
    min_tokens: EOS and stop ids are ignored before this many completion tokens.
    stop: stop strings; the output ends before the one that completes earliest in the text.
    stop_token_ids: token ids that end the output like EOS (kept in ``token_ids``).
    ignore_eos: keep generating past EOS (to ``max_tokens``).
    logprobs: ``None`` for none; N >= 0 for the chosen token's logprob plus the top-N.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 128
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
               and 0.0 <= self.temperature < float("inf"),
               "temperature", self.temperature, "a number >= 0")
        _check(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
               and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 = off)")
        _check(self.seed is None or (_is_int(self.seed) and MIN_INT <= self.seed <= MAX_INT),
               "seed", self.seed, "an integer that fits in 64 bits")
        _check(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "an integer >= 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               "min_tokens", self.min_tokens, "an integer in [0, max_tokens]")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a list of non-empty strings")
        _check(isinstance(self.stop_token_ids, tuple)
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "true or false")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "an integer in [0, 20]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict, base: SamplingParams | None = None) -> SamplingParams:
        """Build from a record's or recipe's fields, overriding ``base``; unknown keys are ignored.

        Lists are accepted for ``stop`` and ``stop_token_ids``; a single string for ``stop``.
        Raises ``ValueError`` naming the field on a bad value.
        """
        base = base or cls()
        updates = {}
        for f in fields(cls):
            if f.name not in values:
                continue
            v = values[f.name]
            if f.name == "stop":
                v = (v,) if isinstance(v, str) else tuple(v) if isinstance(v, list) else v
            elif f.name == "stop_token_ids":
                v = tuple(v) if isinstance(v, list) else v
            elif f.name in ("temperature", "top_p") and _is_int(v):
                v = float(v)
            updates[f.name] = v
        return replace(base, **updates)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))


@dataclass(frozen=True)
class SpecConfig:
    """Which proposer drafts tokens and how many.

    method: ``none`` (plain decoding, k = 0), ``ngram`` (prompt lookup) or ``draft`` (a draft
        model, ``draft_model``).
    num_speculative_tokens: k, draft tokens per verify step (the cap when k varies per row).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes (tokens) the lookup tries, longest first.
    draft_model: the draft model (registry name, .gguf or HF folder); required for ``draft``.
    """

    method: str = "none"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None

    def __post_init__(self) -> None:
        _check(self.method in METHODS, "method", self.method, f"one of {', '.join(METHODS)}")
        _check(self.draft_model is None or (isinstance(self.draft_model, str)
                                            and self.draft_model != ""),
               "draft_model", self.draft_model, "a model name or path")
        _check(self.method != "draft" or self.draft_model is not None, "draft_model",
               self.draft_model, "a draft model (--draft-model NAME) for method draft")
        _check(_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 32,
               "num_speculative_tokens", self.num_speculative_tokens, "an integer in [0, 32]")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
               "prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "prompt_lookup_max", self.prompt_lookup_max, "an integer >= prompt_lookup_min")

    @property
    def k(self) -> int:
        """Draft tokens per verify step; 0 for ``none``."""
        return 0 if self.method == "none" else self.num_speculative_tokens


@dataclass(frozen=True)
class EngineConfig:
    """Engine resources. max_batch_size: rows decoded together (continuous batching).

    max_model_len: cap on prompt + completion tokens per row; ``None`` takes the model's context.
    prefill_chunk: prompt tokens per attention call of prefill (a prompt is cut at its
    multiples, whatever else runs). max_prefill_tokens: prompt tokens per prefill forward (several
    prompts packed); while rows are decoding, one such forward runs per step.
    """

    max_batch_size: int = 16
    max_model_len: int | None = None
    prefill_chunk: int = 1024
    max_prefill_tokens: int = 2048
    dtype: str = "float32"
    device: str = "cpu"

    def __post_init__(self) -> None:
        _check(_is_int(self.max_batch_size) and self.max_batch_size >= 1, "max_batch_size",
               self.max_batch_size, "an integer >= 1")
        _check(self.max_model_len is None or (_is_int(self.max_model_len)
                                              and self.max_model_len >= 2),
               "max_model_len", self.max_model_len, "an integer >= 2")
        _check(_is_int(self.prefill_chunk) and self.prefill_chunk >= 16, "prefill_chunk",
               self.prefill_chunk, "an integer >= 16")
        _check(_is_int(self.max_prefill_tokens) and self.max_prefill_tokens >= 1,
               "max_prefill_tokens", self.max_prefill_tokens, "an integer >= 1")
        _check(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")


__all__ = ["SamplingParams", "SpecConfig", "EngineConfig", "SAMPLING_FIELDS", "METHODS", "DTYPES",
           "MIN_INT", "MAX_INT"]
