"""``specbatch bench``: several configurations on the same records, interleaved, side by side.

Records are grouped by category (a single group when the input has none). For each group every
configuration runs the group's records with a fresh engine, in a Williams design (``run_order``):
the first configuration rotates from group to group and round to round, so slow drift of the
machine spreads over all configurations, and no configuration runs right after the same one in
two rounds running (rotation alone keeps neighbours: with one group, auto ran after suffix in
every round).
Output tok/s = completion tokens / wall seconds of the run (prefill included). Ratios are to
``none`` wherever it is one of the configurations, whatever its place; without it, to the first
configuration, and the table says so. The outputs of every configuration are compared with that
baseline's: speculation must not change them.

Progress on stderr: after each category, its tok/s so far (cumulative over rounds); after each
round, each configuration's tok/s of that round alone over every category (``round_line``).
Under the table, each configuration's per-round overall tok/s and their spread
((max - min) / mean, ``spread_lines``): how far rounds of one arm disagree, the noise floor a
ratio between arms must clear.
"""

from __future__ import annotations

import logging

import time
from collections import defaultdict
from dataclasses import dataclass, replace

import click

from specbatch import methods
from specbatch.commands.common import JobOptions
from specbatch.config import EngineConfig, SamplingParams, SpecConfig
from specbatch.spec_decode.stats import SpecStats


@dataclass(frozen=True, kw_only=True)
class BenchOptions(JobOptions):
    specs: tuple[tuple[str, SpecConfig], ...]
    per_category: int | None = None
    categories: tuple[str, ...] | None = None
    repeats: int = 1
    draft_model: str | None = None
    groups: tuple[tuple[str, tuple[str, ...]], ...] = ()  # extra table rows: (name, categories)


def parse_configs(text: str,
                  draft_model: str | None = None) -> tuple[tuple[str, SpecConfig], ...]:
    """``"none,ngram:k=3,ngram:k=5:min=1:max=3,draft:k=3,auto:k=8,auto:draft"`` -> labelled
    ``SpecConfig``s; the ``draft`` ones use ``draft_model``; for ``auto`` k is the cap, and
    ``auto:draft`` may also draft with ``draft_model``.

    Raises ``ValueError`` on an unknown method or key, a key given twice (``auto:k=3:k=4``), a
    configuration given twice, or ``draft`` without a draft model."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        method, *parts = item.split(":")
        keys_given = [p.partition("=")[0] for p in parts]
        twice = sorted({key for key in keys_given if keys_given.count(key) > 1})
        if twice:
            raise ValueError(f"config {item!r}: {', '.join(twice)} given twice")
        if item in (label for label, _ in out):
            raise ValueError(f"config {item!r} given twice")
        kwargs: dict = {"method": method}
        entry = methods.get(method)  # None: SpecConfig names the known methods
        use = entry.draft_model if entry is not None else "refused"
        if use == "needs" or (use == "optional" and "draft" in parts):
            if draft_model is None:
                raise ValueError(f"config {item!r} needs --draft-model")
            kwargs["draft_model"] = draft_model
        parts = [p for p in parts if not (use == "optional" and p == "draft")]
        keys = entry.bench_keys if entry is not None else methods.BENCH_KEYS
        for part in parts:
            key, _, value = part.partition("=")
            if key not in keys or not value.isdigit():
                raise ValueError(f"config {item!r}: expected method"
                                 + "".join(f"[:{key}=N]" for key in keys))
            kwargs[keys[key]] = int(value)
        out.append((item, SpecConfig(**kwargs)))
    if not out:
        raise ValueError("no configurations given")
    if draft_model is not None and all(spec.draft_model is None for _, spec in out):
        raise ValueError("--draft-model is used by no configuration (draft:k=N or auto:draft)")
    return tuple(out)


def baseline(labels: list[str]) -> str:
    """The configuration ratios are taken to: the first ``none``, else the first of all."""
    return next((lb for lb in labels if not _drafts(lb)), labels[0])


def _drafts(label: str) -> bool:
    """Whether configuration ``label``'s method drafts (not ``none``)."""
    entry = methods.get(label.split(":")[0])
    return entry is None or entry.drafts


def parse_groups(items) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``("copy-heavy=summarization,rag", ...)`` -> ``(("copy-heavy", ("summarization",
    "rag")), ...)``. Raises ``ValueError`` on an item without ``=`` or categories."""
    out = []
    for item in items:
        name, eq, cats = item.partition("=")
        members = tuple(c.strip() for c in cats.split(",") if c.strip())
        if not eq or not name.strip() or not members:
            raise ValueError(f"--group {item!r}: expected NAME=CATEGORY[,CATEGORY...]")
        out.append((name.strip(), members))
    return tuple(out)


def run_bench(opts: BenchOptions) -> int:
    from specbatch.io.records import error_lines
    from specbatch.llm import LLM, ModelLoadError
    from specbatch.commands.run import EXIT_BAD_INPUT, load_records, warn_if_busy

    records, errors = load_records(opts)
    if errors:
        for line in error_lines(errors, "fail", can_skip=False, none_valid=not records):
            click.echo(line, err=True)
        return EXIT_BAD_INPUT
    groups: dict[str, list] = defaultdict(list)
    for r in records:
        cat = str(r.fields.get("category", "all"))
        if opts.categories and cat not in opts.categories:
            continue
        if opts.per_category is None or len(groups[cat]) < opts.per_category:
            groups[cat].append(r)
    if not groups:
        click.echo("error: no records left after --categories / --per-category", err=True)
        return EXIT_BAD_INPUT
    # one load for every configuration; the draft model only when a configuration drafts with it
    spec = next((s for _, s in opts.specs if s.draft_model is not None), opts.specs[0][1])
    if opts.cpu is not None:
        logging.getLogger("specbatch").info(opts.cpu.line())
    opts = replace(opts, engine=opts.engine.for_model(opts.model, opts.cache_dir))  # dtype auto
    warn_if_busy()
    try:
        llm = LLM.from_config(opts.model, spec, opts.engine, cache_dir=opts.cache_dir,
                              seed=opts.run_seed, echo=lambda line: click.echo(line, err=True))
    except ModelLoadError as e:
        click.echo(f"error: {e}", err=True)
        return EXIT_BAD_INPUT
    from specbatch.commands.common import token_id_flag_error

    if (why := token_id_flag_error(opts.sampling, llm.loaded.model.config.vocab_size)):
        click.echo(f"error: {why}", err=True)  # once, not once per record
        return EXIT_BAD_INPUT
    if opts.calibration is not None:
        try:
            for line in llm.pin_calibration(opts.calibration):
                click.echo(f"warning: {line}", err=True)
        except ValueError as e:
            click.echo(f"error: --calibration {e}", err=True)
            return EXIT_BAD_INPUT

    # the memory check of ``run``, once for every configuration (batch size from the table)
    engine_config = llm.fit_engine_config([r for recs in groups.values() for r in recs])

    def run_once(spec: SpecConfig, recs: list) -> tuple[float, dict]:
        # planning is part of the timed run (calibration is cached)
        t0 = time.perf_counter()
        prepared = llm.prepare(recs, spec, engine_config, echo=lambda line: None)
        outs = {rec.index: out for rec, out in prepared.run(opts.run_seed)}
        return time.perf_counter() - t0, outs

    warm = [replace_sampling(next(iter(groups.values()))[0], max_tokens=8)]
    for _, spec in opts.specs:
        run_once(spec, warm)

    labels = [label for label, _ in opts.specs]
    seconds: dict = defaultdict(float)  # (label, cat) -> s
    tokens: dict = defaultdict(int)
    stats: dict = defaultdict(SpecStats)
    outputs: dict = defaultdict(dict)  # label -> index -> output ids
    # (label, round) -> that round's own tokens and seconds, every category
    round_tokens: dict = defaultdict(int)
    round_seconds: dict = defaultdict(float)
    n = len(opts.specs)
    for rnd in range(opts.repeats):
        for gi, (cat, recs) in enumerate(groups.items()):
            for j in run_order(n, gi, rnd):
                label, spec = opts.specs[j]
                dt, outs = run_once(spec, recs)
                seconds[label, cat] += dt
                round_seconds[label, rnd] += dt
                for idx, out in outs.items():
                    tokens[label, cat] += out["usage"]["completion_tokens"]
                    round_tokens[label, rnd] += out["usage"]["completion_tokens"]
                    outputs[label][idx] = out["output_token_ids"]
                    stats[label, cat].merge(SpecStats.from_dict(out["spec"]))
                click.echo(f"  {cat:<14} {label:<22} {tokens[label, cat] / seconds[label, cat]:7.1f}"
                           f" tok/s (round {rnd + 1})", err=True)
        for label in labels:
            click.echo(round_line(label, rnd, round_tokens[label, rnd],
                                  round_seconds[label, rnd]), err=True)
    sizes = {c: len(r) for c, r in groups.items()}
    click.echo(format_table(labels, sizes, seconds, tokens, stats, opts,
                            model=llm.model_id.split("@sha256:")[0],  # the name, not the digest
                            # each category runs on its own: at most its rows (records x n)
                            max_batch_size=min(engine_config.max_batch_size, max(
                                sum(r.sampling.n for r in recs) for recs in groups.values()))))
    for line in spread_lines(labels, opts.repeats, round_tokens, round_seconds):
        click.echo(line)
    base = baseline(labels)
    for label in (lb for lb in labels if lb != base):
        diff = [i for i in outputs[base] if outputs[label].get(i) != outputs[base][i]]
        click.echo(f"outputs {label} vs {base}: {len(outputs[base]) - len(diff)} identical, "
                   f"{len(diff)} differ" + (f" (record indices {diff[:10]})" if diff else ""))
    return 0


def round_line(label: str, rnd: int, tokens: int, seconds: float) -> str:
    """The stderr line after round ``rnd`` (0-based) for one configuration: that round's own
    output tok/s over every category (its tokens / its wall seconds, prefill and planning
    included), not cumulative as the per-category lines above it are."""
    rate = tokens / seconds if seconds else 0.0
    return (f"  {'(all)':<14} {label:<22} {rate:7.1f} tok/s (round {rnd + 1} alone: {tokens} "
            f"tokens in {seconds:.2f} s, all categories)")


def spread(rates: list[float]) -> float | None:
    """(max - min) / mean of ``rates``, as a fraction; None for fewer than 2 rates or a zero
    mean."""
    if len(rates) < 2 or not sum(rates):
        return None
    return (max(rates) - min(rates)) / (sum(rates) / len(rates))


def run_order(n: int, group: int, rnd: int) -> list[int]:
    """The order of ``n`` configurations (indices) in group ``group`` of round ``rnd`` (both
    from 0), a row of a Williams design (E. J. Williams, "Experimental designs balanced for
    the estimation of residual effects of treatments", Aust. J. Sci. Res. A 2, 1949): steps
    0, +1, -1, +2, -2, ... from a first configuration ``(group + rnd) % n``; for odd ``n``,
    odd rounds take a row backwards (still led by ``(group + rnd) % n``). Over ``n`` rounds
    (``2n`` for odd n) every configuration runs in every place equally often and right after
    every other one equally often; in two rounds running, no configuration runs right after
    the same one (n >= 3), and two configurations alternate (A B, B A).
    An earlier order (rotated by ``group + rnd``, backwards in odd rounds) ran two
    configurations A B in every round and let two of four lead in none."""
    lead = (group + rnd) % n
    steps = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]
    if n % 2 and rnd % 2:
        return [(lead - steps[-1] + s) % n for s in reversed(steps)]
    return [(lead + s) % n for s in steps]


def spread_lines(labels, repeats: int, round_tokens, round_seconds) -> list[str]:
    """One line per configuration under the table: its overall output tok/s of each round
    (that round's tokens / seconds, every category) and their spread, (max - min) / mean, in
    %. round_tokens / round_seconds: ``(label, round) -> tokens / s``, rounds 0-based."""
    width = max(len(lb) for lb in labels)
    lines = []
    for lb in labels:
        rates = [round_tokens[lb, r] / round_seconds[lb, r] if round_seconds[lb, r] else 0.0
                 for r in range(repeats)]
        sp = spread(rates)
        lines.append(f"{lb:<{width}} tok/s per round (all categories): "
                     + ", ".join(f"{x:.1f}" for x in rates) + "; spread "
                     + (f"{100 * sp:.1f}% ((max-min)/mean)" if sp is not None else
                        "- (one round)" if repeats < 2 else "-"))
    return lines


def replace_sampling(record, **changes):
    from dataclasses import replace

    return replace(record, sampling=replace(record.sampling, **changes))


def format_table(labels, sizes: dict[str, int], seconds, tokens, stats, opts,
                 model: str | None = None, max_batch_size: int | None = None) -> str:
    """Markdown table: per category, per ``opts.groups`` group and overall, tok/s (the group's
    tokens over its seconds) and ratio to the baseline (``none``, else the first config; see
    ``baseline``), and the mean acceptance length of each drafting config. A group's categories
    absent from the run are left out of it. The line above it names the settings (``prefix
    caching off`` with ``--no-prefix-caching``). model: the model that ran (its registry name
    or path, without the weights' digest); default: ``opts.model``, else the default model.
    max_batch_size: the largest batch that ran (each category runs on its own, so at most the
    largest category's rows, and what fits in memory); default: ``opts.engine.max_batch_size``,
    as asked."""
    if model is None:
        from specbatch.models.registry import DEFAULT_MODEL

        model = opts.model or DEFAULT_MODEL
    cats = list(sizes)
    base = baseline(labels)
    others = [lb for lb in labels if lb != base]
    drafting = [lb for lb in labels if _drafts(lb)]
    head = ["category", "records"] + [f"{lb} tok/s" for lb in labels] + \
        [f"{lb} / {base}" for lb in others] + [f"{lb} acc.len" for lb in drafting]
    rows = []
    members_of = {c: [c] for c in cats}
    for name, group in opts.groups:
        present = [c for c in group if c in sizes]
        if present:
            members_of[f"({name})"] = present
    if len(cats) > 1:
        members_of["(all)"] = cats
    for cat, members in members_of.items():
        tps, accs = {}, {}
        for lb in labels:
            t = sum(tokens[lb, c] for c in members)
            s = sum(seconds[lb, c] for c in members)
            tps[lb] = t / s if s else 0.0
            st = SpecStats()
            for c in members:
                st.merge(stats[lb, c])
            accs[lb] = st.mean_acceptance_length
        row = [cat, str(sum(sizes[c] for c in members))] + [f"{tps[lb]:.1f}" for lb in labels] + \
            [f"{tps[lb] / tps[base]:.2f}x" if tps[base] else "-" for lb in others] + \
            [f"{accs[lb]:.2f}" if accs[lb] else "-" for lb in drafting]
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    asked = opts.engine.max_batch_size
    ran = asked if max_batch_size is None else max_batch_size
    cfg = (f"model {model}, dtype {opts.engine.dtype_text}, max_batch_size {ran}"
           + ("" if ran == asked else f" (--max-batch-size {asked}; each category runs on its "
              "own, at most its records and what fits in memory)")
           + ("" if opts.engine.prefix_caching else ", prefix caching off")
           + f", max_tokens {opts.sampling.max_tokens}, T "
           f"{opts.sampling.temperature}, rounds {opts.repeats}; ratios to {base}"
           + ("" if not _drafts(base) else " (no none configuration: add none to the "
              "--configs for speedups over plain decoding)"))
    return cfg + "\n" + "\n".join(lines)


def command(input_path, configs, draft_model, model, dtype, device, max_batch_size,
            max_model_len, no_prefix_caching, threads, cache_dir, max_tokens, min_tokens,
            temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, logprobs,
            prompt_field, id_field, split, limit, per_category, categories, repeats, groups,
            template, calibration, **more_sampling) -> int:
    """``specbatch bench`` from its parsed flags (``cli.bench``): check them and the model
    names before anything loads, then ``run_bench``. Returns the exit status. Raises
    ``click.UsageError`` (a bad flag value) and ``common.StopError`` (an unknown model)."""
    from specbatch.commands.common import as_flags, check_model, choose_threads, stop_strings
    from specbatch.commands.common import more_sampling as sampling_fields

    cpu = choose_threads(threads)  # first: before anything imports torch
    check_model(model)
    try:
        sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                  max_tokens=max_tokens, min_tokens=min_tokens,
                                  stop=stop_strings(stop),
                                  stop_token_ids=tuple(stop_token_ids), ignore_eos=ignore_eos,
                                  logprobs=logprobs, **sampling_fields(more_sampling))
        engine = EngineConfig(max_batch_size=max_batch_size, max_model_len=max_model_len,
                              dtype=dtype, device=device,
                              prefix_caching=not no_prefix_caching)
        specs = parse_configs(configs, draft_model)
        named_groups = parse_groups(groups)
    except ValueError as e:
        raise click.UsageError(as_flags(str(e))) from None
    if draft_model is not None:  # used by a configuration (parse_configs checked)
        check_model(draft_model, draft=True)
    return run_bench(BenchOptions(
        input_path=input_path, model=model, draft_model=draft_model, cache_dir=cache_dir,
        sampling=sampling, specs=specs, engine=engine, run_seed=seed, prompt_field=prompt_field,
        id_field=id_field, split=split, limit=limit, per_category=per_category,
        categories=tuple(categories.split(",")) if categories else None, repeats=repeats,
        groups=named_groups, template=template, cpu=cpu, calibration=calibration))
