// out = x · wᵀ with a bf16 weight in the checkpoint's [out_features, in_features] layout. CPU
// twins: metrale-gpu-runtime/src/cpu/kernels/gemm.rs.
//
// One function per output type (`linear`: bf16, `linear_f32out`: f32), each with two paths
// chosen by m alone, with the launcher (`ops::linear_geometry`) choosing the matching geometry:
// - m <= LIN_SMALL_M_MAX (decode): GEMV-style. A block of 8 warps owns `ntiles` tiles of 8
//   output columns for 16 rows; warps stream the weight rows straight from global memory with
//   16-byte loads, a whole 256-wide k slice (8 loads per lane) in flight at once, and each
//   weight read serves all 16 rows of the tile. Grid (ceil(m / 16), ceil(n / (8 * ntiles))),
//   256 threads, ntiles * slices * 512 bytes of dynamic shared memory for the slice partials.
// - m > LIN_SMALL_M_MAX (prefill): a tiled tensor-core kernel. 128 x 64 output tiles, 8 warps
//   of 32 x 32, a 4-stage cp.async pipeline of 32-wide k tiles. Grid (ceil(n / 64),
//   ceil(m / 128)), 256 threads, 48 KiB of dynamic shared memory.
//
// Numerics (the same in both paths, hence batch-invariant): every output element is the f32
// sum, in slice order, of per-slice partials; a slice is 256 k (8 chunks of 32), and a slice's
// partial is a chain of mma.sync m16n8k16 (bf16 in, f32 accumulate) over its chunks in order,
// starting from zero. Inside a chunk, lane (g = lane / 4, q = lane % 4) holds k 8q..8q+7 of its
// rows (one 16-byte load); the first MMA takes k 8q..8q+3 and the second 8q+4..8q+7, the same
// permutation of k for x and w, so the dot product is unchanged. Row r always sits at position
// r % 16 of its MMA and column c at c % 8, whatever m is; out-of-range rows, columns and k are
// zero. So a row's output is bitwise the same whatever `m` is and whichever path runs it.
// cuBLASLt was not used for prefill: its algorithm (and so its rounding) changes with m, which
// would break "prefix-cached vs cold" and "batched vs alone" bitwise equality.
#include "common.cuh"

#define LIN_KC 32
#define LIN_SLICE_CHUNKS 8
#define LIN_SLICE (LIN_KC * LIN_SLICE_CHUNKS)
#define LIN_SMALL_M_MAX 64
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

// Warps of a small-path block that split one column tile's slices: min(8, 2^floor(log2 S)).
MT_DEVICE uint32_t warps_per_tile(uint32_t slices) {
    uint32_t w = 1;
    while (w * 2 <= slices && w < 8) w *= 2;
    return w;
}

template <typename OutT>
MT_DEVICE void linear_small(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                            uint32_t k, bool vec, unsigned char* smem) {
    float4* part = reinterpret_cast<float4*>(smem);  // [ntiles][slices][32 lanes]
    const uint32_t slices = (k + LIN_SLICE - 1) / LIN_SLICE;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t wpn = warps_per_tile(slices), ntiles = 8 / wpn;
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const uint32_t tl = warp / wpn, phase = warp % wpn;
    const uint32_t m0 = blockIdx.x * 16;
    const uint32_t n0 = (blockIdx.y * ntiles + tl) * 8;

    if (n0 < n) {
        for (uint32_t s = phase; s < slices; s += wpn) {
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const uint32_t k0 = s * LIN_SLICE;
            uint4 wb[LIN_SLICE_CHUNKS], ra[LIN_SLICE_CHUNKS], rb[LIN_SLICE_CHUNKS];
#pragma unroll
            for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch)
                wb[ch] = load8(w, n, k, n0 + g, k0 + ch * LIN_KC + q * 8, vec);
#pragma unroll
            for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                ra[ch] = load8(x, m, k, m0 + g, k0 + ch * LIN_KC + q * 8, vec);
                rb[ch] = load8(x, m, k, m0 + g + 8, k0 + ch * LIN_KC + q * 8, vec);
            }
#pragma unroll
            for (int ch = 0; ch < LIN_SLICE_CHUNKS; ++ch) {
                if (s * LIN_SLICE_CHUNKS + ch >= chunks) break;
                mma_chunk(c, ra[ch], rb[ch], wb[ch]);
            }
            part[(tl * slices + s) * 32 + lane] = make_float4(c[0], c[1], c[2], c[3]);
        }
    }
    __syncthreads();

    const float* pf = reinterpret_cast<const float*>(part);
    for (uint32_t e = tid; e < ntiles * 128; e += blockDim.x) {
        const uint32_t t = e / 128, ln = (e % 128) / 4, j = e % 4;
        const uint32_t row = m0 + ln / 4 + (j >= 2 ? 8 : 0);
        const uint32_t col = (blockIdx.y * ntiles + t) * 8 + (ln % 4) * 2 + (j & 1);
        if (row >= m || col >= n) continue;
        float total = 0.0f;
        for (uint32_t s = 0; s < slices; ++s) total += pf[((t * slices + s) * 32 + ln) * 4 + j];
        store_out(out, (size_t)row * n + col, total);
    }
}

MT_DEVICE void cp_async16(void* dst, const void* src, uint32_t src_bytes) {
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(src_bytes));
}

MT_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
MT_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

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
    for (uint32_t c = 0; c < chunks; ++c) {
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

        if ((c + 1) % LIN_SLICE_CHUNKS == 0 || c + 1 == chunks) {
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

template <typename OutT>
MT_DEVICE void linear_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n,
                           uint32_t k) {
    extern __shared__ __align__(16) unsigned char lin_smem[];
    if (m == 0 || n == 0 || blockDim.x != LIN_THREADS) return;
    const bool vec = k % 8 == 0 && aligned16(x) && aligned16(w);
    if (m <= LIN_SMALL_M_MAX)
        linear_small(out, x, w, m, n, k, vec, lin_smem);
    else
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
