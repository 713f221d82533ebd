#!/usr/bin/env bash
# One command to check hpar on a machine with a GPU (issue 13):
#
#   scripts/gpu_check.sh                  # CUDA: install, test suite, every strategy one GPU allows, profiles
#   scripts/gpu_check.sh --device cpu --no-install --no-tests --steps 3    # dry run of the same on CPU
#
# It uses the CUDA build of torch already installed on the machine and reaches no package
# registry: hpar's other dependencies come from ../shared/wheels-py312 (wheels for CPython
# 3.12; see the README there), then hpar itself is installed with --no-deps.
# Then, on one GPU: allreduce with 1 worker, allreduce-sparse, hybrid and ps with 1 GPU worker
# and 1 CPU parameter server, a 2-stage pipeline when the machine has 2 GPUs (hpar runs one
# GPU per worker, so on one GPU the pipeline row says why it is skipped), and `hpar profile`
# of examples/wide.py and examples/lm.py, measured on the GPU (--device), and of
# examples/lm1b_shape.py (3.3 GB of tables) for 8 workers on 25 Gbit/s. Prints a pass/fail
# table with samples/s and the worker's peak memory, predicted / measured (from each run's
# summary.json); exit status 1 when any row failed.
#
# Options: --device cuda|cpu (default cuda), --no-install, --no-tests, --steps N (default 30),
# --wheels DIR (default ../shared/wheels-py312; a device machine that gets only the checkout
# takes a copy inside it, e.g. .whl/ listed in .git/info/exclude), --pytest-workers N (default 2),
# --only NAME (one row: tests, allreduce, allreduce-sparse, hybrid, ps, pipeline, profile-wide,
# profile-lm, profile-lm1b), --python PATH (default python3), --keep (keep the run directories).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda INSTALL=1 TESTS=1 STEPS=30 ONLY="" PY=python3 KEEP=0 WHEELS=../shared/wheels-py312 NPROC=2
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --no-tests) TESTS=0; shift ;;
    --steps) STEPS="$2"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --keep) KEEP=1; shift ;;
    --wheels) WHEELS="$2"; shift 2 ;;
    --pytest-workers) NPROC="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu_check: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|cpu) ;; *) echo "gpu_check: --device $DEVICE: choose cuda or cpu" >&2; exit 2 ;; esac

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "gpu_check: $PY has no torch; this script uses the machine's own (CUDA) torch and installs none" >&2
  exit 2
fi
if [ "$INSTALL" = 1 ]; then
  if [ -d "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" fabric rich psutil pytest pytest-timeout \
      || { echo "gpu_check: installing from $WHEELS failed" >&2; exit 2; }
  else
    echo "gpu_check: $WHEELS not found; assuming fabric, rich, psutil and pytest are installed"
  fi
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_check: pip install -e . failed" >&2; exit 2; }
fi
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" = cuda ] && [ "$GPUS" -lt 1 ]; then
  echo "gpu_check: --device cuda but torch sees no GPU (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}); use --device cpu for a dry run" >&2
  exit 2
fi
NAME=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
echo "gpu_check: device $DEVICE ($NAME, $GPUS GPU(s)), torch $("$PY" -c 'import torch; print(torch.__version__)'), $STEPS steps per run"

OUT=$(mktemp -d "${TMPDIR:-/tmp}/hpar-gpu-check.XXXXXX")
ROWS=()
FAILED=0
want() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }
row() {  # name, status, samples/s, note
  ROWS+=("$(printf '%-18s %-5s %12s  %s' "$1" "$2" "$3" "$4")")
  [ "$2" = FAIL ] && FAILED=1
  echo "gpu_check: $1: $2 $4"
}
peaks() {  # the worker's peak memory, predicted / measured (the memory model against the device)
  "$PY" -c "import json,sys; s=json.load(open(sys.argv[1])); p, m = s['predicted_peak_bytes']['worker'], s['peak_bytes']['worker']; print('worker peak %.0f / %.0f MB (%+.0f%%)' % (p / 1e6, m / 1e6, 100 * (p - m) / m) if p and m else 'worker peak -')" "$1/summary.json" 2>/dev/null || echo "worker peak -"
}
samples_per_s() {
  "$PY" -c "import json,sys; print('%.1f' % json.load(open(sys.argv[1]))['samples_per_s'])" "$1/summary.json" 2>/dev/null || echo "-"
}
run_case() {  # name, script, hpar run arguments...
  local name="$1" script="$2"; shift 2
  want "$name" || return 0
  local dir="$OUT/$name"
  if "$PY" -m hpar.launcher.cli run "$script" --device "$DEVICE" --steps "$STEPS" --run-dir "$dir" --plain "$@" \
      >"$OUT/$name.log" 2>&1; then
    row "$name" PASS "$(samples_per_s "$dir")" "$(peaks "$dir"); $(grep -m1 'devices:' "$OUT/$name.log" | sed 's/^hpar: //')"
  else
    row "$name" FAIL "-" "exit $?; last lines of $OUT/$name.log:"
    tail -5 "$OUT/$name.log" | sed 's/^/    /'
    KEEP=1
  fi
}
profile_case() {  # name, script, cluster flags (default --gpus 1)
  want "$1" || return 0
  local name="$1" script="$2"; shift 2
  [ $# -gt 0 ] || set -- --gpus 1
  if "$PY" -m hpar.launcher.cli profile "$script" "$@" --device "$DEVICE" >"$OUT/$name.log" 2>&1; then   # measured on the GPU
    row "$name" PASS "-" "$(grep -m1 -i 'chose\|plan' "$OUT/$name.log" | cut -c1-100)"
  else
    row "$name" FAIL "-" "see $OUT/$name.log"; KEEP=1
  fi
}

if [ "$TESTS" = 1 ] && want tests; then
  # the suite in --pytest-workers processes (pytest-xdist); without xdist, in one
  XDIST=(-n "$NPROC"); "$PY" -c "import xdist" 2>/dev/null || XDIST=(-o "addopts=--durations=20")
  if "$PY" -m pytest -q "${XDIST[@]}" >"$OUT/tests.log" 2>&1; then
    row tests PASS "-" "$(tail -1 "$OUT/tests.log")"
  else
    row tests FAIL "-" "$(tail -1 "$OUT/tests.log") (log: $OUT/tests.log)"; KEEP=1
  fi
fi
run_case allreduce examples/cnn.py --gpus 1 --strategy allreduce
run_case allreduce-sparse examples/lm.py --gpus 1 --strategy allreduce-sparse
run_case hybrid examples/lm.py --gpus 1 --strategy hybrid --servers 1
run_case ps examples/recsys.py --gpus 1 --strategy ps --servers 1
if [ "$DEVICE" = cpu ] || [ "$GPUS" -ge 2 ]; then
  run_case pipeline examples/wide.py --gpus 2 --strategy pipeline --schedule 1f1b
elif want pipeline; then
  row pipeline SKIP "-" "a 2-stage pipeline needs 2 GPUs: hpar runs one GPU per worker and refuses 2 workers on 1 GPU"
fi
profile_case profile-wide examples/wide.py
profile_case profile-lm examples/lm.py
profile_case profile-lm1b examples/lm1b_shape.py --gpus 8 --hosts 8x1 --bandwidth 25Gbps

echo
echo "hpar gpu_check on $NAME ($DEVICE), $(date -u '+%Y-%m-%d %H:%M UTC')"
printf '%-18s %-5s %12s  %s\n' check result samples/s note
for r in "${ROWS[@]}"; do echo "$r"; done
if [ "$KEEP" = 1 ]; then echo "run directories and logs: $OUT"; else rm -rf "$OUT"; fi
exit "$FAILED"
