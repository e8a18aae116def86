// `linear_stream`'s and `linear_stream_b4`'s body, also `linear_swiglu`'s (kernels/gemm.cu has
// the family's numerics). Included by gemm.cu only.

// ---- The m <= 16 decode kernel (`linear_stream`) ----
// Persistent blocks: block b takes the units (one column tile of 8 output columns by one row tile
// of 16 rows) b, b + gridDim.x, ...; warp w computes segment w of each, loading its weight
// fragments straight into registers: a batch is B chunks (one 16-byte load per lane and chunk, 8
// weight rows x 64 bytes per warp-wide load), and two batches are in flight per warp while it
// computes. The batches run on across the block's units, so the next unit's first two batches
// are loading while this unit's last two are computed and summed; the first two are loaded
// before `pdl_wait` (the weight is never written by the kernel ahead on the stream). x comes
// through L1 (it is small and every block rereads it). The warps leave their segment partials
// in shared memory (two buffers, by unit parity: one barrier a unit) and the block sums them in
// segment order.

// 16 weight bytes, read once: past L1, asking L2 for the whole 256-byte span (the rest of the
// row's bytes are read by the next loads of this warp and its neighbours).
MT_DEVICE uint4 ldg_stream16(const bf16* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// The weight operand of the direct kernels, one type per storage format: `Batch<B>` is what a
// lane holds in flight for B chunks (its 8 k of one weight row in each), `load` reads one (zero
// outside the weight; VEC: k % 8 == 0 and an aligned base, so a lane's 8 lie in one aligned
// vector) and `frag` makes chunk `ch` of it the MMA's bf16 fragment. Every format gives
// `linear`'s fragment of the bf16 weight its values stand for, so every format has `linear`'s
// numerics. A batch wholly inside the weight and the segment (the common case: every batch but a
// segment's last, on the checkpoints' shapes all of them) loads from one row address with no
// per-chunk bounds, which keeps the integer work per weight byte small; the others check each
// chunk.
MT_DEVICE bool direct_whole(uint32_t n, uint32_t k, uint32_t row, uint32_t c0, uint32_t c_end, int b) {
    return row < n && c0 + b <= c_end && (c0 + b) * LIN_KC <= k;
}

struct DirectWBf16 {
    const bf16* w;
    template <int B>
    struct Batch {
        uint4 r[B];
    };
    MT_DEVICE bool aligned() const { return aligned16(w); }
    template <int B, bool VEC>
    MT_DEVICE void load(Batch<B>& d, uint32_t n, uint32_t k, uint32_t row, uint32_t c0, uint32_t c_end,
                        uint32_t q) const {
        const uint32_t col0 = c0 * LIN_KC + q * 8;
        if (VEC && direct_whole(n, k, row, c0, c_end, B)) {
            const bf16* p = w + (size_t)row * k + col0;
#pragma unroll
            for (int ch = 0; ch < B; ++ch) d.r[ch] = ldg_stream16(p + ch * LIN_KC);
            return;
        }
#pragma unroll
        for (int ch = 0; ch < B; ++ch) {
            const uint32_t col = col0 + ch * LIN_KC;
            if (c0 + ch >= c_end)
                d.r[ch] = make_uint4(0, 0, 0, 0);
            else if (VEC)
                d.r[ch] = row < n && col < k ? ldg_stream16(w + (size_t)row * k + col) : make_uint4(0, 0, 0, 0);
            else
                d.r[ch] = load8(w, n, k, row, col, false);
        }
    }
    template <int B>
    MT_DEVICE uint4 frag(const Batch<B>& d, int ch) const {
        return d.r[ch];
    }
};

// 8 weight bytes, read once (see `ldg_stream16`).
MT_DEVICE uint2 ldg_stream8(const uint8_t* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// A block-FP8 weight: e4m3 bytes and an f32 scale per block of FP8_BLOCK columns by
// 2^shift rows. A lane holds its 8 bytes a chunk and the scales of the blocks they lie in, as
// the f32 factor the conversion multiplies by (fp8_scale2); its fragment is
// bf16(e4m3 * scale') of each byte, which is `dequant_fp8`'s weight, so the rows are
// `linear`'s of it. Chunk c lies in scale
// block c / 4 (FP8_BLOCK / LIN_KC chunks a block) whatever the lane. SPAN: chunks that share a
// scale in a batch, 4 where every batch starts at a multiple of 4 chunks (the launch checks
// it), so a batch of B reads B / 4 scales; 1 otherwise (one a chunk).
template <int SPAN>
struct DirectWFp8 {
    static_assert(SPAN == 1 || SPAN == FP8_BLOCK / LIN_KC, "a scale spans one chunk or a whole block");
    const uint8_t* w;
    const float* scales;
    uint32_t shift;    // log2 of the weight rows a scale row covers
    uint32_t kblocks;  // scale columns: ceil(k / FP8_BLOCK)
    template <int B>
    struct Batch {
        static_assert(B % SPAN == 0, "a batch holds whole scale spans");
        uint2 q[B];
        uint32_t s2[B / SPAN];  // fp8_scale2 of each span's scale
    };
    MT_DEVICE bool aligned() const { return aligned8(w); }
    template <int B, bool VEC>
    MT_DEVICE void load(Batch<B>& d, uint32_t n, uint32_t k, uint32_t row, uint32_t c0, uint32_t c_end,
                        uint32_t q) const {
        const uint32_t col0 = c0 * LIN_KC + q * 8;
        const float* srow = scales + (size_t)(row >> shift) * kblocks;
        if (VEC && direct_whole(n, k, row, c0, c_end, B)) {
            const uint8_t* p = w + (size_t)row * k + col0;
#pragma unroll
            for (int ch = 0; ch < B; ++ch) d.q[ch] = ldg_stream8(p + ch * LIN_KC);
#pragma unroll
            for (int j = 0; j < B / SPAN; ++j) d.s2[j] = fp8_scale2(__ldg(srow + (c0 + j * SPAN) / (FP8_BLOCK / LIN_KC)));
            return;
        }
#pragma unroll
        for (int ch = 0; ch < B; ++ch) {
            const uint32_t c = c0 + ch, col = col0 + ch * LIN_KC;
            const bool in = c < c_end && row < n && col < k;
            if (ch % SPAN == 0) d.s2[ch / SPAN] = in ? fp8_scale2(__ldg(srow + c / (FP8_BLOCK / LIN_KC))) : 0u;
            const uint8_t* p = w + (size_t)row * k + col;
            if (!in) {
                d.q[ch] = make_uint2(0, 0);
            } else if (VEC) {
                d.q[ch] = ldg_stream8(p);
            } else {
                uint32_t b[2] = {0u, 0u};
#pragma unroll
                for (uint32_t i = 0; i < 8; ++i)
                    if (col + i < k) b[i / 4] |= uint32_t(p[i]) << (8 * (i % 4));
                d.q[ch] = make_uint2(b[0], b[1]);
            }
        }
    }
    template <int B>
    MT_DEVICE uint4 frag(const Batch<B>& d, int ch) const {
        return fp8_frag(d.q[ch], d.s2[ch / SPAN]);
    }
};

// The MMAs of one batch (chunks c0 .. c0 + B - 1 of this warp's segment, those before c_end).
// RB: x rows g + 8 are loaded too (a unit may have rows past its first 8).
template <int B, bool RB, bool VEC, typename W>
MT_DEVICE void direct_batch(float (&acc)[4], const W& w, const typename W::template Batch<B>& wr, const bf16* x,
                            uint32_t m, uint32_t k, uint32_t m0, uint32_t c0, uint32_t c_end, uint32_t g,
                            uint32_t q) {
    uint4 ra[B], rb[B];
    const uint32_t col0 = c0 * LIN_KC + q * 8;
    if (VEC && direct_whole(~0u, k, 0, c0, c_end, B)) {  // every chunk in range: no per-chunk checks
        const bf16* xa = x + (size_t)(m0 + g) * k + col0;
        const bool ina = m0 + g < m, inb = RB && m0 + g + 8 < m;
#pragma unroll
        for (int ch = 0; ch < B; ++ch) {
            ra[ch] = ina ? load16(xa + ch * LIN_KC) : make_uint4(0, 0, 0, 0);
            rb[ch] = inb ? load16(xa + 8 * (size_t)k + ch * LIN_KC) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int ch = 0; ch < B; ++ch) mma_chunk(acc, ra[ch], rb[ch], w.frag(wr, ch));
        return;
    }
#pragma unroll
    for (int ch = 0; ch < B; ++ch) {
        const uint32_t c = c0 + ch, col = col0 + ch * LIN_KC;
        ra[ch] = c < c_end ? load8(x, m, k, m0 + g, col, VEC) : make_uint4(0, 0, 0, 0);
        rb[ch] = RB && c < c_end ? load8(x, m, k, m0 + g + 8, col, VEC) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int ch = 0; ch < B; ++ch) {
        if (c0 + ch >= c_end) break;
        mma_chunk(acc, ra[ch], rb[ch], w.frag(wr, ch));
    }
}

// The block's units in turn: blockIdx.x, blockIdx.x + gridDim.x, ... A warp's batch count is
// rounded up to even (an empty batch loads nothing and adds nothing), so every unit starts in
// the same register buffer. Which block computes a unit, and with which batch size, never
// changes its chain of MMAs. The block lets the next kernel start (`pdl_trigger`) only as it
// begins its last unit: triggering at the start lets the norms, cache store and attention
// behind the projection take its multiprocessors while its weight stream still needs them,
// which slows the whole decode step (see `pdl_enter` in common.cuh). Blocks take their units in
// turn rather than from an atomic counter: the claim's round trip costs more than the balance
// it buys.
// SWIGLU (`linear_swiglu`): w is [2n, k], gate rows then up rows. A block takes pairs of units,
// the gate tile of 8 columns and then the up tile of the same columns, and writes silu(gate) *
// up of the two, each summed as `linear` sums it and rounded to bf16 as `linear` writes it: the
// thread that sums an output's gate column keeps the total for its up column, the next unit.
template <typename OutT, int B, bool RB, bool VEC, bool SWIGLU, typename W>
MT_DEVICE void linear_direct_impl(OutT* out, const bf16* x, const W& w, uint32_t m, uint32_t n,
                                  uint32_t k, float4 (*part)[LIN_STREAM_WARPS * 32]) {
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const LinSegment span = lin_segment(k, warp);
    const uint32_t nsegs = span.nsegs, c_begin = span.c_begin, c_end = span.c_end;
    // Row tiles of one column tile are neighbouring units, so they run together and all but the
    // first read the weight tile from L2 (the launcher sends only m <= 16, one row tile, here).
    // Under SWIGLU a unit is half h of tile pair u / 2: its gate (h = 0) or up (h = 1) rows.
    const uint32_t row_units = (m + 15) / 16, tiles = ((n + 7) / 8) * row_units;
    const uint32_t units = SWIGLU ? 2 * tiles : tiles;
    // The block's i-th unit: blockIdx.x, blockIdx.x + gridDim.x, ... (pairs of them, SWIGLU).
    auto unit_of = [&](uint32_t i) -> uint32_t {
        return SWIGLU ? 2 * (blockIdx.x + (i >> 1) * gridDim.x) + (i & 1) : blockIdx.x + i * gridDim.x;
    };
    auto w_row = [&](uint32_t u) -> uint32_t {  // the unit's first weight row (lane g reads + g)
        return SWIGLU ? (u & 1) * n + ((u >> 1) / row_units) * 8 : (u / row_units) * 8;
    };
    const uint32_t nb = (c_end - c_begin + B - 1) / B, nbe = nb + (nb & 1);  // this warp's batches
    // Batch bb of the block's unit i, where bb may run past it into the block's next unit.
    using Batch = typename W::template Batch<B>;
    auto load = [&](Batch& dst, uint32_t i, uint32_t bb) {
        if (bb >= nbe) {
            ++i;
            bb -= nbe;
        }
        const uint32_t u = unit_of(i);
        if (u < units) w.template load<B, VEC>(dst, SWIGLU ? 2 * n : n, k, w_row(u) + g, c_begin + bb * B, c_end, q);
    };

    // Two batches load before the wait, so the weight stream is busy while the kernel ahead
    // finishes (fewer leave it idle; asking L2 for more of the block's weight as well, by a
    // bulk prefetch, competes with the kernel ahead and slows the step).
    Batch wa, wb;
    if (nbe > 0) {
        load(wa, 0, 0);
        load(wb, 0, 1);
    }
    pdl_wait();  // x and out belong to the kernels around this one
    float gate = 0.0f;  // SWIGLU: this thread's gate total, from the pair's first unit
    for (uint32_t i = 0, u = unit_of(0); u < units; u = unit_of(++i)) {  // caller: blockIdx.x < tiles
        if (unit_of(i + 1) >= units) pdl_trigger();
        const uint32_t tile = SWIGLU ? u >> 1 : u;
        const uint32_t m0 = (tile % row_units) * 16;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (uint32_t b = 0; b < nbe; b += 2) {
            direct_batch<B, RB, VEC>(acc, w, wa, x, m, k, m0, c_begin + b * B, c_end, g, q);
            load(wa, i, b + 2);
            direct_batch<B, RB, VEC>(acc, w, wb, x, m, k, m0, c_begin + (b + 1) * B, c_end, g, q);
            load(wb, i, b + 3);
        }
        float4* pp = part[i & 1];
        pp[warp * 32 + lane] = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();  // also orders this buffer's reads below before its writes two units on
        if (tid < 128) {
            const uint32_t ln = tid / 4, e = tid % 4;
            const uint32_t row = m0 + ln / 4 + (e >= 2 ? 8 : 0);
            const uint32_t col = (tile / row_units) * 8 + (ln % 4) * 2 + (e & 1);
            if (row < m && col < n) {
                const float* pf = reinterpret_cast<const float*>(pp);
                float total = 0.0f;
                for (uint32_t sg = 0; sg < nsegs; ++sg) total += pf[(sg * 32 + ln) * 4 + e];
                if (!SWIGLU)
                    store_out(out, (size_t)row * n + col, total);
                else if ((u & 1) == 0)
                    gate = total;
                else
                    store_out(out, (size_t)row * n + col, siluf_acc(bf2f(f2bf(gate))) * bf2f(f2bf(total)));
            }
        }
    }
}

// ---- The m <= 16 FP8 decode kernel with the weight as the MMA's A operand ----
// `linear_stream_fp8` at m <= 16 on aligned operands whose segments are whole batches (the
// checkpoints' shapes). The weight is the MMA's A operand and x its B operand: a unit is 16
// weight rows (lane g converts rows g and g + 8), and x row g's 16-byte load is the B fragment
// as it stands (rows g + 8 a second B fragment above 8 rows, TT = 2 token tiles), where the
// kernel above moves x and zeros into A's registers every chunk. Each output is the same dot
// product over the same k sets per MMA, transposed, so the rows are bitwise the kernel above's
// (measured on the H200, `lab/fp8_swap_lab.cu`: every output of the Qwen3-8B projections at 1,
// 4 and 8 rows; 38.7 against 46.4 us for gate_up at one row). A block's (unit, batch) pairs are
// one stream with two batches in flight, running on from one unit into the next; its warps sum
// their segments' partials in order through shared memory.
constexpr int LIN_FP8_SWAP_B = 8;  // chunks per batch at one token tile (4 at two)

// A lane's batch of B chunks: 8 bytes of rows g and g + 8 a chunk, and their blocks' scale factors.
template <int B>
struct Fp8SwapBatch {
    uint2 lo[B], hi[B];
    uint32_t s_lo[B / 4], s_hi[B / 4];
};

// Whether `linear_fp8_swapped` serves the launch: m <= 16, aligned operands, and k a multiple of
// LIN_SEGS whole batches (2048: 4096 and 12288 in the checkpoints), so every segment is whole
// batches of whole chunks, and every batch starts on a scale block.
MT_DEVICE bool fp8_swap_fits(const bf16* x, const uint8_t* w, uint32_t m, uint32_t k) {
    return m <= 16 && k % (LIN_KC * LIN_SEGS * LIN_FP8_SWAP_B) == 0 && aligned16(x) && aligned8(w);
}

template <int B>
MT_DEVICE void fp8_swap_load(Fp8SwapBatch<B>& d, const DirectWFp8<FP8_BLOCK / LIN_KC>& w, uint32_t n, uint32_t k,
                             uint32_t row, uint32_t c0, uint32_t q) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const uint32_t r = row + 8 * h;
        uint2* dst = h ? d.hi : d.lo;
        uint32_t* s = h ? d.s_hi : d.s_lo;
        const bool in = r < n;
        const uint8_t* p = w.w + (size_t)r * k + c0 * LIN_KC + q * 8;
        const float* sp = w.scales + (size_t)(r >> w.shift) * w.kblocks + c0 / (FP8_BLOCK / LIN_KC);
#pragma unroll
        for (int ch = 0; ch < B; ++ch) dst[ch] = in ? ldg_stream8(p + ch * LIN_KC) : make_uint2(0, 0);
#pragma unroll
        for (int j = 0; j < B / 4; ++j) s[j] = in ? fp8_scale2(__ldg(sp + j)) : 0u;
    }
}

// TT: token tiles of 8 (1 for m <= 8, 2 for m <= 16).
template <int TT>
MT_DEVICE void linear_fp8_swapped(bf16* out, const bf16* x, const DirectWFp8<FP8_BLOCK / LIN_KC>& w, uint32_t m,
                                  uint32_t n, uint32_t k, float4 (*part)[LIN_STREAM_WARPS * 32]) {
    constexpr int B = LIN_FP8_SWAP_B / TT;
    static_assert(B % 4 == 0, "a batch holds whole scale blocks");
    const uint32_t tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    const LinSegment span = lin_segment(k, warp);
    const uint32_t units = (n + 15) / 16;
    const uint32_t mine = blockIdx.x < units ? (units - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const uint32_t seg_batches = (span.c_end - span.c_begin) / B;  // the same in every warp
    const uint32_t total = mine * seg_batches;
    const bf16* xg = x + (size_t)g * k + q * 8;
    auto unit_of = [&](uint32_t t) { return blockIdx.x + (t / seg_batches) * gridDim.x; };
    auto load = [&](Fp8SwapBatch<B>& d, uint32_t t) {
        fp8_swap_load(d, w, n, k, unit_of(t) * 16 + g, span.c_begin + (t % seg_batches) * B, q);
    };
    float acc[TT][4];
    auto compute = [&](const Fp8SwapBatch<B>& d, uint32_t t) {
        const uint32_t bb = t % seg_batches, c0 = span.c_begin + bb * B;
        if (bb == 0) {
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) acc[tt][0] = acc[tt][1] = acc[tt][2] = acc[tt][3] = 0.0f;
            if (t / seg_batches + 1 == mine) pdl_trigger();  // the block's last unit begins
        }
        uint4 xr[TT][B];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
#pragma unroll
            for (int ch = 0; ch < B; ++ch)
                xr[tt][ch] = g + 8 * tt < m ? load16(xg + (size_t)(8 * tt) * k + (c0 + ch) * LIN_KC)
                                            : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int ch = 0; ch < B; ++ch) {
            const uint4 wl = fp8_frag(d.lo[ch], d.s_lo[ch / 4]), wh = fp8_frag(d.hi[ch], d.s_hi[ch / 4]);
#pragma unroll
            for (int tt = 0; tt < TT; ++tt) {
                mma16816(acc[tt], wl.x, wh.x, wl.y, wh.y, xr[tt][ch].x, xr[tt][ch].y);
                mma16816(acc[tt], wl.z, wh.z, wl.w, wh.w, xr[tt][ch].z, xr[tt][ch].w);
            }
        }
        if (bb + 1 < seg_batches) return;
        // One token tile: buffer by unit parity, one barrier a unit (it also orders this
        // buffer's reads below before its writes two units on). Two: a buffer each, and a
        // second barrier before the next unit writes them.
        float4* pp = part[TT == 1 ? (t / seg_batches) & 1 : 0];
#pragma unroll
        for (int tt = 0; tt < TT; ++tt)
            part[TT == 1 ? (t / seg_batches) & 1 : tt][warp * 32 + lane] =
                make_float4(acc[tt][0], acc[tt][1], acc[tt][2], acc[tt][3]);
        __syncthreads();
        if (tid < 128 * TT) {  // element e of lane ln of tile tt: weight row ln / 4 (+ 8 from e = 2),
                               // x row 8 tt + 2 (ln % 4) + (e & 1)
            const uint32_t tt = tid / 128, ln = (tid % 128) / 4, e = tid % 4;
            const uint32_t col = unit_of(t) * 16 + ln / 4 + (e >= 2 ? 8 : 0), row = 8 * tt + (ln % 4) * 2 + (e & 1);
            if (row < m && col < n) {
                const float* pf = reinterpret_cast<const float*>(TT == 1 ? pp : part[tt]);
                float sum = 0.0f;
                for (uint32_t sg = 0; sg < span.nsegs; ++sg) sum += pf[(sg * 32 + ln) * 4 + e];
                store_out(out, (size_t)row * n + col, sum);
            }
        }
        if (TT > 1) __syncthreads();
    };
    // The first two batches load before the wait: the weight is never written by the kernel
    // ahead on the stream.
    Fp8SwapBatch<B> a, b;
    if (total > 0) load(a, 0);
    if (total > 1) load(b, 1);
    pdl_wait();  // x and out belong to the kernels around this one
    for (uint32_t t = 0; t < total; t += 2) {
        compute(a, t);
        if (t + 2 < total) load(a, t + 2);
        if (t + 1 < total) compute(b, t + 1);
        if (t + 3 < total) load(b, t + 3);
    }
}
