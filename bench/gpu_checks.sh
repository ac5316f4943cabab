#!/usr/bin/env bash
# Issue 31's acceptance run on a GPU, in one go of at most 9 minutes (PA_GPU_CHECKS_BUDGET_S, default 540), ending
# with ONE table: step, figure, goal, pass/fail (bench/gpu_acceptance.py says what each step measures; docs/gpu.md
# how). A lent GPU's time is short: run this first, and copy the table into bench/README.md, "On a GPU".
# Needs precision-audit installed (with its test and fp8 extras), a CUDA GPU, and transformers for GPT-2.
#
#   bench/gpu_checks.sh [OUT_DIR]      (default: ./gpu-checks; a log per step, results.jsonl, table.md)
#   bench/gpu_checks.sh --dry-run      (any machine: the table's layout, every step "not measured: no GPU")
#
# PA_PYTHON names the interpreter (default: `python`, else `python3`: some GPU images have only python3).
# PA_GPU_CHECKS_MIRROR=DIR copies results.jsonl and the table so far into DIR after every step, so that a run cut
# off from outside (a lent machine's call limit) still leaves every row it measured (bench/gpu_session.sh).
#
# Each step gets its own time limit, cut to what is left of the budget, so that one that hangs cannot take the
# others' time; a step that fails, times out or has no time left gets a row saying so.
set -u
cd "$(dirname "$0")/.."
PY=${PA_PYTHON:-$(command -v python || command -v python3)}
if [ "${1:-}" = "--dry-run" ]; then
  exec "$PY" bench/gpu_acceptance.py table --dry-run
fi
out=${1:-gpu-checks}
budget=${PA_GPU_CHECKS_BUDGET_S:-540}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ! timeout -k 5 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" bench/gpu_acceptance.py table --dry-run
  echo "bench/gpu_checks.sh: torch sees no CUDA GPU (expected one; fix: run it on a GPU machine with a CUDA build of torch)" >&2
  exit 2
fi
mkdir -p "$out"
results="$out/results.jsonl"
: > "$results"
t0=$(date +%s)
timeout -k 5 60 "$PY" -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$out/device.log"
mirror=${PA_GPU_CHECKS_MIRROR:-}
[ -n "$mirror" ] && mkdir -p "$mirror"

mirror_rows() {  # the rows so far, where a cut-off run still leaves them
  [ -n "$mirror" ] || return 0
  cp "$results" "$mirror/results.jsonl"
  timeout 30 "$PY" bench/gpu_acceptance.py table "$results" > "$mirror/table.md" 2>&1
}

row() {  # row STEP FIGURE PASS: a row for a step that did not write its own
  "$PY" bench/gpu_acceptance.py row "$1" "$2" "$3" --results "$results"
}

run() {  # run STEP LIMIT_S COMMAND...: the command under min(LIMIT_S, what is left of the budget)
  local name=$1 limit=$2 left
  shift 2
  left=$(( budget - ($(date +%s) - t0) ))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped, ${left}s of the ${budget}s budget left"
    row "$name" "not measured: no time left in the ${budget}s budget" none
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at +$(( $(date +%s) - t0 ))s, limit ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  tail -n 3 "$out/$name.log"
  echo "== $name: exit $rc"
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    row "$name" "timed out after ${limit}s (log: $out/$name.log)" false
  elif [ "$rc" -ne 0 ] && ! grep -q "\"step\": \"$name\"" "$results"; then
    row "$name" "failed: exit $rc (log: $out/$name.log)" false
  fi
  mirror_rows
}

check() {  # check NAME LIMIT_S [ARGS...]: one check of bench/gpu_acceptance.py
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" "$PY" bench/gpu_acceptance.py "$name" --results "$results" --out "$out/work" "$@"
}

check nccl 90
check dropout 120
check tf32 45
check fp8 90
# --load-repeats 0: audit-time measures the plain loading itself (3 fresh processes per arm took the step past 150 s)
run real_models 120 "$PY" bench/real_models.py --device cuda --batch 32 --models gpt2 --load-repeats 0 --json "$out/real_models.json"
if [ -s "$out/real_models.json" ]; then
  check audit-time 60 --real-models-json "$out/real_models.json"
else
  row audit-time "not measured: bench/real_models.py wrote no figures (log: $out/real_models.log)" false
  row loading "not measured: bench/real_models.py wrote no figures" false
fi
check speedup 120
check runtime 120
check calibration 45
run gpu_tests 240 "$PY" -m pytest -m gpu tests/gpu -q -p no:cacheprovider -rA
if [ -f "$out/gpu_tests.log" ] && ! grep -q '"step": "gpu_tests"' "$results"; then
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$out/gpu_tests.log" | tail -n 1 | tr -d '=')
  if grep -qE "[0-9]+ failed|error" <<< "$summary"; then ok=false; else ok=true; fi
  row gpu_tests "${summary:-no summary line}" "$ok"
fi

echo
echo "== done in $(( $(date +%s) - t0 ))s; logs in $out/"
mirror_rows
"$PY" bench/gpu_acceptance.py table "$results" | tee "$out/table.md"
