"""``--method auto``: bucket records by predicted acceptance, print the plan, adapt k online.

Plan, before any generation:
1. predict each record's conditional acceptance ``alpha`` from its prompt (``predict``);
2. bucket: ``copy-heavy`` / ``mixed`` / ``novel`` are the top, middle and bottom thirds of
   this job by predicted acceptance length at k_max (``job_cutoffs``; equal predictions share a
   bucket). Records run in none's order (longest prompt first, ``pipeline``): admitted bucket
   by bucket, prompts that share a prefix shared prefill forwards more often and each computed
   it (on the 16 peer records at batch 16, 2.3% more prompt tokens and auto at 0.982x of
   none with none's drafts; the per-row policy, not the order, matches drafts to rows). The
   cutoffs are relative because the predictor
   ranks records better than it scales them: its weights are SmolLM2-135M's (Spearman 0.41
   out of sample), and fixed cutoffs put nearly every record of a job in one bucket (on
   SmolLM2 every Spec-Bench category predicts and measures an acceptance length above 2.2;
   on another model's tokenizer the scale moves again);
3. per bucket choose the proposer (prompt lookup, or the draft model when one is given) and
   the k in 0..k_max that maximise predicted output tokens per second, every bucket at the
   job's batch size (the rows that run together, whatever bucket they come from), from the
   measured step costs (``costmodel``; a draft model's k forwards are counted): that is the
   bucket's starting choice and its predicted speedup over none, so a bucket predicted to copy
   more never gets a smaller k or speedup. The draft model's acceptance is not predicted per
   record: it starts at ``candidate.MODEL_PRIOR`` and is learned online.

While generating, ``policy.AdaptivePolicy`` re-chooses the candidate (``candidate``) and draft
length of every row every step from the same cost models (fixed for the job) and each row's
observed acceptance (the bucket's prediction is only the lookup's prior).
Outputs are identical to ``--method none``: only how many drafts are verified changes.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from specbatch.auto.candidate import MODEL_PRIOR, Probe, Setup
from specbatch.auto.costmodel import CostModel
from specbatch.auto.policy import AdaptivePolicy
from specbatch.auto.predict import (FITTED_ON, Prediction, fitted_for,
                                    instruction_text, predict)

BUCKETS = ("copy-heavy", "mixed", "novel")
PRIOR_STRENGTH = 4.0  # pseudo-observations behind the predicted alpha
PROBE_TOKENS = 16  # committed tokens after which prompt lookup is replayed (candidate.Probe)


@dataclass
class BucketPlan:
    name: str
    indices: list[int] = field(default_factory=list)
    mean_prompt_tokens: float = 0.0
    predicted_acceptance_length: float = 0.0
    k: int = 0
    proposer: str = "ngram"  # "ngram" or "draft"; "none" when k = 0; "lookup" with suffix
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
    # acceptance lengths at k_max (see ``job_cutoffs``): below ``novel_below`` novel, from
    # ``copy_heavy_from`` copy-heavy
    novel_below: float = float("-inf")
    copy_heavy_from: float = float("inf")
    model_note: str = ""  # a line under the table (e.g. the predictor was fitted elsewhere)

    def bucket(self, acceptance_length: float) -> str:
        """Bucket of a (predicted or probed) acceptance length at k_max, by this job's cutoffs."""
        return bucket_for(acceptance_length, self.novel_below, self.copy_heavy_from)

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
                            "bucket": self.bucket(1.0 if length is None else length)}
        return out

    def prior(self, record_index: int) -> list[tuple[float, float]]:
        return self.prior_from_alpha(self.predictions[record_index].alpha, self.k_max)

    @staticmethod
    def prior_from_alpha(alpha: float, k_max: int) -> list[tuple[float, float]]:
        """Beta prior per draft position: ``PRIOR_STRENGTH`` pseudo-trials at ``alpha``."""
        return [(alpha * PRIOR_STRENGTH, (1 - alpha) * PRIOR_STRENGTH)] * max(k_max, 1)

    def make_policy(self, cost: CostModel, proposer, probe: Probe | None = None,
                    model_cost: CostModel | None = None) -> AdaptivePolicy:
        """The policy over ``proposer``'s candidates (an ``auto.proposer.AutoProposer``; its
        members' registry entries build them, ``Setup``), which ``proposer`` then routes
        through. model_cost: the draft forward's cost model, when a draft model is given."""
        setup = Setup(self.k_max, lambda seq: self.prior(seq.request.tag), probe, model_cost)
        lookup, *others = proposer.build_candidates(setup)
        self.policy = AdaptivePolicy(cost, self.k_max, lookup, others)
        proposer.use(self.policy)
        return self.policy

    def table(self) -> str:
        cutoffs = (f"buckets are the thirds of this job by predicted acceptance length "
                   f"(copy-heavy >= {self.copy_heavy_from:.2f}, novel < {self.novel_below:.2f})"
                   if math.isfinite(self.copy_heavy_from) else
                   "one bucket (fewer than 3 records)")
        # k is where a bucket starts: the policy re-chooses it per row and step, so a k 0
        # bucket's rows still draft once their measured acceptance pays (a fresh user read
        # an all-k-0 plan as "no drafting", then saw acceptance length ~4.8)
        lines = [f"plan: k_max {self.k_max}, batch size {self.batch_size}; k is where a bucket "
                 f"starts: rows draft later where their acceptance pays; {cutoffs}",
                 f"{'bucket':<12}{'records':>8}{'prompt tok':>11}{'pred acc len':>13}"
                 f"{'range':>12}{'starts':>9}{'k':>4}{'pred speedup':>14}"]
        for b in self.buckets.values():
            if b.indices:
                lengths = [self.predictions[i].acceptance_length(self.k_max) for i in b.indices]
                span = f"{min(lengths):.2f}-{max(lengths):.2f}"
                lines.append(f"{b.name:<12}{len(b.indices):>8}{b.mean_prompt_tokens:>11.0f}"
                             f"{b.predicted_acceptance_length:>13.2f}{span:>12}"
                             f"{'plain' if b.proposer == 'none' else b.proposer:>9}"
                             f"{b.k:>4}{b.predicted_speedup:>13.2f}x")
        if self.model_note:
            lines.append(self.model_note)
        return "\n".join(lines)


def bucket_for(acceptance_length: float, novel_below: float, copy_heavy_from: float) -> str:
    """Bucket of an acceptance length at k_max, given the cutoffs (``job_cutoffs``)."""
    return ("copy-heavy" if acceptance_length >= copy_heavy_from
            else "novel" if acceptance_length < novel_below else "mixed")


def job_cutoffs(lengths: list[float]) -> tuple[float, float]:
    """``(novel_below, copy_heavy_from)``: the job's thirds of predicted acceptance length.

    With ``n`` records sorted by prediction, the lowest ``n // 3`` are novel and the highest
    ``n // 3`` copy-heavy, except that equal predictions share a bucket (a tie at a cutoff goes
    up). Fewer than 3 records (or all equal) are all mixed. Example: predictions 2.1, 2.3, 2.3,
    2.5, 2.6, 3.0 give cutoffs (2.3, 2.6): novel 2.1; mixed 2.3, 2.3, 2.5; copy-heavy 2.6, 3.0.
    """
    ordered = sorted(lengths)
    third = len(ordered) // 3
    if third == 0:
        return float("-inf"), float("inf")
    return ordered[third], ordered[len(ordered) - third]


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
              model_cost: CostModel | None = None, renderer=None) -> Plan:
    """records: validated records; prompt_ids: record index -> first prompt's token ids.
    model_cost: the draft model's step cost, when one is given (the bucket may choose it).
    renderer: the ``PromptRenderer``, for the text of records given as token ids
    (``instruction_text``)."""
    preds = {r.index: predict(prompt_ids[r.index], instruction_text(r, renderer),
                              r.sampling.temperature, prompt_lookup_min) for r in records}
    novel_below, copy_heavy_from = job_cutoffs([p.acceptance_length(k_max)
                                                for p in preds.values()])
    bucket_of = {r.index: bucket_for(preds[r.index].acceptance_length(k_max), novel_below,
                                     copy_heavy_from) for r in records}
    # every bucket is planned at the rows that run together: buckets are admitted one after
    # another into the same batch, so a small bucket does not run alone
    job_rows = max(1, min(batch_size, len(preds)))
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
        rows = job_rows
        ctx = int(b.mean_prompt_tokens + expected_output_tokens / 2)
        b.k, b.predicted_speedup = best_k(cost, alphas, k_max, rows, ctx)
        if model_cost is not None:
            k, speedup = best_k(cost, [MODEL_PRIOR], k_max, rows, ctx, model_cost)
            if speedup > b.predicted_speedup:
                b.proposer, b.k, b.predicted_speedup = "draft", k, speedup
        if b.k == 0:
            b.proposer = "none"
    return Plan(k_max, batch_size, preds, bucket_of, buckets, novel_below=novel_below,
                copy_heavy_from=copy_heavy_from)


def plan_auto(records, renderer, spec_config, batch_size: int, max_model_len: int,
              cost: CostModel, proposer, model_cost: CostModel | None = None,
              echo=print, model_id: str = "", echo_plan=None) -> tuple[Plan, AdaptivePolicy]:
    """Plan ``records`` and make the adaptive policy that routes and cuts the drafts of
    ``proposer``, which then routes through it (``Plan.make_policy``; nothing reaches into an
    engine from outside).

    cost: the target's step-cost model (``costmodel.load_or_calibrate``); proposer: the engine's
    ``auto.proposer.AutoProposer`` (``methods``' auto builder: lookup, suffix, any registered
    method auto may choose, and the draft model when one is given); model_cost: the draft
    forward's cost model, given exactly when the proposer drafts with a draft model;
    batch_size: the engine's rows; max_model_len: its context. ``echo`` gets the plan table
    (``echo_plan``, when given, gets it instead); model_id: the target's
    (``LoadedModel.model_id``), for a note when the acceptance predictor was fitted on another
    model."""
    prompt_ids = {r.index: renderer.first_prompt(r)[0] for r in records}
    max_tokens = max((r.sampling.max_tokens for r in records), default=1)
    plan = make_plan(records, prompt_ids, spec_config.num_speculative_tokens, batch_size, cost,
                     spec_config.prompt_lookup_min, max_tokens, model_cost, renderer)
    notes = []
    for b in plan.buckets.values():  # auto's suffix drafts: own text or job index, per step
        if b.proposer == "ngram":
            b.proposer = "lookup"
    if any(b.proposer == "lookup" and b.indices for b in plan.buckets.values()):
        notes.append("lookup: each step, per record, the n-gram draft (its own text) or "
                     "the suffix draft (its own text and the job's finished outputs), "
                     "whichever the policy values more")
    idle = [b.name for b in plan.buckets.values() if b.indices and b.k == 0]
    if idle:  # the plan's k is where a bucket starts; the policy re-chooses every step
        notes.append(f"k 0 ({', '.join(idle)}): drafting is not predicted to pay at batch "
                     f"{batch_size} with this machine's step cost, so "
                     + ("these records start" if len(idle) > 1 else "its records start")
                     + " without drafts")
    plan.model_note = "\n".join(notes)
    if model_id and not fitted_for(model_id):
        plan.model_note = (plan.model_note + "\n" if plan.model_note else "") + (
                           f"note: the acceptance predictor was fitted on {FITTED_ON}; for "
                           f"{model_id.split('@')[0]} its scale may be off: the buckets use only "
                           "its ranking, and each record's acceptance is learned as it runs")
    policy = plan.make_policy(cost, proposer, Probe(PROBE_TOKENS, spec_config.prompt_lookup_min,
                                                    spec_config.prompt_lookup_max, max_model_len),
                              model_cost)
    (echo_plan or echo)(plan.table())
    return plan, policy
