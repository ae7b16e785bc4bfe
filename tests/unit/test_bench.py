"""``specbatch bench``: configuration and group parsing, and the table's arithmetic."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest

from specbatch import config
from specbatch.commands.bench import format_table, parse_configs, parse_groups
from specbatch.config import EngineConfig
from specbatch.spec_decode.stats import SpecStats


def test_parse_configs():
    specs = dict(parse_configs("none, ngram:k=3, ngram:k=5:min=1:max=3, auto:k=8"))
    assert specs["none"].method == "none"
    assert specs["ngram:k=3"].num_speculative_tokens == 3
    s = specs["ngram:k=5:min=1:max=3"]
    assert (s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == (5, 1, 3)
    assert specs["auto:k=8"].method == "auto" and specs["auto:k=8"].num_speculative_tokens == 8
    assert specs["auto:k=8"].draft_model is None
    for bad in ("ngram:q=3", "ngram:k=x", "", "auto:draft", "ngram:draft"):
        with pytest.raises(ValueError):
            parse_configs(bad)
    # auto:draft may draft with the draft model; plain auto and ngram never get it
    specs = dict(parse_configs("auto,auto:draft,auto:k=3:draft,ngram:k=5", draft_model="d"))
    assert specs["auto"].draft_model is None and specs["ngram:k=5"].draft_model is None
    assert specs["auto:draft"].draft_model == "d" and specs["auto:draft"].method == "auto"
    assert specs["auto:k=3:draft"].num_speculative_tokens == 3


def test_parse_groups():
    assert parse_groups(["copy-heavy=summarization, rag", "n=qa"]) == (
        ("copy-heavy", ("summarization", "rag")), ("n", ("qa",)))
    for bad in ("summarization,rag", "x=", "=qa"):
        with pytest.raises(ValueError, match="--group"):
            parse_groups([bad])


def _row(table: str, name: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in\n{table}")


def test_table_groups_add_tokens_and_seconds():
    """A group's tok/s is its tokens over its seconds (not a mean of the categories' tok/s)."""
    labels = ["none", "ngram:k=5"]
    seconds = {("none", "a"): 10.0, ("none", "b"): 1.0, ("none", "c"): 5.0,
               ("ngram:k=5", "a"): 5.0, ("ngram:k=5", "b"): 2.0, ("ngram:k=5", "c"): 5.0}
    tokens = {(lb, c): n for lb in labels for c, n in (("a", 100), ("b", 100), ("c", 50))}
    stats = defaultdict(SpecStats)
    stats["ngram:k=5", "a"] = SpecStats(num_drafts=10, num_accepted_tokens=20)
    stats["ngram:k=5", "b"] = SpecStats(num_drafts=10, num_accepted_tokens=0)
    opts = SimpleNamespace(groups=(("ab", ("a", "b", "missing")),), model=None,
                           engine=SimpleNamespace(dtype_text="bfloat16", max_batch_size=16,
                                                  prefix_caching=True),
                           sampling=SimpleNamespace(max_tokens=128, temperature=0.0), repeats=1)
    table = format_table(labels, {"a": 2, "b": 3, "c": 1}, seconds, tokens, stats, opts)
    ab = _row(table, "(ab)")
    assert ab[1] == "5"  # records of a and b
    assert ab[2] == f"{200 / 11:.1f}" and ab[3] == f"{200 / 7:.1f}"
    assert ab[4] == f"{(200 / 7) / (200 / 11):.2f}x"
    assert ab[5] == "2.00"  # (20 accepted over 20 drafts) + 1
    assert _row(table, "(all)")[2] == f"{250 / 16:.1f}"
    assert _row(table, "a")[4] == "2.00x"


def test_bad_records_stop_bench_without_suggesting_run_flags(tmp_path):
    """bench has no --on-error: its bad-record footer must not suggest it."""
    from click.testing import CliRunner

    from specbatch.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "prompt": "ok"}\n{"id": 2}\n')
    result = CliRunner().invoke(main, ["bench", str(bad), "--configs", "none"])
    assert result.exit_code == 2, result.output
    assert "1 bad record(s); nothing was generated. Fix them." in result.output
    assert "--on-error" not in result.output


def test_header_names_the_model_that_ran_when_model_is_not_given(tmp_path, monkeypatch, tiny_gguf):
    """Without --model the settings line said ``model default``: it names the model loaded."""
    from click.testing import CliRunner

    from specbatch.cli import main
    from specbatch.models import registry
    model = tiny_gguf
    monkeypatch.setattr(registry, "DEFAULT_MODEL", str(model))  # what LLM loads without --model
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hello hello hello"}\n')
    result = CliRunner().invoke(main, ["bench", str(src), "--configs", "none,ngram:k=3",
                                       "--max-tokens", "4", "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    settings = next(line for line in result.stdout.splitlines() if line.startswith("model "))
    # --dtype auto: the tiny model's layers are Q8_0 (int8 where the C kernels run)
    assert settings.startswith(f"model {model}, dtype "
                               f"{EngineConfig().for_model(str(model)).dtype_text}, "), settings
    assert not config._cpu_kernels() or settings.startswith(
        f"model {model}, dtype int8 (auto: GGUF Q8_0 codes on the int8 kernels), "), settings
    # one record ran one row: the header says the batch size that ran, and what was asked
    assert ", max_batch_size 1 (--max-batch-size 16; each category runs on its own, at most " \
        "its records and what fits in memory), " in settings, settings


def _table(labels, tps, prefix_caching=True):
    """A one-category table where config ``lb`` ran 100 tokens at ``tps[lb]`` tok/s."""
    seconds = {(lb, "a"): 100 / tps[lb] for lb in labels}
    tokens = {(lb, "a"): 100 for lb in labels}
    stats = defaultdict(SpecStats)
    opts = SimpleNamespace(groups=(), model=None, repeats=1,
                           engine=SimpleNamespace(dtype_text="bfloat16", max_batch_size=16,
                                                  prefix_caching=prefix_caching),
                           sampling=SimpleNamespace(max_tokens=128, temperature=0.0))
    return format_table(labels, {"a": 1}, seconds, tokens, stats, opts)


def test_ratios_are_to_none_wherever_it_is():
    tps = {"ngram:k=5": 30.0, "none": 10.0, "auto": 20.0}
    table = _table(["ngram:k=5", "none", "auto"], tps)
    head = [c.strip() for c in table.splitlines()[1].strip("|").split("|")]
    assert head[5:7] == ["ngram:k=5 / none", "auto / none"], head
    assert _row(table, "a")[5:7] == ["3.00x", "2.00x"]
    assert head[7:] == ["ngram:k=5 acc.len", "auto acc.len"]  # none drafts nothing
    assert table.splitlines()[0].endswith("; ratios to none")


def test_without_none_the_table_says_what_ratios_are_to():
    table = _table(["ngram:k=3", "ngram:k=5"], {"ngram:k=3": 10.0, "ngram:k=5": 15.0})
    assert "ratios to ngram:k=3 (no none configuration" in table.splitlines()[0]
    assert _row(table, "a")[4] == "1.50x"


def test_header_says_when_prefix_caching_is_off():
    """--no-prefix-caching changes the timings (every prompt prefilled whole): the header names
    it; on, the default, it says nothing."""
    tps = {"none": 10.0, "ngram:k=5": 20.0}
    on = _table(["none", "ngram:k=5"], tps).splitlines()[0]
    off = _table(["none", "ngram:k=5"], tps, prefix_caching=False).splitlines()[0]
    assert "prefix caching" not in on, on
    assert off.startswith("model smollm2-135m, dtype bfloat16, max_batch_size 16, prefix "
                          "caching off, max_tokens 128,"), off


def test_configs_given_twice_are_refused():
    for bad, message in [("auto:k=3:k=4", "'auto:k=3:k=4': k given twice"),
                         ("ngram:k=5:min=1:min=2", "min given twice"),
                         ("none,ngram:k=5,none", "config 'none' given twice"),
                         ("auto:draft:draft", "draft given twice")]:
        with pytest.raises(ValueError, match=message):
            parse_configs(bad, draft_model="d")
    with pytest.raises(ValueError, match="--draft-model is used by no configuration"):
        parse_configs("none,ngram:k=5", draft_model="d")


def test_round_line_is_that_round_alone_over_every_category():
    from specbatch.commands.bench import round_line

    assert round_line("ngram:k=5", 1, 1200, 8.0) == (
        "  (all)          ngram:k=5                150.0 tok/s (round 2 alone: 1200 tokens in "
        "8.00 s, all categories)")
    assert "    0.0 tok/s (round 1 alone: 0 tokens in 0.00 s" in round_line("none", 0, 0, 0.0)


def test_spread_lines_give_each_rounds_rate_and_max_minus_min_over_mean():
    """Per configuration: each round's overall tok/s (tokens / seconds of that round, all
    categories) and (max - min) / mean in %; one round has no spread."""
    from specbatch.commands.bench import spread, spread_lines

    round_tokens = {("none", 0): 1000, ("none", 1): 1000, ("none", 2): 1000,
                    ("suffix", 0): 3000, ("suffix", 1): 3000, ("suffix", 2): 3000}
    round_seconds = {("none", 0): 10.0, ("none", 1): 8.0, ("none", 2): 12.5,
                     ("suffix", 0): 10.0, ("suffix", 1): 10.0, ("suffix", 2): 10.0}
    rates = [100.0, 125.0, 80.0]
    assert spread(rates) == pytest.approx(45.0 / (305.0 / 3))  # 44.26%
    assert spread([5.0]) is None and spread([0.0, 0.0]) is None
    assert spread_lines(["none", "suffix"], 3, round_tokens, round_seconds) == [
        "none   tok/s per round (all categories): 100.0, 125.0, 80.0; spread 44.3% "
        "((max-min)/mean)",
        "suffix tok/s per round (all categories): 300.0, 300.0, 300.0; spread 0.0% "
        "((max-min)/mean)"]
    assert spread_lines(["none"], 1, round_tokens, round_seconds) == [
        "none tok/s per round (all categories): 100.0; spread - (one round)"]


def test_bench_prints_each_rounds_overall_rate_and_their_spread(tmp_path, tiny_gguf):
    """Two categories, two rounds: after each round one ``(all)`` line per configuration with
    that round's own tokens and seconds, and under the table per configuration the same
    rounds' rates and their spread; the round tokens add up to every record's output tokens."""
    import re

    from click.testing import CliRunner

    from specbatch.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "abc abc abc", "category": "a"}\n'
                   '{"id": 2, "prompt": "xyz xyz", "category": "b"}\n')
    result = CliRunner().invoke(main, ["bench", str(src), "--configs", "none,ngram:k=3",
                                       "--max-tokens", "4", "--repeats", "2", "--model",
                                       str(tiny_gguf), "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    alone = re.findall(r"\(all\) +(\S+) +([\d.]+) tok/s \(round (\d) alone: (\d+) tokens in "
                       r"([\d.]+) s, all categories\)", result.stderr)
    assert [(lb, rnd) for lb, _, rnd, _, _ in alone] == [
        ("none", "1"), ("ngram:k=3", "1"), ("none", "2"), ("ngram:k=3", "2")], result.stderr
    assert all(int(t) == 8 for *_, t, _ in alone)  # 2 records x 4 tokens, each round
    for lb in ("none", "ngram:k=3"):
        line = next(x for x in result.stdout.splitlines()
                    if x.startswith(f"{lb} ") and "per round" in x)
        rates = [float(r) for label, r, *_ in alone if label == lb]
        assert line.startswith(f"{lb:<9} tok/s per round (all categories): "
                               f"{rates[0]:.1f}, {rates[1]:.1f}; spread "), line
        assert line.endswith("% ((max-min)/mean)"), line


def test_run_order_is_a_williams_design():
    """Rotation alone kept neighbours: with one group, each configuration ran right after the
    same one in every round (auto after suffix on the extraction recipe), so whatever the
    previous run leaves behind (a slower machine, a warm cache) fell on the same arm; rotation
    and running backwards every other round ran two configurations A B in every round."""
    from collections import Counter

    from specbatch.commands.bench import run_order

    assert [run_order(2, 0, r) for r in range(3)] == [[0, 1], [1, 0], [0, 1]]
    assert [run_order(4, 0, r) for r in range(2)] == [[0, 1, 3, 2], [1, 2, 0, 3]]
    for n in range(1, 8):
        cycle = 2 * n if n % 2 else n
        for group in range(3):
            rounds = [run_order(n, group, r) for r in range(2 * cycle)]
            for r, (order, after) in enumerate(zip(rounds, rounds[1:])):
                assert sorted(order) == list(range(n))
                assert order[0] == (group + r) % n  # the first rotates
                if n >= 3:
                    assert not set(zip(order, order[1:])) & set(zip(after, after[1:])), (n, r)
            # over a cycle: every place and every neighbour equally often
            places = Counter((i, c) for order in rounds[:cycle] for i, c in enumerate(order))
            assert set(places.values()) == {cycle // n} and len(places) == n * n
            pairs = Counter(p for order in rounds[:cycle] for p in zip(order, order[1:]))
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) <= 1, (n, pairs)
