"""``specbatch run --ray`` without Ray installed: one ``error:`` line saying how to install it,
exit 2, before any model loads; ``--replicas`` without ``--ray`` is a usage error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

NO_RAY = """
import sys
sys.modules["ray"] = None  # import ray -> ImportError, as in an install without the extra
from specbatch.cli import main
main(sys.argv[1:])
"""


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "hello"}) + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", NO_RAY, "run", str(inp), "-o",
                           str(tmp_path / "out.jsonl"), *args], env=env, capture_output=True,
                          text=True, timeout=120)


def test_ray_flag_without_ray_is_one_line(tmp_path):
    proc = _run(tmp_path, "--ray", "--replicas", "2")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "error: Ray is not installed: pip install 'specbatch[ray]' (or pip install "
        "'ray[data]>=2.40') on every node"]
    assert not (tmp_path / "out.jsonl.work.jsonl").exists()


def test_replicas_need_ray(tmp_path):
    proc = _run(tmp_path, "--replicas", "2")
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0] == "error: --ray-address and --replicas need --ray"
