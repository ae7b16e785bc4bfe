"""How the package is put together (issue 12, "Done when" 3): the engine is assembled in one
module (``specbatch.llm``), ``analyze`` on an output file imports no torch, the torch-free
stages stay torch-free, and ``SpecStats`` round-trips through the ``spec`` field.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from specbatch.spec_decode.stats import SpecStats

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "specbatch"


def test_engine_and_runner_are_built_in_llm_only():
    """No module but ``specbatch/llm.py`` calls ``ModelRunner(`` or ``Engine(`` (tests may)."""
    build = re.compile(r"(?<![\w.])(ModelRunner|Engine)\(")
    builders = sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py")
                      if any(build.search(line) and not line.lstrip().startswith(("class ", "#"))
                             for line in p.read_text().splitlines()))
    assert builders == ["specbatch/llm.py"], builders


def _spec(num_steps: int, accepted: int) -> dict:
    s = SpecStats(proposer="ngram", num_speculative_tokens=3)
    s.record_step(0, 0)
    for _ in range(num_steps - 1):
        s.record_step(3, accepted)
    return s.to_dict()


def _write_run(tmp_path: Path) -> Path:
    """An output file and its config as ``specbatch run`` writes them (no model needed)."""
    out = tmp_path / "out.jsonl"
    rows = [{"id": i, "category": cat, "prompt": f"p{i}", "output": "x y",
             "output_token_ids": [5, 6, 7], "finish_reason": "length", "stop_reason": None,
             "usage": {"prompt_tokens": 4, "completion_tokens": 3}, "spec": _spec(3, i % 3)}
            for i, cat in enumerate(["a", "b", "a"])]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = {"model": "m@sha256:0", "method": "ngram", "k": 3, "prompt_lookup_min": 2,
              "prompt_lookup_max": 4, "sampling": {"max_tokens": 3}, "max_model_len": 2048}
    (tmp_path / "out.jsonl.config.json").write_text(json.dumps(config))
    return out


def test_analyze_imports_no_torch(tmp_path):
    """``specbatch analyze OUT --by category --json`` in a fresh interpreter: the document is
    right (3 records, their drafted tokens) and ``torch`` never entered ``sys.modules``."""
    out = _write_run(tmp_path)
    script = (
        "import sys\n"
        "from specbatch.cli import main\n"
        "try:\n"
        f"    main(['analyze', {str(out)!r}, '--by', 'category', '--json'])\n"
        "except SystemExit as e:\n"
        "    assert e.code in (0, None), e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', file=sys.stderr)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "NO-TORCH"
    doc = json.loads(proc.stdout)
    (total,) = [row for row in doc["tables"]["category"] if row["group"] == "(all)"]
    assert (total["num_records"], total["num_draft_tokens"]) == (3, 18)  # 2 steps x 3 drafts
    assert total["num_accepted_tokens"] == 0 + 2 + 4  # records accept 0, 1, 2 per step
    a = [row for row in doc["tables"]["category"] if row["group"] == "a"]
    assert [row["num_records"] for row in a] == [2]


def test_torch_free_stages():
    """The API's import, records, prompts, outputs and the writer load no model code."""
    script = ("import sys\n"
              "import specbatch, specbatch.prompts, specbatch.outputs, specbatch.io.writer\n"
              "import specbatch.io.records, specbatch.commands.run, specbatch.commands.bench, specbatch.llm\n"
              "from specbatch import LLM, SamplingParams\n"
              "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_spec_stats_round_trip():
    d = _spec(5, 2)
    d["k_histogram"]["7"] = None  # parquet's struct: an absent key reads back as null
    s = SpecStats.from_dict(d)
    assert s.k_histogram == {0: 1, 3: 4}
    assert s.num_accepted_tokens_per_pos == [4, 4, 0]
    del d["k_histogram"]["7"]
    assert s.to_dict() == d


def test_every_method_has_one_registered_proposer():
    """``--method``'s choices, ``config.METHODS`` and the proposers built name the methods of
    the registry (``specbatch.methods``): a new proposer is one module plus one entry."""
    from click.testing import CliRunner

    from specbatch import methods
    from specbatch.cli import main
    from specbatch.config import METHODS, SpecConfig
    from specbatch.spec_decode import make_proposer

    assert METHODS == methods.names() == ("none", "ngram", "draft", "auto", "suffix")
    help_text = CliRunner().invoke(main, ["run", "--help"]).output
    assert "[auto|none|ngram|draft|suffix]" in help_text
    for method in set(METHODS) - {"draft"}:
        assert make_proposer(SpecConfig(method=method)).name == method


def test_kernels_install_under_specbatch_only():
    """pyproject.toml installs ``kernels/`` as ``specbatch.kernels`` and lists every package
    folder (an unlisted one would be left out of a wheel); nothing installs a top-level
    ``kernels`` module, so Hugging Face's kernel hub (the same import name) is not shadowed and
    transformers does not take us for it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setup["package-dir"] == {"specbatch.kernels": "kernels"}
    folders = {"specbatch" + "".join("." + part for part in p.parent.relative_to(PACKAGE).parts)
               for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts}
    assert set(setup["packages"]) == folders | {"specbatch.kernels"}
    import specbatch.kernels
    assert Path(specbatch.kernels.__file__).resolve() == REPO / "kernels" / "__init__.py"
    # outside the checkout (its root on sys.path would show kernels/ as a folder, not an install)
    src = ("import importlib.util, specbatch.kernels\n"
           "from transformers.utils.import_utils import _is_package_available\n"
           "print(importlib.util.find_spec('kernels'), _is_package_available('kernels')[0])")
    found = subprocess.run([sys.executable, "-c", src], capture_output=True, text=True,
                           cwd=REPO.parent, check=True).stdout.strip()
    assert found == "None False"


def test_a_script_beside_a_checkout_named_specbatch_imports_the_package(tmp_path):
    """Run from the folder that holds a checkout named ``specbatch`` (issue 36), a script's
    ``from specbatch import LLM`` gets the package (not the checkout folder as an empty
    namespace package: "cannot import name 'LLM'"), its submodules and ``python -m
    specbatch`` too."""
    import specbatch

    (tmp_path / "specbatch").symlink_to(REPO, target_is_directory=True)
    script = tmp_path / "job.py"
    script.write_text("import specbatch.llm\nfrom specbatch import LLM, SamplingParams\n"
                      "print(LLM.__module__, specbatch.llm.__file__, specbatch.__version__)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    module, path, version = proc.stdout.split()
    assert module == "specbatch.llm" and version == specbatch.__version__
    assert Path(path).resolve() == REPO / "specbatch" / "llm.py"
    proc = subprocess.run([sys.executable, "-m", "specbatch", "--version"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and specbatch.__version__ in proc.stdout, proc.stderr[-2000:]
