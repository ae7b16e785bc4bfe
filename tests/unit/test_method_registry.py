"""A method registered from a test file runs everywhere a built-in one does (issue 34, point 3).

``repeat`` drafts its row's last token k times. It is registered here, and only here: no file
of the package names it. Checked through the real command line, in process: ``run`` writes the
same output token ids as ``--method none`` (and its ``spec`` shows drafts were verified), its
``memory:`` line has the entry's part, a resume of a ``repeat`` job calls the entry's resume
hook and finishes the job, ``bench --configs none,repeat:k=3`` reports every output identical,
and ``analyze --what-if`` replays the ``repeat`` run as the ``none`` run (the same tokens give
the same n-gram tables). Its entry says auto may choose it and gives a ``Candidate``: ``run
--method auto`` verifies ``repeat`` drafts on some steps, outputs equal to ``none``'s. The
built-in entries keep their behaviour (``SpecConfig`` errors, ``--method`` choices, the bench
keys).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specbatch import methods
from specbatch.cli import main
from specbatch.auto.candidate import ForwardingCandidate
from specbatch.config import ConfigError, SpecConfig
from specbatch.methods import Method, register_method
from specbatch.spec_decode.proposer import Proposer
from tests.cli_helpers import read_jsonl

NAME = "repeat"


class RepeatLastProposer(Proposer):
    """Drafts ``ks[i]`` copies of row i's last token (``Proposer`` protocol)."""

    name = NAME

    def __init__(self) -> None:
        self.calls = 0

    def start(self, seq) -> None:
        pass

    def propose(self, seqs, ks):
        self.calls += 1
        return [[s.token_ids[-1]] * k for s, k in zip(seqs, ks)]

    def on_commit(self, seq, num_new_tokens: int) -> None:
        pass

    def finish(self, seq) -> None:
        pass


class RepeatCandidate(ForwardingCandidate):
    """How auto values ``repeat``'s drafts (``auto.candidate.Candidate``): draft position j is
    accepted with chance 0.9 ** (j + 1), whatever happened before (no acceptance pool), and
    drafting costs nothing. Drafts at most k tokens."""

    name = NAME
    hysteresis = False

    def __init__(self, proposer, setup) -> None:
        self.proposer, self.k = proposer, setup.k_max
        self._drafts: dict[int, list[int]] = {}

    def prepare(self, seqs, caps):
        drafts = self.proposer.propose(seqs, [min(self.k, c) for c in caps])
        self._drafts = {s.seq_id: d for s, d in zip(seqs, drafts)}
        return [len(d) for d in drafts]

    def reach(self, seqs, lengths):
        return [[0.9 ** (j + 1) for j in range(n)] for n in lengths]

    def drafts(self, seqs, lengths, ctx):
        return [self._drafts[s.seq_id][:n] for s, n in zip(seqs, lengths)]


RESUMED: list = []  # the ids of the records each resume hook call was given


def _on_resume(proposer, finished_records) -> None:
    assert isinstance(proposer, RepeatLastProposer) and proposer.calls == 0
    RESUMED.append(sorted(r["id"] for r in finished_records))


@pytest.fixture
def repeat_method():
    RESUMED.clear()
    entry = register_method(Method(NAME, lambda config, draft_forward, num_rows:
                                   RepeatLastProposer(), bench_keys={"k": "num_speculative_tokens"},
                                   resume=_on_resume, memory=lambda proposer: "repeat: no KV",
                                   auto=True, candidate=RepeatCandidate))
    try:
        yield entry
    finally:
        methods.unregister_method(NAME)
    assert methods.get(NAME) is None


def _input(tmp_path):
    inp = tmp_path / "in.jsonl"
    rows = [{"id": i, "prompt": p, "category": c} for i, (p, c) in enumerate(
        [("aaaa aaaa aaaa", "x"), ("abc abc abc abc", "x"), ("hello hello", "y"),
         ("zzzzzzzzzzzz", "y")])]
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return inp


def _run(tmp_path, model, inp, out, *flags):
    result = CliRunner().invoke(main, ["run", str(inp), "-o", str(out), "--model", str(model),
                                       "--cache-dir", str(tmp_path / "c"), "--max-tokens", "12",
                                       "--ignore-eos", "--no-progress", *flags])
    assert result.exit_code == 0, result.output
    return result


def test_a_registered_method_runs_through_run_bench_resume_and_what_if(
        tmp_path, tiny_gguf, repeat_method):
    inp = _input(tmp_path)
    none_out, rep_out = tmp_path / "none.jsonl", tmp_path / "repeat.jsonl"
    _run(tmp_path, tiny_gguf, inp, none_out, "--method", "none")
    ran = _run(tmp_path, tiny_gguf, inp, rep_out, "--method", NAME, "--k", "3")
    memory = next(line for line in ran.output.splitlines() if line.startswith("memory: "))
    assert memory.startswith("memory: target weights ") and "; repeat: no KV" in memory, memory
    base, rep = read_jsonl(none_out), read_jsonl(rep_out)
    assert [r["id"] for r in rep] == [r["id"] for r in base] == [0, 1, 2, 3]
    assert [r["output_token_ids"] for r in rep] == [r["output_token_ids"] for r in base]
    assert all(len(r["output_token_ids"]) == 12 for r in base)  # nothing ended early
    assert {r["spec"]["proposer"] for r in rep} == {NAME}
    drafts = sum(r["spec"]["num_drafts"] for r in rep)
    drafted = sum(r["spec"]["num_draft_tokens"] for r in rep)
    assert 0 < drafts and drafts < drafted <= 3 * drafts  # k = 3, cut near max_tokens
    assert json.loads((tmp_path / "repeat.jsonl.config.json").read_text())["method"] == NAME

    # resume: killed after two records; the entry's resume hook hears of them, the job
    # finishes the other two with the same tokens
    lines = rep_out.read_text().splitlines()
    rep_out.unlink()
    (tmp_path / "repeat.jsonl.work.jsonl").write_text("".join(
        json.dumps({"index": i, "record": json.loads(lines[i])}) + "\n" for i in range(2)))
    resumed = _run(tmp_path, tiny_gguf, inp, rep_out, "--method", NAME, "--k", "3")
    assert "resuming: 2 of 4 records already done" in resumed.output, resumed.output
    assert RESUMED == [[0, 1]]
    assert [r["output_token_ids"] for r in read_jsonl(rep_out)] == [
        r["output_token_ids"] for r in base]

    # bench: the toy's label and keys, outputs compared with none's
    result = CliRunner().invoke(main, ["bench", str(inp), "--configs", f"none,{NAME}:k=3",
                                       "--model", str(tiny_gguf), "--max-tokens", "12",
                                       "--cache-dir", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    head = next(line for line in result.stdout.splitlines() if line.startswith("| category"))
    assert [c.strip() for c in head.strip("|").split("|")][2:] == [
        "none tok/s", f"{NAME}:k=3 tok/s", f"{NAME}:k=3 / none", f"{NAME}:k=3 acc.len"], head
    assert f"outputs {NAME}:k=3 vs none: 4 identical, 0 differ" in result.stdout

    # analyze --what-if: the same tokens give the same replayed tables, no note, no self-check
    docs = {}
    for name, path in (("none", none_out), (NAME, rep_out)):
        result = CliRunner().invoke(main, ["analyze", str(path), "--what-if", "--json"])
        assert result.exit_code == 0, result.output
        docs[name] = json.loads(result.output[result.output.index("{"):])["what_if"]
    assert docs[NAME]["num_replayed"] == 4 and docs[NAME]["notes"] == []
    assert docs[NAME]["groups"] and all(g["configs"] for g in docs[NAME]["groups"])
    assert docs[NAME]["self_check"]["num_checked"] == 0
    assert docs[NAME]["groups"] == docs["none"]["groups"]
    assert docs[NAME]["settings"] == docs["none"]["settings"]


def test_auto_may_choose_a_registered_method(tmp_path, tiny_gguf, repeat_method, monkeypatch):
    """``--method auto`` builds every method whose entry says auto may choose it: on some steps
    of some rows it verifies ``repeat``'s drafts (the record's ``proposer_steps``), and the
    output token ids equal ``--method none``'s. The step cost is a made-up one where a fed
    token costs 1/80 of a step (calibrating would time the model)."""
    from specbatch.auto import costmodel

    real, cheap = costmodel.calibrate, costmodel.CostModel((0.040, 0.0005, 0.0, 0.0))
    monkeypatch.setattr(costmodel, "calibrate", lambda forward, **kw: real(
        forward, **{**kw, "progress": False, "time_fn": cheap.step_time}))
    monkeypatch.setattr(costmodel, "load_average", lambda: None)
    inp = _input(tmp_path)
    none_out, auto_out = tmp_path / "none.jsonl", tmp_path / "auto.jsonl"
    _run(tmp_path, tiny_gguf, inp, none_out, "--method", "none")
    _run(tmp_path, tiny_gguf, inp, auto_out, "--method", "auto", "--k", "3")
    base, auto = read_jsonl(none_out), read_jsonl(auto_out)
    assert [r["output_token_ids"] for r in auto] == [r["output_token_ids"] for r in base]
    steps: dict[str, int] = {}
    for r in auto:
        for source, n in r["spec"]["proposer_steps"].items():
            steps[source] = steps.get(source, 0) + n
    assert steps.get(NAME, 0) > 0, steps
    assert set(steps) <= {NAME, "ngram", "suffix", "none"}, steps


def test_a_registered_method_is_a_choice_and_a_config(repeat_method):
    from specbatch.commands.bench import parse_configs

    assert NAME in methods.names() and methods.get(NAME) is repeat_method
    assert SpecConfig(method=NAME, num_speculative_tokens=2).k == 2
    assert SpecConfig(method=NAME, num_speculative_tokens=2).draft_cap == 2
    with pytest.raises(ConfigError, match=f"no draft model with method {NAME} "
                       f"\\({NAME} drafts without a model;"):
        SpecConfig(method=NAME, draft_model="x")
    with pytest.raises(ConfigError, match=f"an integer in \\[1, 32\\] with method {NAME}"):
        SpecConfig(method=NAME, num_speculative_tokens=0)
    (label, spec), = parse_configs(f"{NAME}:k=4")
    assert label == f"{NAME}:k=4" and spec.method == NAME and spec.num_speculative_tokens == 4
    with pytest.raises(ValueError, match="expected method\\[:k=N\\]$"):
        parse_configs(f"{NAME}:min=2")
    result = CliRunner().invoke(main, ["run", "x.jsonl", "--method", "nope"])
    assert result.exit_code == 2 and f"'{NAME}'" in result.output, result.output


def test_register_method_refuses_what_it_cannot_honour(repeat_method):
    build = repeat_method.build
    with pytest.raises(ValueError, match="already registered"):
        register_method(Method(NAME, build))
    with pytest.raises(ValueError, match="'other': auto=True needs a candidate builder"):
        register_method(Method("other", build, auto=True))
    with pytest.raises(ValueError, match="lowercase letters"):
        register_method(Method("a:b", build))
    with pytest.raises(ValueError, match="draft_model 'maybe'"):
        register_method(Method("other", build, draft_model="maybe"))
    assert "other" not in methods.names()


def test_the_built_in_entries():
    """The five built-in methods, in the order ``--method``'s errors list them, and what each
    entry says (auto chooses among ngram, suffix and draft; suffix and auto re-index on resume;
    only ngram's stats are self-checked by the what-if replay)."""
    assert methods.names()[:5] == ("none", "ngram", "draft", "auto", "suffix")
    assert [m for m in methods.names() if methods.get(m).auto] == ["ngram", "draft", "suffix"]
    assert [m for m in methods.names() if methods.get(m).resume] == ["auto", "suffix"]
    assert [m for m in methods.names() if methods.get(m).whatif_self_check] == ["ngram"]
    assert [m for m in methods.names() if methods.get(m).whatif_note] == ["auto", "suffix"]
    assert [m for m in methods.names() if methods.uses_draft_model(m)] == ["draft", "auto"]
    assert SpecConfig(method="suffix", num_speculative_tokens=5).draft_cap == 15
    assert SpecConfig(method="auto", num_speculative_tokens=12).draft_cap == 32
    assert SpecConfig(method="none", num_speculative_tokens=5).k == 0
    with pytest.raises(ConfigError, match=r"no draft model with method ngram \(prompt lookup "
                       "drafts; use method draft or auto"):
        SpecConfig(method="ngram", draft_model="x")
    with pytest.raises(ConfigError, match="method draft needs a draft model"):
        SpecConfig(method="draft")
