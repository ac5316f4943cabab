#!/usr/bin/env bash
# Everything this project measures on a GPU, in one run of about seven minutes on an H100/H200 (a lent GPU's
# time is short: run this first, then read the logs). Needs precision-audit installed (with its test extra)
# and a CUDA GPU; transformers for the real models. Results: bench/README.md, "On a GPU".
#
#   bench/gpu_checks.sh [OUT_DIR]      (default: ./gpu-checks; one log per step, and real_models.json)
#
# Each step has its own time limit, so that one that hangs cannot take the others' time.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "== $name (at +$(( $(date +%s) - t0 ))s, limit ${limit}s)"
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]}"
}
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bench/gpu_checks.sh: torch sees no CUDA GPU (expected one; fix: run it on a GPU machine with a CUDA build of torch)" >&2
  exit 2
fi
mkdir -p "$out"
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$out/device.log"
step gpu_tests 300 python -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider -rA --durations=0
step runtime_launch_bound 60 python bench/runtime_overhead.py --device cuda --repeats 100
step runtime_gpu_bound 90 env PA_WIDTH=4096 PA_BATCH=8192 python bench/runtime_overhead.py --device cuda --repeats 30
step memory_stages 180 python bench/gpu_memory_stages.py --models t5,gpt2 --batch 32
step real_models 300 python bench/real_models.py --device cuda --batch 32 --models t5,gpt2,llama,vit \
  --json "$out/real_models.json"
echo "done in $(( $(date +%s) - t0 ))s; logs in $out/"
