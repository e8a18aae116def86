// `linear_stream_wide`'s body (kernels/gemm.cu has the family's numerics), also the compute_90
// body of `linear_stream_tma`. Included by gemm.cu only.

// ---- The 16 < m <= 128 decode kernel (`linear_stream_wide`) ----
// A cluster of LIN_SEGS blocks per output tile (8 * NT columns per warp, so 64 * NT per tile, by
// LIN_W_ROWS rows); block s of the cluster computes segment s of every output of the tile. Warp w
// takes the tile's columns 8 NT w .. 8 NT (w + 1) - 1 (NT column tiles) for all its row tiles. The block streams its segment through a ring
// of STAGES stages in shared memory, each STAGE_CH chunks of the tile's weight rows and x rows
// (cp.async; plain loads when unaligned), so a weight fragment is read once from memory and x
// once per tile from L2, and every x fragment read from shared memory feeds two weight column
// tiles. The clusters of one column tile's row blocks are neighbours in the grid, so they run
// together and the weight is read from memory about once. At the end each warp leaves its partials in shared memory and the cluster sums them in
// segment order through distributed shared memory, each block writing one eighth of the tile.

// Slot of vector q of stage row `row` in chunk `ch` of a bf16 stage ([chunk][row][4 vectors]).
template <int BN>
MT_DEVICE uint32_t wide_slot(uint32_t ch, uint32_t row, uint32_t q) {
    return (ch * (BN + LIN_W_ROWS) + row) * 4 + q;
}

// Queue `rows` rows of bf16 `src` ([src_rows, k], from row r0) for chunks c0 .. c0 + STAGE_CH - 1
// (those before c_end) into the stage slots `slot(ch, r, q)` gives (16-byte vectors of `st`);
// consecutive threads take consecutive 16-byte vectors of a row, so each row's run of the stage
// is one contiguous read.
template <int STAGE_CH, bool VEC, typename Slot>
MT_DEVICE void wide_issue(uint4* st, const bf16* src, uint32_t src_rows, uint32_t k, uint32_t r0,
                          uint32_t rows, uint32_t c0, uint32_t c_end, Slot slot) {
    for (uint32_t i = threadIdx.x; i < rows * STAGE_CH * 4; i += blockDim.x) {
        const uint32_t r = i / (STAGE_CH * 4), ch = (i / 4) % STAGE_CH, q = i % 4;
        const uint32_t c = c0 + ch, grow = r0 + r, col = c * LIN_KC + q * 8;
        uint4* dst = st + slot(ch, r, q);
        if (VEC) {
            const bool in = grow < src_rows && c < c_end && col < k;
            cp_async16(dst, in ? src + (size_t)grow * k + col : src, in ? 16u : 0u);
        } else {
            *dst = c < c_end ? load8(src, src_rows, k, grow, col, false) : make_uint4(0, 0, 0, 0);
        }
    }
}

// The weight operand of `linear_wide_impl`, one type per storage format: where a stage keeps
// the tile's BN weight rows and its x rows (`STAGE_VECS` 16-byte vectors a stage; `x_slot`),
// how the weight's chunks are queued (`issue`), and lane (g, q)'s MMA fragment of weight row
// `row` of the tile in chunk `ch` of the stage, chunk `c` of k (`frag`). `vec`: the weight
// allows the cp.async copies (with x's alignment, the caller's VEC).
template <int BN, int STAGE_CH>
struct WideWBf16 {
    const bf16* w;
    // [chunk][row][4 vectors], the tile's BN weight rows then its x rows; vector q of a row
    // holds k 8q..8q+7 of the chunk, which is what lane (g, q) feeds its MMAs.
    static constexpr uint32_t STAGE_VECS = STAGE_CH * (BN + LIN_W_ROWS) * 4;
    MT_DEVICE static uint32_t x_slot(uint32_t ch, uint32_t r, uint32_t q) { return wide_slot<BN>(ch, BN + r, q); }
    MT_DEVICE bool vec(uint32_t k) const { return k % 8 == 0 && aligned16(w); }
    template <bool VEC>
    MT_DEVICE void issue(uint4* st, uint32_t n, uint32_t k, uint32_t n0, uint32_t c0, uint32_t c_end) const {
        wide_issue<STAGE_CH, VEC>(st, w, n, k, n0, BN, c0, c_end,
                                  [](uint32_t ch, uint32_t r, uint32_t q) { return wide_slot<BN>(ch, r, q); });
    }
    MT_DEVICE uint4 frag(const uint4* st, uint32_t ch, uint32_t row, uint32_t q, uint32_t, uint32_t, uint32_t) const {
        return st[wide_slot<BN>(ch, row, q)];
    }
};

// A block-FP8 weight (see `DirectWFp8`): a stage keeps the weight's bytes, [chunk][row][32
// bytes] (lane (g, q) reads bytes 8q..8q+7 of its row: one 256-byte run a warp, no bank
// conflict), then x's rows as `WideWBf16` keeps them. A fragment is converted as the MMAs take
// it, with its block's scale read through L1.
template <int BN, int STAGE_CH>
struct WideWFp8 {
    const uint8_t* w;
    const float* scales;
    uint32_t shift;    // log2 of the weight rows a scale row covers
    uint32_t kblocks;  // scale columns: ceil(k / FP8_BLOCK)
    static constexpr uint32_t W_VECS = STAGE_CH * BN * 2;
    static constexpr uint32_t STAGE_VECS = W_VECS + STAGE_CH * LIN_W_ROWS * 4;
    MT_DEVICE static uint32_t x_slot(uint32_t ch, uint32_t r, uint32_t q) {
        return W_VECS + (ch * LIN_W_ROWS + r) * 4 + q;
    }
    MT_DEVICE bool vec(uint32_t k) const { return k % 16 == 0 && aligned16(w); }
    // Half h of row r's 32 bytes of chunk c (16 bytes, zero outside the weight).
    template <bool VEC>
    MT_DEVICE void issue(uint4* st, uint32_t n, uint32_t k, uint32_t n0, uint32_t c0, uint32_t c_end) const {
        for (uint32_t i = threadIdx.x; i < BN * STAGE_CH * 2; i += blockDim.x) {
            const uint32_t r = i / (STAGE_CH * 2), ch = (i / 2) % STAGE_CH, h = i % 2;
            const uint32_t c = c0 + ch, grow = n0 + r, col = c * LIN_KC + h * 16;
            uint4* dst = st + (ch * BN + r) * 2 + h;
            const bool in = grow < n && c < c_end && col < k;
            if (VEC) {
                cp_async16(dst, in ? w + (size_t)grow * k + col : w, in ? 16u : 0u);
            } else {
                uint32_t b[4] = {0u, 0u, 0u, 0u};
                if (in) {
                    const uint8_t* p = w + (size_t)grow * k + col;
                    for (uint32_t e = 0; e < 16 && col + e < k; ++e) b[e / 4] |= uint32_t(p[e]) << (8 * (e % 4));
                }
                *dst = make_uint4(b[0], b[1], b[2], b[3]);
            }
        }
    }
    MT_DEVICE uint4 frag(const uint4* st, uint32_t ch, uint32_t row, uint32_t q, uint32_t n, uint32_t n0,
                         uint32_t c) const {
        const uint2 v = reinterpret_cast<const uint2*>(st)[(ch * BN + row) * 4 + q];
        const uint32_t grow = n0 + row;
        const uint32_t s2 =
            grow < n ? fp8_scale2(__ldg(scales + (size_t)(grow >> shift) * kblocks + (c * LIN_KC) / FP8_BLOCK)) : 0u;
        return fp8_frag(v, s2);
    }
};

// `tile`: the cluster's tile (its index over the grid's clusters but for the compute_90 body of
// the persistent `linear_stream_tma`, whose clusters take tiles in turn).
// W: the weight's format (`WideWBf16`, `WideWFp8` of BN = 64 NT columns and STAGE_CH).
template <typename OutT, int NT, int STAGE_CH, int STAGES, bool VEC, typename W>
MT_DEVICE void linear_wide_impl(OutT* out, const bf16* x, const W& w, uint32_t m, uint32_t n,
                                uint32_t k, unsigned char* smem, uint32_t tile) {
    constexpr uint32_t BN = 64 * NT;
    constexpr uint32_t STAGE_VECS = W::STAGE_VECS;
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
            w.template issue<VEC>(ring + (j % STAGES) * STAGE_VECS, n, k, n0, c_begin + j * STAGE_CH, c_end);
    };
    auto issue_x = [&](uint32_t j) {
        if (j < steps)
            wide_issue<STAGE_CH, VEC>(ring + (j % STAGES) * STAGE_VECS, x, m, k, m0, row_tiles * 16,
                                      c_begin + j * STAGE_CH, c_end,
                                      [](uint32_t ch, uint32_t r, uint32_t q) { return W::x_slot(ch, r, q); });
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
            const uint32_t c = c_begin + j * STAGE_CH + ch;
            if (c >= c_end) break;
            uint4 wb[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) wb[t] = w.frag(st, ch, warp * 8 * NT + t * 8 + g, q, n, n0, c);
#pragma unroll
            for (int rt = 0; rt < 4; ++rt) {
                if ((uint32_t)rt >= row_tiles) break;
                const uint4 ra = st[W::x_slot(ch, rt * 16 + g, q)];
                const uint4 rb = st[W::x_slot(ch, rt * 16 + g + 8, q)];
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
