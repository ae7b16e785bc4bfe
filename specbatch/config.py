"""Frozen configuration dataclasses: sampling parameters, speculation and engine settings.

Every value a user can set is checked in ``__post_init__``; a wrong value raises ``ValueError``
naming the field and the value. Derived values are properties.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass, field, fields, replace

from specbatch import methods, settings
# int8: float32, except that the matmuls with a GGUF model's 4/8-bit code weights round their
# input to 8 bits per block of 32 (llama.cpp's Q8 activations; CPU only, kernels/csrc/linear_q8.c)
DTYPES = ("float32", "bfloat16", "float64", "float16", "int8")
# vLLM's names for two of them (``LLM(dtype="half")``, ``--dtype half``), read as those
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# what ``--dtype``, ``LLM(dtype=...)``, a recipe's ``dtype`` and ``EngineConfig`` take: the one
# list (the CLI's choices and the API's error are made of it)
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES)
# The integers a JSON file holds exactly (orjson reads and writes -2**63 .. 2**64 - 1; it reads
# a longer integer as a float): the range of a seed, which the output's config saves.
MIN_INT, MAX_INT = -2**63, 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one record's tokens are chosen and when its generation stops.

    temperature: 0 means greedy (argmax, lowest token id wins ties); > 0 means position-keyed
        Gumbel-max sampling (see ``specbatch.spec_decode.sampler``).
    top_p: nucleus mass kept, in (0, 1]; 1 keeps everything.
    top_k: number of most likely tokens kept; 0 keeps everything. -1 (vLLM's "off" before
        0 was) is read as 0, so a config that records it says 0 either way.
    seed: the record seed, an integer in [MIN_INT, MAX_INT]; ``None`` lets the run derive it
        from ``--seed`` and the record id.
    max_tokens: cap on completion tokens (tokens) per generated answer; ``None`` (vLLM's
        default) runs until EOS, a stop, or the context (``max_model_len``) is full:
        ``LLM.generate`` reads it as the run's ``max_model_len`` (``LLM.to_records``).
    min_tokens: EOS and stop ids are ignored before this many completion tokens.
    stop: stop strings; the output ends before the one that completes earliest in the text.
    stop_token_ids: token ids that end the output like EOS (kept in ``token_ids``).
    ignore_eos: keep generating past EOS (to ``max_tokens``).
    logprobs: ``None`` for none; N >= 0 for the chosen token's logprob plus the top-N.
    n: samples generated per prompt; with n > 1 the output fields become lists, one entry per
        sample, and sample s > 0 draws its noise from a seed derived from the record seed and s.
    presence_penalty, frequency_penalty: in [-2, 2]; subtracted from the logit of every token
        that occurs in the output so far, once (presence) or once per occurrence (frequency),
        as vLLM and OpenAI define them.
    repetition_penalty: > 0 (1 = off); the logit of every token in the prompt or the output so
        far is divided by it if positive, multiplied if not (Keskar et al. 2019, as vLLM).
    min_p: in [0, 1]; tokens whose probability is below ``min_p`` times the most likely one's
        are dropped (after temperature, before top-k / top-p, as vLLM).
    logit_bias: ``((token_id, bias), ...)`` sorted by id, bias in [-100, 100], added to the
        logits before everything else (a record's ``{"id": bias}`` object is read into this).
    response_format: ``None``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
        "json_schema": {"schema": {...}}}`` (OpenAI's field): output constrained by xgrammar.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 128
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # a list is read into a tuple, as is ``stop``
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    response_format: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        # the Python forms vLLM users write: a stop string or list, a list of ids, a dict of
        # biases (the record reader, ``from_dict``, reads JSON the same way); a bad one is
        # named as the caller wrote it (a dict, a list), not as the tuple it is read into
        written = {name: getattr(self, name) for name in _AS_WRITTEN_EXPECTED
                   if isinstance(getattr(self, name), (str, list, dict))}
        try:
            self._read_and_check()
        except ConfigError as e:
            _raise_as_written(e, written)

    def _read_and_check(self) -> None:
        if isinstance(self.stop, (str, list)):
            object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str)
                               else tuple(self.stop))
        if isinstance(self.stop_token_ids, list):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if isinstance(self.response_format, dict):
            _response_format(self.response_format)
        if _is_int(self.top_k) and self.top_k == -1:  # vLLM's older "off" (it still takes it)
            object.__setattr__(self, "top_k", 0)
        _check(isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
               and 0.0 <= self.temperature < float("inf"),
               "temperature", self.temperature, "a finite number >= 0")
        _check(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool)
               and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1]")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "an integer >= 0 (0 or -1 = off)")
        _check(self.seed is None or (_is_int(self.seed) and MIN_INT <= self.seed <= MAX_INT),
               "seed", self.seed, "an integer that fits in 64 bits")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               "max_tokens", self.max_tokens, "an integer >= 1")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens and (
            self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens", self.min_tokens, "an integer in [0, max_tokens]")
        _check(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
               "stop", self.stop, "a non-empty string or a list of non-empty strings")
        _check(isinstance(self.stop_token_ids, tuple)
               and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "token ids (integers >= 0)")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "true or false")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "an integer in [0, 20]")
        _check(_is_int(self.n) and 1 <= self.n <= 1024, "n", self.n, "an integer in [1, 1024]")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            _check(_is_num(v) and -2.0 <= v <= 2.0, name, v, "a number in [-2, 2]")
        _check(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty < float("inf"),
               "repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)")
        _check(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p,
               "a number in [0, 1]")
        _check(isinstance(self.logit_bias, tuple) and all(
            isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0
            and _is_num(p[1]) and -100.0 <= p[1] <= 100.0 for p in self.logit_bias),
            "logit_bias", self.logit_bias,
            'an object {"token id": bias} with ids >= 0 and biases in [-100, 100]')
        _check(self.response_format is None or (
            isinstance(self.response_format, dict)
            and self.response_format.get("type") in ("json_object", "json_schema", "text")),
            "response_format", self.response_format,
            '{"type": "json_schema", "json_schema": {"schema": {...}}} or {"type": "json_object"}')

    @property
    def has_penalties(self) -> bool:
        """Whether any count-based penalty is on (these need the tokens generated so far)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def json_schema(self) -> dict | bool | None:
        """The schema output must follow: a JSON schema, ``True`` for any JSON object
        (``json_object``), ``None`` when unconstrained."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf["type"] == "json_object":
            return True
        spec = rf.get("json_schema")
        return spec.get("schema", True) if isinstance(spec, dict) else True

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict, base: SamplingParams | None = None) -> SamplingParams:
        """Build from a record's or recipe's fields, overriding ``base``; unknown keys are ignored.

        Lists are accepted for ``stop`` and ``stop_token_ids``; a single string for ``stop``.
        Raises ``ConfigError`` (a ``ValueError``) naming the field on a bad value, shown as
        written (JSON: ``true``, ``"hot"``, a ``stop`` list rather than the tuple it is read
        into).
        """
        base = base or cls()
        updates = {}
        written = {}  # field -> the value as given (JSON), for the error message
        for f in fields(cls):
            if f.name not in values:
                continue
            v = written[f.name] = values[f.name]
            if f.name in _FLOAT_FIELDS and _is_int(v):
                v = float(v)
            updates[f.name] = v  # lists and dicts are read into tuples by __post_init__
        try:
            return replace(base, **updates)
        except ConfigError as e:
            _raise_as_written(e, written)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = {str(t): b for t, b in self.logit_bias}
        return d


# from_dict: the fields read into tuples, whose bad values are shown as written, and what a
# record may write for them where that differs from the dataclass's own check (None: the same)
_AS_WRITTEN_EXPECTED = {"stop": "a non-empty string or a list of non-empty strings",
                        "stop_token_ids": None, "logit_bias": None}
_FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "min_p")


def _logit_bias(v: dict):
    """``{"50256": -100, ...}`` (OpenAI writes ids as strings) -> sorted ((id, bias), ...)."""
    pairs = []
    for key, bias in v.items():
        tok = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if _is_int(bias):
            bias = float(bias)
        pairs.append((tok, bias))
    try:
        return tuple(sorted(pairs))
    except TypeError:
        return tuple(pairs)


def _response_format(v: dict) -> None:
    """Check the shape of OpenAI's ``response_format``; the schema itself is compiled later."""
    if v.get("type") == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            expected = 'json_schema to be an object with a "schema" object'
            raise ConfigError(f"response_format={_as_written(v)}: expected {expected}",
                              "response_format", expected)


SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))

# Generation parameters of vLLM's SamplingParams, the OpenAI chat/completions API (and a few of
# transformers' generate() and llama.cpp's, often found in datasets) that specbatch does NOT
# apply: a record carrying one is a bad record (``io.records``), since the user would believe it
# was applied.
# Name -> what to use instead ("" if nothing). The ONE list: when a parameter becomes supported
# (a SamplingParams field, or a record field the reader knows), remove it here; the reader skips
# supported names anyway. Transport and metadata names (model, user, metadata, stream, store,
# service_tier) are not listed: records may carry them as metadata.
UNSUPPORTED_SAMPLING_FIELDS: dict[str, str] = {
    "best_of": "", "allowed_token_ids": "", "bad_words": "", "prompt_logprobs": "",
    "include_stop_str_in_output": "", "skip_special_tokens": "",
    "spaces_between_special_tokens": "", "detokenize": "", "truncate_prompt_tokens": "",
    "logits_processors": "", "extra_args": "", "guided_decoding": "", "structured_outputs": "",
    "guided_json": "", "guided_regex": "", "guided_choice": "", "guided_grammar": "",
    "use_beam_search": "", "length_penalty": "", "early_stopping": "", "tools": "",
    "tool_choice": "", "functions": "", "function_call": "", "parallel_tool_calls": "",
    "reasoning_effort": "", "chat_template_kwargs": "", "echo": "", "suffix": "",
    "prediction": "", "max_completion_tokens": "max_tokens", "top_logprobs": "logprobs: N",
    "stop_sequences": "stop", "max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
    "do_sample": "temperature (0 is greedy)", "num_beams": "", "num_return_sequences": "n",
    "typical_p": "", "no_repeat_ngram_size": "",
    # llama.cpp (llama-server's /completion, llama-cpp-python's create_completion)
    "n_predict": "max_tokens", "repeat_penalty": "repetition_penalty", "repeat_last_n": "",
    "penalize_nl": "", "n_probs": "logprobs: N", "typ_p": "", "tfs_z": "", "mirostat": "",
    "mirostat_tau": "", "mirostat_eta": "", "dry_multiplier": "", "dry_base": "",
    "dry_allowed_length": "", "dry_penalty_last_n": "", "xtc_probability": "",
    "xtc_threshold": "", "n_keep": "",
    # ollama's options; transformers' max_length (it counts the prompt's tokens too)
    "num_predict": "max_tokens", "max_length": "max_tokens (output tokens only)",
}


@dataclass(frozen=True)
class SpecConfig:
    """Which proposer drafts tokens and how many.

    method: ``none`` (plain decoding, k = 0), ``ngram`` (prompt lookup), ``draft`` (a draft
        model, ``draft_model``), ``suffix`` (own text + the job's finished outputs,
        ``spec_decode.suffix``) or ``auto`` (chooses per row and step).
    num_speculative_tokens: k, draft tokens per verify step (the cap when k varies per row).
    prompt_lookup_min / prompt_lookup_max: n-gram sizes (tokens) the lookup tries, longest first.
    draft_model: the draft model (registry name, .gguf or HF folder); required for ``draft``,
        optional for ``auto``, refused for ``ngram`` and ``suffix`` (it would go unused),
        ignored by ``none``.
    suffix_max_tokens: bound (output tokens) of the job-wide suffix index; oldest evicted first.
    """

    method: str = "none"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    draft_model: str | None = None
    suffix_max_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        entry = methods.get(self.method)
        _check(entry is not None, "method", self.method, f"one of {', '.join(methods.names())}")
        _check(self.draft_model is None or (isinstance(self.draft_model, str)
                                            and self.draft_model != ""),
               "draft_model", self.draft_model, "a model name or path")
        if entry.draft_model == "needs" and self.draft_model is None:
            raise ConfigError(f"method {self.method} needs a draft model (--draft-model NAME)",
                              "draft_model", "a draft model")
        # a refusing method would leave it unused, and a user would believe it drafted; none
        # ignores it, so a baseline may share the command line of the draft run it is compared with
        _check(self.draft_model is None or entry.draft_model != "refused", "draft_model",
               self.draft_model, f"no draft model with method {self.method} "
               f"({entry.drafts_by or self.method + ' drafts without a model'}; use method "
               "draft or auto to draft with a model)")
        _check(_is_int(self.num_speculative_tokens) and 0 <= self.num_speculative_tokens <= 32,
               "num_speculative_tokens", self.num_speculative_tokens, "an integer in [0, 32]")
        # 0 would run plain decoding under a speculative method's name (and its stats)
        _check(not entry.drafts or self.num_speculative_tokens >= 1,
               "num_speculative_tokens", self.num_speculative_tokens,
               f"an integer in [1, 32] with method {self.method} (0 drafts nothing: use method "
               "none)")
        _check(_is_int(self.prompt_lookup_min) and self.prompt_lookup_min >= 1,
               "prompt_lookup_min", self.prompt_lookup_min, "an integer >= 1")
        _check(_is_int(self.prompt_lookup_max) and self.prompt_lookup_max >= self.prompt_lookup_min,
               "prompt_lookup_max", self.prompt_lookup_max, "an integer >= prompt_lookup_min")
        _check(_is_int(self.suffix_max_tokens) and self.suffix_max_tokens >= 1,
               "suffix_max_tokens", self.suffix_max_tokens, "an integer >= 1")
        if entry.validate is not None:
            entry.validate(self)

    @property
    def k(self) -> int:
        """Draft tokens per verify step; 0 for ``none``."""
        return self.num_speculative_tokens if methods.get(self.method).drafts else 0

    @property
    def draft_cap(self) -> int:
        """The engine's per-row draft cap (tokens): k, except that ``suffix`` (and ``auto``'s
        suffix drafts) may draft a long, frequent match past k, up to ``SUFFIX_CAP_FACTOR * k``
        (at most 32; ``methods.Method.draft_cap``); ``auto`` cuts lookup and draft-model drafts
        to k."""
        return methods.get(self.method).draft_cap(self.k)


@dataclass(frozen=True)
class EngineConfig:
    """Engine resources. max_batch_size: rows decoded together (continuous batching).

    max_model_len: cap on prompt + completion tokens per row; ``None`` takes the model's context.
    prefill_chunk: prompt tokens per attention call of prefill (a prompt is cut at its
    multiples, whatever else runs). max_prefill_tokens: prompt tokens per prefill forward (several
    prompts packed); while rows are decoding, one such forward runs per step.
    device: ``auto`` (cuda when available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``; stored
    resolved (``auto`` never remains). Raises ``ValueError`` for cuda without a usable GPU.
    dtype: one of ``DTYPE_CHOICES``: ``auto`` (see ``auto_dtype``), one of ``DTYPES``, or vLLM's
    ``half`` / ``float`` (stored as float16 / float32); stored resolved, from the device
    alone until ``for_model`` resolves it for the model. ``int8`` (float32 with 8-bit
    activations into the code-weight matmuls) is for the CPU only.
    dtype_auto: why ``auto`` chose ``dtype`` (e.g. ``GGUF Q4_1 + Q8_0 codes on the int8
    kernels``), said in the start-up line and saved in ``OUT.config.json``; None when the dtype
    was named. Set here when dtype is ``auto`` and by ``for_model``; ``replace`` keeps it.
    prefix_caching: a prompt starts its prefill after the longest prefix of it that a cache row
    already holds (``ModelRunner.start``); on where prefill is per token (the CPU kernels:
    float32 on AVX2 CPUs, int8), where it changes no bit; off elsewhere whatever this says.
    """

    max_batch_size: int = 16
    max_model_len: int | None = None
    prefill_chunk: int = 1024
    max_prefill_tokens: int = 2048
    dtype: str = "auto"
    device: str = "auto"
    prefix_caching: bool = True
    dtype_auto: str | None = None

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
        _check(isinstance(self.prefix_caching, bool), "prefix_caching", self.prefix_caching,
               "true or false")
        if type(self.dtype).__module__ == "torch":  # vLLM takes a torch.dtype: torch.float16
            object.__setattr__(self, "dtype", str(self.dtype).removeprefix("torch."))
        _check(isinstance(self.dtype, str) and self.dtype in DTYPE_CHOICES, "dtype", self.dtype,
               f"one of {', '.join(DTYPE_CHOICES)}")
        object.__setattr__(self, "dtype", DTYPE_ALIASES.get(self.dtype, self.dtype))
        _check(self.dtype_auto is None or (isinstance(self.dtype_auto, str) and self.dtype_auto),
               "dtype_auto", self.dtype_auto, "None or why auto chose the dtype")
        object.__setattr__(self, "device", resolve_device(self.device))
        if self.dtype == "auto":
            dtype, why = auto_dtype(self.device)
            object.__setattr__(self, "dtype", dtype)
            object.__setattr__(self, "dtype_auto", why)
        _check(self.dtype != "int8" or self.device.startswith("cpu"), "dtype", self.dtype,
               f"auto, bfloat16, float32, float16 or float64 on {self.device} (int8 activations "
               "run on specbatch's CPU kernels only)")
        if self.dtype == "int8":
            _check(_cpu_kernels(), "dtype", self.dtype, "float32 here: int8 needs specbatch's "
                   "C kernels (x86-64 with AVX2 + FMA and a C compiler; not "
                   "SPECBATCH_CPU_KERNELS=0)")


    def for_model(self, model: str | None, cache_dir: str | None = None) -> EngineConfig:
        """This config with ``auto`` resolved for ``model`` (a registry name, ``.gguf`` path or
        HF folder; None: the default model): ``int8`` for a GGUF whose matmul weights the int8
        kernels take as codes, where they run (``auto_dtype``). Returns ``self`` when the
        dtype was named. Deterministic per machine and model file; reads the GGUF header only
        (a registry model shipped in parts is assembled into ``cache_dir`` first, as the load
        would). Called where the model becomes known (``LLM(...)``, ``specbatch run``,
        ``bench``, ``calibrate``, ``ray.build_processor``), once: Ray replicas get the
        driver's resolved config and never resolve again."""
        if self.dtype_auto is None:
            return self
        from specbatch.models.registry import DEFAULT_MODEL

        dtype, why = auto_dtype(self.device, model or DEFAULT_MODEL, cache_dir)
        return replace(self, dtype=dtype, dtype_auto=why)

    @property
    def dtype_text(self) -> str:
        """``dtype`` as the start-up line says it: ``float32``, or ``int8 (auto: GGUF Q4_1 +
        Q8_0 codes on the int8 kernels)`` where ``auto`` chose it."""
        return self.dtype if self.dtype_auto is None else f"{self.dtype} (auto: {self.dtype_auto})"


def auto_dtype(device: str, model: str | None = None, cache_dir: str | None = None
               ) -> tuple[str, str]:
    """What ``--dtype auto`` runs on ``device`` (resolved: ``cpu``, ``cuda``, ``cuda:N``) for
    ``model``, and why, as ``(dtype, reason)``:

    - from the device alone (``resolve_dtype``'s rule, below) when ``model`` is None;
    - ``int8`` where that gives float32 on a CPU whose C kernels run (``_cpu_kernels``, as
      ``EngineConfig`` checks int8, and ``SPECBATCH_CPU_WEIGHTS`` is not ``float32``) and
      ``model`` (a registry name, ``.gguf`` path or HF folder) is a GGUF whose matmul weights
      are mostly of types the int8 kernels take as codes (``models.gguf_header.
      int8_code_types``: Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1; a Q4_K_M file is Q4_K +
      Q6_K, with Q5_0 / Q8_0 where a row length is not a multiple of 256, as in the Qwen 0.5B):
      llama.cpp's scheme on the file's own codes,
      batch-invariant, ~2x float32's batch-16 throughput (docs/models.md, "dtype"). It is
      another dtype than float32 (outputs differ as bfloat16's do), taken because it is the
      fastest invariant path for such a file;
    - float32 otherwise: a Hugging Face folder, an F32 / F16 / BF16 GGUF or one of types the
      kernels do not take, a name that is no model (the load then reports it).

    Decided from the CPU flags, the ``SPECBATCH_CPU_*`` switches and the file's header (no
    torch, a few ms): one machine and one model file give one dtype, never the batch size or
    the load. Raises nothing."""
    dtype = resolve_dtype("auto", device)
    if not device.startswith("cpu"):
        return dtype, "a GPU"
    flags = _cpu_flags()
    where = ("an x86-64 CPU with AVX2 + FMA" if {"avx2", "fma"} <= flags
             else "a CPU with AVX-512 BF16 but not AVX2 + FMA" if dtype == "bfloat16"
             else "a CPU without AVX2 + FMA")
    if model is None or dtype != "float32":
        return dtype, where
    from specbatch.models.registry import find_model, gguf_file

    try:
        kind = find_model(model)[0]
        path = gguf_file(model, cache_dir)
    except (ValueError, OSError):  # no such model, parts that do not assemble: the load says
        return dtype, where
    if path is None:
        return dtype, ("a Hugging Face folder" if kind == "hf_folder"
                       else "random float32 weights (dummy model)")
    from specbatch.models import gguf_header

    codes = " + ".join(gguf_header.int8_code_types(path))
    if not codes:
        kinds = " + ".join(gguf_header.weight_types(path)) or "of unread types"
        return dtype, f"GGUF {kinds}, no codes the int8 kernels take"
    if not _cpu_kernels():
        return dtype, (f"GGUF {codes}, but the int8 kernels cannot run here (C kernels off, "
                       "or no AVX2 + FMA + F16C or C compiler)")
    if not settings.cpu_code_weights():
        return dtype, f"GGUF {codes}, but SPECBATCH_CPU_WEIGHTS=float32"
    return "int8", f"GGUF {codes} codes on the int8 kernels"


def resolve_dtype(name: str, device: str, model: str | None = None,
                  cache_dir: str | None = None) -> str:
    """``auto`` -> ``auto_dtype(device, model, cache_dir)``'s dtype with a model; any other name
    as it is. Without a model, from the device: the fastest dtype whose
    decode/verify path is batch-invariant on ``device`` (docs/design.md, "Which CPU"), from the
    CPU flags in /proc/cpuinfo:

    - a GPU: ``bfloat16``;
    - an x86-64 CPU with AVX2 and FMA, AMX or not: ``float32``, which runs on specbatch's C
      kernels (``kernels/``; decode steps stream the weights as exact 4-bit codes), invariant by
      construction. bfloat16 is not taken on AMX CPUs: on an Intel Xeon with AMX and AVX-512
      FP16 (2026-12-03, torch 2.13, docs/design.md "Which CPU") oneDNN's bfloat16 ``F.linear``
      rounds rows differently with the row count (down_proj from 6 rows, lm_head from 1) and a
      2-replica run wrote another token than one process. With AVX-512 BF16 but no AMX (an AMD
      EPYC, 2 cores, the 16 peer records, docs/benchmarks.md "Zen 5") float32 was also 3.4x
      bfloat16's speed at batch 1 and on par at batch 16;
    - any other CPU: ``bfloat16`` where it has native bfloat16 matmuls (AVX-512 BF16), else
      ``float32`` (torch's bfloat16 matmul runs at scalar speed on AVX2: SmolLM2-135M batch-16
      decode ~6x slower than float32 on a Zen 3).

    Any other name is returned as it is. The device's choice depends on the CPU only (never
    on the batch size or an environment switch), so one machine gives one dtype and one set
    of outputs."""
    if name != "auto":
        return name
    if model is not None:
        return auto_dtype(device, model, cache_dir)[0]
    if not device.startswith("cpu"):
        return "bfloat16"
    flags = _cpu_flags()
    if {"avx2", "fma"} <= flags:
        return "float32"
    return "bfloat16" if "avx512_bf16" in flags else "float32"


def _cpu_kernels() -> bool:
    """Whether specbatch's C matmul can run here, judged without building it or importing torch
    (validation stays instant): not switched off (``SPECBATCH_CPU_KERNELS=0``,
    ``SPECBATCH_CPU_LINEAR=onednn``), AVX2 + FMA + F16C in /proc/cpuinfo (as
    ``kernels/cpu_build.py``), and a C compiler (``$CC``, ``cc`` or ``gcc``). A compiler that
    then fails is reported when the model loads (``models/llama.py``, ``ValueError``)."""
    return (settings.cpu_kernels() and settings.cpu_linear()
            and {"avx2", "fma", "f16c"} <= _cpu_flags()
            and bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")))


def _cpu_flags() -> frozenset[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` if torch sees a GPU, else ``cpu``; ``cpu`` / ``cuda`` / ``cuda:N``
    are checked (a GPU must be visible to torch). Raises ``ValueError`` naming the value.
    ``cpu``, and ``auto`` on a Linux machine without GPU device files, do not import torch
    (seconds), so that errors found before the model loads are shown at once."""
    _check(isinstance(name, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", name) is not None,
           "device", name, "auto, cpu, cuda or cuda:N")
    if name == "cpu" or (name == "auto" and _surely_no_gpu()):
        return "cpu"
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(name.partition(":")[2] or 0)
        _check(index < count, "device", name,
               f"a visible GPU (torch {torch.__version__} sees {count})")
    return name


def _surely_no_gpu() -> bool:
    """Linux without the device files of an NVIDIA, ROCm or WSL GPU driver: torch cannot see a
    GPU there."""
    return sys.platform.startswith("linux") and not any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg"))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def context_limit_text(max_model_len: int, setting: str | None = None) -> str:
    """How an error names the context cap: ``the model's context is 2048``, or, where the
    cap is the user's (``--max-model-len`` / ``max_model_len``, below the model's own: the
    ``setting`` named), ``the context limit is 512 (--max-model-len)``."""
    if setting is None:
        return f"the model's context is {max_model_len}"
    return f"the context limit is {max_model_len} ({setting})"


def prompt_too_long_text(num_prompt_tokens: int, max_model_len: int,
                         setting: str | None = None) -> str:
    """Why a prompt of ``num_prompt_tokens`` cannot run (it is at least ``max_model_len``):
    ``prompt is 300 tokens; the model's context is 128``, with ``, leaving no room for output``
    where it fills the context exactly (``prompt is 125 tokens; the context limit is 125`` read
    as a contradiction). setting: as ``context_limit_text``."""
    room = ", leaving no room for output" if num_prompt_tokens == max_model_len else ""
    return (f"prompt is {num_prompt_tokens} tokens{room}; "
            + context_limit_text(max_model_len, setting))


class ConfigError(ValueError):
    """A bad value of a ``SamplingParams``, ``SpecConfig`` or ``EngineConfig`` field, raised as
    the object is built: ``name=value: expected ...``. ``name``: the field; ``expected``: what it
    accepts (``SamplingParams.from_dict`` uses them to show the value as the record wrote it)."""

    def __init__(self, message: str, name: str | None = None, expected: str | None = None):
        super().__init__(message)
        self.name, self.expected = name, expected


def _check(ok: bool, name: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r}: expected {expected}", name, expected)


def _raise_as_written(e: ConfigError, written: dict) -> None:
    """Re-raise ``e``; for a field the caller wrote as a string, list or dict (``written``:
    name -> value), echo that value as written (JSON) instead of its parsed form."""
    if e.name not in written:
        raise e
    raise ConfigError(f"{e.name}={_as_written(written[e.name])}: expected "
                      f"{_AS_WRITTEN_EXPECTED.get(e.name) or e.expected}", e.name,
                      e.expected) from None


def _as_written(value, limit: int = 200) -> str:
    """``value`` as JSON (as a record or request wrote it), else its ``repr``; cut at ``limit``
    characters, so that one error stays one readable line."""
    import json

    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = ["ConfigError", "SamplingParams", "SpecConfig", "EngineConfig", "resolve_device", "resolve_dtype", "auto_dtype", "SAMPLING_FIELDS", "DTYPES",
           "DTYPE_ALIASES", "DTYPE_CHOICES",
           "MIN_INT", "MAX_INT", "UNSUPPORTED_SAMPLING_FIELDS", "context_limit_text",
           "prompt_too_long_text"]


def __getattr__(name: str):
    if name == "METHODS":  # the registered method names (``methods.names()``), read when asked
        return methods.names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
