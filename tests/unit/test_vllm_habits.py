"""What users coming from vLLM / transformers write, taken as they mean it (fresh-user passes):
``top_k=-1`` for "off", ``max_tokens=None`` for "up to the context", vLLM's engine knobs that
mean nothing here, ``use_tqdm``, ``-`` for standard input, and the errors they meet next.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specbatch.cli import main
from specbatch.config import ConfigError, SamplingParams


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM takes top_k = -1 (its old default) and 0 for "off"; both are 0 here, so a config
    that records it says 0 whichever was written; below -1 is still refused."""
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0) == SamplingParams()
    assert SamplingParams(top_k=-1).to_dict()["top_k"] == 0
    assert SamplingParams.from_dict({"top_k": -1}).top_k == 0
    with pytest.raises(ConfigError, match="top_k"):
        SamplingParams(top_k=-2)


def test_run_top_k_minus_one_writes_what_no_top_k_writes(tmp_path, tiny_gguf):
    """``--top-k -1`` (sampled, so top-k would matter): the same output rows and the same
    recorded sampling config as leaving --top-k out."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "abc abc"}\n{"id": 2, "prompt": "x y z", "top_k": -1}\n')
    common = ["run", str(inp), "--model", str(tiny_gguf), "--cache-dir", str(tmp_path / "c"),
              "--method", "none", "--max-tokens", "6", "--temperature", "1.5", "--no-progress"]
    outs = {}
    for name, extra in (("off", []), ("minus1", ["--top-k", "-1"])):
        out = tmp_path / f"{name}.jsonl"
        r = CliRunner().invoke(main, [*common, "-o", str(out), *extra])
        assert r.exit_code == 0, r.output
        outs[name] = ([json.loads(line)["output_token_ids"] for line in
                       out.read_text().splitlines()],
                      json.loads((tmp_path / f"{name}.jsonl.config.json").read_text())["sampling"])
    assert outs["minus1"] == outs["off"]
    assert outs["off"][1]["top_k"] == 0 and len(outs["off"][0]) == 2
    r = CliRunner().invoke(main, [*common, "-o", str(tmp_path / "bad.jsonl"), "--top-k", "-2"])
    assert r.exit_code == 2 and "--top-k" in r.output
