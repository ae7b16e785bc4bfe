"""The command line's own behaviour: usage errors are one ``error:`` line, a hint, exit 2."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from specbatch.cli import main


# message: our own text, exact; or a tuple of what we put into click's sentence (the flag, the
# value, our range), since click's wording ("Invalid value for ...") may change between releases.
@pytest.mark.parametrize("args, message, command", [
    (["run", "in.jsonl", "--bogus"], "error: no such option: --bogus.", "main run"),
    # the closest flag only (click's own list added --seed and --threads)
    (["run", "in.jsonl", "--methd", "auto"],
     "error: no such option: --methd. Did you mean --method?", "main run"),
    (["run", "in.jsonl", "--k", "99"], ("'--k'", "99", "32"), "main run"),
    (["run"], ("INPUT",), "main run"),
    (["run", "in.jsonl", "--template", "{x}", "--prompt-field", "p"],
     "error: --template and --prompt-field exclude each other", "main run"),
    (["run", "in.jsonl", "--seed", "123456789012345678901234567890"],
     ("'--seed'", "123456789012345678901234567890", "2**64 - 1"), "main run"),
    (["run", "in.jsonl", "--seed", "x1"], ("'--seed'", "'x1' is not an integer"), "main run"),
    (["run", "in.jsonl", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"],
     "error: --prompt-lookup-max=2: expected an integer >= --prompt-lookup-min", "main run"),
    (["bench", __file__, "--configs", "auto:draft"],  # checked before INPUT is read
     "error: config 'auto:draft' needs --draft-model", "main bench"),
    (["run", "in.jsonl", "--stop", "END", "--stop", ""],
     "error: --stop '': expected a non-empty string", "main run"),
    (["bench", __file__, "--stop", ""], "error: --stop '': expected a non-empty string",
     "main bench"),
    (["run", "in.jsonl", "--method", "draft"],
     "error: method draft needs a draft model (--draft-model NAME)", "main run"),
    (["frob"], ("frob",), "main"),
    (["analyze", "a.jsonl", "--batch-size", "0"], ("'--batch-size'", "0"), "main analyze"),
])
def test_usage_errors_are_one_line_and_a_hint(args, message, command):
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    lines = result.output.splitlines()
    assert len(lines) == 2 and lines[1] == f"try '{command} --help'", result.output
    if isinstance(message, str):
        assert lines[0] == message
    else:
        assert lines[0].startswith("error: ") and all(m in lines[0] for m in message), lines[0]


def test_seed_help_names_its_range_in_words():
    """``--seed``'s help says "64-bit", not IntRange's two 20-digit ends, which wrapped the
    line; the extremes are seeds."""
    out = CliRunner().invoke(main, ["run", "--help"], terminal_width=80).output
    block = out[out.index("--seed"):out.index("--stop")]
    assert "64-bit integer" in block and "9223372036854775808" not in block
    for seed in ("-9223372036854775808", "18446744073709551615"):
        result = CliRunner().invoke(main, ["run", "nosuch.jsonl", "--seed", seed])
        assert "--seed" not in result.output and "nosuch.jsonl" in result.output, result.output


def test_no_command_still_prints_the_help():
    result = CliRunner().invoke(main, [])
    assert "Offline batch text generation" in result.output and "error:" not in result.output


def test_version_is_the_installed_package_version():
    from importlib.metadata import version

    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"specbatch {version('specbatch')}\n"


def test_dunder_version_agrees_with_dash_dash_version():
    """``specbatch.__version__`` is the package version ``specbatch --version`` prints (issue
    36), installed or not (then the checkout's pyproject version, which --version marks)."""
    import importlib.metadata
    import re
    from pathlib import Path

    import specbatch
    from specbatch._version import package_version

    printed = CliRunner().invoke(main, ["--version"]).output
    assert printed == f"specbatch {specbatch.__version__}" + (
        "" if package_version()[1] else " (not installed)") + "\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", specbatch.__version__)
    pyproject = Path(specbatch.__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.exists():  # a checkout (editable install): the same number as pyproject's
        assert specbatch.__version__ == re.search(r'^version = "([^"]+)"', pyproject.read_text(),
                                                  re.M).group(1)
    else:
        assert specbatch.__version__ == importlib.metadata.version("specbatch")


def test_python_dash_m_runs_the_same_command_line():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "specbatch", "run"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Missing argument 'INPUT'" in proc.stderr and "specbatch run --help" in proc.stderr


def test_version_of_a_checkout_that_is_not_installed(monkeypatch):
    """Run without installing, the version is the checkout's pyproject's, marked (unknown when
    the package does not sit in a checkout)."""
    import importlib.metadata
    import re
    from pathlib import Path

    from specbatch.cli import _version

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    import specbatch

    pyproject = Path(specbatch.__file__).resolve().parents[1] / "pyproject.toml"
    if not pyproject.exists():  # a non-editable install: no checkout beside the package
        assert _version() == "unknown (not installed)"
        return
    expected = re.search(r'^version = "([^"]+)"', pyproject.read_text(), re.M).group(1)
    assert _version() == f"{expected} (not installed)"


def test_skipped_records_are_warnings_failing_ones_errors(tmp_path, tiny_gguf):
    """``--on-error skip`` runs the good records: the bad ones are ``warning:`` lines; with
    ``--on-error fail`` the same records stop the run and are ``error:`` lines."""
    model = tiny_gguf
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc abc"}\n{"id": 2}\n{"id": 3, "prompt": "x"}\n')
    common = ["run", str(inp), "--model", str(model), "--cache-dir", str(tmp_path / "c"),
              "--method", "none", "--max-tokens", "2", "--no-progress"]
    bad = f"{inp}:2: no prompt"
    skip = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "s.jsonl"),
                                     "--on-error", "skip"])
    assert skip.exit_code == 0, skip.output
    assert f"warning: {bad}" in skip.output and "error:" not in skip.output
    # said before the model loads (seconds to minutes), not after it (issue 36)
    assert skip.output.index(f"warning: {bad}") < skip.output.index("loading model ")
    assert skip.output.count(f"warning: {bad}") == 1
    assert f"skipping 1 bad record(s); listed in {tmp_path / 's.jsonl'}.errors.jsonl" in (
        skip.output)
    fail = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "f.jsonl")])
    assert fail.exit_code == 2
    assert f"error: {bad}" in fail.output and "warning:" not in fail.output
    # -o naming the input: that one line first and alone, not the records' errors before it
    # (a fresh user saw them first)
    same = CliRunner().invoke(main, [*common, "-o", str(inp)])
    assert same.exit_code == 2
    assert same.output.strip().splitlines() == [
        f"error: output {str(inp)!r} is the input file; choose another -o"], same.output


def test_summary_table_tells_zero_acceptance_from_no_drafts():
    from specbatch.commands.run import summary_table

    def out(drafts, accepted, tokens):
        return {"spec": {"num_steps": tokens - accepted, "num_drafts": drafts,
                         "num_draft_tokens": 3 * drafts, "num_accepted_tokens": accepted},
                "usage": {"completion_tokens": tokens}}

    table = summary_table({"novel": [out(4, 0, 10)], "plain": [out(0, 0, 10)]})
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert rows["novel"][-2:] == ["1.00", "0.00"]  # drafted, nothing accepted
    assert rows["plain"][-2:] == ["-", "-"]  # nothing drafted


def test_records_that_stop_with_an_error_are_reported(tmp_path, tiny_gguf):
    """A later turn that no longer fits the context ends its record with an error: the record
    is written (finish_reason "error"), and the run says so instead of a silent success."""
    import json

    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "t", "turns": ["abc", "x" * 40]}) + "\n"
                   + json.dumps({"id": "ok", "prompt": "hello"}) + "\n")
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(model),
                                       "--cache-dir", str(tmp_path / "c"), "--method", "none",
                                       "--max-tokens", "8", "--ignore-eos", "--no-progress",
                                       "--max-model-len", "40"])
    assert result.exit_code == 0, result.output
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["t"]["finish_reason"][-1] == "error" and "context" in rows["t"]["error"]
    assert f"warning: {src}:1: id='t': prompt is" in result.output, result.output
    assert "1 record(s) stopped with an error" in result.output
    assert "error" not in rows["ok"] and rows["ok"]["finish_reason"] == "length"
    # usage counts the prompts actually fed: the first turn's, not the later one that was refused
    usage = rows["t"]["usage"]
    assert usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= 40, usage


def test_skip_with_every_record_refused_by_the_model_is_an_error(tmp_path, tiny_gguf):
    """--on-error skip where the model can run none of the records (a prompt longer than the
    context, checked once the model is loaded): nothing to run, exit 2, no empty output; one
    bad record is its one line (no "no valid records" line after it)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "long", "prompt": "' + "x " * 60 + '"}\n')
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(tiny_gguf),
                                       "--cache-dir", str(tmp_path / "c"), "--method", "none",
                                       "--max-model-len", "40", "--on-error", "skip",
                                       "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1].startswith(f"error: {src}:1: id='long': prompt is")
    assert "no valid records" not in result.stderr, result.stderr
    assert not out.exists() and "wrote" not in result.stdout
    # with a line the input check refused too: that one is said once (a warning, before the
    # load), the model's refusal after it, then that nothing is left to run
    src.write_text('{"id": "bad", "promt": "hi"}\n' + src.read_text())
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(tiny_gguf),
                                       "--cache-dir", str(tmp_path / "c"), "--method", "none",
                                       "--max-model-len", "40", "--on-error", "skip",
                                       "--no-progress"])
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith(("warning: ", "error: "))]
    # (other warnings may come between, e.g. a memory note on a busy machine)
    said = [ln for ln in lines if f"{src}:" in ln]
    assert [ln.split(":")[0] for ln in said] == ["warning", "error"], "\n".join(lines)
    assert f"{src}:1: id='bad'" in said[0]
    assert said[1].startswith(f"error: {src}:2: id='long': prompt is")
    assert lines[-1] == "error: no valid records; nothing to run."
    assert not out.exists()


def test_skipped_records_are_listed_in_file_order(tmp_path, tiny_gguf):
    """OUT.errors.jsonl lists the skipped records by line, those the model refused (checked
    after the load) among those the input check refused (before it); it listed line 3 before
    line 1 (fresh-user trial)."""
    import json

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "long", "prompt": "' + "x " * 60 + '"}\n{"id": "ok", "prompt": "Hi"}\n'
                   '{"id": "bad", "promt": "hi"}\n')
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(tiny_gguf),
                                       "--cache-dir", str(tmp_path / "c"), "--method", "none",
                                       "--max-model-len", "40", "--max-tokens", "2",
                                       "--on-error", "skip", "--no-progress"])
    assert result.exit_code == 0, result.output
    listed = [json.loads(line) for line in
              (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines()]
    assert [e["id"] for e in listed] == ["long", "bad"], listed


def test_resume_with_changed_options_is_refused_before_the_model_loads(tmp_path, tiny_gguf):
    """A work file left by a killed run, rerun with another --k: refused in one line, exit 2,
    without loading the model first (it could take minutes)."""
    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hello"}\n')
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "-o", str(out), "--model", str(model), "--cache-dir",
            str(tmp_path / "c"), "--method", "ngram", "--max-tokens", "4", "--no-progress"]
    assert CliRunner().invoke(main, args + ["--k", "5"]).exit_code == 0
    out.unlink()  # as if killed before the end: the config and a work file remain
    (tmp_path / "out.jsonl.work.jsonl").write_text("")
    result = CliRunner().invoke(main, args + ["--k", "3"])
    assert result.exit_code == 2, result.output
    assert "differs in: k; rerun with the same options" in result.stderr, result.stderr
    assert "loading model" not in result.output
    assert CliRunner().invoke(main, args + ["--k", "5"]).exit_code == 0  # same options: resumes


def test_summary_after_a_resume_covers_the_whole_job(tmp_path, tiny_gguf):
    """Killed after one of three records, then resumed: the summary table counts all three
    records, the ``wrote`` line the new tokens only."""
    import json

    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"id": {i}, "prompt": "hello {i}", "category": "qa"}}\n'
                           for i in range(3)))
    out = tmp_path / "out.jsonl"
    args = ["run", str(src), "-o", str(out), "--model", str(model), "--cache-dir",
            str(tmp_path / "c"), "--method", "ngram", "--max-tokens", "4", "--ignore-eos",
            "--no-progress"]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    whole = first.stdout.splitlines()[2].split()
    assert whole[:3] == ["qa", "3", "12"], first.stdout
    lines = out.read_text().splitlines()
    out.unlink()  # as if killed after the first record
    (tmp_path / "out.jsonl.work.jsonl").write_text(
        json.dumps({"index": 0, "record": json.loads(lines[0])}) + "\n")
    resumed = CliRunner().invoke(main, args)
    assert resumed.exit_code == 0, resumed.output
    assert "(8 new output tokens" in resumed.stdout, resumed.stdout
    assert resumed.stdout.splitlines()[2].split() == whole, resumed.stdout


def test_result_goes_to_stdout_progress_and_warnings_to_stderr(tmp_path, tiny_gguf):
    """``specbatch run ... > log`` keeps the result: the ``wrote`` line, the summary table and
    the memory line; a skipped record's warning stays on stderr."""
    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "hello", "category": "qa"}\n{"id": 2}\n')
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(model),
                                       "--cache-dir", str(tmp_path / "c"), "--method", "ngram",
                                       "--max-tokens", "4", "--on-error", "skip"])
    assert result.exit_code == 0, result.output
    stdout = result.stdout.splitlines()
    assert stdout[0].startswith(f"wrote 1 record to {out} ("), result.stdout
    assert stdout[1].split()[:3] == ["category", "records", "out"], result.stdout
    assert stdout[2].split()[:2] == ["qa", "1"] and stdout[3].startswith("memory: ")
    assert len(stdout) == 4, result.stdout
    assert f"warning: {src}:2: no prompt" in result.stderr
    assert "warning" not in result.stdout and "wrote" not in result.stderr
    assert "1/1" in result.stderr  # the progress bar


def _fresh_cli(args: list[str], cwd) -> tuple[int, bool, str]:
    """Run ``specbatch ARGS`` in a fresh interpreter: (exit status, whether torch got imported,
    stderr)."""
    code, torch_imported, stderr, _ = _fresh_cli_timed(args, cwd)
    return code, torch_imported, stderr


def _fresh_cli_timed(args: list[str], cwd) -> tuple[int, bool, str, float]:
    """``_fresh_cli`` and the seconds ``main`` took (after ``specbatch.cli`` was imported)."""
    import subprocess
    import sys

    script = ("import sys, time\nfrom specbatch.cli import main\nt0 = time.perf_counter()\n"
              "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
              "print(code, 'torch' in sys.modules, time.perf_counter() - t0)\n")
    proc = subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    code, torch_imported, seconds = proc.stdout.split()[-3:]
    return int(code), torch_imported == "True", proc.stderr, float(seconds)


def test_an_unknown_model_is_one_line_before_torch_is_imported(tmp_path):
    """An unknown ``--model`` / ``--draft-model`` used to be reported after importing torch and
    the model code (28 s on a loaded machine): now at once, exit 2, one line naming it. A
    model that exists (a .gguf path, the packaged default) passes the check."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    unknown = ("not a registry name (known: qwen2.5-coder-0.5b, qwen2.5-coder-1.5b, "
               "smollm2-135m; default smollm2-135m; or dummy:SHAPE[:SEED], seeded random weights) "
               "and no such .gguf file or model folder")
    cases = [
        (["run", str(src), "--model", "no-such-model"],
         f"error: unknown model 'no-such-model': {unknown}"),
        (["run", str(src), "--method", "draft", "--draft-model", "nope"],
         f"error: draft model 'nope': unknown model 'nope': {unknown}"),
        (["run", str(src), "--model", str(src)],
         f"error: --model {str(src)!r} is a file but not a .gguf file"),
        (["bench", str(src), "--model", "no-such-model"],
         f"error: unknown model 'no-such-model': {unknown}"),
        (["calibrate", "--model", "no-such-model"],
         f"error: unknown model 'no-such-model': {unknown}"),
    ]
    for args, message in cases:
        code, torch_imported, stderr, seconds = _fresh_cli_timed(args, tmp_path)
        assert code == 2 and stderr.splitlines() == [message], (args, stderr)
        assert not torch_imported, args
        assert seconds < 5, (args, seconds)  # milliseconds; importing torch takes seconds
    # a model that exists is not refused by the check: the run goes on to the output check
    (tmp_path / "m.gguf").write_bytes(b"")
    done = tmp_path / "done.jsonl"
    done.write_text('{"prompt": "hi", "output": "x"}\n')
    code, _, stderr = _fresh_cli(["run", str(src), "-o", str(done), "--model",
                                  str(tmp_path / "m.gguf")], tmp_path)
    assert code == 2 and stderr.splitlines() == [
        f"error: {done} exists from a finished run; --force to overwrite"], stderr


def test_errors_that_need_no_model_come_before_torch_is_imported(tmp_path):
    """Importing torch and transformers takes 6-9 s: a wrong flag combination or a finished
    output is reported before that (they came after loading the model)."""
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "hi"}\n')
    done = tmp_path / "done.jsonl"
    done.write_text('{"prompt": "hi", "output": "x"}\n')  # a finished run: no work file
    cases = [
        (["run", str(src), "--plan-only", "--method", "none"],
         "error: --plan-only needs --method auto (got --method none)"),
        (["run", str(src), "-o", str(done)],
         f"error: {done} exists from a finished run; --force to overwrite"),
        (["run", str(src), "--method", "ngram", "--draft-model", "smollm2-135m"],
         "error: --draft-model='smollm2-135m': expected no draft model with method ngram "
         "(prompt lookup drafts; use method draft or auto to draft with a model)"),
        (["bench", str(src), "--configs", "none,auto:k=3:k=4"],
         "error: config 'auto:k=3:k=4': k given twice"),
        (["bench", str(src), "--configs", "none,ngram:k=5", "--draft-model", "x"],
         "error: --draft-model is used by no configuration (draft:k=N or auto:draft)"),
    ]
    for args, message in cases:
        code, torch_imported, stderr = _fresh_cli(args, tmp_path)
        assert code == 2 and stderr.splitlines()[0] == message, (args, stderr)
        assert not torch_imported, args
    assert done.read_text() == '{"prompt": "hi", "output": "x"}\n'


def test_every_option_has_a_help_text():
    import click

    missing = []

    def walk(command, path):
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden and not param.help:
                missing.append(f"{path} {param.opts[-1]}")
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, f"{path} {name}")

    walk(main, "specbatch")
    assert not missing, missing


def test_auto_device_skips_importing_torch_only_where_torch_sees_no_gpu():
    """``--device auto`` decides "cpu" from the absence of GPU device files, without importing
    torch; where that shortcut is taken, torch must agree."""
    import torch

    from specbatch.config import _surely_no_gpu

    if _surely_no_gpu():
        assert not torch.cuda.is_available()
    if torch.cuda.is_available():
        assert not _surely_no_gpu()


def test_sampled_records_without_id_or_seed_are_warned_about_once(tmp_path, monkeypatch, tiny_gguf):
    """Their seed derives from the line number: reordering the file changes their output. And
    records asking for n > 1 greedy samples are told that those are identical."""
    from specbatch import cpu_threads

    monkeypatch.setattr(cpu_threads, "other_load", lambda: 0.0)  # no busy-machine warning

    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"id": 3, "prompt": "c"}\n'
                   '{"prompt": "d", "seed": 4}\n{"prompt": "e", "temperature": 0}\n')
    common = ["run", str(src), "--model", str(model), "--cache-dir", str(tmp_path / "c"),
              "--method", "none", "--max-tokens", "2", "--no-progress"]
    result = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "t.jsonl"),
                                       "--temperature", "0.7"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: 2 record(s) sample at temperature > 0 with no id and no seed (line 1, 2): "
        "their seed derives from the line number, so their output changes if their place in "
        "the file changes; give each an id or a seed"], result.output
    greedy = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "g.jsonl")])
    assert greedy.exit_code == 0 and "warning:" not in greedy.output, greedy.output
    # several greedy samples are one sample n times: said once (a fresh user read 3 equal ones)
    same = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "n.jsonl"), "--n", "2"])
    assert same.exit_code == 0, same.output
    assert [line for line in same.output.splitlines() if line.startswith("warning:")] == [
        "warning: 5 record(s) ask for n > 1 samples at temperature 0 (line 1, 2, 3, ...): "
        "greedy samples are identical; set a temperature > 0 for different ones"], same.output


def test_limit_never_hides_a_bad_record_it_did_not_cut(tmp_path):
    """``--limit 100`` on a file with 1 valid and 2 bad records: the limit cuts nothing, so both
    bad lines are errors (exit 2, nothing generated). It used to drop every error after the last
    valid record and write 1 record with exit 0 (found by a fresh user). A limit that does cut
    the file still ignores the bad lines after the cut."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "ok", "prompt": "Say hi"}\n'
                   '{"id": "typo", "prompt": "Say hi", "temprature": 0.5}\n'
                   '{"id": "broken", "prompt": "x"\n')
    result = CliRunner().invoke(main, ["run", str(inp), "--limit", "100", "--max-tokens", "2",
                                       "--method", "none", "-o", str(tmp_path / "o.jsonl")])
    assert result.exit_code == 2, result.output
    assert f"{inp}:2:" in result.output and f"{inp}:3:" in result.output
    assert not (tmp_path / "o.jsonl").exists()
    from types import SimpleNamespace

    from specbatch.config import SamplingParams
    from specbatch.commands.run import load_records

    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c", "temprature": 1}\n')
    opts = SimpleNamespace(input_path=str(two), prompt_field=None, id_field=None, split=None,
                           sampling=SamplingParams(), template=None, limit=2)
    records, errors = load_records(opts)
    assert len(records) == 2 and errors == []  # line 3 is past the cut


def test_busy_machine_warning(monkeypatch):
    """Other work runnable on at least half the usable CPUs while OpenMP threads spin: one
    line saying why it matters (spin-waiting OpenMP threads) and what helps; nothing on a
    quieter machine, where the OS says nothing of its load, or with threads that wait passively
    (the ``cpu:`` line says that). The measure is the one the wait-policy choice uses, so the
    two never disagree (the 1-minute average counted the job run just before)."""
    import os

    from specbatch import cpu_threads
    from specbatch.commands.run import busy_machine_warning

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))  # not what counts
    monkeypatch.setattr(cpu_threads, "other_load", lambda: 0.0)
    assert busy_machine_warning() is None
    monkeypatch.setattr(cpu_threads, "other_load", lambda: 1.0)
    assert busy_machine_warning() == (
        "the machine is busy (other work holds 1.0 of the 2 usable CPU(s)): OpenMP threads "
        "spin-wait, so several jobs on the same cores slow each other a lot; run one job at a "
        "time, or set OMP_WAIT_POLICY=PASSIVE")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # threads wait passively: no spinning
    assert busy_machine_warning() is None
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setattr(cpu_threads, "other_load", lambda: None)  # the OS says nothing
    assert busy_machine_warning() is None


def test_run_and_bench_warn_once_on_a_busy_machine(tmp_path, monkeypatch, tiny_gguf):
    """The warning goes to the ``specbatch`` logger, shown as one ``warning:`` line on stderr
    before ``loading model ...``."""
    from specbatch import cpu_threads

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    # torch is loaded already (in process), so the threads keep spinning beside 64 others
    monkeypatch.setattr(cpu_threads, "other_load", lambda: 64.0)
    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n')
    common = ["--model", str(model), "--cache-dir", str(tmp_path / "c"), "--max-tokens", "2"]
    for args in (["run", str(src), "-o", str(tmp_path / "o.jsonl"), "--method", "none",
                  "--no-progress", *common],
                 ["bench", str(src), "--configs", "none", *common]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        lines = result.output.splitlines()
        busy = [i for i, line in enumerate(lines)
                if line.startswith("warning: the machine is busy (other work holds all")]
        loading = [i for i, line in enumerate(lines) if line.startswith("loading model")]
        assert len(busy) == 1 and busy[0] < loading[0], result.output


def test_a_swallowed_sigterm_still_stops_the_run_at_the_next_record(tmp_path, monkeypatch,
                                                                   tiny_gguf):
    """Python drops an exception raised inside a weakref callback, so the KeyboardInterrupt of
    the SIGTERM handler can be lost; the recorded signal then stops the run after the next
    finished record: exit 130, that record kept, the rest left for ``--resume``."""
    import json
    import signal

    import specbatch.pipeline as pipeline
    import specbatch.commands.run as run_mod
    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "prompt": f"hello {i}"}) + "\n"
                           for i in range(4)))
    out = tmp_path / "out.jsonl"
    add = pipeline.Throughput.add

    def add_then_signal(self, n, stats):  # as if the handler ran and its exception was lost
        run_mod.request_stop(signal.SIGTERM)
        return add(self, n, stats)

    monkeypatch.setattr(pipeline.Throughput, "add", add_then_signal)
    sigterm = signal.getsignal(signal.SIGTERM)  # ``run`` installs its own
    try:
        result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                           str(model), "--cache-dir", str(tmp_path / "c"),
                                           "--method", "none", "--max-tokens", "4",
                                           "--max-batch-size", "1", "--no-progress"])
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert result.exit_code == 130, result.output
    work = tmp_path / "out.jsonl.work.jsonl"
    assert not out.exists() and len(work.read_text().splitlines()) == 1


def test_prefix_caching_is_reported_and_no_prefix_caching_turns_it_off(tmp_path, tiny_gguf):
    """Two prompts sharing their first words at batch 1: the memory line says how many prompt
    tokens the second found in the row; --no-prefix-caching prefills both whole and the
    outputs are the same."""
    import json

    model = tiny_gguf
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "the same long instruction, then one"}\n'
                   '{"id": 2, "prompt": "the same long instruction, then two"}\n')
    outs, lines = [], []
    for extra in ([], ["--no-prefix-caching"]):
        out = tmp_path / f"out{len(extra)}.jsonl"
        result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model",
                                           str(model), "--cache-dir", str(tmp_path / "c"),
                                           "--method", "ngram", "--max-tokens", "4",
                                           "--max-batch-size", "1", "--dtype", "float32",
                                           *extra])
        assert result.exit_code == 0, result.output
        lines.append(result.stdout.splitlines()[-1])
        outs.append([json.loads(x)["output_token_ids"] for x in out.read_text().splitlines()])
    assert outs[0] == outs[1]
    assert lines[0].startswith("memory: ") and "; prefix caching: " in lines[0], lines[0]
    reused, total = lines[0].split("; prefix caching: ")[1].split(" prompt tokens")[0].split(" of ")
    assert 0 < int(reused) < int(total)
    assert lines[1].startswith("memory: ") and "prefix caching" not in lines[1]


def test_predict_eval_reads_a_template_job_as_run_read_it(tmp_path, tiny_gguf):
    """``predict-eval`` on the output of a ``--template`` job: the records have no prompt
    field, only the template's fields; it renders them with the run's template (from the
    config beside OUT), as ``analyze`` does, instead of finding no record to score."""
    import json

    model = tiny_gguf
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "text": f"abc abc abc {i} abc abc"}) + "\n"
                           for i in range(4)))
    out = tmp_path / "out.jsonl"
    common = ["--model", str(model), "--cache-dir", str(tmp_path / "c")]
    ran = CliRunner().invoke(main, ["run", str(inp), "-o", str(out), "--template",
                                    "Repeat: {text}", "--method", "ngram", "--k", "3",
                                    "--max-tokens", "24", "--no-progress", *common])
    assert ran.exit_code == 0, ran.output
    result = CliRunner().invoke(main, ["predict-eval", str(out), *common])
    assert result.exit_code == 0, result.output
    assert "from the prompt, before generation:" in result.output
    assert "(4 records, vs the whole answer)" in result.output
    assert "measured = prompt lookup replayed" not in result.output  # ngram: its own figures
    # a suffix run drafts past k from other sources: measured by replaying lookup at k instead
    # (the same outputs, so the same figures as the ngram run's at k = 3)
    sfx = tmp_path / "sfx.jsonl"
    ran = CliRunner().invoke(main, ["run", str(inp), "-o", str(sfx), "--template",
                                    "Repeat: {text}", "--method", "suffix", "--k", "3",
                                    "--max-tokens", "24", "--no-progress", *common])
    assert ran.exit_code == 0, ran.output
    replay = CliRunner().invoke(main, ["predict-eval", str(sfx), "--k", "3", *common])
    assert replay.exit_code == 0, replay.output
    assert f"{sfx} (method suffix): measured = prompt lookup replayed at k=3" in replay.output
    table = lambda text: text[text.index("category"):]  # noqa: E731
    again = CliRunner().invoke(main, ["predict-eval", str(out), "--k", "3", *common])
    assert table(replay.output) == table(again.output)


def test_calibrate_to_an_unwritable_path_is_one_line(tmp_path, tiny_gguf):
    """``calibrate -o`` where the file cannot be written (a file where its folder should be):
    one ``error:`` line naming the path and exit 2, before loading and measuring (~20 s on
    the real model), not a traceback after them."""
    blocker = tmp_path / "ro.json"
    blocker.write_text("{}")
    result = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_gguf), "--cache-dir",
                                       str(tmp_path / "c"), "-o", str(blocker / "x.json")])
    assert result.exit_code == 2, result.output
    assert f"error: cannot write {str(blocker / 'x.json')!r}: {str(blocker)!r} is a file, " \
        "not a folder" in result.output
    assert "Traceback" not in result.output
    assert "loading model" not in result.output and "calibrating" not in result.output
    # a new folder is created; the fit reads back and no PATH.tmp is left beside it
    from specbatch.auto.costmodel import load

    good = tmp_path / "new" / "cost.json"
    own = good.with_name("cost.json.tmp")  # a file of the user's beside it is left alone
    own.parent.mkdir()
    own.write_text("keep")
    result = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_gguf), "--cache-dir",
                                       str(tmp_path / "c"), "-o", str(good)])
    assert result.exit_code == 0, result.output
    assert load(good).samples and own.read_text() == "keep"
    assert sorted(p.name for p in good.parent.iterdir()) == ["cost.json", "cost.json.tmp"]
    empty = CliRunner().invoke(main, ["calibrate", "--model", str(tiny_gguf), "-o", ""])
    assert empty.exit_code == 2 and "error: cannot write '': an empty path" in empty.output


def test_a_run_holds_its_output_lock_while_its_model_loads(tmp_path, monkeypatch, tiny_gguf):
    """Two runs started on one ``-o`` together: the second is refused before its model loads,
    because the first holds OUT.lock from before its own load (it took it when its writer
    opened, after the load, so both loaded first); a run that ends before writing (here its
    model fails to load) leaves neither the lock file nor the folder it made."""
    from specbatch import llm as llm_mod
    from specbatch.io.writer import OutLock

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n')
    out = tmp_path / "new" / "o.jsonl"
    seen = []

    def loading(cls, *args, **kwargs):
        with pytest.raises(ValueError, match="is being written by another specbatch run"):
            OutLock(out)  # a second run starting now
        seen.append(out.with_name("o.jsonl.lock").read_text().strip())
        raise llm_mod.ModelLoadError("no model here")

    monkeypatch.setattr(llm_mod.LLM, "from_config", classmethod(loading))
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(tiny_gguf),
                                       "--cache-dir", str(tmp_path / "c"), "--no-progress"])
    assert result.exit_code == 2 and "error: no model here" in result.output, result.output
    assert seen == [str(os.getpid())]
    assert not (tmp_path / "new").exists()


def test_a_run_on_an_output_another_run_writes_is_refused_before_the_model_loads(
        tmp_path, monkeypatch, tiny_gguf):
    """One line, exit 2, before ``loading model`` (a fresh-user pass saw the model load first:
    minutes for a 1.5B model); the running job's files are left as they are."""
    from specbatch.io.writer import OutputWriter

    src = tmp_path / "in.jsonl"
    src.write_text('{"id": 1, "prompt": "a"}\n')
    out = tmp_path / "o.jsonl"
    running = OutputWriter(out, {"other": "run"}, resume=False, force=False, num_records=1)
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(tiny_gguf),
                                       "--cache-dir", str(tmp_path / "c"), "--max-tokens", "2",
                                       "--force", "--no-progress"])
    assert result.exit_code == 2, result.output
    assert "loading model" not in result.output
    assert result.output.strip().splitlines()[-1].startswith(
        f"error: {out} is being written by another specbatch run (process ")
    running.close()
    assert (tmp_path / "o.jsonl.config.json").read_text().strip() == '{\n  "other": "run"\n}'


def test_run_without_o_writes_the_input_stem_in_the_current_folder(tmp_path, monkeypatch,
                                                                   tiny_gguf):
    """``-o`` is optional: the output is INPUT's name up to its first dot + ``.out.jsonl`` in
    the current folder (not INPUT's), as ``run --help``, the README usage and docs/output.md
    say (a fresh user read ``-o`` in the README's usage as required)."""
    import json
    from pathlib import Path

    data = tmp_path / "data"
    data.mkdir()
    inp = data / "a.b.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc abc"}\n')
    cwd = tmp_path / "here"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    r = CliRunner().invoke(main, ["run", str(inp), "--model", str(tiny_gguf), "--cache-dir",
                                  str(tmp_path / "c"), "--method", "none", "--max-tokens", "2",
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    out = cwd / "a.out.jsonl"
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1]
    assert not (data / "a.out.jsonl").exists()
    help_text = " ".join(CliRunner().invoke(main, ["run", "--help"]).output.split())
    assert "default: INPUT stem + .out.jsonl in the current folder" in help_text
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    usage = next(line for line in readme.splitlines() if line.startswith("specbatch run "))
    assert usage.startswith("specbatch run INPUT|- [-o OUT.jsonl] "), usage


def test_skipped_lines_without_id_are_named_by_their_line_alike(tmp_path, tiny_gguf):
    """``--on-error skip``: an array line and an object without an id are both listed by their
    line number, in OUT.errors.jsonl (``id``) and on stderr (``id=N``); the array line was
    ``"id": null`` there (fresh-user pass)."""
    import json

    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc abc"}\n[1, 2]\n{"max_tokens": 3}\n')
    out = tmp_path / "o.jsonl"
    r = CliRunner().invoke(main, ["run", str(inp), "-o", str(out), "--model", str(tiny_gguf),
                                  "--cache-dir", str(tmp_path / "c"), "--method", "none",
                                  "--max-tokens", "2", "--no-progress", "--on-error", "skip"])
    assert r.exit_code == 0, r.output
    listed = [json.loads(line) for line in (tmp_path / "o.jsonl.errors.jsonl").read_text()
              .splitlines()]
    assert [(e["line"], e["id"]) for e in listed] == [(2, 2), (3, 3)]
    assert f"warning: {inp}:2: expected one JSON object per line, got an array" in r.output
    assert f"warning: {inp}:3: no prompt" in r.output
