// out = x · wᵀ with a bf16 weight in the checkpoint's [out_features, in_features] layout. CPU
// twins: metrale-gpu-runtime/src/cpu/kernels/gemm.rs.
//
// Three kernels per output type (bf16: `linear`, `linear_stream`, `linear_stream_wide`; f32: the
// same with `_f32out`), each computing the whole function for any m; the launcher
// (`ops::linear_geometry`) runs `linear_stream` for m <= 16, `linear_stream_wide` for m <= 64
// (decode) and the tiled `linear` above:
// - `linear_stream` / `linear_stream_wide` (decode): persistent blocks streaming the weight. A
//   unit of work is 1 (narrow) or 2 (wide) column tiles of 8 output columns for 16 (narrow) or
//   up to 64 (wide, 4 row tiles) rows; block b takes units b, b + G, b + 2G, ... (G =
//   gridDim.x). The block's 8 warps split the unit's k into the LIN_SEGS segments (warp w:
//   segment w), so together they read the unit's weight rows (contiguous in memory) at once. Each
//   lane copies the 16-byte weight fragments it will feed to its own MMAs into its own slots of a
//   per-warp ring of 8-chunk stages in shared memory (cp.async), the next stages (and the next
//   unit's) in flight while it computes; x comes straight from global memory (L1 / L2). At the
//   end of a unit every warp leaves its segment's partial in shared memory and the block sums
//   them in segment order. Narrow: grid min(units, 264), 96 + 4 KiB of dynamic shared memory (two
//   blocks per multiprocessor), lean per-step code; wide: grid min(units, 132), 192 + 32 KiB.
// - `linear` (prefill): a tiled tensor-core kernel. 128 x 64 output tiles, 8 warps of 32 x 32, a
//   4-stage cp.async pipeline of 32-wide k tiles. Grid (ceil(n / 64), ceil(m / 128)), 256
//   threads, 48 KiB of dynamic shared memory.
//
// Numerics (the same in both kernels, hence batch-invariant): k is cut into chunks of 32 and the
// chunks into LIN_SEGS (8) contiguous segments of ceil(chunks / 8) chunks, a count fixed by k
// alone. A segment's partial is a chain of mma.sync m16n8k16 (bf16 in, f32 accumulate) over its
// chunks in order, starting from zero; every output element is the f32 sum of the non-empty
// segments' partials in segment order, starting from 0. Inside a chunk, lane (g = lane / 4,
// q = lane % 4) holds k 8q..8q+7 of its rows (one 16-byte load); the first MMA takes k 8q..8q+3
// and the second 8q+4..8q+7, the same permutation of k for x and w, so the dot product is
// unchanged. Row r always sits at position r % 16 of its MMA and column c at c % 8, whatever m
// is; out-of-range rows, columns and k are zero. So a row's output is bitwise the same whatever
// `m` is and whichever kernel runs it. cuBLASLt was not used for prefill: its algorithm (and so
// its rounding) changes with m, which would break "prefix-cached vs cold" and "batched vs alone"
// bitwise equality.
#include "common.cuh"

#define LIN_KC 32
#define LIN_SEGS 8
#define LIN_SLICE_CHUNKS 8  // chunks per stage of the decode kernel's weight ring
#define LIN_THREADS 256
#define LIN_BM 128
#define LIN_BN 64
#define LIN_STAGES 4

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

MT_DEVICE void store_out(bf16* out, size_t i, float v) { out[i] = f2bf(v); }
MT_DEVICE void store_out(float* out, size_t i, float v) { out[i] = v; }

// One pipeline stage: x rows [m0, m0 + 128) then w rows [n0, n0 + 64), 32 k each, as 16-byte
// vectors (4 per row), so vector i of the stage is row i / 4, k 8 * (i % 4).
MT_DEVICE void load_stage(uint4* stage, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                          uint32_t k, uint32_t m0, uint32_t n0, uint32_t chunk, bool vec) {
    for (uint32_t i = threadIdx.x; i < (LIN_BM + LIN_BN) * 4; i += blockDim.x) {
        const uint32_t row = i / 4, col = chunk * LIN_KC + (i % 4) * 8;
        const bool is_x = row < LIN_BM;
        const bf16* base = is_x ? x : w;
        const uint32_t rows = is_x ? m : n;
        const uint32_t grow = is_x ? m0 + row : n0 + (row - LIN_BM);
        if (vec) {
            const bool in = grow < rows && col < k;
            const bf16* src = in ? base + (size_t)grow * k + col : base;
            cp_async16(stage + i, src, in ? 16u : 0u);
        } else {
            stage[i] = load8(base, rows, k, grow, col, false);
        }
    }
}

template <typename OutT>
MT_DEVICE void linear_tiled(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                            uint32_t k, bool vec, unsigned char* smem) {
    uint4* stages = reinterpret_cast<uint4*>(smem);
    const uint32_t stage_vecs = (LIN_BM + LIN_BN) * 4;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const uint32_t m0 = blockIdx.y * LIN_BM, n0 = blockIdx.x * LIN_BN;
    const uint32_t wm0 = (warp >> 1) * 32, wn0 = (warp & 1) * 32;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;

    float acc[2][4][4], total[2][4][4];
#pragma unroll
    for (int a = 0; a < 2; ++a)
#pragma unroll
        for (int b = 0; b < 4; ++b)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[a][b][j] = total[a][b][j] = 0.0f;

#pragma unroll
    for (int s = 0; s < LIN_STAGES - 1; ++s) {
        if ((uint32_t)s < chunks) load_stage(stages + s * stage_vecs, x, w, m, n, k, m0, n0, s, vec);
        cp_async_commit();
    }
    for (uint32_t c = 0, in_seg = 1; c < chunks; ++c, ++in_seg) {
        cp_async_wait<LIN_STAGES - 2>();
        __syncthreads();
        const uint32_t pre = c + LIN_STAGES - 1;
        if (pre < chunks) load_stage(stages + (pre % LIN_STAGES) * stage_vecs, x, w, m, n, k, m0, n0, pre, vec);
        cp_async_commit();

        const uint4* sa = stages + (c % LIN_STAGES) * stage_vecs;
        const uint4* sb = sa + LIN_BM * 4;
        uint4 a[2][2], b[4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
            a[mt][0] = sa[(wm0 + mt * 16 + g) * 4 + q];
            a[mt][1] = sa[(wm0 + mt * 16 + g + 8) * 4 + q];
        }
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) b[nt] = sb[(wn0 + nt * 8 + g) * 4 + q];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt) mma_chunk(acc[mt][nt], a[mt][0], a[mt][1], b[nt]);

        if (in_seg == seg_chunks || c + 1 == chunks) {  // a segment ends
            in_seg = 0;
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        total[mt][nt][j] += acc[mt][nt][j];
                        acc[mt][nt][j] = 0.0f;
                    }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const uint32_t row = m0 + wm0 + mt * 16 + g + (j >= 2 ? 8 : 0);
                const uint32_t col = n0 + wn0 + nt * 8 + 2 * q + (j & 1);
                if (row < m && col < n) store_out(out, (size_t)row * n + col, total[mt][nt][j]);
            }
}

// The wide decode kernel: see the header. Each lane copies exactly the 16-byte weight fragments
// it later feeds to its own MMAs, into its own ring slots ([stage][tile][chunk][lane]), so no lane
// reads another's copies; a slot is refilled only after the same lane read it one step earlier.
#define LIN_STREAM_WARPS 8
#define LIN_STREAM_RING (192 * 1024)  // wide: weight ring bytes per block (then 32 KiB of partials)
#define LIN_STREAM_ROWS 64            // rows per unit (4 row tiles)

template <typename OutT, int NT, bool VEC>
MT_DEVICE void linear_stream_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                                  uint32_t k, unsigned char* smem) {
    constexpr uint32_t STAGE_VECS = NT * LIN_SLICE_CHUNKS * 32;
    constexpr int STAGES = LIN_STREAM_RING / (LIN_STREAM_WARPS * STAGE_VECS * 16);
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    uint4* ring = reinterpret_cast<uint4*>(smem) + (size_t)warp * STAGES * STAGE_VECS;
    // Segment partials: [warp][row tile][tile][lane] float4.
    float4* part = reinterpret_cast<float4*>(smem + LIN_STREAM_RING);
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t nsegs = seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 0;
    const uint32_t c_begin = min(chunks, warp * seg_chunks);
    const uint32_t c_end = min(chunks, c_begin + seg_chunks);
    // Steps (ring stages) per unit: the same for every warp, so the block stays in step.
    const uint32_t unit_steps = seg_chunks > 0 ? (seg_chunks + LIN_SLICE_CHUNKS - 1) / LIN_SLICE_CHUNKS : 1;
    const uint32_t col_units = (n + 8 * NT - 1) / (8 * NT);
    const uint32_t units = col_units * ((m + LIN_STREAM_ROWS - 1) / LIN_STREAM_ROWS);
    if (blockIdx.x >= units) return;  // uniform over the block
    const uint32_t steps = (units - blockIdx.x + gridDim.x - 1) / gridDim.x * unit_steps;

    // Queue the weight fragments of this warp's step j (unit j / unit_steps).
    auto issue = [&](uint32_t j) {
        if (j < steps) {
            const uint32_t u = blockIdx.x + (j / unit_steps) * gridDim.x;
            const uint32_t c0 = c_begin + (j % unit_steps) * LIN_SLICE_CHUNKS;
            const uint32_t n0 = (u % col_units) * NT * 8;
            uint4* st = ring + (j % STAGES) * STAGE_VECS;
            if constexpr (VEC) {
#pragma unroll
                for (int t = 0; t < NT; ++t)
#pragma unroll
                    for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                        const uint32_t row = n0 + t * 8 + g, c = c0 + ch, col = c * LIN_KC + q * 8;
                        const bool in = row < n && c < c_end && col < k;
                        cp_async16(st + (t * LIN_SLICE_CHUNKS + ch) * 32 + lane,
                                   in ? w + (size_t)row * k + col : w, in ? 16u : 0u);
                    }
            } else {
#pragma unroll 1
                for (int tc = 0; tc < NT * LIN_SLICE_CHUNKS; ++tc) {
                    const int t = tc / LIN_SLICE_CHUNKS, ch = tc % LIN_SLICE_CHUNKS;
                    const uint32_t row = n0 + t * 8 + g, c = c0 + ch;
                    st[tc * 32 + lane] = c < c_end ? load8(w, n, k, row, c * LIN_KC + q * 8, false)
                                                   : make_uint4(0, 0, 0, 0);
                }
            }
        }
        cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

#pragma unroll
    for (int p = 0; p < STAGES - 1; ++p) issue(p);
    float acc[4][NT][4];
#pragma unroll
    for (int rt = 0; rt < 4; ++rt)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.0f;

    for (uint32_t j = 0; j < steps; ++j) {
        cp_async_wait<STAGES - 2>();
        const uint4* st = ring + (j % STAGES) * STAGE_VECS;
        const uint32_t u = blockIdx.x + (j / unit_steps) * gridDim.x, js = j % unit_steps;
        const uint32_t m0 = (u / col_units) * LIN_STREAM_ROWS;
        const uint32_t c0 = c_begin + js * LIN_SLICE_CHUNKS;
        if constexpr (VEC) {
            uint4 wb[NT][LIN_SLICE_CHUNKS];
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch)
                    wb[t][ch] = st[(t * LIN_SLICE_CHUNKS + ch) * 32 + lane];
            issue(j + STAGES - 1);  // refills the stage read at step j - 1
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                const uint32_t r0 = m0 + rt * 16;
                if (r0 >= m) break;
                uint4 ra[LIN_SLICE_CHUNKS], rb[LIN_SLICE_CHUNKS];
#pragma unroll
                for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                    const uint32_t col = (c0 + ch) * LIN_KC + q * 8;
                    ra[ch] = load8(x, m, k, r0 + g, col, true);
                    rb[ch] = load8(x, m, k, r0 + g + 8, col, true);
                }
#pragma unroll
                for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                    if (c0 + ch >= c_end) break;
#pragma unroll
                    for (int t = 0; t < NT; ++t) mma_chunk(acc[rt][t], ra[ch], rb[ch], wb[t][ch]);
                }
            }
        } else {
            // The same chain, one chunk at a time, weights read from the ring.
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                const uint32_t r0 = m0 + rt * 16;
                if (r0 >= m) break;
#pragma unroll 1
                for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                    if (c0 + ch >= c_end) break;
                    const uint32_t col = (c0 + ch) * LIN_KC + q * 8;
                    const uint4 ra = load8(x, m, k, r0 + g, col, false);
                    const uint4 rb = load8(x, m, k, r0 + g + 8, col, false);
#pragma unroll
                    for (int t = 0; t < NT; ++t)
                        mma_chunk(acc[rt][t], ra, rb, st[(t * LIN_SLICE_CHUNKS + ch) * 32 + lane]);
                }
            }
            issue(j + STAGES - 1);  // after the reads: this lane's slots of stage j - 1 are free
        }

        if (js == unit_steps - 1) {
            // The unit's last step: leave the segment partial, then sum the segments in order.
#pragma unroll
            for (int rt = 0; rt < 4; ++rt)
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    part[((warp * 4 + rt) * NT + t) * 32 + lane] =
                        make_float4(acc[rt][t][0], acc[rt][t][1], acc[rt][t][2], acc[rt][t][3]);
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.0f;
                }
            __syncthreads();
            const uint32_t n0 = (u % col_units) * NT * 8;
            const float* pf = reinterpret_cast<const float*>(part);
            for (uint32_t e = tid; e < 4 * NT * 128; e += blockDim.x) {
                const uint32_t rt = e / (NT * 128), t = (e / 128) % NT, ln = (e % 128) / 4, i = e % 4;
                const uint32_t row = m0 + rt * 16 + ln / 4 + (i >= 2 ? 8 : 0);
                const uint32_t col = n0 + t * 8 + (ln % 4) * 2 + (i & 1);
                if (row >= m || col >= n) continue;
                float total = 0.0f;
                for (uint32_t sg = 0; sg < nsegs; ++sg) total += pf[(((sg * 4 + rt) * NT + t) * 32 + ln) * 4 + i];
                store_out(out, (size_t)row * n + col, total);
            }
            __syncthreads();  // the partials are read before the next unit overwrites them
        }
    }
    cp_async_wait<0>();
}

// Two column tiles per unit: each x fragment serves two weight fragments.
template <typename OutT>
MT_DEVICE void linear_stream_wide_dispatch(OutT* out, const bf16* x, const bf16* w, uint32_t m,
                                           uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_stream_smem[];
    if (m == 0 || n == 0 || blockDim.x != LIN_STREAM_WARPS * 32) return;
    if (k % 8 != 0 || !aligned16(x) || !aligned16(w))
        linear_stream_impl<OutT, 2, false>(out, x, w, m, n, k, lin_stream_smem);
    else
        linear_stream_impl<OutT, 2, true>(out, x, w, m, n, k, lin_stream_smem);
}

// linear_stream_wide(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): `linear`, the
// decode path for 16 < m <= 64.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 1)
    linear_stream_wide(bf16* __restrict__ out, const bf16* __restrict__ x,
                       const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_stream_wide_dispatch(out, x, w, m, n, k);
}

// linear_stream_wide_f32out(out: f32 [m, n], x, w, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 1)
    linear_stream_wide_f32out(float* __restrict__ out, const bf16* __restrict__ x,
                              const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_stream_wide_dispatch(out, x, w, m, n, k);
}

// The m <= 16 decode kernel (`linear_stream`): the same segments, one row tile (16 rows) and one
// column tile (8 columns) per unit, a 3-stage ring (96 KiB per block, two blocks per
// multiprocessor), lean per-step code: on full steps the copies and x loads use one base address
// and immediate offsets, and the unit / step cursors advance by increments, not divisions.
#define LIN_N_STAGES 3
#define LIN_N_RING (LIN_STREAM_WARPS * LIN_N_STAGES * LIN_SLICE_CHUNKS * 32 * 16)

template <typename OutT, bool VEC>
MT_DEVICE void linear_narrow_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                                  uint32_t k, unsigned char* smem) {
    constexpr uint32_t STAGE_VECS = LIN_SLICE_CHUNKS * 32;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    uint4* ring = reinterpret_cast<uint4*>(smem) + (size_t)warp * LIN_N_STAGES * STAGE_VECS + lane;
    float4* part = reinterpret_cast<float4*>(smem + LIN_N_RING);  // [warp][lane]
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t nsegs = seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 0;
    const uint32_t c_begin = min(chunks, warp * seg_chunks);
    const uint32_t c_end = min(chunks, c_begin + seg_chunks);
    const uint32_t unit_steps = seg_chunks > 0 ? (seg_chunks + LIN_SLICE_CHUNKS - 1) / LIN_SLICE_CHUNKS : 1;
    const uint32_t col_units = (n + 7) / 8;
    const uint32_t units = col_units * ((m + 15) / 16);
    if (blockIdx.x >= units) return;  // uniform over the block
    const uint32_t steps = (units - blockIdx.x + gridDim.x - 1) / gridDim.x * unit_steps;
    // A step is full when its 8 chunks lie inside the segment and inside k.
    auto full = [&](uint32_t c0) { return c0 + LIN_SLICE_CHUNKS <= c_end && (c0 + LIN_SLICE_CHUNKS) * LIN_KC <= k; };

    // Issue cursor: step ij of unit (i_ct, i_rt), step i_s within it.
    uint32_t ij = 0, i_s = 0, i_ct = blockIdx.x % col_units, i_rt = blockIdx.x / col_units;
    auto issue = [&]() {
        if (ij < steps) {
            const uint32_t row = i_ct * 8 + g, c0 = c_begin + i_s * LIN_SLICE_CHUNKS;
            uint4* st = ring + (ij % LIN_N_STAGES) * STAGE_VECS;
            if (VEC && row < n && full(c0)) {
                const bf16* src = w + (size_t)row * k + c0 * LIN_KC + q * 8;
#pragma unroll
                for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) cp_async16(st + ch * 32, src + ch * LIN_KC, 16u);
            } else {
#pragma unroll 1
                for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                    const uint32_t c = c0 + ch, col = c * LIN_KC + q * 8;
                    const bool in = row < n && c < c_end && col < k;
                    if (VEC)
                        cp_async16(st + ch * 32, in ? w + (size_t)row * k + col : w, in ? 16u : 0u);
                    else
                        st[ch * 32] = in ? load8(w, n, k, row, col, false) : make_uint4(0, 0, 0, 0);
                }
            }
            ++ij;
            if (++i_s == unit_steps) {
                i_s = 0;
                i_ct += gridDim.x;
                while (i_ct >= col_units) {
                    i_ct -= col_units;
                    ++i_rt;
                }
            }
        }
        cp_async_commit();  // an empty group past the end keeps the group count uniform
    };

#pragma unroll
    for (int p = 0; p < LIN_N_STAGES - 1; ++p) issue();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t c_s = 0, c_ct = blockIdx.x % col_units, c_rt = blockIdx.x / col_units;
    for (uint32_t j = 0; j < steps; ++j) {
        cp_async_wait<LIN_N_STAGES - 2>();
        const uint4* st = ring + (j % LIN_N_STAGES) * STAGE_VECS;
        uint4 wb[LIN_SLICE_CHUNKS];
#pragma unroll
        for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) wb[ch] = st[ch * 32];
        issue();  // refills the stage read at step j - 1
        const uint32_t c0 = c_begin + c_s * LIN_SLICE_CHUNKS;
        const uint32_t ra_row = c_rt * 16 + g, rb_row = ra_row + 8;
        if (VEC && full(c0)) {
            const bf16* xa = x + (size_t)ra_row * k + c0 * LIN_KC + q * 8;
            const bf16* xb = xa + (size_t)8 * k;
            uint4 ra[LIN_SLICE_CHUNKS], rb[LIN_SLICE_CHUNKS];
#pragma unroll
            for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                ra[ch] = ra_row < m ? load16(xa + ch * LIN_KC) : make_uint4(0, 0, 0, 0);
                rb[ch] = rb_row < m ? load16(xb + ch * LIN_KC) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) mma_chunk(acc, ra[ch], rb[ch], wb[ch]);
        } else {
#pragma unroll
            for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                const uint32_t c = c0 + ch;
                if (c >= c_end) break;
                const uint4 ra = load8(x, m, k, ra_row, c * LIN_KC + q * 8, VEC);
                const uint4 rb = load8(x, m, k, rb_row, c * LIN_KC + q * 8, VEC);
                mma_chunk(acc, ra, rb, wb[ch]);
            }
        }
        if (++c_s == unit_steps) {
            // The unit's last step: leave the segment partial, then sum the segments in order.
            part[warp * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] = 0.0f;
            __syncthreads();
            if (tid < 128) {
                const uint32_t ln = tid / 4, i = tid % 4;
                const uint32_t row = c_rt * 16 + ln / 4 + (i >= 2 ? 8 : 0);
                const uint32_t col = c_ct * 8 + (ln % 4) * 2 + (i & 1);
                if (row < m && col < n) {
                    const float* pf = reinterpret_cast<const float*>(part);
                    float total = 0.0f;
                    for (uint32_t sg = 0; sg < nsegs; ++sg) total += pf[(sg * 32 + ln) * 4 + i];
                    store_out(out, (size_t)row * n + col, total);
                }
            }
            __syncthreads();  // the partials are read before the next unit overwrites them
            c_s = 0;
            c_ct += gridDim.x;
            while (c_ct >= col_units) {
                c_ct -= col_units;
                ++c_rt;
            }
        }
    }
    cp_async_wait<0>();
}

template <typename OutT>
MT_DEVICE void linear_narrow_dispatch(OutT* out, const bf16* x, const bf16* w, uint32_t m,
                                      uint32_t n, uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_narrow_smem[];
    if (m == 0 || n == 0 || blockDim.x != LIN_STREAM_WARPS * 32) return;
    if (k % 8 == 0 && aligned16(x) && aligned16(w))
        linear_narrow_impl<OutT, true>(out, x, w, m, n, k, lin_narrow_smem);
    else
        linear_narrow_impl<OutT, false>(out, x, w, m, n, k, lin_narrow_smem);
}

// linear_stream(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): `linear`, the
// decode path for m <= 16. Grid (min(units, 264)), 256 threads, LIN_N_RING + 4 KiB of dynamic
// shared memory.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    linear_stream(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                  uint32_t m, uint32_t n, uint32_t k) {
    linear_narrow_dispatch(out, x, w, m, n, k);
}

// linear_stream_f32out(out: f32 [m, n], x, w, m, n, k): `linear_f32out`, likewise.
extern "C" __global__ void __launch_bounds__(LIN_STREAM_WARPS * 32, 2)
    linear_stream_f32out(float* __restrict__ out, const bf16* __restrict__ x,
                         const bf16* __restrict__ w, uint32_t m, uint32_t n, uint32_t k) {
    linear_narrow_dispatch(out, x, w, m, n, k);
}

template <typename OutT>
MT_DEVICE void linear_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                           uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_smem[];
    if (m == 0 || n == 0 || blockDim.x != LIN_THREADS) return;
    const bool vec = k % 8 == 0 && aligned16(x) && aligned16(w);
    linear_tiled(out, x, w, m, n, k, vec, lin_smem);
}

// linear(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k).
extern "C" __global__ void __launch_bounds__(LIN_THREADS)
    linear(bf16* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
           uint32_t m, uint32_t n, uint32_t k) {
    linear_impl(out, x, w, m, n, k);
}

// linear_f32out(out: f32 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k): the LM head.
extern "C" __global__ void __launch_bounds__(LIN_THREADS)
    linear_f32out(float* __restrict__ out, const bf16* __restrict__ x, const bf16* __restrict__ w,
                  uint32_t m, uint32_t n, uint32_t k) {
    linear_impl(out, x, w, m, n, k);
}
