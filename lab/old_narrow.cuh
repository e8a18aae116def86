// The m <= 16 decode kernel of commit 37527a3 (kernels/gemm.cu), for the lab's comparison:
// persistent blocks, a per-warp cp.async ring of 3 stages, two blocks per multiprocessor.
#pragma once
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

