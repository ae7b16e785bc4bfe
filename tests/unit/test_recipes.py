"""Recipes: loading and checking, flags over recipe over defaults, and templates.

The command-line tests call ``specbatch.cli.main`` with ``run_job`` replaced by a stub that
records the options it gets, so no model loads.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

import specbatch.commands.run
from specbatch.cli import main
from specbatch.io.records import read_records, template_fields
from specbatch.recipe import load_recipe, parse_recipe

RECIPES = Path(__file__).parents[2] / "recipes"

BASE = '''
name = "demo"
version = 3

[model]
dtype = "float32"
max_batch_size = 2

[speculation]
method = "ngram"
k = 3

[sampling]
temperature = 0.5
max_tokens = 7
stop = ["END"]
seed = 11

[input]
prompt_field = "q"
'''


def _write(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_recipes():
    spec_bench = load_recipe(RECIPES / "spec_bench.toml")
    assert (spec_bench.name, spec_bench.version) == ("spec_bench", 1)
    assert {k: spec_bench.options[k] for k in ("method", "k", "max_tokens", "prompt_field")} == \
        {"method": "ngram", "k": 5, "max_tokens": 128, "prompt_field": "turns"}
    code_edit = load_recipe(RECIPES / "code_edit.toml")
    assert code_edit.name == "code_edit"
    assert template_fields(code_edit.options["template"]) == ["instruction", "code"]
    records, errors = read_records(RECIPES / "prompts" / "code_edit.jsonl",
                                   template=code_edit.options["template"])
    assert errors == [] and len(records) >= 3
    for r in records:
        (message,) = r.messages
        assert message["role"] == "user"
        assert r.fields["instruction"] in message["content"]
        assert f"```\n{r.fields['code']}" in message["content"]


@pytest.mark.parametrize("text, message", [
    ('name = "x y"\nversion = 1', "name='x y'"),
    ('name = "x"', "version is missing (a recipe starts with name"),
    ('version = 1\n[model]\nname = "x"', "name is missing"),
    ('name = "x"\nversion = true', "version=True"),
    ('name = "x"\nversion = 1\nmodle = "a"', "unknown key 'modle'"),
    ('name = "x"\nversion = 1\n[sampling]\ntemprature = 1.0', "unknown key [sampling] "
     "'temprature' (did you mean 'temperature'?); expected one of temperature"),
    ('name = "x"\nversion = 1\nsamplng = 3', "unknown key 'samplng' (did you mean 'sampling'?)"),
    ('name = "x"\nversion = 1\n[speculation]\nk = 3\nnum_speculative_tokens = 4',
     "[speculation] k and num_speculative_tokens set the same value; keep one"),
    ('name = "x"\nversion = 1\n[speculation]\nnum_speculative_tokens = 99',
     "[speculation] k=99: expected an integer in [0, 32]"),
    ('name = "x"\nversion = 1\nsampling = 3', "sampling must be a table"),
    ('name = "x"\nversion = 1\n[sampling]\ntemperature = -1.0', "[sampling] temperature=-1.0"),
    ('name = "x"\nversion = 1\n[sampling]\nmax_tokens = "12"', 'max_tokens="12"'),
    ('name = "x"\nversion = 1\n[sampling]\nseed = 1.5', "seed=1.5"),
    ('name = "x"\nversion = 1\n[sampling]\nseed = 123456789012345678901234567890',
     "seed=123456789012345678901234567890: expected an integer that fits in 64 bits"),
    ('name = "x"\nversion = 1\n[sampling]\nstop = 5', "stop=5"),
    ('name = "x"\nversion = 1\n[speculation]\nk = 99', "[speculation] k=99: expected an "
     "integer in [0, 32]"),
    ('name = "x"\nversion = 1\n[speculation]\nmethod = "ngram"\nk = 0', "[speculation] k=0: "
     "expected an integer in [1, 32] with method ngram (0 drafts nothing: use method none)"),
    ('name = "x"\nversion = 1\n[model]\nname = ""', "[model] name='': expected a non-empty "
     "string"),
    ('name = "x"\nversion = 1\n[speculation]\nmethod = "magic"', "method='magic'"),
    ('name = "x"\nversion = 1\n[speculation]\nmethod = "draft"',
     "method draft needs a draft model"),
    ('name = "x"\nversion = 1\n[model]\ndtype = "int4"', "dtype='int4'"),
    ('name = "x"\nversion = 1\n[model]\nmax_batch_size = 0', "[model] max_batch_size=0"),
    ('name = "x"\nversion = 1\n[input]\ntemplate = "{code"', "template '{code'"),
    ('name = "x"\nversion = 1\n[input]\ntemplate = "no fields"', "uses no record field"),
    ('name = "x"\nversion = 1\n[input]\ntemplate = "{a}"\nprompt_field = "b"', "keep one"),
    ('name = "x"\nversion = 1\n[input]\nprompt_field = ""', "prompt_field=''"),
    ('name = "x"\nversion = 1\n[sampling\n', "invalid TOML"),
])
def test_bad_recipes_name_file_and_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_recipe(path)
    assert str(e.value).startswith(f"recipe {str(path)!r}: "), str(e.value)
    assert message in str(e.value)


def test_draft_model_recipe(tmp_path, captured):
    small = tmp_path / "small.gguf"  # the CLI checks that the draft model exists
    small.write_bytes(b"")
    path = _write(tmp_path, 'name = "d"\nversion = 1\n[speculation]\nmethod = "draft"\n'
                  f'draft_model = "{small}"\nk = 4')
    opts = _run(["--recipe", str(path), "in.jsonl"], captured)
    assert (opts.spec.method, opts.spec.draft_model, opts.spec.k) == ("draft", str(small), 4)


def test_missing_recipe_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_recipe(tmp_path / "nope.toml")


# ----- precedence: flags given > recipe > built-in defaults -----

@pytest.fixture
def captured(monkeypatch):
    seen = []

    def fake_run_job(opts):
        seen.append(opts)
        return 0

    monkeypatch.setattr(specbatch.commands.run, "run_job", fake_run_job)
    sigterm = signal.getsignal(signal.SIGTERM)  # ``run`` installs its own
    yield seen
    signal.signal(signal.SIGTERM, sigterm)


def _run(args: list[str], captured: list):
    result = CliRunner().invoke(main, ["run", *args])
    assert result.exit_code == 0, result.output
    return captured.pop()


def test_recipe_takes_num_speculative_tokens_for_k(tmp_path, captured):
    """The CLI takes --num-speculative-tokens as --k; a recipe refused the same name."""
    text = 'name = "x"\nversion = 1\n[speculation]\nmethod = "ngram"\nnum_speculative_tokens = 4\n'
    opts = _run(["--recipe", str(_write(tmp_path, text)), "in.jsonl"], captured)
    assert (opts.spec.method, opts.spec.k) == ("ngram", 4)


def test_recipe_values_apply(tmp_path, captured):
    opts = _run(["--recipe", str(_write(tmp_path, BASE)), "in.jsonl"], captured)
    assert (opts.spec.method, opts.spec.k) == ("ngram", 3)
    assert (opts.sampling.temperature, opts.sampling.max_tokens, opts.sampling.stop) == \
        (0.5, 7, ("END",))
    assert (opts.engine.dtype, opts.engine.max_batch_size) == ("float32", 2)
    assert (opts.run_seed, opts.prompt_field, opts.template) == (11, "q", None)
    assert opts.recipe == {"name": "demo", "version": 3}
    assert opts.spec.prompt_lookup_min == 2 and opts.sampling.top_p == 1.0  # defaults fill in


def test_flags_given_override_the_recipe(tmp_path, captured):
    recipe = str(_write(tmp_path, BASE))
    # --k 5 and --max-tokens 128 equal the built-in defaults: given, they still win
    opts = _run(["--k", "5", "--recipe", recipe, "in.jsonl", "--max-tokens", "128",
                 "--stop", "STOP", "--dtype", "bfloat16", "--seed", "0"], captured)
    assert (opts.spec.k, opts.sampling.max_tokens, opts.sampling.stop) == (5, 128, ("STOP",))
    assert (opts.engine.dtype, opts.run_seed) == ("bfloat16", 0)
    assert opts.sampling.temperature == 0.5 and opts.prompt_field == "q"  # not given: recipe
    assert opts.recipe == {"name": "demo", "version": 3}


def test_without_a_recipe_the_defaults(captured):
    opts = _run(["in.jsonl"], captured)
    assert (opts.spec.k, opts.sampling.max_tokens, opts.sampling.temperature) == (5, 128, 0.0)
    assert opts.recipe is None and opts.template is None


def test_template_and_prompt_field_the_given_one_wins(tmp_path, captured):
    with_template = _write(tmp_path, 'name = "t"\nversion = 1\n[input]\ntemplate = "{a}: {b}"')
    opts = _run(["--recipe", str(with_template), "in.jsonl"], captured)
    assert (opts.template, opts.prompt_field) == ("{a}: {b}", None)
    opts = _run(["--recipe", str(with_template), "in.jsonl", "--prompt-field", "p"], captured)
    assert (opts.template, opts.prompt_field) == (None, "p")
    with_field = str(_write(tmp_path, BASE, "f.toml"))
    opts = _run(["--recipe", with_field, "in.jsonl", "--template", "{x}"], captured)
    assert (opts.template, opts.prompt_field) == ("{x}", None)
    result = CliRunner().invoke(main, ["run", "in.jsonl", "--template", "{x}",
                                       "--prompt-field", "p"])
    assert result.exit_code == 2 and "exclude each other" in result.output


def test_bad_recipe_is_a_usage_error(tmp_path, captured):
    path = _write(tmp_path, 'name = "x"\nversion = 1\n[speculation]\nk = 99')
    result = CliRunner().invoke(main, ["run", "--recipe", str(path), "in.jsonl"])
    assert result.exit_code == 2 and not captured
    assert "'--recipe'" in result.output  # in click's words around it
    assert "[speculation] k=99" in result.output and "num_speculative" not in result.output


# ----- templates -----

def test_template_errors_are_per_record(tmp_path):
    rows = [{"id": "a", "instruction": "Fix it.", "code": "x = 1"},
            {"id": "b", "instruction": "Fix it."},
            {"id": "c", "instruction": "Fix it.", "code": None},
            {"id": "d", "instruction": ["not", "text"], "code": "y"},
            {"id": "e", "instruction": " ", "code": ""},
            {"id": "f", "instruction": "Count:", "code": 3}]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    records, errors = read_records(path, template="{instruction}\n{code}")
    assert [(r.id, r.messages[0]["content"]) for r in records] == [
        ("a", "Fix it.\nx = 1"), ("f", "Count:\n3")]
    assert [(e.line, e.id, e.reason) for e in errors] == [
        (2, "b", "template field 'code' is missing"),
        (3, "c", "template field 'code' is missing (null)"),
        (4, "d", "template field 'instruction' must be text or a number, got array"),
        (5, "e", "template renders an empty prompt")]


def test_template_errors_through_the_cli(tmp_path):
    """``--on-error fail`` stops before the model loads, naming the line and the field."""
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": 1, "instruction": "a", "code": "b"}\n{"id": 2, "instruction": "a"}\n')
    result = CliRunner().invoke(main, ["run", str(path), "-o", str(tmp_path / "o.jsonl"),
                                       "--recipe", str(RECIPES / "code_edit.toml")])
    assert result.exit_code == 2
    assert f"error: {path}:2: template field 'code' is missing" in result.output
    assert not (tmp_path / "o.jsonl.work.jsonl").exists()


@pytest.mark.parametrize("template", ["{", "}", "{}", "{0}", "{a.b}", "{a[0]}", "text only",
                                      "{a:{b}}"])
def test_malformed_templates(template):
    with pytest.raises(ValueError, match="template"):
        template_fields(template)


def test_recipe_json_schema_is_read_from_the_recipes_folder(tmp_path, captured, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    (folder / "s.json").write_text(json.dumps(schema))
    path = _write(folder, 'name = "x"\nversion = 1\n[sampling]\njson_schema = "s.json"\n')
    assert load_recipe(path).options["json_schema"] == str(folder / "s.json")
    monkeypatch.chdir(tmp_path)  # not the recipe's folder: the path must not depend on the cwd
    opts = _run(["--recipe", str(path), "in.jsonl"], captured)
    assert opts.sampling.response_format["json_schema"]["schema"] == schema
    with pytest.raises(ValueError, match=r"json_schema=3: expected a non-empty string"):
        parse_recipe({"name": "x", "version": 1, "sampling": {"json_schema": 3}})
    # a schema file that is not JSON: the error names the file, not --json-schema, a flag
    # the user never typed (fresh-user trial)
    (folder / "s.json").write_text("{not json")
    result = CliRunner().invoke(main, ["run", "--recipe", str(path), "in.jsonl"])
    assert result.exit_code == 2, result.output
    assert f"JSON schema {folder / 's.json'}: cannot read it: " in result.output, result.output
    assert "--json-schema" not in result.output
