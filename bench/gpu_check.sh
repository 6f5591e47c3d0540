#!/usr/bin/env bash
# GPU check of meshkern's CUDA and Triton kernels and of the trainer on CUDA, ~5-6 min on one
# GPU (the steps' caps sum to 430 s on one GPU, plus the build when the CUDA kernels are missing):
#   bench/gpu_check.sh OUT_DIR
# 1. builds meshkern._mask_C and meshkern._spectral_C with their CUDA kernels if they are
#    missing (MAX_JOBS = all cores; the .cu files are the slow part, ~1-2 min);
# 2. runs every CUDA-marked test (tests/test_mask_cuda.py: mask bit-identity vs the
#    reference, opcheck, gradcheck, Philox known answers; tests/test_spectral_cuda.py:
#    sym_eig, project, randomized_svd on the cuda / compiled-Triton / reference backends;
#    tests/test_pca_cuda.py: the compiled Triton pca kernels against the reference);
# 3. the benches, each printing its goal lines:
#    - mask: cuda + triton vs the reference at the default shape, then T=16384, H=4096,
#      bf16: achieved GB/s of pack / unpack against the device's memory bandwidth (issue
#      15 goal >= 80%) and against a clone of the same tensor;
#    - spectral: SpectralAdamW.step vs AdamW.step (issue 15 goal <= 1.1x on a GPU) and
#      the batched SVD vs a loop of torch.svd_lowrank (issue 15 item 2's table);
#    - pca (issue 29): the Triton pca encode / decode vs the unfused torch path and vs the
#      GEMM of the same size, at H = 576, 2048, 4096 with the codec's k;
#    - pca nf (issue 28): quant=nf's encode / decode (Triton pack / unpack, cuBLAS GEMMs) vs
#      the reference, the GEMM and the fused int4 codec at the same bytes.
# Writes into OUT_DIR: env.txt, nvidia-smi.txt, build.log, tests.txt (+ junit.xml),
# mask_bench.txt/.json, mask_bw.txt/.json, spectral_step.txt, spectral_svd.txt,
# pca_bench.txt/.json, pca_nf_bench.txt/.json, trainer_1gpu.txt (+ trainer_nccl.txt with 2+ GPUs; run folders under runs/), and
# status.txt (one line per step: name, exit code, seconds). A step that fails or times
# out is recorded and the script goes on; summary.txt collects every goal line.
set -uo pipefail
out="${1:?usage: bench/gpu_check.sh OUT_DIR}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY=PASSIVE
: > "$out/status.txt"
T0=$SECONDS

step() {  # step NAME TIMEOUT_S CMD... : run, log exit code and duration
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@"
  local rc=$?
  echo "$name rc=$rc seconds=$((SECONDS - t0))" | tee -a "$out/status.txt"
  return 0
}

nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python -c "import torch, triton; p = torch.cuda.get_device_properties(0); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, p.name, 'mem clock kHz', getattr(p, 'memory_clock_rate', '?'), 'bus bits', getattr(p, 'memory_bus_width', '?'))" > "$out/env.txt" 2>&1

have_cuda_kernels() {
  python -c "import sys; from meshkern import _backend; sys.exit(0 if all(_backend.has_cuda_kernels(g) for g in ('mask', 'spectral')) else 1)" 2>/dev/null
}
if ! have_cuda_kernels; then
  MAX_JOBS="$(nproc)" MESHKERN_EXT=mask,spectral step build 200 \
    python setup.py -q build_ext --inplace --build-temp build/tmp_gpu_check > "$out/build.log" 2>&1
fi

step tests 90 python -u -m pytest -q -m cuda tests/test_mask_cuda.py tests/test_spectral_cuda.py tests/test_pca_cuda.py \
  --junitxml="$out/junit.xml" > "$out/tests.txt" 2>&1
step mask_bench 35 python -u -m bench.mask_bench --device cuda --repeats 30 --json "$out/mask_bench.json" \
  > "$out/mask_bench.txt" 2>&1
step mask_bandwidth 25 python -u -m bench.mask_bench --device cuda --shapes 16384x4096 --dtypes bfloat16 \
  --no-reference --repeats 50 --json "$out/mask_bw.json" > "$out/mask_bw.txt" 2>&1
step spectral_step 60 python -u -m bench.spectral_bench --device cuda --only step --repeats 10 --threads 8 \
  > "$out/spectral_step.txt" 2>&1
step spectral_svd 60 python -u -m bench.spectral_bench --device cuda --only svd --repeats 5 --threads 8 \
  > "$out/spectral_svd.txt" 2>&1
step pca_bench 30 python -u -m bench.pca_bench --device cuda --hidden 576 2048 4096 --tokens 16384 --repeats 20 \
  --json "$out/pca_bench.json" > "$out/pca_bench.txt" 2>&1
step pca_nf_bench 30 python -u -m bench.pca_nf_bench --device cuda --hidden 576 2048 4096 --tokens 16384 --repeats 20 \
  --json "$out/pca_nf_bench.json" > "$out/pca_nf_bench.txt" 2>&1

# 4. the trainer on the GPU (issue #29 item 3): the embedded default model, 1 replica x 2
#    stages, the default pca codec, 40 steps. Both stages share GPU 0 (NCCL refuses two ranks
#    on one device, so --mesh.device cuda picks gloo between them and sends the wire tensors
#    as CPU copies: orchestration/distributed/devices.py; ranks start with spawn). With 2+
#    GPUs also the NCCL path, one GPU per stage. ~20 s each on CPU for 3 steps.
step trainer_1gpu 100 python -u -m orchestration.train --mesh.device cuda --mesh.rows 1 --mesh.stages 2 \
  --train.steps 40 --run.out-dir "$out/runs" --run.name gpu-1x2-gloo > "$out/trainer_1gpu.txt" 2>&1
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  step trainer_nccl 100 python -u -m orchestration.train --mesh.device cuda --mesh.dist-backend nccl --mesh.rows 1 \
    --mesh.stages 2 --train.steps 40 --run.out-dir "$out/runs" --run.name gpu-1x2-nccl > "$out/trainer_nccl.txt" 2>&1
fi

{
  echo "== goal lines (total $((SECONDS - T0)) s)"
  grep -h -E "goal|PASS|FAIL|of peak" "$out/mask_bw.txt" "$out/mask_bench.txt" 2>/dev/null
  grep -h -E "vs AdamW|SpectralAdamW|reused G_proj" "$out/spectral_step.txt" 2>/dev/null
  grep -h -E "PASS|FAIL" "$out/spectral_svd.txt" 2>/dev/null
  grep -h -E "encode|decode" "$out/pca_bench.txt" "$out/pca_nf_bench.txt" 2>/dev/null
  tail -n 3 "$out/tests.txt" 2>/dev/null
  grep -h -E "^mesh |train step 40/40|held-out loss|measured tokens|^error" "$out/trainer_1gpu.txt" "$out/trainer_nccl.txt" 2>/dev/null | tail -n 6
} > "$out/summary.txt"
cat "$out/status.txt" "$out/summary.txt"
