"""Scale-out on Ray Data: one job over N engine replicas, output identical to one process.

The field's way (vLLM's batch-inference example, ``ray.data.llm``): each replica is a stateful
``map_batches`` actor holding an ``LLM``; records stream through them in batches. Because a
record's output does not depend on its batch, its neighbours or its replica (the engine's
invariance), a job split over N replicas writes the same bytes as one process (``--method
ngram`` / ``none`` / ``draft``; ``auto`` gives the same token ids, its plan fields are per batch).

Two ways in:

    specbatch run INPUT -o OUT.jsonl --ray [--ray-address ADDR] --replicas N

reads and validates INPUT in the driver exactly as a local run (same errors, same exit codes),
sends the records to the replicas, and writes OUT in input order by the same atomic rename.
Each replica also appends its finished records to its own work file beside OUT
(``OUT.work.HOST-PID.jsonl``, ``io.writer.WorkShard``) as they finish, so a killed job loses at
most the replicas' unfinished records, and ``--resume`` (or rerunning the command, locally or
on Ray) skips every record any replica finished. That needs OUT's folder on a filesystem every
node sees; without one, records still reach the driver's work file as batches complete.

    import ray
    from specbatch.ray import build_processor
    process = build_processor(model="smollm2-135m", method="ngram", k=5, replicas=2,
                              max_tokens=128)
    out = process(ray.data.read_json("in.jsonl"))   # rows: records in the input format
    out.write_json("out/")                          # rows: the input + output fields

Resources: a GPU replica (``device="cuda"``) requests ``num_gpus=1``; a CPU replica requests
``cpus_per_replica`` cores (default: the cluster's CPUs / replicas) and runs torch with as many
threads. With ``method="auto"`` every replica calibrates on its node, or reads the calibration
cache (``SPECBATCH_CACHE``) when its node has one, and adapts on its own.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from specbatch.config import EngineConfig, SamplingParams, SpecConfig

INSTALL_HINT = ("Ray is not installed: pip install 'specbatch[ray]' (or pip install "
                "'ray[data]>=2.40') on every node")


class RayUnavailable(ImportError):
    """Ray (``ray[data]``) cannot be imported; the message says how to install it."""


class ReplicaFailed(RuntimeError):
    """The job on Ray stopped: a replica failed (and Ray gave up retrying it), or the cluster
    went away. The message is one line; the records finished so far are kept."""


def import_ray():
    """``ray`` with ``ray.data`` loaded; raises ``RayUnavailable`` with ``INSTALL_HINT``."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise RayUnavailable(INSTALL_HINT) from None
    return ray


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica builds its ``LLM`` from. out_path / num_records: where its work file
    goes (``None``: write none) and the job's record count (indices are checked against it)."""

    model: str | None
    spec: SpecConfig
    engine: EngineConfig
    cache_dir: str | None = None
    seed: int = 0
    num_threads: int | None = None
    out_path: str | None = None
    num_records: int = 0
    defaults: SamplingParams = SamplingParams()  # for rows in the input format


class Replica:
    """A Ray Data actor holding one ``LLM``. A batch is either the driver's rows
    (``{"index": int, "record": pickled Record}``) or rows in the input format (``build_processor``);
    it yields one row per finished record as it finishes."""

    def __init__(self, config: ReplicaConfig) -> None:
        if config.num_threads:
            import torch

            torch.set_num_threads(config.num_threads)
        from specbatch.llm import LLM

        self.config = config
        self.llm = LLM.from_config(config.model, config.spec, config.engine,
                                   cache_dir=config.cache_dir, seed=config.seed)
        self.shard = None
        if config.out_path is not None:
            from specbatch.io.writer import WorkShard

            self.shard = WorkShard(config.out_path, f"{socket.gethostname()}-{os.getpid()}",
                                   config.num_records)

    def __call__(self, batch: dict) -> Iterator[dict]:
        import numpy as np
        import orjson

        from specbatch.io.openai_batch import output_line

        if "record" in batch:  # from the driver: validated records
            records = [pickle.loads(b) for b in batch["record"]]
            for rec, out in self.llm.generate_records(records):
                if self.shard is not None:
                    self.shard.write(rec.index, output_line(rec, out, self.llm.model_id))
                yield {"index": np.array([rec.index]),
                       "out": np.array([orjson.dumps(out)], dtype=object)}
            if self.shard is not None:
                self.shard.sync()  # the batch is done: on disk, whatever happens next
            return
        rows = _rows_of(batch)
        records = self.llm.to_records(rows, self.config.defaults)
        for rec, out in self.llm.generate_records(records):
            yield {k: np.array([v], dtype=object) for k, v in {**rec.fields, **out}.items()}


def _rows_of(batch: dict) -> list[dict]:
    """Columns (numpy arrays) -> row dicts, with numpy values back to Python (and None for a
    missing cell)."""
    import numpy as np

    def plain(v):
        if isinstance(v, np.ndarray):
            return [plain(x) for x in v.tolist()]
        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, list):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    names = list(batch)
    num = len(batch[names[0]]) if names else 0
    rows = []
    for i in range(num):
        row = {k: plain(batch[k][i]) for k in names}
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows


def _resources(engine: EngineConfig, replicas: int, cpus_per_replica: int | None,
               ray) -> dict:
    if engine.device.startswith("cuda"):
        return {"num_gpus": 1, "num_cpus": cpus_per_replica or 1}
    if cpus_per_replica is None:
        total = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1))
        cpus_per_replica = max(1, total // replicas)
    return {"num_cpus": cpus_per_replica}


def _quiet_data_context(ray) -> None:
    import logging

    logging.getLogger("ray.data").setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the driver has its own bar
    ctx.verbose_stats_logs = False
    ctx.print_on_execution_start = False


def init_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Connect to the cluster at ``address`` (``auto``: the one ``ray start`` runs here), or
    start a local one with ``num_cpus`` (default: this machine's). Returns whether this call
    connected (so the caller shuts it down); False when Ray was already initialised."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    import logging

    # Ray's own notes (auth token, deprecations, executor progress) would bury the run's lines;
    # failures still raise in the driver
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "fatal")
    # errors inside Ray's own actors (its stats actor's KeyError) printed tracebacks on runs
    # that succeeded; an error of ours still raises in the driver
    os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    for name in ("ray", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    kwargs: dict[str, Any] = {"logging_level": logging.ERROR, "log_to_driver": False,
                              "include_dashboard": False}
    if address is None:
        kwargs.update(num_cpus=num_cpus or os.cpu_count(), object_store_memory=256 << 20)
    ray.init(address=address, **kwargs)
    return True


def generate_on_ray(records: list, *, model: str | None, spec: SpecConfig,
                    engine: EngineConfig, replicas: int, address: str | None = None,
                    cache_dir: str | None = None, seed: int = 0,
                    out_path: str | None = None, num_records: int = 0,
                    cpus_per_replica: int | None = None, batch_size: int | None = None,
                    on_tokens: Callable[[int, Any], None] | None = None,
                    ) -> Iterator[tuple[Any, dict]]:
    """``specbatch run --ray``: generate ``records`` (validated ``Record``s) over ``replicas``
    replicas; yields ``(record, output_fields)`` as batches finish, like
    ``LLM.generate_records``. Connects to (or starts) Ray and shuts it down when done or
    interrupted. batch_size: records per replica call (default: two calls per replica, at
    most ``engine.max_batch_size`` records each)."""
    import orjson

    from specbatch.spec_decode.stats import SpecStats

    ray = import_ray()
    started = init_ray(address)
    try:
        _quiet_data_context(ray)
        if not records:
            return
        num_threads = None
        resources = _resources(engine, replicas, cpus_per_replica, ray)
        if not engine.device.startswith("cuda"):
            num_threads = int(resources["num_cpus"])
        if batch_size is None:
            batch_size = max(1, min(engine.max_batch_size, -(-len(records) // (2 * replicas))))
        config = ReplicaConfig(model, spec, engine, cache_dir, seed, num_threads, out_path,
                               num_records)
        rows = [{"index": r.index, "record": pickle.dumps(r)} for r in records]
        ds = ray.data.from_items(rows, override_num_blocks=-(-len(rows) // batch_size))
        out = ds.map_batches(Replica, fn_constructor_args=(config,), batch_size=batch_size,
                             batch_format="numpy",
                             compute=ray.data.ActorPoolStrategy(size=replicas), **resources)
        by_index = {r.index: r for r in records}
        rows = iter(out.iter_rows())
        while True:
            try:
                row = next(rows)
            except StopIteration:
                break
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except Exception as e:  # Ray's errors carry a remote traceback: one line of it
                raise ReplicaFailed(_first_line(e)) from e
            rec, fields = by_index[int(row["index"])], orjson.loads(row["out"])
            if on_tokens is not None:
                on_tokens(fields["usage"]["completion_tokens"],
                          SpecStats.from_dict(fields["spec"]))
            yield rec, fields
    finally:
        if started:
            ray.shutdown()


def _first_line(e: BaseException) -> str:
    """The last line of the innermost cause that names an error (``ValueError: ...``)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    named = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception", "Died"))]
    return (named or lines or [type(e).__name__])[-1][:300]


def build_processor(model: str | None = None, method: str = "auto", k: int = 5, *,
                    replicas: int = 1, dtype: str = "auto", device: str = "cpu",
                    max_batch_size: int = 16, max_model_len: int | None = None,
                    prompt_lookup_min: int = 2, prompt_lookup_max: int = 4,
                    draft_model: str | None = None, cache_dir: str | None = None,
                    seed: int = 0, cpus_per_replica: int | None = None,
                    batch_size: int | None = None, **sampling,
                    ) -> Callable[[Any], Any]:
    """A function of a ``ray.data.Dataset`` of records in the input format (``prompt`` /
    ``messages`` / ``turns``, optional ``id`` and per-record sampling fields) that returns the
    dataset of output rows (the input fields plus ``output``, ``output_token_ids``,
    ``finish_reason``, ``stop_reason``, ``usage``, ``spec``), generated by ``replicas``
    ``LLM`` actors. ``sampling``: ``SamplingParams`` fields, the defaults of every record.
    Call ``ray.init`` first (else a local Ray starts). Raises ``ValueError`` for a bad option
    and ``RayUnavailable`` without Ray. Row ids: a row without ``id`` gets its position in its
    batch; give ids (or use ``specbatch run --ray``) for a stable seed at T > 0."""
    ray = import_ray()
    spec = SpecConfig(method=method, num_speculative_tokens=k,
                      prompt_lookup_min=prompt_lookup_min, prompt_lookup_max=prompt_lookup_max,
                      draft_model=draft_model)
    # dtype auto resolved here, once, for the model: every replica runs the driver's choice
    engine = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                          dtype=dtype, device=device).for_model(model, cache_dir)
    unknown = sorted(set(sampling) - {f.name for f in fields(SamplingParams)})
    if unknown:
        raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    defaults = SamplingParams.from_dict(sampling)  # lists, logit_bias {"id": bias}, ...
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas={replicas!r}: expected an integer >= 1")

    def process(ds):
        if not ray.is_initialized():
            init_ray()
        _quiet_data_context(ray)
        resources = _resources(engine, replicas, cpus_per_replica, ray)
        threads = None if device.startswith("cuda") else int(resources["num_cpus"])
        config = ReplicaConfig(model, spec, engine, cache_dir, seed, threads, defaults=defaults)
        return ds.map_batches(Replica, fn_constructor_args=(config,),
                              batch_size=batch_size or max_batch_size, batch_format="numpy",
                              compute=ray.data.ActorPoolStrategy(size=replicas), **resources)

    return process


__all__ = ["build_processor", "generate_on_ray", "init_ray", "import_ray", "RayUnavailable",
           "ReplicaFailed",
           "Replica", "ReplicaConfig", "INSTALL_HINT"]
