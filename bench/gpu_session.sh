#!/usr/bin/env bash
# One lent GPU session in one command: install precision-audit (and wheels carried for what the image lacks), run
# bench/gpu_checks.sh under a hard cap, and leave its rows in MIRROR_DIR after every step.
#
#   bench/gpu_session.sh MIRROR_DIR [WHEEL_DIR]        (PA_GPU_CHECKS_BUDGET_S, default 420: the checks' budget)
#
# Written after a session whose only run was cut off by the machine's 600 s call limit and returned nothing (not
# one row: the table was to be copied out at the end; bench/README.md, "On a GPU"). Hence: the cap sits well under
# the call limit, every step's row is mirrored at once, and the interpreter is found whether the image calls it
# python or only python3. WHEEL_DIR holds wheels for the image's Python (there: jsonschema and its needs, torchao);
# they go to /tmp/site, on PYTHONPATH, beside the image's own torch.
set -u
cd "$(dirname "$0")/.."
mirror=${1:?usage: bench/gpu_session.sh MIRROR_DIR [WHEEL_DIR]}
wheels=${2:-}
budget=${PA_GPU_CHECKS_BUDGET_S:-420}
t0=$(date +%s)
mkdir -p "$mirror"
PY=$(command -v python || command -v python3)
export PA_PYTHON=$PY PYTHONUNBUFFERED=1
if [ -n "$wheels" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
    || { echo "gpu_session: the wheels in $wheels did not install" >&2; exit 3; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# the console script lands beside the interpreter, which need not be on PATH under that name
export PATH=$(dirname "$PY"):$PATH
timeout -k 5 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . > "$mirror/install.log" 2>&1 \
  || { tail -n 20 "$mirror/install.log"; exit 3; }
echo "gpu_session: installed at +$(( $(date +%s) - t0 ))s with $PY"
PA_GPU_CHECKS_MIRROR=$mirror PA_GPU_CHECKS_BUDGET_S=$budget \
  timeout -k 10 $(( budget + 40 )) bash bench/gpu_checks.sh /tmp/gpu-checks
rc=$?
echo "gpu_session: checks exit $rc at +$(( $(date +%s) - t0 ))s"
(cd /tmp && find gpu-checks -maxdepth 1 -name '*.log' | tar czf "$mirror/logs.tgz" -T -) 2>/dev/null
exit $rc
