#!/usr/bin/env bash
# auto against the best static arm in the seven regimes of issue 35 (docs/benchmarks.md, "auto
# against the best static arm, per regime"): 3 interleaved rounds each, every output compared.
# Run from the repository root in the project's venv on a quiet machine (~30 min on 2 cores):
#     W=/tmp/regret bash benchmarks/auto_regret.sh
# writes W/peer16.json (+ .log), W/b130.log, W/ext1.log, W/ext16.log, the calibration logs
# and the load average after each job; benchmarks/auto_regret_table.py W prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
W=${W:-/tmp/regret}
PEER=${PEER:-$W/peer16}
mkdir -p "$W"
date -u +%FT%T > "$W/start"
git log --oneline -1 > "$W/commit" 2>/dev/null || true
[ -f "$PEER/prompts.json" ] || python benchmarks/peers/prepare.py benchmarks/peers/records16.jsonl \
    --out "$PEER" --no-hf-model > "$W/prepare.log" 2>&1
# auto's fits measured now, on the quiet machine, and fixed for every job below
specbatch calibrate --recalibrate --dtype int8 > "$W/cal_int8.log" 2>&1
specbatch calibrate --recalibrate --dtype float32 > "$W/cal_f32.log" 2>&1
arms=""
for dt in int8 float32; do for b in 16 1; do for m in none ngram auto; do
    arms="$arms,specbatch:$m:$b:$dt"; done; done; done
python benchmarks/peers/run.py --work "$PEER" --rounds 3 --share-workers --out "$W/peer16.json" \
    --arms "${arms#,}" > "$W/peer16.log" 2>&1
uptime >> "$W/load"
specbatch bench ../shared/data/spec_bench/question.jsonl --configs none,ngram:k=3,ngram:k=5,suffix,auto \
    --per-category 10 --max-batch-size 16 --max-tokens 128 --dtype int8 --repeats 3 > "$W/b130.log" 2>&1
uptime >> "$W/load"
T="$(python -c 'import tomllib; print(tomllib.load(open("recipes/json_extraction.toml", "rb"))["input"]["template"])')"
for B in 1 16; do
    specbatch bench recipes/prompts/json_extraction.jsonl --template "$T" \
        --json-schema recipes/json_extraction.schema.json --configs none,ngram:k=5,suffix,auto \
        --limit 48 --max-tokens 128 --dtype int8 --max-batch-size $B --repeats 3 > "$W/ext$B.log" 2>&1
    uptime >> "$W/load"
done
date -u +%FT%T > "$W/end"
