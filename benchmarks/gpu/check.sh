#!/usr/bin/env bash
# The GPU check in one command, for a machine that reaches no package registry (docs/gpu.md).
#   bash benchmarks/gpu/check.sh BUNDLE OUT [check.py options, e.g. --device cpu]
# BUNDLE: the folder benchmarks/gpu/build_bundle.py made (wheels/, requirements.txt, tokenizer/,
# spec_bench.jsonl), copied beside the checkout. OUT: where gpu_check.json and gpu_check.txt go.
#
# 1. Installs the bundle's wheels with pip --no-index into OUT/venv: a venv that sees the
#    interpreter's own packages (--system-site-packages, and a .pth naming that interpreter's
#    site-packages, for an interpreter that is itself a venv), so the image's torch, triton and
#    transformers stay as they are. --without-pip: the interpreter's own pip does the install.
# 2. Runs benchmarks/gpu/check.py from this checkout (PYTHONPATH), with the bundle's tokenizer
#    ($SPECBATCH_TOKENIZER) and a fresh cache in OUT/cache ($SPECBATCH_CACHE).
# Exit status: check.py's (0 pass, 1 a check failed, 3 incomplete for time), 2 when the bundle
# does not install or is not a bundle. Under 8 minutes on an H200, install included.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/gpu/check.sh BUNDLE OUT [check.py options]" >&2
  exit 2
fi
[ -d "$1/wheels" ] && [ -f "$1/requirements.txt" ] || {
  echo "error: $1 is not a bundle folder (no wheels/ or requirements.txt): build it with" \
       "python benchmarks/gpu/build_bundle.py" >&2
  exit 2
}
BUNDLE=$(cd "$1" && pwd)
mkdir -p "$2" || exit 2
OUT=$(cd "$2" && pwd)
shift 2
cd "$(dirname "$0")/../.." || exit 2
PY=${PYTHON:-python3}
start=$(date +%s)
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONPATH="$PWD"
export SPECBATCH_TOKENIZER="$BUNDLE/tokenizer" SPECBATCH_CACHE="${SPECBATCH_CACHE:-$OUT/cache}"
log="$OUT/install.log"
: > "$log"
echo "== installing $BUNDLE/wheels into $OUT/venv (pip --no-index)"
rm -rf "$OUT/venv"
# every folder the interpreter imports from (its site-packages, a venv's, the user site, ...)
paths=$("$PY" -c 'import os, sys; print("\n".join(p for p in sys.path if p and os.path.isdir(p)))') \
  || { echo "error: $PY does not run" >&2; exit 2; }
if "$PY" -m venv --system-site-packages --without-pip "$OUT/venv" >> "$log" 2>&1; then
  VPY="$OUT/venv/bin/python"
  vsite=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # after the venv's own site-packages: what the bundle installs wins, the rest is the image's
  echo "$paths" > "$vsite/_image_site.pth"
  "$VPY" -m pip install --no-index --find-links "$BUNDLE/wheels" -r "$BUNDLE/requirements.txt" \
    >> "$log" 2>&1 || { "$PY" benchmarks/gpu/check.py --bundle "$BUNDLE" --out "$OUT" \
                          --install-failed "$log" "$@"; tail -5 "$log"; exit 2; }
else
  # no venv module: the user site of a folder of our own (PYTHONUSERBASE), same effect
  echo "venv failed (see $log); installing into the user site $OUT/pyuser"
  export PYTHONUSERBASE="$OUT/pyuser" PIP_BREAK_SYSTEM_PACKAGES=1  # our own user site only
  VPY=$PY
  "$VPY" -m pip install --user --no-index --find-links "$BUNDLE/wheels" \
    -r "$BUNDLE/requirements.txt" >> "$log" 2>&1 \
    || { "$PY" benchmarks/gpu/check.py --bundle "$BUNDLE" --out "$OUT" \
           --install-failed "$log" "$@"; tail -5 "$log"; exit 2; }
fi
echo "installed in $(( $(date +%s) - start )) s: $(grep -c '^Successfully installed\|already satisfied' "$log" || true) pip lines, see $log"
"$VPY" benchmarks/gpu/check.py --bundle "$BUNDLE" --out "$OUT" "$@"
status=$?
echo "gpu check: exit $status in $(( $(date +%s) - start )) s; $OUT/gpu_check.txt and .json"
exit $status
