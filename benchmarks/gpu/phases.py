"""The GPU check's measuring phases, each run by ``check.py`` in its own process (a hard
timeout can then stop it, and a crash or a hung kernel costs only that phase).

    python benchmarks/gpu/phases.py probe SETTINGS.json OUT.json
    python benchmarks/gpu/phases.py model SETTINGS.json OUT.json MODEL

A phase rewrites OUT.json after every item it finishes, so a phase stopped by its timeout still
leaves what it measured. ``SETTINGS.json`` is ``check.Settings`` as a dict; ``deadline_s`` in it
is the phase's own soft budget: items that would start after their share of it are skipped and
listed in ``skipped``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


class Phase:
    """The phase's JSON document, saved atomically after each change."""

    def __init__(self, path: Path, budget_s: float) -> None:
        self.path, self.start, self.budget_s = path, time.perf_counter(), budget_s
        self.doc: dict = {"skipped": [], "errors": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def may_start(self, what: str, share: float) -> bool:
        """Whether ``what`` may start: before ``share`` of the budget has passed; else it is
        listed as skipped."""
        if self.elapsed() <= share * self.budget_s:
            return True
        self.doc["skipped"].append(f"{what} (out of time at {self.elapsed():.0f} s)")
        self.save()
        return False

    def save(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 2)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1) + "\n")
        os.replace(tmp, self.path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def torch_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "int8": torch.float32}[name]


# ---------------------------------------------------------------- probe


def dense_shapes(shape: str) -> list[tuple[int, int]]:
    """(in_features, out_features) of one layer's dense matmuls (fused q/k/v, o, fused
    gate/up, down) and lm_head, for a dummy shape."""
    from specbatch.models.dummy import DUMMY_SHAPES

    c = DUMMY_SHAPES[shape]
    hidden, inter, head_dim = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden),
            (hidden, c["vocab_size"])]


def time_dense(linear, shapes, num_layers: int, rows: int, dtype, device, repeats: int) -> float:
    """Seconds of one step's dense matmuls (``num_layers`` x the layer's, lm_head once) at
    ``rows`` rows: the best of ``repeats``."""
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).div_(k ** 0.5).to(dtype).to(device)
               for k, n in shapes]
    xs = [torch.randn(rows, k, generator=gen).to(dtype).to(device) for k, _ in shapes]
    best = float("inf")
    for i in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(num_layers):
            for x, w in zip(xs[:-1], weights[:-1]):
                linear(x, w, None)
        linear(xs[-1], weights[-1], None)
        sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def run_probe(settings: dict, out: Path) -> int:
    """Row invariance of the dense layers (``dense.probe_row_invariance``) and of RMSNorm, and
    what the invariant matmul costs. On CUDA: ``benchmarks/gpu/dense_cost.py`` first, in its
    own process (plain cuBLAS against the Triton matmul on the 1.5B shapes, eager and
    CUDA-graph times, its probe), then here, after vLLM's Hopper setting
    (``dense.apply_cublas_batch_invariant``, as the engine applies it before its probe): the
    probe of cuBLAS and of the Triton matmul on every model's shapes, RMSNorm's, and one step's
    dense matmuls timed with each. On a CPU: the probe and timing of ``F.linear`` and the
    engine's matmul (``dense.linear_for``). What a checkout lacks is "not available"."""
    import torch.nn.functional as F

    phase = Phase(out, settings["deadline_s"])
    doc = phase.doc
    device = torch.device(settings["device"])
    dtype = torch_dtype(settings["dtype"])
    shapes = {m: dense_shapes(m.removeprefix("dummy:").split(":")[0]) for m in settings["models"]}
    try:
        from specbatch.models import dense
    except ImportError as e:
        doc["probe"] = f"not available ({e})"
        phase.save()
        return 0
    if device.type == "cuda":
        doc["dense_cost_plain_cublas"] = dense_cost(settings, 0.45 * settings["deadline_s"])
        phase.save()
        if hasattr(dense, "apply_cublas_batch_invariant"):
            doc["cublas_setting"] = "vLLM Hopper (no split-K)"
            dense.apply_cublas_batch_invariant()
    impls = {("cublas" if device.type == "cuda" else "F.linear"): F.linear}
    if device.type == "cuda":
        try:
            from specbatch.kernels.matmul import linear as triton_linear

            impls["triton"] = lambda x, w, b=None: triton_linear(x, w, b)
        except ImportError as e:
            doc["triton_matmul"] = f"not available ({e})"
    else:
        engine_linear = dense.linear_for(dtype, device)
        if engine_linear is not F.linear:
            impls[f"engine ({dense.linear_name(engine_linear)})"] = engine_linear
    doc["impls"] = list(impls)
    probe = getattr(dense, "probe_row_invariance", None)
    if probe is None:
        doc["probe"] = "not available: specbatch.models.dense has no probe_row_invariance"
    else:
        results = doc.setdefault("probe", {})
        for name, fn in impls.items():
            for model, model_shapes in shapes.items():
                if not phase.may_start(f"probe {name} {model}", 0.75):
                    break
                try:
                    report = probe(fn, model_shapes, dtype, device, rows=settings["probe_rows"])
                    results[f"{name} {model}"] = {
                        "invariant": all(r["invariant"] for r in report.values()),
                        "shapes": report}
                except Exception as e:  # noqa: BLE001 - a report, not a crash
                    results[f"{name} {model}"] = {"error": f"{type(e).__name__}: {e}"}
                phase.save()
    try:
        from specbatch.kernels.rmsnorm import rms_norm
    except ImportError as e:
        doc["rms_norm"] = f"not available ({e})"
    else:
        if device.type == "cuda" and phase.may_start("rms_norm invariance", 0.8):
            try:
                doc["rms_norm"] = rms_norm_invariance(rms_norm, dtype, device)
            except Exception as e:  # noqa: BLE001
                doc["rms_norm"] = {"error": f"{type(e).__name__}: {e}"}
    phase.save()
    # one step's dense matmuls with each, rows 1 / 16 / 64
    from specbatch.models.dummy import DUMMY_SHAPES

    timing = doc.setdefault("dense_step_ms", {})
    for model, model_shapes in shapes.items():
        layers = DUMMY_SHAPES[model.removeprefix("dummy:").split(":")[0]]["num_hidden_layers"]
        for name, fn in impls.items():
            for r in settings["dense_rows"]:
                if not phase.may_start(f"dense timing {name} {model} {r} rows", 0.9):
                    break
                cell = timing.setdefault(model, {}).setdefault(name, {})
                try:
                    t = time_dense(fn, model_shapes, layers, r, dtype, device,
                                   settings["dense_repeats"])
                    cell[str(r)] = round(t * 1e3, 4)
                except Exception as e:  # noqa: BLE001
                    cell[str(r)] = f"{type(e).__name__}: {e}"
                phase.save()
    phase.save()
    return 0


def dense_cost(settings: dict, timeout: float) -> dict:
    """``benchmarks/gpu/dense_cost.py --probe`` (plain cuBLAS, its own process): its JSON, or
    what went wrong."""
    import subprocess

    script = Path(__file__).resolve().with_name("dense_cost.py")
    if not script.is_file():
        return {"error": "not available: benchmarks/gpu/dense_cost.py is missing"}
    cmd = [sys.executable, str(script), "--rows", *map(str, settings["dense_rows"]),
           "--dtype", settings["dtype"], "--iters", "20", "--probe"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"stopped after {timeout:.0f} s"}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-800:]}"}


def rms_norm_invariance(rms_norm, dtype, device) -> dict:
    """Whether ``rms_norm`` gives a row the same bits at 1, 2, 6, 16, 64 and 100 rows, in a
    shuffled order."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for hidden in (576, 2048):
        x = torch.randn(100, hidden, generator=gen).to(dtype).to(device)
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
        full = rms_norm(x, w, 1e-5)
        same = True
        for m in (1, 2, 6, 16, 64, 100):
            pick = torch.randperm(100, generator=gen)[:m].to(device)
            same &= bool(torch.equal(rms_norm(x[pick], w, 1e-5), full[pick]))
        out[str(hidden)] = same
    return out


# ---------------------------------------------------------------- model


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device copy moves (read + write), best of 5 after a warm-up."""
    x = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * num_bytes / best


def streamed_bytes(model) -> int:
    """Weight bytes a decode step reads: every parameter, but the embedding only where it is
    also lm_head (tied); an untied embedding is read a row per token."""
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if tied or p is not embed)


def outputs_of(prepared_run) -> dict:
    return {rec.index: out for rec, out in prepared_run}


def run_model(settings: dict, out: Path, model_name: str) -> int:
    """Load one dummy model, then: step time against the weight-streaming floor, a warm-up of
    every method (Triton compiles, auto's calibration), the timed runs (method x batch, every
    output compared with the first run's) and ``none`` against transformers ``generate``."""
    from specbatch import LLM, SamplingParams
    from specbatch.config import EngineConfig, SpecConfig
    from specbatch.auto.costmodel import measure
    from specbatch.spec_decode.stats import SpecStats

    phase = Phase(out, settings["deadline_s"])
    doc = phase.doc
    device = torch.device(settings["device"])
    handler = logging.Handler(logging.INFO)  # the engine's own lines (which dense layers, ...)
    handler.emit = lambda record: doc.setdefault("log", []).append(record.getMessage())
    logger = logging.getLogger("specbatch")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    t0 = time.perf_counter()
    llm = LLM(model_name, method="none", dtype=settings["dtype"], device=settings["device"],
              max_batch_size=max(settings["batches"]), max_model_len=settings["max_model_len"],
              echo=lambda line: doc.setdefault("notes", []).append(line))
    hf = llm.loaded.model
    doc.update(model_id=llm.model_id, load_s=round(time.perf_counter() - t0, 2),
               parameters=sum(p.numel() for p in hf.parameters()),
               dtype=str(hf.dtype).removeprefix("torch."))
    phase.save()

    # ---- step time against the floor
    bandwidth = copy_bandwidth(device, settings["copy_bytes"])
    weights = streamed_bytes(hf)
    floor = weights / bandwidth
    doc["floor"] = {"streamed_weight_bytes": weights, "copy_bandwidth_bytes_per_s": bandwidth,
                    "floor_us": round(floor * 1e6, 2)}
    runner = llm.new_runner(max(r for r, _ in settings["step_shapes"]),
                            settings["step_context"] + 16)
    from specbatch.models import dense

    doc["engine"] = {"dense": dense.linear_name(runner.forward.linear),
                     "triton_kernels": bool(getattr(runner.forward, "use_kernels", False))}
    steps = doc.setdefault("steps", [])
    for rows, q in settings["step_shapes"]:
        if not phase.may_start(f"step {rows}x{q}", 0.2):
            break
        try:
            t = measure(runner.forward, rows, q, settings["step_context"],
                        repeats=settings["step_repeats"], cache=runner.cache)
            steps.append({"rows": rows, "tokens": q, "fed_tokens": max(q, 2 if rows == 1 else 1),
                          "context": settings["step_context"], "us": round(t * 1e6, 1),
                          "x_floor": round(t / floor, 2)})
        except Exception as e:  # noqa: BLE001
            steps.append({"rows": rows, "tokens": q, "error": f"{type(e).__name__}: {e}"})
        phase.save()
    del runner

    # ---- records
    rows_in = [json.loads(line) for line in
               Path(settings["records_path"]).read_text().splitlines() if line.strip()]
    rows_in = rows_in[:settings["records"]]
    params = SamplingParams(max_tokens=settings["max_tokens"])
    records = llm.to_records([{"id": str(r.get("question_id", i)), "turns": r["turns"]}
                              for i, r in enumerate(rows_in)], params)
    base = EngineConfig(max_batch_size=max(settings["batches"]),
                        max_model_len=settings["max_model_len"], dtype=settings["dtype"],
                        device=settings["device"])
    fitted = llm.fit_engine_config(records, base, echo=lambda line: None)

    def engine_at(batch: int, num_records: int) -> EngineConfig:
        return replace(fitted, max_batch_size=max(1, min(batch, fitted.max_batch_size,
                                                         num_records)))

    def spec_of(method: str) -> SpecConfig:
        return SpecConfig(method=method, num_speculative_tokens=settings["k"])

    # ---- warm-up: compiles, calibration (auto), first-call costs; not timed below
    t0 = time.perf_counter()
    warm = llm.to_records([{"id": "warm", "turns": rows_in[0]["turns"][:1]}],
                          SamplingParams(max_tokens=4))
    for method in settings["methods"]:
        if not phase.may_start(f"warm-up {method}", 0.4):
            break
        try:
            outputs_of(llm.prepare(warm, spec_of(method), engine_at(1, 1),
                                   echo=lambda line: None).run())
        except Exception as e:  # noqa: BLE001
            doc["errors"].append(f"warm-up {method}: {type(e).__name__}: {e}")
    sync(device)
    doc["warmup_s"] = round(time.perf_counter() - t0, 2)
    phase.save()

    # ---- the runs: batch 16 and 64 first, batch 1 (the slowest) last
    runs = doc.setdefault("runs", [])
    reference = None
    mismatches = doc.setdefault("mismatches", [])
    order = sorted(settings["batches"], key=lambda b: (b == 1, b))
    for batch in order:
        for method in settings["methods"]:
            label = f"{method} batch {batch}"
            if not phase.may_start(label, settings["runs_share"]):
                continue
            engine = engine_at(batch, len(records))
            try:
                sync(device)
                t0 = time.perf_counter()
                outs = outputs_of(llm.prepare(records, spec_of(method), engine,
                                              echo=lambda line: None).run())
                sync(device)
                wall = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                runs.append({"method": method, "batch": batch, "error":
                             f"{type(e).__name__}: {e}"})
                doc["errors"].append(f"{label}: {type(e).__name__}: {e}")
                phase.save()
                continue
            ids = {rec.id: outs[rec.index]["output_token_ids"] for rec in records}
            tokens = sum(outs[rec.index]["usage"]["completion_tokens"] for rec in records)
            stats = SpecStats()
            for rec in records:
                stats.merge(SpecStats.from_dict(outs[rec.index]["spec"]))
            runs.append({"method": method, "batch": batch, "rows": engine.max_batch_size,
                         "records": len(records), "tokens": tokens, "wall_s": round(wall, 3),
                         "tok_s": round(tokens / wall, 1),
                         "mean_acceptance_length": stats.mean_acceptance_length})
            if reference is None:
                reference = (label, ids)
                doc["reference_run"] = label
                (out.parent / f"outputs_{out.stem}.json").write_text(json.dumps(ids) + "\n")
            else:
                differ = [rid for rid in ids if ids[rid] != reference[1][rid]]
                if differ:
                    first = differ[0]
                    mismatches.append({"run": label, "against": reference[0],
                                       "records_differing": len(differ), "first_record": first,
                                       "first_position": first_difference(ids[first],
                                                                          reference[1][first])})
            phase.save()
    doc["identical"] = bool(runs) and not mismatches and not any("error" in r for r in runs)

    # ---- none against transformers generate: first turns, greedy, exactly max_tokens each
    hf_rows = doc.setdefault("hf", [])
    n_tokens = settings["max_tokens"]
    first_turns = llm.to_records(
        [{"id": str(r.get("question_id", i)),
          "messages": [{"role": "user", "content": r["turns"][0]}]}
         for i, r in enumerate(rows_in)],
        SamplingParams(max_tokens=n_tokens, min_tokens=n_tokens))
    for batch in settings["batches"]:
        subset = first_turns[:settings["hf_records_batch1"]] if batch == 1 else first_turns
        if not phase.may_start(f"transformers generate batch {batch}", 0.92):
            continue
        entry = {"batch": batch, "records": len(subset)}
        try:
            engine = engine_at(batch, len(subset))
            sync(device)
            t0 = time.perf_counter()
            outs = outputs_of(llm.prepare(subset, spec_of("none"), engine,
                                          echo=lambda line: None).run())
            sync(device)
            ours_s = time.perf_counter() - t0
            ours = {rec.id: outs[rec.index]["output_token_ids"] for rec in subset}
            prompts = {rec.id: llm.renderer.first_prompt(rec)[0] for rec in subset}
            theirs, theirs_s = hf_generate(hf, prompts, engine.max_batch_size, n_tokens,
                                           llm.loaded.eos_token_ids, device)
            ours_tokens = sum(len(v) for v in ours.values())
            theirs_tokens = sum(len(v) for v in theirs.values())
            entry.update(rows=engine.max_batch_size, specbatch_tok_s=round(ours_tokens / ours_s, 1),
                         transformers_tok_s=round(theirs_tokens / theirs_s, 1),
                         ratio=round((ours_tokens / ours_s) / (theirs_tokens / theirs_s), 2),
                         same_tokens=sum(ours[i] == theirs[i] for i in ours))
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"
            doc["errors"].append(f"transformers batch {batch}: {entry['error']}")
        hf_rows.append(entry)
        phase.save()
    phase.save()
    return 0


def first_difference(a: list, b: list) -> str:
    """Where two outputs (a list of turns of token ids, or one list) first differ:
    ``turn T token I``."""
    turns_a = a if a and isinstance(a[0], list) else [a]
    turns_b = b if b and isinstance(b[0], list) else [b]
    for t, (x, y) in enumerate(zip(turns_a, turns_b)):
        for i, (u, v) in enumerate(zip(x, y)):
            if u != v:
                return f"turn {t} token {i}"
        if len(x) != len(y):
            return f"turn {t} token {min(len(x), len(y))} (lengths {len(x)}, {len(y)})"
    return f"turns {len(turns_a)} vs {len(turns_b)}"


def hf_generate(model, prompts: dict, batch: int, n_tokens: int, eos_ids, device):
    """transformers ``generate``, greedy, exactly ``n_tokens`` new tokens per prompt, batches of
    ``batch`` prompts (longest first, left-padded): (id -> new token ids, seconds)."""
    order = sorted(prompts, key=lambda i: -len(prompts[i]))
    pad = eos_ids[0] if eos_ids else 0
    out, seconds = {}, 0.0
    for s in range(0, len(order), batch):
        ids = order[s:s + batch]
        width = max(len(prompts[i]) for i in ids)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for r, i in enumerate(ids):
            p = prompts[i]
            input_ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            gen = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                                 pad_token_id=pad, eos_token_id=list(eos_ids) or None)
        sync(device)
        seconds += time.perf_counter() - t0
        for r, i in enumerate(ids):
            out[i] = gen[r, width:].tolist()
    return out, seconds


def main(argv: list[str]) -> int:
    what, settings_path, out = argv[0], Path(argv[1]), Path(argv[2])
    settings = json.loads(settings_path.read_text())
    if settings["device"] == "cpu" and settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    if what == "probe":
        return run_probe(settings, out)
    if what == "model":
        return run_model(settings, out, argv[3])
    raise SystemExit(f"unknown phase {what!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
