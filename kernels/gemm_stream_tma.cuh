// `linear_stream_tma`'s body (`linear_dec_body`) and its helpers: part of gemm.cu, which
// includes it after gemm_wgmma.cuh (the wgmma, fragment and tensor-map helpers it shares with
// `linear_tma_body`).
#pragma once

// ---- The decode kernel with the weight by tensor map (`linear_stream_tma`) ----
// `linear_tma`'s operands, `linear_stream_wide`'s numerics: persistent clusters of LIN_SEGS blocks,
// one a multiprocessor; a cluster takes tiles of LIN_DEC_COLS weight rows (output columns) by all
// of x's rows in turn, block s computing segment s of every output of each (one accumulator chain
// per tile), and sums the segment partials in order through distributed shared memory. The weight
// streams through the tensor memory accelerator (`linear_tma`'s map: boxes of 64 k by 128 rows)
// into a ring that runs on across tiles, and is wgmma's register operand (W: `TmaWBf16`, or
// `TmaWFp8` for `linear_stream_tma_fp8`, whose e4m3 bytes are converted as the fragments are
// loaded; its stages are half the bytes, so twice as many fit). x, the B operand, is the same for
// every tile of a block: the block reads its segment of x once, at the start, into shared memory in
// the `k32_pairs` order of `permute_k32_tiles`'s images (every stage's image resident; taken from
// those images by bulk copies where the producer of x wrote them: rows past m then hold whatever
// the images hold, which reaches only those rows' outputs, never stored), so the consumers are
// `linear_tma_body`'s. The row count picks the wgmma's N (8 .. 64), so one row multiplies 8 rows,
// not 64; where N rows of the segment would not fit, x goes in row blocks of fewer rows, each row
// block's clusters beside the other's on the same column tiles (the down projection's 12288 inputs
// at 64 rows: two blocks of 32). x is copied once rather than with every stage, which would nearly
// double the time of a wide projection at 64 rows; the tile sums run beside the next tile's MMAs
// rather than holding every block at each tile, and the waits are relaxed with an explicit acquire
// fence (below), for the same reason.
#define LIN_DEC_SUM_THREADS 96  // the producer warpgroup's warps 1-3: the tile sums

// d[N / 2] (+)= A · B for one warpgroup: A 64 x 16 from registers (mma.sync's A fragment per
// warp, as `wgmma_m64n128k16_rs`), B N x 16 (k-major) by descriptor. Thread (warp w, lane g * 4
// + q) holds d[4 j + e]: A row 16 w + g (+ 8 for e >= 2), B row 8 j + 2 q + (e & 1).
template <uint32_t N>
MT_DEVICE void wgmma_m64nNk16_rs(float (&d)[N / 2], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                 uint64_t db, uint32_t scale_d) {
    if constexpr (N == 8) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
            : WG_ACC4(d, 0)
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(scale_d));
    } else if constexpr (N == 16) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, "
            "{%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
            : WG_ACC4(d, 0), WG_ACC4(d, 4)
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(scale_d));
    } else if constexpr (N == 32) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, "
            "%8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
            : WG_ACC16(d, 0)
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(scale_d));
    } else {
        static_assert(N == 64, "N is 8, 16, 32 or 64");
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, "
            "%8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, "
            "%26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
            : WG_ACC16(d, 0), WG_ACC16(d, 16)
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db), "r"(scale_d));
    }
}

// 16 bytes of x (written by the kernel ahead), from L2.
MT_DEVICE uint4 ld_cg16(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// Arrive (relaxed, cluster scope) on the mbarrier of block `rank` of this cluster that sits at
// `bar` in every block.
MT_DEVICE void mbar_arrive_remote(uint32_t bar, uint32_t rank) {
    asm volatile(
        "{\n.reg .b32 ra;\nmapa.shared::cluster.u32 ra, %0, %1;\n"
        "mbarrier.arrive.relaxed.cluster.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar), "r"(rank)
        : "memory");
}

// Wait until the phase of parity `parity` of `bar` completes, then acquire at cluster scope what
// the arriving blocks published in their shared memory (an acquiring wait would also invalidate
// L1, a large share of the kernel's stalls).
MT_DEVICE void mbar_wait_cluster(uint32_t bar, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.relaxed.cluster.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n"
        "fence.acquire.sync_restrict::shared::cluster.cluster;\n" ::"r"(bar), "r"(parity) : "memory");
}

// Block `tid`'s share of copying its segment of x (`span`, rows m0..m0 + N) into shared memory
// at `xs`, in the `k32_pairs` order and swizzle the consumers read (stage j at j * N * 128): by
// bulk copies from the stage images where `staged` (completing on `xfull`), else from x's rows
// (zeros past m and past the segment).
template <uint32_t N>
MT_DEVICE void dec_load_x(const bf16* x, const unsigned char* ximg, uint32_t m, uint32_t k, uint32_t m0,
                          const LinSegment& span, uint32_t seg_steps, bool staged, uint32_t xs, uint32_t xfull) {
    constexpr uint32_t X_STAGE = N * 128;
    const uint32_t tid = threadIdx.x;
    const uint32_t steps = (span.c_end - span.c_begin + 1) / 2;
    if (staged) {
        // The images hold every row of the one 128-row tile (m <= 128): stage j of this
        // segment is N * 128 contiguous bytes of image span.c_begin / 2 + j, from row m0, in
        // the order and swizzle the consumers read. One bulk copy a stage, all on `xfull`.
        if (tid == 0) {
            mbar_expect_tx(xfull, steps * X_STAGE);
            for (uint32_t j = 0; j < steps; ++j)
                bulk_g2s(xs + j * X_STAGE, ximg + ((size_t)(span.c_begin / 2 + j) * 16384 + m0 * 128), X_STAGE, xfull);
        }
    } else {
        // x's segment: unit u (16 bytes: k 8q..8q+7 of chunk cc of row r, pairs 4q..4q+3)
        // goes pair by pair to its `k32_pairs` places (pair 4q + i: unit i, position q).
        // Batches of XB units a thread: the loads of a batch are all in flight before its stores.
        constexpr uint32_t XB = 8;
        const uint32_t units = N * seg_steps * 8;
        for (uint32_t u0 = tid; u0 < units; u0 += XB * LIN_DEC_THREADS) {
            uint4 v[XB];
#pragma unroll
            for (uint32_t b = 0; b < XB; ++b) {
                const uint32_t u = u0 + b * LIN_DEC_THREADS;
                const uint32_t q = u % 4, cc = (u / 4) % (2 * seg_steps), r = u / (8 * seg_steps);
                const uint32_t c = span.c_begin + cc, col = c * LIN_KC + 8 * q;
                v[b] = make_uint4(0, 0, 0, 0);
                if (u < units && m0 + r < m && c < span.c_end && col < k)
                    v[b] = ld_cg16(x + (size_t)(m0 + r) * k + col);
            }
#pragma unroll
            for (uint32_t b = 0; b < XB; ++b) {
                const uint32_t u = u0 + b * LIN_DEC_THREADS;
                if (u >= units) break;
                const uint32_t q = u % 4, cc = (u / 4) % (2 * seg_steps), r = u / (8 * seg_steps);
                const uint32_t at = xs + (cc / 2) * X_STAGE + r * 128 + q * 4;
                const uint32_t words[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
#pragma unroll
                for (uint32_t i = 0; i < 4; ++i)
                    asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(at + (((4 * (cc % 2) + i) ^ (r % 8)) << 4)),
                                 "r"(words[i])
                                 : "memory");
            }
        }
        fence_async_smem();  // the stores, before the consumers' wgmma reads them
    }
}

// The shared-memory barriers of `linear_dec_body`: each ring stage's full and empty barrier (at
// full + 8 s, empty + 8 s), the two partial buffers' ready and free barriers, x's.
struct DecBars {
    uint32_t full, empty, pready, pfree, xfull;
};

// The consumer warpgroups' part of `linear_dec_body` (threads 128..383): every stage of every
// tile of the block's through wgmma (weight rows 64 c .. 64 c + 63 of the tile, fragment rows
// as in `linear_tma_body`, `W::frags` of the stage's chunks c_begin + 2 j and + 1; x's image of
// the step from `xs`), the tile's partials into buffer it % 2 of `part` once the cluster has read
// that buffer's tile before, then published to every block. The cluster's tiles are cid, cid +
// ncl, ...
template <uint32_t N, typename W>
MT_DEVICE void dec_consume(const W& wf, float4* part, uint32_t ring, uint32_t xs, const DecBars& bars, uint32_t ST,
                           uint32_t c_begin, uint32_t nch, uint32_t cid, uint32_t ncl, uint32_t my_tiles,
                           bool staged) {
    constexpr uint32_t W_BYTES = LIN_DEC_COLS * W::ROW_BYTES, X_STAGE = N * 128;
    const uint32_t full = bars.full, empty = bars.empty, pready = bars.pready, pfree = bars.pfree;
    const uint32_t tid = threadIdx.x, steps = (nch + 1) / 2;
    const uint32_t ct = tid - 128, wt = ct % 128, lane = wt % 32;
    const WgFragRows fr = wg_frag_rows(ct / 128, wt / 32, lane / 4, lane % 4);
    float acc[N / 2];
    uint4 A0[4], A1[4];
    // The ring position of the next stage, kept by counters (a division by the run-time ST each
    // stage showed in the stall samples): `slot`, its `phase`, and `prev_slot`, the stage's
    // before it.
    uint32_t slot = 0, phase = 0, prev_slot = ST - 1;
    // The next stage (step j of its tile): wait for it, load its fragments into `cur`, issue its
    // MMAs (the chain's first with scale-d 0) on x's image of step j, then wait for the MMAs of
    // the stage before (fragments `prev`) and release it (within the tile; the tile's last stage
    // is released at its end). A segment of an odd chunk count ends inside its last stage: the
    // second chunk's MMAs still run (a branch around them would serialize every wgmma), on zero
    // fragments and the zeros x holds there, adding +0 products: at most a partial's zero
    // changes sign, which the sum from +0 cannot see.
    uint32_t n0 = cid * LIN_DEC_COLS;  // the tile's first weight row
    auto step = [&](uint32_t j, uint4 (&cur)[4], uint4 (&prev)[4]) {
        const uint32_t st = ring + slot * W_BYTES, xb = xs + j * X_STAGE;
        mbar_wait(full + slot * 8, phase);
        wf.frags(cur, st, fr, n0, c_begin + 2 * j);
        if (2 * j + 1 >= nch) cur[2] = cur[3] = make_uint4(0, 0, 0, 0);  // past the segment
        wg_fence();
        wgmma_m64nNk16_rs<N>(acc, cur[0].x, cur[1].x, cur[0].y, cur[1].y, wg_desc_sw(xb, 0, 0), j == 0 ? 0u : 1u);
        wgmma_m64nNk16_rs<N>(acc, cur[0].z, cur[1].z, cur[0].w, cur[1].w, wg_desc_sw(xb, 0, 1), 1u);
        wgmma_m64nNk16_rs<N>(acc, cur[2].x, cur[3].x, cur[2].y, cur[3].y, wg_desc_sw(xb, 0, 2), 1u);
        wgmma_m64nNk16_rs<N>(acc, cur[2].z, cur[3].z, cur[2].w, cur[3].w, wg_desc_sw(xb, 0, 3), 1u);
        wg_commit();
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
        keep_live4(prev);
        if (j > 0) mbar_arrive(empty + prev_slot * 8);
        prev_slot = slot;
        if (++slot == ST) slot = 0, phase ^= 1;
    };
    if (staged) mbar_wait(bars.xfull, 0);
    uint32_t g = 0;
    for (uint32_t it = 0; it < my_tiles; ++it) {
#pragma unroll
        for (uint32_t e = 0; e < N / 2; ++e) acc[e] = 0.0f;
        for (uint32_t j = 0; j < steps; ++j, ++g) {
            if (g & 1)
                step(j, A1, A0);
            else
                step(j, A0, A1);
        }
        wg_wait0();
        keep_live4(A0);
        keep_live4(A1);
        if (steps > 0) mbar_arrive(empty + prev_slot * 8);
        n0 += ncl * LIN_DEC_COLS;
        // Buffer it % 2 is free once the cluster has read tile it - 2 from it.
        const uint32_t b = it & 1;
        mbar_wait_cluster(pfree + b * 8, ((it >> 1) & 1) ^ 1);
        float4* dst = part + b * (N * 32);
#pragma unroll
        for (uint32_t jn = 0; jn < N / 8; ++jn)
            dst[jn * 256 + ct] = make_float4(acc[4 * jn], acc[4 * jn + 1], acc[4 * jn + 2], acc[4 * jn + 3]);
        asm volatile("fence.release.sync_restrict::shared::cta.cluster;\n" ::: "memory");
        asm volatile("bar.sync 1, 256;\n" ::: "memory");
        if (ct < LIN_SEGS) mbar_arrive_remote(pready + b * 8, ct);
    }
}

// `linear_stream_tma`'s body for N-row wgmmas. Shared memory: x's segment (stage j's image at
// j * N * 128), two buffers of partials, the ring of weight stages, the mbarriers. Thread 0
// queues the ring's first stages before the programmatic wait (the weight is never written by
// the kernel ahead), then either thread 0 queues bulk copies of x's segment from its stage
// images (`ximg`: one a stage, completing on `xfull`, which the consumers wait for) or every
// thread copies its share of x's rows (zeros past m and past the segment); then thread 0 queues
// the rest, each stage's full barrier taking the box's bytes, its empty barrier the 256
// consumers' arrivals. Warpgroups 1 and 2 consume (weight rows 64 c .. 64 c + 63 of the tile,
// fragment rows as in `linear_tma_body`). At a tile's end the consumers
// write their partials into one of two buffers (once the cluster has read that buffer's
// previous tile: `pfree`), tell every block (`pready`) and go on to the next tile; the producer
// warpgroup's warps 1-3 sum this block's share of each tile over the segments, in order, once
// every block has published it, store it, and tell every block that buffer is read.
template <typename OutT, uint32_t N, typename W>
MT_DEVICE void linear_dec_body(OutT* out, const bf16* x, const unsigned char* ximg, const W& wf, const void* wmap,
                               uint32_t m, uint32_t n, uint32_t k, uint32_t row_blocks, unsigned char* smem) {
    constexpr uint32_t W_BYTES = LIN_DEC_COLS * W::ROW_BYTES, X_STAGE = N * 128, PART_BYTES = N * 1024;
    constexpr uint32_t MAX_STAGES = W::DEC_MAX_STAGES;
    const uint32_t tid = threadIdx.x, seg = blockIdx.x % LIN_SEGS;
    // Cluster c takes rows N (c % row_blocks).. and the column tiles c / row_blocks, + ncol, ...:
    // the clusters of one column tile's row blocks are neighbours and read its weight together
    // (the second from L2). The launcher makes the clusters a multiple of row_blocks.
    const uint32_t cid = blockIdx.x / LIN_SEGS / row_blocks, ncl = gridDim.x / LIN_SEGS / row_blocks;
    const uint32_t m0 = (blockIdx.x / LIN_SEGS % row_blocks) * N;
    const uint32_t tiles = (n + LIN_DEC_COLS - 1) / LIN_DEC_COLS;
    const uint32_t my_tiles = cid < tiles ? (tiles - cid + ncl - 1) / ncl : 0;  // the same in the cluster
    const LinSegment span = lin_segment(k, seg);
    const uint32_t seg_steps = (lin_segment(k, 0).c_end + 1) / 2;  // x's room: the longest segment
    const uint32_t nch = span.c_end - span.c_begin, steps = (nch + 1) / 2, total = my_tiles * steps;
    const uint32_t x_bytes = seg_steps * X_STAGE;
    const uint32_t st_fit = (LIN_DEC_SPACE - x_bytes - PART_BYTES) / W_BYTES;
    const uint32_t ST = st_fit < MAX_STAGES ? st_fit : MAX_STAGES;
    if (ST < 2) __trap();  // the launcher keeps to LIN_DEC_MIN_STAGES
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    const uint32_t xs = sbase, ring = sbase + x_bytes + PART_BYTES;
    const uint32_t full = ring + ST * W_BYTES, empty = full + MAX_STAGES * 8;
    const uint32_t pready = empty + MAX_STAGES * 8, pfree = pready + 16, xfull = pfree + 16;
    const DecBars bars = {full, empty, pready, pfree, xfull};
    // x's segment from its stage images: where they are given and every segment starts and
    // ends with a stage (uniform over the grid).
    const bool staged = ximg != nullptr && k % 64 == 0 && lin_segment(k, 0).c_end % 2 == 0;
    if (tid < ST) {
        mbar_init(full + tid * 8, 1);
        mbar_init(empty + tid * 8, 256);
    }
    if (tid < 2) {
        mbar_init(pready + tid * 8, LIN_SEGS);
        mbar_init(pfree + tid * 8, LIN_SEGS);
    }
    if (tid == 0) mbar_init(xfull, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    // Every block's barriers are set before any block arrives on them.
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");

    auto queue_w = [&](uint32_t g) {  // stage g: step g % steps of tile g / steps
        const uint32_t slot = g % ST, bar = full + slot * 8;
        mbar_expect_tx(bar, W_BYTES);
        tma_load_2d(ring + slot * W_BYTES, wmap, (span.c_begin + 2 * (g % steps)) * LIN_KC,
                    (cid + (g / steps) * ncl) * LIN_DEC_COLS, bar);
    };
    if (tid == 0) {
        // The map was written by a copy before the launch.
        asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;\n" ::"l"(wmap) : "memory");
        for (uint32_t g = 0; g < total && g < ST; ++g) queue_w(g);
    }
    pdl_wait();
    dec_load_x<N>(x, ximg, m, k, m0, span, seg_steps, staged, xs, xfull);
    __syncthreads();
    float4* part = reinterpret_cast<float4*>(smem + x_bytes);
    cg::cluster_group cluster = cg::this_cluster();
    // Sum the cluster's partials of tile `it` (buffer it % 2) over the segments in order and
    // store this block's share; then tell every block that buffer is read. Run by the producer
    // warpgroup's warps 1-3 (LIN_DEC_SUM_THREADS), so the consumers go on to the next tile's
    // MMAs meanwhile (summed by the consumers between their tiles, the sums would take a large
    // share of a small projection).
    auto reduce = [&](uint32_t it, uint32_t rt) {
        const uint32_t b = it & 1;
        mbar_wait_cluster(pready + b * 8, (it >> 1) & 1);
        const float4* src = part + b * (N * 32);
        const uint32_t n0 = (cid + it * ncl) * LIN_DEC_COLS;
        for (uint32_t f = seg * (N * 4) + rt; f < (seg + 1) * (N * 4); f += LIN_DEC_SUM_THREADS) {
            // float4 jn of consumer t: its fragment row's columns, x rows 8 jn + 2 q (+ 1).
            const uint32_t t = f % 256, jn = f / 256, ln = t % 32;
            const uint32_t col0 = n0 + wg_frag_rows(t / 128, (t % 128) / 32, ln / 4, ln % 4).ra;
            const uint32_t row0 = m0 + jn * 8 + 2 * (ln % 4);
            const float4 sum = cluster_segment_sum<true>(cluster, src, f, span.nsegs);
            const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
            for (uint32_t e = 0; e < 4; ++e) {
                const uint32_t row = row0 + (e & 1), col = col0 + (e >= 2 ? 8 : 0);
                if (row < m && col < n) store_out(out, (size_t)row * n + col, vals[e]);
            }
        }
        asm volatile("bar.sync 2, %0;\n" ::"n"(LIN_DEC_SUM_THREADS) : "memory");  // every read has returned
        if (rt < LIN_SEGS) mbar_arrive_remote(pfree + b * 8, rt);
    };
    if (tid < 128) {
        pdl_trigger();
        if (tid == 0) {
            for (uint32_t g = ST, slot = 0, phase = 0; g < total; ++g) {
                mbar_wait(empty + slot * 8, phase);
                queue_w(g);
                if (++slot == ST) slot = 0, phase ^= 1;
            }
        } else if (tid >= 32) {
            for (uint32_t it = 0; it < my_tiles; ++it) reduce(it, tid - 32);
            // No block leaves while another may still read its partials (the last use of each
            // buffer).
            for (uint32_t it = my_tiles > 2 ? my_tiles - 2 : 0; it < my_tiles; ++it)
                mbar_wait_cluster(pfree + (it & 1) * 8, (it >> 1) & 1);
        }
        return;
    }

    dec_consume<N>(wf, part, ring, xs, bars, ST, span.c_begin, nch, cid, ncl, my_tiles, staged);
}
