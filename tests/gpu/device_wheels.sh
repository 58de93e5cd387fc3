#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels the GPU machine lacks, for its Python 3.12 on x86-64, at
# the versions installed in this checkout's .venv (the versions CI tests). The GPU machine has no
# network; its image holds torch, lightning, transformers, accelerate, numpy, pandas, pyarrow and
# the rest, but not TRL, datasets, jsonargparse, omegaconf or OpenSpiel. vLLM cannot travel: its
# wheel is far over the 64 MiB a call may carry, so the acceptance's vllm part is left out there.
#
#   bash tests/gpu/device_wheels.sh        # then: tests/gpu/device_run.sh on the GPU machine, .whl carried
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
NAMES="trl datasets dill multiprocess omegaconf jsonargparse docstring-parser typeshed-client open-spiel ml-collections"
PINS=$("$PY" - $NAMES <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
pins = []
for name in sys.argv[1:]:
    try:
        pins.append(f"{name}=={version(name)}")
    except PackageNotFoundError:
        sys.exit(f"{name} is not installed in this environment: run scripts/setup.sh first")
print(" ".join(pins))
PYEOF
)
rm -rf "$ROOT/.whl"
mkdir -p "$ROOT/.whl"
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$ROOT/.whl" $PINS
size=$(du -sm "$ROOT/.whl" | cut -f1)
echo "wrote $(ls "$ROOT/.whl" | wc -l) wheels, ${size} MiB, to $ROOT/.whl: $PINS"
if (( size > 48 )); then echo "the wheels take ${size} MiB: with the tree they must stay under 64 MiB" >&2; exit 1; fi
