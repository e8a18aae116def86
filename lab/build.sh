#!/usr/bin/env bash
# Build the GEMM lab (lab/gemm_lab.cu) with the nvcc of `cargo xtask setup-cuda` and a static CUDA
# runtime: target/gemm-lab/gemm_lab, a standalone binary to copy to the GPU machine and run there
# (`gemm_lab`, or `gemm_lab quick` for fewer row counts). Extra arguments go to nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
NV=$(ls -d .xtask/cuda-venv/lib/python3*/site-packages/nvidia/cu13)
mkdir -p target/gemm-lab
"$NV/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas=-warn-spills \
  -I"$NV/include/cccl" -I"$NV/include" -Ikernels -L"$NV/lib" -cudart static \
  -o target/gemm-lab/gemm_lab lab/gemm_lab.cu "$@"
