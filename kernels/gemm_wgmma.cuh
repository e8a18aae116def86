// The prefill kernels' bodies (`linear_ws` for `linear`, `linear_tma_body` for `linear_tma`)
// and their wgmma, mbarrier and copy helpers: part of gemm.cu, which includes it after
// gemm_mma.cuh (LIN_KC, LIN_SEGS, store_out) and common.cuh (the cp.async, mbarrier and
// bulk-copy helpers).
#pragma once

// ---- The prefill kernel (`linear`): warp-specialized Hopper warpgroup MMAs ----
// wgmma.mma_async gives bitwise the sums of the mma.sync chains (gemm_mma.cuh) when each
// m64nNk16 takes the same 16 k as the matching m16n8k16, whatever their order inside the
// instruction (the GPU tests compare the two bit for bit). A chunk's first MMA takes k 0-3,
// 8-11, 16-19, 24-27, so operands are staged in runs of 4 k (8-byte cp.async) into
// 128-byte-swizzled rows whose 16-byte core-matrix units each hold two such runs.

// d[64] (+)= A · B for one warpgroup: A 64 x 16 and B 128 x 16 (k-major) through shared-memory
// descriptors; scale_d 0 ignores d (the chain's first MMA). Thread (warp w, lane g * 4 + q) holds
// d[4 j + e]: row 16 w + g (+ 8 for e >= 2), column 8 j + 2 q + (e & 1).
MT_DEVICE void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db, uint32_t scale_d = 1) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_ACC64_REGS
        "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : WG_ACC64(d)
        : "l"(da), "l"(db), "r"(scale_d));
}

// Byte offset of 8-byte piece p (k 4p..4p+3 of chunk cc of a 2-chunk stage) of row r in an
// operand tile of 128-byte rows, 128-byte swizzled: a row holds the stage's four k16 steps
// (chunk cc, instruction p % 2) of 32 bytes, each two 16-byte units (core matrices p / 4) of two
// 8-byte halves ((p / 2) % 2); unit u of row r sits at u ^ (r % 8). A warp's 32 pieces of two
// rows then fill 256 distinct bytes (no bank conflicts).
MT_DEVICE uint32_t wg_off(uint32_t r, uint32_t cc, uint32_t p) {
    const uint32_t u = (cc * 2 + p % 2) * 2 + p / 4;
    return r * 128 + ((u ^ (r % 8)) << 4) + ((p / 2) % 2) * 8;
}

// The descriptor of k16 step t (chunk t / 2, instruction t % 2) of a swizzled tile at `tile`
// (1024-byte aligned) from row group `rg`: 128-byte swizzle, 1024 bytes between row groups.
MT_DEVICE uint64_t wg_desc_sw(uint32_t tile, uint32_t rg, uint32_t t) {
    const uint32_t a = tile + rg * 1024 + t * 32;
    return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

// Four consecutive bf16 of row `row` of a [rows, k] matrix from column `col` (zero outside), as
// 8 bytes; any alignment.
MT_DEVICE uint2 load4(const bf16* base, uint32_t rows, uint32_t k, uint32_t row, uint32_t col) {
    uint32_t h[4] = {0u, 0u, 0u, 0u};
    if (row < rows) {
        const bf16* p = base + (size_t)row * k;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            if (col + i < k) h[i] = __bfloat16_as_ushort(p[col + i]);
    }
    return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

MT_DEVICE void st_shared8(uint32_t addr, uint2 v) {
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(v.x), "r"(v.y) : "memory");
}

// The producer warpgroup of `linear_ws` (thread `wt` of warpgroup 0): every step's x and weight
// tiles into ring slot j % ST at `sbase` once its empty barrier says it is free, each stage's
// full barrier signalled when its copies land. With three consumers it hands registers to them.
template <int ST, uint32_t BM, bool VEC>
MT_DEVICE void ws_produce(const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k, uint32_t m0,
                          uint32_t n0, uint32_t steps, uint32_t sbase, uint32_t full, uint32_t empty,
                          uint32_t wt) {
    constexpr uint32_t BN = 128, SCH = 2;
    constexpr bool REG = BM > 128;
    constexpr uint32_t A_BYTES = BM * 128, B_BYTES = BN * 128;
    constexpr uint32_t STAGE_BYTES = A_BYTES + B_BYTES;
    if (REG) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    // Thread (r0 = wt / 16, cc = (wt / 8) % 2, p = wt % 8) copies piece p of chunk cc of rows
    // r0, r0 + 8, ... of the x tile then the weight tile: the swizzle term is fixed.
    const uint32_t r0 = wt / 16, cc = (wt / 8) % SCH, p = wt % 8;
    const uint32_t off = wg_off(r0, cc, p);
    for (uint32_t j = 0; j < steps; ++j) {
        const uint32_t slot = j % ST;
        mbar_wait(empty + slot * 8, ((j / ST) & 1) ^ 1);
        const uint32_t col = (j * SCH + cc) * LIN_KC + 4 * p;
        const uint32_t dst = sbase + slot * STAGE_BYTES + off;
        if (VEC) {
#pragma unroll 4
            for (uint32_t i = 0; i < BM / 8; ++i) {
                const uint32_t row = m0 + r0 + 8 * i;
                const bool in = row < m && col < k;
                cp_async_ca<8>(dst + i * 1024, in ? x + (size_t)row * k + col : x, in ? 8u : 0u);
            }
#pragma unroll 4
            for (uint32_t i = 0; i < BN / 8; ++i) {
                const uint32_t row = n0 + r0 + 8 * i;
                const bool in = row < n && col < k;
                cp_async_ca<8>(dst + A_BYTES + i * 1024, in ? w + (size_t)row * k + col : w, in ? 8u : 0u);
            }
            cp_async_mbar_arrive(full + slot * 8);
        } else {  // element loads (zero past k and past the rows), then stores
            for (uint32_t i = 0; i < BM / 8; ++i)
                st_shared8(dst + i * 1024, load4(x, m, k, m0 + r0 + 8 * i, col));
            for (uint32_t i = 0; i < BN / 8; ++i)
                st_shared8(dst + A_BYTES + i * 1024, load4(w, n, k, n0 + r0 + 8 * i, col));
            fence_async_smem();  // the stores, before the consumers' wgmma reads them
            mbar_arrive(full + slot * 8);
        }
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// The prefill kernel's body (`linear`): a BM x 128 output tile per block of 128 + 2 BM threads.
// Warpgroup 0 (the producer) fills a ring of ST stages, each 2 chunks of the tile's BM x rows and
// 128 weight rows (8-byte cp.async into the `wg_off` layout; VEC false: operands not in aligned
// runs of 4 k, element loads and shared stores), and signals each stage's full mbarrier when its
// copies land; warpgroup 1 + i (a consumer) runs the m64n128k16 MMAs of rows
// 64 i .. 64 i + 63 and releases the stage through its empty mbarrier. With three consumers
// (BM = 192) the producer gives registers to them (setmaxnreg). Numerics of `linear_tiled`.
template <typename OutT, int ST, uint32_t BM, bool VEC>
MT_DEVICE void linear_ws(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k,
                               unsigned char* smem) {
    constexpr uint32_t BN = 128, SCH = 2;
    constexpr bool REG = BM > 128;
    constexpr uint32_t A_BYTES = BM * 128, B_BYTES = BN * 128;
    constexpr uint32_t STAGE_BYTES = A_BYTES + B_BYTES;
    smem += (1024 - ((uint32_t)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // swizzle atoms
    const uint32_t tid = threadIdx.x, wg = tid / 128, wt = tid % 128;
    const uint32_t m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t steps = (chunks + SCH - 1) / SCH;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t full = sbase + ST * STAGE_BYTES, empty = full + ST * 8;
    if (tid < ST) {
        mbar_init(full + tid * 8, 128);
        mbar_init(empty + tid * 8, BM * 2);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();

    if (wg == 0) {
        ws_produce<ST, BM, VEC>(x, w, m, n, k, m0, n0, steps, sbase, full, empty, wt);
        return;
    }

    if (REG) asm volatile("setmaxnreg.inc.sync.aligned.u32 152;\n");
    const uint32_t cw = wg - 1;  // consumer: rows 64 cw .. 64 cw + 63 of the tile
    float acc[64], total[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = total[e] = 0.0f;
    if (seg_chunks % SCH == 0 && chunks % SCH == 0) {
        // Segments end with steps: one step's MMAs stay in flight while the next is issued, and
        // a stage is released once the MMAs after it are issued and it is read.
        // (steps per segment: seg_chunks / SCH; the last segment may be shorter)
        const uint32_t seg_steps = seg_chunks / SCH;
        uint32_t j = 0;
        while (j < steps) {
            // A segment's chain starts from zero: its first MMA ignores the accumulator (scale-d
            // 0), the same sums as adding to +0 (a zero's sign cannot reach `total`, which starts
            // at +0).
            const uint32_t j0 = j, j_end = min(steps, j + seg_steps);
            for (; j < j_end; ++j) {
                const uint32_t slot = j % ST;
                mbar_wait(full + slot * 8, (j / ST) & 1);
                fence_async_smem();
                const uint32_t st = sbase + slot * STAGE_BYTES;
                wg_fence();
#pragma unroll
                for (uint32_t cc = 0; cc < SCH; ++cc)
#pragma unroll
                    for (uint32_t b = 0; b < 2; ++b)
                        wgmma_m64n128k16(acc, wg_desc_sw(st, cw * 8, cc * 2 + b),
                                         wg_desc_sw(st + A_BYTES, 0, cc * 2 + b),
                                         cc == 0 && b == 0 && j == j0 ? 0u : 1u);
                wg_commit();
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
                if (j > 0) mbar_arrive(empty + ((j + ST - 1) % ST) * 8);  // step j - 1 is read
            }
            wg_wait0();
#pragma unroll
            for (int e = 0; e < 64; ++e) total[e] += acc[e];
        }
        mbar_arrive(empty + ((steps + ST - 1) % ST) * 8);
    } else {  // a segment may end inside a stage: each step's MMAs complete before the next
        uint32_t in_seg = 0;
        for (uint32_t j = 0; j < steps; ++j) {
            const uint32_t slot = j % ST;
            mbar_wait(full + slot * 8, (j / ST) & 1);
            fence_async_smem();
            const uint32_t st = sbase + slot * STAGE_BYTES;
#pragma unroll
            for (uint32_t cc = 0; cc < SCH; ++cc) {
                const uint32_t c = j * SCH + cc;
                if (c >= chunks) break;
                wg_fence();
#pragma unroll
                for (uint32_t b = 0; b < 2; ++b)
                    wgmma_m64n128k16(acc, wg_desc_sw(st, cw * 8, cc * 2 + b), wg_desc_sw(st + A_BYTES, 0, cc * 2 + b));
                wg_commit();
                if (++in_seg == seg_chunks || c + 1 == chunks) {  // a segment ends
                    in_seg = 0;
                    wg_wait0();
#pragma unroll
                    for (int e = 0; e < 64; ++e) {
                        total[e] += acc[e];
                        acc[e] = 0.0f;
                    }
                }
            }
            wg_wait0();
            mbar_arrive(empty + slot * 8);
        }
    }
    const uint32_t warp = wt / 32, lane = wt % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (int e = 0; e < 64; ++e) {
        const uint32_t row = m0 + cw * 64 + warp * 16 + g + ((e % 4) >= 2 ? 8 : 0);
        const uint32_t col = n0 + (e / 4) * 8 + 2 * q + (e & 1);
        if (row < m && col < n) store_out(out, (size_t)row * n + col, total[e]);
    }
}

// ---- The prefill kernel with the weight as the register operand (`linear_tma`) ----
// `linear_ws` stages both operands in 8-byte pieces, because a k16 step takes half of every 8-k
// run (k 8q..8q+3 of lane q) while a shared-memory operand's core matrices hold 8 consecutive k;
// its copies bound it. Here the weight is wgmma's A operand, in registers: lane (g, q) reads k
// 8q..8q+7 of its rows with one 16-byte shared load, the decode kernels' fragment, so the weight
// tile arrives whole by the tensor memory accelerator (a 2-D tensor map, 128-byte swizzle). x is
// the B operand, read by descriptor in `k32_pairs` order, in which each 16-byte unit is one
// core-matrix row of a step; `permute_k32_tiles` writes that order once per launch as the images
// of the stages, so one bulk copy brings a stage's x. Same k sets per step, same chains and
// segments: bitwise `linear_ws`, at about twice its rate on prefill shapes.

// d[64] (+)= A · B: A 64 x 16 from registers (per warp mma.sync's A fragment: a0 row g k 2q, a1
// row g + 8, a2 row g k 2q + 8, a3 row g + 8 k 2q + 8) and B 128 x 16 (k-major) by descriptor.
MT_DEVICE void wgmma_m64n128k16_rs(float (&d)[64], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                   uint64_t db, uint32_t scale_d) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        WG_ACC64_REGS
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : WG_ACC64(d)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(scale_d));
}

// Where lane (g, q) of warp `warp` of consumer warpgroup `cw` reads its weight fragments in a
// stage of 128 swizzled 128-byte rows: tile row ra = 64 cw + 16 warp + g / 2 + 4 (g % 2) (so the
// two rows a quarter warp loads fall in different halves of the swizzle; row g + 8 is ra + 8),
// 16-byte unit q of chunk 0 (`off0`) and of chunk 1 (`off1`); and in a stage of 64-byte rows
// under the 64-byte swizzle (an FP8 weight's, `TmaWFp8`), its 8 bytes of chunk 0 (`off8_0`) and
// chunk 1 (`off8_1`): 16-byte unit u of row r sits at u ^ ((r / 2) % 4), lane q's bytes of
// chunk c are half q % 2 of unit 2 c + q / 2.
struct WgFragRows {
    uint32_t ra, off0, off1, off8_0, off8_1;
};

MT_DEVICE WgFragRows wg_frag_rows(uint32_t cw, uint32_t warp, uint32_t g, uint32_t q) {
    const uint32_t sg = (g >> 1) | ((g & 1) << 2);
    WgFragRows f;
    f.ra = cw * 64 + warp * 16 + sg;
    f.off0 = f.ra * 128 + ((q ^ sg) << 4);
    f.off1 = f.ra * 128 + (((4 + q) ^ sg) << 4);
    const uint32_t x8 = (f.ra >> 1) & 3;  // the same for row ra + 8
    f.off8_0 = f.ra * 64 + (((q >> 1) ^ x8) << 4) + (q & 1) * 8;
    f.off8_1 = f.ra * 64 + (((2 + (q >> 1)) ^ x8) << 4) + (q & 1) * 8;
    return f;
}

// A stage's weight fragments at shared address `st`: chunk 0 rows g, g + 8, chunk 1 rows g, g + 8.
MT_DEVICE void wg_load_frags(uint4 (&cur)[4], uint32_t st, const WgFragRows& f) {
    const uint32_t offs[4] = {f.off0, f.off0 + 1024, f.off1, f.off1 + 1024};
#pragma unroll
    for (int i = 0; i < 4; ++i)
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(cur[i].x), "=r"(cur[i].y), "=r"(cur[i].z), "=r"(cur[i].w)
                     : "r"(st + offs[i]));
}

// The weight operand of the tensor-map kernels (`linear_tma_body`, `linear_dec_body`), one type
// per storage format: a stage's weight tile is its rows of ROW_BYTES (64 k) as the weight's
// tensor map lays them out, and `frags` gives lane (g, q)'s bf16 fragments of a stage (chunks c0
// and c0 + 1 of k; weight rows row0 + f.ra and row0 + f.ra + 8) in `wg_load_frags`'s order.
// DEC_MAX_STAGES: the most ring stages `linear_dec_body` keeps of it.
struct TmaWBf16 {
    static constexpr uint32_t ROW_BYTES = 128, DEC_MAX_STAGES = 12;
    MT_DEVICE void frags(uint4 (&cur)[4], uint32_t st, const WgFragRows& f, uint32_t, uint32_t) const {
        wg_load_frags(cur, st, f);
    }
};

// A block-FP8 weight (`linear_tma_fp8`, `linear_stream_tma_fp8`): e4m3 bytes through a map of
// 64-byte boxes under the 64-byte swizzle, and an f32 scale per block of FP8_BLOCK columns by
// 2^shift rows. A lane reads its 8 bytes of each chunk and row (one 8-byte shared load) and
// converts them with their block's scale (`fp8_frag`): `dequant_fp8`'s fragment, so the rows
// are the bf16 kernel's on the dequantized weight. Bytes past the weight are zeros (the map's
// fill), which convert to zeros whatever the scale. Twice the stages of a bf16 ring fit the same
// room.
struct TmaWFp8 {
    static constexpr uint32_t ROW_BYTES = 64, DEC_MAX_STAGES = 24;
    const float* scales;
    uint32_t shift;    // log2 of the weight rows a scale row covers
    uint32_t kblocks;  // scale columns: ceil(k / FP8_BLOCK)
    uint32_t n, k;
    // The conversion factor (fp8_scale2) of weight row `row` in chunk `c`; 0 outside the weight.
    MT_DEVICE uint32_t scale2(uint32_t row, uint32_t c) const {
        return row < n && c * LIN_KC < k
                   ? fp8_scale2(__ldg(scales + (size_t)(row >> shift) * kblocks + c * LIN_KC / FP8_BLOCK))
                   : 0u;
    }
    MT_DEVICE void frags(uint4 (&cur)[4], uint32_t st, const WgFragRows& f, uint32_t row0, uint32_t c0) const {
        const uint32_t offs[4] = {f.off8_0, f.off8_0 + 512, f.off8_1, f.off8_1 + 512};
        uint2 v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(v[i].x), "=r"(v[i].y) : "r"(st + offs[i]));
        // Rows ra and ra + 8 share a scale row under 128-row blocks, chunks c0 and c0 + 1 a scale
        // column unless c0 is the last chunk of a block: one or two scales, not four.
        const uint32_t r = row0 + f.ra;
        const bool same_row = (r >> shift) == ((r + 8) >> shift) && r + 8 < n;
        const bool same_col = c0 * LIN_KC / FP8_BLOCK == (c0 + 1) * LIN_KC / FP8_BLOCK && (c0 + 1) * LIN_KC < k;
        const uint32_t s00 = scale2(r, c0), s01 = same_row ? s00 : scale2(r + 8, c0);
        const uint32_t s10 = same_col ? s00 : scale2(r, c0 + 1), s11 = same_col ? s01 : scale2(r + 8, c0 + 1);
        cur[0] = fp8_frag(v[0], s00);
        cur[1] = fp8_frag(v[1], s01);
        cur[2] = fp8_frag(v[2], s10);
        cur[3] = fp8_frag(v[3], s11);
    }
};

// A block-FP8 weight as `linear_tiled`'s scalar loads read it (the compute_90 body of
// `linear_tma_fp8`): lane (g, q)'s 8 bytes of row `row` from column `col` (zero outside) with
// their block's scale, converted as `TmaWFp8` converts them.
struct TiledWFp8 {
    const uint8_t* w;
    TmaWFp8 f;
};

MT_DEVICE uint4 tiled_w8(const TiledWFp8& w, uint32_t n, uint32_t k, uint32_t row, uint32_t col) {
    if (row >= n || col >= k) return make_uint4(0, 0, 0, 0);
    const uint8_t* p = w.w + (size_t)row * k + col;
    uint32_t b[2] = {0u, 0u};
#pragma unroll
    for (uint32_t i = 0; i < 8; ++i)
        if (col + i < k) b[i / 4] |= uint32_t(p[i]) << (8 * (i % 4));
    return fp8_frag(make_uint2(b[0], b[1]), w.f.scale2(row, col / LIN_KC));
}

// Keeps `v` in its registers up to this point: a register operand of an asynchronous wgmma must
// not be reused before the wgmma has completed, which the compiler cannot see.
MT_DEVICE void keep_live(uint4& v) { asm volatile("" : "+r"(v.x), "+r"(v.y), "+r"(v.z), "+r"(v.w)::"memory"); }

MT_DEVICE void keep_live4(uint4 (&v)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) keep_live(v[i]);
}

// The box (cols, rows) of the 2-D tensor map `map` at column `c0`, row `r0` -> shared `dst`,
// completing on `bar` (rows past the tensor's are zero).
MT_DEVICE void tma_load_2d(uint32_t dst, const void* map, uint32_t c0, uint32_t r0, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(r0), "r"(bar)
        : "memory");
}


// `linear_tma`'s body: the 128 x 128 output tiles this block takes (`lin_tma_tiles`; a grid of
// every tile takes one each, a grid of the resident blocks walks them, its ring
// running on from one tile into the next, so a tile's first stages land while the tile before it
// stores its outputs); 384 threads a block. Thread 0 of warpgroup 0 queues each stage of the
// ST-stage ring: the weight tile's 128 rows x 64 k by tensor map (`wmap`: a 2-D map of w with a
// 64 x 128 box, bf16 under the 128-byte swizzle or, `TmaWFp8`, e4m3 under the 64-byte one) and
// the x tile's stage image (`xt`, `permute_k32_tiles`) by one bulk copy. Warpgroup 1 + c computes
// weight rows 64 c .. 64 c + 63 with m64n128k16 wgmma from register A fragments (`W::frags`: an
// FP8 weight's converted there): lane (g, q) takes tile row ra = ... + g / 2 + 4 (g % 2), so the
// two rows a quarter warp loads fall in different halves of the swizzle. Chunks past k and rows
// past m (zero in the image) or n (zero by the map) add nothing; SPLIT: a segment may end inside
// a stage. No multicast between blocks: the tensor pipe and L2 are both well used, and sharing
// the x tile across a cluster costs more in barrier traffic than the copies it saves.
// SWIGLU (`linear_tma_swiglu`): w is [2 n, k], gate rows then up rows, and `wmap` boxes 64 rows;
// column tile y is gate rows 64 y .. 64 y + 63 (warpgroup 1) and the same up rows (warpgroup 2),
// two boxes a stage, and the block writes silu(gate) * up as the stage images `out` of an [m, n]
// matrix (`lin_swiglu_store`).
template <typename OutT, int ST, bool SPLIT, typename W, bool SWIGLU = false>
MT_DEVICE void linear_tma_body(OutT* out, const bf16* xt, const W& wf, const void* wmap, uint32_t* sched, uint32_t m,
                               uint32_t n, uint32_t k, unsigned char* smem) {
    constexpr uint32_t W_BYTES = LIN_TMA_TILE * W::ROW_BYTES, STAGE_BYTES = W_BYTES + LIN_TMA_IMG_BYTES;
    smem += (1024 - ((uint32_t)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // swizzle atoms
    const uint32_t tid = threadIdx.x, wg = tid / 128, wt = tid % 128;
    constexpr uint32_t COLS = SWIGLU ? LIN_TMA_TILE / 2 : LIN_TMA_TILE;  // output columns a tile
    const LinTmaTiles tl = lin_tma_tiles(m, SWIGLU ? 2 * n : n);
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC, seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t steps = (chunks + 1) / 2;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t full = sbase + ST * STAGE_BYTES, empty = full + ST * 8;
    // Each stage's tile (the producer's claim, read by the consumers at a tile's first stage).
    uint32_t* stage_tile = reinterpret_cast<uint32_t*>(smem + ST * STAGE_BYTES + 2 * ST * 8);
    // Tiles claimed from `sched` (a counter per launch: the blocks that start first take more
    // tiles, so a block placed late, behind the kernel ahead, does not hold the launch's end),
    // or walked as lin_tma_tiles deals them where there is no counter or no stage (k = 0).
    const bool claim = sched != nullptr && steps > 0;
    if (tid < ST) {
        mbar_init(full + tid * 8, 1);
        mbar_init(empty + tid * 8, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();

    if (wg == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 56;\n");
        if (wt != 0) return;
        // The map was written by a copy before the launch: order that before the tensor
        // memory accelerator reads it.
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(wmap) : "memory");
        uint32_t gj = 0;  // the ring's step count over this block's tiles
        for (uint32_t t = claim ? atomicAdd(sched, 1u) : tl.first;; t = claim ? atomicAdd(sched, 1u) : t + tl.stride) {
            if (t >= tl.count) {
                if (claim) {
                    // No tile left: the consumers learn it from the next stage's tile; the last
                    // block to get here resets the counter for the next launch (every claim of
                    // this one is made, and that launch claims only once this grid is done).
                    const uint32_t slot = gj % ST;
                    mbar_wait(empty + slot * 8, ((gj / ST) & 1) ^ 1);
                    stage_tile[slot] = 0xFFFFFFFFu;
                    mbar_arrive(full + slot * 8);
                    if (atomicAdd(sched + 1, 1u) == gridDim.x * gridDim.y - 1) {
                        atomicExch(sched, 0u);
                        atomicExch(sched + 1, 0u);
                    }
                }
                break;
            }
            const uint32_t n0 = t / tl.rows * COLS;
            const unsigned char* img =
                reinterpret_cast<const unsigned char*>(xt) + (size_t)(t % tl.rows) * steps * LIN_TMA_IMG_BYTES;
            for (uint32_t j = 0; j < steps; ++j, ++gj) {
                const uint32_t slot = gj % ST, bar = full + slot * 8, st = sbase + slot * STAGE_BYTES;
                mbar_wait(empty + slot * 8, ((gj / ST) & 1) ^ 1);
                stage_tile[slot] = t;  // published by the arrival below
                mbar_expect_tx(bar, STAGE_BYTES);
                tma_load_2d(st, wmap, j * 64, n0, bar);
                if constexpr (SWIGLU) tma_load_2d(st + W_BYTES / 2, wmap, j * 64, n + n0, bar);  // the up rows
                bulk_g2s(st + W_BYTES, img + (size_t)j * LIN_TMA_IMG_BYTES, LIN_TMA_IMG_BYTES, bar);
            }
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 224;\n");
    const uint32_t cw = wg - 1, warp = wt / 32, lane = wt % 32, g = lane / 4, q = lane % 4;
    const WgFragRows fr = wg_frag_rows(cw, warp, g, q);
    float acc[64], total[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) acc[e] = 0.0f;
    uint4 A0[4], A1[4];  // a stage's fragments: chunk 0 rows g, g + 8, chunk 1 rows g, g + 8

    // !SPLIT: segments end with stages (an even number of chunks each, and in all), so a
    // segment's steps run, then its total is taken; SPLIT: every step checks its chunks.
    const uint32_t seg_steps = SPLIT ? steps : seg_chunks / 2;
    for (uint32_t t = tl.first, g0 = 0;; t += tl.stride, g0 += steps) {
        if (claim) {  // the tile the producer claimed for this tile's first stage
            const uint32_t slot = g0 % ST;
            mbar_wait(full + slot * 8, (g0 / ST) & 1);
            t = stage_tile[slot];
        }
        if (t >= tl.count) break;
        const uint32_t t0 = t % tl.rows * LIN_TMA_TILE, n0 = t / tl.rows * COLS;
        // The weight row of tile row 0 as `W::frags` sees it (its FP8 scales): under SWIGLU the
        // up rows (tile rows 64..127) are weight rows n + n0 ...
        const uint32_t wrow0 = SWIGLU && cw == 1 ? n + n0 - 64 : n0;
#pragma unroll
        for (int e = 0; e < 64; ++e) total[e] = 0.0f;
        // Step j of the tile (the ring's step g0 + j): wait for its stage, load its fragments into
        // `cur`, issue its MMAs (the first of a segment with scale-d 0; where a segment ends inside
        // the stage, or SPLIT, the chain is closed there: wait, add to the total), then wait for
        // step j - 1's MMAs (whose fragments are `prev`) and release step j - 1's stage.
        auto step = [&](uint32_t j, uint4 (&cur)[4], uint4 (&prev)[4], bool first) {
            const uint32_t gj = g0 + j, slot = gj % ST;
            mbar_wait(full + slot * 8, (gj / ST) & 1);
            const uint32_t st = sbase + slot * STAGE_BYTES;
            wf.frags(cur, st, fr, wrow0, 2 * j);
            wg_fence();
            const uint32_t xb = st + W_BYTES;
            if constexpr (SPLIT) {
#pragma unroll
                for (uint32_t cc = 0; cc < 2; ++cc) {
                    const uint32_t c = 2 * j + cc;
                    if (c >= chunks) break;
                    wgmma_m64n128k16_rs(acc, cur[2 * cc].x, cur[2 * cc + 1].x, cur[2 * cc].y, cur[2 * cc + 1].y,
                                        wg_desc_sw(xb, 0, 2 * cc), c % seg_chunks == 0 ? 0u : 1u);
                    wgmma_m64n128k16_rs(acc, cur[2 * cc].z, cur[2 * cc + 1].z, cur[2 * cc].w, cur[2 * cc + 1].w,
                                        wg_desc_sw(xb, 0, 2 * cc + 1), 1u);
                    if ((c + 1) % seg_chunks == 0 || c + 1 == chunks) {  // a segment ends
                        wg_commit();
                        wg_wait0();
                        keep_live4(cur);
                        keep_live4(prev);
#pragma unroll
                        for (int e = 0; e < 64; ++e) total[e] += acc[e];
                        wg_fence();
                    }
                }
            } else {
                wgmma_m64n128k16_rs(acc, cur[0].x, cur[1].x, cur[0].y, cur[1].y, wg_desc_sw(xb, 0, 0), first ? 0u : 1u);
                wgmma_m64n128k16_rs(acc, cur[0].z, cur[1].z, cur[0].w, cur[1].w, wg_desc_sw(xb, 0, 1), 1u);
                wgmma_m64n128k16_rs(acc, cur[2].x, cur[3].x, cur[2].y, cur[3].y, wg_desc_sw(xb, 0, 2), 1u);
                wgmma_m64n128k16_rs(acc, cur[2].z, cur[3].z, cur[2].w, cur[3].w, wg_desc_sw(xb, 0, 3), 1u);
            }
            wg_commit();
            asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            keep_live4(prev);
            if (j > 0) mbar_arrive(empty + ((gj + ST - 1) % ST) * 8);
        };
        for (uint32_t j = 0; j < steps;) {
            const uint32_t j_end = min(steps, j + seg_steps);
            for (const uint32_t j0 = j; j < j_end; ++j) {
                if (j & 1)
                    step(j, A1, A0, j == j0);
                else
                    step(j, A0, A1, j == j0);
            }
            wg_wait0();
            keep_live4(A0);
            keep_live4(A1);
            if constexpr (!SPLIT) {
#pragma unroll
                for (int e = 0; e < 64; ++e) total[e] += acc[e];
            }
        }
        if (steps > 0) mbar_arrive(empty + ((g0 + steps - 1) % ST) * 8);  // the tile's last stage, its MMAs done
        if constexpr (SWIGLU) {
            // Tile row ra (+ 8) holds gate (warpgroup 1) or up (warpgroup 2) values of x row
            // (e / 4) * 8 + 2 q + (e & 1): each into the exchange, then the SwiGLU from there;
            // the last barrier lets the next tile write the exchange.
            const uint32_t xch = full + 1024;
#pragma unroll
            for (int e = 0; e < 64; ++e)
                lin_swiglu_put(xch, (e / 4) * 8 + 2 * q + (e & 1), fr.ra + ((e % 4) >= 2 ? 8 : 0), total[e]);
            asm volatile("bar.sync 1, 256;\n" ::: "memory");
            lin_swiglu_store(reinterpret_cast<unsigned char*>(out), xch, t0, n0, m, n, tid - 128, 256);
            asm volatile("bar.sync 1, 256;\n" ::: "memory");
        } else {
#pragma unroll
            for (int e = 0; e < 64; ++e) {
                const uint32_t col = n0 + fr.ra + ((e % 4) >= 2 ? 8 : 0);
                const uint32_t row = t0 + (e / 4) * 8 + 2 * q + (e & 1);
                if (row < m && col < n) store_out(out, (size_t)row * n + col, total[e]);
            }
        }
    }
}
