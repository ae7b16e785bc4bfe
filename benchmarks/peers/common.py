"""What the three engine workers share (standard library only: each worker runs in its own venv).

Protocol: the driver (``run.py``) starts a worker, which loads its engine and prints one JSON
line ``{"event": "ready", ...}`` on its protocol channel; then for each JSON command line on
stdin (``{"cmd": "run", "limit": N, "max_tokens": M}`` or ``{"cmd": "quit"}``) it runs the first
N prompts of ``prompts.json`` as one batch job and answers ``{"event": "result", "seconds": s,
"cpu_seconds": c, "outputs": [[token ids], ...]}`` (s: wall seconds; c: the worker process's CPU
seconds, all its threads, ``time.process_time``; outputs in prompt order; a final EOS id is
kept, as specbatch keeps it). A worker that serves several arms (specbatch with ``run.py --share-workers``) also
gets ``"method"`` and ``"batch"`` in the run command. The protocol channel is the process's original stdout; everything an engine prints
to stdout goes to stderr instead, so library logging cannot corrupt it.
"""

from __future__ import annotations

import argparse

import json
import os
import sys
import time
from collections.abc import Callable


def protocol_channel():
    """Keep the real stdout for protocol lines and send fd 1 (engine prints) to stderr."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return channel


def serve(channel, ready: dict, run: Callable[..., list[list[int]]],
          num_prompts: int) -> None:
    """Answer run commands until ``quit`` or EOF. ``run(n, max_tokens)`` generates the first n
    prompts as one batch job and returns the output ids per prompt; a command's ``method`` and
    ``batch``, when it has them, are passed on as keywords."""
    channel.write(json.dumps({"event": "ready", **ready}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        t0, c0 = time.perf_counter(), time.process_time()
        arm = {key: cmd[key] for key in ("method", "batch") if key in cmd}
        outputs = run(min(cmd.get("limit") or num_prompts, num_prompts), cmd["max_tokens"],
                      **arm)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        channel.write(json.dumps({"event": "result", "seconds": seconds, "cpu_seconds": cpu,
                                  "outputs": outputs}) + "\n")


def load_prompts(path: str) -> list[dict]:
    """``prompts.json``: ``[{"question_id", "category", "prompt_ids"}, ...]``."""
    with open(path) as fh:
        return json.load(fh)


def arg(*args, **kwargs) -> tuple[tuple, dict]:
    """One ``add_argument`` call's arguments, for ``peer_args``."""
    return args, kwargs


def peer_args(*extra: tuple[tuple, dict],
              methods: tuple[str, ...] = ("none", "ngram")) -> argparse.Namespace:
    """A peer worker's command line: PROMPTS MODEL --method METHOD --k --threads, plus
    ``extra`` ``(args, kwargs)`` pairs for ``add_argument``; methods: the ``--method``
    choices."""
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts")
    ap.add_argument("model")
    ap.add_argument("--method", default="none", choices=list(methods))
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    for args, kwargs in extra:
        ap.add_argument(*args, **kwargs)
    return ap.parse_args()
