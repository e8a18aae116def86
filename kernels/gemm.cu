// out = x · wᵀ with a bf16 weight in the checkpoint's [out_features, in_features] layout. CPU
// twins: metrale-gpu-runtime/src/cpu/kernels/gemm.rs.
//
// Six kernels per output type (bf16: `linear`, `linear_stream`, `linear_stream_b4`,
// `linear_stream_wide`, `linear_stream_tma`, `linear_tma`; f32: the same with `_f32out`), each
// computing the whole function, and `linear_swiglu` (the gate/up projection and `silu_mul` in
// one launch, decode) and `linear_tma_swiglu` (`linear_tma` and `silu_mul_staged` in one launch,
// prefill). The launcher (`ops_gemm::linear_path`) runs `linear_stream_b4` for m <= 16 on
// projections of 6144 columns or more, `linear_stream` for the other m <= 16,
// `linear_stream_tma` for 9..128 rows where the weight has a tensor map and x fits in at most
// four row blocks, `linear_stream_wide` for the other m <= 128 (decode), and `linear_tma` or the
// tiled `linear` above, every one as a programmatic dependent launch: each kernel calls
// `pdl_wait` (common.cuh) before it touches x or out, so its blocks may start while the kernel
// ahead of it on the stream finishes, and the decode kernels issue their first weight loads
// before that wait (the weight is never written by the kernel just ahead of a projection).
// - `linear_stream` (m <= 16, gemm_direct.cuh): persistent blocks taking units of one column
//   tile (8 output columns) by one row tile (16 rows) in turn; as many blocks as are resident
//   (two a multiprocessor), 256 threads, 8 KiB of static shared memory. Warp w computes segment
//   w, loading its 16-byte weight fragments straight into registers (ld.global.nc, no L1
//   allocation, a 256-byte L2 prefetch): batches of LIN_D_B (8) chunks at m <= 8, LIN_D_B_RB (4)
//   above (x rows g + 8 too) or where the operands are unaligned; two batches in flight per
//   warp, running on from one unit into the next, so no unit's first loads wait for a block to
//   retire and another to start. x is read through L1. The warps leave their segment partials
//   in shared memory and the block sums them in segment order. `linear_stream_b4` is the same
//   with batches of 4 (2) chunks and three blocks per multiprocessor. The weight goes to
//   registers rather than through a bulk-copy ring: the copy engine wants larger copies than a
//   segment's weight row gives.
// - `linear_stream_wide` (16 < m <= 128, gemm_wide.cuh): a cluster of LIN_SEGS blocks per tile
//   of 128 columns by 64 rows, block s computing segment s; x and the weight staged together
//   through a 3-stage cp.async ring; the cluster sums the segment partials in order through
//   distributed shared memory.
// - `linear_stream_tma` (9 <= m <= 128 where the weight has a tensor map,
//   gemm_stream_tma.cuh): persistent clusters of LIN_SEGS blocks, one a multiprocessor, taking
//   tiles of 128 columns in turn; the weight by tensor map into a ring that runs on across
//   tiles, as wgmma's register operand; each block's segment of x (or of a row block of x, where
//   the whole segment would not fit) copied once into shared memory, by bulk copies from the
//   stage images its producer wrote where the launcher gives them (17..128 rows); the producer
//   warpgroup's idle warps sum the tiles' segment partials. It keeps more of the weight stream
//   in flight than `linear_stream_wide`, which it replaces where a map exists.
// - `linear_tma` (prefill, m > 128, where the launcher has a staging buffer for x and the shape
//   allows: k % 8 == 0, 16-byte aligned operands, gemm_wgmma.cuh): after `permute_k32_tiles`
//   writes x as stage images (or a `_staged` producer did), the weight as wgmma's register
//   operand through a tensor map, 128 x 128 tiles. `linear_tma_swiglu` (`_fp8`) is its body on
//   tiles of 64 gate and the same 64 up rows of the [gate; up] weight (two 64-row boxes a
//   stage), each tile's values exchanged through shared memory into silu(gate) * up, written as
//   the down projection's stage images: the [m, 2 ffn] projection is never stored.
// - `linear` (prefill, m > 128, otherwise, gemm_wgmma.cuh): warp-specialized Hopper warpgroup
//   MMAs (`linear_ws`): 192 x 128 output tiles, a producer warpgroup filling a 5-stage ring and
//   three consumer warpgroups of m64n128k16 wgmma; grid (ceil(n / 128), ceil(m / 192)), 512
//   threads, 202 KiB of dynamic shared memory. The 8-byte copies that fill its ring bound its
//   rate (a deeper ring does not help), which is why `linear_tma` serves the shapes it can.
//   The compute_90 PTX, which has no wgmma, runs the mma.sync tiles of `linear_tiled`
//   (gemm_mma.cuh) instead, with the same numerics.
// Block-FP8 weights compute `linear` of the bf16 weight the FP8 one stands for, each fragment
// converted as it is read (gemm_fp8.cuh), so their rows are bitwise the bf16 kernels' on
// `dequant_fp8`'s output: where the weight has a tensor map (its e4m3 bytes, 64-byte boxes under
// the 64-byte swizzle, `TmaWFp8`), `linear_stream_tma_fp8` for 17..128 rows and `linear_tma_fp8`
// at prefill sizes, the bf16 tensor-map kernels with the conversion in their fragment loads;
// otherwise `linear_stream_fp8` for m <= 16, `linear_stream_wide_fp8` for 16 < m <= 128 and
// `dequant_fp8` then the bf16 kernels above. At m <= 16 on the checkpoints' shapes
// `linear_stream_fp8` gives the weight the MMA's A operand and x the B operand
// (`linear_fp8_swapped`, gemm_direct.cuh): the same k sets per MMA, transposed, which the H200
// computes bit for bit as the other order (`lab/fp8_swap_lab.cu`; the GPU tests hold it).
// Figures for each path: docs/BENCHMARKS.md.
//
// Numerics (the same in every kernel, hence batch-invariant): k is cut into chunks of 32 and the
// chunks into LIN_SEGS (8) contiguous segments of ceil(chunks / 8) chunks, a count fixed by k
// alone. A segment's partial is a chain of mma.sync m16n8k16 (bf16 in, f32 accumulate) over its
// chunks in order, starting from zero; every output element is the f32 sum of the non-empty
// segments' partials in segment order, starting from 0. Inside a chunk, lane (g = lane / 4,
// q = lane % 4) holds k 8q..8q+7 of its rows (one 16-byte load); the first MMA takes k 8q..8q+3
// and the second 8q+4..8q+7, the same permutation of k for x and w, so the dot product is
// unchanged. Row r always sits at position r % 16 of its MMA and column c at c % 8, whatever m
// is; out-of-range rows, columns and k are zero. So a row's output is bitwise the same whatever
// `m` is and whichever kernel runs it (`linear_ws` feeds each wgmma k16 step the same 16 k as
// the matching m16n8k16, which gives the same sums). Prefill does not use cuBLASLt: its
// algorithm (and so its rounding) changes with m, which would break "prefix-cached vs cold" and
// "batched vs alone" bitwise equality.
//
// Every kernel checks the block size it is compiled for and refuses any other launch with a
// fault (`mt_fault`, reason GEOMETRY) instead of computing.
#include "common.cuh"

#include <cooperative_groups.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace cg = cooperative_groups;

#include "gemm_mma.cuh"
#include "gemm_fp8.cuh"
#include "gemm_wide.cuh"
#include "gemm_direct.cuh"
#include "gemm_wgmma.cuh"
#include "gemm_stream_tma.cuh"

// `kernel`: the entry's MT_KERNEL_* (for its fault). W: the weight's format (`WideWBf16`,
// `WideWFp8`) with STAGE_CH chunks a stage and STAGES stages.
template <typename OutT, int STAGE_CH, int STAGES, typename W>
MT_DEVICE void linear_stream_wide_dispatch(OutT* out, const bf16* x, const W& w, uint32_t m,
                                           uint32_t n, uint32_t k, uint32_t kernel) {
    extern __shared__ __align__(16) unsigned char lin_stream_smem[];
    // Uniform over the grid, so every block of a cluster leaves together.
    if (m == 0 || n == 0) return;
    if (blockDim.x != LIN_STREAM_WARPS * 32) {
        mt_fault(kernel, MT_FAULT_GEOMETRY);
        return;
    }
    if (k % 8 != 0 || !aligned16(x) || !w.vec(k))
        linear_wide_impl<OutT, LIN_W_NT, STAGE_CH, STAGES, false>(out, x, w, m, n, k, lin_stream_smem,
                                                                   blockIdx.x / LIN_SEGS);
    else
        linear_wide_impl<OutT, LIN_W_NT, STAGE_CH, STAGES, true>(out, x, w, m, n, k, lin_stream_smem,
                                                                  blockIdx.x / LIN_SEGS);
}

// The bf16 weight of `linear_stream_wide`.
using WideBf16 = WideWBf16<64 * LIN_W_NT, LIN_W_STAGE_CH>;

// linear_stream_wide(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): `linear`, the
// decode path for 16 < m <= 128. Clusters of LIN_SEGS blocks, grid (LIN_SEGS * ceil(n / 128) *
// ceil(m / 64)), 256 threads, LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64 bytes of dynamic shared
// memory (72 KiB).
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_wide(LINEAR_PARAMS(bf16)) {
    linear_stream_wide_dispatch<bf16, LIN_W_STAGE_CH, LIN_W_STAGES>(out, x, WideBf16{w}, m, n, k,
                                                                   MT_KERNEL_LINEAR_STREAM_WIDE);
}

// linear_stream_wide_f32out(out: f32 [m, n], x, w, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_wide_f32out(LINEAR_PARAMS(float)) {
    linear_stream_wide_dispatch<float, LIN_W_STAGE_CH, LIN_W_STAGES>(out, x, WideBf16{w}, m, n, k,
                                                                    MT_KERNEL_LINEAR_STREAM_WIDE_F32OUT);
}

#define LIN_D_B 8     // chunks per batch of the m <= 8 instance
#define LIN_D_B_RB 4  // chunks per batch of the m > 8 instance (x rows g + 8 as well)

// B: chunks per batch of the aligned m <= 8 instance; BR: of the others (x rows g + 8 as well, or
// scalar loads, which need more registers). The choice is the launch's, uniform over its blocks.
// SWIGLU: `linear_swiglu` (see `linear_direct_impl`).
// `kernel`: the entry's MT_KERNEL_* (for its fault).
// W: the weight's format (`DirectWBf16`, `DirectWFp8`).
// The direct kernels' segment partials (two buffers, by unit parity): one array, whichever
// instances a kernel holds.
MT_DEVICE float4 (*lin_direct_part())[LIN_STREAM_WARPS * 32] {
    __shared__ float4 part[2][LIN_STREAM_WARPS * 32];
    return part;
}

template <typename OutT, int B, int BR, bool SWIGLU = false, typename W>
MT_DEVICE void linear_direct_dispatch(OutT* out, const bf16* x, const W& w, uint32_t m,
                                      uint32_t n, uint32_t k, uint32_t kernel) {
    float4(*part)[LIN_STREAM_WARPS * 32] = lin_direct_part();
    if (m == 0 || n == 0) return;
    if (blockDim.x != LIN_STREAM_WARPS * 32) {
        mt_fault(kernel, MT_FAULT_GEOMETRY);
        return;
    }
    if (blockIdx.x >= ((n + 7) / 8) * ((m + 15) / 16)) return;  // uniform over the block
    const bool vec = k % 8 == 0 && aligned16(x) && w.aligned();
    const bool rb = m > 8;
    if (vec) {
        if (rb)
            linear_direct_impl<OutT, BR, true, true, SWIGLU>(out, x, w, m, n, k, part);
        else
            linear_direct_impl<OutT, B, false, true, SWIGLU>(out, x, w, m, n, k, part);
    } else {  // scalar loads need more registers: the smaller batch
        if (rb)
            linear_direct_impl<OutT, BR, true, false, SWIGLU>(out, x, w, m, n, k, part);
        else
            linear_direct_impl<OutT, BR, false, false, SWIGLU>(out, x, w, m, n, k, part);
    }
}

// linear_stream(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): `linear`, the
// decode path for m <= 16. Grid: any number of blocks up to the units (ceil(n / 8) *
// ceil(m / 16)), the launcher's as many as are resident; 256 threads, no dynamic shared memory.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    linear_stream(LINEAR_PARAMS(bf16)) {
    linear_direct_dispatch<bf16, LIN_D_B, LIN_D_B_RB>(out, x, DirectWBf16{w}, m, n, k, MT_KERNEL_LINEAR_STREAM);
}

// linear_stream_f32out(out: f32 [m, n], x, w, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    linear_stream_f32out(LINEAR_PARAMS(float)) {
    linear_direct_dispatch<float, LIN_D_B, LIN_D_B_RB>(out, x, DirectWBf16{w}, m, n, k, MT_KERNEL_LINEAR_STREAM_F32OUT);
}

// linear_stream_b4(out: bf16 [m, n], x, w, m, n, k): `linear_stream` with batches of 4 chunks (2
// for 16-row units and unaligned operands) and three blocks per multiprocessor, the launcher's
// choice for m <= 16 on projections of 6144 columns or more (qkv, gate/up, the GDN input, LM
// heads: `ops_gemm::LINEAR_B4_MIN_N`). Same grid.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_b4(LINEAR_PARAMS(bf16)) {
    linear_direct_dispatch<bf16, 4, 2>(out, x, DirectWBf16{w}, m, n, k, MT_KERNEL_LINEAR_STREAM_B4);
}

// linear_stream_b4_f32out(out: f32 [m, n], x, w, m, n, k): likewise, f32 out.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_b4_f32out(LINEAR_PARAMS(float)) {
    linear_direct_dispatch<float, 4, 2>(out, x, DirectWBf16{w}, m, n, k, MT_KERNEL_LINEAR_STREAM_B4_F32OUT);
}

// linear_swiglu(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [2 n, k], m, n, k): `linear` (gate rows
// then up rows of w) then `silu_mul`, in one launch, the rows of the two bit for bit: each
// output is silu(gate) * up of the gate and up columns `linear` would write, rounded to bf16 as
// it writes them, and the gate/up rows are never written. The circuit's `linear(gate_up) >
// silu_mul` at the narrow decode widths. `linear_stream_b4`'s batches and residency; a block
// takes pairs of units (a gate tile, then its up tile), so the grid is any number of blocks up
// to ceil(n / 8) * ceil(m / 16), as `linear_stream`'s for n columns.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_swiglu(LINEAR_PARAMS(bf16)) {
    linear_direct_dispatch<bf16, 4, 2, true>(out, x, DirectWBf16{w}, m, n, k, MT_KERNEL_LINEAR_SWIGLU);
}

// Chunks per batch of `linear_stream_fp8`. Where a segment is whole scale blocks, a lane's
// chunk is 8 weight bytes (two registers; the block's four chunks share one scale factor);
// otherwise each chunk also holds its scale factor. Batches of 16 (more weight bytes in flight per
// warp) and of 4 at three blocks a multiprocessor both measured slower on whole decode steps.
#define LIN_FP8_B 8
#define LIN_FP8_B_RB 4

// linear_stream_fp8(out: bf16 [m, n], x: bf16 [m, k], w: fp8 e4m3 [n, k], scales: f32 [ceil(n /
// 2^scale_row_shift), ceil(k / FP8_BLOCK)], m, n, k, scale_row_shift): `linear_stream` of the
// weight bf16(f32(w * scale)), rows bitwise `linear`'s of `dequant_fp8`'s output, at any m (each row
// tile of 16 rereads the weight tile, from L2 after the first); at m <= 16 where
// `fp8_swap_fits`, `linear_fp8_swapped` (units of 16 weight rows, the weight as the MMA's A
// operand). The grid and block as `linear_stream`'s.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    linear_stream_fp8(LINEAR_FP8_PARAMS) {
    constexpr uint32_t span = FP8_BLOCK / LIN_KC;
    static_assert(LIN_FP8_B % span == 0 && LIN_FP8_B_RB % span == 0, "batches hold whole scale blocks");
    const uint32_t kblocks = (k + FP8_BLOCK - 1) / FP8_BLOCK;
    const uint32_t seg_chunks = ((k + LIN_KC - 1) / LIN_KC + LIN_SEGS - 1) / LIN_SEGS;
    if (m > 0 && n > 0 && fp8_swap_fits(x, w, m, k)) {
        if (blockDim.x != LIN_STREAM_WARPS * 32) {
            mt_fault(MT_KERNEL_LINEAR_STREAM_FP8, MT_FAULT_GEOMETRY);
            return;
        }
        const DirectWFp8<span> wf{w, scales, scale_row_shift, kblocks};
        if (m <= 8)
            linear_fp8_swapped<1>(out, x, wf, m, n, k, lin_direct_part());
        else
            linear_fp8_swapped<2>(out, x, wf, m, n, k, lin_direct_part());
        return;
    }
    // Segments of whole scale blocks: every batch starts on a block, and reads one scale a block.
    if (seg_chunks % span == 0)
        linear_direct_dispatch<bf16, LIN_FP8_B, LIN_FP8_B_RB>(out, x, DirectWFp8<span>{w, scales, scale_row_shift, kblocks},
                                                              m, n, k, MT_KERNEL_LINEAR_STREAM_FP8);
    else
        linear_direct_dispatch<bf16, LIN_FP8_B, LIN_FP8_B_RB>(out, x, DirectWFp8<1>{w, scales, scale_row_shift, kblocks},
                                                              m, n, k, MT_KERNEL_LINEAR_STREAM_FP8);
}

// linear_stream_wide_fp8(out: bf16 [m, n], x: bf16 [m, k], w: fp8 e4m3 [n, k], scales, m, n, k,
// scale_row_shift): `linear_stream_wide` of the weight bf16(f32(w * scale)), rows bitwise
// `linear`'s of `dequant_fp8`'s output; the decode path for 16 < m <= 128, where the narrow
// kernel would convert each weight fragment once per row tile. The weight's bytes go through
// the ring (LIN_WF_STAGES stages of LIN_WF_STAGE_CH chunks) and are converted as the MMAs read
// them. Clusters of LIN_SEGS blocks, grid (LIN_SEGS * ceil(n / 128) * ceil(m / 64)), 256
// threads, LIN_WF_STAGES * LIN_WF_STAGE_CH * (128 * 32 + 64 * 64) bytes of dynamic shared memory.
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_wide_fp8(LINEAR_FP8_PARAMS) {
    const WideWFp8<64 * LIN_W_NT, LIN_WF_STAGE_CH> wf{w, scales, scale_row_shift, (k + FP8_BLOCK - 1) / FP8_BLOCK};
    linear_stream_wide_dispatch<bf16, LIN_WF_STAGE_CH, LIN_WF_STAGES>(out, x, wf, m, n, k,
                                                                      MT_KERNEL_LINEAR_STREAM_WIDE_FP8);
}

// dequant_fp8(out: bf16 [n, k], w: fp8 e4m3 [n, k], scales, n, k, scale_row_shift): each
// element bf16(w * bf16(its block's scale)), the weight `linear_stream_fp8` computes with. Grid: any
// number of blocks of FP8_CONVERT_THREADS threads, each thread taking elements i, i + stride,
// ... (prefill runs `linear` over this; the weight is never written while a projection runs).
extern "C" __global__ void __launch_bounds__(FP8_CONVERT_THREADS) dequant_fp8(DEQUANT_FP8_PARAMS) {
    pdl_wait();
    pdl_trigger();
    if (blockDim.x != FP8_CONVERT_THREADS) {
        mt_fault(MT_KERNEL_DEQUANT_FP8, MT_FAULT_GEOMETRY);
        return;
    }
    const uint32_t kblocks = (k + FP8_BLOCK - 1) / FP8_BLOCK;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    if (k % 8 == 0 && aligned8(w) && aligned16(out)) {
        // Eight elements a thread (one block scale: 8 divides FP8_BLOCK), 8 bytes in, 16 out.
        const size_t groups = (size_t)n * k / 8;
        for (size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
            const size_t i = 8 * g;
            const uint32_t row = (uint32_t)(i / k), col = (uint32_t)(i % k);
            const uint32_t s2 = fp8_scale2(scales[(size_t)(row >> scale_row_shift) * kblocks + col / FP8_BLOCK]);
            const uint2 q = *reinterpret_cast<const uint2*>(w + i);
            *reinterpret_cast<uint4*>(out + i) =
                make_uint4(fp8x2_scaled(q.x, FP8_PAIR_LO, s2), fp8x2_scaled(q.x, FP8_PAIR_HI, s2),
                           fp8x2_scaled(q.y, FP8_PAIR_LO, s2), fp8x2_scaled(q.y, FP8_PAIR_HI, s2));
        }
        return;
    }
    const size_t total = (size_t)n * k;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const uint32_t row = (uint32_t)(i / k), col = (uint32_t)(i % k);
        const uint32_t s2 = fp8_scale2(scales[(size_t)(row >> scale_row_shift) * kblocks + col / FP8_BLOCK]);
        const uint32_t pair = fp8x2_scaled(w[i], FP8_PAIR_LO, s2);  // the byte, and a zero
        out[i] = __ushort_as_bfloat16((unsigned short)(pair & 0xFFFFu));
    }
}

// quantize_fp8(out: fp8 e4m3 [n, k], scales: f32 [ceil(n / FP8_BLOCK), ceil(k / FP8_BLOCK)], w:
// bf16 [n, k], n, k): block FP8 with the checkpoints' recipe. A block of FP8_CONVERT_THREADS
// threads per weight block (grid ceil(k / FP8_BLOCK) x ceil(n / FP8_BLOCK)): its amax (exact,
// whatever the order), scale = amax / 448 (1 for a block of zeros), each element
// fp8(w / scale), rounded to nearest even and saturated at ±448. NaN elements do not count
// towards amax and stay NaN.
extern "C" __global__ void __launch_bounds__(FP8_CONVERT_THREADS) quantize_fp8(QUANTIZE_FP8_PARAMS) {
    pdl_wait();
    pdl_trigger();
    __shared__ float warp_max[FP8_CONVERT_THREADS / 32];
    __shared__ float block_scale;
    if (blockDim.x != FP8_CONVERT_THREADS) {
        mt_fault(MT_KERNEL_QUANTIZE_FP8, MT_FAULT_GEOMETRY);
        return;
    }
    const uint32_t r0 = blockIdx.y * FP8_BLOCK, c0 = blockIdx.x * FP8_BLOCK;
    const uint32_t rows = min(FP8_BLOCK, n - r0), cols = min(FP8_BLOCK, k - c0);
    float amax = 0.0f;
    for (uint32_t i = threadIdx.x; i < rows * cols; i += blockDim.x)
        amax = fmaxf(amax, fabsf(bf2f(w[(size_t)(r0 + i / cols) * k + c0 + i % cols])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float a = 0.0f;
        for (uint32_t i = 0; i < FP8_CONVERT_THREADS / 32; ++i) a = fmaxf(a, warp_max[i]);
        const float s = a > 0.0f ? a / 448.0f : 1.0f;
        block_scale = s;
        scales[(size_t)blockIdx.y * gridDim.x + blockIdx.x] = s;
    }
    __syncthreads();
    const float s = block_scale;
    for (uint32_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
        const size_t at = (size_t)(r0 + i / cols) * k + c0 + i % cols;
        out[at] = __nv_cvt_float_to_fp8(bf2f(w[at]) / s, __NV_SATFINITE, __NV_E4M3);
    }
}

// `kernel`: the entry's MT_KERNEL_* (for its fault).
template <typename OutT>
MT_DEVICE void linear_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                           uint32_t k, uint32_t kernel) {
    extern __shared__ __align__(16) unsigned char lin_smem[];
    if (m == 0 || n == 0) return;
    if (blockDim.x != LIN_THREADS) {
        mt_fault(kernel, MT_FAULT_GEOMETRY);
        return;
    }
    pdl_wait();  // launched as a programmatic dependent (ops::linear_geometry)
    pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg: the sm_90a cubin
    if (k % 4 == 0 && aligned8(x) && aligned8(w))
        linear_ws<OutT, LIN_STAGES, LIN_BM, true>(out, x, w, m, n, k, lin_smem);
    else
        linear_ws<OutT, LIN_STAGES, LIN_BM, false>(out, x, w, m, n, k, lin_smem);
#else  // the compute_90 PTX: the mma.sync tiles, same numerics, same block tile
    linear_tiled<OutT, LIN_BM, LIN_BN, LIN_T_WM, LIN_T_WN, LIN_T_SC, LIN_T_ST, false>(out, x, w, m, n, k, lin_smem,
                                                                                      blockIdx.y, blockIdx.x);
#endif
}

// linear(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k).
extern "C" __global__ void __launch_bounds__(LIN_THREADS, 1)
    linear(LINEAR_PARAMS(bf16)) {
    linear_impl(out, x, w, m, n, k, MT_KERNEL_LINEAR);
}

// linear_f32out(out: f32 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): the LM head.
extern "C" __global__ void __launch_bounds__(LIN_THREADS, 1)
    linear_f32out(LINEAR_PARAMS(float)) {
    linear_impl(out, x, w, m, n, k, MT_KERNEL_LINEAR_F32OUT);
}

// ---- `linear_tma`: the prefill kernel of the sm_90a cubin where the shape allows ----

// permute_k32_tiles(out: bf16 image, x: bf16 [m, k], m, k): x as the stage images `linear_tma`
// copies whole. For row tile tt (128 rows) and stage j (chunks 2j, 2j + 1 of 32 k), 16 KiB of
// 128 rows x 128 bytes; in a row, 16-byte unit t of chunk c sits at (4 (c % 2) + t) ^ (r % 8)
// (the 128-byte swizzle) and holds, in `k32_pairs` order, the chunk's 4-byte pairs t, t + 4,
// t + 8, t + 12 (k 2t, 2t + 1, 2t + 8, ...). Rows past m (to the tile) and k past the end (to the
// stage) are zero. Needs k % 8 == 0 and a 16-byte aligned x; the image takes
// ceil(m / 128) * ceil(k / 64) * 16 KiB. Grid-stride, one thread per (row, chunk), chunks
// fastest (faster than a thread per (row, stage) in either order).
extern "C" __global__ void __launch_bounds__(256)
    permute_k32_tiles(PERMUTE_K32_TILES_PARAMS) {
    pdl_wait();
    pdl_trigger();
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC, steps = (chunks + 1) / 2, slots = 2 * steps;
    const size_t total = (size_t)((m + 127) / 128 * 128) * slots;
    unsigned char* img = reinterpret_cast<unsigned char*>(out);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const uint32_t row = (uint32_t)(i / slots), c = (uint32_t)(i % slots);
        uint4 v[4];
#pragma unroll
        for (uint32_t u = 0; u < 4; ++u) {
            const uint32_t col = c * LIN_KC + u * 8;
            v[u] = row < m && col < k ? load16(x + (size_t)row * k + col) : make_uint4(0, 0, 0, 0);
        }
        store_k32_pairs(img, row, c, steps, v);
    }
}

// `kernel`: the entry's MT_KERNEL_* (for its fault).
// W: the weight's format as the tensor-map body reads it (`TmaWBf16`, `TmaWFp8`); TW: the same
// weight as the compute_90 body's scalar loads read it (`tiled_w8`).
// SWIGLU: `linear_tma_swiglu` (`n` the SwiGLU's width, `out` its stage images).
template <typename OutT, typename W, typename TW, bool SWIGLU = false>
MT_DEVICE void linear_tma_impl(OutT* out, const bf16* xt, const W& wf, TW w, const void* wmap, uint32_t* sched,
                               uint32_t m, uint32_t n, uint32_t k, uint32_t kernel) {
    extern __shared__ __align__(16) unsigned char lin_tma_smem[];
    if (m == 0 || n == 0) return;
    if (blockDim.x != LIN_TMA_THREADS) {
        mt_fault(kernel, MT_FAULT_GEOMETRY);
        return;
    }
    pdl_wait();  // launched as a programmatic dependent, like `linear`
    pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    (void)w;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC, seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    if (seg_chunks % 2 == 0 && chunks % 2 == 0)  // segments end with stages (uniform over the grid)
        linear_tma_body<OutT, LIN_TMA_STAGES, false, W, SWIGLU>(out, xt, wf, wmap, sched, m, n, k, lin_tma_smem);
    else
        linear_tma_body<OutT, LIN_TMA_STAGES, true, W, SWIGLU>(out, xt, wf, wmap, sched, m, n, k, lin_tma_smem);
#else  // the compute_90 PTX: the mma.sync tiles reading x from the images (no tensor map)
    (void)wmap;
    (void)wf;
    (void)sched;
    // 8 warps of 64 x 32 per 128 x 128 tile; the other four leave (barriers count the rest).
    // The tiles as the sm_90a body takes them.
    if (threadIdx.x >= 256) return;
    const LinTmaTiles tl = lin_tma_tiles(m, SWIGLU ? 2 * n : n);
    for (uint32_t t = tl.first; t < tl.count; t += tl.stride) {
        if constexpr (SWIGLU)
            linear_tiled<OutT, LIN_TMA_TILE, LIN_TMA_TILE, 64, 32, 2, 3, false, true, SwigluRows<TW>, true>(
                out, xt, SwigluRows<TW>{w, n}, m, n, k, lin_tma_smem, t % tl.rows, t / tl.rows);
        else
            linear_tiled<OutT, LIN_TMA_TILE, LIN_TMA_TILE, 64, 32, 2, 3, false, true>(out, xt, w, m, n, k, lin_tma_smem,
                                                                                      t % tl.rows, t / tl.rows);
        __syncthreads();  // the next tile's stages overwrite this one's
    }
#endif
}

// linear_tma(out: bf16 [m, n], xt: `permute_k32_tiles` of x [m, k], w: bf16 [n, k], wmap: a 2-D
// tensor map of w (bf16, dims (k, n), box 64 x 128, 128-byte swizzle) in device memory, m, n, k):
// `linear`. Any grid (its blocks walk the 128 x 128 tiles, `linear_tma_body`; the launcher gives
// the resident blocks), LIN_TMA_THREADS threads, LIN_TMA_STAGES * 32 KiB + 2 KiB of dynamic shared
// memory. Needs k % 8 == 0 and 16-byte aligned operands.
extern "C" __global__ void __launch_bounds__(LIN_TMA_THREADS, 1)
    linear_tma(LINEAR_TMA_PARAMS(bf16)) {
    linear_tma_impl(out, xt, TmaWBf16{}, w, wmap, sched, m, n, k, MT_KERNEL_LINEAR_TMA);
}

// linear_tma_f32out(out: f32 [m, n], xt, w, wmap, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __launch_bounds__(LIN_TMA_THREADS, 1)
    linear_tma_f32out(LINEAR_TMA_PARAMS(float)) {
    linear_tma_impl(out, xt, TmaWBf16{}, w, wmap, sched, m, n, k, MT_KERNEL_LINEAR_TMA_F32OUT);
}

// The tensor-map format of a block-FP8 weight's launch.
MT_DEVICE TmaWFp8 tma_w_fp8(const float* scales, uint32_t scale_row_shift, uint32_t n, uint32_t k) {
    return TmaWFp8{scales, scale_row_shift, (k + FP8_BLOCK - 1) / FP8_BLOCK, n, k};
}

// linear_tma_fp8(out: bf16 [m, n], xt: `permute_k32_tiles` of x [m, k], w: fp8 e4m3 [n, k],
// scales, wmap: a 2-D tensor map of w (bytes, dims (k, n), box 64 x 128, 64-byte swizzle) in
// device memory, m, n, k, scale_row_shift): `linear_tma` of the weight `dequant_fp8` makes of w,
// each fragment converted as the consumers load it, so its rows are bitwise `linear`'s of that
// weight without writing it (prefill of an FP8 weight). `linear_tma`'s geometry; needs k % 16
// == 0 and 16-byte aligned operands.
extern "C" __global__ void __launch_bounds__(LIN_TMA_THREADS, 1)
    linear_tma_fp8(LINEAR_TMA_FP8_PARAMS) {
    const TmaWFp8 wf = tma_w_fp8(scales, scale_row_shift, n, k);
    linear_tma_impl(out, xt, wf, TiledWFp8{w, wf}, wmap, sched, m, n, k, MT_KERNEL_LINEAR_TMA_FP8);
}

// linear_tma_swiglu(img: the stage images of an [m, n] bf16 matrix, xt: `permute_k32_tiles` of
// x [m, k], w: bf16 [2 n, k] (gate rows, then up rows), wmap: a 2-D tensor map of w (bf16, dims
// (k, 2 n), box 64 x 64, 128-byte swizzle) in device memory, m, n, k): `linear_tma` into [gate |
// up] then `silu_mul_staged`, in one launch and without the [m, 2 n] projection: each tile's gate
// and up values are rounded to bf16 as `linear` stores them and combined by `silu_mul`'s
// arithmetic, so the images are bitwise the two launches'. `linear_tma`'s grid and tile walk
// (`sched`) over tiles of 128 rows by 64 columns of the SwiGLU, LIN_TMA_THREADS threads,
// LINEAR_TMA_SMEM + 32 KiB of dynamic shared memory (the exchange).
// Needs n % 64 == 0, k % 8 == 0 and 16-byte aligned operands; image rows past m are not written.
extern "C" __global__ void __launch_bounds__(LIN_TMA_THREADS, 1)
    linear_tma_swiglu(LINEAR_TMA_SWIGLU_PARAMS) {
    if (n % 64 != 0) {
        mt_fault(MT_KERNEL_LINEAR_TMA_SWIGLU, MT_FAULT_SHAPE);
        return;
    }
    linear_tma_impl<unsigned char, TmaWBf16, const bf16*, true>(img, xt, TmaWBf16{}, w, wmap, sched, m, n, k,
                                                               MT_KERNEL_LINEAR_TMA_SWIGLU);
}

// linear_tma_swiglu_fp8(img, xt, w: fp8 e4m3 [2 n, k], scales, wmap: a 2-D tensor map of w
// (bytes, dims (k, 2 n), box 64 x 64, 64-byte swizzle), m, n, k, scale_row_shift):
// `linear_tma_swiglu` of the weight `dequant_fp8` makes of w, converted as `linear_tma_fp8`
// converts it. Its geometry; needs k % 16 == 0.
extern "C" __global__ void __launch_bounds__(LIN_TMA_THREADS, 1)
    linear_tma_swiglu_fp8(LINEAR_TMA_SWIGLU_FP8_PARAMS) {
    if (n % 64 != 0) {
        mt_fault(MT_KERNEL_LINEAR_TMA_SWIGLU_FP8, MT_FAULT_SHAPE);
        return;
    }
    const TmaWFp8 wf = tma_w_fp8(scales, scale_row_shift, 2 * n, k);
    linear_tma_impl<unsigned char, TmaWFp8, TiledWFp8, true>(img, xt, wf, TiledWFp8{w, wf}, wmap, sched, m, n, k,
                                                             MT_KERNEL_LINEAR_TMA_SWIGLU_FP8);
}

// ---- `linear_stream_tma`: the decode kernel of the sm_90a cubin where a weight map exists ----

// `kernel`: the entry's MT_KERNEL_* (for its fault). W: the weight's format as the tensor-map
// body reads it (`TmaWBf16`, `TmaWFp8`); WW: the same weight as `linear_wide_impl` reads it (the
// compute_90 body), with WW_CH chunks a stage and WW_STAGES stages.
template <typename OutT, int WW_CH, int WW_STAGES, typename W, typename WW>
MT_DEVICE void linear_stream_tma_impl(OutT* out, const bf16* x, const bf16* ximg, const W& wf, const WW& ww,
                                      const void* wmap, uint32_t m, uint32_t n, uint32_t k, uint32_t kernel) {
    extern __shared__ __align__(1024) unsigned char lin_dec_smem[];
    // Uniform over the grid, so every block of a cluster leaves together.
    if (m == 0 || n == 0) return;
    if (blockDim.x != LIN_DEC_THREADS) {
        mt_fault(kernel, MT_FAULT_GEOMETRY);
        return;
    }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    (void)ww;
    unsigned char* smem = lin_dec_smem + ((1024 - ((uint32_t)__cvta_generic_to_shared(lin_dec_smem) & 1023)) & 1023);
    // N: x's rows a block holds (a power of two, 8 .. LIN_DEC_ROWS), halved while x's segment,
    // the partials and LIN_DEC_MIN_STAGES weight stages would not fit; then as many row blocks
    // as m needs (`ops_gemm::linear_stream_tma_rows` mirrors this).
    uint32_t rows = 8;
    while (rows < m && rows < LIN_DEC_ROWS) rows *= 2;
    const uint32_t seg_steps = (lin_segment(k, 0).c_end + 1) / 2;
    while (rows > 8 && seg_steps * rows * 128 + rows * 1024 + LIN_DEC_MIN_STAGES * LIN_DEC_COLS * 128 > LIN_DEC_SPACE)
        rows /= 2;
    const uint32_t row_blocks = (m + rows - 1) / rows;
    const unsigned char* xi = reinterpret_cast<const unsigned char*>(ximg);
    if (rows == 8)
        linear_dec_body<OutT, 8>(out, x, xi, wf, wmap, m, n, k, row_blocks, smem);
    else if (rows == 16)
        linear_dec_body<OutT, 16>(out, x, xi, wf, wmap, m, n, k, row_blocks, smem);
    else if (rows == 32)
        linear_dec_body<OutT, 32>(out, x, xi, wf, wmap, m, n, k, row_blocks, smem);
    else
        linear_dec_body<OutT, 64>(out, x, xi, wf, wmap, m, n, k, row_blocks, smem);
#else  // the compute_90 PTX: `linear_stream_wide`'s body (no wgmma, no tensor map) on each of the
       // cluster's tiles in turn, from x's rows (never its images); the warps past its eight
       // compute partials nobody sums.
    (void)wmap;
    (void)ximg;
    (void)wf;
    const uint32_t tiles = (n + 127) / 128 * ((m + LIN_W_ROWS - 1) / LIN_W_ROWS);
    for (uint32_t t = blockIdx.x / LIN_SEGS; t < tiles; t += gridDim.x / LIN_SEGS) {
        if (k % 8 != 0 || !aligned16(x) || !ww.vec(k))
            linear_wide_impl<OutT, LIN_W_NT, WW_CH, WW_STAGES, false>(out, x, ww, m, n, k, lin_dec_smem, t);
        else
            linear_wide_impl<OutT, LIN_W_NT, WW_CH, WW_STAGES, true>(out, x, ww, m, n, k, lin_dec_smem, t);
    }
#endif
}

// linear_stream_tma(out: bf16 [m, n], x: bf16 [m, k], ximg: x's stage images or NULL, w: bf16
// [n, k], wmap: `linear_tma`'s tensor map of w, m, n, k): `linear`, the decode path (9..128 rows)
// where the weight has a map. Where `ximg` is given (its producer wrote x both as rows and as
// `linear_tma`'s stage images: `add_rms_norm_staged`, `silu_mul_staged`), k % 64 == 0 and each
// of the k segments is whole stages, a block takes its segment of x from the images by bulk
// copies instead of copying x's rows itself (the same bytes in shared memory, so the same rows
// out; m <= 128, so the images are one row tile). Persistent clusters of LIN_SEGS blocks: grid
// LIN_SEGS * clusters, the clusters a multiple of the row blocks
// (`ops_gemm::linear_stream_tma_geometry`: per row block at most one a tile of 128 columns and
// no more than are resident), LIN_DEC_THREADS threads, LIN_DEC_SPACE + 2 KiB of dynamic shared
// memory (one block a multiprocessor). Needs k % 8 == 0 and 16-byte aligned operands (128-byte
// aligned images).
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_DEC_THREADS, 1)
    linear_stream_tma(LINEAR_STREAM_TMA_PARAMS(bf16)) {
    linear_stream_tma_impl<bf16, LIN_W_STAGE_CH, LIN_W_STAGES>(out, x, ximg, TmaWBf16{}, WideBf16{w}, wmap, m, n, k,
                                                              MT_KERNEL_LINEAR_STREAM_TMA);
}

// linear_stream_tma_f32out(out: f32 [m, n], x, ximg, w, wmap, m, n, k): `linear_f32out`,
// likewise.
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_DEC_THREADS, 1)
    linear_stream_tma_f32out(LINEAR_STREAM_TMA_PARAMS(float)) {
    linear_stream_tma_impl<float, LIN_W_STAGE_CH, LIN_W_STAGES>(out, x, ximg, TmaWBf16{}, WideBf16{w}, wmap, m, n,
                                                               k, MT_KERNEL_LINEAR_STREAM_TMA_F32OUT);
}

// linear_stream_tma_fp8(out: bf16 [m, n], x: bf16 [m, k], ximg: x's stage images or NULL, w: fp8
// e4m3 [n, k], scales, wmap: `linear_tma_fp8`'s tensor map of w, m, n, k, scale_row_shift):
// `linear_stream_tma` of the weight `dequant_fp8` makes of w, each fragment converted as the
// consumers load it (the e4m3 bytes stream, half of bf16's), so its rows are bitwise `linear`'s
// of that weight; the decode path (17..128 rows) of an FP8 weight with a map. `linear_stream_tma`'s
// geometry and requirements, k % 16 == 0.
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_DEC_THREADS, 1)
    linear_stream_tma_fp8(LINEAR_STREAM_TMA_FP8_PARAMS) {
    const WideWFp8<64 * LIN_W_NT, LIN_WF_STAGE_CH> ww{w, scales, scale_row_shift, (k + FP8_BLOCK - 1) / FP8_BLOCK};
    linear_stream_tma_impl<bf16, LIN_WF_STAGE_CH, LIN_WF_STAGES>(out, x, ximg, tma_w_fp8(scales, scale_row_shift, n, k),
                                                                ww, wmap, m, n, k, MT_KERNEL_LINEAR_STREAM_TMA_FP8);
}
