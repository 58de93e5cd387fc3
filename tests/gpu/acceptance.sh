#!/usr/bin/env bash
# GPU acceptance of issue 16, on one CUDA GPU, in under 8 minutes (each part has a hard time limit;
# the limits add up to 7 min 50 s). Figures go to CSV files under the output directory:
#
#   fit_hf.csv, fit_vllm.csv      per RL step: stage seconds and tokens/s (rollout, experience, train),
#                                 logprob/mismatch after the weight sync, reward, tokens generated
#   memory_hf.csv, memory_vllm.csv  per stage: torch.cuda.max_memory_allocated vs the memory model
#   plan_errors_hf.csv, plan_errors_vllm.csv  per stage of every step after the first: `earl plan`'s
#                                 predicted seconds (the time model on this GPU's device profile) and
#                                 peak memory against the measured ones, with their errors
#   oom.csv                       the train stage under a memory cap: a real torch.OutOfMemoryError
#                                 with the big micro-batch, recovered by AdaptiveParallelism
#   vs_trl.csv, vs_trl_runs.csv   benchmarks/vs_trl.py --quick on the GPU
#   parts.csv                     exit code and seconds of every part; <part>.log its output
#
# The model is Qwen2.5-0.5B-shaped with random weights, bf16 (tests/gpu/acceptance.py).
#
#   bash tests/gpu/acceptance.sh [OUT_DIR]           # OUT_DIR default: $OUT, else runs/gpu_acceptance
#   bash tests/gpu/acceptance.sh --dry-run [OUT_DIR] # CPU, earl-tiny, 2 steps: checks the plumbing only
#   PARTS="fit_hf oom" bash tests/gpu/acceptance.sh ...  # only these parts (default: all four)
#
# Needs the project installed with a CUDA torch, TRL and vLLM (pip install -e '.[vllm]');
# PYTHON picks the interpreter (default .venv/bin/python, else python). On a lent GPU machine with
# no network, tests/gpu/device_run.sh installs carried wheels and runs this (without fit_vllm: vLLM's
# wheel is too large to carry). Exit status: 0 when every
# part passed, 1 when one failed (the others still run), 2 when there is no GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
if [[ $# -gt 1 ]]; then echo "usage: $0 [--dry-run] [OUT_DIR]" >&2; exit 64; fi
OUT_DIR="${1:-${OUT:-$ROOT/runs/gpu_acceptance}}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[[ -x "$PY" ]] || PY="$(command -v python3 || command -v python)"
mkdir -p "$OUT_DIR" || { echo "cannot create $OUT_DIR" >&2; exit 64; }
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
cd "$ROOT" || exit 64

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Every part is a fresh one-process job: a launcher's variables inherited from the caller (a torchrun
# or a test process) would point its process group at a port that is not its own.
# The names are earl_lightning.parallel.launch_env's, the list the Python launchers use.
while read -r var; do [[ -n "$var" ]] && unset "$var"; done < <("$PY" -m earl_lightning.parallel.launch_env)
export TOKENIZERS_PARALLELISM=false VLLM_LOGGING_LEVEL=WARNING TRL_EXPERIMENTAL_SILENCE=1
if [[ $DRY == 1 ]]; then
  DEV=(--device cpu --preset earl-tiny --steps 2)
  BENCH=(--device cpu --steps 2 --multi-steps 2 --warmup 1 --lengths 8 --turns 3 --batch 16)
  export VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE=1
  LIMITS=(300 420 300 420)
else
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "no CUDA GPU visible to $PY; for a CPU check of the plumbing use --dry-run" >&2
    exit 2
  fi
  DEV=(--device cuda)
  BENCH=(--device cuda)
  LIMITS=(90 150 70 160)    # seconds: fit hf, fit vllm, oom, vs_trl (7 min 50 s in all)
fi

status=0
echo "part,exit_code,seconds" > "$OUT_DIR/parts.csv"
ALL_PARTS="fit_hf fit_vllm oom vs_trl"
PARTS="${PARTS:-$ALL_PARTS}"
for part in $PARTS; do
  [[ " $ALL_PARTS " == *" $part "* ]] || { echo "unknown part '$part' in PARTS; the parts: $ALL_PARTS" >&2; exit 64; }
done
run_part() {  # run_part NAME LIMIT_S CMD...: output to NAME.log, a row in parts.csv
  local name=$1 limit=$2 start rc
  shift 2
  [[ " $PARTS " == *" $name "* ]] || return 0
  start=$(date +%s)
  echo "== $name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$OUT_DIR/$name.log" 2>&1
  rc=$?
  echo "$name,$rc,$(( $(date +%s) - start ))" >> "$OUT_DIR/parts.csv"
  grep -E '^(wrote|hf |vllm |oom events|\|)' "$OUT_DIR/$name.log" || true
  if [[ $rc -ne 0 ]]; then
    status=1
    echo "!! $name failed (exit $rc$([[ $rc == 124 ]] && echo ': time limit')); last lines of $OUT_DIR/$name.log:"
    tail -n 15 "$OUT_DIR/$name.log"
  fi
}

run_part fit_hf "${LIMITS[0]}" "$PY" -m tests.gpu.acceptance fit --backend hf --out "$OUT_DIR" "${DEV[@]}"
run_part fit_vllm "${LIMITS[1]}" "$PY" -m tests.gpu.acceptance fit --backend vllm --out "$OUT_DIR" "${DEV[@]}"
run_part oom "${LIMITS[2]}" "$PY" -m tests.gpu.acceptance oom --out "$OUT_DIR" "${DEV[@]}"
run_part vs_trl "${LIMITS[3]}" "$PY" benchmarks/vs_trl.py --quick --out "$OUT_DIR/vs_trl.csv" "${BENCH[@]}"

echo "== parts (exit code 0 = passed)"
cat "$OUT_DIR/parts.csv"
echo "figures in $OUT_DIR"
exit $status
