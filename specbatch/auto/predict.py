"""Acceptance predictor: from the prompt alone, how much will prompt lookup's drafts be accepted?

Cheap (one pass over the prompt ids and a regex over the last user text; no model forward) and
explainable: the features are stored in each record's stats.

Features (``FEATURES``, in order)
- ``repeat_share``: share of prompt positions whose preceding n-gram (n = prompt_lookup_min)
  already occurred earlier in the prompt: how often lookup would have matched while reading it.
- ``log_prompt_tokens``: more context, more to copy from.
- instruction cues, 1.0 when the task text matches (``CUES``): translate, summarise, extract,
  rewrite / edit, passage (answer from a given text), code, math, creative writing.
- ``temperature``: sampling lowers the chance a draft equals the target's token.

Model: per-position conditional acceptance ``alpha = sigmoid(w . features)``; predicted
acceptance length for k drafts ``1 + sum_{i=1..k} alpha**i`` (drafts accepted as a geometric
run, the model of Leviathan et al. 2023, arXiv 2211.17192, sec. 3.1). ``WEIGHTS`` are a
least-squares fit of logit(alpha) on a measured ngram k5 run of SmolLM2-135M over the 480
Spec-Bench records (``specbatch predict-eval --refit`` refits on any output files and reports
the out-of-sample rank correlation). They encode what that model does: it echoes a source text
it is asked to translate, and a 135M model repeats itself on open-ended prompts, so cues that
mean "novel" for a large model need not here. Refit for another model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

CUES = {
    "translate": re.compile(r"translat", re.I),
    "summarize": re.compile(r"summar|tl;?dr|key points", re.I),
    "extract": re.compile(r"extract|identify|list (all|every|the)|find (all|the)|which of", re.I),
    "rewrite": re.compile(r"rewrite|rephrase|paraphrase|edit|correct|fix|refactor|rename|"
                          r"previous (answer|response)", re.I),
    "passage": re.compile(r"based on|according to|passage|context|document|article|"
                          r"following|given", re.I),
    "code": re.compile(r"code|function|python|program|```|def |class ", re.I),
    "math": re.compile(r"calculat|solve|equation|math|\d+\s*[-+*/^]\s*\d+", re.I),
    "creative": re.compile(r"poem|story|imagine|compose|creative|invent|joke|pretend|role|"
                           r"essay|blog|email|letter", re.I),
}
FEATURES = ("bias", "repeat_share", "log_prompt_tokens", *CUES, "temperature")

# one per FEATURES entry: `predict-eval --refit` on the 480-record ngram k5 run (T = 0,
# max_tokens 128, bfloat16; 2-fold out-of-sample Spearman 0.41). The temperature weight is
# not fitted (every Spec-Bench run was at T = 0): a hand-set guess that sampling lowers alpha.
FITTED_ON = "SmolLM2-135M"  # the model WEIGHTS were fitted on (``fitted_for``)
WEIGHTS = (-0.291, -0.166, 0.178, 1.603, -0.416, 0.476, -0.040, 0.075, -0.074, 0.235, 0.106,
           -1.2)


@dataclass(frozen=True)
class Prediction:
    values: tuple[float, ...]  # one per FEATURES entry
    alpha: float  # predicted conditional acceptance per draft position

    def acceptance_length(self, k: int) -> float:
        """Predicted mean acceptance length (tokens per drafting step) with k drafts."""
        return 1.0 + sum(self.alpha ** i for i in range(1, k + 1))

    def features(self) -> dict:
        """Named features (the bias left out) and alpha, rounded, for the record's stats."""
        d = {name: round(v, 4) for name, v in zip(FEATURES[1:], self.values[1:])}
        d["alpha"] = round(self.alpha, 4)
        return d


def repeat_share(ids: list[int], n: int) -> float:
    """Share of positions i >= n whose n-gram ids[i-n:i] occurred at an earlier position."""
    if len(ids) <= n:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    hits = 0
    for i in range(n, len(ids) + 1):
        gram = tuple(ids[i - n:i])
        hits += gram in seen
        seen.add(gram)
    return hits / (len(ids) - n + 1)


def feature_values(prompt_ids: list[int], instruction: str, temperature: float,
                   prompt_lookup_min: int = 2) -> tuple[float, ...]:
    """The ``FEATURES`` of one record. instruction: the user text (where the task is stated)."""
    cues = tuple(1.0 if rx.search(instruction) else 0.0 for rx in CUES.values())
    return (1.0, repeat_share(prompt_ids, prompt_lookup_min),
            math.log(max(len(prompt_ids), 1)), *cues, float(temperature))


def predict(prompt_ids: list[int], instruction: str, temperature: float,
            prompt_lookup_min: int = 2, weights: tuple[float, ...] = WEIGHTS) -> Prediction:
    """instruction: the user text (where the task is stated); see ``instruction_text``."""
    values = feature_values(prompt_ids, instruction, temperature, prompt_lookup_min)
    z = sum(w * f for w, f in zip(weights, values, strict=True))
    return Prediction(values, alpha=1.0 / (1.0 + math.exp(-z)))


def fitted_for(model_id: str) -> bool:
    """Whether ``WEIGHTS`` were fitted on this model (``LoadedModel.model_id``: a registry
    name or a file name, then ``@sha256:...``)."""
    return FITTED_ON.lower() in model_id.lower()


def instruction_text(record, renderer=None) -> str:
    """The user text a record's task is stated in: the last user message, or every turn of a
    ``turns`` record (a later "rewrite your previous answer" turn copies an earlier answer);
    for ``prompt_token_ids``, their text (``renderer.detokenize``; "" without a renderer), as
    the same prompt given as text would say."""
    ids = getattr(record, "prompt_token_ids", None)
    if ids is not None:
        return renderer.detokenize(list(ids)) if renderer is not None else ""
    if record.prompt is not None:
        return record.prompt
    if record.messages is not None:
        users = [m["content"] for m in record.messages if m.get("role") == "user"]
        return users[-1] if users else ""
    return "\n".join(record.turns)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties; ``scipy.stats.spearmanr``); 0.0 where
    either side is constant (no ranking to compare)."""
    from scipy.stats import spearmanr

    if len(set(xs)) < 2 or len(set(ys)) < 2:
        return 0.0
    return float(spearmanr(xs, ys).statistic)
