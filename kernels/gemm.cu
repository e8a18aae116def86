// out = x · wᵀ with a bf16 weight in the checkpoint's [out_features, in_features] layout. CPU
// twins: metrale-gpu-runtime/src/cpu/kernels/gemm.rs.
//
// Six kernels per output type (bf16: `linear`, `linear_stream`, `linear_stream_b4`,
// `linear_stream_wide`, `linear_stream_tma`, `linear_tma`; f32: the same with `_f32out`), each
// computing the whole function; the launcher
// (`ops_gemm::linear_path`) runs `linear_stream_b4` for m <= 16 on projections of 6144 columns or
// more, `linear_stream` for the other m <= 16, `linear_stream_tma` for 9..128 rows where the
// weight has a tensor map and x fits in at most four row blocks, `linear_stream_wide` for the
// other m <= 128
// (decode) and `linear_tma` or the tiled `linear` above, every one as a programmatic dependent
// launch: each
// kernel calls `pdl_wait` (common.cuh) before it touches x or out, so its blocks may start while
// the kernel ahead of it on the stream finishes, and the decode kernels issue their first weight
// loads before that wait (the weight is never written by the kernel just ahead of a projection).
// - `linear_stream` (m <= 16): persistent blocks taking units of one column tile (8 output
//   columns) by one row tile (16 rows) in turn; as many blocks as are resident (two a
//   multiprocessor), 256 threads, 8 KiB of static shared memory. Warp w computes segment w,
//   loading its 16-byte weight fragments straight into registers (ld.global.nc, no L1
//   allocation, a 256-byte L2 prefetch): batches of LIN_D_B (8) chunks at m <= 8, LIN_D_B_RB (4)
//   above (x rows g + 8 too) or where the operands are unaligned; two batches in flight per
//   warp, running on from one unit into the next. x is read through L1. The warps leave their
//   segment partials in shared memory and the block sums them in segment order.
//   `linear_stream_b4` is the same with batches of 4 (2) chunks and three blocks per
//   multiprocessor.
// - `linear_stream_wide` (16 < m <= 128): a cluster of LIN_SEGS blocks per tile of 128 columns by
//   64 rows, block s computing segment s; x and the weight staged together through a 3-stage
//   cp.async ring; the cluster sums the segment partials in order through distributed shared
//   memory (details at the kernel).
// - `linear_stream_tma` (9 <= m <= 128 where the weight has a tensor map): persistent clusters of
//   LIN_SEGS blocks, one a multiprocessor, taking tiles of 128 columns in turn; the weight by
//   tensor map into a ring that runs on across tiles, as wgmma's register operand; each block's
//   segment of x (or of a row block of x, where the whole segment would not fit) copied once
//   into shared memory, by bulk copies from the stage images its producer wrote where the
//   launcher gives them (17..128 rows); the producer warpgroup's idle warps sum the tiles' segment partials
//   (kernels/gemm_wgmma.cuh). H200 (lab/decode_tma_lab.cu, 2026-12-01), share of the read
//   stream at 64 rows on the Qwen3-8B projections, against `linear_stream_wide`: qkv 54 / 35 %,
//   o 48 / 34 %, gate_up 79 / 48 %, down 52 / 38 % (two row blocks of 32); LM head at 32 rows
//   91 / 69 %.
// - `linear_tma` (prefill, m > 128, where the launcher has a staging buffer for x and the shape
//   allows: k % 8 == 0, 16-byte aligned operands): after `permute_k32_tiles` writes x as stage
//   images (or a `_staged` producer did), the weight as wgmma's register operand through a
//   tensor map, 128 x 128 tiles (kernels/gemm_wgmma.cuh); 490-600 TFLOP/s at m = 2048.
// - `linear` (prefill, m > 128, otherwise): warp-specialized Hopper warpgroup MMAs (`linear_ws`): 192 x 128
//   output tiles, a producer warpgroup filling a 5-stage ring and three consumer warpgroups of
//   m64n128k16 wgmma; grid (ceil(n / 128), ceil(m / 192)), 512 threads, 202 KiB of dynamic
//   shared memory. The lab (lab/prefill_lab.cu, H200, 2026-11-30) measured 215-247 TFLOP/s at
//   m = 2048 on the Qwen3-8B projections against 200-215 for the mma.sync tiles it replaced
//   (`linear_tiled`, 128 x 128, now only in the compute_90 PTX). Its rate did not move with the
//   ring depth: the 8-byte copies bound it.
//
// Measured on the H200 (kernels alone, 20 launches per CUDA graph, weights rotated past L2,
// programmatic launches, against a read-only stream; lab/gemm_lab.cu; docs/BENCHMARKS.md): at
// m = 1 the persistent narrow kernels the launcher picks (2026-12-01) reach 75-97 % (qkv
// 6144x4096 81 %, o 4096x4096 75 %, gate_up 24576x4096 93 %, down 4096x12288 85 %, LM head
// 151936x4096 97 %), where a block per unit reached 65-92 % (75, 65, 85, 82, 92: the next
// unit's loads waited for a block to retire and another to start); the lab's chain of 36
// Qwen3-8B layers (stand-in small kernels between the projections) at one row took 4.220 ms
// against 4.614. (2026-11-30:) `linear_stream_wide` at m = 32 reaches 47-64 % (qkv, o, down,
// gate_up, LM head), at m = 64 34-47 %, at m = 128 20-24 % (still 1.6x the tiled kernel there); the persistent per-warp-segment kernel it replaced ran at
// 31-37 % at m = 32 (x re-read from L2 for every 16 columns). Tried and dropped: a weight ring
// filled by the bulk-copy engine (cp.async.bulk, one copy of 128 B - 1 KiB per weight row and
// stage, mbarrier completion) ran at 27-64 % at m = 1 (the copy engine wants larger copies than
// a segment's row gives); cluster tiles of 64 or 256 columns, one-chunk stages, two-stage rings
// (all slower than 128 columns, 2-chunk stages, 3 stages at m = 32..128).
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
// the matching m16n8k16, which gives the same sums). cuBLASLt was not used for prefill: its algorithm (and so
// its rounding) changes with m, which would break "prefix-cached vs cold" and "batched vs alone"
// bitwise equality.
#include "common.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#define LIN_KC 32
#define LIN_SEGS 8
#define LIN_STREAM_WARPS 8  // warps of the decode kernels' blocks
#define LIN_BM 192       // the prefill kernel's block tile: rows (three consumer warpgroups)
#define LIN_BN 128       // ... and columns
#define LIN_THREADS 512  // a producer warpgroup and three consumers
#define LIN_STAGES 5     // its ring: 5 x (192 + 128) rows x 128 bytes = 200 KiB (+ 2 KiB)
#define LIN_T_WM 48      // the mma.sync tiles of the compute_90 PTX: warp tile rows (4 x 4 warps)
#define LIN_T_WN 32      // ... and columns
#define LIN_T_SC 2       // chunks per stage
#define LIN_T_ST 3       // stages (3 x 2 x 320 rows x 64 bytes = 120 KiB)

MT_DEVICE void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                        uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The two MMAs of one 32-wide k chunk: x rows g (`ra`) and g + 8 (`rb`) and weight row g
// (`wb`), each holding k 8q..8q+7 of the chunk.
MT_DEVICE void mma_chunk(float (&c)[4], uint4 ra, uint4 rb, uint4 wb) {
    mma16816(c, ra.x, rb.x, ra.y, rb.y, wb.x, wb.y);
    mma16816(c, ra.z, rb.z, ra.w, rb.w, wb.z, wb.w);
}

// Eight consecutive bf16 of row `row` of a [rows, k] matrix from column `col`; zero outside.
// `vec`: k % 8 == 0 and the base is 16-byte aligned, so the 8 lie in one aligned vector.
MT_DEVICE uint4 load8(const bf16* base, uint32_t rows, uint32_t k, uint32_t row, uint32_t col,
                      bool vec) {
    if (row >= rows || col >= k) return make_uint4(0, 0, 0, 0);
    const bf16* p = base + (size_t)row * k + col;
    if (vec) return load16(p);
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t lo = col + 2 * i < k ? __bfloat16_as_ushort(p[2 * i]) : 0u;
        const uint32_t hi = col + 2 * i + 1 < k ? __bfloat16_as_ushort(p[2 * i + 1]) : 0u;
        w[i] = lo | (hi << 16);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// `load8` of x from its stage images: k 8q..8q+7 of a chunk are pairs 4q..4q+3, pair 4q + i the
// 4 bytes at position q of image unit i.
MT_DEVICE uint4 load8_img(const bf16* xt, uint32_t m, uint32_t k, uint32_t row, uint32_t col) {
    if (row >= m || col >= k) return make_uint4(0, 0, 0, 0);
    const uint32_t steps = ((k + LIN_KC - 1) / LIN_KC + 1) / 2, c = col / LIN_KC, q = (col % LIN_KC) / 8;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(xt);
    uint32_t v[4];
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) v[i] = *reinterpret_cast<const uint32_t*>(base + img_offset(row, c, i, steps) + q * 4);
    return make_uint4(v[0], v[1], v[2], v[3]);
}

MT_DEVICE void store_out(bf16* out, size_t i, float v) { out[i] = f2bf(v); }
MT_DEVICE void store_out(float* out, size_t i, float v) { out[i] = v; }

// One pipeline stage: SC chunks of x rows [m0, m0 + BM) then w rows [n0, n0 + BN),
// 32 k each, as 16-byte vectors laid out [chunk][row][4 vectors] (vector q of a row holds k
// 8q..8q+7 of its chunk, what lane (g, q) feeds its MMAs; a warp's 8 rows of one vector column
// are 512 contiguous bytes, so its shared loads are conflict-free). Consecutive threads take
// consecutive vectors of a row, so each row's 128 bytes per stage are one contiguous read.
template <int BM, int BN, int SC, int THREADS, bool VEC, bool XIMG = false>
MT_DEVICE void load_stage(uint4* stage, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                          uint32_t k, uint32_t m0, uint32_t n0, uint32_t step) {
    constexpr uint32_t ROWS = BM + BN;
#pragma unroll 4
    for (uint32_t i = threadIdx.x; i < ROWS * SC * 4; i += THREADS) {
        const uint32_t row = i / (SC * 4), ch = (i / 4) % SC, q = i % 4;
        const uint32_t col = (step * SC + ch) * LIN_KC + q * 8;
        const bool is_x = row < BM;
        const bf16* base = is_x ? x : w;
        const uint32_t rows = is_x ? m : n;
        const uint32_t grow = is_x ? m0 + row : n0 + (row - BM);
        uint4* dst = stage + (ch * ROWS + row) * 4 + q;
        if (VEC) {
            const bool in = grow < rows && col < k;
            cp_async16(dst, in ? base + (size_t)grow * k + col : base, in ? 16u : 0u);
        } else if (XIMG && is_x) {
            *dst = load8_img(x, m, k, grow, col);
        } else {
            *dst = load8(base, rows, k, grow, col, false);
        }
    }
}

// The tiled kernel's body for a BM x BN block tile of (BM / WM) x (BN / WN) warps of WM x WN,
// SC chunks per stage and ST stages: `linear` in the compute_90 PTX, which cannot use wgmma
// (<LIN_BM, LIN_BN, LIN_T_WM, LIN_T_WN, LIN_T_SC, LIN_T_ST>, VEC false) and, with VEC, the kernel
// before `linear_ws` (lab/prefill_lab.cu). Every instance has the same numerics.
// VEC: k % 8 == 0 and 16-byte aligned operands, so stages fill by cp.async; a compile-time
// choice, since a run-time branch in the copy loop cost 13 % (lab, 2026-11-30: 177-185 against
// 200-214 TFLOP/s at m = 2048).
// XIMG: x is given as `permute_k32_tiles`'s stage images, and grid x runs over the row tiles
// (the compute_90 body of `linear_tma`).
template <typename OutT, int BM, int BN, int WM, int WN, int SC, int ST, bool VEC, bool XIMG = false>
MT_DEVICE void linear_tiled(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                            uint32_t k, unsigned char* smem) {
    constexpr int MT = WM / 16, NT = WN / 8, THREADS = (BM / WM) * (BN / WN) * 32;
    constexpr uint32_t ROWS = BM + BN, STAGE_VECS = SC * ROWS * 4;
    uint4* stages = reinterpret_cast<uint4*>(smem);
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const uint32_t m0 = (XIMG ? blockIdx.x : blockIdx.y) * BM, n0 = (XIMG ? blockIdx.y : blockIdx.x) * BN;
    const uint32_t wm0 = (warp / (BN / WN)) * WM, wn0 = (warp % (BN / WN)) * WN;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t steps = (chunks + SC - 1) / SC;

    float acc[MT][NT][4], total[MT][NT][4];
#pragma unroll
    for (int a = 0; a < MT; ++a)
#pragma unroll
        for (int b = 0; b < NT; ++b)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[a][b][j] = total[a][b][j] = 0.0f;

#pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if ((uint32_t)s < steps)
            load_stage<BM, BN, SC, THREADS, VEC, XIMG>(stages + s * STAGE_VECS, x, w, m, n, k, m0, n0, s);
        cp_async_commit();
    }
    uint32_t in_seg = 0;
    for (uint32_t j = 0; j < steps; ++j) {
        cp_async_wait<ST - 2>();
        __syncthreads();
        const uint32_t pre = j + ST - 1;
        if (pre < steps)
            load_stage<BM, BN, SC, THREADS, VEC, XIMG>(stages + (pre % ST) * STAGE_VECS, x, w, m, n, k, m0, n0, pre);
        cp_async_commit();

        const uint4* st = stages + (j % ST) * STAGE_VECS;
#pragma unroll
        for (int ch = 0; ch < SC; ++ch) {
            const uint32_t c = j * SC + ch;
            if (c >= chunks) break;
            const uint4* sa = st + ch * ROWS * 4;
            const uint4* sb = sa + BM * 4;
            uint4 a[MT][2], b[NT];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][0] = sa[(wm0 + mt * 16 + g) * 4 + q];
                a[mt][1] = sa[(wm0 + mt * 16 + g + 8) * 4 + q];
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) b[nt] = sb[(wn0 + nt * 8 + g) * 4 + q];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) mma_chunk(acc[mt][nt], a[mt][0], a[mt][1], b[nt]);

            if (++in_seg == seg_chunks || c + 1 == chunks) {  // a segment ends
                in_seg = 0;
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                        for (int jj = 0; jj < 4; ++jj) {
                            total[mt][nt][jj] += acc[mt][nt][jj];
                            acc[mt][nt][jj] = 0.0f;
                        }
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj) {
                const uint32_t row = m0 + wm0 + mt * 16 + g + (jj >= 2 ? 8 : 0);
                const uint32_t col = n0 + wn0 + nt * 8 + 2 * q + (jj & 1);
                if (row < m && col < n) store_out(out, (size_t)row * n + col, total[mt][nt][jj]);
            }
}

// ---- The 16 < m <= 64 decode kernel (`linear_stream_wide`) ----
// A cluster of LIN_SEGS blocks per output tile (8 * NT columns per warp, so 64 * NT per tile, by
// LIN_W_ROWS rows); block s of the cluster computes segment s of every output of the tile. Warp w
// takes the tile's columns 8 NT w .. 8 NT (w + 1) - 1 (NT column tiles) for all its row tiles. The block streams its segment through a ring
// of STAGES stages in shared memory, each STAGE_CH chunks of the tile's weight rows and x rows
// (cp.async; plain loads when unaligned), so a weight fragment is read once from memory and x
// once per tile from L2, and every x fragment read from shared memory feeds two weight column
// tiles. The clusters of one column tile's row blocks are neighbours in the grid, so they run
// together and the weight is read from memory about once. At the end each warp leaves its partials in shared memory and the cluster sums them in
// segment order through distributed shared memory, each block writing one eighth of the tile.
#define LIN_W_ROWS 64  // rows per tile (4 row tiles)

// Stage layout: [chunk][row][4 vectors], the tile's BN weight rows then its x rows; vector q of a
// row holds k 8q..8q+7 of the chunk, which is what lane (g, q) feeds its MMAs.
template <int BN>
MT_DEVICE uint32_t wide_slot(uint32_t ch, uint32_t row, uint32_t q) {
    return (ch * (BN + LIN_W_ROWS) + row) * 4 + q;
}

// Queue `rows` rows of `src` ([src_rows, k], from row r0) for chunks c0 .. c0 + STAGE_CH - 1
// (those before c_end) into stage rows base.. of `st`; consecutive threads take consecutive
// 16-byte vectors of a row, so each row's run of the stage is one contiguous read.
template <int BN, int STAGE_CH, bool VEC>
MT_DEVICE void wide_issue(uint4* st, const bf16* src, uint32_t src_rows, uint32_t k, uint32_t r0,
                          uint32_t rows, uint32_t base, uint32_t c0, uint32_t c_end) {
    for (uint32_t i = threadIdx.x; i < rows * STAGE_CH * 4; i += blockDim.x) {
        const uint32_t r = i / (STAGE_CH * 4), ch = (i / 4) % STAGE_CH, q = i % 4;
        const uint32_t c = c0 + ch, grow = r0 + r, col = c * LIN_KC + q * 8;
        uint4* dst = st + wide_slot<BN>(ch, base + r, q);
        if (VEC) {
            const bool in = grow < src_rows && c < c_end && col < k;
            cp_async16(dst, in ? src + (size_t)grow * k + col : src, in ? 16u : 0u);
        } else {
            *dst = c < c_end ? load8(src, src_rows, k, grow, col, false) : make_uint4(0, 0, 0, 0);
        }
    }
}

// Segment `seg` of k: its chunks [c_begin, c_end) (empty past the last), and how many segments
// hold chunks (the numerics above).
struct LinSegment {
    uint32_t c_begin, c_end, nsegs;
};

MT_DEVICE LinSegment lin_segment(uint32_t k, uint32_t seg) {
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    LinSegment s;
    s.nsegs = seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 0;
    s.c_begin = min(chunks, seg * seg_chunks);
    s.c_end = min(chunks, s.c_begin + seg_chunks);
    return s;
}

// float4 `f` of the partials `part` summed over the cluster's first `nsegs` blocks (the
// segments) in order, from +0: the decode kernels' last step. BATCH: every block's float4 is read
// before the first add, so the remote reads overlap (`linear_stream_tma`, which has the
// registers; `linear_stream_wide` at three blocks a multiprocessor would spill).
template <bool BATCH>
MT_DEVICE float4 cluster_segment_sum(cg::cluster_group& cluster, const float4* part, uint32_t f, uint32_t nsegs) {
    float4 total = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    auto add = [&](const float4& v) {
        total.x += v.x;
        total.y += v.y;
        total.z += v.z;
        total.w += v.w;
    };
    if constexpr (BATCH) {
        float4 v[LIN_SEGS];
#pragma unroll
        for (uint32_t s = 0; s < LIN_SEGS; ++s)
            if (s < nsegs) v[s] = cluster.map_shared_rank(part, s)[f];
#pragma unroll
        for (uint32_t s = 0; s < LIN_SEGS; ++s)
            if (s < nsegs) add(v[s]);
    } else {
        for (uint32_t s = 0; s < nsegs; ++s) add(cluster.map_shared_rank(part, s)[f]);
    }
    return total;
}

// `tile`: the cluster's tile (its index over the grid's clusters but for the compute_90 body of
// the persistent `linear_stream_tma`, whose clusters take tiles in turn).
template <typename OutT, int NT, int STAGE_CH, int STAGES, bool VEC>
MT_DEVICE void linear_wide_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                                uint32_t k, unsigned char* smem, uint32_t tile) {
    constexpr uint32_t BN = 64 * NT;
    constexpr uint32_t STAGE_VECS = STAGE_CH * (BN + LIN_W_ROWS) * 4;
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const uint32_t seg = cluster.block_rank();
    const uint32_t row_blocks = (m + LIN_W_ROWS - 1) / LIN_W_ROWS;
    const uint32_t n0 = (tile / row_blocks) * BN, m0 = (tile % row_blocks) * LIN_W_ROWS;
    const uint32_t rows = m0 < m ? min(LIN_W_ROWS, m - m0) : 0;
    const uint32_t row_tiles = (rows + 15) / 16;
    const LinSegment span = lin_segment(k, seg);
    const uint32_t nsegs = span.nsegs, c_begin = span.c_begin, c_end = span.c_end;
    const uint32_t steps = (c_end - c_begin + STAGE_CH - 1) / STAGE_CH;
    uint4* ring = reinterpret_cast<uint4*>(smem);

    auto issue_w = [&](uint32_t j) {
        if (j < steps)
            wide_issue<BN, STAGE_CH, VEC>(ring + (j % STAGES) * STAGE_VECS, w, n, k, n0, BN, 0,
                                      c_begin + j * STAGE_CH, c_end);
    };
    auto issue_x = [&](uint32_t j) {
        if (j < steps)
            wide_issue<BN, STAGE_CH, VEC>(ring + (j % STAGES) * STAGE_VECS, x, m, k, m0,
                                          row_tiles * 16, BN, c_begin + j * STAGE_CH, c_end);
        cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

    // The weight is never written by the kernel ahead on the stream: its first stages are
    // queued before the wait, x (that kernel's output) after it.
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue_w(p);
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue_x(p);

    float acc[4][NT][4];
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.0f;

    for (uint32_t j = 0; j < steps; ++j) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // stage j is complete for everyone, and stage j - 1 is read
        issue_w(j + STAGES - 1);
        issue_x(j + STAGES - 1);
        const uint4* st = ring + (j % STAGES) * STAGE_VECS;
#pragma unroll
        for (int ch = 0; ch < STAGE_CH; ++ch) {
            if (c_begin + j * STAGE_CH + ch >= c_end) break;
            uint4 wb[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) wb[t] = st[wide_slot<BN>(ch, warp * 8 * NT + t * 8 + g, q)];
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                if ((uint32_t)rt >= row_tiles) break;
                const uint4 ra = st[wide_slot<BN>(ch, BN + rt * 16 + g, q)];
                const uint4 rb = st[wide_slot<BN>(ch, BN + rt * 16 + g + 8, q)];
#pragma unroll
                for (int t = 0; t < NT; ++t) mma_chunk(acc[rt][t], ra, rb, wb[t]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();  // the ring is free: the partials take its place

    // Partials: [warp][row tile][column tile][lane] float4, the MMA accumulator layout.
    float4* part = reinterpret_cast<float4*>(smem);
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
            part[((warp * 4 + rt) * NT + t) * 32 + lane] =
                make_float4(acc[rt][t][0], acc[rt][t][1], acc[rt][t][2], acc[rt][t][3]);
    cluster_publish_arrive();
    cluster_wait();
    // This block's share of the tile: float4 `f` of the partial layout, summed over the
    // segments in order.
    constexpr uint32_t PART_VECS = LIN_STREAM_WARPS * 4 * NT * 32;
    for (uint32_t f = seg * (PART_VECS / LIN_SEGS) + tid; f < (seg + 1) * (PART_VECS / LIN_SEGS);
         f += blockDim.x) {
        const uint32_t ln = f % 32, t = (f / 32) % NT, rt = (f / (32 * NT)) % 4, wp = f / (128 * NT);
        if (rt >= row_tiles) continue;
        const float4 total = cluster_segment_sum<false>(cluster, part, f, nsegs);
        const float vals[4] = {total.x, total.y, total.z, total.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const uint32_t row = m0 + rt * 16 + ln / 4 + (i >= 2 ? 8 : 0);
            const uint32_t col = n0 + wp * 8 * NT + t * 8 + (ln % 4) * 2 + (i & 1);
            if (row < m && col < n) store_out(out, (size_t)row * n + col, vals[i]);
        }
    }
    cluster_leave_barrier();  // no block leaves while another still reads its partials
}


#define LIN_W_NT 2        // column tiles per warp: tiles of 128 columns
#define LIN_W_STAGE_CH 2  // chunks per stage
#define LIN_W_STAGES 3    // 72 KiB of shared memory: three blocks per multiprocessor

template <typename OutT>
MT_DEVICE void linear_stream_wide_dispatch(OutT* out, const bf16* x, const bf16* w, uint32_t m,
                                           uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_stream_smem[];
    // Uniform over the grid, so every block of a cluster leaves together.
    if (m == 0 || n == 0 || blockDim.x != LIN_STREAM_WARPS * 32) return;
    if (k % 8 != 0 || !aligned16(x) || !aligned16(w))
        linear_wide_impl<OutT, LIN_W_NT, LIN_W_STAGE_CH, LIN_W_STAGES, false>(out, x, w, m, n, k,
                                                                              lin_stream_smem, blockIdx.x / LIN_SEGS);
    else
        linear_wide_impl<OutT, LIN_W_NT, LIN_W_STAGE_CH, LIN_W_STAGES, true>(out, x, w, m, n, k,
                                                                             lin_stream_smem, blockIdx.x / LIN_SEGS);
}

// linear_stream_wide(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): `linear`, the
// decode path for 16 < m <= 128. Clusters of LIN_SEGS blocks, grid (LIN_SEGS * ceil(n / 128) *
// ceil(m / 64)), 256 threads, LIN_W_STAGES * LIN_W_STAGE_CH * 192 * 64 bytes of dynamic shared
// memory (72 KiB).
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_wide(bf16* __restrict__ out, const bf16* __restrict__ x,
                       const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_stream_wide_dispatch(out, x, w, m, n, k);
}

// linear_stream_wide_f32out(out: f32 [m, n], x, w, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_wide_f32out(float* __restrict__ out, const bf16* __restrict__ x,
                              const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_stream_wide_dispatch(out, x, w, m, n, k);
}

// ---- The m <= 16 decode kernel (`linear_stream`) ----
// Persistent blocks: block b takes the units (one column tile of 8 output columns by one row tile
// of 16 rows) b, b + gridDim.x, ...; warp w computes segment w of each, loading its weight
// fragments straight into registers: a batch is B chunks (one 16-byte load per lane and chunk, 8
// weight rows x 64 bytes per warp-wide load), and two batches are in flight per warp while it
// computes. The batches run on across the block's units, so the next unit's first two batches
// are loading while this unit's last two are computed and summed; the first two are loaded
// before `pdl_wait` (the weight is never written by the kernel ahead on the stream). x comes
// through L1 (it is small and every block rereads it). The warps leave their segment partials
// in shared memory (two buffers, by unit parity: one barrier a unit) and the block sums them in
// segment order.

// 16 weight bytes, read once: past L1, asking L2 for the whole 256-byte span (the rest of the
// row's bytes are read by the next loads of this warp and its neighbours).
MT_DEVICE uint4 ldg_stream16(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <int B, bool VEC>
MT_DEVICE void direct_load_w(uint4 (&dst)[B], const bf16* w, uint32_t n, uint32_t k, uint32_t row,
                             uint32_t c0, uint32_t c_end, uint32_t q) {
#pragma unroll
    for (int ch = 0; ch < B; ++ch) {
        const uint32_t c = c0 + ch, col = c * LIN_KC + q * 8;
        if (VEC)
            dst[ch] = c < c_end && row < n && col < k ? ldg_stream16(w + (size_t)row * k + col) : make_uint4(0, 0, 0, 0);
        else
            dst[ch] = c < c_end ? load8(w, n, k, row, col, false) : make_uint4(0, 0, 0, 0);
    }
}

// The MMAs of one batch (chunks c0 .. c0 + B - 1 of this warp's segment, those before c_end).
// RB: x rows g + 8 are loaded too (a unit may have rows past its first 8).
template <int B, bool RB, bool VEC>
MT_DEVICE void direct_batch(float (&acc)[4], const uint4 (&wr)[B], const bf16* x, uint32_t m,
                            uint32_t k, uint32_t m0, uint32_t c0, uint32_t c_end, uint32_t g, uint32_t q) {
    uint4 ra[B], rb[B];
#pragma unroll
    for (int ch = 0; ch < B; ++ch) {
        const uint32_t c = c0 + ch, col = c * LIN_KC + q * 8;
        ra[ch] = c < c_end ? load8(x, m, k, m0 + g, col, VEC) : make_uint4(0, 0, 0, 0);
        rb[ch] = RB && c < c_end ? load8(x, m, k, m0 + g + 8, col, VEC) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int ch = 0; ch < B; ++ch) {
        if (c0 + ch >= c_end) break;
        mma_chunk(acc, ra[ch], rb[ch], wr[ch]);
    }
}

// The block's units in turn: blockIdx.x, blockIdx.x + gridDim.x, ... A warp's batch count is
// rounded up to even (an empty batch loads nothing and adds nothing), so every unit starts in
// the same register buffer. Which block computes a unit, and with which batch size, never
// changes its chain of MMAs. The block lets the next kernel start (`pdl_trigger`) only as it
// begins its last unit, as a block per unit did once the last of them had started: triggering
// at the start, Qwen3-8B's batch-1 step went from 4.90 to 5.62 ms (H200, 2026-12-01; the
// norms, cache store and attention behind the projections then took their multiprocessors
// early, as at batch 1 in the session-16 note at `pdl_enter`). Blocks taking their units from
// an atomic counter instead (so that one which started late would take fewer) were slower
// still: 4.82 with the claim's answer read at once, 5.04 with it read a unit later, against
// 4.70 taking them in turn.
// SWIGLU (`linear_swiglu`): w is [2n, k], gate rows then up rows. A block takes pairs of units,
// the gate tile of 8 columns and then the up tile of the same columns, and writes silu(gate) *
// up of the two, each summed as `linear` sums it and rounded to bf16 as `linear` writes it: the
// thread that sums an output's gate column keeps the total for its up column, the next unit.
template <typename OutT, int B, bool RB, bool VEC, bool SWIGLU>
MT_DEVICE void linear_direct_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                                  uint32_t k, float4 (*part)[LIN_STREAM_WARPS * 32]) {
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const LinSegment span = lin_segment(k, warp);
    const uint32_t nsegs = span.nsegs, c_begin = span.c_begin, c_end = span.c_end;
    // Row tiles of one column tile are neighbouring units, so they run together and all but the
    // first read the weight tile from L2 (the launcher sends only m <= 16, one row tile, here).
    // Under SWIGLU a unit is half h of tile pair u / 2: its gate (h = 0) or up (h = 1) rows.
    const uint32_t row_units = (m + 15) / 16, tiles = ((n + 7) / 8) * row_units;
    const uint32_t units = SWIGLU ? 2 * tiles : tiles;
    // The block's i-th unit: blockIdx.x, blockIdx.x + gridDim.x, ... (pairs of them, SWIGLU).
    auto unit_of = [&](uint32_t i) -> uint32_t {
        return SWIGLU ? 2 * (blockIdx.x + (i >> 1) * gridDim.x) + (i & 1) : blockIdx.x + i * gridDim.x;
    };
    auto w_row = [&](uint32_t u) -> uint32_t {  // the unit's first weight row (lane g reads + g)
        return SWIGLU ? (u & 1) * n + ((u >> 1) / row_units) * 8 : (u / row_units) * 8;
    };
    const uint32_t nb = (c_end - c_begin + B - 1) / B, nbe = nb + (nb & 1);  // this warp's batches
    // Batch bb of the block's unit i, where bb may run past it into the block's next unit.
    auto load = [&](uint4 (&dst)[B], uint32_t i, uint32_t bb) {
        if (bb >= nbe) {
            ++i;
            bb -= nbe;
        }
        const uint32_t u = unit_of(i);
        if (u < units) direct_load_w<B, VEC>(dst, w, SWIGLU ? 2 * n : n, k, w_row(u) + g, c_begin + bb * B, c_end, q);
    };

    // Two batches load before the wait. H200 (2026-12-02, circuit, context 1024): one batch
    // before it took Qwen3-8B batch 1 from 4.551 / 4.565 to 4.603 / 4.614 ms, none to 4.615 /
    // 4.622; asking L2 for more of the block's weight as well (cp.async.bulk.prefetch.L2, 24,
    // 48 or 96 KiB a block) to 4.68-4.72, 4.83-4.85 and 5.06-5.11.
    uint4 wa[B], wb[B];
    if (nbe > 0) {
        load(wa, 0, 0);
        load(wb, 0, 1);
    }
    pdl_wait();  // x and out belong to the kernels around this one
    float gate = 0.0f;  // SWIGLU: this thread's gate total, from the pair's first unit
    for (uint32_t i = 0, u = unit_of(0); u < units; u = unit_of(++i)) {  // caller: blockIdx.x < tiles
        if (unit_of(i + 1) >= units) pdl_trigger();
        const uint32_t tile = SWIGLU ? u >> 1 : u;
        const uint32_t m0 = (tile % row_units) * 16;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint32_t b = 0; b < nbe; b += 2) {
            direct_batch<B, RB, VEC>(acc, wa, x, m, k, m0, c_begin + b * B, c_end, g, q);
            load(wa, i, b + 2);
            direct_batch<B, RB, VEC>(acc, wb, x, m, k, m0, c_begin + (b + 1) * B, c_end, g, q);
            load(wb, i, b + 3);
        }
        float4* pp = part[i & 1];
        pp[warp * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();  // also orders this buffer's reads below before its writes two units on
        if (tid < 128) {
            const uint32_t ln = tid / 4, e = tid % 4;
            const uint32_t row = m0 + ln / 4 + (e >= 2 ? 8 : 0);
            const uint32_t col = (tile / row_units) * 8 + (ln % 4) * 2 + (e & 1);
            if (row < m && col < n) {
                const float* pf = reinterpret_cast<const float*>(pp);
                float total = 0.0f;
                for (uint32_t sg = 0; sg < nsegs; ++sg) total += pf[(sg * 32 + ln) * 4 + e];
                if (!SWIGLU)
                    store_out(out, (size_t)row * n + col, total);
                else if ((u & 1) == 0)
                    gate = total;
                else
                    store_out(out, (size_t)row * n + col, siluf_acc(bf2f(f2bf(gate))) * bf2f(f2bf(total)));
            }
        }
    }
}

#define LIN_D_B 8     // chunks per batch of the m <= 8 instance
#define LIN_D_B_RB 4  // chunks per batch of the m > 8 instance (x rows g + 8 as well)

// B: chunks per batch of the aligned m <= 8 instance; BR: of the others (x rows g + 8 as well, or
// scalar loads, which need more registers). The choice is the launch's, uniform over its blocks.
// SWIGLU: `linear_swiglu` (see `linear_direct_impl`).
template <typename OutT, int B, int BR, bool SWIGLU = false>
MT_DEVICE void linear_direct_dispatch(OutT* out, const bf16* x, const bf16* w, uint32_t m,
                                      uint32_t n, uint32_t k) {
    __shared__ float4 part[2][LIN_STREAM_WARPS * 32];
    if (m == 0 || n == 0 || blockDim.x != LIN_STREAM_WARPS * 32) return;
    if (blockIdx.x >= ((n + 7) / 8) * ((m + 15) / 16)) return;  // uniform over the block
    const bool vec = k % 8 == 0 && aligned16(x) && aligned16(w);
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
    linear_stream(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                  uint32_t m, uint32_t n, uint32_t k) {
    linear_direct_dispatch<bf16, LIN_D_B, LIN_D_B_RB>(out, x, w, m, n, k);
}

// linear_stream_f32out(out: f32 [m, n], x, w, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    linear_stream_f32out(float* __restrict__ out, const bf16* __restrict__ x,
                         const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_direct_dispatch<float, LIN_D_B, LIN_D_B_RB>(out, x, w, m, n, k);
}

// linear_stream_b4(out: bf16 [m, n], x, w, m, n, k): `linear_stream` with batches of 4 chunks (2
// for 16-row units and unaligned operands) and three blocks per multiprocessor, the launcher's
// choice for m <= 16 on projections of 6144 columns or more (qkv, gate/up, the GDN input, LM
// heads: `ops_gemm::LINEAR_B4_MIN_N`). Same grid.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_b4(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                     uint32_t m, uint32_t n, uint32_t k) {
    linear_direct_dispatch<bf16, 4, 2>(out, x, w, m, n, k);
}

// linear_stream_b4_f32out(out: f32 [m, n], x, w, m, n, k): likewise, f32 out.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_stream_b4_f32out(float* __restrict__ out, const bf16* __restrict__ x,
                            const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_direct_dispatch<float, 4, 2>(out, x, w, m, n, k);
}

// linear_swiglu(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [2 n, k], m, n, k): `linear` (gate rows
// then up rows of w) then `silu_mul`, in one launch, the rows of the two bit for bit: each
// output is silu(gate) * up of the gate and up columns `linear` would write, rounded to bf16 as
// it writes them, and the gate/up rows are never written. The circuit's `linear(gate_up) >
// silu_mul` at the narrow decode widths. `linear_stream_b4`'s batches and residency; a block
// takes pairs of units (a gate tile, then its up tile), so the grid is any number of blocks up
// to ceil(n / 8) * ceil(m / 16), as `linear_stream`'s for n columns.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 3)
    linear_swiglu(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                  uint32_t m, uint32_t n, uint32_t k) {
    linear_direct_dispatch<bf16, 4, 2, true>(out, x, w, m, n, k);
}


#include "gemm_wgmma.cuh"

template <typename OutT>
MT_DEVICE void linear_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                           uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_smem[];
    if (m == 0 || n == 0 || blockDim.x != LIN_THREADS) return;
    pdl_wait();  // launched as a programmatic dependent (ops::linear_geometry)
    pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)  // wgmma and setmaxnreg: the sm_90a cubin
    if (k % 4 == 0 && aligned8(x) && aligned8(w))
        linear_ws<OutT, LIN_STAGES, LIN_BM, true>(out, x, w, m, n, k, lin_smem);
    else
        linear_ws<OutT, LIN_STAGES, LIN_BM, false>(out, x, w, m, n, k, lin_smem);
#else  // the compute_90 PTX: the mma.sync tiles, same numerics, same block tile
    linear_tiled<OutT, LIN_BM, LIN_BN, LIN_T_WM, LIN_T_WN, LIN_T_SC, LIN_T_ST, false>(out, x, w, m, n, k,
                                                                                      lin_smem);
#endif
}

// linear(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k).
extern "C" __global__ void __launch_bounds__(LIN_THREADS, 1)
    linear(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
           uint32_t m, uint32_t n, uint32_t k) {
    linear_impl(out, x, w, m, n, k);
}

// linear_f32out(out: f32 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): the LM head.
extern "C" __global__ void __launch_bounds__(LIN_THREADS, 1)
    linear_f32out(float* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                  uint32_t m, uint32_t n, uint32_t k) {
    linear_impl(out, x, w, m, n, k);
}

// ---- `linear_tma`: the prefill kernel of the sm_90a cubin where the shape allows ----

// permute_k32_tiles(out: bf16 image, x: bf16 [m, k], m, k): x as the stage images `linear_tma`
// copies whole. For row tile tt (128 rows) and stage j (chunks 2j, 2j + 1 of 32 k), 16 KiB of
// 128 rows x 128 bytes; in a row, 16-byte unit t of chunk c sits at (4 (c % 2) + t) ^ (r % 8)
// (the 128-byte swizzle) and holds, in `k32_pairs` order, the chunk's 4-byte pairs t, t + 4,
// t + 8, t + 12 (k 2t, 2t + 1, 2t + 8, ...). Rows past m (to the tile) and k past the end (to the
// stage) are zero. Needs k % 8 == 0 and a 16-byte aligned x; the image takes
// ceil(m / 128) * ceil(k / 64) * 16 KiB. Grid-stride, one thread per (row, chunk), chunks
// fastest. (Tried on the H200, 2026-12-01, at 2048 x 4096: this 18 us; a thread per (row,
// stage) 28 us, rows fastest or stages fastest.)
extern "C" __global__ void __launch_bounds__(256)
    permute_k32_tiles(bf16* __restrict__ out, const bf16* __restrict__ x, uint32_t m, uint32_t k) {
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

template <typename OutT>
MT_DEVICE void linear_tma_impl(OutT* out, const bf16* xt, const bf16* w, const void* wmap, uint32_t m, uint32_t n,
                               uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_tma_smem[];
    if (m == 0 || n == 0 || blockDim.x != 384) return;
    pdl_wait();  // launched as a programmatic dependent, like `linear`
    pdl_trigger();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    (void)w;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC, seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    if (seg_chunks % 2 == 0 && chunks % 2 == 0)  // segments end with stages (uniform over the grid)
        linear_tma_body<OutT, LIN_TMA_STAGES, false>(out, xt, wmap, m, n, k, lin_tma_smem);
    else
        linear_tma_body<OutT, LIN_TMA_STAGES, true>(out, xt, wmap, m, n, k, lin_tma_smem);
#else  // the compute_90 PTX: the mma.sync tiles reading x from the images (no tensor map)
    (void)wmap;
    // 8 warps of 64 x 32 per 128 x 128 tile; the other four leave (barriers count the rest).
    if (threadIdx.x >= 256) return;
    linear_tiled<OutT, LIN_TMA_TILE, LIN_TMA_TILE, 64, 32, 2, 3, false, true>(out, xt, w, m, n, k, lin_tma_smem);
#endif
}

// linear_tma(out: bf16 [m, n], xt: `permute_k32_tiles` of x [m, k], w: bf16 [n, k], wmap: a 2-D
// tensor map of w (bf16, dims (k, n), box 64 x 128, 128-byte swizzle) in device memory, m, n, k):
// `linear`. Grid (ceil(m / 128), ceil(n / 128)), 384 threads, LIN_TMA_STAGES * 32 KiB + 2 KiB of
// dynamic shared memory. Needs k % 8 == 0 and 16-byte aligned operands.
extern "C" __global__ void __launch_bounds__(384, 1)
    linear_tma(bf16* __restrict__ out, const bf16* __restrict__ xt, const bf16* __restrict__ w,
               const void* __restrict__ wmap, uint32_t m, uint32_t n, uint32_t k) {
    linear_tma_impl(out, xt, w, wmap, m, n, k);
}

// linear_tma_f32out(out: f32 [m, n], xt, w, wmap, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __launch_bounds__(384, 1)
    linear_tma_f32out(float* __restrict__ out, const bf16* __restrict__ xt, const bf16* __restrict__ w,
                      const void* __restrict__ wmap, uint32_t m, uint32_t n, uint32_t k) {
    linear_tma_impl(out, xt, w, wmap, m, n, k);
}

// ---- `linear_stream_tma`: the decode kernel of the sm_90a cubin where a weight map exists ----

template <typename OutT>
MT_DEVICE void linear_stream_tma_impl(OutT* out, const bf16* x, const bf16* ximg, const bf16* w, const void* wmap,
                                      uint32_t m, uint32_t n, uint32_t k) {
    extern __shared__ __align__(1024) unsigned char lin_dec_smem[];
    // Uniform over the grid, so every block of a cluster leaves together.
    if (m == 0 || n == 0 || blockDim.x != LIN_DEC_THREADS) return;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    (void)w;
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
        linear_dec_body<OutT, 8>(out, x, xi, wmap, m, n, k, row_blocks, smem);
    else if (rows == 16)
        linear_dec_body<OutT, 16>(out, x, xi, wmap, m, n, k, row_blocks, smem);
    else if (rows == 32)
        linear_dec_body<OutT, 32>(out, x, xi, wmap, m, n, k, row_blocks, smem);
    else
        linear_dec_body<OutT, 64>(out, x, xi, wmap, m, n, k, row_blocks, smem);
#else  // the compute_90 PTX: `linear_stream_wide`'s body (no wgmma, no tensor map) on each of the
       // cluster's tiles in turn, from x's rows (never its images); the warps past its eight
       // compute partials nobody sums.
    (void)wmap;
    (void)ximg;
    const uint32_t tiles = (n + 127) / 128 * ((m + LIN_W_ROWS - 1) / LIN_W_ROWS);
    for (uint32_t t = blockIdx.x / LIN_SEGS; t < tiles; t += gridDim.x / LIN_SEGS) {
        if (k % 8 != 0 || !aligned16(x) || !aligned16(w))
            linear_wide_impl<OutT, LIN_W_NT, LIN_W_STAGE_CH, LIN_W_STAGES, false>(out, x, w, m, n, k, lin_dec_smem, t);
        else
            linear_wide_impl<OutT, LIN_W_NT, LIN_W_STAGE_CH, LIN_W_STAGES, true>(out, x, w, m, n, k, lin_dec_smem, t);
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
    linear_stream_tma(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ ximg,
                      const bf16* __restrict__ w, const void* __restrict__ wmap, uint32_t m, uint32_t n,
                      uint32_t k) {
    linear_stream_tma_impl(out, x, ximg, w, wmap, m, n, k);
}

// linear_stream_tma_f32out(out: f32 [m, n], x, ximg, w, wmap, m, n, k): `linear_f32out`,
// likewise.
extern "C" __global__ void __cluster_dims__(LIN_SEGS, 1, 1) __launch_bounds__(LIN_DEC_THREADS, 1)
    linear_stream_tma_f32out(float* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ ximg,
                             const bf16* __restrict__ w, const void* __restrict__ wmap, uint32_t m, uint32_t n,
                             uint32_t k) {
    linear_stream_tma_impl(out, x, ximg, w, wmap, m, n, k);
}
