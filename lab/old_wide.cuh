// The 16 < m <= 64 decode kernel of commit 071b9ff (kernels/gemm.cu), for the lab's comparison:
// persistent blocks, each warp one segment of units of 16 columns by 64 rows, a per-warp cp.async
// weight ring, x read from global memory for every unit.
#pragma once
#define LIN_SLICE_CHUNKS 8
// The wide decode kernel: see the header. Each lane copies exactly the 16-byte weight fragments
// it later feeds to its own MMAs, into its own ring slots ([stage][tile][chunk][lane]), so no lane
// reads another's copies; a slot is refilled only after the same lane read it one step earlier.
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
