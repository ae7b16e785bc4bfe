"""``--method auto``: bucket records by predicted acceptance, print the plan, adapt k online.

Plan, before any generation:
1. predict each record's conditional acceptance ``alpha`` from its prompt (``predict``);
2. bucket: ``copy-heavy`` / ``mixed`` / ``novel`` by predicted acceptance length at k_max,
   and order records by bucket, then prompt length (longest first), so rows that run together
   have alike acceptance and length;
3. per bucket choose the proposer (prompt lookup, or the draft model when one is given) and
   the k in 0..k_max that maximise predicted output tokens per second at the batch size, from
   the measured step costs (``costmodel``; a draft model's k forwards are counted): that is the
   bucket's starting choice and its predicted speedup over none. The draft model's acceptance
   is not predicted per record: it starts at ``policy.MODEL_PRIOR`` and is learned online.

While generating, ``policy.AdaptivePolicy`` re-chooses the proposer and draft length of every
row every step from the same cost models and each row's observed acceptance (the bucket's
prediction is only the prior).
Outputs are identical to ``--method none``: only how many drafts are verified changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specbatch.plan.costmodel import CostModel
from specbatch.plan.policy import MODEL_PRIOR, AdaptivePolicy, Probe
from specbatch.plan.predict import Prediction, instruction_text, predict

BUCKETS = ("copy-heavy", "mixed", "novel")
COPY_HEAVY_MIN = 2.2  # predicted acceptance length at k_max (tokens per drafting step)
NOVEL_MAX = 1.5
PRIOR_STRENGTH = 4.0  # pseudo-observations behind the predicted alpha
PROBE_TOKENS = 16  # committed tokens after which prompt lookup is replayed (policy.Probe)


@dataclass
class BucketPlan:
    name: str
    indices: list[int] = field(default_factory=list)
    mean_prompt_tokens: float = 0.0
    predicted_acceptance_length: float = 0.0
    k: int = 0
    proposer: str = "ngram"  # "ngram" or "draft"; "none" when k = 0
    predicted_speedup: float = 1.0


@dataclass
class Plan:
    """Per-record predictions and buckets, and the per-bucket choice of k."""

    k_max: int
    batch_size: int
    predictions: dict[int, Prediction]
    bucket_of: dict[int, str]
    buckets: dict[str, BucketPlan]
    policy: AdaptivePolicy | None = None

    def order_key(self, record_index: int, prompt_tokens: int) -> tuple:
        return (BUCKETS.index(self.bucket_of[record_index]), -prompt_tokens)

    def annotate(self, record_index: int) -> dict:
        """Fields added to the record's ``spec`` stats: the planned bucket, the prompt-only
        prediction and its features, and (once the record ran past the probe) ``probe``: the
        acceptance length prompt lookup had on its first committed tokens and the bucket that
        puts it in."""
        pred = self.predictions[record_index]
        out = {"bucket": self.bucket_of[record_index],
               "predicted_acceptance_length": round(pred.acceptance_length(self.k_max), 4),
               "predictor_features": pred.features()}
        if self.policy is not None:
            steps = self.policy.steps_by_proposer.get(record_index, {})
            out["proposer_steps"] = dict(sorted(steps.items()))
        result = self.policy.probe_results.get(record_index) if self.policy else None
        if result is not None:
            length, tokens = result
            out["probe"] = {"tokens": tokens,
                            "acceptance_length": None if length is None else round(length, 4),
                            "bucket": bucket_for(1.0 if length is None else length)}
        return out

    def prior(self, record_index: int) -> list[tuple[float, float]]:
        return self.prior_from_alpha(self.predictions[record_index].alpha, self.k_max)

    @staticmethod
    def prior_from_alpha(alpha: float, k_max: int) -> list[tuple[float, float]]:
        """Beta prior per draft position: ``PRIOR_STRENGTH`` pseudo-trials at ``alpha``."""
        return [(alpha * PRIOR_STRENGTH, (1 - alpha) * PRIOR_STRENGTH)] * max(k_max, 1)

    def make_policy(self, cost: CostModel, probe: Probe | None = None, proposer=None,
                    model_cost: CostModel | None = None,
                    match_len_of=None, suffix=None) -> AdaptivePolicy:
        """proposer, model_cost: a ``LookupAndDraftProposer`` and its draft forward's cost
        model, when a draft model is given; match_len_of: ``NgramProposer.match_len``."""
        self.policy = AdaptivePolicy(cost, self.k_max, lambda seq: self.prior(seq.request.tag),
                                     probe=probe, proposer=proposer, model_cost=model_cost,
                                     match_len_of=match_len_of, suffix=suffix)
        return self.policy

    def table(self) -> str:
        lines = [f"plan: k_max {self.k_max}, batch size {self.batch_size}",
                 f"{'bucket':<12}{'records':>8}{'prompt tok':>11}{'pred acc len':>13}"
                 f"{'proposer':>9}{'k':>4}{'pred speedup':>14}"]
        for b in self.buckets.values():
            if b.indices:
                lines.append(f"{b.name:<12}{len(b.indices):>8}{b.mean_prompt_tokens:>11.0f}"
                             f"{b.predicted_acceptance_length:>13.2f}{b.proposer:>9}{b.k:>4}"
                             f"{b.predicted_speedup:>13.2f}x")
        return "\n".join(lines)


def bucket_for(acceptance_length: float) -> str:
    """Bucket of a (predicted or probed) acceptance length at k_max."""
    return ("copy-heavy" if acceptance_length >= COPY_HEAVY_MIN
            else "novel" if acceptance_length < NOVEL_MAX else "mixed")


def expected_tokens(alpha: float, k: int) -> float:
    return 1.0 + sum(alpha ** i for i in range(1, k + 1))


def best_k(cost: CostModel, alphas: list[float], k_max: int, rows: int,
           context_len: int, model_cost: CostModel | None = None) -> tuple[int, float]:
    """k in 0..k_max maximising predicted tokens/s for a batch of ``rows`` rows whose
    acceptance is ``alphas`` (cycled); returns (k, speedup over k = 0). model_cost: the step
    cost of a draft model, which runs k forwards of ``rows`` rows per verify step (None: the
    drafts are free, as prompt lookup's)."""
    rate = {}
    for k in range(k_max + 1):
        tokens = sum(expected_tokens(alphas[i % len(alphas)], k) for i in range(rows))
        seconds = cost.step_time(rows, k + 1, context_len)
        if model_cost is not None:
            seconds += k * model_cost.step_time(rows, 1, context_len)
        rate[k] = tokens / seconds
    k = max(rate, key=lambda kk: (rate[kk], -kk))
    return k, rate[k] / rate[0]


def make_plan(records, prompt_ids: dict[int, list[int]], k_max: int, batch_size: int,
              cost: CostModel, prompt_lookup_min: int, expected_output_tokens: int,
              model_cost: CostModel | None = None) -> Plan:
    """records: validated records; prompt_ids: record index -> first prompt's token ids.
    model_cost: the draft model's step cost, when one is given (the bucket may choose it)."""
    preds = {r.index: predict(prompt_ids[r.index], instruction_text(r), r.sampling.temperature,
                              prompt_lookup_min) for r in records}
    bucket_of = {}
    for r in records:
        bucket_of[r.index] = bucket_for(preds[r.index].acceptance_length(k_max))
    buckets = {name: BucketPlan(name) for name in BUCKETS}
    for r in records:
        buckets[bucket_of[r.index]].indices.append(r.index)
    for b in buckets.values():
        if not b.indices:
            continue
        alphas = [preds[i].alpha for i in b.indices]
        lengths = [len(prompt_ids[i]) for i in b.indices]
        b.mean_prompt_tokens = sum(lengths) / len(lengths)
        b.predicted_acceptance_length = sum(expected_tokens(a, k_max) for a in alphas) / len(
            alphas)
        rows = min(batch_size, len(b.indices))
        ctx = int(b.mean_prompt_tokens + expected_output_tokens / 2)
        b.k, b.predicted_speedup = best_k(cost, alphas, k_max, rows, ctx)
        if model_cost is not None:
            k, speedup = best_k(cost, [MODEL_PRIOR], k_max, rows, ctx, model_cost)
            if speedup > b.predicted_speedup:
                b.proposer, b.k, b.predicted_speedup = "draft", k, speedup
        if b.k == 0:
            b.proposer = "none"
    return Plan(k_max, batch_size, preds, bucket_of, buckets)


def prepare_auto(engine, records, renderer, spec_config, engine_config, model_id: str,
                 cache_dir=None, echo=print, draft_model_id: str = "") -> Plan:
    """Calibrate (or load the cached cost models: the target's and, when the engine's proposer
    has a draft model, the draft's, cached under ``draft_model_id``), plan, and attach the
    adaptive policy to ``engine``. ``echo`` gets the human-readable lines (calibration notes and
    plan table)."""
    from specbatch.models.loader import cache_root
    from specbatch.plan.costmodel import load_or_calibrate

    cost, path, measured = load_or_calibrate(engine.runner.forward, model_id,
                                             engine_config.dtype, cache_root(cache_dir))
    if measured:
        echo(f"calibrated the step-cost model for this machine: {path}")
    proposer = engine.proposer if hasattr(engine.proposer, "propose_with_model") else None
    model_cost = None
    if proposer is not None:  # the draft model's forward gets its own calibration
        model_cost, path, measured = load_or_calibrate(
            proposer.model.forward, draft_model_id or "draft", engine_config.dtype,
            cache_root(cache_dir))
        if measured:
            echo(f"calibrated the draft model's step cost for this machine: {path}")
    prompt_ids = {r.index: renderer.first_prompt(r)[0] for r in records}
    max_tokens = max((r.sampling.max_tokens for r in records), default=1)
    plan = make_plan(records, prompt_ids, spec_config.num_speculative_tokens,
                     engine_config.max_batch_size, cost, spec_config.prompt_lookup_min,
                     max_tokens, model_cost)
    engine.policy = plan.make_policy(cost, Probe(PROBE_TOKENS, spec_config.prompt_lookup_min,
                                                 spec_config.prompt_lookup_max,
                                                 engine.runner.max_model_len),
                                     proposer=proposer, model_cost=model_cost,
                                     match_len_of=getattr(engine.proposer, "match_len", None),
                                     suffix=(engine.proposer if hasattr(engine.proposer,
                                                                        "propose_suffix")
                                             else None))
    echo(plan.table())
    return plan
