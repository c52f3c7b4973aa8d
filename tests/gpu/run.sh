#!/usr/bin/env bash
# GPU check for a machine with an NVIDIA GPU (H200/H100/A100) and nvcc: build in place, show the
# backends, compare every CUDA kernel with the CPU one, and time CPU vs CUDA. Under 5 minutes.
# No build isolation and no dependency resolution: the machine may have no network, the
# environment must already hold numpy, pytest, setuptools and wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python}"

echo "== build"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
command -v nvcc >/dev/null || echo "warning: nvcc not on PATH (CUDA_HOME=${CUDA_HOME:-unset})"
"$PY" -m pip install --no-deps --no-build-isolation -q -e .
cat qtool/_lib/build_info.json

echo "== backends"
"$PY" -c 'import qtool.kernels as k; print(k.backends())'
"$PY" -c 'import qtool.kernels as k, sys; sys.exit(0 if k.default_device() == "cuda" else 1)' \
  || { echo "CUDA backend not usable: the GPU tests would all be skipped"; exit 1; }

echo "== tests"
"$PY" -m pytest tests/gpu -v -p no:cacheprovider

if [ -f benchmarks/kernels.py ]; then
  echo "== benchmark"
  "$PY" benchmarks/kernels.py
fi
