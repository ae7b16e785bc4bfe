"""PNG plots of an analyze document (matplotlib, Agg backend; ``pip install specbatch[plot]``).

    acceptance_length.png         per group: share of drafting steps by acceptance length
    per_position_acceptance.png   per group: acceptance at each draft position (unconditional,
                                  and the acceptance rate, accepted / drafts that reached the
                                  position, where at least MIN_CONDITIONAL_SUPPORT drafts did;
                                  for a file written before ``num_draft_tokens_per_pos``, the
                                  conditional acceptance instead)
    predicted_vs_measured.png     per record: ``spec.predicted_acceptance_length`` against the
                                  measured mean acceptance length (only when predictions exist)
    what_if.png                   per group: predicted speedup (with a cost model) or replayed
                                  output tokens per decode step over k, one line per n-gram
                                  size range
"""

from __future__ import annotations

import math
from pathlib import Path

from specbatch.analyze.tables import ALL, distinct_rows
from specbatch.io.records import Record

MAX_PANELS_PER_ROW = 4
# A conditional acceptance (accepted at i / accepted at i - 1) from fewer drafting steps than
# this is noise (3 of 3 plots as 1.0): such points are left out of the plot.
MIN_CONDITIONAL_SUPPORT = 20


def line_colors(n: int) -> list:
    """``n`` distinct colours: tab10 up to 10 lines, tab20 (its 10 dark, then its 10 light
    shades) up to 20, else evenly spaced over the ``turbo`` colormap. Matplotlib's default
    cycle repeats after 10 (coding and summarization both came out blue)."""
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](2 * i if i < 10 else 2 * (i - 10) + 1) for i in range(n)]
    return [colormaps["turbo"](i / (n - 1)) for i in range(n)]


def conditional_points(row: dict, min_support: int = MIN_CONDITIONAL_SUPPORT
                       ) -> list[tuple[int, float, int]]:
    """``(position i, conditional acceptance, drafting steps it is measured on)`` of an analyze
    row, for the positions measured on at least ``min_support`` drafting steps (those that
    accepted i - 1 drafts; all drafting steps for i = 1)."""
    per_pos = row["num_accepted_tokens_per_pos"]
    support = [row["num_drafts"]] + per_pos[:-1]
    return [(i + 1, y, n) for i, (y, n) in
            enumerate(zip(row["conditional_acceptance_per_pos"], support))
            if y is not None and n >= min_support]


def rate_points(row: dict, min_support: int = MIN_CONDITIONAL_SUPPORT
                ) -> list[tuple[int, float, int]]:
    """``(position i, acceptance rate, drafts that reached i)`` of an analyze row (accepted at
    i / ``num_draft_tokens_per_pos[i]``), for the positions at least ``min_support`` drafts
    reached; ``[]`` for a row without the drafted counts."""
    drafted = row.get("num_draft_tokens_per_pos")
    if drafted is None:
        return []
    return [(i + 1, y, n) for i, (y, n) in enumerate(zip(row["acceptance_rate_per_pos"], drafted))
            if y is not None and n >= min_support]


def write_plots(doc: dict, records: list[tuple[str, Record]], out_dir: str | Path) -> list[Path]:
    """Write the plots of ``doc`` (the analyze document) into ``out_dir``; returns their paths.

    records: ``(group, record)`` for every analysed record (for the per-record plot).
    Raises ``ValueError`` when matplotlib is not installed.
    """
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install -c constraints.txt -e '.[plot]' in "
                         "a checkout (pip install 'specbatch[plot]' from a wheel)") from None
    matplotlib.use("Agg")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = distinct_rows(doc["tables"][doc["primary_grouping"]])  # no two equal panels
    paths = [_acceptance_length(rows, out / "acceptance_length.png", doc["primary_grouping"]),
             _per_position(rows, out / "per_position_acceptance.png", doc["primary_grouping"])]
    pairs = [(g, r.fields["spec"]["predicted_acceptance_length"],
              r.fields["spec"].get("mean_acceptance_length")) for g, r in records
             if r.fields["spec"].get("predicted_acceptance_length") is not None]
    if pairs:
        paths.append(_predicted_vs_measured(pairs, out / "predicted_vs_measured.png"))
    if doc.get("what_if") and doc["what_if"]["groups"]:
        paths.append(_what_if(doc["what_if"], out / "what_if.png"))
    return paths


def _panels(n: int, width: float = 3.6, height: float = 2.9):
    import matplotlib.pyplot as plt

    ncols = min(n, MAX_PANELS_PER_ROW)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + 0.6),
                             squeeze=False, sharex=True, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax in flat[:n]:  # shared scales, but every panel keeps its tick labels
        ax.tick_params(labelbottom=True, labelleft=True)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _acceptance_length(rows: list[dict], path: Path, grouping: str) -> Path:
    rows = [r for r in rows if r["acceptance_length_histogram"]] or rows[-1:]
    fig, axes = _panels(len(rows))
    for ax, r in zip(axes, rows):
        hist = {int(k): v for k, v in r["acceptance_length_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        ax.bar(xs, [100 * hist[x] / total for x in xs], color="tab:blue")
        mal = r["mean_acceptance_length"]
        ax.set_title(f"{r['group']} (mean {mal:.2f})" if mal else r["group"], fontsize=10)
        ax.set_xlabel("acceptance length (tokens / drafting step)")
        ax.set_ylabel("drafting steps (%)")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Acceptance length per drafting step, by {grouping}")
    return _save(fig, path)


def _per_position(rows: list[dict], path: Path, grouping: str) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_u, ax_c) = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    colors = line_colors(sum(r["group"] != ALL for r in rows))
    # the rate where every row knows the drafts that reached each position (files written
    # before num_draft_tokens_per_pos do not): one measure in one panel
    rates = all(r.get("acceptance_rate_per_pos") is not None for r in rows if r["num_drafts"])
    right = rate_points if rates else conditional_points
    for r in rows:
        if r["group"] == ALL:
            style = dict(color="black", linewidth=2.5)
        else:
            style = dict(color=colors.pop(0))
        ys = r["acceptance_per_pos"]
        if any(y is not None for y in ys):
            ax_u.plot(range(1, len(ys) + 1), [math.nan if y is None else y for y in ys],
                      marker="o", label=r["group"], **style)
        points = right(r)
        if points:  # labelled with the drafting steps behind its first and last point
            ax_c.plot([i for i, _, _ in points], [y for _, y, _ in points], marker="o",
                      label=f"{r['group']} (n {points[0][2]}..{points[-1][2]})", **style)
    ax_u.set_title("unconditional: accepted at position i / drafting steps")
    if rates:
        ax_c.set_title(f"rate: accepted at i / drafts that reached i\n(points measured on "
                       f"fewer than {MIN_CONDITIONAL_SUPPORT} drafts are left out)", fontsize=10)
    else:
        ax_c.set_title(f"conditional: accepted at i / accepted at i - 1\n(points measured on "
                       f"fewer than {MIN_CONDITIONAL_SUPPORT} drafting steps are left out)",
                       fontsize=10)
    for ax in (ax_u, ax_c):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position i (1 = first draft token)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    ax_u.set_ylabel("acceptance (fraction of steps)")
    ax_c.legend(title=f"{grouping} (drafting steps)", fontsize=8, loc="center left",
                bbox_to_anchor=(1.01, 0.5))
    fig.suptitle(f"Per-position acceptance, by {grouping}")
    return _save(fig, path)


def _predicted_vs_measured(pairs: list[tuple[str, float, float | None]], path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    groups = sorted({g for g, _, _ in pairs})
    for g, color in zip(groups, line_colors(len(groups))):
        pts = [(p, m) for gg, p, m in pairs if gg == g and m is not None]
        ax.scatter([p for p, _ in pts], [m for _, m in pts], s=14, alpha=0.7, label=g,
                   color=color)
    values = [v for _, p, m in pairs for v in (p, m) if v is not None]
    lo, hi = min(values + [1.0]), max(values + [2.0])
    ax.plot([lo, hi], [lo, hi], color="gray", linestyle="--", label="predicted = measured")
    ax.set_xlabel("predicted mean acceptance length (tokens / drafting step)")
    ax.set_ylabel("measured mean acceptance length (tokens / drafting step)")
    ax.set_title("Predicted vs measured acceptance, per record")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _what_if(wi: dict, path: Path) -> Path:
    rows = distinct_rows(wi["groups"])  # one group: not beside an equal (all) panel
    speedup = wi["has_cost_model"]
    # without a cost model: tokens per decode step, the number the best setting is chosen by
    key = "predicted_speedup" if speedup else "tokens_per_decode_step"
    fig, axes = _panels(len(rows))
    settings = wi["settings"]
    lookups = sorted({(s["prompt_lookup_min"], s["prompt_lookup_max"]) for s in settings})
    for ax, r in zip(axes, rows):
        by_name = {c["name"]: c for c in r["configs"]}
        for lo, hi in lookups:
            pts = sorted((s["k"], by_name[s["name"]][key]) for s in settings
                         if (s["prompt_lookup_min"], s["prompt_lookup_max"]) == (lo, hi)
                         and by_name[s["name"]][key] is not None)
            if pts:
                ax.plot([k for k, _ in pts], [v for _, v in pts], marker="o", markersize=3,
                        label=f"n-gram {lo}-{hi}")
        if speedup:
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_title(f"{r['group']} (best {r['best']['name'].replace('ngram:', '')})",
                     fontsize=9)
        ax.set_xlabel("k (draft tokens / step)")
        ax.set_ylabel("predicted speedup vs none (x)" if speedup
                      else "output tokens / decode step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    what = (f"Predicted decode speedup at batch size {wi['batch_size']}" if speedup
            else "replayed output tokens per decode step (no cost model)")
    fig.suptitle(f"What-if over k, by {wi['grouping']}: {what}")
    return _save(fig, path)
