"""Step-cost model: seconds per target forward as a function of batch shape, measured here.

``calibrate`` times decode/verify steps of the loaded model on this machine (dtype, device) for
a grid of rows in the batch, query tokens per row (k + 1) and context length, with warm-up and
repeats (fastest), and fits

    step_time(rows, q, ctx) = c0 + c1 * rows * q + c2 * rows * ctx + c3 * rows * q * ctx

by least squares: weight matmuls grow with the tokens in the batch (rows * q), attention with
the keys read (rows * ctx) and scored (rows * q * ctx). The fit is cached as JSON per
(model, dtype, device, host) under the cache directory; ``run --method auto`` calibrates on
first use (a few seconds).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

ROWS = (1, 4, 16)
QUERY_LENS = (1, 2, 4, 6, 9)
CONTEXTS = (256, 1024)


@dataclass(frozen=True)
class CostModel:
    """Fitted step time (seconds). coef: (c0, c1, c2, c3) as in the module docstring.

    samples: the measurements ``[rows, q, ctx, seconds]`` the fit came from.
    """

    coef: tuple[float, float, float, float]
    model_id: str = ""
    dtype: str = ""
    device: str = ""
    host: str = ""
    samples: tuple[tuple[int, int, int, float], ...] = ()

    def step_time(self, num_rows: int, query_len: int, context_len: int,
                  num_tokens: int | None = None) -> float:
        """Predicted seconds for one forward over ``num_rows`` rows padded to ``query_len``
        new tokens, attending to ``context_len`` keys (tokens). num_tokens: the real tokens
        when rows feed different lengths and the dense layers run packed (``runner.verify``);
        default ``num_rows * query_len``. Attention always costs the padded shape."""
        c0, c1, c2, c3 = self.coef
        r, q, c = num_rows, query_len, context_len
        t = r * q if num_tokens is None else num_tokens
        return max(c0 + c1 * t + c2 * r * c + c3 * r * q * c, 1e-6)

    def token_cost(self) -> float:
        """Seconds one more packed token adds to a step (the dense layers' share), >= 0."""
        return max(self.coef[1], 0.0)

    def speedup(self, num_rows: int, k: int, context_len: int, tokens_per_step: float) -> float:
        """Throughput with k drafts per row relative to plain decoding (k = 0)."""
        return (tokens_per_step / self.step_time(num_rows, k + 1, context_len)
                * self.step_time(num_rows, 1, context_len))

    def save(self, path: str | os.PathLike) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, p)


class OnlineCost:
    """A ``CostModel`` that keeps fitting while the engine runs.

    The calibration grid is measured in a few seconds on synthetic batches; the steps of a real
    run (other shapes, a warmer or busier machine, the engine's own work) can cost more or less.
    Each verify step's wall time is added to the calibration samples and the four coefficients
    are refitted (weighted least squares on relative error, as ``fit``; the normal equations are
    accumulated, so an update is O(1)). The calibration samples, worth ``prior_weight`` steps in
    all, keep the fit sane for shapes the run has not tried yet; after a few dozen steps the
    run's own timings dominate. Same interface as ``CostModel`` (``step_time``, ``token_cost``).
    """

    def __init__(self, base: CostModel, prior_weight: float = 8.0, refit_every: int = 8) -> None:
        self.model = base  # the current fit; ``coef`` replaced at each refit
        self.refit_every = refit_every
        self.num_observed = 0
        self._a = torch.zeros(4, 4, dtype=torch.float64)
        self._b = torch.zeros(4, dtype=torch.float64)
        # the calibration counts as ``prior_weight`` observed steps in all
        for r, q, c, sec in base.samples:
            self._add(r, q, c, r * q, sec, prior_weight / len(base.samples))

    def _add(self, rows: int, q: int, ctx: int, tokens: int, seconds: float,
             weight: float = 1.0) -> None:
        x = torch.tensor([1.0, tokens, rows * ctx, rows * q * ctx], dtype=torch.float64) / seconds
        self._a += weight * torch.outer(x, x)
        self._b += weight * x  # target: seconds / seconds = 1

    def observe(self, num_rows: int, query_len: int, context_len: int, num_tokens: int,
                seconds: float) -> None:
        """One measured step (shape as in ``step_time``; seconds of wall time)."""
        if seconds <= 0:
            return
        self._add(num_rows, query_len, context_len, num_tokens, seconds)
        self.num_observed += 1
        if self.num_observed % self.refit_every == 0:
            try:
                coef = tuple(float(v) for v in torch.linalg.solve(self._a, self._b))
                self.model = replace(self.model, coef=coef)
            except RuntimeError:  # singular (no calibration samples): keep the last fit
                pass

    def step_time(self, num_rows: int, query_len: int, context_len: int,
                  num_tokens: int | None = None) -> float:
        return self.model.step_time(num_rows, query_len, context_len, num_tokens)

    def token_cost(self) -> float:
        return self.model.token_cost()


def load(path: str | os.PathLike) -> CostModel:
    """Read a cost model written by ``CostModel.save``; raises ``ValueError`` if malformed."""
    try:
        d = json.loads(Path(path).read_text())
        return CostModel(coef=tuple(d["coef"]), model_id=d.get("model_id", ""),
                         dtype=d.get("dtype", ""), device=d.get("device", ""),
                         host=d.get("host", ""),
                         samples=tuple(tuple(s) for s in d.get("samples", ())))
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a specbatch calibration file ({e})") from None


def fit(samples: list[tuple[int, int, int, float]]) -> tuple[float, float, float, float]:
    """Least-squares fit of the four coefficients, relative error weighted (each sample's row
    divided by its time) so small steps count as much as large ones."""
    feats = torch.tensor([[1.0, r * q, r * c, r * q * c] for r, q, c, _ in samples],
                         dtype=torch.float64)
    t = torch.tensor([s[3] for s in samples], dtype=torch.float64)
    w = 1.0 / t
    sol = torch.linalg.lstsq(feats * w[:, None], (t * w)[:, None]).solution[:, 0]
    return tuple(float(x) for x in sol)


def measure(forward, rows: int, query_len: int, context_len: int, repeats: int = 3) -> float:
    """Fastest of ``repeats`` timings of one decode/verify forward of this shape, after one
    warm-up (the minimum, not the median: other processes only ever add time)."""
    from specbatch.engine.kv_cache import KVCache  # noqa: F401  (cache type for readers)

    cache = forward.new_cache(rows, context_len + query_len + 1)
    for r in range(rows):
        cache.seq_lens[r] = context_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, forward.vocab_size, (rows, max(query_len, 2 if rows == 1 else 1)),
                        generator=gen).to(forward.device)
    qlen = ids.shape[1]
    positions = (context_len + torch.arange(qlen))[None, :].expand(rows, -1).to(forward.device)
    row_ids = torch.arange(rows, device=forward.device)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        forward.forward(ids, positions, cache, row_ids)
        if forward.device.type == "cuda":
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def calibrate(forward, model_id: str = "", dtype: str = "", repeats: int = 3,
              rows_grid=ROWS, query_grid=QUERY_LENS, context_grid=CONTEXTS) -> CostModel:
    """Measure the grid and fit. ``forward``: a ``LlamaForward``. Takes ~5-15 s on a 2-core CPU
    for SmolLM2-135M."""
    samples = [(r, q, c, measure(forward, r, q, c, repeats))
               for c in context_grid for r in rows_grid for q in query_grid]
    return CostModel(fit(samples), model_id=model_id, dtype=dtype, device=str(forward.device),
                     host=host_id(), samples=tuple(samples))


def host_id() -> str:
    return f"{platform.node()}/{platform.processor() or platform.machine()}/{os.cpu_count()}cpu"


def cache_path(cache_root: Path, model_id: str, dtype: str, device: str) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in
                   f"{model_id}-{dtype}-{device}-{host_id()}")
    return cache_root / "calibration" / f"{safe}.json"


def load_or_calibrate(forward, model_id: str, dtype: str, cache_root: Path,
                      recalibrate: bool = False) -> tuple[CostModel, Path, bool]:
    """The cached cost model for this (model, dtype, device, host), measured if absent.
    Returns (model, path, was_measured_now)."""
    path = cache_path(cache_root, model_id, dtype, str(forward.device))
    if path.exists() and not recalibrate:
        try:
            return load(path), path, False
        except ValueError:
            pass
    model = calibrate(forward, model_id=model_id, dtype=dtype)
    model.save(path)
    return model, path, True
