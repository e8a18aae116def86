#!/usr/bin/env bash
# Build the labs, standalone binaries to copy to the GPU machine and run there, with the nvcc of
# `cargo xtask setup-cuda` and a static CUDA runtime, into target/gemm-lab/:
# - gemm_lab: the decode GEMMs and lab variants, bitwise against the tiled kernel, timed per
#   projection and over 36 Qwen3-8B-shaped layers (`gemm_lab quick`, `gemm_lab narrow`);
# - prefill_lab: the prefill GEMMs at prefill row counts;
# - wgmma_lab: whether wgmma reproduces the mma.sync chains' sums bit for bit;
# - prefetch_lab: decode projections from device memory and from L2, and L2 prefetch;
# - attention_lab: `paged_attention` from two cubins, bitwise against each other and timed;
# - decode_tma_lab: `linear_stream_tma` against the map-less decode kernels, bitwise and timed;
# - gdn_lab: `gated_delta_streamed` against `gated_delta_recurrent`, bitwise and timed;
# - tma_stream_lab: the decode GEMM's tensor-map weight stream without the GEMM;
# - fp8_swap_lab: `linear_stream_fp8` at m <= 8 (the weight as the MMA's A operand) against its
#   direct path with the weight as the B operand, bitwise and timed;
# - fp8_exact_lab: `linear_stream_fp8` against a candidate numerics (exact e4m3 weights through
#   f16 MMAs, the block scale applied to each block's sums), timed and each against the exact
#   weight;
# - wgmma_attention_lab: whether warpgroup MMAs (scores from shared memory, P V with P in
#   registers, V transposed or read through the instruction's transpose) reproduce the prefill
#   attention unit's arithmetic bit for bit, the rate of a pipelined kernel made of them, and
#   decode rows in chains of 256 tokens (a candidate arithmetic) against the same reference;
# - fp8_mma_lab: whether FP8 x FP8 tensor-core sums (e4m3) are the same from mma.sync m16n8k32 and
#   wgmma m64n8k32, and which rounding model one instruction follows;
# - fp8_act_lab: the decode GEMM with FP8 activations (x quantized per 128 columns) and the
#   weight bytes straight into e4m3 MMAs, timed and each against the exact weight beside
#   linear_stream_fp8;
# - fp8_tma_lab: the FP8 tensor-map GEMMs (`linear_stream_tma_fp8`, `linear_tma_fp8`) against
#   the map-less FP8 paths, bitwise, and timed at decode rows 1..128 and at 2048 prefill rows;
# - attention_pieces_lab: decode attention in a candidate arithmetic cut at absolute positions
#   (64-key softmax tiles, pieces of 2 to 8 tiles folded in order), bitwise against a prefill-style
#   walk in the same arithmetic, and timed.
# Each program's header says what it measures and which arguments it takes. Extra arguments go
# to nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
NV=$(ls -d .xtask/cuda-venv/lib/python3*/site-packages/nvidia/cu13)
mkdir -p target/gemm-lab
labs="gemm_lab prefill_lab wgmma_lab prefetch_lab attention_lab decode_tma_lab gdn_lab tma_stream_lab
  fp8_swap_lab fp8_exact_lab wgmma_attention_lab fp8_mma_lab fp8_act_lab fp8_tma_lab attention_pieces_lab"
pids=()
for lab in $labs; do
  "$NV/bin/nvcc" -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Xptxas=-warn-spills \
    -I"$NV/include/cccl" -I"$NV/include" -Ikernels -L"$NV/lib" -cudart static \
    -o target/gemm-lab/$lab lab/$lab.cu "$@" &
  pids+=("$!")
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
exit "$failed"
