"""Acceptance predictor: from the prompt alone, how much will prompt lookup's drafts be accepted?

Cheap (one pass over the prompt ids and a regex over the last user text; no model forward) and
explainable: the features are stored in each record's stats.

Features
- ``repeat_share``: share of prompt positions whose preceding n-gram (n = prompt_lookup_min)
  already occurred earlier in the prompt: how often lookup would have matched while reading it.
- ``log_prompt_tokens``: more context, more to copy from.
- ``quote_cue`` / ``novel_cue``: the instruction asks to reuse the input (summarise, extract,
  rewrite, edit code, answer from a passage) or to make new text (translate, write a story...).
- ``temperature``: sampling lowers the chance a draft equals the target's token.

Model: per-position conditional acceptance ``alpha = sigmoid(w . features)``; predicted
acceptance length for k drafts ``1 + sum_{i=1..k} alpha**i`` (drafts accepted as a geometric
run, the model of Leviathan et al. 2023, arXiv 2211.17192, sec. 3.1). The weights were fitted
on measured ngram k5 runs of SmolLM2-135M over Spec-Bench (``specbatch predict-eval`` reports
the rank correlation on any output file).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

QUOTE_CUE = re.compile(
    r"summar|rewrite|rephrase|paraphrase|extract|edit|correct|fix|refactor|rename|copy|repeat|"
    r"quote|based on|according to|passage|context|document|article|following|given|code|"
    r"previous (answer|response)|"
    r"list (all|every|the)", re.I)
NOVEL_CUE = re.compile(r"translat|poem|story|imagine|compose|creative|invent|joke|pretend|"
                       r"role|write an? (essay|blog|email|letter)", re.I)

# fitted weights: bias, repeat_share, log_prompt_tokens, quote_cue, novel_cue, temperature
WEIGHTS = (-2.2, 2.0, 0.22, 0.45, -0.45, -1.2)


@dataclass(frozen=True)
class Prediction:
    repeat_share: float
    log_prompt_tokens: float
    quote_cue: float
    novel_cue: float
    temperature: float
    alpha: float  # predicted conditional acceptance per draft position

    def acceptance_length(self, k: int) -> float:
        """Predicted mean acceptance length (tokens per drafting step) with k drafts."""
        return 1.0 + sum(self.alpha ** i for i in range(1, k + 1))

    def features(self) -> dict:
        d = asdict(self)
        return {key: round(v, 4) for key, v in d.items()}


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


def predict(prompt_ids: list[int], instruction: str, temperature: float,
            prompt_lookup_min: int = 2, weights: tuple[float, ...] = WEIGHTS) -> Prediction:
    """instruction: the last user text (where the task is stated)."""
    feats = (1.0, repeat_share(prompt_ids, prompt_lookup_min),
             math.log(max(len(prompt_ids), 1)),
             1.0 if QUOTE_CUE.search(instruction) else 0.0,
             1.0 if NOVEL_CUE.search(instruction) else 0.0, float(temperature))
    z = sum(w * f for w, f in zip(weights, feats))
    return Prediction(*feats[1:], alpha=1.0 / (1.0 + math.exp(-z)))


def instruction_text(record) -> str:
    """The user text a record's task is stated in: the last user message, or every turn of a
    ``turns`` record (a later "rewrite your previous answer" turn copies an earlier answer)."""
    if record.prompt is not None:
        return record.prompt
    if record.messages is not None:
        users = [m["content"] for m in record.messages if m.get("role") == "user"]
        return users[-1] if users else ""
    return "\n".join(record.turns)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman rank correlation (average ranks for ties)."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for t in range(i, j + 1):
                r[order[t]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = math.sqrt(sum((a - mx) ** 2 for a in rx))
    vy = math.sqrt(sum((b - my) ** 2 for b in ry))
    return cov / (vx * vy) if vx and vy else 0.0
