"""``specbatch analyze`` on mini runs: tiny float64 models through the real pipeline
(``generate_records``) with a character tokenizer, written as ``specbatch run`` writes them.

Checked: the tables reconcile exactly with the per-record counters; the what-if replay of the
run's own setting equals every recorded ``spec`` (prompt, chat and turns records, EOS,
max_tokens and context endings) and T > 0 / error records are skipped with a reason; the
speedup math against a stand-in cost model; compare finds an altered output at the right
position; ``--plot`` writes readable PNGs; the CLI's usage errors.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from types import SimpleNamespace

import orjson
import pytest
from click.testing import CliRunner

from specbatch.analyze import whatif
from specbatch.commands.common import file_age
from specbatch.analyze.load import config_path, load_run, spec_stats
from specbatch.commands.analyze import AnalyzeOptions, build_document, format_text
from specbatch.cli import main
from specbatch.config import SamplingParams
from specbatch.io.records import read_records
from specbatch.pipeline import PromptRenderer, generate_records
from specbatch.spec_decode.stats import SpecStats
from tests.helpers import make_engine, repeating_prompts, tiny_llama

VOCAB = 48
OFFSET = 48  # token i <-> chr(48 + i): "0".."_"
COUNTERS = ("num_steps", "num_drafts", "num_draft_tokens", "num_accepted_tokens")


class CharTokenizer:
    """A transformers-like tokenizer over ``VOCAB`` ids, one character per token."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [(ord(c) - OFFSET) % VOCAB for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(OFFSET + i) for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


TOK = CharTokenizer()


def _rows(num: int, seed: int) -> list[dict]:
    """Input records: plain prompts, chats and two-turn records of repeating phrases, with
    varied max_tokens, a few at T > 0, a category and (for some) nothing else."""
    phrases = [TOK.decode(p) for p in repeating_prompts(VOCAB, num * 2, seed=seed, max_len=36)]
    rows = []
    for i in range(num):
        row: dict = {"id": f"r{i}", "category": ["alpha", "beta", "gamma"][i % 3]}
        kind = i % 4
        if kind == 0:
            row["turns"] = [phrases[2 * i], phrases[2 * i + 1]]
        elif kind == 1:
            row["messages"] = [{"role": "system", "content": phrases[2 * i + 1][:5]},
                               {"role": "user", "content": phrases[2 * i]}]
        else:
            row["prompt"] = phrases[2 * i]
        row["max_tokens"] = [3, 24, 40, 1, 31][i % 5]
        if i % 11 == 5:
            row["temperature"] = 0.8
        rows.append(row)
    return rows


def mini_run(tmp_path, name: str, rows: list[dict], k: int, lookup: tuple[int, int],
             eos_id: int, max_model_len: int = 256, model_seed: int = 11,
             batch_size: int = 8, steps: list | None = None):
    """Generate ``rows`` like ``specbatch run`` (method ngram when k > 0) and write
    ``<name>.jsonl`` with its ``.config.json``; returns the output path. steps: given, gets
    every verify step's (rows, padded queries per row, real tokens, mean context) appended."""
    inp = tmp_path / f"{name}.in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, errors = read_records(inp, defaults=SamplingParams(max_tokens=24))
    assert not errors
    model = tiny_llama(VOCAB, seed=model_seed)
    engine = make_engine(model, k, batch_size, eos_ids=(eos_id,), max_model_len=max_model_len,
                         detokenize=TOK.decode, prompt_lookup=lookup)
    if steps is not None:
        verify = engine.runner.verify

        def spy(seqs, drafts, meta=None):
            steps.append((len(seqs), engine.runner.query_len(drafts),
                          sum(1 + len(d) for d in drafts),
                          sum(len(s.token_ids) for s in seqs) / len(seqs)))
            return verify(seqs, drafts, meta)

        engine.runner.verify = spy
    outs = {rec.index: {**rec.fields, **out}
            for rec, out in generate_records(engine, PromptRenderer(TOK), records)}
    out = tmp_path / f"{name}.jsonl"
    out.write_bytes(b"".join(orjson.dumps(outs[i]) + b"\n" for i in sorted(outs)))
    config = {"model": "chars", "method": "ngram" if k else "none", "k": k,
              "prompt_lookup_min": lookup[0], "prompt_lookup_max": lookup[1],
              "sampling": SamplingParams(max_tokens=24).to_dict(), "prompt_field": None,
              "id_field": None, "max_model_len": max_model_len}
    config_path(out).write_text(json.dumps(config))
    return out


EOS = 7


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of the same 36 records (ngram k4 n-gram 1-3, and plain decoding), and one with
    a small context cap (k3, n-gram 2-4)."""
    tmp = tmp_path_factory.mktemp("runs")
    rows = _rows(36, seed=2)
    return {"ngram": mini_run(tmp, "ngram", rows, 4, (1, 3), EOS),
            "none": mini_run(tmp, "none", rows, 0, (1, 3), EOS),
            "ctx": mini_run(tmp, "ctx", rows, 3, (2, 4), EOS, max_model_len=52)}


def _doc(paths, cost=None, **kw):
    opts = AnalyzeOptions(paths=tuple(str(p) for p in paths), **kw)
    files = [load_run(p) for p in opts.paths]
    return files, build_document(files, opts, cost, tokenizer_for=lambda model_id: TOK)


def test_mini_runs_cover_the_cases(runs):
    recs = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    reasons = {r for rec in recs for r in (rec["finish_reason"] if isinstance(
        rec["finish_reason"], list) else [rec["finish_reason"]])}
    assert reasons == {"stop", "length"}
    assert sum(r["spec"]["num_accepted_tokens"] for r in recs) > 20
    ctx = [json.loads(line) for line in runs["ctx"].read_text().splitlines()]
    assert any(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] == 52 for r in ctx
               if "prompt" in r)  # some rows stopped at the context cap


@pytest.mark.parametrize("run", ["ngram", "none"])
def test_tables_reconcile_with_records(runs, run, tmp_path):
    # give some records a planner bucket, so that grouping has several groups
    src = [json.loads(line) for line in runs[run].read_text().splitlines()]
    for i, rec in enumerate(src):
        if i % 3:
            rec["spec"]["bucket"] = f"b{i % 2}"
    path = tmp_path / "bucketed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    config_path(path).write_text(config_path(runs[run]).read_text())
    _, doc = _doc([path], by="category")
    assert list(doc["tables"]) == ["category", "proposer"]  # --by replaces the bucket grouping
    want = {c: sum(r["spec"][c] for r in src) for c in COUNTERS}
    want["num_output_tokens"] = sum(r["usage"]["completion_tokens"] for r in src)
    want["num_records"] = len(src)
    pos = SpecStats()
    for r in src:
        pos.merge(spec_stats(r))
    for grouping, rows in doc["tables"].items():
        *groups, total = rows
        assert total["group"] == "(all)"
        assert len(groups) == {"bucket": 3, "proposer": 1, "category": 3}[grouping]
        for key, value in want.items():
            assert total[key] == value, (grouping, key)
            assert sum(g[key] for g in groups) == value, (grouping, key)
        for row in rows:
            _check_row(row)
        assert total["num_accepted_tokens_per_pos"] == pos.num_accepted_tokens_per_pos
        assert total["k_histogram"] == {str(k): n for k, n in sorted(pos.k_histogram.items())}
    text = format_text(doc)
    assert "== by category ==" in text and "(all)" in text and "== by bucket ==" not in text
    _, doc = _doc([path])  # an auto run (records with a bucket): by bucket
    assert doc["primary_grouping"] == "bucket" and list(doc["tables"]) == ["bucket", "proposer"]
    # the records without a planner bucket (a static method's) are named for what they ran,
    # not a bucket "-" that reads as a missing value
    static = "ngram:k=4" if run == "ngram" else "none"
    assert [r["group"] for r in doc["tables"]["bucket"]] == ["b0", "b1", static, "(all)"]


def test_files_of_different_settings_are_not_pooled(runs, tmp_path):
    """An ngram k=4 run beside a plain one: no ``(all)`` row over both (it measures neither
    method); each file has its own rows and total, equal to that file analysed alone, and the
    text says why. Two files of the same setting (a job's shards) are still pooled."""
    _, doc = _doc([runs["ngram"], runs["none"]], by="category")
    assert not doc["pooled"] and doc["differing_settings"] == ["method", "k"]
    for grouping, rows in doc["tables"].items():
        assert all(r["group"] != "(all)" for r in rows)
        for name in ("ngram", "none"):
            alone = _doc([runs[name]], by="category")[1]["tables"][grouping]
            mine = [r for r in rows if r["file"] == f"{name}.jsonl"]
            assert [r["group"] for r in mine] == [f"{name}.jsonl: {r['group']}" for r in alone]
            assert [{**r, "group": None, "file": None} for r in mine] == [
                {**r, "group": None, "file": None} for r in alone]
    text = format_text(doc)
    assert "note: the files differ in method, k: each file has its own rows" in text
    assert "ngram.jsonl: (all)" in text and "none.jsonl: (all)" in text
    assert "\n(all) " not in text
    # two files of one name: named by their paths; the plots take the same names
    other = tmp_path / "copy" / "ngram.jsonl"
    other.parent.mkdir()
    other.write_text(runs["none"].read_text())
    config_path(other).write_text(config_path(runs["none"]).read_text())
    _, doc = _doc([runs["ngram"], other])
    assert {r["file"] for r in doc["tables"]["proposer"]} == {str(runs["ngram"]), str(other)}
    if importlib.util.find_spec("matplotlib") is not None:
        r = CliRunner().invoke(main, ["analyze", str(runs["ngram"]), str(other), "--plot",
                                      str(tmp_path / "plots")])
        assert r.exit_code == 0 and "wrote " in r.output, r.output
    # shards of one job (same config): one set of rows, one (all) over both
    src = runs["ngram"].read_text().splitlines()
    halves = []
    for i, lines in enumerate((src[:18], src[18:])):
        half = tmp_path / f"half{i}.jsonl"
        half.write_text("\n".join(lines) + "\n")
        config_path(half).write_text(config_path(runs["ngram"]).read_text())
        halves.append(half)
    _, doc = _doc(halves, by="category")
    assert doc["pooled"] and doc["differing_settings"] == []
    whole = _doc([runs["ngram"]], by="category")[1]
    assert doc["tables"] == whole["tables"]


def test_what_if_of_files_of_different_settings_is_per_file(runs):
    """``--what-if`` over an ngram run and a plain run of the same records: each file's groups
    and total (``FILE: group``, ``FILE: (all)``) equal that file's what-if alone, and no
    ``(all)`` row counts the records twice (it did: one total over both files)."""
    _, doc = _doc([runs["ngram"], runs["none"]], by="category", what_if=True)
    groups = doc["what_if"]["groups"]
    assert all(g["group"] != "(all)" for g in groups)
    replayed = 0
    for name in ("ngram", "none"):
        alone = _doc([runs[name]], by="category", what_if=True)[1]["what_if"]
        replayed += alone["num_replayed"]
        mine = [g for g in groups if g["group"].startswith(f"{name}.jsonl: ")]
        assert [g["group"] for g in mine] == [f"{name}.jsonl: {g['group']}"
                                               for g in alone["groups"]]
        assert [{**g, "group": None} for g in mine] == [{**g, "group": None}
                                                         for g in alone["groups"]]
    both = [g for g in groups if g["group"].endswith(": (all)")]
    assert doc["what_if"]["num_replayed"] == sum(g["num_records"] for g in both) == replayed
    assert replayed > 36  # both files replayed records (33 each: 3 are sampled, T 0.8)


def test_what_if_predicts_at_the_runs_batch_size(runs, tmp_path):
    """Without ``--batch-size`` the what-if predicts at the run's ``--max-batch-size`` (its
    OUT.config.json), 16 for a file written before it was recorded; ``--batch-size`` wins. The
    verdict can turn on it (a fresh user's batch-4 ngram run read "best: none" at 16)."""
    config = json.loads(config_path(runs["ngram"]).read_text())
    assert "max_batch_size" not in config
    assert _doc([runs["ngram"]], what_if=True)[1]["what_if"]["batch_size"] == 16
    path = tmp_path / "b4.jsonl"
    path.write_text(runs["ngram"].read_text())
    config_path(path).write_text(json.dumps({**config, "max_batch_size": 4}))
    assert _doc([path], what_if=True)[1]["what_if"]["batch_size"] == 4
    assert _doc([path], what_if=True, batch_size=16)[1]["what_if"]["batch_size"] == 16


def test_a_run_without_buckets_groups_by_category(runs):
    """A run without buckets (ngram) whose records have a ``category``: the primary grouping is
    the category (not one bucket named for its proposer), the what-if too; ``--by bucket``
    still works, its records under their proposer label."""
    _, doc = _doc([runs["ngram"]], what_if=True)
    assert doc["primary_grouping"] == "category"
    assert list(doc["tables"]) == ["category", "proposer"]
    cats = sorted({json.loads(line)["category"]
                   for line in runs["ngram"].read_text().splitlines()})
    assert [r["group"] for r in doc["tables"]["category"]] == cats + ["(all)"]
    assert [g["group"] for g in doc["what_if"]["groups"]] == cats + ["(all)"]
    lines = format_text(doc).splitlines()
    assert "== by category ==" in lines and "== by bucket ==" not in lines
    _, doc = _doc([runs["ngram"]], by="bucket")
    assert [r["group"] for r in doc["tables"]["bucket"]] == ["ngram:k=4", "(all)"]


def test_the_text_says_what_its_columns_are_once(runs):
    """A fresh user read ``no-draft``, ``prefill`` and ``answers`` without a key: the text
    output ends its tables with one legend of the columns, however many tables it has."""
    from specbatch.commands.analyze import COLUMNS

    _, doc = _doc([runs["ngram"]], by="category")  # and by proposer
    lines = format_text(doc).splitlines()
    assert len(doc["tables"]) == 2 and lines.count(COLUMNS[0]) == 1
    at = lines.index(COLUMNS[0])
    assert lines[at:at + 3] == list(COLUMNS) and lines[at - 1] == ""
    for column in ("answers", "prefill", "tok/step", "acc len", "acc rate", "no-draft"):
        assert f"{column}: " in " ".join(COLUMNS), column


def test_one_group_run_shows_one_row_and_one_panel(runs, tmp_path):
    """Records with neither a bucket nor a category: one group, every record; its table is the
    ``(all)`` row alone (the text says "all records"), the what-if has one group, and the
    acceptance-length plot draws one panel, not equal ``-`` and ``(all)`` panels."""
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    for rec in src:
        del rec["category"]
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    config_path(path).write_text(config_path(runs["ngram"]).read_text())
    files, doc = _doc([path], what_if=True)
    assert doc["primary_grouping"] == "all"
    assert [r["group"] for r in doc["tables"]["all"]] == ["(all)"]
    assert doc["tables"]["all"][0]["num_records"] == len(src)
    assert [g["group"] for g in doc["what_if"]["groups"]] == ["(all)"]
    lines = format_text(doc).splitlines()
    at = lines.index("== all records ==")
    assert lines[at + 2].split()[0] == "(all)" and lines[at + 3].startswith("per-position")
    assert not any(line.split()[:1] in (["-"], ["-:"]) for line in lines)
    pytest.importorskip("matplotlib")
    from specbatch.analyze import plots

    panels = []
    real = plots._panels
    plots._panels = lambda n, *a, **k: (panels.append(n), real(n, *a, **k))[1]
    try:
        plots.write_plots(doc, [("(all)", r) for r in files[0].records], tmp_path / "plots")
    finally:
        plots._panels = real
    assert panels[0] == 1  # acceptance_length.png: one panel
    assert panels[-1] == 1  # what_if.png too

def _check_row(r: dict) -> None:
    """Identities every row must satisfy, whatever the records."""
    assert r["num_prefill_steps"] == r["num_answers"]  # one prefill per answer, none failed
    assert r["num_prefill_steps"] + r["num_decode_steps"] == r["num_steps"]
    assert sum(r["finish_reasons"].values()) == r["num_answers"]
    assert r["tokens_per_step"] == pytest.approx(r["num_output_tokens"] / r["num_steps"])
    hist = {int(k): v for k, v in r["acceptance_length_histogram"].items()}
    assert sum(hist.values()) == r["num_drafts"]
    # each drafting step emits its acceptance length; the other steps one token each
    assert sum(n * c for n, c in hist.items()) == r["num_drafts"] + r["num_accepted_tokens"]
    assert r["num_drafts"] + r["num_no_draft_steps"] == r["num_decode_steps"]
    if r["num_drafts"]:
        assert r["mean_acceptance_length"] == pytest.approx(
            1 + r["num_accepted_tokens"] / r["num_drafts"], abs=1e-6)
        per_pos = r["num_accepted_tokens_per_pos"]
        assert sum(per_pos) == r["num_accepted_tokens"]
        assert r["acceptance_per_pos"][0] == r["conditional_acceptance_per_pos"][0]
        for i in range(1, len(per_pos)):
            if per_pos[i - 1]:
                assert r["conditional_acceptance_per_pos"][i] == pytest.approx(
                    per_pos[i] / per_pos[i - 1], abs=1e-6)
    else:
        assert r["num_accepted_tokens"] == 0 and r["mean_acceptance_length"] is None


@pytest.mark.parametrize("run", ["ngram", "ctx"])
def test_what_if_replays_own_setting_exactly(runs, run):
    _, doc = _doc([runs[run]], by="category", what_if=True)
    wi = doc["what_if"]
    src = {r["id"]: r for r in map(json.loads, runs[run].read_text().splitlines())}
    hot = {i for i, r in src.items() if r.get("temperature")}
    failed = {i for i, r in src.items() if "error" in str(r["finish_reason"])} - hot
    assert hot and (run == "ctx") == bool(failed)  # the small context fails long prompts
    want_skipped = {i: "temperature 0.8 > 0" for i in hot} | {i: "finish_reason error"
                                                               for i in failed}
    assert {s["id"]: s["reason"] for s in wi["skipped"]} == want_skipped
    checks = wi["self_check"]["records"]
    assert len(checks) == len(src) - len(want_skipped) == wi["num_replayed"]
    for c in checks:
        want = spec_stats(src[c["id"]]).to_dict()
        assert c["replayed"] == want, c["id"]
        assert c["equal"]
    assert wi["self_check"]["num_equal"] == len(checks)
    # the grid holds k 1..8 for the run's own n-gram sizes, and its (all) row at the run's own
    # setting sums the replayed records
    cfg = json.loads(config_path(runs[run]).read_text())
    own = f"ngram:k={cfg['k']}:min={cfg['prompt_lookup_min']}:max={cfg['prompt_lookup_max']}"
    total = next(g for g in wi["groups"] if g["group"] == "(all)")
    row = next(c for c in total["configs"] if c["name"] == own)
    replayed = [src[c["id"]]["spec"] for c in checks]
    acc = sum(s["num_accepted_tokens"] for s in replayed)
    drafts = sum(s["num_drafts"] for s in replayed)
    assert row["mean_acceptance_length"] == pytest.approx(1 + acc / drafts, abs=1e-6)
    assert total["best"]["criterion"] == "tokens_per_decode_step"
    assert "best:" in format_text(doc)


def test_self_check_reports_a_record_that_does_not_replay(runs, tmp_path):
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    victim = next(r for r in src if r["spec"]["num_drafts"] > 2 and not r.get("temperature"))
    victim["spec"]["k_histogram"]["0"] = victim["spec"]["k_histogram"].get("0", 0) + 1
    path = tmp_path / "tampered.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    config_path(path).write_text(config_path(runs["ngram"]).read_text())
    _, doc = _doc([path], what_if=True)
    sc = doc["what_if"]["self_check"]
    assert [c["id"] for c in sc["records"] if not c["equal"]] == [victim["id"]]
    assert sc["num_equal"] == sc["num_checked"] - 1
    assert f"differs: tampered.jsonl id='{victim['id']}'" in format_text(doc)


def test_what_if_says_suffix_runs_are_not_replayed_exactly(runs, tmp_path):
    """A suffix run's drafts depend on job order: what-if says so, self-checks none of it."""
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    for r in src:
        r["spec"]["proposer"] = "suffix"
    path = tmp_path / "suffix.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    config = json.loads(config_path(runs["ngram"]).read_text())
    config_path(path).write_text(json.dumps({**config, "method": "suffix"}))
    _, doc = _doc([path], what_if=True)
    assert doc["what_if"]["self_check"]["num_checked"] == 0
    assert doc["what_if"]["num_replayed"] > 0  # n-gram settings still replay its outputs
    text = format_text(doc)
    assert "note: suffix.jsonl: method suffix: suffix drafts depend on the records" in text
    assert "self-check:" not in text  # no claim that its own stats replay
    _, plain = _doc([runs["ngram"]], what_if=True)
    assert plain["what_if"]["notes"] == []


def test_what_if_from_plain_run_predicts_the_ngram_run(runs):
    """Replaying the plain-decoding run for ngram k4 1-3 gives what the ngram run measured
    (same outputs at T = 0), per group."""
    _, plain = _doc([runs["none"]], by="category", what_if=True)
    _, spec = _doc([runs["ngram"]], by="category")
    measured = {r["group"]: r for r in spec["tables"]["category"]}
    hot = {json.loads(line)["category"] for line in runs["ngram"].read_text().splitlines()
           if json.loads(line).get("temperature")}
    for g in plain["what_if"]["groups"]:
        if g["group"] in hot or g["group"] == "(all)":
            continue  # T > 0 records are measured but not replayed
        row = next(c for c in g["configs"] if c["name"] == "ngram:k=4:min=1:max=3")
        assert row["mean_acceptance_length"] == measured[g["group"]]["mean_acceptance_length"]


class LinearCost:
    """Stand-in for ``auto.costmodel``: a fixed cost plus one per query token per row."""

    def __init__(self, base: float, per_token: float) -> None:
        self.base, self.per_token = base, per_token

    def step_time(self, num_rows: int, query_len: int, context_len: int,
                  num_tokens: float | None = None) -> float:
        return self.base + self.per_token * (num_rows * query_len if num_tokens is None
                                             else num_tokens)


class SpyCost:
    """A cost model that prices every step at 1 s and keeps its shape:
    (rows, padded queries per row, real tokens, mean context)."""

    def __init__(self, min_query_len: int) -> None:
        self.min_query_len = min_query_len
        self.calls: list[tuple] = []

    def step_time(self, num_rows: int, query_len: int, context_len: float,
                  num_tokens: float | None = None) -> float:
        self.calls.append((num_rows, query_len, num_tokens, context_len))
        return 1.0


@pytest.mark.parametrize("k, batch_size", [(0, 8), (4, 8), (4, 3), (3, 1)])
def test_simulate_prices_the_steps_the_engine_ran(tmp_path, monkeypatch, k, batch_size):
    """``whatif.simulate`` of a run's own setting at its batch size prices the very verify
    steps the engine ran: step by step the same rows, padded queries, real tokens and mean
    context (turns queued first, rows refilled as records finish, a job's tail of few rows,
    answers of one token, the lone row's padding)."""
    rows = [r for r in _rows(30, seed=5) if "temperature" not in r]
    ran: list = []
    path = mini_run(tmp_path, "run", rows, k, (1, 3), EOS, batch_size=batch_size, steps=ran)
    lone = make_engine(tiny_llama(VOCAB), 0, 1).runner.backend.min_query_len
    cost = SpyCost(lone)
    simulate, calls = whatif.simulate, {}

    def spy(jobs, b, c, setting=None):
        c.calls = calls.setdefault(setting, [])
        return simulate(jobs, b, c, setting)

    monkeypatch.setattr(whatif, "simulate", spy)
    doc = whatif.what_if([load_run(path)], whatif.NO_GROUPS, lambda m: TOK,
                         batch_size=batch_size, cost=cost, ks=(max(k, 1),), lookups=((1, 3),))
    assert doc["num_skipped"] == 0 and len(doc["groups"]) == 1
    plain, spec = calls[None], calls[whatif.Setting(1, 3, max(k, 1))]
    got = plain if k == 0 else spec
    assert len(got) == len(ran) and (batch_size == 1 or any(r[0] < batch_size for r in ran))
    for (r, q, t, c), want in zip(got, ran):
        assert (r, q, t) == want[:3] and c == pytest.approx(want[3])
    if k:  # fewer steps than plain decoding, and some of them drafting
        assert len(spec) < len(plain) and any(t > r for r, q, t, c in spec)


def test_simulate_prices_the_tail():
    """Two rows, one record of 10 plain steps beside one of 2: plain decoding takes 10 steps
    (the short record's row idles), drafting that halves the long record's steps takes 5,
    where a model of full steps would read the tokens per row step, 12 / 7."""
    cost = SimpleNamespace(step_time=lambda r, q, c, num_tokens=None: 1.0, min_query_len=1)
    s = whatif.Setting(1, 3, 2)
    long = whatif.Answer(5, 11, {s: (bytes([1] * 5), bytes([2] * 5))})
    short = whatif.Answer(3, 3, {s: (bytes([0, 0]), bytes([1, 1]))})
    jobs = [[short], [long]]
    assert whatif.simulate(jobs, 2, cost) == 10
    assert whatif.simulate(jobs, 2, cost, s) == 5
    assert whatif.simulate(jobs, 1, cost) == 12  # one row: every step of both
    assert whatif.simulate(jobs, 1, cost, s) == 7
    # a step costs its rows' real tokens; the padded queries follow the longest draft
    seen = []
    probe = SimpleNamespace(min_query_len=2, step_time=lambda r, q, c, num_tokens=None:
                            seen.append((r, q, num_tokens)) or 1.0)
    whatif.simulate(jobs, 2, probe, s)
    assert seen == [(2, 2, 3), (2, 2, 3)] + [(1, 2, 2)] * 3
    seen.clear()
    whatif.simulate([[short]], 2, probe)  # one row alone: padded to the fit's min_query_len
    assert seen == [(1, 2, 1), (1, 2, 1)]


def test_predicted_speedup(runs):
    # one row, a step costs the same whatever its length: speedup = plain steps / decode steps
    _, doc = _doc([runs["ngram"]], what_if=True, cost=LinearCost(1.0, 0.0), batch_size=1)
    for g in doc["what_if"]["groups"]:
        for c in g["configs"]:
            assert c["predicted_speedup"] == pytest.approx(c["tokens_per_decode_step"], abs=1e-5)
        assert g["best"]["criterion"] == "predicted_speedup"
        assert g["best"]["value"] == max(c["predicted_speedup"] for c in g["configs"])
    # a step costs its tokens: drafting can only lose, so the best is none
    _, doc = _doc([runs["ngram"]], what_if=True, cost=LinearCost(0.0, 1.0), batch_size=4)
    for g in doc["what_if"]["groups"]:
        assert g["best"]["name"] == "none"
        assert all(c["predicted_speedup"] < 1 for c in g["configs"])
    assert "predicted decode speedup vs none at batch size 4" in format_text(doc)
    assert ("predicted speedup: each group's records run as one job of at most 4 rows a step, "
            "verify steps only (prefill") in format_text(doc)


def test_compare_counts_differing_outputs(runs, tmp_path):
    _, doc = _doc([runs["none"], runs["ngram"]], compare=True, by="category")
    cmp = doc["compare"]
    assert cmp["num_common"] == 36 and cmp["num_differing_outputs"] == 0
    steps = {g["group"]: g for g in cmp["groups"]}["(all)"]
    assert steps["steps_ratio"] < 1  # speculation took fewer steps for the same tokens
    # alter one token of one record (the second turn of a turns record) and drop another record
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    victim = next(r for r in src if "turns" in r and len(r["output_token_ids"][1]) > 3)
    victim["output_token_ids"][1][2] = (victim["output_token_ids"][1][2] + 1) % VOCAB
    dropped = src.pop(5)["id"]
    altered = tmp_path / "altered.jsonl"
    altered.write_text("".join(json.dumps(r) + "\n" for r in src))
    config_path(altered).write_text(config_path(runs["ngram"]).read_text())
    _, doc = _doc([runs["ngram"], altered], compare=True)
    cmp = doc["compare"]
    assert cmp["num_differing_outputs"] == 1 and cmp["only_in_a"] == [dropped]
    d = cmp["differing_outputs"][0]
    assert (d["id"], d["turn"], d["position"]) == (victim["id"], 1, 2)
    assert f"id='{victim['id']}': turn 1, first difference at token 2" in format_text(doc)
    assert cmp["output_setting_differences"] == []
    assert "(should be 0: speculation must not change the output)" in format_text(doc)


def test_compare_names_a_dtype_difference(runs, tmp_path):
    """Outputs of a float32 run and an int8 run differ because of the dtype: the comparison
    names it instead of blaming speculation (issue 36)."""
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    victim = next(r for r in src if "prompt" in r and r["output_token_ids"])
    victim["output_token_ids"][0] = (victim["output_token_ids"][0] + 1) % VOCAB
    other = tmp_path / "int8.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in src))
    config = json.loads(config_path(runs["ngram"]).read_text())
    config_path(runs["ngram"]).write_text(json.dumps({**config, "dtype": "float32"}))
    config_path(other).write_text(json.dumps({**config, "dtype": "int8"}))
    try:
        _, doc = _doc([runs["ngram"], other], compare=True)
    finally:
        config_path(runs["ngram"]).write_text(json.dumps(config))
    cmp = doc["compare"]
    assert cmp["num_differing_outputs"] == 1
    assert cmp["output_setting_differences"] == [{"key": "dtype", "a": "float32", "b": "int8"}]
    text = format_text(doc)
    assert "the runs differ in what decides the tokens: dtype float32 vs int8" in text
    assert "speculation must not change" not in text
    # sampling parameters: the field that differs, not two JSON objects cut at the same width
    sampling = {**config["sampling"], "max_tokens": 128}
    config_path(other).write_text(json.dumps({**config, "sampling": sampling}))
    _, doc = _doc([runs["ngram"], other], compare=True)
    assert doc["compare"]["output_setting_differences"] == [
        {"key": "sampling.max_tokens", "a": config["sampling"]["max_tokens"], "b": 128}]
    assert f"sampling.max_tokens {config['sampling']['max_tokens']} vs 128" in format_text(doc)
    # an output that is a prefix of the other's (a shorter max_tokens) says so
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    victim = next(r for r in src if "prompt" in r and r["output_token_ids"])
    n = len(victim["output_token_ids"])
    victim["output_token_ids"].append(1)
    other.write_text("".join(json.dumps(r) + "\n" for r in src))
    _, doc = _doc([runs["ngram"], other], compare=True)
    assert f"a ends after {n} tokens, where b goes on (token 1)" in format_text(doc)


def test_plots_are_written(runs, tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    rng = random.Random(0)
    for r in src:  # as the auto planner will write them
        r["spec"]["predicted_acceptance_length"] = round(1 + 2 * rng.random(), 3)
    path = tmp_path / "pred.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in src))
    config_path(path).write_text(config_path(runs["ngram"]).read_text())
    plot_dir = tmp_path / "plots"
    result = _invoke(["analyze", str(path), "--by", "category", "--what-if", "--plot",
                      str(plot_dir)], tokenizer=True)
    assert result.exit_code == 0, result.output
    names = {"acceptance_length.png", "per_position_acceptance.png",
             "predicted_vs_measured.png", "what_if.png"}
    assert {p.name for p in plot_dir.iterdir()} == names
    for name in names:
        img = imread(plot_dir / name)
        height, width = img.shape[:2]
        assert width >= 600 and height >= 300, (name, img.shape)
        assert img.std() > 0.05  # not a blank canvas
        assert f"wrote {plot_dir / name}" in result.output


def _invoke(args: list[str], tokenizer: bool = False):
    if tokenizer:
        from specbatch.commands import analyze as report

        orig = report.load_tokenizer
        report.load_tokenizer = lambda model_id: TOK
        try:
            return CliRunner().invoke(main, args)
        finally:
            report.load_tokenizer = orig
    return CliRunner().invoke(main, args)


def test_cli_json_and_usage_errors(runs, tmp_path):
    result = _invoke(["analyze", str(runs["ngram"]), "--json", "--by", "category"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["tables"]["category"][-1]["num_records"] == 36 and doc["what_if"] is None
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "a"}\n{"id": 2, "prompt": "b"}\n')
    # an input whose records do not even read as prompts (the recipe's articles: the template
    # makes the prompt at run time): found by a fresh user, it used to exit 0 with empty tables
    articles = tmp_path / "articles.jsonl"
    articles.write_text('{"id": 1, "article": "a"}\n{"id": 2, "article": "b"}\n')
    # the output of an OpenAI batch input: it said "not its input" of the file run wrote
    batch = tmp_path / "batch.out.jsonl"
    batch.write_text(json.dumps({"id": "batch_req-1", "custom_id": "r1", "error": None,
                                 "response": {"status_code": 200, "body": {}}}) + "\n")
    bad = [(["analyze", str(runs["ngram"]), "--compare"], "--compare needs exactly two"),
           (["analyze", str(tmp_path / "nope.jsonl")], "no such output file"),
           (["analyze", str(tmp_path)], "a directory, not an output file"),
           (["analyze", str(inp)], "none of its 2 lines is an output record"),
           (["analyze", str(articles)], "none of its 2 lines is an output record"),
           (["analyze", str(batch)], "an OpenAI batch output (custom_id, response)"),
           (["analyze", str(runs["ngram"]), "--calibration", "x.json"], "add --what-if")]
    for args, msg in bad:
        result = _invoke(args)
        assert result.exit_code == 2 and msg in result.output, (args, result.output)


def test_what_if_does_not_self_check_auto_runs(runs, tmp_path):
    """``--method auto`` varies k per step: its records are replayed (what fixed settings would
    have done) but not checked against one setting."""
    out = tmp_path / "auto.jsonl"
    out.write_bytes(runs["ngram"].read_bytes())
    cfg = json.loads(config_path(runs["ngram"]).read_text())
    config_path(out).write_text(json.dumps({**cfg, "method": "auto"}))
    wi = _doc([out], by="category", what_if=True)[1]["what_if"]
    assert wi["num_replayed"] > 0
    assert wi["self_check"]["num_checked"] == 0


def test_plot_colors_stay_distinct_past_ten_groups():
    """Spec-Bench has 13 categories: matplotlib's default cycle gave coding and summarization
    the same blue."""
    pytest.importorskip("matplotlib")
    from specbatch.analyze.plots import line_colors

    for n in (1, 10, 13, 20, 21, 40):
        colors = line_colors(n)
        assert len(colors) == n and len(set(colors)) == n, n


def test_conditional_points_leave_out_tiny_support():
    """accepted at i / accepted at i - 1: 3 of 3 is 1.0 on nothing; such points are left out,
    and each kept point carries the drafting steps it is measured on."""
    from specbatch.analyze.plots import conditional_points

    row = {"num_drafts": 100, "num_accepted_tokens_per_pos": [50, 3, 3, 0],
           "conditional_acceptance_per_pos": [0.5, 0.06, 1.0, 0.0]}
    assert conditional_points(row) == [(1, 0.5, 100), (2, 0.06, 50)]
    assert conditional_points(row, min_support=3) == [(1, 0.5, 100), (2, 0.06, 50),
                                                      (3, 1.0, 3), (4, 0.0, 3)]
    nothing = {"num_drafts": 0, "num_accepted_tokens_per_pos": [],
               "conditional_acceptance_per_pos": []}
    assert conditional_points(nothing) == []


def test_rate_points_leave_out_tiny_support():
    """accepted at i / drafts that reached i, kept where at least 20 drafts reached i; a row
    of a file written before ``num_draft_tokens_per_pos`` has none."""
    from specbatch.analyze.plots import rate_points

    row = {"num_draft_tokens_per_pos": [100, 60, 12, 12],
           "acceptance_rate_per_pos": [0.5, 0.05, 0.25, 0.0]}
    assert rate_points(row) == [(1, 0.5, 100), (2, 0.05, 60)]
    assert rate_points(row, min_support=12) == [(1, 0.5, 100), (2, 0.05, 60), (3, 0.25, 12),
                                                (4, 0.0, 12)]
    assert rate_points({"num_draft_tokens_per_pos": None,
                        "acceptance_rate_per_pos": None}) == []


def test_what_if_takes_the_cached_calibration(runs, tmp_path, monkeypatch):
    """``analyze --what-if`` without --calibration prices the settings with the calibration that
    run / bench / calibrate cached for the run's model and dtype on this host (a fresh user
    was told to pass --calibration although one was cached), and says which file it read;
    with none cached it still answers, in tokens per step, and says how to get one."""
    import dataclasses

    from specbatch.auto.costmodel import CostModel, cache_path, engine_fingerprint

    out = tmp_path / "run.jsonl"
    out.write_bytes(runs["ngram"].read_bytes())
    cfg = json.loads(config_path(runs["ngram"]).read_text())
    cfg["dtype"] = "float32"
    config_path(out).write_text(json.dumps(cfg))
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    args = ["analyze", str(out), "--what-if", "--json"]

    result = _invoke(args, tokenizer=True)
    assert result.exit_code == 0, result.output
    assert "cached calibration" not in result.output
    doc = json.loads(result.output)
    assert doc["what_if"]["calibration"] is None and not doc["what_if"]["has_cost_model"]
    text = _invoke(args[:-1], tokenizer=True)  # none cached: the text says how to get one
    assert text.exit_code == 0 and "pass --calibration" in text.output, text.output

    cached = cache_path(tmp_path / "cache", cfg["model"], "float32", "cpu")
    cached.parent.mkdir(parents=True)
    fit = CostModel((0.035, 0.0012, 2e-7, 1e-8), model_id=cfg["model"], dtype="float32",
                    engine=engine_fingerprint())
    fit.save(cached)
    result = _invoke(args, tokenizer=True)
    assert result.exit_code == 0, result.output
    assert f"step costs from the cached calibration {cached}, measured 0 min ago" \
        in result.output
    assert "warning" not in result.output
    written = os.path.getmtime(cached)  # its age, as the cached fit grows old
    assert [file_age(cached, written + s) for s in (59, 3 * 3600 + 5, 3 * 86400)] \
        == ["0 min ago", "3 h ago", "3 days ago"]
    doc = json.loads(result.output[result.output.index("{"):])
    assert {g["best"]["criterion"] for g in doc["what_if"]["groups"]} == {"predicted_speedup"}
    assert doc["what_if"]["calibration"] == str(cached)
    text = _invoke(args[:-1], tokenizer=True)  # one cached: no request for --calibration
    assert text.exit_code == 0 and "predicted speedup" in text.output, text.output
    assert "pass --calibration" not in text.output
    # a fit of an older engine build still answers, with a warning saying so
    dataclasses.replace(fit, engine="engine r1").save(cached)
    result = _invoke(args, tokenizer=True)
    assert result.exit_code == 0, result.output
    assert "measured with another engine build" in result.output
    # --calibration of another dtype (or model): a warning naming both, still an answer
    other = tmp_path / "bf16.json"
    dataclasses.replace(fit, dtype="bfloat16").save(other)
    result = _invoke(args + ["--calibration", str(other)], tokenizer=True)
    assert result.exit_code == 0, result.output
    assert "measured for dtype bfloat16, the run used float32" in result.output


def test_a_template_output_away_from_its_config_says_so(tmp_path):
    """The output of a --template job moved without OUT.config.json: its records have no
    prompt field, so none reads; the error names the missing config, not "no output record"."""
    from specbatch.analyze.load import load_run

    out = tmp_path / "moved.jsonl"
    out.write_text(json.dumps({"id": 1, "article": "a", "output": "x", "output_token_ids": [1],
                               "finish_reason": "length", "usage": {}, "spec": {}}) + "\n")
    with pytest.raises(ValueError, match=r"no prompt.*moved.jsonl.config.json is not beside it"):
        load_run(out)


def test_a_file_with_some_input_lines_keeps_its_output_records(runs, tmp_path):
    """Only a file with no output record at all is refused (exit 2); one with some output
    records and some input lines (one reading as a prompt, one not) is analysed: the output
    records are counted and each other line is a ``warning: skipped`` line."""
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(runs["ngram"].read_text() + '{"id": "in-1", "prompt": "a"}\n'
                     '{"id": "in-2", "article": "b"}\n')
    config_path(mixed).write_text(config_path(runs["ngram"]).read_text())
    result = _invoke(["analyze", str(mixed), "--json"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2 and all("skipped" in w for w in warnings), result.output
    assert any("id='in-1': not an output record" in w for w in warnings), warnings
    assert any("id='in-2': no prompt" in w for w in warnings), warnings
    doc = json.loads(result.output[result.output.index("{"):])
    assert doc["files"][0]["num_records"] == 36 and doc["files"][0]["num_problems"] == 2


def test_an_output_without_its_config_says_the_settings_are_unknown(runs, tmp_path):
    """An output copied away from OUT.config.json: the header says so instead of printing
    ``? k=None n-gram None-None`` (fresh-user pass)."""
    moved = tmp_path / "moved.jsonl"
    moved.write_bytes(runs["ngram"].read_bytes())
    _, doc = _doc([moved])
    header = format_text(doc).splitlines()[0]
    assert header.endswith("records, run settings unknown (no OUT.config.json beside it)")
    assert "None" not in header


def test_by_a_field_no_record_has_is_refused(runs):
    """``--by categroy`` (a typo) put every record in one group ``-`` without a word; now one
    line naming the closest field, exit 2; a field the records hold still works."""
    result = _invoke(["analyze", str(runs["ngram"]), "--by", "categroy"])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: --by categroy: no record has that field")
    assert "did you mean 'category'?" in line
    assert _invoke(["analyze", str(runs["ngram"]), "--by", "category"]).exit_code == 0


def test_header_names_n_gram_sizes_only_for_prompt_lookup_runs(runs):
    """The n-gram sizes are settings of prompt lookup: a ``none`` run's header does not name
    them (it said "none k=0 n-gram 1-3")."""
    _, doc = _doc([runs["ngram"], runs["none"]])
    head = format_text(doc).splitlines()[:2]
    assert head == [f"{runs['ngram']}: 36 records, ngram k=4 n-gram 1-3, chars",
                    f"{runs['none']}: 36 records, none k=0, chars"]


def test_rows_that_never_drafted_have_no_per_position_row(runs):
    """A ``none`` file beside an ngram file (not pooled): the per-position block lists the
    ngram file's groups only (the none file's printed as empty rows), and a ``none`` file alone
    has no per-position block."""
    _, doc = _doc([runs["ngram"], runs["none"]], by="category")
    lines = format_text(doc).splitlines()
    at = lines.index("== by category ==")
    head = next(i for i in range(at, len(lines)) if lines[i].startswith("per-position"))
    end = next(i for i in range(head, len(lines)) if lines[i].startswith("finish reasons"))
    names = [line.split(": ")[0] for line in lines[head + 2:end]]
    assert names == ["ngram.jsonl"] * 4  # alpha, beta, gamma and (all)
    rates = next(r for r in doc["tables"]["category"] if r["group"] == "ngram.jsonl: (all)")
    assert lines[end - 1].split()[2:] == [f"{x:.2f}" for x in rates["acceptance_rate_per_pos"]]
    _, alone = _doc([runs["none"]], by="category")
    assert not any(line.startswith("per-position") for line in format_text(alone).splitlines())


def test_compare_of_files_with_no_records_in_common_is_refused(runs, tmp_path):
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    for r in src[:30]:
        r["id"] = "other-" + r["id"]
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in src[:30]))
    config_path(other).write_text(config_path(runs["ngram"]).read_text())
    result = _invoke(["analyze", str(runs["none"]), str(other), "--compare"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: --compare: {runs['none']} and {other} have no records in common (a: 36 "
        "records, b: 30 records; records are matched by id): compare two runs of the same input"]


def test_what_if_of_files_with_one_group_each_skips_their_totals(runs):
    """By proposer, the ngram file and the none file have one group each: the text prints
    ``FILE: group`` and not ``FILE: (all)``, which repeats it."""
    _, doc = _doc([runs["ngram"], runs["none"]], by="proposer", what_if=True)
    names = [g["group"] for g in doc["what_if"]["groups"]]
    assert names == ["ngram.jsonl: ngram:k=4", "none.jsonl: none", "ngram.jsonl: (all)",
                     "none.jsonl: (all)"]  # the document keeps them
    heads = [line.split(":")[0] + ":" + line.split(":")[1] for line in
             format_text(doc).split("== what-if")[1].splitlines() if " records, " in line]
    assert heads == ["ngram.jsonl: ngram", "none.jsonl: none"]
    # the files in the order given (it was by name: none.jsonl's groups after ngram.jsonl's)
    _, doc = _doc([runs["none"], runs["ngram"]], by="proposer", what_if=True)
    assert [g["group"] for g in doc["what_if"]["groups"]] == [
        "none.jsonl: none", "ngram.jsonl: ngram:k=4", "none.jsonl: (all)", "ngram.jsonl: (all)"]
    # by category each file has three groups: every total is printed
    _, doc = _doc([runs["ngram"], runs["none"]], by="category", what_if=True)
    text = format_text(doc).split("== what-if")[1]
    assert "\nngram.jsonl: (all): " in text and "\nnone.jsonl: (all): " in text


def test_self_check_of_a_file_written_before_drafted_per_position(runs, tmp_path):
    """A file without ``num_draft_tokens_per_pos`` (older writer): the self-check still finds
    every record equal, and the tables are the same as the current file's (the drafted
    counts come from ``k_histogram``)."""
    src = [json.loads(line) for line in runs["ngram"].read_text().splitlines()]
    for r in src:
        del r["spec"]["num_draft_tokens_per_pos"]
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in src))
    config_path(old).write_text(config_path(runs["ngram"]).read_text())
    _, doc = _doc([old], by="category", what_if=True)
    sc = doc["what_if"]["self_check"]
    assert sc["num_checked"] == 33 and sc["num_equal"] == 33
    _, new = _doc([runs["ngram"]], by="category")
    assert doc["tables"] == new["tables"]


def test_what_if_names_the_run_config_it_missed(runs, tmp_path):
    """A file without its run config beside it: every record is skipped, and the reason names
    the file it looked for (a user saw "no OUT.config.json" and did not know which name)."""
    out = tmp_path / "moved.jsonl"
    out.write_bytes(runs["ngram"].read_bytes())
    wi = _doc([out], what_if=True)[1]["what_if"]
    assert wi["num_replayed"] == 0
    assert wi["skipped_reasons"] == {"no run config moved.jsonl.config.json beside it": 36}
    config_path(out).write_text(json.dumps({"model": "chars"}))
    wi = _doc([out], what_if=True)[1]["what_if"]
    assert wi["skipped_reasons"] == {
        "its run config moved.jsonl.config.json names no model or max_model_len": 36}
