#!/usr/bin/env bash
# Set up earl_lightning on a fresh machine (CPU): a virtual environment in .venv with the CPU
# build of torch 2.13.0 installed first (so no dependency can pull a CUDA build), then the project
# with its dev extras. Idempotent: a second run only checks that everything is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
python -c "import torch, lightning, transformers, trl, pyspiel; print('earl_lightning set-up ok: torch', torch.__version__, '| lightning', lightning.__version__, '| transformers', transformers.__version__)"
