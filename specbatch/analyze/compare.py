"""Compare two output files of the same records (none vs ngram, last night vs tonight).

Records are matched by id and grouped by file a's groups. Per group: records, output tokens, steps, tokens per step, mean
acceptance length and acceptance rate of each file side by side, and the steps ratio b / a
(< 1: file b needed fewer target forwards for the same tokens). Outputs: the records whose
``output_token_ids`` differ, each with the first differing position. Speculation must not change
the output (same model, dtype, prompt and seed), so that count should be 0 unless the files'
configs differ in one of those (``output_setting_differences``: another dtype, e.g. float32 vs
int8, gives other tokens by itself).
"""

from __future__ import annotations

from specbatch.analyze.load import RunFile, answers
from specbatch.analyze.tables import group_label, group_table


def first_difference(a: list, b: list) -> int | None:
    """First index where token lists ``a`` and ``b`` differ (a prefix differs at the shorter
    length); None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# run-config keys (OUT.config.json) whose values decide the output tokens; speculation
# (method, k, n-gram sizes, batch size) does not
OUTPUT_KEYS = ("model", "dtype", "sampling", "seed", "max_model_len", "prompt_field", "template",
               "input_sha256")


def output_setting_differences(a: RunFile, b: RunFile) -> list[dict]:
    """``{"key", "a", "b"}`` for each run-config value that changes output tokens and differs
    between the two files (none when a config is missing); where both values are objects (the
    sampling parameters), one entry per field that differs, keyed ``sampling.max_tokens``."""
    if a.config is None or b.config is None:
        return []
    out = []
    for k in OUTPUT_KEYS:
        va, vb = a.config.get(k), b.config.get(k)
        if va == vb:
            continue
        if isinstance(va, dict) and isinstance(vb, dict):
            out += [{"key": f"{k}.{f}", "a": va.get(f), "b": vb.get(f)}
                    for f in sorted(va.keys() | vb.keys()) if va.get(f) != vb.get(f)]
        else:
            out.append({"key": k, "a": va, "b": vb})
    return out


def common_ids(a: RunFile, b: RunFile) -> set[str]:
    """The record ids (as strings) that both files hold: the records ``compare`` matches."""
    return {str(r.id) for r in a.records} & {str(r.id) for r in b.records}


def compare(a: RunFile, b: RunFile, grouping: str) -> dict:
    """The ``compare`` section of the analyze document (see docs/analyze.md)."""
    by_id_b = {str(r.id): r for r in b.records}
    ids_a = {str(r.id) for r in a.records}
    common = [r for r in a.records if str(r.id) in by_id_b]
    matched_b = [by_id_b[str(r.id)] for r in common]
    differ = []
    for ra, rb in zip(common, matched_b):
        outs_a = answers(ra.fields, "output_token_ids")
        outs_b = answers(rb.fields, "output_token_ids")
        for turn in range(max(len(outs_a), len(outs_b))):
            ta = outs_a[turn] if turn < len(outs_a) else []
            tb = outs_b[turn] if turn < len(outs_b) else []
            pos = first_difference(ta or [], tb or [])
            if pos is not None:
                differ.append({"id": ra.id, "turn": turn, "position": pos,
                               "a_token": ta[pos] if pos < len(ta) else None,
                               "b_token": tb[pos] if pos < len(tb) else None})
                break
    # group both by file a's labels: proposer or bucket may differ between the files
    labels = [group_label(r, grouping) for r in common]
    rows_a = {r["group"]: r for r in group_table(common, grouping, labels)}
    rows_b = {r["group"]: r for r in group_table(matched_b, grouping, labels)}
    keys = ("num_records", "num_output_tokens", "num_steps", "tokens_per_step",
            "mean_acceptance_length", "acceptance_rate")
    groups = []
    for name in rows_a:  # both tables hold the same records, so the same groups
        ra, rb = rows_a[name], rows_b[name]
        groups.append({"group": name, "a": {k: ra[k] for k in keys},
                       "b": {k: rb[k] for k in keys},
                       "steps_ratio": (round(rb["num_steps"] / ra["num_steps"], 6)
                                       if ra["num_steps"] else None)})
    return {
        "a": str(a.path), "b": str(b.path),
        "grouping": grouping,
        "num_common": len(common),
        "only_in_a": sorted(ids_a - set(by_id_b)),
        "only_in_b": sorted(set(by_id_b) - ids_a),
        "output_setting_differences": output_setting_differences(a, b),
        "num_differing_outputs": len(differ),
        "differing_outputs": differ,
        "groups": groups,
    }
