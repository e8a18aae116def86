// Lab: the m <= 16 direct kernel widened to NT column tiles (8 NT columns) by RT row tiles (16 RT
// rows) per block: warp w computes segment w of the whole unit, each weight fragment (loaded
// straight into registers, as `linear_stream`) feeding RT MMA pairs and each x fragment NT. It
// measures whether the register-direct weight stream keeps its m = 1 rate at 32-64 rows once x
// traffic per weight byte is held at 2 RT / NT. Numerics of every `linear` kernel. A block takes
// a whole multiprocessor's registers, so in a decode step it cannot start beside the kernel
// ahead: judge it by whole steps, not by the lab's back-to-back launches.
template <int B, int NT, int RT, bool VEC>
MT_DEVICE void drt_load_w(uint4 (&dst)[B][NT], const bf16* w, uint32_t n, uint32_t k, uint32_t n0, uint32_t g,
                          uint32_t c0, uint32_t c_end, uint32_t q) {
#pragma unroll
    for (int ch = 0; ch < B; ++ch)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const uint32_t c = c0 + ch, col = c * LIN_KC + q * 8, row = n0 + 8 * t + g;
            dst[ch][t] = c < c_end && row < n && col < k ? ldg_stream16(w + (size_t)row * k + col) : make_uint4(0, 0, 0, 0);
        }
}

template <int B, int NT, int RT>
MT_DEVICE void drt_batch(float (&acc)[RT][NT][4], const uint4 (&wr)[B][NT], const bf16* x, uint32_t m, uint32_t k,
                         uint32_t m0, uint32_t c0, uint32_t c_end, uint32_t g, uint32_t q) {
    uint4 ra[B][RT], rb[B][RT];
#pragma unroll
    for (int ch = 0; ch < B; ++ch)
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            const uint32_t c = c0 + ch, col = c * LIN_KC + q * 8;
            ra[ch][r] = c < c_end ? load8(x, m, k, m0 + 16 * r + g, col, true) : make_uint4(0, 0, 0, 0);
            rb[ch][r] = c < c_end ? load8(x, m, k, m0 + 16 * r + g + 8, col, true) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
    for (int ch = 0; ch < B; ++ch) {
        if (c0 + ch >= c_end) break;
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int t = 0; t < NT; ++t) mma_chunk(acc[r][t], ra[ch][r], rb[ch][r], wr[ch][t]);
    }
}

template <typename OutT, int B, int NT, int RT, int MINB>
__global__ void __launch_bounds__(256, MINB)
    lab_drt(OutT* out, const bf16* x, const bf16* w, uint32_t m, uint32_t n, uint32_t k) {
    __shared__ float4 part[LIN_STREAM_WARPS][RT][NT][32];
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const LinSegment span = lin_segment(k, warp);
    const uint32_t nsegs = span.nsegs, c_begin = span.c_begin, c_end = span.c_end;
    const uint32_t row_units = (m + 16 * RT - 1) / (16 * RT);
    const uint32_t n0 = (blockIdx.x / row_units) * 8 * NT, m0 = (blockIdx.x % row_units) * 16 * RT;
    const uint32_t nb = (c_end - c_begin + B - 1) / B;

    uint4 wa[B][NT], wb[B][NT];
    if (nb > 0) drt_load_w<B, NT, RT, true>(wa, w, n, k, n0, g, c_begin, c_end, q);
    if (nb > 1) drt_load_w<B, NT, RT, true>(wb, w, n, k, n0, g, c_begin + B, c_end, q);
    pdl_wait();
    pdl_trigger();
    float acc[RT][NT][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = acc[r][t][2] = acc[r][t][3] = 0.0f;
    for (uint32_t b = 0; b < nb; b += 2) {
        drt_batch<B, NT, RT>(acc, wa, x, m, k, m0, c_begin + b * B, c_end, g, q);
        if (b + 2 < nb) drt_load_w<B, NT, RT, true>(wa, w, n, k, n0, g, c_begin + (b + 2) * B, c_end, q);
        if (b + 1 < nb) {
            drt_batch<B, NT, RT>(acc, wb, x, m, k, m0, c_begin + (b + 1) * B, c_end, g, q);
            if (b + 3 < nb) drt_load_w<B, NT, RT, true>(wb, w, n, k, n0, g, c_begin + (b + 3) * B, c_end, q);
        }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int t = 0; t < NT; ++t) part[warp][r][t][lane] = make_float4(acc[r][t][0], acc[r][t][1], acc[r][t][2], acc[r][t][3]);
    __syncthreads();
    // Output (r, t, lane ln, element i): row m0 + 16 r + ln / 4 (+ 8), column n0 + 8 t + 2 (ln % 4) + (i & 1).
    for (uint32_t o = tid; o < RT * NT * 128; o += 256) {
        const uint32_t i = o % 4, ln = (o / 4) % 32, t = (o / 128) % NT, r = o / (128 * NT);
        const uint32_t row = m0 + 16 * r + ln / 4 + (i >= 2 ? 8 : 0);
        const uint32_t col = n0 + 8 * t + (ln % 4) * 2 + (i & 1);
        if (row < m && col < n) {
            float total = 0.0f;
            for (uint32_t sg = 0; sg < nsegs; ++sg) total += reinterpret_cast<const float*>(&part[sg][r][t][ln])[i];
            store_out(out, (size_t)row * n + col, total);
        }
    }
}
