#!/usr/bin/env bash
# The GPU proof in one command, for a machine with an NVIDIA GPU (written for one H200) and nvcc:
#   1. build: the CPU and CUDA kernels (sm_80 + sm_90 SASS, compute_90 PTX), editable install
#   2. backends: both libraries load, the CUDA one sees the device; SASS present for sm_90
#   3. tests/gpu: every CUDA kernel and every observe design against the CPU kernels, bit for bit
#      (histograms, min/max, observe, MSE errors, block MSE search; KL within a tolerance), one
#      QAT step on CUDA against the CPU step
#   4. benchmarks/gpu_observe.py: observe throughput of every design against the measured
#      device-to-device copy bandwidth, on 4 GiB tensors (target: >= 70%)
#   5. tests/gpu/test_nccl.py: NCCL calibration and QAT under torchrun
#   6. a summary of all figures (tests/gpu/summarize.py)
# Every stage has its own time limit (7.5 minutes in all; 132 s on an H200); a stage that
# fails is reported and the next one still runs; the exit status is the first failure's.
# No network and no dependency resolution: the environment must already hold torch, numpy,
# pytest, setuptools, wheel and qtool's other dependencies (the device image does).
#
#   OUT=/some/dir bash tests/gpu/run.sh      # results land in $OUT (default: a temporary dir)
#
# Files in $OUT: log (everything printed), build_info.json, junit.xml, junit_nccl.xml,
# gpu_observe.json, qat_step.json, summary.txt.
set -uo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$self")/../.." || exit 1
export PY="${PYTHON:-python3}"
export OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
if [ -z "${QTOOL_RUN_LOGGED:-}" ]; then  # once more, everything also into $OUT/log
  QTOOL_RUN_LOGGED=1 bash "$self" "$@" 2>&1 | tee "$OUT/log"
  exit "${PIPESTATUS[0]}"
fi
export PYTHONUNBUFFERED=1 QTOOL_GPU_RESULTS="$OUT"
started=$(date +%s)
status=0

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, remember the first failure
  # (a shell function runs as `bash -c NAME`: timeout needs a program)
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $(($(date +%s) - started))s)"
  timeout --kill-after=10 "$limit" "$@"
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "!! $name: stopped at its ${limit}s limit" || echo "!! $name: exit $rc"
    [ "$status" -eq 0 ] && status=$rc
  fi
  return "$rc"
}

# shellcheck disable=SC2329  # build and backends run through `bash -c` (stage)
build() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
    --format=csv,noheader || echo "nvidia-smi failed"
  command -v nvcc >/dev/null && nvcc --version | tail -2 || echo "nvcc not on PATH"
  "$PY" -c 'import sys, torch, numpy; print(sys.version.split()[0], torch.__version__, numpy.__version__)'
  rm -f qtool/_lib/*.so qtool/_lib/build_info.json
  if ! "$PY" -m pip install --no-deps --no-build-isolation -q -e .; then
    echo "!! pip install -e . failed: building the kernels in place and importing from here"
    "$PY" setup.py -q build_kernels --inplace || return 1
  fi
  cp qtool/_lib/build_info.json "$OUT/" && cat qtool/_lib/build_info.json
}

# shellcheck disable=SC2329
backends() {
  "$PY" -c 'import qtool.kernels as k; print(k.backends())' || return 1
  "$PY" -c 'import qtool.kernels as k, sys; sys.exit(0 if k.default_device() == "cuda" else 1)' \
    || { echo "CUDA backend not usable: the GPU tests would all be skipped"; return 1; }
  "$PY" -c 'import qtool.kernels as k; print("designs:", k.cuda_variants(), "default:", k.default_cuda_variant())'
  if command -v cuobjdump >/dev/null; then
    cuobjdump --list-elf qtool/_lib/libqtool_cuda.so
    cuobjdump --list-ptx qtool/_lib/libqtool_cuda.so
    cuobjdump -sass -arch sm_90 qtool/_lib/libqtool_cuda.so | "$PY" tests/gpu/summarize.py --sass
  else
    echo "cuobjdump not on PATH: SASS not inspected"
  fi
}

export -f build backends
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the in-place fallback imports from here
stage build 100 bash -c build
stage backends 30 bash -c backends || { echo "no usable CUDA backend: stopping"; exit 1; }

# the kernel and QAT checks first; NCCL (two torchrun runs of the CLI) after the benchmark
tests=()
for f in tests/gpu/test_*.py; do [ "$f" != tests/gpu/test_nccl.py ] && tests+=("$f"); done
stage tests 180 "$PY" -m pytest "${tests[@]}" -v -p no:cacheprovider --durations=15 \
  --junitxml="$OUT/junit.xml"
stage benchmark 70 "$PY" -m benchmarks.gpu_observe --gib 4 --json "$OUT/gpu_observe.json"
stage nccl 70 "$PY" -m pytest tests/gpu/test_nccl.py -v -p no:cacheprovider \
  --junitxml="$OUT/junit_nccl.xml"

echo "== summary"
"$PY" tests/gpu/summarize.py "$OUT" "$(($(date +%s) - started))" | tee "$OUT/summary.txt"
exit "$status"
