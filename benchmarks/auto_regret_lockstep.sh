#!/usr/bin/env bash
# auto against the best static arm in the seven regimes of issue 35, every regime in lockstep
# (benchmarks/lockstep.py: the arms' engine steps interleaved in one process by output progress,
# 3 rounds pooled, every output compared), after fresh calibrations on the quiet machine.
# Run from the repository root in the project's venv with greenlet installed, nothing else on
# the CPU (~35 min on 2 cores):
#     W=/tmp/lockstep bash benchmarks/auto_regret_lockstep.sh
# writes W/<regime>.log; each ends with "auto / best static arm (ARM): RATIO pooled; per round".
# R130=N: rounds of the 130-record job (default 3; ~20 min a round on a 2-core Zen 2, where
# the other six regimes take ~50 min together).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
W=${W:-/tmp/lockstep}
mkdir -p "$W"
date -u +%FT%T > "$W/start"
git log --oneline -1 > "$W/commit" 2>/dev/null || true
specbatch calibrate --recalibrate --dtype int8 > "$W/cal_int8.log" 2>&1
specbatch calibrate --recalibrate --dtype float32 > "$W/cal_f32.log" 2>&1
L=benchmarks/lockstep.py
for dt in int8 float32; do for b in 16 1; do
    python $L benchmarks/peers/records16.jsonl --batch $b --dtype $dt --arms none,ngram:k=5,auto \
        > "$W/peer_b${b}_$dt.log" 2>&1
done; done
T="$(python -c 'import tomllib
print(tomllib.load(open("recipes/json_extraction.toml", "rb"))["input"]["template"])')"
for b in 1 16; do
    python $L recipes/prompts/json_extraction.jsonl --template "$T" \
        --json-schema recipes/json_extraction.schema.json --limit 48 --batch $b --dtype int8 \
        --arms none,ngram:k=5,suffix,auto > "$W/extraction_b$b.log" 2>&1
done
# the 130-record Spec-Bench set (the first 10 records of each category, as bench
# --per-category 10 takes them), one job at batch 16
python - "$W/spec_bench130.jsonl" <<'PY'
import json, sys
seen, out = {}, []
for line in open("../shared/data/spec_bench/question.jsonl"):
    cat = json.loads(line)["category"]
    if seen.setdefault(cat, 0) < 10:
        seen[cat] += 1
        out.append(line)
open(sys.argv[1], "w").writelines(out)
PY
python $L "$W/spec_bench130.jsonl" --batch 16 --dtype int8 --rounds "${R130:-3}" \
    --arms none,ngram:k=3,ngram:k=5,suffix,auto > "$W/spec_bench130_b16.log" 2>&1
date -u +%FT%T > "$W/end"
grep -H "best static" "$W"/*.log
