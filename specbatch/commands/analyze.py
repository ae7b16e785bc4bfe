"""``specbatch analyze``: read output files, build one document of tables, print it as text or
JSON, and optionally plot it. The document's fields are documented in docs/analyze.md.

Exit status: 0 done; 2 bad input or options (a missing or unreadable file, a file with no
output record, as the run's input, ``--compare`` without exactly two files or of two files
with no record id in common, an unreadable
calibration file, no matplotlib for ``--plot``).
"""

from __future__ import annotations

from dataclasses import dataclass

import click
import orjson

from specbatch.analyze.load import RunFile, load_run
from specbatch.analyze.plots import MIN_CONDITIONAL_SUPPORT
from specbatch.analyze.tables import (ALL, NO_GROUPS, default_grouping, differing_settings,
                                      distinct_rows, file_tables, group_table, record_groups)
from specbatch.commands.common import file_age

EXIT_OK, EXIT_BAD_INPUT = 0, 2
MAX_DIFFS_SHOWN = 20


@dataclass(frozen=True)
class AnalyzeOptions:
    paths: tuple[str, ...]
    by: str | None = None
    what_if: bool = False
    calibration: str | None = None
    batch_size: int | None = None  # None: the run's --max-batch-size (OUT.config.json), or 16
    compare: bool = False
    as_json: bool = False
    plot_dir: str | None = None


def build_document(files: list[RunFile], opts: AnalyzeOptions, cost=None,
                   tokenizer_for=None) -> dict:
    """The analyze document: ``files``, ``tables`` per grouping, and ``what_if`` / ``compare``
    when asked. tokenizer_for: model id -> tokenizer (default: load the run's model)."""
    records = [r for f in files for r in f.records]
    primary = opts.by or default_grouping(records)
    groupings = [primary] + (["proposer"] if primary != "proposer" else [])
    # files of different settings (method, k, model, sampling...): rows per file, no total
    # over them (docs/analyze.md)
    differ = differing_settings([f.config for f in files]) if len(files) > 1 else []
    doc: dict = {
        "files": [_file_info(f) for f in files],
        "primary_grouping": primary,
        "pooled": not differ,
        "differing_settings": differ,
        "tables": {g: file_tables(files, g) if differ else group_table(records, g)
                   for g in groupings},
        "what_if": None,
        "compare": None,
    }
    if opts.what_if:
        from specbatch.analyze.whatif import what_if

        doc["what_if"] = what_if(files, primary, tokenizer_for or load_tokenizer,
                                 opts.batch_size or _run_batch_size(files), cost,
                                 pooled=not differ)
    if opts.compare:
        from specbatch.analyze.compare import compare

        doc["compare"] = compare(files[0], files[1], primary)
    return doc


def _other_run(cost, config: dict | None) -> str | None:
    """Why ``cost`` does not price the run of ``config``: measured for another model or dtype
    (None when they match, or when the run's config does not say)."""
    config = config or {}
    for key, what in (("model", "model_id"), ("dtype", "dtype")):
        ran, measured = config.get(key), getattr(cost, what)
        if ran and measured and ran != measured:
            return f"measured for {key} {measured}, the run used {ran}"
    return None


def _cached_calibration(config: dict | None) -> str | None:
    """The calibration `run`, `bench` and `calibrate` cached for the run's model and dtype on
    this host (``auto.costmodel.find_cached``), or None."""
    if not config or not config.get("model") or not config.get("dtype"):
        return None
    from specbatch.models.loader import cache_root
    from specbatch.auto.costmodel import find_cached

    path = find_cached(cache_root(), config["model"], config["dtype"], config.get("device"))
    return str(path) if path else None


def run_analyze(opts: AnalyzeOptions) -> int:
    if opts.compare and len(opts.paths) != 2:
        return _bad(f"--compare needs exactly two output files, got {len(opts.paths)}")
    if opts.calibration and not opts.what_if:
        return _bad("--calibration is used by --what-if; add --what-if")
    try:
        files = [load_run(p) for p in opts.paths]
        cost = None
        calibration = opts.calibration
        if opts.what_if and not calibration:
            calibration = _cached_calibration(files[0].config)
            if calibration:
                click.echo(f"what-if: step costs from the cached calibration {calibration}, "
                           f"measured {file_age(calibration)} (--calibration FILE takes another; "
                           "`specbatch calibrate --recalibrate` measures again)", err=True)
        if calibration:
            from specbatch.auto.costmodel import load, other_engine

            cost = load(calibration)
            why = cost.problem() or _other_run(cost, files[0].config) or other_engine(cost)
            if why:
                click.echo(f"warning: {calibration}: {why}; the predicted speedups may be off "
                           "(`specbatch calibrate --recalibrate` measures this machine again)",
                           err=True)
    except ValueError as e:
        return _bad(str(e))
    for f in files:
        for p in f.problems:
            click.echo(f"warning: skipped {p}", err=True)
    unknown = _unknown_grouping(opts.by, files)
    if unknown:
        return _bad(unknown)
    if opts.compare:
        from specbatch.analyze.compare import common_ids

        a, b = files
        if not common_ids(a, b):
            return _bad(f"--compare: {a.path} and {b.path} have no records in common (a: "
                        f"{len(a.records)} records, b: {len(b.records)} records; records "
                        "are matched by id): compare two runs of the same input")
    doc = build_document(files, opts, cost)
    if doc["what_if"] is not None:
        doc["what_if"]["calibration"] = calibration
    if opts.plot_dir:
        from specbatch.analyze.plots import write_plots

        primary = doc["primary_grouping"]
        try:
            paths = write_plots(doc, record_groups(files, primary, doc["pooled"]),
                                opts.plot_dir)
        except ValueError as e:
            return _bad(str(e))
        doc["plots"] = [str(p) for p in paths]
    if opts.as_json:
        click.echo(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(format_text(doc))
    return EXIT_OK


def load_tokenizer(model_id: str):
    """The tokenizer of the run's model, from ``OUT.config.json``'s ``model``
    (``<registry name or path>@sha256:<16 hex>``), without the weights (from the weight cache:
    about a second for SmolLM2-135M); warns when the model there now has other weights."""
    from specbatch.models.loader import load_tokenizer as load

    name = model_id.rpartition("@sha256:")[0] or model_id
    tokenizer, now = load(name)
    if now != model_id:
        click.echo(f"warning: the run used {model_id}; {name} is now {now} (its tokenizer is "
                   "used for the replay)", err=True)
    return tokenizer


def _unknown_grouping(by: str | None, files: list[RunFile]) -> str | None:
    """The error for ``--by FIELD`` that no record holds (a typo would put every record in one
    group ``-``), naming the fields the records have and the closest one; else None."""
    import difflib

    from specbatch.analyze.tables import NO_GROUPS

    if by is None or by in ("bucket", "proposer", NO_GROUPS):
        return None
    fields = sorted({k for f in files for r in f.records for k in r.fields})
    if by in fields:
        return None
    close = difflib.get_close_matches(by, fields + ["bucket", "proposer"], n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return (f"--by {by}: no record has that field{hint} (fields: {', '.join(fields)}; also "
            f"bucket, proposer, {NO_GROUPS})")


def _bad(msg: str) -> int:
    click.echo(f"error: {msg}", err=True)
    return EXIT_BAD_INPUT


def _file_info(f: RunFile) -> dict:
    c = f.config or {}
    return {"path": str(f.path), "config_found": f.config is not None,
            "model": c.get("model"), "dtype": c.get("dtype"), "method": c.get("method"),
            "k": c.get("k"), "prompt_lookup_min": c.get("prompt_lookup_min"),
            "prompt_lookup_max": c.get("prompt_lookup_max"),
            "max_model_len": c.get("max_model_len"), "num_records": len(f.records),
            "num_problems": len(f.problems)}


# ---- text ---------------------------------------------------------------------------------
# the tables' columns in a few words (docs/analyze.md has them in full)
COLUMNS = (
    "columns: answers: one per record, one per turn of a turns record; steps: forwards that "
    "emitted tokens;",
    "  prefill: one per answer (its first token); tok/step: out tok / steps; acc len: 1 + "
    "accepted / drafting steps;",
    "  acc rate: accepted / draft tokens; no-draft: decode steps without a draft "
    "(docs/analyze.md)")


def format_text(doc: dict) -> str:
    out = []
    for f in doc["files"]:
        if f["model"] is None:  # no OUT.config.json beside the file: nothing to say of the run
            out.append(f"{f['path']}: {f['num_records']} records, run settings unknown (no "
                       "OUT.config.json beside it)")
            continue
        ngram = (f" n-gram {f['prompt_lookup_min']}-{f['prompt_lookup_max']}"
                 if _uses_prompt_lookup(f["method"]) else "")
        out.append(f"{f['path']}: {f['num_records']} records, {f['method'] or '?'} "
                   f"k={f['k']}{ngram}, {f['model']}")
    if not doc.get("pooled", True):
        out.append(f"note: the files differ in {', '.join(doc['differing_settings'])}: each "
                   "file has its own rows and (all) total; no row pools them")
    ks = [f["k"] for f in doc["files"] if isinstance(f.get("k"), int)]
    for grouping, rows in doc["tables"].items():
        out += ["", *_group_table_text(grouping, rows, min(ks, default=None))]
    if doc["tables"]:
        out += ["", *COLUMNS]
    if doc["what_if"] is not None:
        out += ["", *_what_if_text(doc["what_if"])]
    if doc["compare"] is not None:
        out += ["", *_compare_text(doc["compare"])]
    for p in doc.get("plots", []):
        out.append(f"wrote {p}")
    return "\n".join(out)


def _setting(value) -> str:
    """A run-config value in one short piece: a string as it is, else compact JSON."""
    text = value if isinstance(value, str) else orjson.dumps(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _group_table_text(grouping: str, rows: list[dict], k: int | None = None) -> list[str]:
    """One grouping's table, per-position block and finish reasons. k: the runs' smallest k
    (None: unknown), which the per-position block names where drafts ran past it."""
    rows = distinct_rows(rows)  # one group: its row equals (all)
    w = max(12, *(len(r["group"]) + 1 for r in rows))
    lines = ["== all records ==" if grouping == NO_GROUPS else f"== by {grouping} ==",
             f"{'group':<{w}}{'records':>8}{'answers':>8}{'out tok':>9}{'steps':>8}"
             f"{'prefill':>8}{'tok/step':>9}{'acc len':>8}{'acc rate':>9}{'no-draft':>9}"]
    for r in rows:
        lines.append(f"{r['group']:<{w}}{r['num_records']:>8}{r['num_answers']:>8}"
                     f"{r['num_output_tokens']:>9}{r['num_steps']:>8}{r['num_prefill_steps']:>8}"
                     f"{_f(r['tokens_per_step']):>9}{_f(r['mean_acceptance_length']):>8}"
                     f"{_f(r['acceptance_rate']):>9}{_f(r['no_draft_share'], '.1%'):>9}")
    lines += _per_position_text(rows, w, k)
    reasons = sorted({k for r in rows for k in r["finish_reasons"]})
    lines += ["finish reasons (answers):",
              f"{'group':<{w}}" + "".join(f"{k:>8}" for k in reasons)]
    for r in rows:
        lines.append(f"{r['group']:<{w}}"
                     + "".join(f"{r['finish_reasons'].get(k, 0):>8}" for k in reasons))
    return lines


def _uses_prompt_lookup(method: str | None) -> bool:
    """Whether a run of ``method`` drafts by prompt lookup, so that its n-gram sizes
    (``prompt_lookup_min`` / ``max``) mean something (``methods.Method.prompt_lookup``)."""
    from specbatch import methods

    entry = methods.get(method) if method else None
    return entry is not None and entry.prompt_lookup


def _per_position_text(rows: list[dict], w: int, k: int | None = None) -> list[str]:
    """The per-position block of a table: the acceptance rate at each draft position
    (accepted / drafting steps whose draft reached it), or, for records written before
    ``num_draft_tokens_per_pos``, the unconditional / conditional acceptance, said so. Rows
    that never drafted (a ``none`` run) are left out, and the block when no row drafted.
    Where drafts ran past ``k``, the header says why (suffix drafts may run to
    ``SUFFIX_CAP_FACTOR * k`` tokens)."""
    from specbatch.methods import SUFFIX_CAP_FACTOR

    rows = [r for r in rows if r["num_drafts"]]
    num_pos = max((len(r["acceptance_per_pos"]) for r in rows), default=0)
    if not num_pos:
        return []
    past_k = (f"; positions past k = {k} are suffix drafts, which may run to "
              f"{SUFFIX_CAP_FACTOR}k tokens where a match is long"
              if k is not None and num_pos > k else "")
    if all(r["acceptance_rate_per_pos"] is not None for r in rows):
        lines = ["per-position acceptance rate: accepted / drafts that reached the position "
                 f"(draft position 1 to the longest draft{past_k}; *: fewer than "
                 f"{MIN_CONDITIONAL_SUPPORT} drafts reached it, a rate to read with care):",
                 f"{'group':<{w}}" + "".join(f"{i + 1:>7}" for i in range(num_pos))]
        for r in rows:
            cells = [_f(x) + ("" if n >= MIN_CONDITIONAL_SUPPORT else "*")
                     for x, n in zip(r["acceptance_rate_per_pos"], r["num_draft_tokens_per_pos"])]
            lines.append(f"{r['group']:<{w}}" + "".join(f"{c:>7}" for c in cells))
        return lines
    lines = ["per-position acceptance, unconditional/conditional (draft position 1 to the "
             f"longest draft{past_k}; a file written before spec.num_draft_tokens_per_pos does not say "
             "how many drafts reached each position, so conditional = accepted at i / accepted "
             "at i - 1 counts a draft that ended before i as rejected there):",
             f"{'group':<{w}}" + "".join(f"{i + 1:>11}" for i in range(num_pos))]
    for r in rows:
        cells = [f"{_f(u)}/{_f(c)}" for u, c in zip(r["acceptance_per_pos"],
                                                   r["conditional_acceptance_per_pos"])]
        lines.append(f"{r['group']:<{w}}" + "".join(f"{c:>11}" for c in cells))
    return lines


def _redundant_totals(wi: dict) -> set[str]:
    """The what-if ``(all)`` rows that repeat a group: the total of one pooled group, or, for
    files not pooled, ``FILE: (all)`` of a file with one group."""
    names = [g["group"] for g in wi["groups"]]
    groups = [n for n in names if n != ALL and not n.endswith(f": {ALL}")]
    if ALL in names:
        return {ALL} if len(groups) == 1 else set()
    out = set()
    for total in names:
        if total.endswith(f": {ALL}"):
            prefix = total[:-len(ALL)]
            if sum(n.startswith(prefix) for n in groups) == 1:
                out.add(total)
    return out


def _what_if_text(wi: dict) -> list[str]:
    skipped = ", ".join(f"{n}: {why}" for why, n in wi["skipped_reasons"].items())
    lines = [f"== what-if by {wi['grouping']}: {wi['num_replayed']} records replayed at T = 0"
             + (f" ({wi['num_skipped']} skipped: {skipped})" if wi["num_skipped"] else "")
             + " =="]
    lines += [f"note: {n}" for n in wi.get("notes", [])]
    if wi["has_cost_model"]:
        lines.append(f"predicted speedup: each group's records run as one job of at most "
                     f"{wi['batch_size']} rows a step, verify steps only (prefill costs every "
                     "setting the same and is left out, so a measured end-to-end ratio, as "
                     "`bench` gives, sits nearer 1)")
    sc = wi["self_check"]
    if sc["num_checked"]:
        lines.append(f"self-check: the replay of the run's own setting equals the recorded "
                     f"stats for {sc['num_equal']} of {sc['num_checked']} ngram records")
        bad = [c for c in sc["records"] if not c["equal"]]
        for c in bad[:MAX_DIFFS_SHOWN]:
            lines.append(f"  differs: {c['file']} id={c['id']!r} ({c['setting']}; a planner "
                         "that changes k per step, or a tokenizer that changed, does this)")
    settings = wi["settings"]
    lookups = sorted({(s["prompt_lookup_min"], s["prompt_lookup_max"]) for s in settings})
    ks = sorted({s["k"] for s in settings})
    metrics = [("mean_acceptance_length", "replayed mean acceptance length (tokens / drafting "
                "step)", ".2f"),
               ("tokens_per_decode_step", "replayed output tokens / decode step (drafting or "
                "not)", ".2f")]
    if wi["has_cost_model"]:
        metrics.append(("predicted_speedup", f"predicted decode speedup vs none at batch size "
                        f"{wi['batch_size']} (x)", ".2f"))
    redundant = _redundant_totals(wi)
    for g in wi["groups"]:
        if g["group"] in redundant:
            continue
        by_key = {(c["name"]): c for c in g["configs"]}
        lines.append(f"{g['group']}: {g['num_records']} records, {g['num_output_tokens']} output "
                     f"tokens, mean context {g['mean_context_len']} tokens")
        for key, title, fmt in metrics:
            lines += [f"  {title}", "  n-gram " + "".join(f"{'k=' + str(k):>7}" for k in ks)]
            for lo, hi in lookups:
                cells = []
                for k in ks:
                    c = by_key.get(f"ngram:k={k}:min={lo}:max={hi}")
                    cells.append(_f(c[key], fmt) if c else "")
                lines.append(f"  {f'{lo}-{hi}':<7}" + "".join(f"{c:>7}" for c in cells))
        b = g["best"]
        if b["criterion"] == "predicted_speedup":
            lines.append(f"  best: {b['name']}, predicted speedup {b['value']:.2f}x")
        else:
            lines.append(f"  best: {b['name']}, {b['value']:.2f} tokens / decode step (no cost "
                         "model for this run's model and dtype on this host: longer drafts look "
                         "free; run `specbatch calibrate` or pass --calibration)")
    return lines


def _compare_text(cmp: dict) -> list[str]:
    lines = [f"== compare a = {cmp['a']} with b = {cmp['b']}: {cmp['num_common']} common "
             f"records, by {cmp['grouping']} =="]
    if cmp["only_in_a"] or cmp["only_in_b"]:
        lines.append(f"only in a: {len(cmp['only_in_a'])} records; only in b: "
                     f"{len(cmp['only_in_b'])} records")
    w = max(12, *(len(g["group"]) + 1 for g in cmp["groups"]))
    lines.append(f"{'group':<{w}}{'records':>8}{'steps a':>9}{'steps b':>9}{'b/a':>7}"
                 f"{'tok/step a':>11}{'tok/step b':>11}{'acc len a':>10}{'acc len b':>10}"
                 f"{'acc rate a':>11}{'acc rate b':>11}")
    for g in cmp["groups"]:
        a, b = g["a"], g["b"]
        lines.append(f"{g['group']:<{w}}{a['num_records']:>8}{a['num_steps']:>9}"
                     f"{b['num_steps']:>9}{_f(g['steps_ratio']):>7}"
                     f"{_f(a['tokens_per_step']):>11}{_f(b['tokens_per_step']):>11}"
                     f"{_f(a['mean_acceptance_length']):>10}{_f(b['mean_acceptance_length']):>10}"
                     f"{_f(a['acceptance_rate']):>11}{_f(b['acceptance_rate']):>11}")
    n = cmp["num_differing_outputs"]
    settings = ", ".join(f"{d['key']} {_setting(d['a'])} vs {_setting(d['b'])}"
                         for d in cmp["output_setting_differences"])
    if not n:
        why = ""
    elif settings:  # another dtype or model gives other tokens: not speculation's doing
        why = (f" (expected: the runs differ in what decides the tokens: {settings}; "
               "compare runs of the same model, dtype, sampling and seed to check speculation)")
    else:
        why = " (should be 0: speculation must not change the output)"
    lines.append(f"records whose output_token_ids differ: {n} of {cmp['num_common']}{why}")
    for d in cmp["differing_outputs"][:MAX_DIFFS_SHOWN]:
        at = f"  id={d['id']!r}: turn {d['turn']}, "
        if d["a_token"] is None or d["b_token"] is None:  # one output is a prefix of the other
            short, other = ("a", "b") if d["a_token"] is None else ("b", "a")
            lines.append(f"{at}{short} ends after {d['position']} tokens, where {other} goes "
                         f"on (token {d[other + '_token']})")
        else:
            lines.append(f"{at}first difference at token {d['position']} "
                         f"(a {d['a_token']}, b {d['b_token']})")
    if n > MAX_DIFFS_SHOWN:
        lines.append(f"  ... and {n - MAX_DIFFS_SHOWN} more (see --json)")
    return lines


def _run_batch_size(files, default: int = 16) -> int:
    """The rows per step ``--what-if`` predicts at without ``--batch-size``: the first run's
    ``max_batch_size`` in its OUT.config.json (written since it was recorded), else
    ``default``."""
    for f in files:
        b = (f.config or {}).get("max_batch_size")
        if isinstance(b, int) and not isinstance(b, bool) and b >= 1:
            return b
    return default


def command(paths, by, what_if, calibration, batch_size, compare, as_json, plot_dir) -> int:
    """``specbatch analyze`` from its parsed flags (``cli.analyze``): ``run_analyze``. Returns
    the exit status."""
    return run_analyze(AnalyzeOptions(
        paths=tuple(paths), by=by, what_if=what_if, calibration=calibration,
        batch_size=batch_size, compare=compare, as_json=as_json, plot_dir=plot_dir))


__all__ = ["AnalyzeOptions", "build_document", "command", "run_analyze", "format_text"]
