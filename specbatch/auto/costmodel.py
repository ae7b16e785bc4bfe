"""Step-cost model: seconds per target forward as a function of batch shape, measured here.

``calibrate`` times decode/verify steps of the loaded model on this machine (dtype, device) for
a grid of rows in the batch, query tokens per row (k + 1) and context length, in interleaved
sweeps (fastest of each shape), and fits

    step_time(rows, q, ctx) = c0 + dense(rows * q) + c2 * rows * ctx + c3 * rows * q * ctx

by non-negative least squares: weight matmuls grow with the tokens in the batch (t = rows * q),
attention with the keys read (rows * ctx) and scored (rows * q * ctx). Where the forward packs
a verify step whose rows feed different lengths (``CostModel.packed``: the CPU C attention, each
real token reads its own row), the last term counts the real tokens, ``c3 * t * ctx``, not
every row padded to the longest: with one row drafting 15 tokens and fifteen drafting 2, the
padded term priced a batch-16 step of the extraction job at 49 ms where it took 37 (session 15),
and ``auto`` cut long drafts that paid. ``dense`` is piecewise
linear in t, one slope per segment between ``TOKEN_KNOTS`` (4, 8, 16, 32, 64 tokens): the
matmul kernels fill their tiles as tokens grow, so a token costs more at 16 -> 32 tokens than
at 64 -> 144 (SmolLM2-135M int8, 16 rows at 256 keys: q 1 -> 2 cost 1.4 ms a token, q 6 -> 9
0.9 ms; one slope over-priced long drafts and under-priced the first, and ``auto`` drafted
where it did not pay at batch 16, docs/benchmarks.md session 10). Where the forward packs
(``CostModel.tiled``), two more terms: ``ct * ceil(t / tile_tokens)`` (the matmuls multiply
``tile_tokens`` tokens a weight pass: 8 on the AVX-512 kernels, 4 on AVX2; the uniform grid's
16-row shapes are whole tiles) and ``cp * rows * q`` on a
packed step (its logits laid out padded), fitted from ``PACKED_SHAPES`` timed beside the grid:
SmolLM2-135M int8 at batch 16 (1 thread, CPU time), auto's drafting steps ran 2-3.6% further
above the uniform fit than its plain steps (16 -> 17 tokens cost 2.25 ms, the fit said 1.19),
within +-1% with these terms. On AVX2 (4-row passes) 8-token tiles missed the jump: 16 -> 17
tokens cost 4.9-5.3 ms of a 43.5 ms step (float32, 256 keys, 2-core Zen 2), the fit said 2.2,
4.1 with 4-token tiles (the fit's median deviation 4.0% -> 3.0%); int8 there costs by the
token (17 -> 24: 2.5 ms each) and its fit keeps no tile term. The slopes are non-negative,
so a step never gets cheaper with more tokens. Timings far above the fit (another process
took the CPU) are taken again, then left out, while the time budget (``BUDGET_SECONDS``)
lasts. The fit is cached as JSON per (model, dtype, device, CPU kernel path, host) under the
cache directory (``cache_path``), a
noisy one too (``CostModel.noise``, with a note; a later run on a quiet machine times it
again, ``load_or_calibrate``); ``run --method auto`` calibrates on first use
(~8 s for SmolLM2-135M float32 on a quiet 2-core CPU, at most ~20 s plus one sweep of the
grid). A job prices every step with the fit it started with (kept beside its output,
``save_job_fits``): no time measured while it runs enters a decision, so two runs of a job, or
a killed and resumed one, decide alike.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specbatch import cpu_threads, settings

ROWS = (1, 4, 16)
QUERY_LENS = (1, 2, 4, 6, 9)
CONTEXTS = (256, 1024)
# packed verify steps timed besides the uniform grid, (rows, q, real tokens), where the forward
# packs them (``StepBackend.packed_attention``): a few rows drafting, the rest feeding one token,
# at token counts that fill a matmul tile in part (TILE_TOKENS), as ``auto`` runs at batch 16
PACKED_SHAPES = ((4, 2, 5), (4, 6, 11), (16, 2, 17), (16, 2, 24), (16, 6, 21), (16, 6, 28))
# the matmul kernels multiply the tokens 8 rows at a time on AVX-512 (kernels/csrc/linear_q8.c
# MRQ, linear_f32.c MR512), 4 on AVX2 (MRA, MR_MAX): a tile started costs its weight pass
# whatever it holds. The step backend says which (``row_tile``); this where it does not
TILE_TOKENS = 8
CALIBRATION_VERSION = 7  # 1: plain least squares, no outlier check; 2: one token slope;
# 3: no packed shapes (uniform rows only; no tile or padded-logits terms); 4: the 1-row shape
# timed at 2 tokens where plain decoding feeds 1, a fresh cache's first step timed cold;
# 5: 8-token tiles everywhere; 6: the kernels' own tile (4 tokens on AVX2), no drafting-row
# term
# token counts where the dense term's slope may change (segments [0, 4], [4, 8] ... [64, inf));
# a fit keeps the knots its samples pass (``knots_for``)
TOKEN_KNOTS = (4, 8, 16, 32, 64)
OUTLIER_RESIDUAL = 0.25  # a timing this far above its fit is taken again, then left out
OUTLIER_ROUNDS = 2  # times an outlier is timed again before it is left out
MIN_SAMPLES = 12  # never leave out samples below this many (4 coefficients to fit)
NOISY_RESIDUAL = 0.08  # median |measured / fit - 1| above this: a noisy fit (a note)
NOISY_REJECTED_SHARE = 0.2  # more timings than this share left out: a noisy fit
# calibrations a noisy cached fit may merge (``load_or_calibrate``): a later run on a quiet
# machine times the grid again and keeps each shape's fastest timing, at most this many times
HEAL_CALIBRATIONS = 3
# untimed steps of each (rows, ctx) group's first shape, in every sweep: after a step of
# another group (16 rows x 1024 keys streams ~380 MB of int8's float16 KV cache for
# SmolLM2-135M) the next 2-3 steps ran slow while the weights came back into the CPU's cache
# (1 row x 1 token at 256 keys: 4.8, 4.7, 3.4, then 2.9 ms; AMX Xeon, int8). Timed after one
# warm-up, the first shape of each group read 6-17% slow in every sweep, under the outlier
# cut, and priced plain batch-1 decoding above a 4-token step
SHAPE_WARMUP_STEPS = 3
# seconds a calibration may take: after the first sweep of the grid, more sweeps and the
# outliers' retakes only while time is left (the fit uses what was measured)
BUDGET_SECONDS = 20.0
# Bump when the forward's cost changes shape (a cached fit of the old engine would mislead the
# plan): 3 = fused q/k/v and gate/up, attention without value copies (2026-12-01); 4 = the C
# float32 matmul and attention on x86-64 CPUs (kernels/csrc, 2026-12-01); 5 = the whole float32
# decode step in one C call, exact 4/8-bit weights streamed as codes, one-token batch-1 steps
# (2026-12-02); 6 = the AVX-512 matmul micro-kernels (8+ rows, and 3-8 rows on code weights,
# 1.4-1.6x faster where the CPU has them, 2026-12-02); 7 = code weights at 4-48 rows on
# AVX-512 with the accumulators in registers (8-row step 17 -> 9.5 ms, session 9); 8 = the
# query heads of a kv head share one pass over its keys and values, codes in blocks of 16 panels;
# 9 = prefill through the same C step (attention in C, tasks round-robin over threads), dtype
# int8 (8-bit activations into the code-weight matmuls, float16 KV cache; session 10); 10 =
# four keys' score sums sharing their horizontal adds (a verify token's attention ~0.40 ->
# ~0.29 ms at batch 1), two VPDPBUSD chains at few rows, thread blocks that split evenly
# (session 12); 11 = the weights prefetched ahead of each pass (int8 b1 verify of 11 tokens 15.0
# -> 12.4 ms), AVX-512 attention with two tokens a pass, prefix caching (session 13).
# 12 = the calibration records whether attention runs on the real tokens of a packed step
# (``CostModel.packed``; session 15). 13 = float32 code weights at 1-3 rows on AVX-512 on Intel
# CPUs (a batch-1 step of 1-3 tokens 15-23% cheaper on an Emerald Rapids Xeon; session 27).
# 14 = a packed verify step's logits stay packed ``[T, vocab]`` (no zeroed ``[B, Q, vocab]``
# grid and scatter: ~3 ms of a batch-16 step with 5-token drafts; session 30).
ENGINE_REVISION = 14


def engine_fingerprint() -> str:
    """What besides model, dtype, device and host sets the step cost: the engine revision,
    torch's version, its intra-op threads, the OpenMP wait policy (``OMP_WAIT_POLICY=
    PASSIVE`` made steps 1.4-1.6x slower on a 2-core VM) and whether the C kernels are on
    (``SPECBATCH_CPU_KERNELS=0``: 1.6x slower batch-16 steps; ``SPECBATCH_CPU_DECODE=torch``,
    ``SPECBATCH_CPU_WEIGHTS=float32``: 2.7x slower batch-1 steps together;
    ``SPECBATCH_CPU_AVX512=0``: 1.4-1.6x slower matmuls of 3-8+ rows). A cached fit is
    reused under the same fingerprint, the wait policy aside (``other_engine``)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "default").lower()
    kernels = ("on" if settings.cpu_kernels() else "off") + settings.cpu_switches()
    return (f"engine r{ENGINE_REVISION}, torch {torch.__version__}, "
            f"{cpu_threads.chosen_threads()} threads, OpenMP wait {policy}, C kernels {kernels}")


@dataclass(frozen=True)
class CostModel:
    """Fitted step time (seconds). coef: ``(c0, s0, c2, c3, s1, ..., sm)`` as in the module
    docstring: c0 seconds per step, s0 seconds per token up to ``knots[0]`` tokens (or for
    every token when ``knots`` is empty: the linear model ``c0 + s0 t + ...``), c2 seconds per
    row x key, c3 per token x key, s_i seconds per token between ``knots[i - 1]`` and
    ``knots[i]`` tokens (the last slope from the last knot on); where ``tiled``, then ``ct``
    seconds per matmul tile started (``ceil(t / tile_tokens)``) and ``cp`` per query slot of
    a packed step (``rows * q`` when ``t < rows * q``, else 0): what the padded ``[rows, q]``
    layout still costs there (the ids grid; on the torch reference backend, attention). Its
    logits are never padded (``runner.verify``): until engine r14 they were laid out
    ``[rows, q, vocab]``, zeros where a row fed fewer, and ``cp`` came to 18-39 us a slot
    (SmolLM2-135M int8, 2-core Xeon), ~3 ms of a batch-16 step with 5-token drafts.

    samples: the measurements ``[rows, q, ctx, seconds]`` the fit came from, a packed one
    ``[rows, q, ctx, seconds, tokens]``.
    """

    coef: tuple[float, ...]
    model_id: str = ""
    dtype: str = ""
    device: str = ""
    host: str = ""
    samples: tuple[tuple[int, int, int, float], ...] = ()
    version: int = CALIBRATION_VERSION
    rejected: tuple[tuple[int, int, int, float], ...] = ()  # outliers left out of the fit
    median_residual: float = 0.0  # median |measured / fitted - 1| over ``samples``
    load_average: float | None = None  # the 1-minute load average while measuring
    engine: str = ""  # engine_fingerprint() when measured ("" in files older than it)
    knots: tuple[int, ...] = ()  # token counts where the dense slope changes (TOKEN_KNOTS)
    # attention runs on the real tokens of a packed step (c3 per real token x key), not on
    # every row padded to the longest (``StepBackend.packed_attention``)
    packed: bool = False
    # the tile and padded-slot terms (``ct``, ``cp``), fitted from packed shapes too
    # (``PACKED_SHAPES``); False: the uniform grid alone, which cannot tell them apart
    tiled: bool = False
    tile_tokens: int = TILE_TOKENS  # tokens a matmul tile holds (the kernels' row pass)
    # a term per drafting row (a row that feeds more than one token; ``cd``, the last
    # coefficient), fitted from the packed shapes too: the same draft tokens cost more spread
    # over rows than on one (``_drafting_rows``)
    drafting: bool = False
    # query tokens a one-row step feeds at least (``StepBackend.min_query_len``): plain
    # batch-1 decoding costs ``step_time(1, min_query_len, ctx)`` (analyze's what-if)
    min_query_len: int = 2
    # calibrations whose timings the fit merges (each shape's fastest of them): 1, or more
    # where a noisy fit was measured again on a quiet machine (``load_or_calibrate``)
    calibrations: int = 1

    def __post_init__(self) -> None:
        n = 4 + len(self.knots) + 2 * self.tiled + self.drafting
        if len(self.coef) != n:
            raise ValueError(f"a cost model with {len(self.knots)} knots"
                             + (" and tile terms" if self.tiled else "")
                             + (" and a drafting-row term" if self.drafting else "")
                             + f" has {n} coefficients, not {len(self.coef)}")
        # ``step_time``'s dense segments past the first: (coefficient, start, width) each, as
        # ``_features`` ramps them (its ``edges``); not a field (no part of eq or the file)
        edges = (0, *self.knots, math.inf)
        object.__setattr__(self, "_later", tuple(
            (self.coef[4 + i], lo, hi - lo) for i, (lo, hi) in enumerate(zip(edges[1:],
                                                                              edges[2:]))))

    def problem(self) -> str | None:
        """Why this calibration cannot be used, or None if it is sound: a negative or
        non-finite coefficient, or an older format (fitted without the outlier checks)."""
        if not all(math.isfinite(c) for c in self.coef):
            return f"a coefficient that is not a finite number in the fit {self.coef}"
        if any(c < 0 for c in self.coef):
            return f"a negative coefficient in the fit {tuple(round(c, 9) for c in self.coef)}"
        if self.version < CALIBRATION_VERSION:
            return "written by an older specbatch, with another fit"
        return None

    def noise(self) -> str | None:
        """How noisy the timings were, when noisier than a quiet machine gives (None): more
        than ``NOISY_RESIDUAL`` off the fit at the median, or more than
        ``NOISY_REJECTED_SHARE`` of them left out as outliers. A noisy fit is still cached
        and used."""
        if self.median_residual > NOISY_RESIDUAL:
            return f"timings {self.median_residual:.0%} off the fit at the median"
        total = len(self.samples) + len(self.rejected)
        if total and len(self.rejected) > NOISY_REJECTED_SHARE * total:
            return f"{len(self.rejected)} of {total} timings slowed by other processes"
        return None

    def step_time(self, num_rows: int, query_len: int, context_len: int,
                  num_tokens: int | None = None, drafting_rows: int | None = None) -> float:
        """Predicted seconds for one forward over ``num_rows`` rows padded to ``query_len``
        new tokens, attending to ``context_len`` keys (tokens). num_tokens: the real tokens
        when rows feed different lengths and the dense layers run packed (``runner.verify``);
        default ``num_rows * query_len``. drafting_rows: the rows that feed more than one
        token, where the fit has that term (``drafting``); default: the fewest rows the real
        tokens fit in (``_drafting_rows``). Attention always costs the padded shape."""
        # the dot of ``coef`` with ``_features``: the same float operations in the same order
        # (its bits), without building the list: ~2 us a call, not ~7 (auto prices tens of
        # shapes a step at batch 16)
        c, slots = self.coef, num_rows * query_len
        t = float(slots if num_tokens is None else num_tokens)
        acc = 0  # as ``sum`` starts
        acc += c[0] * 1.0
        acc += c[1] * min(max(t - 0, 0.0), (self.knots[0] if self.knots else math.inf) - 0)
        acc += c[2] * float(num_rows * context_len)
        acc += c[3] * ((t if self.packed else float(slots)) * context_len)
        for coef, lo, width in self._later:
            acc += coef * min(max(t - lo, 0.0), width)
        if self.tiled:
            base = 4 + len(self.knots)
            acc += c[base] * float(math.ceil(t / self.tile_tokens))
            acc += c[base + 1] * (float(slots) if t < slots else 0.0)
        if self.drafting:
            acc += c[-1] * float(drafting_rows if drafting_rows is not None
                                 else _drafting_rows(num_rows, query_len, t))
        return max(acc, 1e-6)

    def token_cost(self, num_tokens: int = 0, context_len: int = 0) -> float:
        """Seconds one more packed token adds to a step of ``num_tokens`` tokens (the dense
        layers' slope there; where attention is ``packed``, plus scoring ``context_len`` keys),
        >= 0. A row that is not the longest adds no attention where it is padded."""
        segment = sum(1 for k in self.knots if num_tokens >= k)
        slope = max(self.coef[1] if segment == 0 else self.coef[3 + segment], 0.0)
        if self.tiled:  # a tile's cost shared by the tokens that fill it
            slope += self.coef[4 + len(self.knots)] / self.tile_tokens
        return slope + self.token_key_cost * context_len

    @property
    def token_key_cost(self) -> float:
        """Seconds a packed token adds per key of its row: scoring them where attention is
        ``packed``, else 0 (a row shorter than the longest is padded anyway)."""
        return self.coef[3] if self.packed else 0.0

    def terms(self) -> list[tuple[str, float]]:
        """The fit term by term, as ``(what it is paid for, milliseconds)``: every step, the
        dense slope per segment, the two attention terms (per 1,000 keys), then the tile,
        packed-slot and drafting-row terms where fitted. A step's predicted time is the sum of
        each term times its count (``step_time``; ``specbatch calibrate`` prints them)."""
        c0, s0, c2, c3 = self.coef[:4]
        slopes = (s0, *self.coef[4:4 + len(self.knots)])
        edges = (0, *self.knots)
        out = [("every step", c0 * 1e3)]
        for s, lo, hi in zip(slopes, edges, (*self.knots, None)):
            span = "" if not self.knots else (f", tokens {lo}-{hi} of the step" if hi
                                              else f", tokens past {lo} of the step")
            out.append((f"per fed token{span}", s * 1e3))
        out.append(("per row, per 1,000 keys", c2 * 1e6))
        out.append((("per fed token" if self.packed else "per query slot (rows x q)")
                    + ", per 1,000 keys of its row", c3 * 1e6))
        if self.tiled:
            ct, cp = self.coef[4 + len(self.knots):6 + len(self.knots)]
            out.append((f"per {self.tile_tokens}-token matmul tile started", ct * 1e3))
            out.append(("per query slot of a packed step (rows x q)", cp * 1e3))
        if self.drafting:
            out.append(("per drafting row (a row feeding more than one token)",
                        self.coef[-1] * 1e3))
        return out

    def describe(self) -> str:
        """The fit in one line, its ``terms`` joined (benchmarks' logs)."""
        return " + ".join(f"{ms:.3f} ms {what}" for what, ms in self.terms())

    def speedup(self, num_rows: int, k: int, context_len: int, tokens_per_step: float) -> float:
        """Throughput with k drafts per row relative to plain decoding (k = 0)."""
        return (tokens_per_step / self.step_time(num_rows, k + 1, context_len)
                * self.step_time(num_rows, 1, context_len))

    def save(self, path: str | os.PathLike) -> None:
        """Write the fit as JSON (through a fresh temporary file beside it, renamed over
        ``path``: no other file is touched); creates the folder. Raises ``OSError`` if it
        cannot be written."""
        import tempfile

        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(asdict(self), indent=1))
            os.replace(tmp, p)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def load(path: str | os.PathLike) -> CostModel:
    """Read a cost model written by ``CostModel.save`` (or the target's of a job's fits,
    ``save_job_fits``); raises ``ValueError`` if malformed."""
    try:
        d = json.loads(Path(path).read_text())
        if isinstance(d, dict) and isinstance(d.get("target"), dict):  # a job's fits
            d = d["target"]
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a specbatch calibration file ({e})") from None
    return _from_dict(d, path)


def _numbers(values, what: str) -> tuple[float, ...]:
    """``values`` as a tuple of numbers (JSON ints / floats, not booleans); raises
    ``ValueError`` naming ``what`` otherwise."""
    if not isinstance(values, list) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{what} is not a list of numbers")
    return tuple(values)


def _timings(values, what: str) -> tuple[tuple, ...]:
    """``samples`` / ``rejected``: each ``[rows, q, ctx, seconds(, tokens)]``, whole positive
    shape numbers and positive finite seconds; raises ``ValueError`` naming ``what``."""
    if not isinstance(values, list):
        raise ValueError(f"{what} is not a list")
    out = []
    for i, s in enumerate(values):
        nums = _numbers(s, f"{what}[{i}]")
        shape = nums[:3] + nums[4:]
        if len(nums) not in (4, 5) or not all(v == int(v) and v > 0 for v in shape) \
                or not (math.isfinite(nums[3]) and nums[3] > 0):
            raise ValueError(f"{what}[{i}] is not [rows, q, ctx, seconds] or [rows, q, ctx, "
                             f"seconds, tokens]: {s}")
        out.append(tuple(int(v) for v in nums[:3]) + (float(nums[3]),)
                   + tuple(int(v) for v in nums[4:]))
    return tuple(out)


def _from_dict(d, path) -> CostModel:
    """The ``CostModel`` of ``asdict``'s JSON ``d`` read from ``path``; raises ``ValueError``
    (one line naming the file and what is wrong)."""
    try:
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
        calibrations = d.get("calibrations", 1)
        if not isinstance(calibrations, int) or isinstance(calibrations, bool) \
                or calibrations < 1:
            raise ValueError(f"calibrations is {calibrations!r}, not a whole number >= 1")
        return CostModel(coef=_numbers(d["coef"], "coef"), model_id=d.get("model_id", ""),
                         dtype=d.get("dtype", ""), device=d.get("device", ""),
                         host=d.get("host", ""),
                         samples=_timings(d.get("samples", []), "samples"),
                         version=int(d.get("version", 1)),
                         rejected=_timings(d.get("rejected", []), "rejected"),
                         median_residual=float(d.get("median_residual", 0.0)),
                         load_average=d.get("load_average"), engine=d.get("engine", ""),
                         knots=tuple(int(k) for k in d.get("knots", ())),
                         packed=bool(d.get("packed", False)),
                         tiled=bool(d.get("tiled", False)),
                         tile_tokens=int(d.get("tile_tokens", TILE_TOKENS)),
                         drafting=bool(d.get("drafting", False)),
                         min_query_len=int(d.get("min_query_len", 2)),
                         calibrations=calibrations)
    except KeyError as e:
        raise ValueError(f"{path}: not a specbatch calibration file (no {e.args[0]!r} field; "
                         "write one with `specbatch calibrate -o FILE`)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a specbatch calibration file ({e})") from None


def save_job_fits(path: str | os.PathLike, target: CostModel,
                  draft: CostModel | None = None) -> None:
    """Write the fits a job's decisions use (``OUT.calibration.json``): ``{"target": ...,
    "draft": ... or null}``, each as ``CostModel.save`` writes one (``load`` reads the
    target's: ``--calibration OUT.calibration.json`` prices another job alike). Atomic (a
    temporary file renamed over ``path``); raises ``OSError``."""
    from specbatch.io.writer import _atomic_write

    data = json.dumps({"target": asdict(target),
                       "draft": None if draft is None else asdict(draft)}, indent=1)
    _atomic_write(Path(path), data.encode())


def load_job_fits(path: str | os.PathLike) -> tuple[CostModel, CostModel | None]:
    """The ``(target, draft or None)`` fits of ``save_job_fits``; raises ``ValueError`` (one
    line naming the file) if it is not such a file."""
    try:
        d = json.loads(Path(path).read_text())
        target, draft = d["target"], d["draft"]
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: not a job's calibration file ({e})") from None
    return _from_dict(target, path), None if draft is None else _from_dict(draft, path)


def _features(rows: int, q: int, ctx: int, tokens: int | None = None,
              knots: tuple[int, ...] = (), packed: bool = False,
              tiled: bool = False, tile: int = TILE_TOKENS,
              drafting: bool = False) -> list[float]:
    """The regressors of ``CostModel.coef``: 1, the tokens in the first dense segment, rows x
    keys, query tokens x keys (the real tokens where attention is ``packed``, else rows x q),
    then the tokens in each later segment; where ``tiled``, the matmul tiles started
    (``ceil(t / tile)``) and the query slots of a packed step (``rows * q`` when the
    rows feed fewer tokens than that, else 0); where ``drafting``, the drafting rows
    (``_drafting_rows``)."""
    slots = rows * q
    t = float(slots if tokens is None else tokens)
    edges = (0, *knots, math.inf)
    ramps = [min(max(t - lo, 0.0), hi - lo) for lo, hi in zip(edges, edges[1:])]
    scored = t if packed else float(slots)
    x = [1.0, ramps[0], float(rows * ctx), scored * ctx, *ramps[1:]]
    if tiled:
        x += [float(math.ceil(t / tile)), float(slots) if t < slots else 0.0]
    if drafting:
        x.append(float(_drafting_rows(rows, q, t)))
    return x


def _drafting_rows(rows: int, q: int, tokens: float) -> int:
    """Rows that feed more than one token in a step of ``rows`` rows, ``q`` query tokens at
    most and ``tokens`` real ones laid out as ``packed_fed`` lays out calibration's packed
    shapes (the drafts on as few rows as they fit in); every row where ``tokens`` is
    ``rows * q`` and q > 1. A drafting row costs more than its tokens: 24 tokens in 16 rows
    took 61.5 ms as one row of 9, 65.0 ms as 8 rows of 2 (float32, 300 keys, 2-core Zen 2,
    ``benchmarks/packed_layout.py``); without the term auto's batch-16 suffix drafts (1-2
    tokens on several rows) ran 3-5% above the fit."""
    extra = int(tokens) - rows
    return 0 if q <= 1 or extra <= 0 else min(rows, -(-extra // (q - 1)))


def _shape(s) -> tuple[int, int, int, int]:
    """(rows, q, ctx, real tokens) of a sample ``[rows, q, ctx, seconds(, tokens)]`` or of a
    shape ``(rows, q, ctx(, tokens))`` (tokens an int, seconds a float): tokens ``rows * q``
    unless given."""
    r, q, c = (int(v) for v in s[:3])
    if len(s) == 5:
        return r, q, c, int(s[4])
    if len(s) == 4 and isinstance(s[3], int):
        return r, q, c, s[3]
    return r, q, c, r * q


def _sample(shape: tuple[int, int, int, int], seconds: float) -> tuple:
    """The stored sample of a timed shape: ``(rows, q, ctx, seconds)``, a packed one with its
    real tokens last."""
    r, q, c, t = shape
    return (r, q, c, seconds) if t == r * q else (r, q, c, seconds, t)


def knots_for(samples, knots: tuple[int, ...] = TOKEN_KNOTS) -> tuple[int, ...]:
    """The knots that some sample's token count passes (rows x q, or its real tokens): a segment
    no sample reaches would get no slope of its own (and extrapolate as free)."""
    top = max((_shape(s)[3] for s in samples), default=0)
    return tuple(k for k in knots if k < top)


def solve_nonnegative(a, b) -> tuple[float, ...]:
    """Minimise ``x^T a x - 2 b^T x`` subject to ``x >= 0``: the least-squares problem given by
    its normal equations (``a = X^T X``, ``b = X^T y``), solved as ``min |R x - R^-T b|`` with
    ``a = R^T R`` (Cholesky) by scipy's Lawson-Hanson NNLS (``scipy.optimize.nnls``; Lawson &
    Hanson, "Solving Least Squares Problems", 1974, ch. 23).

    a: ``[n, n]``; b: ``[n]`` (numpy arrays or CPU tensors, as float64). Returns n floats >= 0
    (all zero if nothing fits)."""
    from scipy.linalg import solve_triangular
    from scipy.optimize import nnls

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = b.shape[0]
    # scale to a unit diagonal: the features span ~6 orders of magnitude (1 .. rows*q*ctx)
    diag = np.diagonal(a)
    scale = np.where(diag > 0, 1.0 / np.sqrt(np.maximum(diag, 1e-300)), 1.0)
    a, b = a * scale[:, None] * scale[None, :], b * scale
    a = a + 1e-12 * np.eye(n)  # a feature never seen: still definite
    if not np.all(np.isfinite(a)):  # NaN timings: nothing fits
        return (0.0,) * n
    try:
        r = np.linalg.cholesky(a).T  # upper: a = r^T r
    except np.linalg.LinAlgError:  # not positive definite: nothing fits
        return (0.0,) * n
    y = solve_triangular(r.T, b, lower=True)
    try:
        x, _ = nnls(r, y)
    except RuntimeError:  # scipy: iteration limit (degenerate data)
        return (0.0,) * n
    return tuple(float(v) for v in x * scale)


def fit(samples: list[tuple[int, int, int, float]],
        knots: tuple[int, ...] = (), packed: bool = False,
        tiled: bool = False, tile: int = TILE_TOKENS,
        drafting: bool = False) -> tuple[float, ...]:
    """Non-negative least-squares fit of ``CostModel.coef`` (4 + len(knots) coefficients, 2
    more where ``tiled``, 1 more where ``drafting``; ``tile``: tokens per matmul tile),
    relative error weighted (each sample's row divided by its time) so small steps count as
    much as large ones. A step cannot get cheaper with more tokens or context, so no
    coefficient is negative (an unconstrained fit of noisy timings can make one
    so, and then mispredicts every shape far from the samples). samples: ``[rows, q, ctx,
    seconds]``, a packed one ``[rows, q, ctx, seconds, tokens]``."""
    x = _relative_rows(samples, knots, packed, tiled, tile, drafting)
    return solve_nonnegative(x.T @ x, x.sum(0))


def _relative_rows(samples, knots: tuple[int, ...], packed: bool = False,
                   tiled: bool = False, tile: int = TILE_TOKENS,
                   drafting: bool = False) -> np.ndarray:
    """The least-squares rows of ``[rows, q, ctx, seconds(, tokens)]`` samples: each sample's
    features over its seconds, ``[len(samples), len(coef)]`` float64, so the target is 1 and
    the error relative."""
    feats = np.array([_features(r, q, c, t, knots, packed, tiled, tile, drafting)
                      for r, q, c, t in map(_shape, samples)])
    return feats / np.array([s[3] for s in samples], dtype=np.float64)[:, None]


def packed_fed(rows: int, query_len: int, num_tokens: int) -> list[int]:
    """Tokens each row feeds in a packed step of ``num_tokens`` real tokens: one each, the rest
    as drafts of up to ``query_len - 1`` tokens, row by row (a few rows drafting long, as
    ``auto`` and prompt lookup do at batch 16). Raises ``ValueError`` when they do not fit."""
    fed, extra = [1] * rows, num_tokens - rows
    for i in range(rows):
        fed[i] += min(query_len - 1, extra)
        extra -= fed[i] - 1
    if extra or num_tokens < rows:
        raise ValueError(f"{num_tokens} tokens do not pack into {rows} rows of 1-{query_len}")
    return fed


def measure(forward, rows: int, query_len: int, context_len: int, repeats: int = 3,
            cache=None, warmup: int = 1, num_tokens: int | None = None) -> float:
    """Fastest of ``repeats`` timings of one decode/verify forward of this shape, after
    ``warmup`` untimed ones (the minimum, not the median: other processes only ever add
    time).
    cache: a ``KVCache`` of at least ``rows`` rows and ``context_len + query_len + 1``
    positions to reuse (default: a new one). num_tokens: fewer real tokens than ``rows *
    query_len``: a packed step (``packed_fed``; the dense layers and attention on the real
    tokens, logits laid out ``[rows, query_len, vocab]``, as ``runner.verify`` runs it)."""
    if cache is None:
        cache = forward.new_cache(rows, context_len + query_len + 1)
    for r in range(rows):
        cache.seq_lens[r] = context_len
    gen = torch.Generator().manual_seed(0)
    lone = _min_query_len(forward) if rows == 1 else 1
    ids = torch.randint(0, forward.vocab_size, (rows, max(query_len, lone)),
                        generator=gen).to(forward.device)
    qlen = ids.shape[1]
    positions = (context_len + torch.arange(qlen))[None, :].expand(rows, -1).to(forward.device)
    row_ids = torch.arange(rows, device=forward.device)
    num_fed = None
    if num_tokens is not None and num_tokens < rows * qlen:
        num_fed = torch.tensor(packed_fed(rows, qlen, num_tokens), device=forward.device)
    times = []
    for i in range(repeats + int(warmup)):
        t0 = time.perf_counter()
        forward.forward(ids, positions, cache, row_ids, num_fed=num_fed)
        if forward.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return min(times)


def _min_query_len(forward) -> int:
    """Query tokens a one-row step feeds at least (``StepBackend.min_query_len``: 1 on the C
    step, else 2: no one-row matmuls; 2 for a forward without a backend)."""
    return getattr(getattr(forward, "backend", None), "min_query_len", 2)


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


@cpu_threads.held()  # every thread the run chose, whatever the neighbours do meanwhile
def calibrate(forward, model_id: str = "", dtype: str = "", repeats: int = 3,
              rows_grid=ROWS, query_grid=QUERY_LENS, context_grid=CONTEXTS,
              progress: bool = False, time_fn=None,
              budget_seconds: float | None = BUDGET_SECONDS,
              packed_grid=PACKED_SHAPES, prior: CostModel | None = None) -> CostModel:
    """Measure the grid and fit, rejecting timings that other processes inflated.

    ``forward``: a ``LlamaForward``. Every shape is timed once (the first of each (rows, ctx)
    after ``SHAPE_WARMUP_STEPS`` untimed steps), then the
    grid is swept again ``repeats - 1`` times, interleaved, keeping each shape's fastest time
    (a burst of load then hits different shapes in different sweeps; the minimum is the
    estimate because load only ever adds time). The fit is non-negative least squares on
    relative error (``fit``). A sample more than ``OUTLIER_RESIDUAL`` above its fit is timed
    again (up to ``OUTLIER_ROUNDS`` times) and, if still out, left out of the fit and kept in
    ``rejected``. ``CostModel.problem`` then says whether the result is fit to cache.
    ``samples`` and ``rejected`` keep the grid's order (context, rows, q).
    Where the forward packs a verify step (``backend.packed_attention``) the packed shapes
    ``packed_grid`` ``(rows, q, real tokens)`` are timed too, at every context, for rows in
    ``rows_grid`` (``measure``'s num_tokens), and the fit is ``tiled``: a matmul tile partly
    filled and a packed step's query slots get terms of their own (the uniform grid's token
    counts are whole tiles: 16 rows x 1-2 tokens priced a batch-16 step with a few rows
    drafting 2-4% low relative to plain steps, and ``auto`` drafted where it did not pay).
    progress: show a tqdm bar on stderr when it is a terminal. time_fn(rows, q, ctx) -> seconds
    replaces the measurement (tests; a packed shape: time_fn(rows, q, ctx, tokens)).
    budget_seconds: once this much wall time has passed, no more sweeps or retakes (the first
    sweep always completes: every shape once, ``SHAPE_WARMUP_STEPS`` untimed steps before each
    group); None: no limit.
    SmolLM2-135M float32 on a 2-core CPU: ~8 s quiet (the packed shapes add ~1/3); beside busy
    neighbours the first sweep is most of the budget (issue 36).
    prior: an earlier calibration of this forward (a noisy one, ``load_or_calibrate``): its
    timings of the grid's shapes, kept and rejected, count as one more sweep (each shape's
    fastest wins), and the result's ``calibrations`` is one more than the prior's.
    """
    # a 1-row step feeds at least ``min_query_len`` tokens (runner.query_len): the 1-row,
    # 1-token shape is timed and fitted as what runs, 2 tokens where one-row matmuls are not
    # allowed, and 1 on the C step, whose plain batch-1 decode feeds one. Timed at 2 there, it
    # priced plain decoding at a 2-token step and made a batch-1 draft token look free
    # (SmolLM2-135M int8 on an AMX Xeon: the fit's slope 0.000 ms per token up to 8 tokens,
    # where 1 -> 4 tokens cost 0.25 ms each and 4 -> 9 0.65 ms; auto fed 2-token drafts that
    # did not pay and ran 0.97x prompt lookup k5 on the 16 peer records)
    tiled = bool(forward.backend.packed_attention) and bool(packed_grid)
    tile = int(getattr(forward.backend, "row_tile", TILE_TOKENS))
    lone = _min_query_len(forward)
    shapes = []
    for c in context_grid:
        for r in rows_grid:
            shapes += [(r, max(q, lone) if r == 1 else q, c) for q in query_grid]
            if tiled:  # (rows, q, ctx, tokens): packed steps beside the uniform ones
                shapes += [(r, q, c, t) for pr, q, t in packed_grid if pr == r]
    shapes = [_shape(s) for s in dict.fromkeys(shapes)]
    caches: dict[tuple[int, int], object] = {}
    max_q = max(max(query_grid), 2, *(q for _, q, _ in (packed_grid if tiled else ())))

    def one(r: int, q: int, c: int, t: int) -> float:
        if time_fn is not None:
            return time_fn(r, q, c) if t == r * q else time_fn(r, q, c, t)
        warm = 0
        if (r, c) not in caches:  # one cache per (rows, ctx), reused for every q
            caches.clear()
            caches[(r, c)] = forward.new_cache(r, c + max_q + 1)
            warm = SHAPE_WARMUP_STEPS
        return measure(forward, r, q, c, repeats=1, cache=caches[(r, c)], warmup=warm,
                       num_tokens=t)

    load_before = load_average()
    start = time.perf_counter()

    def time_left() -> bool:
        return budget_seconds is None or time.perf_counter() - start < budget_seconds

    bar = None
    if progress and sys.stderr.isatty():  # a log of stderr gets the lines around it only
        from tqdm import tqdm

        bar = tqdm(total=len(shapes) * repeats, unit="step", file=sys.stderr, leave=False,
                   desc=f"calibrating {model_id or 'the model'} ({dtype or 'model dtype'})",
                   dynamic_ncols=True)
    best: dict[tuple[int, int, int, int], float] = {}
    if prior is not None:
        earlier = {_shape(x): x[3] for x in (*prior.samples, *prior.rejected)}
        best = {s: earlier[s] for s in shapes if s in earlier}
    for sweep in range(max(repeats, 1)):
        if sweep and not time_left():
            break
        for shape in shapes:
            t = one(*shape)
            best[shape] = min(best.get(shape, t), t)
            if bar is not None:
                bar.update(1)
    packed = bool(forward.backend.packed_attention)
    knots = knots_for(shapes)
    kept, rejected = _reject_outliers(best, knots, packed, tiled, tile, tiled)
    for _ in range(OUTLIER_ROUNDS):
        if not rejected or not time_left():
            break
        for s in rejected:  # time it again: load comes and goes
            rejected[s] = min(rejected[s], one(*s))
        kept, rejected = _reject_outliers({**kept, **rejected}, knots, packed, tiled, tile,
                                          tiled)
    knots = knots_for(kept, knots)
    # a shape timed again comes back last from the merge: back to its place in the grid
    kept = {s: kept[s] for s in shapes if s in kept}
    rejected = {s: rejected[s] for s in shapes if s in rejected}
    coef = fit([_sample(s, t) for s, t in kept.items()], knots, packed, tiled, tile, tiled)
    if bar is not None:
        bar.close()
    model = CostModel(coef, knots=knots, packed=packed, tiled=tiled, tile_tokens=tile,
                      drafting=tiled)
    residuals = sorted(abs(t / _predict(model, s) - 1) for s, t in kept.items())
    loads = [x for x in (load_before, load_average()) if x is not None]
    return CostModel(coef, model_id=model_id, dtype=dtype, device=str(forward.device),
                     host=host_id(), samples=tuple(_sample(s, t) for s, t in kept.items()),
                     version=CALIBRATION_VERSION,
                     rejected=tuple(_sample(s, t) for s, t in rejected.items()),
                     median_residual=residuals[len(residuals) // 2] if residuals else 0.0,
                     load_average=max(loads) if loads else None,
                     engine=engine_fingerprint(), knots=knots, packed=packed, tiled=tiled,
                     tile_tokens=tile, drafting=tiled, min_query_len=lone,
                     calibrations=1 + (prior.calibrations if prior is not None else 0))


def _predict(model: CostModel, shape: tuple[int, int, int, int]) -> float:
    r, q, c, t = shape
    return model.step_time(r, q, c, num_tokens=t)


def _reject_outliers(timings: dict[tuple[int, int, int, int], float],
                     knots: tuple[int, ...] = (), packed: bool = False, tiled: bool = False,
                     tile: int = TILE_TOKENS, drafting: bool = False,
                     ) -> tuple[dict[tuple[int, int, int, int], float],
                                dict[tuple[int, int, int, int], float]]:
    """Split ``{(rows, q, ctx, tokens): seconds}`` into (kept, outliers): fit, drop the timing
    furthest above its fit if it is more than ``OUTLIER_RESIDUAL`` above, refit, repeat (one at
    a time, so a large outlier cannot drag the fit toward itself and hide behind it); at least
    ``MIN_SAMPLES`` are kept. Only slow timings are outliers: load never makes a step faster."""
    kept, out = dict(timings), {}
    while len(kept) > MIN_SAMPLES:
        model = CostModel(fit([_sample(s, t) for s, t in kept.items()], knots, packed, tiled,
                              tile, drafting), knots=knots, packed=packed, tiled=tiled,
                          tile_tokens=tile, drafting=drafting)
        worst = max(kept, key=lambda s: kept[s] / _predict(model, s))
        if kept[worst] <= _predict(model, worst) * (1 + OUTLIER_RESIDUAL):
            break
        out[worst] = kept.pop(worst)
    return kept, out


def host_id() -> str:
    return f"{platform.node()}/{platform.processor() or platform.machine()}/{os.cpu_count()}cpu"


def kernel_path(dtype: str, device: str) -> str:
    """Which kernels run a CPU step, a part of the calibration's key: the step backend's name
    (``StepBackend.name``, known without a model: ``models.backends.cpu_backend_name``):
    ``"ckernels"`` where specbatch's C kernels are in use (``kernels/csrc``; float32 and int8
    only), for dtype int8 with the 8-bit matmul that ``kernels.linear_cpu.int8_kernel()``
    reports (``"ckernels_vnni"``, ``_avx2``, ``_portable``), else ``"torch"`` (bfloat16,
    float64, ``SPECBATCH_CPU_KERNELS=0``, a CPU without AVX2/FMA, no compiler; batch-16 steps
    ~1.6x slower); ``""`` off the CPU. Builds the kernels on first use (~3 s, once per
    machine), as the engine does."""
    if not device.startswith("cpu"):
        return ""
    from specbatch.models.backends import cpu_backend_name
    return cpu_backend_name(dtype)


def cache_path(cache_root: Path, model_id: str, dtype: str, device: str) -> Path:
    """The cache file of (model, dtype, device, ``kernel_path``, host): runs on the C kernels
    and on torch's (or on two int8 kernels) keep a fit each instead of measuring again at every
    switch. Files named before the kernel path was in the key are not read (measured anew)."""
    kernels = kernel_path(dtype, device)
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in
                   f"{model_id}-{dtype}-{device}-" + (f"{kernels}-" if kernels else "")
                   + host_id())
    return cache_root / "calibration" / f"{safe}.json"


def other_engine(cost: CostModel) -> str | None:
    """Why ``cost`` may not price this engine's steps: measured under another
    ``engine_fingerprint`` (None when it is the same)."""
    now = engine_fingerprint()
    if _without_wait_policy(cost.engine) == _without_wait_policy(now):
        return None
    return (f"measured with another engine build or setting ({cost.engine or 'not recorded'}; "
            f"now {now})")


def _without_wait_policy(fingerprint: str) -> str:
    """The fingerprint less its OpenMP wait policy: the CLI makes threads wait passively when
    other work holds the CPUs (``cpu_threads``), a choice of the moment like the load itself,
    which moves step times a little; a fit is not measured again for it."""
    import re

    return re.sub(r", OpenMP wait \w+", "", fingerprint)


def find_cached(cache_root: Path, model_id: str, dtype: str,
                device: str | None = None) -> Path | None:
    """The cached calibration file of (model, dtype, device) on this host, or None. device None:
    any device's (a run's config does not record it), CPU's first where there are several."""
    if device is not None:
        path = cache_path(cache_root, model_id, dtype, device)
        return path if path.is_file() else None
    found = [cache_path(cache_root, model_id, dtype, d) for d in ("cpu", "cuda", "cuda:0")]
    return next((p for p in found if p.is_file()), None)


def load_or_calibrate(forward, model_id: str, dtype: str, cache_root: Path,
                      recalibrate: bool = False, echo=None, progress: bool = True,
                      time_fn=None, purpose: str | None = None,
                      budget_seconds: float | None = BUDGET_SECONDS) -> tuple[CostModel, Path, bool]:
    """The cached cost model for this (model, dtype, device, kernel path, host), measured if
    absent, unusable (``CostModel.problem``: an older format, a negative coefficient), of
    another engine build, torch or thread count (``other_engine``), or ``recalibrate``. The
    load average is no reason to measure again; a noisy cached fit (``CostModel.noise``) is
    measured again when the load average is at most the CPU count, its timings merged
    (``calibrate``'s prior), until it is not noisy or merges ``HEAL_CALIBRATIONS``
    calibrations: one slow moment does not price every later job (a fit timed beside a test
    suite priced a batch-16 step of 144 tokens at 1.8 s where it takes 0.1, and auto ran the
    extraction job 0.87x of suffix on it). ``specbatch calibrate --recalibrate`` measures
    afresh. A new fit is always cached; a noisy one with a ``note:`` line saying so.
    echo: a callable for the lines a person should see (``None``: silent): the line that says
    it is calibrating, for what (``purpose``), how long at most and where the fit is cached;
    progress: a tqdm bar while measuring; time_fn, budget_seconds: as ``calibrate``.
    Returns (model, path, was_measured_now)."""
    say = echo or (lambda _line: None)
    path = cache_path(cache_root, model_id, dtype, str(forward.device))
    load_now = load_average()
    cpus = os.cpu_count() or 1
    prior = None
    if path.exists() and not recalibrate:
        try:
            cached = load(path)
        except ValueError as e:
            say(f"warning: {e}; calibrating again")
        else:
            why = cached.problem() or other_engine(cached)
            noisy = cached.noise() if why is None else None
            busy = load_now is not None and load_now > cpus
            if why is None and (noisy is None or cached.calibrations >= HEAL_CALIBRATIONS
                                or busy):
                if noisy is not None and cached.calibrations >= HEAL_CALIBRATIONS:
                    say(f"note: the cached calibration {path} is noisy ({noisy}) in "
                        f"{cached.calibrations} calibrations; used as it is (`specbatch "
                        "calibrate --recalibrate` on a quiet machine measures afresh)")
                elif noisy is not None:
                    say(f"note: the cached calibration {path} is noisy ({noisy}); used as it "
                        f"is, and timed again by a run on a quieter machine (load average "
                        f"{load_now:.1f} on {cpus} CPUs now)")
                return cached, path, False
            if why is None:
                prior = cached
                say(f"the cached calibration {path} is noisy ({noisy}); the machine is "
                    "quieter now: timing it again, each shape's fastest timing kept")
            else:
                say(f"the cached calibration {path} is not used ({why}); calibrating again")
    limit = (f"at most ~{budget_seconds:.0f} s after one sweep of its shapes, "
             if budget_seconds is not None else "")
    say(f"calibrating this machine's step cost for {model_id or 'the model'} ({dtype})"
        + (f": {purpose}" if purpose else "") + f"; {limit}cached in {path} for later runs"
        + (f" (load average {load_now:.1f} on {cpus} CPUs: other processes slow it)"
           if load_now is not None and load_now > cpus else "") + " ...")
    t0 = time.perf_counter()
    model = calibrate(forward, model_id=model_id, dtype=dtype, progress=progress,
                      time_fn=time_fn, budget_seconds=budget_seconds, prior=prior)
    seconds = time.perf_counter() - t0
    if model.problem() is None:
        model.save(path)
    noisy = model.noise()
    say(f"calibrated in {seconds:.1f} s" + (
        f"; note: {noisy}, with other work on the CPUs: it is used as measured (auto's "
        "decisions follow it, not the time of the moment); a later run on a quieter machine "
        "times it again (or `specbatch calibrate --recalibrate`)"
        if noisy and model.calibrations < HEAL_CALIBRATIONS else
        f"; note: {noisy} in {model.calibrations} calibrations: it is used as measured"
        if noisy else ""))
    return model, path, True
