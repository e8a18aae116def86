#!/usr/bin/env bash
# Build the labs with the nvcc of `cargo xtask setup-cuda` and a static CUDA runtime: the decode
# GEMM lab (lab/gemm_lab.cu -> target/gemm-lab/gemm_lab; `gemm_lab quick` for fewer row counts)
# and the prefill GEMM lab (lab/prefill_lab.cu -> target/gemm-lab/prefill_lab), standalone
# binaries to copy to the GPU machine and run there (both include lab/lab_util.cuh). Extra
# arguments go to nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
NV=$(ls -d .xtask/cuda-venv/lib/python3*/site-packages/nvidia/cu13)
mkdir -p target/gemm-lab
for lab in gemm_lab prefill_lab wgmma_lab; do
  "$NV/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas=-warn-spills \
    -I"$NV/include/cccl" -I"$NV/include" -Ikernels -L"$NV/lib" -cudart static \
    -o target/gemm-lab/$lab lab/$lab.cu "$@" &
done
wait
