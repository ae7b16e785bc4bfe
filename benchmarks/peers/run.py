"""Run specbatch, vLLM and llama.cpp on the same prompts, interleaved, and print the table.

Each arm (engine, method, batch size) is a worker process in its engine's own venv (see
README.md), started once and warmed up (two prompts, 16 tokens); then every round runs each
arm on all prompts, one arm at a time (the other workers stopped with SIGSTOP meanwhile), in
``specbatch bench``'s order (``round_order``): the first arm rotating from round to round so
drift of a shared machine spreads over all arms, and no arm running right after the same one
in two rounds running (rotation alone ran auto right after ngram of its batch size in every
round).
Output tok/s = output tokens (a final EOS counted, as every engine emits it) / wall seconds of
the batch job, summed over rounds; "per round" gives each round's. The 1-minute load average is
read before and after every run; the table's "load" column is its range over the arm's runs.

    python benchmarks/peers/run.py --work /work/peer-run --rounds 2 \
        --arms specbatch:none:16,specbatch:ngram:16,vllm:none:16,vllm:ngram:16

The models are the ones ``prepare.py`` wrote to ``WORK/model.json`` (target, draft and their
GGUF files; the packaged SmolLM2-135M and no draft when it is absent); ``--model`` /
``--draft`` override them (registry names; llama.cpp then needs ``--gguf`` / ``--draft-gguf``).
Methods: ``none``, ``ngram`` (prompt lookup), ``draft`` (the draft model: specbatch's draft
proposer; llama.cpp through the binding's ``draft_model`` hook, see ``worker_llamacpp.py``) and
``auto`` (specbatch; given the draft model when there is one).

Standard library and ``specbatch.commands.bench`` (the order) only; the workers import the
engines.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PYTHONS = {"specbatch": os.environ.get("SPECBATCH_PYTHON", sys.executable),
           "vllm": os.environ.get("VLLM_PYTHON", "/work/peer-venvs/vllm/bin/python"),
           "llamacpp": os.environ.get("LLAMACPP_PYTHON", "/work/peer-venvs/llamacpp/bin/python")}
LABELS = {"specbatch": "specbatch", "vllm": "vLLM", "llamacpp": "llama.cpp"}


def models(args) -> dict:
    """``{"model", "draft", "gguf", "draft_gguf"}``: ``WORK/model.json`` (``prepare.py``), the
    command line's ``--model`` / ``--draft`` / ``--gguf`` / ``--draft-gguf`` over it."""
    path = Path(args.work) / "model.json"
    info = json.loads(path.read_text()) if path.exists() else {}
    gguf = Path(args.work) / "gguf-path.txt"
    info.setdefault("gguf", gguf.read_text().strip() if gguf.exists() else None)
    for key, value in (("model", args.model), ("draft", args.draft), ("gguf", args.gguf),
                       ("draft_gguf", args.draft_gguf)):
        if value is not None:
            info[key] = value
    return info


def worker_command(engine: str, method: str, batch: int, dtype: str,
                   args) -> tuple[list[str], dict]:
    work = Path(args.work)
    info = models(args)
    if method == "draft" and not info.get("draft"):
        raise SystemExit("a draft arm needs a draft model: prepare.py --draft NAME (or --draft)")
    prompts = str(work / "prompts.json")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    # every engine runs with its own OpenMP wait policy: OMP_WAIT_POLICY=PASSIVE from a shell
    # (set to share a busy machine) made specbatch's steps 1.4-1.6x slower here
    for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(var, None)
    common = ["--method", method, "--k", str(args.k), "--threads", str(args.threads)]
    if engine != "llamacpp":
        common += ["--dtype", dtype]
    if engine == "specbatch":
        env["PYTHONPATH"] = str(REPO)
        if info.get("model"):
            common += ["--model", info["model"]]
        if method in ("draft", "auto") and info.get("draft"):
            common += ["--draft-model", info["draft"]]
        return ([PYTHONS[engine], str(HERE / "worker_specbatch.py"), args.records, prompts,
                 "--batch", str(batch), *common], env)
    if engine == "vllm":
        if method not in ("none", "ngram"):
            raise SystemExit(f"vllm arms: methods none and ngram only, not {method}")
        env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND":
                    f"0-{args.threads - 1}", "VLLM_NO_USAGE_STATS": "1",
                    "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        return ([PYTHONS[engine], str(HERE / "worker_vllm.py"), prompts,
                 str(work / "hf-model"), "--batch", str(batch), *common], env)
    if engine == "llamacpp":
        if batch != 1:
            raise SystemExit("llamacpp arms run batch 1 only (see worker_llamacpp.py)")
        if method not in ("none", "ngram", "draft"):
            raise SystemExit(f"llamacpp arms: methods none, ngram and draft, not {method}")
        if method == "draft":
            if not info.get("draft_gguf"):
                raise SystemExit("llamacpp:draft needs the draft's GGUF (prepare.py --draft)")
            common += ["--draft-gguf", info["draft_gguf"]]
        return ([PYTHONS[engine], str(HERE / "worker_llamacpp.py"), prompts, info["gguf"],
                 *common], env)
    raise SystemExit(f"unknown engine {engine!r}")


class Worker:
    def __init__(self, arm: tuple[str, str, int, str], args, log_dir: Path,
                 shared: bool = False) -> None:
        """arm: the worker's command line; shared: it serves every arm of its engine and dtype
        (each run command names the arm)."""
        self.arm, self.shared = arm, shared
        cmd, env = worker_command(*arm, args)
        name = ("%s-%s-shared.log" % (arm[0], arm[3]) if shared
                else "%s-%s-b%d-%s.log" % arm)
        self.log = open(log_dir / name, "w")
        # own process group, so that pause() stops the engine's helper processes too
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, env=env, text=True, cwd=str(REPO),
                                     start_new_session=True)
        self.t0 = time.perf_counter()
        self.info: dict = {}

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.arm} died at start-up: see {self.log.name}")
        self.info = json.loads(line)
        self.info["startup_s"] = time.perf_counter() - self.t0

    def run(self, limit: int | None, max_tokens: int, arm=None) -> dict:
        """One timed job; arm: the arm to run, sent along to a shared worker."""
        cmd = {"cmd": "run", "limit": limit, "max_tokens": max_tokens}
        if self.shared:
            cmd.update(method=arm[1], batch=arm[2])
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"worker {self.arm} died: see {self.log.name}")
        return json.loads(line)

    def pause(self) -> None:
        """SIGSTOP the worker's process group while other arms run: an idle vLLM engine keeps
        its OpenMP threads and engine-core loop spinning (load average 3-4 on 2 cores with
        nothing running), which would slow whichever arm is being timed."""
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        try:
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001 - a stuck engine must not keep the driver alive
            self.proc.kill()


def round_order(arms: list, rnd: int) -> list:
    """The arms of round ``rnd`` (from 0), in ``specbatch bench``'s order (``run_order``: the
    first arm rotates, no arm right after the same one in two rounds running)."""
    from specbatch.commands.bench import run_order

    return [arms[j] for j in run_order(len(arms), 0, rnd)]


def parse_arms(text: str) -> list[tuple[str, str, int, str]]:
    """``engine:method:batch[:dtype]`` items. dtype default: specbatch ``auto`` (what
    ``specbatch run`` picks on this CPU; the table shows the resolved dtype), vLLM bfloat16,
    llama.cpp its GGUF's (``gguf``: the file's own types)."""
    defaults = {"specbatch": "auto", "llamacpp": "gguf"}
    arms = []
    for item in text.split(","):
        engine, method, batch, *dtype = item.strip().split(":")
        dtype = dtype[0] if dtype else defaults.get(engine, "bfloat16")
        arms.append((engine, method, int(batch), dtype))
    return arms


def identical_share(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def table(arms, results, outputs, resolved: dict | None = None) -> str:
    """Markdown: per arm tok/s, ratios to each peer's best arm at the same batch size, and the
    share of outputs identical to the same engine's ``none`` at that batch and to the same
    method at the other batch size."""
    tps = {arm: sum(r["tokens"] for r in results[arm]) / sum(r["seconds"] for r in results[arm])
           for arm in arms}
    head = ["engine", "method", "batch", "dtype", "output tok/s", "per round", "tokens",
            "seconds", "load"]
    peers = [e for e in ("vllm", "llamacpp") if any(a[0] == e for a in arms)]
    head += [f"/ best {LABELS[p]} arm" for p in peers]
    head += ["identical to none (same engine, batch)", "identical across batch sizes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm in arms:
        engine, method, batch, dtype = arm
        tokens = sum(r["tokens"] for r in results[arm])
        seconds = sum(r["seconds"] for r in results[arm])
        shown = (resolved or {}).get(arm) or dtype
        shown = shown if shown == dtype else f"{shown} ({dtype})"
        loads = [r[k] for r in results[arm] for k in ("load_before", "load_after") if k in r]
        row = [LABELS[engine], method, str(batch), shown, f"{tps[arm]:.1f}",
               ", ".join(f"{r['tokens'] / r['seconds']:.1f}" for r in results[arm]),
               str(tokens), f"{seconds:.1f}", f"{min(loads):.1f}-{max(loads):.1f}"]
        for p in peers:
            best = max((tps[a] for a in arms if a[0] == p and a[2] == batch), default=None)
            row.append(f"{tps[arm] / best:.2f}x" if best else "-")
        base = (engine, "none", batch, dtype)
        row.append(identical_share(outputs[arm], outputs[base])
                   if base in outputs and method != "none" else "-")
        other = [a for a in arms if a[:2] == arm[:2] and a[3] == dtype and a[2] != batch]
        row.append(identical_share(outputs[arm], outputs[other[0]]) if other else "-")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def report(args, arms, workers, results, outputs, out: Path, rounds_done: int) -> None:
    """Print the table of the rounds done so far and (re)write the results JSON, so that a
    run stopped in a later round keeps what it measured."""
    loads = [r["load_before"] for rs in results.values() for r in rs]
    md = table(arms, results, outputs, {a: w.info.get("dtype") for a, w in workers.items()})
    info = models(args)
    summary = (f"model {info.get('model') or 'smollm2-135m'}"
               + (f", draft {info['draft']}" if info.get("draft") else "") + ", "
               f"{len(outputs[arms[0]])} prompts, max_tokens {args.max_tokens}, greedy, "
               f"{rounds_done} of {args.rounds} rounds, threads {args.threads}; load average "
               f"(1 min) before runs {min(loads):.2f}-{max(loads):.2f}")
    print(summary, flush=True)
    print(md, flush=True)
    out.write_text(json.dumps({"args": vars(args), "summary": summary, "table": md,
                               "workers": {"%s:%s:%d:%s" % a: w.info
                                           for a, w in workers.items()},
                               "results": {"%s:%s:%d:%s" % a: r for a, r in results.items()},
                               "outputs": {"%s:%s:%d:%s" % a: o for a, o in outputs.items()}},
                              indent=1))
    print(f"wrote {out}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True, help="folder prepare.py wrote")
    ap.add_argument("--records", default=str(HERE / "records16.jsonl"))
    ap.add_argument("--arms", required=True, help="engine:method:batch[:dtype],... (engine: "
                    "specbatch, vllm, llamacpp; method: none, ngram, draft (specbatch, llamacpp), auto "
                    "(specbatch); dtype: auto (specbatch's default), bfloat16 (vLLM's "
                    "default) or float32)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--batch1-limit", type=int, default=None, help="first N prompts only in "
                    "the batch-1 arms (default: --limit); their tok/s then come from fewer "
                    "prompts than the batched arms'")
    ap.add_argument("--warmup-prompts", type=int, default=2, help="prompts of the untimed "
                    "warm-up per arm (16 tokens each)")
    ap.add_argument("--out", default=None, help="results JSON (default WORK/results-<time>.json)")
    ap.add_argument("--share-workers", action="store_true", help="one specbatch worker per "
                    "dtype serves all its arms (one copy of the weights: a 1.5B model's "
                    "worker holds ~6-9 GB, one per arm would not fit in 24 GB); each run still "
                    "builds its own engine")
    ap.add_argument("--recalibrate", action="store_true", help="measure auto's step-cost "
                    "fits again before the workers start (else a cached fit is used: one "
                    "measured on a busy machine plans for that machine)")
    ap.add_argument("--model", default=None, help="specbatch's target (default: WORK/model.json)")
    ap.add_argument("--draft", default=None, help="specbatch's draft model (default: "
                    "WORK/model.json)")
    ap.add_argument("--gguf", default=None, help="llama.cpp's target GGUF (default: "
                    "WORK/model.json)")
    ap.add_argument("--draft-gguf", default=None, help="llama.cpp's draft GGUF (default: "
                    "WORK/model.json)")
    args = ap.parse_args()

    arms = parse_arms(args.arms)
    log_dir = Path(args.work) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    out = Path(args.out or Path(args.work) / f"results-{time.strftime('%H%M%S')}.json")
    info = models(args)
    calibrate = [info.get("model")] + [info.get("draft")] * bool(info.get("draft"))
    for dtype in sorted({d for e, m, _, d in arms if e == "specbatch" and m == "auto"}):
        # auto plans from the cached step-cost fits (the target's, and the draft model's when
        # it is given): measure them now, on the quiet machine, not in its worker's warm-up
        # while the vLLM engines compile beside it (a fit measured under that load planned a
        # whole run at 0.41x of none)
        env = worker_command("specbatch", "auto", 1, dtype, args)[1]
        # the draft model runs at the target's dtype (resolved for the target: a draft that
        # alone would resolve to float32 runs int8 beside an int8 target)
        dtype = subprocess.run(
            [PYTHONS["specbatch"], "-c", "import sys; from specbatch.config import EngineConfig; "
             "print(EngineConfig(dtype=sys.argv[1], device='cpu').for_model(sys.argv[2] or "
             "None).dtype)", dtype, info.get("model") or ""], env=env, cwd=str(REPO),
            check=True, capture_output=True, text=True).stdout.strip()
        for model in calibrate:
            subprocess.run([PYTHONS["specbatch"], "-m", "specbatch.cli", "calibrate", "--dtype",
                            dtype, "--device", "cpu", *(["--model", model] if model else []),
                            *(["--recalibrate"] if args.recalibrate else [])],
                           env=env, cwd=str(REPO), check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: dict = {}
    for arm in arms:
        if args.share_workers and arm[0] == "specbatch":
            first = next(a for a in arms if a[0] == arm[0] and a[3] == arm[3])
            # started as a draft arm when there is one, so that it loads the draft model
            start = next((a for a in arms if a[0] == arm[0] and a[3] == arm[3]
                          and a[1] == "draft"), first)
            if first not in workers:
                workers[first] = Worker(start, args, log_dir, shared=True)
            workers[arm] = workers[first]
        else:
            workers[arm] = Worker(arm, args, log_dir)
    procs = list({id(w): w for w in workers.values()}.values())
    try:
        for w in procs:
            w.wait_ready()
            print(f"ready {w.arm}{' (shared)' if w.shared else ''}: {w.info}", file=sys.stderr)
        for w in procs:
            w.pause()
        for arm, w in workers.items():  # warm-up, untimed
            w.resume()
            w.run(args.warmup_prompts, 16, arm)
            w.pause()
        results = {arm: [] for arm in arms}
        outputs: dict = {}
        for rnd in range(args.rounds):
            for arm in round_order(arms, rnd):
                workers[arm].resume()  # the only engine not stopped (see Worker.pause)
                load = os.getloadavg()[0]
                limit = args.batch1_limit if arm[2] == 1 and args.batch1_limit else args.limit
                res = workers[arm].run(limit, args.max_tokens, arm)
                workers[arm].pause()
                load_after = os.getloadavg()[0]
                tokens = sum(len(o) for o in res["outputs"])
                results[arm].append({"round": rnd, "seconds": res["seconds"], "tokens": tokens,
                                     "load_before": load, "load_after": load_after})
                if arm in outputs and outputs[arm] != res["outputs"]:
                    print(f"note: {arm} outputs changed between rounds", file=sys.stderr)
                outputs.setdefault(arm, res["outputs"])
                print(f"round {rnd + 1} {arm}: {tokens / res['seconds']:.1f} tok/s "
                      f"({tokens} tokens, {res['seconds']:.1f} s, load {load:.2f} before, "
                      f"{load_after:.2f} after)",
                      file=sys.stderr)
            report(args, arms, workers, results, outputs, out, rnd + 1)
    finally:
        for w in procs:
            w.close()


if __name__ == "__main__":
    main()
