#!/usr/bin/env bash
# Build the labs with the nvcc of `cargo xtask setup-cuda` and a static CUDA runtime: the decode
# GEMM lab (lab/gemm_lab.cu -> target/gemm-lab/gemm_lab; `gemm_lab quick` for fewer row counts),
# the prefill GEMM lab (lab/prefill_lab.cu -> target/gemm-lab/prefill_lab), the residency lab
# (prefetch_lab: decode projections from memory and from L2, and L2 prefetch) and the timeline
# lab (timeline_lab: the decode GEMM's phases per block, on a copy of the kernel that
# lab/timeline_gen.py writes from kernels/gemm.cu) and the decode attention lab (attention_lab:
# `paged_attention` from two cubins, bitwise against each other and timed; see its header), the
# decode TMA lab (decode_tma_lab: `linear_stream_tma` bitwise against the map-less decode kernels,
# timed per projection and over 36 Qwen3-8B-shaped layers), the delta-rule decode lab (gdn_lab:
# `gated_delta_streamed` bitwise against `gated_delta_recurrent`, both compiled in, and timed),
# the weight-stream lab (tma_stream_lab: the decode GEMM's tensor-map stream without the GEMM),
# standalone binaries to copy to the GPU machine and run there (each includes lab/lab_util.cuh).
# Extra arguments go to nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
NV=$(ls -d .xtask/cuda-venv/lib/python3*/site-packages/nvidia/cu13)
mkdir -p target/gemm-lab
python3 lab/timeline_gen.py
for lab in gemm_lab prefill_lab wgmma_lab prefetch_lab timeline_lab attention_lab decode_tma_lab gdn_lab tma_stream_lab; do
  "$NV/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas=-warn-spills \
    -I"$NV/include/cccl" -I"$NV/include" -Ikernels -Itarget/gemm-lab -L"$NV/lib" -cudart static \
    -o target/gemm-lab/$lab lab/$lab.cu "$@" &
done
wait
