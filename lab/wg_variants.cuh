// A lab-only wgmma variant of the decode `linear` kernel, for comparison in lab/gemm_lab.cu; it
// uses kernels/gemm_wgmma.cuh's helpers and gives bitwise the engine's rows.
// - linear_wg_impl: the decode cluster kernel (`linear_stream_wide`'s tiles and segments) with one
//   warpgroup per block running m64n128k16 on stages filled by every thread (slower than the
//   mma.sync kernel at 32 and 64 rows).
#pragma once

// One warpgroup (128 threads) per block, a cluster of LIN_SEGS blocks per tile of 128 columns by
// 64 rows (block s: segment s), clusters looping over tiles cid, cid + clusters, ... A ring of ST
// stages of 2 chunks (x 8 KiB, weight 16 KiB). PART_IN_RING: the segment partials reuse the ring
// (the ring drains at each tile's end); otherwise they have their own 32 KiB after it and the
// next tile's first stages load while the cluster sums the last.
template <typename OutT, int ST, bool PART_IN_RING>
MT_DEVICE void linear_wg_impl(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k,
                              unsigned char* smem) {
    constexpr uint32_t BN = 128, SCH = 2;
    constexpr uint32_t A_BYTES = 64 * 128, B_BYTES = BN * 128;
    constexpr uint32_t STAGE_BYTES = A_BYTES + B_BYTES;
    smem += (1024 - ((uint32_t)__cvta_generic_to_shared(smem) & 1023)) & 1023;  // swizzle atoms
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t tid = threadIdx.x;
    const uint32_t seg = cluster.block_rank(), cid = blockIdx.x / LIN_SEGS, ncl = gridDim.x / LIN_SEGS;
    const uint32_t row_blocks = (m + 63) / 64;
    const uint32_t tiles = ((n + BN - 1) / BN) * row_blocks;
    const uint32_t my_tiles = cid < tiles ? (tiles - cid + ncl - 1) / ncl : 0;
    const uint32_t chunks = (k + LIN_KC - 1) / LIN_KC;
    const uint32_t seg_chunks = (chunks + LIN_SEGS - 1) / LIN_SEGS;
    const uint32_t nsegs = seg_chunks > 0 ? (chunks + seg_chunks - 1) / seg_chunks : 0;
    const uint32_t c_begin = min(chunks, seg * seg_chunks);
    const uint32_t c_end = min(chunks, c_begin + seg_chunks);
    const uint32_t steps = (c_end - c_begin + SCH - 1) / SCH;
    const uint32_t total = my_tiles * steps;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    float4* part = reinterpret_cast<float4*>(smem + (PART_IN_RING ? 0 : ST * STAGE_BYTES));

    // x rows past m are never loaded: zero them in every stage once.
    for (uint32_t i = tid; i < ST * A_BYTES / 16; i += 128)
        reinterpret_cast<uint4*>(smem)[(i / (A_BYTES / 16)) * (STAGE_BYTES / 16) + i % (A_BYTES / 16)] =
            make_uint4(0, 0, 0, 0);

    auto tile_of = [&](uint32_t j) { return cid + (j / steps) * ncl; };
    auto issue_w = [&](uint32_t j) {
        if (j >= total) return;
        const uint32_t n0 = (tile_of(j) / row_blocks) * BN, c0 = c_begin + (j % steps) * SCH;
        const uint32_t dst = sbase + (j % ST) * STAGE_BYTES + A_BYTES;
        for (uint32_t i = tid; i < BN * SCH * 8; i += 128) {
            const uint32_t r = i / (SCH * 8), cc = (i / 8) % SCH, p = i % 8;
            const uint32_t row = n0 + r, c = c0 + cc, col = c * LIN_KC + 4 * p;
            const bool in = row < n && c < c_end && col < k;
            cp_async_ca<8>(dst + wg_off(r, cc, p), in ? w + (size_t)row * k + col : w, in ? 8u : 0u);
        }
    };
    auto issue_x = [&](uint32_t j) {
        if (j < total) {
            const uint32_t m0 = (tile_of(j) % row_blocks) * 64, c0 = c_begin + (j % steps) * SCH;
            const uint32_t rows = min(64u, m - m0);
            const uint32_t dst = sbase + (j % ST) * STAGE_BYTES;
            for (uint32_t i = tid; i < rows * SCH * 8; i += 128) {
                const uint32_t r = i / (SCH * 8), cc = (i / 8) % SCH, p = i % 8;
                const uint32_t c = c0 + cc, col = c * LIN_KC + 4 * p;
                const bool in = c < c_end && col < k;
                cp_async_ca<8>(dst + wg_off(r, cc, p), in ? x + (size_t)(m0 + r) * k + col : x, in ? 8u : 0u);
            }
        }
        cp_async_commit();
    };

#pragma unroll
    for (int p = 0; p < ST - 1; ++p) issue_w(p);
    pdl_wait();
    pdl_trigger();
#pragma unroll
    for (int p = 0; p < ST - 1; ++p) issue_x(p);

    const uint32_t warp = tid / 32, lane = tid % 32, g = lane / 4, q = lane % 4;
    uint32_t j = 0;
    for (uint32_t it = 0; it < my_tiles; ++it) {
        const uint32_t t = cid + it * ncl, n0 = (t / row_blocks) * BN, m0 = (t % row_blocks) * 64;
        float acc[64];
#pragma unroll
        for (int e = 0; e < 64; ++e) acc[e] = 0.0f;
        for (uint32_t s = 0; s < steps; ++s, ++j) {
            cp_async_wait<ST - 2>();
            fence_async_smem();
            __syncthreads();  // stage j is in for everyone; the MMAs of j - 1 are done
            issue_w(j + ST - 1);
            issue_x(j + ST - 1);
            const uint32_t st = sbase + (j % ST) * STAGE_BYTES;
            wg_fence();
#pragma unroll
            for (uint32_t cc = 0; cc < SCH; ++cc) {
                if (c_begin + s * SCH + cc >= c_end) break;
#pragma unroll
                for (uint32_t b = 0; b < 2; ++b)
                    wgmma_m64n128k16(acc, wg_desc_sw(st, 0, cc * 2 + b), wg_desc_sw(st + A_BYTES, 0, cc * 2 + b));
            }
            wg_commit();
            wg_wait0();
        }
        if (PART_IN_RING) {
            cp_async_wait<0>();
            __syncthreads();
        }
        // acc[4 jn + e]: row 16 warp + g (+ 8 for e >= 2), column 8 jn + 2 q + (e & 1).
#pragma unroll
        for (int jn = 0; jn < 16; ++jn)
            part[jn * 128 + tid] = make_float4(acc[4 * jn], acc[4 * jn + 1], acc[4 * jn + 2], acc[4 * jn + 3]);
        cluster.sync();
        for (uint32_t f = seg * 256 + tid; f < (seg + 1) * 256; f += 128) {
            const uint32_t jn = f / 128, tt = f % 128;
            const uint32_t wp = tt / 32, ln = tt % 32;
            const uint32_t row0 = m0 + wp * 16 + ln / 4;
            if (row0 >= m) continue;
            float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (uint32_t sg = 0; sg < nsegs; ++sg) {
                const float4 v = cluster.map_shared_rank(part, sg)[f];
                sum.x += v.x;
                sum.y += v.y;
                sum.z += v.z;
                sum.w += v.w;
            }
            const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const uint32_t row = row0 + (e >= 2 ? 8 : 0), col = n0 + jn * 8 + (ln % 4) * 2 + (e & 1);
                if (row < m && col < n) store_out(out, (size_t)row * n + col, vals[e]);
            }
        }
        cluster.sync();  // the partials are read before anything overwrites them
    }
    cp_async_wait<0>();
    (void)warp; (void)g; (void)q;
}
