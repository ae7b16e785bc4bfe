"""``spec.num_speculative_tokens`` is the k the run asked for, ``spec.max_spec_tokens`` the
engine's per-row draft cap (``min(32, 3k)`` for suffix): a suffix run at k 3 is labelled
``suffix:k=3`` by analyze (not ``suffix:k=9``), its per-position acceptance has one column per
position some draft reached (not 9 columns, those past the longest draft all 0), and output
files written before ``max_spec_tokens`` existed (``num_speculative_tokens`` = the cap) read
back the same way. A real suffix run of a tiny float64 model, through ``generate_records``."""

from __future__ import annotations

import json

import orjson
import pytest

from specbatch.analyze.load import config_path, load_run, upgrade_spec
from specbatch.analyze.plots import MIN_CONDITIONAL_SUPPORT
from specbatch.commands.analyze import format_text
from specbatch.config import SamplingParams, SpecConfig
from specbatch.io.records import read_records
from specbatch.pipeline import PromptRenderer, generate_records
from specbatch.spec_decode import make_proposer
from specbatch.spec_decode.stats import SpecStats
from tests.helpers import make_engine, run_engine, tiny_llama
from tests.unit.test_analyze import EOS, TOK, VOCAB, _doc, _rows

K = 3
CAP = SpecConfig(method="suffix", num_speculative_tokens=K).draft_cap  # 9


def _suffix_run(tmp, rows: list[dict], batch_size: int = 1):
    """``rows`` generated with ``--method suffix --k K`` as ``specbatch run`` builds it (the
    engine's cap is the method's, the stats' k the run's), written with its config."""
    inp = tmp / "suffix.in.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, errors = read_records(inp, defaults=SamplingParams(max_tokens=24))
    assert not errors
    config = SpecConfig(method="suffix", num_speculative_tokens=K)
    engine = make_engine(tiny_llama(VOCAB, seed=11), K, batch_size, eos_ids=(EOS,),
                         detokenize=TOK.decode)
    engine.proposer = make_proposer(config)
    engine.k = config.draft_cap
    outs = {rec.index: {**rec.fields, **out}
            for rec, out in generate_records(engine, PromptRenderer(TOK), records)}
    out = tmp / "suffix.jsonl"
    out.write_bytes(b"".join(orjson.dumps(outs[i]) + b"\n" for i in sorted(outs)))
    config_path(out).write_text(json.dumps(
        {"model": "chars", "method": "suffix", "k": K, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "sampling": SamplingParams(max_tokens=24).to_dict(),
         "prompt_field": None, "id_field": None, "max_model_len": 256}))
    return out


@pytest.fixture(scope="module")
def suffix_run(tmp_path_factory):
    return _suffix_run(tmp_path_factory.mktemp("suffix"), _rows(24, seed=2))


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _longest(recs) -> int:
    return max(int(k) for r in recs for k, n in r["spec"]["k_histogram"].items() if n)


def _per_pos_columns(text: str, grouping: str) -> int:
    """The per-position columns the text prints under ``== by GROUPING ==``."""
    lines = text.splitlines()
    at = lines.index(f"== by {grouping} ==")
    head = next(i for i in range(at, len(lines)) if lines[i].startswith("per-position"))
    return len(lines[head + 1].split()) - 1  # "group 1 2 3 ..."


def test_suffix_records_hold_k_and_the_cap(suffix_run):
    recs = _records(suffix_run)
    longest = _longest(recs)
    assert K < longest <= CAP  # a suffix draft ran past k (batch 1), within the cap
    for r in recs:
        s = r["spec"]
        assert (s["proposer"], s["num_speculative_tokens"], s["max_spec_tokens"]) == (
            "suffix", K, CAP)
        own = max((int(k) for k, n in s["k_histogram"].items() if n), default=0)
        # k positions, more only where this record's drafts went past k
        assert len(s["num_accepted_tokens_per_pos"]) == max(K, own)
        assert sum(s["num_accepted_tokens_per_pos"]) == s["num_accepted_tokens"]


def test_analyze_labels_k_and_prints_only_drafted_positions(suffix_run):
    recs = _records(suffix_run)
    _, doc = _doc([suffix_run], by="category")
    total = doc["tables"]["proposer"][-1]
    assert [r["group"] for r in doc["tables"]["proposer"]] == [f"suffix:k={K}", "(all)"]
    longest = _longest(recs)
    assert len(total["num_accepted_tokens_per_pos"]) == longest
    text = format_text(doc)
    # no n-gram sizes: suffix drafts do not use prompt lookup
    assert text.splitlines()[0].split(", ")[1] == f"suffix k={K}"
    assert "n-gram" not in text.splitlines()[0]
    assert f"suffix:k={K}" in text and f"suffix:k={CAP}" not in text
    assert _per_pos_columns(text, "proposer") == longest < CAP
    # the drafts ran past k, and the block's header says why there are more columns than k
    head = next(line for line in text.splitlines() if line.startswith("per-position"))
    assert K < longest and f"positions past k = {K} are suffix drafts, which may run to 3k" in head


def test_suffix_records_count_the_drafts_that_reach_each_position(suffix_run):
    """Suffix drafts vary in length: ``num_draft_tokens_per_pos[i]`` counts the drafting steps
    whose draft reached position i (the steps with a longer draft in ``k_histogram``), and
    analyze's per-position acceptance rate is accepted[i] / drafted[i]."""
    recs = _records(suffix_run)
    for r in recs:
        s = r["spec"]
        drafted, accepted = s["num_draft_tokens_per_pos"], s["num_accepted_tokens_per_pos"]
        hist = {int(k): n for k, n in s["k_histogram"].items()}
        assert len(drafted) == len(accepted)
        assert drafted == [sum(n for d, n in hist.items() if d > i)
                           for i in range(len(drafted))]
        assert sum(drafted) == s["num_draft_tokens"]
        assert all(a <= t for a, t in zip(accepted, drafted))
        assert not drafted or drafted[0] == s["num_drafts"]
    _, doc = _doc([suffix_run], by="category")
    total = doc["tables"]["proposer"][-1]
    drafted = [sum(r["spec"]["num_draft_tokens_per_pos"][i]
                   if i < len(r["spec"]["num_draft_tokens_per_pos"]) else 0 for r in recs)
               for i in range(_longest(recs))]
    accepted = total["num_accepted_tokens_per_pos"]
    assert total["num_draft_tokens_per_pos"] == drafted
    assert drafted[-1] < drafted[0]  # fewer drafts reached the last position than the first
    rates = [round(a / t, 6) for a, t in zip(accepted, drafted)]
    assert total["acceptance_rate_per_pos"] == rates
    # the old "conditional" (accepted at i / accepted at i - 1) is another number here
    assert total["conditional_acceptance_per_pos"] != rates
    lines = format_text(doc).splitlines()
    at = lines.index("== by proposer ==")
    head = next(i for i in range(at, len(lines)) if lines[i].startswith("per-position"))
    assert lines[head].startswith("per-position acceptance rate: accepted / drafts that "
                                  "reached the position")
    # a rate from fewer than MIN_CONDITIONAL_SUPPORT drafts is starred, as the plot leaves it
    # out (a suffix run's last positions read 1.00 from one draft each)
    shown = [f"{x:.2f}" + ("" if n >= MIN_CONDITIONAL_SUPPORT else "*")
             for x, n in zip(rates, drafted)]
    assert shown[-1].endswith("*") and not shown[0].endswith("*")
    assert lines[head + 2].split() == [f"suffix:k={K}"] + shown


def _old_format(spec: dict) -> dict:
    """``spec`` as the writer wrote it before ``max_spec_tokens``: num_speculative_tokens was
    the cap and the per-position list was padded to it (and there was no
    ``num_draft_tokens_per_pos``)."""
    old = {k: v for k, v in spec.items()
           if k not in ("max_spec_tokens", "num_draft_tokens_per_pos")}
    old["num_speculative_tokens"] = spec["max_spec_tokens"]
    per_pos = spec["num_accepted_tokens_per_pos"]
    old["num_accepted_tokens_per_pos"] = per_pos + [0] * (spec["max_spec_tokens"] - len(per_pos))
    return old


@pytest.mark.parametrize("with_config", [True, False])
def test_old_format_files_read_as_the_new(suffix_run, tmp_path, with_config):
    """The same run in the previous format gives the same tables and text; k comes from the
    run config, or without one from the cap (9 = 3 * 3)."""
    src = _records(suffix_run)
    for r in src:
        r["spec"] = _old_format(r["spec"])
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps(r) + "\n" for r in src))
    if with_config:
        config_path(old).write_text(config_path(suffix_run).read_text())
    f = load_run(old)
    assert {(r.fields["spec"]["num_speculative_tokens"], r.fields["spec"]["max_spec_tokens"])
            for r in f.records} == {(K, CAP)}
    _, new_doc = _doc([suffix_run], by="category")
    _, old_doc = _doc([old], by="category")
    assert old_doc["tables"] == new_doc["tables"]


def test_a_hand_made_old_record(tmp_path):
    """Two records as the old writer wrote a ``--method suffix --k 5`` run: k 15 (the cap),
    15 per-position entries, the drafts of which reached 7. Analyze groups them as suffix:k=5
    and prints 7 per-position columns (it printed 15, 8-15 all 0)."""
    def record(rid, per_pos, hist):
        steps = 1 + sum(hist.values())  # the prefill and the decode steps
        spec = {"proposer": "suffix", "num_speculative_tokens": 15, "num_steps": steps,
                "num_drafts": sum(n for k, n in hist.items() if k != "0"),
                "num_draft_tokens": sum(int(k) * n for k, n in hist.items()),
                "num_accepted_tokens": sum(per_pos),
                "num_accepted_tokens_per_pos": per_pos + [0] * (15 - len(per_pos)),
                "acceptance_rate": None, "mean_acceptance_length": None, "k_histogram": hist,
                "mean_k": None}
        n = steps + sum(per_pos)
        return {"id": rid, "prompt": "x", "output": "y" * n, "output_token_ids": [1] * n,
                "finish_reason": "length", "usage": {"prompt_tokens": 1, "completion_tokens": n},
                "spec": spec}
    # a: a plain step, a 2-token draft with 1 accepted, a 7-token draft with 6 accepted;
    # b: two 3-token drafts, 1 and 0 accepted
    rows = [record("a", [2, 1, 1, 1, 1, 1], {"0": 1, "2": 1, "7": 1}),
            record("b", [1], {"3": 2})]
    path = tmp_path / "old.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config_path(path).write_text(json.dumps({"model": "m", "method": "suffix", "k": 5,
                                             "prompt_lookup_min": 2, "prompt_lookup_max": 4}))
    _, doc = _doc([path])
    [row, total] = doc["tables"]["proposer"]
    assert row["group"] == "suffix:k=5" and total["group"] == "(all)"
    assert row["num_accepted_tokens_per_pos"] == [3, 1, 1, 1, 1, 1, 0]  # drafts reached 7
    assert row["acceptance_length_histogram"] == {"1": 1, "2": 2, "3": 0, "4": 0, "5": 0,
                                                  "6": 0, "7": 1, "8": 0}
    # drafts that reached each position: a's 2- and 7-token drafts, b's two 3-token drafts
    assert row["num_draft_tokens_per_pos"] == [4, 4, 3, 1, 1, 1, 1]
    assert row["acceptance_rate_per_pos"] == [0.75, 0.25, 0.333333, 1.0, 1.0, 1.0, 0.0]
    text = format_text(doc)
    assert _per_pos_columns(text, "proposer") == 7
    assert "suffix:k=15" not in text
    # every position reached by fewer than MIN_CONDITIONAL_SUPPORT drafts: starred
    assert "suffix:k=5 0.75* 0.25* 0.33* 1.00* 1.00* 1.00* 0.00*" in " ".join(text.split())
    # an old record whose histogram does not account for its drafts: the drafts that reached
    # each position are unknown, and the table says what it prints instead
    rows[1]["spec"]["k_histogram"] = {}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, doc = _doc([path])
    [row, _] = doc["tables"]["proposer"]
    assert row["num_draft_tokens_per_pos"] is None and row["acceptance_rate_per_pos"] is None
    text = format_text(doc)
    assert "a file written before spec.num_draft_tokens_per_pos" in text
    assert _per_pos_columns(text, "proposer") == 7


@pytest.mark.parametrize("spec,config,want", [
    ({"proposer": "suffix", "num_speculative_tokens": 15}, None, (5, 15)),
    ({"proposer": "auto", "num_speculative_tokens": 12}, None, (4, 12)),
    ({"proposer": "ngram", "num_speculative_tokens": 5}, None, (5, 5)),
    ({"proposer": "none", "num_speculative_tokens": 0}, None, (0, 0)),
    # 32 is the cap of every k from 11 up: the config says which, else it stays
    ({"proposer": "suffix", "num_speculative_tokens": 32}, None, (32, 32)),
    ({"proposer": "suffix", "num_speculative_tokens": 32}, {"method": "suffix", "k": 12},
     (12, 32)),
    # a config of another method (files analyzed together) does not apply
    ({"proposer": "suffix", "num_speculative_tokens": 15}, {"method": "ngram", "k": 7},
     (5, 15)),
    # a current spec is left alone
    ({"proposer": "suffix", "num_speculative_tokens": 5, "max_spec_tokens": 15},
     {"method": "suffix", "k": 9}, (5, 15)),
])
def test_upgrade_spec(spec, config, want):
    s = upgrade_spec(dict(spec), config)
    assert (s["num_speculative_tokens"], s["max_spec_tokens"]) == want


def test_from_dict_of_an_old_spec_treats_the_value_as_the_cap():
    d = {"proposer": "suffix", "num_speculative_tokens": 15, "num_steps": 3, "num_drafts": 1,
         "num_draft_tokens": 6, "num_accepted_tokens": 6,
         "num_accepted_tokens_per_pos": [1] * 6 + [0] * 9, "k_histogram": {"6": 1}}
    s = SpecStats.from_dict(d)
    assert (s.num_speculative_tokens, s.max_spec_tokens, s.longest_draft) == (15, 15, 6)
    assert SpecStats.from_dict(s.to_dict()) == s  # the current format round-trips
    new = SpecStats.from_dict({**d, "num_speculative_tokens": 5, "max_spec_tokens": 15})
    assert (new.num_speculative_tokens, new.max_spec_tokens) == (5, 15)


def test_suffix_outputs_unchanged(suffix_run):
    """A stats / format change only: the suffix run's output tokens are plain decoding's."""
    recs = _records(suffix_run)
    rows = _rows(24, seed=2)
    prompts, ok = [], []
    for rec, row in zip(recs, rows):
        if "prompt" in row and not row.get("temperature"):
            prompts.append(TOK.encode(row["prompt"]))
            ok.append(rec)
    sampling = [SamplingParams(max_tokens=r.get("max_tokens", 24)) for r in ok]
    base = run_engine(tiny_llama(VOCAB, seed=11), prompts, 0, 1, sampling, eos_ids=(EOS,))
    assert [c.output_ids for c in base] == [r["output_token_ids"] for r in ok]
