"""``specbatch run --ray`` (issue 12, "Done when" 2): a job split over replicas on a local Ray
cluster writes the bytes one process writes.

The fast test (in the default suite and CI, ~45 s here: ``--dtype auto``, int8 for the bundled
Q4_1 GGUF on an AVX2 CPU, the dtype every replica gets from the driver): 12
Spec-Bench records (short ones), ``--method ngram --k 5 --max-tokens 8``, 2 replicas vs one
process: byte-identical OUT and the same summary table. The
others take minutes on a 2-core machine (every replica loads the model; auto calibrates), so
they run only when asked (each command may take up to 30 minutes under load; auto calibrates
first):

    SPECBATCH_RAY_TESTS=1 python -m pytest -q tests/e2e/test_ray.py

- ``--method auto`` on 2 replicas: the same token ids as one process;
- a replica's process SIGKILLed mid-job, then the same command with ``--resume``: the same
  file as one process (the killed replica's finished records are taken from its work file).

Each ``specbatch run --ray`` starts its own local Ray (this machine's CPUs) and shuts it down.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import read_jsonl, run_cli, spec_bench_subset, specbatch_command

pytest.importorskip("ray", reason="Ray is an optional extra: pip install -e '.[ray]'")

# 12 records with short prompts from 8 categories (two of them two-turn records): on 2 busy
# cores the long summarization / rag prompts of test_main_job take minutes per run
QUESTION_IDS = [228, 202, 190, 375, 351, 366, 444, 455, 116, 152, 277, 125]
FULL = os.environ.get("SPECBATCH_RAY_TESTS") == "1"
_full = pytest.mark.skipif(not FULL, reason="minutes on 2 cores; run with "
                           "SPECBATCH_RAY_TESTS=1 python -m pytest tests/e2e/test_ray.py")


def full_only(test):
    """Slow, and run only with SPECBATCH_RAY_TESTS=1."""
    return pytest.mark.slow(_full(test))


@pytest.fixture(scope="module")
def inp(spec_bench, real_model, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ray")
    return spec_bench_subset(spec_bench, QUESTION_IDS, d / "subset.jsonl")


def _table(stderr: str) -> list[str]:
    """The summary table's lines (the per-category counts, not the timings)."""
    lines = stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("category"))
    return [ln for ln in lines[start:] if not ln.startswith("memory:")]


def test_two_replicas_write_the_bytes_of_one_process(inp, tmp_path):
    args = ["--method", "ngram", "--k", "5", "--max-tokens", "8", "--no-progress"]
    local = run_cli("run", str(inp), "-o", str(tmp_path / "local.jsonl"), *args, cwd=tmp_path)
    on_ray = run_cli("run", str(inp), "-o", str(tmp_path / "ray.jsonl"), *args, "--ray",
                     "--replicas", "2", cwd=tmp_path)
    data = (tmp_path / "ray.jsonl").read_bytes()
    assert data == (tmp_path / "local.jsonl").read_bytes()
    assert len(read_jsonl(tmp_path / "ray.jsonl")) == 12
    assert _table(on_ray) == _table(local)
    assert "wrote 12 records" in on_ray
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "local.jsonl", "local.jsonl.config.json", "ray.jsonl", "ray.jsonl.config.json"]


@full_only
def test_auto_on_two_replicas_gives_the_token_ids_of_one_process(inp, tmp_path):
    args = ["--method", "auto", "--k", "5", "--max-tokens", "24", "--no-progress"]
    run_cli("run", str(inp), "-o", str(tmp_path / "local.jsonl"), *args, cwd=tmp_path,
            timeout=1800)
    run_cli("run", str(inp), "-o", str(tmp_path / "ray.jsonl"), *args, "--ray", "--replicas",
            "2", cwd=tmp_path, timeout=1800)
    local, on_ray = read_jsonl(tmp_path / "local.jsonl"), read_jsonl(tmp_path / "ray.jsonl")
    assert [r["output_token_ids"] for r in on_ray] == [r["output_token_ids"] for r in local]
    assert [r["usage"] for r in on_ray] == [r["usage"] for r in local]
    assert all(r["spec"]["proposer"] for r in on_ray)


@full_only
def test_killed_replica_then_resume_gives_the_same_file(inp, tmp_path):
    args = ["--method", "ngram", "--k", "5", "--max-tokens", "32", "--no-progress"]
    run_cli("run", str(inp), "-o", str(tmp_path / "local.jsonl"), *args, cwd=tmp_path,
            timeout=1800)
    out = tmp_path / "ray.jsonl"
    ray_args = ["run", str(inp), "-o", str(out), *args, "--ray", "--replicas", "2"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([*specbatch_command(), *ray_args], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 600
        while killed is None:  # a replica's work file with a finished record: kill it
            assert proc.poll() is None, f"the run ended before a replica could be killed:\n" \
                                        f"{proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "no replica finished a record"
            for shard in tmp_path.glob("ray.jsonl.work.*.jsonl"):
                if shard.read_bytes().count(b"\n") >= 1:
                    killed = int(shard.name.split(".")[-2].rsplit("-", 1)[1])
                    os.kill(killed, signal.SIGKILL)
                    break
            time.sleep(0.2)
        stderr = proc.communicate(timeout=1800)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, 1), stderr[-3000:]  # Ray retried the batch, or gave up
    assert "Traceback" not in stderr
    if proc.returncode == 1:
        assert "error: the job on Ray stopped:" in stderr
        run_cli(*ray_args, "--resume", cwd=tmp_path, timeout=1800)
    assert out.read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    assert not list(tmp_path.glob("ray.jsonl.work*"))


@full_only
def test_build_processor_gives_what_llm_generate_gives(real_model):
    """The Python form: a ``ray.data.Dataset`` of records in the input format through 2
    replicas (``ray.init(num_cpus=2)``) gives the token ids ``LLM.generate`` gives."""
    import ray

    from specbatch import LLM, SamplingParams
    from specbatch.ray import build_processor

    rows = [{"id": "a", "prompt": "Repeat: one two three, one two three, one two"},
            {"id": "b", "prompt": "Translate to French: good morning"},
            {"id": "c", "messages": [{"role": "user", "content": "Name a colour."}]},
            {"id": "d", "prompt": "2 + 2 ="}]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        process = build_processor(method="ngram", k=5, replicas=2, max_tokens=8, batch_size=2)
        got = {r["id"]: r for r in process(ray.data.from_items(rows)).take_all()}
    finally:
        ray.shutdown()
    ref = LLM(method="ngram", k=5, max_batch_size=4).generate(rows, SamplingParams(max_tokens=8))
    assert sorted(got) == ["a", "b", "c", "d"]
    for o in ref:
        assert list(got[o.id]["output_token_ids"]) == o.token_ids
        assert got[o.id]["output"] == o.text
