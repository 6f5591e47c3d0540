#!/usr/bin/env bash
# GPU check of the mask kernels (CUDA + compiled Triton), < 5 min on one GPU:
#   bench/gpu_check.sh OUT_DIR
# Builds meshkern._mask_C with its CUDA kernels if they are missing, runs the CUDA-marked
# mask tests (bit-identity vs the reference, opcheck, gradcheck, Philox known answers),
# then the kernel benchmark table on the GPU. Writes into OUT_DIR:
#   env.txt, nvidia-smi.txt, build.log, tests.txt (+ junit.xml), mask_bench.txt/.json,
#   status.txt (one line per step: name, exit code, seconds).
set -uo pipefail
out="${1:?usage: bench/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
: > "$out/status.txt"

step() {  # step NAME TIMEOUT_S CMD... : run, log exit code and duration
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/status.txt"
  return 0
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())" > "$out/env.txt" 2>&1

if ! python -c "import sys, torch; from meshkern import _backend; sys.exit(0 if _backend.has_cuda_kernels('mask') and hasattr(torch.ops.meshkern_C, 'mask_pack') else 1)" 2>/dev/null; then
  # -j: the .cu is the slow part (~1-2 min); MAX_JOBS lets ninja use the cores.
  MAX_JOBS="$(nproc)" MESHKERN_EXT=mask step build 240 \
    python setup.py -q build_ext --inplace --build-temp build/tmp_mask_cuda > "$out/build.log" 2>&1
fi

step tests 150 python -u -m pytest -q -m cuda tests/test_mask_cuda.py --junitxml="$out/junit.xml" > "$out/tests.txt" 2>&1
step bench 150 python -u -m bench.mask_bench --device cuda --full --repeats 30 --json "$out/mask_bench.json" \
  > "$out/mask_bench.txt" 2>&1
cat "$out/status.txt"
