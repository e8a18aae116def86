// The mma.sync building blocks of the `linear` family (kernels/gemm.cu, whose header has the
// numerics every kernel shares): the m16n8k16 MMA and a 32-wide k chunk of two, the 8-element
// loads with their zero fill, the stage images' loads, the tiled body of the compute_90 PTX,
// and the segments of k with their cluster sum. Included by gemm.cu only.

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

// The weight of the tiled kernel's scalar loads: lane (g, q)'s 8 bf16 of row `row` from column
// `col` (zero outside), from a bf16 weight here, from a block-FP8 one through `TiledWFp8`
// (gemm_wgmma.cuh), converted as read.
MT_DEVICE uint4 tiled_w8(const bf16* w, uint32_t n, uint32_t k, uint32_t row, uint32_t col) {
    return load8(w, n, k, row, col, false);
}

// The SwiGLU exchange of `linear_tma_swiglu` (and its compute_90 body): the tile's gate values
// [128 x rows][64 columns] as bf16, then its up values likewise, each row's eight 16-byte units
// (8 columns each) swizzled by the row, so a warp's unit loads and its 2-byte stores spread over
// the banks. Byte offset of unit u of row r in one of the two halves:
MT_DEVICE uint32_t lin_swiglu_xoff(uint32_t r, uint32_t u) { return r * 128 + ((u ^ (r % 8)) << 4); }

// Tile value (x row `r`, weight row `c` of the tile: gate column c below 64, else up column
// c - 64) rounded to bf16, as `linear` stores it, into the exchange at shared address `xch`.
MT_DEVICE void lin_swiglu_put(uint32_t xch, uint32_t r, uint32_t c, float v) {
    const bf16 h = f2bf(v);
    const uint32_t at = xch + (c / 64) * (LIN_TMA_TILE * 128) + lin_swiglu_xoff(r, (c % 64) / 8) + (c % 8) * 2;
    asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(at), "h"(__bfloat16_as_ushort(h)) : "memory");
}

// From the exchange at shared address `xch` (every value written and visible to the `threads`
// threads calling): silu(gate) * up of the tile's rows t0.. (those below m) and columns
// n0 .. n0 + 63 of an [m, n] SwiGLU into its stage images `img`, a 16-byte unit (8 columns) at a
// time, as `silu_mul_staged` writes them; thread `t` of them takes units t, t + threads, ...
MT_DEVICE void lin_swiglu_store(unsigned char* img, uint32_t xch, uint32_t t0, uint32_t n0, uint32_t m, uint32_t n,
                                uint32_t t, uint32_t threads) {
    const uint32_t steps = ((n + LIN_KC - 1) / LIN_KC + 1) / 2;
    for (uint32_t i = t; i < LIN_TMA_TILE * 8; i += threads) {
        const uint32_t r = i / 8, u = i % 8, off = lin_swiglu_xoff(r, u);
        if (t0 + r >= m) continue;
        uint4 gv, uv;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(gv.x), "=r"(gv.y), "=r"(gv.z), "=r"(gv.w)
                     : "r"(xch + off));
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(uv.x), "=r"(uv.y), "=r"(uv.z), "=r"(uv.w)
                     : "r"(xch + LIN_TMA_TILE * 128 + off));
        const uint32_t v = n0 / 8 + u;  // the unit's 8 columns of the SwiGLU
        store_k32_unit(img, t0 + r, v / 4, v % 4, steps, silu_mul_packed8(gv, uv));
    }
}

// The weight rows of a SwiGLU tile as `linear_tiled` walks them (the compute_90 body of
// `linear_tma_swiglu`): row i of column tile y (row 128 y + i of the walk) is gate row 64 y + i
// for i < 64, else up row ffn + 64 y + i - 64 of the [2 ffn, k] weight `w`.
template <typename TW>
struct SwigluRows {
    TW w;
    uint32_t ffn;
};

template <typename TW>
MT_DEVICE uint4 tiled_w8(const SwigluRows<TW>& s, uint32_t, uint32_t k, uint32_t row, uint32_t col) {
    const uint32_t i = row % 128, r = row / 128 * 64 + (i < 64 ? i : s.ffn + i - 64);
    return tiled_w8(s.w, 2 * s.ffn, k, r, col);
}

// One pipeline stage: SC chunks of x rows [m0, m0 + BM) then w rows [n0, n0 + BN),
// 32 k each, as 16-byte vectors laid out [chunk][row][4 vectors] (vector q of a row holds k
// 8q..8q+7 of its chunk, what lane (g, q) feeds its MMAs; a warp's 8 rows of one vector column
// are 512 contiguous bytes, so its shared loads are conflict-free). Consecutive threads take
// consecutive vectors of a row, so each row's 128 bytes per stage are one contiguous read.
// TW: the weight (`tiled_w8`); VEC copies need a bf16 one.
template <int BM, int BN, int SC, int THREADS, bool VEC, bool XIMG = false, typename TW = const bf16*>
MT_DEVICE void load_stage(uint4* stage, const bf16* x, TW w, uint32_t m, uint32_t n, uint32_t k, uint32_t m0,
                          uint32_t n0, uint32_t step) {
    constexpr uint32_t ROWS = BM + BN;
#pragma unroll 4
    for (uint32_t i = threadIdx.x; i < ROWS * SC * 4; i += THREADS) {
        const uint32_t row = i / (SC * 4), ch = (i / 4) % SC, q = i % 4;
        const uint32_t col = (step * SC + ch) * LIN_KC + q * 8;
        const bool is_x = row < BM;
        const uint32_t grow = is_x ? m0 + row : n0 + (row - BM);
        uint4* dst = stage + (ch * ROWS + row) * 4 + q;
        if constexpr (VEC) {
            const bf16* base = is_x ? x : w;
            const bool in = grow < (is_x ? m : n) && col < k;
            cp_async16(dst, in ? base + (size_t)grow * k + col : base, in ? 16u : 0u);
        } else if (is_x) {
            *dst = XIMG ? load8_img(x, m, k, grow, col) : load8(x, m, k, grow, col, false);
        } else {
            *dst = tiled_w8(w, n, k, grow, col);
        }
    }
}

// `linear_tma`'s 128 x 128 output tiles as a grid of any size walks them: tile t covers x rows
// of row tile t % rows by weight rows of column tile t / rows (row tiles innermost, so the
// blocks running together share a weight tile); this block takes tiles first, first + stride, ...
struct LinTmaTiles {
    uint32_t rows, count, first, stride;
};

MT_DEVICE LinTmaTiles lin_tma_tiles(uint32_t m, uint32_t n) {
    LinTmaTiles t;
    t.rows = (m + LIN_TMA_TILE - 1) / LIN_TMA_TILE;
    t.count = t.rows * ((n + LIN_TMA_TILE - 1) / LIN_TMA_TILE);
    t.first = blockIdx.y * gridDim.x + blockIdx.x;
    t.stride = gridDim.x * gridDim.y;
    return t;
}

// The tiled kernel's body for a BM x BN block tile of (BM / WM) x (BN / WN) warps of WM x WN,
// SC chunks per stage and ST stages: `linear` in the compute_90 PTX, which cannot use wgmma
// (<LIN_BM, LIN_BN, LIN_T_WM, LIN_T_WN, LIN_T_SC, LIN_T_ST>, VEC false). Every instance has the
// same numerics.
// VEC: k % 8 == 0 and 16-byte aligned operands, so stages fill by cp.async; a compile-time
// choice, since a run-time branch in the copy loop slows every stage. The kernels here run the
// scalar loads (VEC false): the compute_90 PTX is the fallback where the sm_90a cubin cannot
// load.
// Each value of a warp's accumulators `t` (an m16n8 fragment a tile) with its row and column
// from the warp's origin (`r0`, `c0`; lane g * 4 + q): f(row, col, value).
template <int MT, int NT, typename F>
MT_DEVICE void lin_tile_frags(const float (&t)[MT][NT][4], uint32_t r0, uint32_t c0, uint32_t g, uint32_t q, F&& f) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
                f(r0 + mt * 16 + g + (jj >= 2 ? 8 : 0), c0 + nt * 8 + 2 * q + (jj & 1), t[mt][nt][jj]);
}

// The block computes row tile `row_tile` (x rows) by column tile `col_tile` (weight rows).
// XIMG: x is given as `permute_k32_tiles`'s stage images (the compute_90 body of `linear_tma`).
// TW: the weight (`tiled_w8`: bf16, or block FP8 for the compute_90 body of `linear_tma_fp8`).
// SWIGLU (`linear_tma_swiglu`, BM = BN = 128): TW is `SwigluRows`, `n` the SwiGLU's width, and
// the block writes silu(gate) * up of its 128 rows by 64 columns as the stage images `out`.
template <typename OutT, int BM, int BN, int WM, int WN, int SC, int ST, bool VEC, bool XIMG = false,
          typename TW = const bf16*, bool SWIGLU = false>
MT_DEVICE void linear_tiled(OutT* out, const bf16* x, TW w, uint32_t m, uint32_t n, uint32_t k,
                            unsigned char* smem, uint32_t row_tile, uint32_t col_tile) {
    constexpr int MT = WM / 16, NT = WN / 8, THREADS = (BM / WM) * (BN / WN) * 32;
    constexpr uint32_t ROWS = BM + BN, STAGE_VECS = SC * ROWS * 4;
    uint4* stages = reinterpret_cast<uint4*>(smem);
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const uint32_t m0 = row_tile * BM, n0 = col_tile * BN;
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
            load_stage<BM, BN, SC, THREADS, VEC, XIMG, TW>(stages + s * STAGE_VECS, x, w, m, n, k, m0, n0, s);
        cp_async_commit();
    }
    uint32_t in_seg = 0;
    for (uint32_t j = 0; j < steps; ++j) {
        cp_async_wait<ST - 2>();
        __syncthreads();
        const uint32_t pre = j + ST - 1;
        if (pre < steps)
            load_stage<BM, BN, SC, THREADS, VEC, XIMG, TW>(stages + (pre % ST) * STAGE_VECS, x, w, m, n, k, m0, n0, pre);
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

    if constexpr (SWIGLU) {
        static_assert(BM == 128 && BN == 128, "a SwiGLU tile is 128 rows by 64 gate and 64 up columns");
        __syncthreads();  // every warp is done with the stages: the exchange takes their room
        const uint32_t xch = (uint32_t)__cvta_generic_to_shared(smem);
        lin_tile_frags(total, wm0, wn0, g, q,
                       [&](uint32_t row, uint32_t col, float v) { lin_swiglu_put(xch, row, col, v); });
        __syncthreads();
        lin_swiglu_store(out, xch, m0, n0 / 2, m, n, tid, THREADS);
    } else {
        lin_tile_frags(total, m0 + wm0, n0 + wn0, g, q, [&](uint32_t row, uint32_t col, float v) {
            if (row < m && col < n) store_out(out, (size_t)row * n + col, v);
        });
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
