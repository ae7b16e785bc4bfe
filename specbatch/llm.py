"""``specbatch.LLM``: the one place that loads a model and builds an engine and a plan.

    from specbatch import LLM, SamplingParams

    llm = LLM(model="smollm2-135m", method="ngram", k=5)
    outs = llm.generate(["Repeat: a b c a b c", {"turns": ["Hi", "And then?"]}],
                        SamplingParams(max_tokens=64))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].prompt_token_ids,
    outs[0].spec["mean_acceptance_length"]

``specbatch run``, ``bench``, ``calibrate``, ``reference`` and the Ray replicas
(``specbatch.ray``) all build on it; no other module assembles a ``ModelRunner`` or an
``Engine``. The data flow runs one way:

    records -> prompts -> requests -> engine -> completions -> output fields -> writer

(``io.records`` -> ``prompts`` -> ``pipeline`` -> ``engine`` -> ``outputs`` -> ``io.writer``).
A build is per batch of records: the batch size is fitted to the records and to free memory
(``pipeline.fit_engine_config``) and, with ``method="auto"``, the records are planned
(``auto.planner.plan_auto``) and the engine's proposer is an ``auto.proposer.AutoProposer``:
the candidate proposers behind the adaptive policy that routes and cuts their drafts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from specbatch import methods
from specbatch.config import ConfigError, EngineConfig, SamplingParams, SpecConfig
from specbatch.outputs import RequestOutput
from specbatch.prompts import PromptRenderer

_log = logging.getLogger("specbatch")


class ModelLoadError(ValueError):
    """The model or the draft model cannot be found or loaded; the message is one line that
    names it (what ``specbatch run`` prints after ``error:``)."""


def os_error_text(e: OSError) -> str:
    """``[Errno 2] No such file ...: '/x'`` -> ``/x: No such file or directory``."""
    where = e.filename if e.filename is not None else ""
    return f"{where}: {e.strerror}" if where and e.strerror else str(e)


@dataclass
class Prepared:
    """An engine built for a batch of records, and its plan (``method="auto"``; else None).
    ``run`` generates them: yields ``(record, output_fields)`` as records finish."""

    llm: LLM
    engine: Any  # engine.engine.Engine
    plan: Any  # auto.planner.Plan | None
    records: list
    engine_config: EngineConfig  # as fitted: max_batch_size is the engine's rows
    # method="auto": the (target, draft model or None) step-cost fits its decisions use
    fits: tuple | None = None

    def run(self, seed: int | None = None,
            on_tokens: Callable[[int, Any], None] | None = None,
            on_step: Callable[[int], None] | None = None,
            replay: dict[int, list[dict]] | None = None,
            schedules: dict[int, list[dict]] | None = None) -> Iterator[tuple[Any, dict]]:
        """replay, schedules: resume a job exactly (``pipeline.generate_records``)."""
        from specbatch.pipeline import generate_records

        return generate_records(self.engine, self.llm.renderer, self.records,
                                self.llm.seed if seed is None else seed, on_tokens,
                                plan=self.plan, on_step=on_step, replay=replay,
                                schedules=schedules)


_THREADS_CHOSEN = False


def _default_logging() -> None:
    """Show the ``specbatch`` logger's lines on stderr where the program set up no logging (no
    handler on it or on the root logger), as vLLM does for its ``vllm`` logger: an API user
    otherwise saw nothing while the first ``method="auto"`` call measured the step cost
    (57 s on a busy 2-core machine, fresh-user report) or a model converted. INFO and above
    (the logger's level, where the program left it unset), as ``LEVEL specbatch: message``;
    not passed on to the root logger, so a ``logging.basicConfig`` made later does not print
    them twice. A program that configures logging first gets them through its own handlers."""
    if _log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()  # sys.stderr
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    _log.addHandler(handler)
    if _log.level == logging.NOTSET:
        _log.setLevel(logging.INFO)
    _log.propagate = False


def _choose_cpu_threads(device: str) -> None:
    """The CLI's thread and wait-policy choice for an API user, once per process, logged."""
    global _THREADS_CHOSEN
    if _THREADS_CHOSEN or str(device).startswith("cuda"):
        return
    _THREADS_CHOSEN = True
    from specbatch import cpu_threads

    _log.info("%s", cpu_threads.choose_threads().line())


class LLM:
    """A loaded model (and draft model) that generates for records, prompts or chats.

    model: registry name (or the Hugging Face id of a registry model, e.g.
        ``HuggingFaceTB/SmolLM2-135M-Instruct``: its packaged GGUF, nothing is downloaded),
        ``.gguf`` path or Hugging Face folder (default: the packaged SmolLM2-135M).
        method: ``auto`` | ``none`` | ``ngram`` | ``draft``; k: draft tokens per
        verify step (the cap for ``auto``). dtype: ``auto`` (as the CLI: bfloat16 on GPUs;
        on x86-64 CPUs with AVX2, int8 for a GGUF of Q4_1 / Q8_0 / K-quant weights, else
        float32;
        ``config.auto_dtype``) | ``bfloat16`` | ``float32`` | ``float64`` | ``float16`` |
        ``int8`` | ``half`` | ``float`` (``config.DTYPE_CHOICES``, as ``--dtype``; float16,
        bfloat16 and float64 run on torch's kernels on a CPU); device: a torch device string.
        max_batch_size: rows decoded
        together (lowered to the records and to free memory per build). max_model_len: cap on
        prompt + output tokens. draft_model: for ``draft`` (or for ``auto`` to choose per row).
        seed: the run seed a record's seed is derived from (with its id), as ``--seed``.
        enable_prefix_caching: vLLM's name; a prompt's prefill starts after the longest prefix
        of it a cache row holds (``EngineConfig.prefix_caching``: exact, on the CPU kernels).
        echo: gets the human-readable notes (calibration, plan table, a lowered batch size);
        default: the ``specbatch`` logger at INFO, shown on stderr where the program set up no
        logging (``_default_logging``, as vLLM's ``vllm`` logger).

    On the CPU, the first ``LLM(...)`` of a process chooses its threads as the CLI does
    (``cpu_threads.choose_threads``, before torch loads): spinning threads fitted to the other
    work on the CPUs while it runs (spin-waiting threads of several jobs slow each other ~7x),
    and logs the ``cpu:`` line. ``OMP_WAIT_POLICY`` / ``OMP_NUM_THREADS`` set by the caller
    win; where torch was imported before, the policy cannot change any more and the line says
    so.

    vLLM's names, so a vLLM script's ``LLM(...)`` runs: ``max_num_seqs`` (= max_batch_size),
    ``speculative_config`` (a dict: ``method`` ``ngram`` | ``suffix`` | ``draft_model``,
    ``num_speculative_tokens``, ``prompt_lookup_min`` / ``prompt_lookup_max``, ``model`` for a
    draft model; it replaces method / k, and without it the method is ``auto``), dtype
    ``half`` / ``float`` (= float16 / float32), ``tensor_parallel_size`` (1 only) and
    ``trust_remote_code`` (no effect: specbatch runs no model code from a model's folder).
    vLLM's engine knobs that mean nothing here (``VLLM_IGNORED``: ``gpu_memory_utilization``,
    ``enforce_eager``, ...) are accepted and ignored, with one warning per process naming
    them; any other unknown keyword is a ``TypeError``, as Python's.

    Raises ``ValueError`` for a bad option (naming it) and ``ModelLoadError`` (a
    ``ValueError``) when a model cannot be loaded.
    """

    def __init__(self, model: str | None = None, method: str = "auto", k: int = 5, *,
                 dtype: str = "auto", device: str = "cpu", max_batch_size: int = 16,
                 max_model_len: int | None = None, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 4, draft_model: str | None = None,
                 cache_dir: str | None = None, seed: int = 0, enable_prefix_caching: bool = True,
                 echo: Callable[[str], None] | None = None, max_num_seqs: int | None = None,
                 speculative_config: dict | None = None, tensor_parallel_size: int = 1,
                 trust_remote_code: bool = False, **vllm_kwargs) -> None:
        _default_logging()
        _ignore_vllm_kwargs(vllm_kwargs)
        _choose_cpu_threads(device)
        if tensor_parallel_size != 1:
            raise ConfigError(f"tensor_parallel_size={tensor_parallel_size!r}: specbatch runs "
                              "one engine per process (1); use --ray --replicas N to spread a "
                              "job", "tensor_parallel_size", "1")
        if max_num_seqs is not None:
            max_batch_size = max_num_seqs
        if speculative_config is not None:
            method, k, prompt_lookup_min, prompt_lookup_max, draft_model = _speculative_config(
                speculative_config, prompt_lookup_min, prompt_lookup_max)
        spec = SpecConfig(method=method, num_speculative_tokens=k,
                          prompt_lookup_min=prompt_lookup_min,
                          prompt_lookup_max=prompt_lookup_max, draft_model=draft_model)
        if not isinstance(enable_prefix_caching, bool):  # named as the caller wrote it
            raise ConfigError(f"enable_prefix_caching={enable_prefix_caching!r}: expected True "
                              "or False", "enable_prefix_caching", "True or False")
        engine = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                              dtype=dtype, device=device, prefix_caching=enable_prefix_caching)
        self._load(model, spec, engine, cache_dir, seed, echo, resolve_dtype=True)

    @classmethod
    def from_config(cls, model: str | None, spec: SpecConfig, engine: EngineConfig, *,
                    cache_dir: str | None = None, seed: int = 0,
                    echo: Callable[[str], None] | None = None) -> LLM:
        """The CLI's way in: configs already built (and checked) from flags, the engine's
        dtype already resolved for the model (``EngineConfig.for_model``: a Ray replica must
        run the driver's choice, so nothing is resolved here)."""
        llm = cls.__new__(cls)
        llm._load(model, spec, engine, cache_dir, seed, echo, limit_setting="--max-model-len")
        return llm

    def _load(self, model, spec: SpecConfig, engine: EngineConfig, cache_dir, seed,
              echo, resolve_dtype: bool = False, limit_setting: str = "max_model_len") -> None:
        """Load the model (and draft model). Progress goes to the ``specbatch`` logger at INFO
        (``loading model ... ...``, ``model ready in S s``; the CLI prints it on stderr), the
        first line before torch is imported: a name that is no model fails before that.
        resolve_dtype: resolve a dtype ``auto`` for the model first (``LLM(...)``).
        limit_setting: how errors name a ``max_model_len`` below the model's context (the
        CLI's flag, or the keyword)."""
        self._limit_setting = limit_setting
        from specbatch.models.registry import DEFAULT_MODEL, find_model, hub_alias_note

        self.spec_config = spec
        self.cache_dir, self.seed = cache_dir, seed
        self.echo = echo or _log.info
        name = model or DEFAULT_MODEL
        t0 = time.perf_counter()
        try:
            find_model(name)  # an unknown name fails here, in milliseconds
            if (note := hub_alias_note(name)) is not None:
                _log.info("%s", note)
            if resolve_dtype:
                engine = engine.for_model(name, cache_dir)
            self.engine_config = engine
            _log.info("loading model %s (%s, %s%s) ...", name, engine.dtype, engine.device,
                      "" if engine.dtype_auto is None else f"; auto: {engine.dtype_auto}")
            from specbatch.models.loader import load_model  # imports torch (seconds)

            self.loaded = load_model(name, dtype=engine.dtype, device=engine.device,
                                     cache_dir=cache_dir)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        except OSError as e:
            raise ModelLoadError(f"cannot load model {name!r}: {os_error_text(e)}") from None
        self.draft = None
        if methods.uses_draft_model(spec.method) and spec.draft_model is not None:
            from specbatch.spec_decode.draft import load_draft_model

            _log.info("loading draft model %s ...", spec.draft_model)
            try:
                self.draft = load_draft_model(spec.draft_model, self.loaded, engine.dtype,
                                              engine.device, cache_dir)
            except (ValueError, OSError) as e:
                why = str(e) if isinstance(e, ValueError) else os_error_text(e)
                raise ModelLoadError(why if why.startswith("draft model ")
                                     else f"draft model {spec.draft_model!r}: {why}") from None
        self.load_seconds = time.perf_counter() - t0
        _log.info("model ready in %.1f s", self.load_seconds)
        self.renderer = PromptRenderer(self.loaded.tokenizer)
        self.max_model_len = min(self.loaded.max_model_len,
                                 engine.max_model_len or self.loaded.max_model_len)
        if (engine.max_model_len or 0) > self.loaded.max_model_len:
            _log.warning("%s %d is above the model's context (%d tokens): using %d",
                         limit_setting, engine.max_model_len, self.loaded.max_model_len,
                         self.loaded.max_model_len)
        self.engine = None  # the last engine built (its memory is what ``memory_summary`` shows)

    # ---- identity ------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    @property
    def draft_model_id(self) -> str | None:
        return self.draft.model_id if self.draft is not None else None

    @property
    def tokenizer(self):
        """The tokenizer the engine tokenises and detokenises with (``get_tokenizer``)."""
        return self.loaded.tokenizer

    def get_tokenizer(self):
        """The tokenizer this LLM uses, as vLLM's ``LLM.get_tokenizer()``: the transformers
        tokenizer (a ``PreTrainedTokenizerFast``) that text prompts are encoded with, chats
        rendered with (``apply_chat_template``) and outputs decoded with; its
        ``encode(prompt)`` is ``RequestOutput.prompt_token_ids`` for a text prompt."""
        return self.loaded.tokenizer

    # ---- records -------------------------------------------------------------------------
    def check_records(self, records: Iterable, path: str = "") -> list:
        """``RecordError``s of the records this model cannot run: a prompt that leaves no room
        in the context, a token id outside the vocabulary (``prompt_token_ids``,
        ``stop_token_ids``, ``logit_bias``). path: the input the errors name (none for the
        API's prompts: ``prompt N: ...``)."""
        from specbatch.io.records import check_lengths, check_token_ids

        records = list(records)
        return (check_lengths(records, self.renderer.count_tokens, self.max_model_len, path,
                              tokenizer=self.tokenizer,
                              limit_setting=self.limit_setting(self.max_model_len))
                + check_token_ids(records, self.loaded.model.config.vocab_size, path))

    def limit_setting(self, max_model_len: int) -> str | None:
        """The setting errors name for a context cap of ``max_model_len`` below the model's
        own (``--max-model-len`` from the CLI, ``max_model_len`` from ``LLM(...)``); None when
        the cap is the model's context."""
        return (self.__dict__.get("_limit_setting", "max_model_len")
                if max_model_len < self.loaded.max_model_len else None)

    def to_records(self, prompts: Iterable, sampling_params=None) -> list:
        """Validated ``Record``s of strings (a plain prompt each), dicts (records in the input
        format: ``prompt`` / ``messages`` / ``turns`` / ``prompt_token_ids``, optional ``id``
        and sampling fields; ``{"prompt_token_ids": [...]}`` is vLLM's ``TokensPrompt``, run
        as given, with the outputs of the text those ids encode) or ``Record``s (kept as they
        are). sampling_params: the defaults, one ``SamplingParams``
        or a list with one per prompt. A single string, dict or ``Record`` is one prompt (as
        vLLM's ``generate`` takes it). ``max_tokens=None`` (vLLM's default: up to the context)
        becomes this LLM's ``max_model_len``: the output ends at EOS, a stop, or when prompt +
        output fill the context (``finish_reason`` ``length``). Raises ``ValueError`` listing
        the bad ones (the first 5), each as ``prompt N: reason`` (N counts from 1; ``id=ID``
        follows N where the dict gave its own id): an empty prompt, a prompt that is no
        string or dict, token ids that are empty, not integers >= 0 or outside the
        vocabulary, a prompt too long for the context, a bad sampling field."""
        from specbatch.io.records import Record, records_from_rows

        prompts = [prompts] if isinstance(prompts, (str, dict, Record)) else list(prompts)
        if prompts and all(isinstance(p, Record) for p in prompts):
            return self._up_to_the_context(prompts)
        defaults = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                    else sampling_params or SamplingParams())
        rows = [{"prompt": p} if isinstance(p, str) else p for p in prompts]
        records, errors = records_from_rows(rows, defaults=defaults)
        errors += self.check_records(records)
        if errors:
            raise ValueError("; ".join(str(e) for e in errors[:5])
                             + (f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""))
        return self._up_to_the_context(records)

    def _up_to_the_context(self, records: list) -> list:
        """``records`` with ``max_tokens=None`` read as ``max_model_len`` (the context stop,
        ``StopRules``, ends such an output first: prompt + output never exceed it)."""
        from dataclasses import replace

        return [r if r.sampling.max_tokens is not None else replace(
            r, sampling=replace(r.sampling, max_tokens=self.max_model_len)) for r in records]

    # ---- building ------------------------------------------------------------------------
    def fit_engine_config(self, records: Iterable, engine: EngineConfig | None = None,
                          echo: Callable[[str], None] | None = None) -> EngineConfig:
        """``engine`` (default: this LLM's) with ``max_batch_size`` at most the number of
        records and lowered, with a note to ``echo``, if the KV rows would not fit in memory."""
        from specbatch.pipeline import fit_engine_config

        return fit_engine_config(engine or self.engine_config, records, self.renderer,
                                 self.max_model_len, self.loaded.model,
                                 self.draft.model if self.draft is not None else None,
                                 echo=echo or self.echo)

    def new_runner(self, num_rows: int, max_model_len: int | None = None, **kwargs):
        """A ``ModelRunner`` of the target with its own KV cache of ``num_rows`` rows."""
        from specbatch.engine.runner import ModelRunner
        from specbatch.models.llama import LlamaForward

        return ModelRunner(LlamaForward(self.loaded.model), num_rows,
                           max_model_len or self.max_model_len, **kwargs)

    def calibrate(self, recalibrate: bool = False, forward=None, model_id: str | None = None,
                  echo: Callable[[str], None] | None = None, purpose: str | None = None):
        """The step-cost model of this machine (``auto.costmodel``): ``(cost, path, measured)``,
        loaded from the cache shared by every run (and replica) unless ``recalibrate`` (or the
        cached fit fails its checks). forward, model_id: another forward to calibrate (the
        draft model's) and its id. echo: gets what it is doing and why a fit is not cached
        (default: this LLM's echo), with ``purpose`` (what waits for it) in the line that says
        it is calibrating; a progress bar goes to stderr while it measures.
        A fit is kept for the life of this ``LLM`` (measured once per ``LLM``, not once per
        ``generate``). A fit pinned with ``pin_calibration`` (``--calibration FILE``) is the
        target's, whatever the cache holds."""
        from specbatch.models.llama import LlamaForward
        from specbatch.models.loader import cache_root
        from specbatch.auto import costmodel

        key = model_id or self.model_id
        fits = self.__dict__.setdefault("_fits", {})
        pinned = self.__dict__.get("_pinned")
        if pinned is not None and key == self.model_id:
            return pinned[0], pinned[1], False
        if key in fits and not recalibrate:
            cost, path = fits[key]
            return cost, path, False
        cost, path, measured = costmodel.load_or_calibrate(
            forward or LlamaForward(self.loaded.model), key, self.engine_config.dtype,
            cache_root(self.cache_dir), recalibrate=recalibrate, echo=echo or self.echo,
            purpose=purpose)
        fits[key] = (cost, path)
        return cost, path, measured

    def pin_calibration(self, path: str) -> list[str]:
        """Use the step-cost fit in ``path`` (``specbatch calibrate -o``, or a cached one) for
        the target model instead of the cache: ``--calibration FILE``. Returns warning lines
        when it was measured for another model, dtype or engine setting (it is used anyway;
        a job prices its steps with it as it is). Raises ``ValueError`` (one line naming the
        file) when it is no usable calibration."""
        from pathlib import Path

        from specbatch.auto.costmodel import load, other_engine

        cost = load(path)
        if (why := cost.problem()) is not None:
            raise ValueError(f"{path}: {why}")
        warnings = []
        if cost.model_id and cost.model_id != self.model_id:
            warnings.append(f"measured for {cost.model_id}, not {self.model_id}")
        if cost.dtype and cost.dtype != self.engine_config.dtype:
            warnings.append(f"measured at dtype {cost.dtype}, not {self.engine_config.dtype}")
        if (why := other_engine(cost)) is not None:
            warnings.append(why)
        self.__dict__["_pinned"] = (cost, Path(path))
        return [f"--calibration {path}: {w}; used anyway"
                for w in warnings]

    def use_job_fits(self, path: str) -> None:
        """Price ``method="auto"`` with the fits a job started with (``OUT.calibration.json``,
        ``costmodel.save_job_fits``), whatever the cache or ``--calibration`` hold now: a
        resumed job decides as the interrupted one did. Raises ``ValueError`` (one line naming
        the file)."""
        from pathlib import Path

        from specbatch.auto.costmodel import load_job_fits

        target, draft = load_job_fits(path)
        self.__dict__["_pinned"] = (target, Path(path))
        if draft is not None:
            key = self.draft_model_id or "draft"
            self.__dict__.setdefault("_fits", {})[key] = (draft, Path(path))

    def prepare(self, records: Iterable, spec: SpecConfig | None = None,
                engine: EngineConfig | None = None,
                echo: Callable[[str], None] | None = None,
                echo_plan: Callable[[str], None] | None = None) -> Prepared:
        """Build an engine for ``records`` (a list of ``Record``): spec (default: this LLM's),
        engine: an already fitted ``EngineConfig`` (default: fitted to the records here).
        With ``method="auto"``: calibrate (or read the cache), plan, and build the engine with
        an ``AutoProposer`` over the candidate proposers and the adaptive policy. ``echo`` gets the
        notes and the plan table (``echo_plan``, when given, gets the table: ``--plan-only``
        prints it on stdout)."""
        from specbatch.engine.engine import Engine
        from specbatch.engine.sequence import StopRules
        from specbatch.models.llama import LlamaForward
        from specbatch.pipeline import kv_capacity
        from specbatch.spec_decode import make_proposer

        records = self._up_to_the_context(list(records))
        spec = spec or self.spec_config
        echo = echo or self.echo
        engine_config = engine or self.fit_engine_config(records, echo=echo)
        rows = engine_config.max_batch_size
        max_model_len = min(self.loaded.max_model_len,
                            engine_config.max_model_len or self.loaded.max_model_len)
        runner = self.new_runner(rows, max_model_len, prefill_chunk=engine_config.prefill_chunk,
                                 max_prefill_tokens=engine_config.max_prefill_tokens,
                                 prefix_caching=engine_config.prefix_caching,
                                 initial_capacity=kv_capacity(records, self.renderer,
                                                              max_model_len, spec.draft_cap))
        stop_rules = StopRules(frozenset(self.loaded.eos_token_ids), max_model_len,
                               self.renderer.detokenize)
        use_draft = (self.draft is not None and methods.uses_draft_model(spec.method)
                     and spec.draft_model is not None)
        draft_forward = LlamaForward(self.draft.model) if use_draft else None
        proposer = make_proposer(spec, draft_forward, rows)
        plan = None
        if spec.method == "auto":
            from specbatch.auto.planner import plan_auto

            why = "the plan's k and predicted speedup per bucket depend on it"
            cost, _, _ = self.calibrate(forward=runner.forward, echo=echo, purpose=why)
            model_cost = None
            if draft_forward is not None:  # auto drafts with it too: its own costs
                model_cost, _, _ = self.calibrate(
                    forward=draft_forward, model_id=self.draft_model_id or "draft",
                    echo=echo, purpose=why)
            # the proposer routes through the plan's policy from now on
            plan, _ = plan_auto(records, self.renderer, spec, rows, max_model_len, cost,
                                proposer, model_cost, echo=echo, model_id=self.model_id,
                                echo_plan=echo_plan)
            fits = (cost, model_cost)
        else:
            fits = None
        self.engine = Engine(runner, proposer, stop_rules, spec.draft_cap,
                             self.renderer.detokenize, num_speculative_tokens=spec.k,
                             limit_setting=self.limit_setting(max_model_len))
        return Prepared(self, self.engine, plan, records, engine_config, fits)

    def memory_summary(self) -> str:
        """One line: weights and KV bytes of the last engine built (see
        ``pipeline.memory_summary``)."""
        from specbatch.pipeline import memory_summary

        return memory_summary(self.engine)

    # ---- generating ----------------------------------------------------------------------
    def generate_records(self, records: Iterable, *, seed: int | None = None,
                         on_tokens: Callable[[int, Any], None] | None = None,
                         spec: SpecConfig | None = None, engine: EngineConfig | None = None,
                         echo: Callable[[str], None] | None = None,
                         ) -> Iterator[tuple[Any, dict]]:
        """``prepare(records, ...).run(seed, on_tokens)``: yields ``(record, output_fields)``
        in the order records finish (``outputs.output_fields``)."""
        yield from self.prepare(records, spec, engine, echo).run(seed, on_tokens)

    def generate(self, prompts: Iterable, sampling_params=None, *,
                 seed: int | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (see ``to_records``); one ``RequestOutput`` per prompt, in
        input order, shaped as vLLM's (``.outputs[i].text``, ``.prompt_token_ids``, ...) and
        holding the output fields ``specbatch run`` writes for the same record and flags (the
        same token ids and ``spec`` stats). use_tqdm: vLLM's name; when stderr is a terminal,
        a progress bar over the prompts (``specbatch run``'s: records, tokens, tok/s,
        acceptance length) is drawn there; False: never. Raises ``ValueError`` for bad prompts
        (and a ``use_tqdm`` that is not True or False) before generating anything."""
        if not isinstance(use_tqdm, bool):
            raise ConfigError(f"use_tqdm={use_tqdm!r}: expected True or False", "use_tqdm",
                              "True or False")
        records = self.to_records(prompts, sampling_params)
        if not records:
            return []
        progress = _api_progress(records) if use_tqdm else None
        outs = {}
        try:
            run = self.prepare(records).run(
                seed, progress.answer_done if progress else None,
                progress.tick if progress else None)
            for rec, out in run:
                outs[rec.index] = self._request_output(rec, out)
                if progress is not None:
                    progress.record_done(out.get("usage", {}).get("completion_tokens"))
        finally:
            if progress is not None:
                progress.close()
        return [outs[r.index] for r in records]

    def _request_output(self, rec, fields: dict) -> RequestOutput:
        ids, _ = self.renderer.first_prompt(rec)
        prompt = rec.prompt if rec.prompt is not None else self.tokenizer.decode(ids)
        return RequestOutput.from_fields(rec, fields, prompt, list(ids),
                                         lambda t: self.tokenizer.decode([t]))

    def chat(self, messages_list: Iterable[list[dict]], sampling_params=None, *,
             seed: int | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """``generate`` for chats: each item a list of ``{"role", "content"}`` messages,
        rendered with the tokenizer's chat template; a single chat (a list of message dicts)
        is one item, as in vLLM's ``chat``."""
        chats = list(messages_list)
        if chats and isinstance(chats[0], dict):
            chats = [chats]
        return self.generate([{"messages": list(m)} for m in chats], sampling_params,
                             seed=seed, use_tqdm=use_tqdm)


def _in_notebook() -> bool:
    """Whether this process is a Jupyter (IPython) kernel: its stderr is no terminal, yet the
    notebook redraws a bar (carriage returns) in place, as it does vLLM's ``use_tqdm`` bar."""
    import sys

    shell = sys.modules.get("IPython")
    get = getattr(shell, "get_ipython", None)
    return get is not None and type(get()).__name__ == "ZMQInteractiveShell"


def _api_progress(records: list):
    """``generate``'s progress bar (``progress.Progress``) when stderr is a terminal or a
    Jupyter notebook's (``_in_notebook``), else None: the Python API writes no plain progress
    lines into a caller's logs."""
    import sys

    notebook = _in_notebook()
    if sys.stderr is None or not (sys.stderr.isatty() or notebook):
        return None
    from specbatch.progress import Progress

    return Progress(len(records), tty=True, max_tokens=max(
        r.sampling.max_tokens * r.sampling.n * len(r.turns or [None]) for r in records))


# vLLM ``LLM(...)`` keywords about its GPU engine (memory, CUDA graphs, swap, workers) that
# have no meaning in specbatch: accepted and ignored, with one warning per process naming them
VLLM_IGNORED = ("gpu_memory_utilization", "enforce_eager", "swap_space", "cpu_offload_gb",
                "max_seq_len_to_capture", "disable_custom_all_reduce", "disable_log_stats",
                "distributed_executor_backend")
_WARNED_IGNORED: set[str] = set()


def _ignore_vllm_kwargs(kwargs: dict) -> None:
    """Raise ``TypeError`` for a keyword outside ``VLLM_IGNORED`` (as Python does for an
    unknown one); warn once per process about those ignored."""
    unknown = sorted(set(kwargs) - set(VLLM_IGNORED))
    if unknown:
        raise TypeError(f"LLM() got an unexpected keyword argument {unknown[0]!r}")
    new = [name for name in VLLM_IGNORED if name in kwargs and name not in _WARNED_IGNORED]
    if new:
        _WARNED_IGNORED.update(new)
        _log.warning("ignoring vLLM engine option(s) %s: no meaning in specbatch (it sizes "
                     "its KV cache to the records and free memory and runs no CUDA graphs)",
                     ", ".join(new))


_SPEC_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft"}


def _speculative_config(config, lookup_min: int, lookup_max: int) -> tuple:
    """vLLM's ``speculative_config`` dict -> ``(method, k, prompt_lookup_min,
    prompt_lookup_max, draft_model)``; raises ``ConfigError`` naming a key or method specbatch
    does not have."""
    if not isinstance(config, dict):
        raise ConfigError(f"speculative_config={config!r}: expected a dict",
                          "speculative_config", "a dict")
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
             "model"}
    unknown = sorted(set(config) - known)
    if unknown:
        raise ConfigError(f"speculative_config: unsupported key(s) {', '.join(unknown)} "
                          f"(supported: {', '.join(sorted(known))})", "speculative_config",
                          "known keys")
    draft_model = config.get("model")
    method = config.get("method") or ("draft_model" if draft_model else None)
    if method not in _SPEC_METHODS:
        raise ConfigError(f"speculative_config: method {method!r} is not supported (supported: "
                          f"{', '.join(_SPEC_METHODS)})", "speculative_config",
                          "ngram, suffix or draft_model")
    k = config.get("num_speculative_tokens", 5)
    return (_SPEC_METHODS[method], k, config.get("prompt_lookup_min", lookup_min),
            config.get("prompt_lookup_max", lookup_max), draft_model)


__all__ = ["LLM", "ModelLoadError", "Prepared", "RequestOutput", "SamplingParams",
           "VLLM_IGNORED"]
