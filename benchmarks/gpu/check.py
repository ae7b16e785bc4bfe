"""The GPU check: every figure of one run, written to ``OUT/gpu_check.json`` and
``OUT/gpu_check.txt`` (docs/gpu.md). ``check.sh`` installs the bundle and runs this; run it
directly where the bundle's wheels are already installed:

    python benchmarks/gpu/check.py --bundle gpu_bundle --out OUT [--device cpu] [options]

Phases, each in its own process under a hard timeout (the budgets sum to ~7 minutes on CUDA):

1. ``env``: Python, torch, triton, transformers, the device;
2. ``kernel_tests``: ``pytest tests/kernels`` (compiled on CUDA; on a CPU under Triton's
   interpreter);
3. ``probe``: row invariance of the dense layers and RMSNorm, and the invariant matmul's cost
   against ``F.linear`` (where those kernels exist; else "not available");
4. one phase per dummy model: step time at rows x tokens against the weight-streaming floor;
   none / ngram / suffix / auto at each batch size on the bundle's records, every output
   compared with the first run's; ``none`` against transformers ``generate``.

``OUT`` is rewritten after every phase, so a failed or stopped check still leaves what it
measured. Exit status: 0 every check passed; 1 a check failed (kernel tests, outputs that
differ, a run or phase that raised or crashed); 3 nothing failed but something was skipped or
stopped for time; 2 a bad command line or bundle.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # report_text
PHASES = Path(__file__).resolve().with_name("phases.py")
MODELS = ("dummy:smollm2-135m", "dummy:llama-1.5b")
METHODS = ("none", "ngram", "suffix", "auto")
GRACE_S = 15  # a phase's hard timeout past its soft budget
NUMPY_INTERPRETER_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


@dataclass
class Settings:
    """What the check runs; ``for_device`` fills the defaults of a device. Budgets are the
    phases' soft time limits in seconds (their hard timeouts are ``GRACE_S`` more)."""

    device: str = "cuda"
    dtype: str = "auto"
    records: int = 32
    max_tokens: int = 64
    k: int = 5
    models: list[str] = field(default_factory=lambda: list(MODELS))
    batches: list[int] = field(default_factory=lambda: [1, 16, 64])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    max_model_len: int = 4096
    hf_records_batch1: int = 8
    step_shapes: list[list[int]] = field(default_factory=lambda: [[1, 1], [16, 6], [64, 6]])
    step_context: int = 512
    step_repeats: int = 10
    copy_bytes: int = 1 << 30
    probe_rows: list[int] = field(default_factory=lambda: [1, 2, 3, 4, 6, 8, 16, 32, 64, 100,
                                                           128, 256])
    dense_rows: list[int] = field(default_factory=lambda: [1, 16, 64])
    dense_repeats: int = 5
    runs_share: float = 0.75
    threads: int | None = None
    records_path: str = ""
    budget_kernel_tests: float = 120
    budget_probe: float = 60
    budget_models: dict[str, float] = field(default_factory=lambda: {
        "dummy:smollm2-135m": 95, "dummy:llama-1.5b": 110})

    @classmethod
    def for_device(cls, device: str, smallest: bool) -> Settings:
        if device == "cuda" and not smallest:
            return cls()
        # a CPU run (or --smallest): the whole path, on the fewest records and tokens
        return cls(device=device, records=4, max_tokens=16, models=[MODELS[0]],
                   hf_records_batch1=2, step_context=128, step_repeats=2, copy_bytes=64 << 20,
                   probe_rows=[1, 2, 6, 16, 64, 100], dense_repeats=2, max_model_len=2048,
                   budget_kernel_tests=900 if device == "cpu" else 140,
                   budget_probe=120, budget_models={m: 900 for m in MODELS})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, help="the bundle folder (build_bundle.py)")
    ap.add_argument("--out", required=True, help="where gpu_check.json / .txt go")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smallest", action="store_true",
                    help="the smallest settings (a CPU run has them anyway): 4 records, 16 "
                    "tokens, dummy:smollm2-135m only")
    ap.add_argument("--records", type=int)
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--models", nargs="+", choices=MODELS)
    ap.add_argument("--batches", nargs="+", type=int)
    ap.add_argument("--methods", nargs="+", choices=METHODS)
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiply every phase's time budget (default 1: ~7 min on CUDA)")
    ap.add_argument("--skip-kernel-tests", action="store_true")
    ap.add_argument("--install-failed", metavar="LOG",
                    help="(check.sh) the bundle did not install: record LOG's tail and stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = Settings.for_device(args.device, args.smallest)
    for name in ("records", "max_tokens", "models", "batches", "methods"):
        if getattr(args, name) is not None:
            setattr(s, name, getattr(args, name))
    s.records_path = str(Path(args.bundle) / "spec_bench.jsonl")
    s.budget_kernel_tests *= args.budget_scale
    s.budget_probe *= args.budget_scale
    s.budget_models = {m: b * args.budget_scale for m, b in s.budget_models.items()}
    if os.environ.get("OMP_NUM_THREADS"):
        s.threads = int(os.environ["OMP_NUM_THREADS"])
    report = Report(out, s)
    if args.install_failed:
        log = Path(args.install_failed)
        tail = log.read_text(errors="replace").splitlines()[-15:] if log.is_file() else []
        report.fail("install", "the bundle did not install (pip --no-index): "
                    + " | ".join(t for t in tail if t.strip())[-1500:])
        report.write()
        return 2
    if not Path(s.records_path).is_file():
        report.fail("bundle", f"{s.records_path} is missing: is --bundle a bundle folder?")
        report.write()
        return 2

    report.doc["env"] = env = run_env(s)
    report.write()
    if "error" in env:
        report.fail("env", env["error"])
        report.write()
        return report.exit_status()
    if s.device == "cuda" and not env.get("cuda"):
        report.fail("env", "torch sees no CUDA device (run with --device cpu for a CPU check)")
        report.write()
        return report.exit_status()
    s.dtype = env["dtype"]
    report.doc["settings"] = asdict(s)

    if args.skip_kernel_tests:
        report.doc["kernel_tests"] = {"skipped": "--skip-kernel-tests"}
    else:
        report.doc["kernel_tests"] = kt = run_kernel_tests(s)
        if kt["status"] == "failed":
            report.fail("kernel_tests", kt["summary"])
        elif kt["status"] == "timeout":
            report.incomplete("kernel_tests", kt["summary"])
    report.write()

    report.doc["probe"] = run_phase(report, "probe", s, s.budget_probe, "probe")
    report.write()
    models = report.doc.setdefault("models", {})
    for model in s.models:
        models[model] = doc = run_phase(report, f"model {model}", s,
                                        s.budget_models.get(model, 120), "model", model)
        judge_model(report, model, doc, s)
        report.write()
    report.write(final=True)
    print(report.text())
    return report.exit_status()


class Report:
    """The check's JSON document and its text form, rewritten as phases finish."""

    def __init__(self, out: Path, settings: Settings) -> None:
        self.out, self.start = out, time.perf_counter()
        self.doc: dict = {"status": "RUNNING", "failures": [], "incomplete": [],
                          "settings": asdict(settings)}

    def fail(self, where: str, why: str) -> None:
        self.doc["failures"].append(f"{where}: {why}")

    def incomplete(self, where: str, why: str) -> None:
        self.doc["incomplete"].append(f"{where}: {why}")

    def exit_status(self) -> int:
        return 1 if self.doc["failures"] else 3 if self.doc["incomplete"] else 0

    def write(self, final: bool = False) -> None:
        status = {0: "PASS", 1: "FAIL", 3: "INCOMPLETE"}[self.exit_status()]
        self.doc["status"] = status if final or self.doc["failures"] else "RUNNING"
        self.doc["wall_s"] = round(time.perf_counter() - self.start, 1)
        for name, text in (("gpu_check.json", json.dumps(self.doc, indent=1) + "\n"),
                           ("gpu_check.txt", self.text() + "\n")):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def text(self) -> str:
        from report_text import render  # beside this file

        return render(self.doc)


def run_env(s: Settings) -> dict:
    """Versions and the device, from a subprocess (a broken torch is reported, not raised)."""
    code = r"""
import json, platform, sys
doc = {"python": platform.python_version()}
try:
    import torch
    doc["torch"] = torch.__version__
    doc["cuda"] = torch.cuda.is_available()
    if doc["cuda"]:
        doc["device_name"] = torch.cuda.get_device_name()
        doc["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    import transformers
    doc["transformers"] = transformers.__version__
    try:
        import triton
        doc["triton"] = triton.__version__
    except ImportError:
        doc["triton"] = None
    from specbatch.config import resolve_dtype
    doc["dtype"] = resolve_dtype(sys.argv[2], sys.argv[1])
    doc["cpu_count"] = __import__("os").cpu_count()
    import shutil
    doc["c_compiler"] = shutil.which("cc") or shutil.which("gcc")  # Triton builds its launcher
except Exception as e:
    doc["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(doc))
"""
    try:
        proc = subprocess.run([sys.executable, "-c", code, s.device, s.dtype], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"error": f"could not read the environment: {e}"}
    if s.device == "cuda":
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=20)
            doc["nvidia_smi"] = smi.stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            doc["nvidia_smi"] = None
    return doc


def run_kernel_tests(s: Settings) -> dict:
    """``pytest tests/kernels`` under the budget: status passed / failed / timeout / skipped,
    the summary line and seconds."""
    env = {**os.environ, "COLUMNS": "1000"}  # the short summary keeps each failure's message
    if s.device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p",
                               "no:cacheprovider", "tests/kernels"], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=s.budget_kernel_tests + GRACE_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (
            e.stdout or "")
        return {"status": "timeout", "seconds": round(time.perf_counter() - t0, 1),
                "summary": f"stopped after {s.budget_kernel_tests + GRACE_S:.0f} s",
                "tail": tail[-2000:]}
    seconds = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = next((ln.strip("= ") for ln in reversed(lines)
                    if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "no summary")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)",
                                                summary)}
    failed = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))]
    note = ""
    if proc.returncode == 0 and counts.get("passed", 0) == 0:
        status = "skipped"  # triton missing, or no device to run them on
    else:
        status = "passed" if proc.returncode == 0 else "failed"
    if (status == "failed" and s.device == "cpu" and failed
            and all(NUMPY_INTERPRETER_ERROR in ln for ln in failed)):
        # Triton < 3.7's interpreter takes int() of 1-element arrays, an error since NumPy 2.4:
        # the CPU cannot run these tests with that pair; compiled on CUDA they are unaffected
        status = "skipped"
        note = (f"{len(failed)} tests cannot run under this Triton's CPU interpreter with this "
                f"NumPy (int() of a 1-element array: {NUMPY_INTERPRETER_ERROR!r}); the compiled "
                f"kernels on CUDA do not take that path")
    if status == "skipped" and s.device == "cuda":
        status = "failed"
    return {"status": status, "summary": summary, "seconds": seconds, "counts": counts,
            "note": note, "failed": failed[:20],
            "tail": "\n".join(lines[-30:]) if status == "failed" else ""}


def run_phase(report: Report, label: str, s: Settings, budget: float, *phase_args) -> dict:
    """Run ``phases.py`` with the settings and a soft budget; its JSON (what it saved before
    ending, however it ended), with ``returncode`` / ``timed_out`` / ``stderr_tail`` added."""
    slug = re.sub(r"[^a-z0-9.-]+", "_", label.lower()).strip("_")
    settings_path = report.out / f"settings_{slug}.json"
    settings_path.write_text(json.dumps({**asdict(s), "deadline_s": budget}))
    result_path = report.out / f"phase_{slug}.json"
    result_path.unlink(missing_ok=True)
    log_path = report.out / f"phase_{slug}.log"
    t0 = time.perf_counter()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(PHASES), phase_args[0], str(settings_path),
                                 str(result_path), *phase_args[1:]], cwd=REPO, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=budget + GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            timed_out = True
    try:
        doc = json.loads(result_path.read_text())
    except (OSError, ValueError):
        doc = {}
    doc.update(returncode=rc, timed_out=timed_out, seconds=round(time.perf_counter() - t0, 1))
    if rc != 0:
        doc["log_tail"] = log_path.read_text(errors="replace").splitlines()[-25:]
    if timed_out:
        report.incomplete(label, f"stopped at its {budget + GRACE_S:.0f} s timeout")
    elif rc != 0:
        tail = [ln for ln in doc["log_tail"] if ln.strip()][-1:] or ["no output"]
        report.fail(label, f"exited {rc}: {tail[0]}")
    for skipped in doc.get("skipped", []):
        report.incomplete(label, f"skipped {skipped}")
    return doc


def judge_model(report: Report, model: str, doc: dict, s: Settings) -> None:
    """Failures of a model phase: errors, outputs that differ, runs missing from the plan."""
    where = f"model {model}"
    for error in doc.get("errors", []):
        report.fail(where, error)
    for m in doc.get("mismatches", []):
        report.fail(where, f"outputs of {m['run']} differ from {m['against']} in "
                    f"{m['records_differing']} records (first: record {m['first_record']}, "
                    f"{m['first_position']})")
    ran = len([r for r in doc.get("runs", []) if "error" not in r])
    planned = len(s.batches) * len(s.methods)
    if ran < planned and not doc.get("timed_out") and not doc.get("skipped") and not (
            doc.get("returncode")):
        report.incomplete(where, f"{ran} of {planned} runs")


if __name__ == "__main__":
    sys.exit(main())
