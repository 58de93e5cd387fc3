#!/usr/bin/env bash
# One call on a lent GPU machine (the `device` tool): install the carried wheels, check the
# requirements, run tests/gpu and the acceptance script, and bundle every figure and log into
# $OUT/gpu_results.tgz (the tool returns at most 8 files), with parts.csv and the summary beside it.
#
#   here:   bash tests/gpu/device_wheels.sh
#   device: run(command="bash tests/gpu/device_run.sh", carry=[".whl"], timeout_s=570)
#   DRY_RUN=1 PYTHON=.venv/bin/python PARTS=oom bash tests/gpu/device_run.sh   # the plumbing, here on CPU
#
# Budget (the machine starts in a minute or two, 15 minutes of device time in all): install ~20 s,
# tests/gpu <= 120 s, acceptance parts fit_hf + oom + vs_trl <= 320 s (their own limits); PARTS
# narrows the acceptance parts. fit_vllm is left out by default: vLLM's wheel cannot be carried.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 64
OUT="${OUT:-$ROOT/runs/device}"
RES="$(mktemp -d)"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHON="${PYTHON:-python3}"
bundle() {
  nvidia-smi > "$RES/nvidia_smi.txt" 2>&1
  [[ -f "$RES/acceptance/parts.csv" ]] && cp "$RES/acceptance/parts.csv" "$OUT/parts.csv"
  tar -czf "$OUT/gpu_results.tgz" -C "$RES" . && echo "bundled $(find "$RES" -type f | wc -l) files into $OUT/gpu_results.tgz"
}
trap bundle EXIT
{
  date -u; uname -m; "$PYTHON" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())'
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    echo "dry run: this environment's packages, acceptance --dry-run (CPU)"; "$PYTHON" tests/gpu/device_check.py
  elif compgen -G ".whl/*.whl" > /dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing the carried wheels failed"; exit 3; }
    export PYTHONPATH="/tmp/site:$ROOT"
    "$PYTHON" tests/gpu/device_check.py --site /tmp/site
  else
    echo "no .whl/ carried: run tests/gpu/device_wheels.sh here and name .whl in carry"; exit 3
  fi
} 2>&1 | tee "$RES/setup.log"
[[ ${PIPESTATUS[0]} == 0 ]] || exit 3
export PYTHONPATH="/tmp/site:$ROOT"
timeout --kill-after=10 120 "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$RES/pytest_gpu.log"
DRY=(); [[ "${DRY_RUN:-0}" == 1 ]] && DRY=(--dry-run)
PARTS="${PARTS:-fit_hf oom vs_trl}" bash tests/gpu/acceptance.sh "${DRY[@]}" "$RES/acceptance" 2>&1 | tee "$RES/acceptance.log"
status=${PIPESTATUS[0]}
grep -hE "passed|failed|error|skipped" "$RES/pytest_gpu.log" | tail -1 > "$OUT/summary.txt"
tail -n 20 "$RES/acceptance.log" >> "$OUT/summary.txt"
exit "$status"
