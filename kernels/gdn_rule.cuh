// The gated delta rule's device code (the Rule arguments, the fast warp-tile path with its
// prefill ring, the general column path, one block of either): part of gdn.cu, which includes it
// before the rule kernels; its header says how the rule is computed.
#pragma once

// The arguments both rule kernels share.
struct Rule {
    float* out;
    float* state;
    const float* qk;
    const bf16* conv;
    const float* gates;
    const uint32_t* seq_start;
    const uint32_t* seq_slot;
    // gated_delta_verify: the slot each row's state is kept in (NULL for the other kernels).
    const uint32_t* row_slot;
    uint32_t rows, num_seqs, num_slots, stride;
    uint32_t hk, dk, hv, dv;
    uint32_t kernel;  // MT_KERNEL_* of the launch, for its faults
};

// The slot row r keeps its state in, or NULL: verify steps only (PER_ROW), a real slot only.
MT_DEVICE float* row_state(const Rule& a, uint32_t r, uint32_t j) {
    const uint32_t dst = a.row_slot[r];
    if (dst == GDN_NO_SLOT) return nullptr;
    if (dst >= a.num_slots) {
        mt_fault(a.kernel, MT_FAULT_INDEX);
        return nullptr;
    }
    return a.state + (size_t)dst * a.stride + (size_t)j * a.dk * a.dv;
}

// What one token of one value head needs, for the rows and columns a fast-path lane owns.
template <int RPT>
struct RuleTok {
    float k[RPT];
    float q[RPT];
    float v[4];
    float beta;
    float g;
};

// Load row r's token for value head j: q̂, k̂ rows row0 .. row0+RPT-1 (zero past Dk), v columns
// col0 .. col0+3 (zero past Dv), β and g.
template <int RPT>
MT_DEVICE void load_tok(RuleTok<RPT>& t, const Rule& a, uint32_t r, uint32_t j, uint32_t row0,
                        uint32_t col0) {
    const uint32_t kd = a.hk * a.dk;
    const uint32_t kh = j / (a.hv / a.hk);
    const float* qr = a.qk + (size_t)r * 2 * kd + (size_t)kh * a.dk;
    const float* kr = qr + kd;
#pragma unroll
    for (int m = 0; m < RPT / 4; ++m) {
        const uint32_t c = row0 + 4 * m;
        float4 qv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), kv = qv;
        if (c < a.dk) {
            qv = *reinterpret_cast<const float4*>(qr + c);
            kv = *reinterpret_cast<const float4*>(kr + c);
        }
        t.q[4 * m] = qv.x; t.q[4 * m + 1] = qv.y; t.q[4 * m + 2] = qv.z; t.q[4 * m + 3] = qv.w;
        t.k[4 * m] = kv.x; t.k[4 * m + 1] = kv.y; t.k[4 * m + 2] = kv.z; t.k[4 * m + 3] = kv.w;
    }
    const uint32_t cd = 2 * kd + a.hv * a.dv;
    const bf16* vr = a.conv + (size_t)r * cd + 2 * kd + (size_t)j * a.dv + col0;
#pragma unroll
    for (int x = 0; x < 4; ++x) t.v[x] = col0 < a.dv ? bf2f(vr[x]) : 0.0f;
    t.beta = a.gates[(size_t)r * 2 * a.hv + j];
    t.g = a.gates[(size_t)r * 2 * a.hv + a.hv + j];
}

// Sum over the 8 row lanes (lane bits 2..4) of a fast-path warp; every row lane gets the same bits.
MT_DEVICE float row_lanes_sum(float v) {
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One token of the fast path on a lane's tile `s`: decay, the delta rule, the output columns o
// (summed over the row lanes, the same bits in all of them).
template <int RPT>
MT_DEVICE void rule_token(float (&s)[RPT][4], const RuleTok<RPT>& cur, float (&o)[4]) {
    const float decay = expf(cur.g);
    float kv[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            s[i][x] = __fmul_rn(s[i][x], decay);
            kv[x] = fmaf(s[i][x], cur.k[i], kv[x]);
        }
    }
    float delta[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
        delta[x] = __fmul_rn(cur.v[x] - row_lanes_sum(kv[x]), cur.beta);
        o[x] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            s[i][x] = fmaf(cur.k[i], delta[x], s[i][x]);
            o[x] = fmaf(s[i][x], cur.q[i], o[x]);
        }
    }
#pragma unroll
    for (int x = 0; x < 4; ++x) o[x] = row_lanes_sum(o[x]);
}

// Where a fast-path lane sits in warp tile `w` of head j: rows row0 .. row0 + RPT - 1 and
// columns col0 .. col0 + 3 of the head's state (`st`: the sequence's, NULL for none).
struct RuleLane {
    uint32_t rl, cq, row0, col0;
    bool col_ok;
    float* st;
};

template <int RPT>
MT_DEVICE RuleLane rule_lane(const Rule& a, uint32_t j, uint32_t w, uint32_t slot) {
    RuleLane L;
    const uint32_t lane = threadIdx.x & 31;
    L.rl = lane >> 2;
    L.cq = lane & 3;
    L.row0 = L.rl * RPT;
    L.col0 = w * GDN_WARP_COLS + 4 * L.cq;
    L.col_ok = L.col0 < a.dv;
    L.st = slot == GDN_NO_SLOT ? nullptr : a.state + (size_t)slot * a.stride + (size_t)j * a.dk * a.dv;
    return L;
}

// The lane's part of a head state `st` (zero for none, and past Dk or Dv) into s.
template <int RPT>
MT_DEVICE void tile_load(float (&s)[RPT][4], const Rule& a, const RuleLane& L, const float* st) {
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        float4 e = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (st && L.col_ok && L.row0 + i < a.dk)
            e = *reinterpret_cast<const float4*>(st + (size_t)(L.row0 + i) * a.dv + L.col0);
        s[i][0] = e.x; s[i][1] = e.y; s[i][2] = e.z; s[i][3] = e.w;
    }
}

// s back to the lane's part of head state `st` (which must exist; nothing past Dk or Dv).
template <int RPT>
MT_DEVICE void tile_store(float* st, const float (&s)[RPT][4], const Rule& a, const RuleLane& L) {
    if (!L.col_ok) return;
#pragma unroll
    for (int i = 0; i < RPT; ++i)
        if (L.row0 + i < a.dk)
            *reinterpret_cast<float4*>(st + (size_t)(L.row0 + i) * a.dv + L.col0) =
                make_float4(s[i][0], s[i][1], s[i][2], s[i][3]);
}

// The fast path's rows first .. end-1 of head j on a lane's tile `s`, the outputs stored. PER_ROW
// (verify): the tile after each row goes to the row's slot.
template <int RPT, bool PER_ROW>
MT_DEVICE void rule_rows(float (&s)[RPT][4], const Rule& a, const RuleLane& L, uint32_t j, uint32_t first,
                         uint32_t end) {
    const size_t vd = (size_t)a.hv * a.dv;
    for (uint32_t r = first; r < end; ++r) {
        RuleTok<RPT> cur;
        load_tok<RPT>(cur, a, r, j, L.row0, L.col0);
        float o[4];
        rule_token<RPT>(s, cur, o);
        if (L.rl == 0 && L.col_ok)
            *reinterpret_cast<float4*>(a.out + (size_t)r * vd + (size_t)j * a.dv + L.col0) =
                make_float4(o[0], o[1], o[2], o[3]);
        if (PER_ROW) {
            float* kept = row_state(a, r, j);
            if (kept) tile_store<RPT>(kept, s, a, L);
        }
    }
}

// The fast path: warp tile `w` (columns 16w .. 16w+15) of head j of a sequence with `slot`, over
// rows first .. end-1. See the header. PER_ROW (verify): the tile after each row goes to the
// row's slot, and the sequence's slot is not written back.
template <int RPT, bool PER_ROW>
MT_DEVICE void rule_warp(const Rule& a, uint32_t j, uint32_t w, uint32_t slot, uint32_t first,
                         uint32_t end) {
    const RuleLane L = rule_lane<RPT>(a, j, w, slot);
    float s[RPT][4];
    tile_load<RPT>(s, a, L, L.st);
    rule_rows<RPT, PER_ROW>(s, a, L, j, first, end);
    if (!PER_ROW && L.st && first < end) tile_store<RPT>(L.st, s, a, L);
}

// The prefill ring: the chunked kernel's fast path streams each token's inputs (q̂ and k̂ of the
// head's key head, the tile's 16 v columns, β and g) into a per-warp ring of GDN_RING tokens in
// shared memory, GDN_RING - 1 tokens ahead, so the loads of a token are in flight for several
// tokens' arithmetic (loading one token ahead in registers leaves most of their latency
// exposed). The arithmetic is rule_token's, so the bits are the register path's.

// What one lane copies of every token, fixed for the warp's (head, tile): up to two 16-byte
// vectors of q̂ / k̂ and one 4-byte piece (two v columns, or β or g), as token-0 sources and
// per-token strides, so queueing a token is a few adds.
struct RingLane {
    const unsigned char* qk0[2];  // NULL: no vector
    uint32_t qk_dst[2];
    const unsigned char* x0;  // NULL: no piece
    uint32_t x_dst, x_bytes;  // x_bytes 0: zero-fill (a v column past Dv)
    size_t qk_step, x_step;   // bytes per token
};

MT_DEVICE RingLane ring_lane(const Rule& a, uint32_t j, uint32_t w, uint32_t lane) {
    RingLane L;
    const uint32_t kd = a.hk * a.dk, cd = 2 * kd + a.hv * a.dv;
    const uint32_t kh = j / (a.hv / a.hk);
    const float* q0 = a.qk + (size_t)kh * a.dk;
    const uint32_t vecs = a.dk / 4;  // float4 of q̂ (then as many of k̂)
#pragma unroll
    for (uint32_t n = 0; n < 2; ++n) {
        const uint32_t i = lane + 32 * n;
        const bool is_k = i >= vecs, any = i < 2 * vecs;
        const uint32_t e = (is_k ? i - vecs : i) * 4;
        L.qk0[n] = any ? reinterpret_cast<const unsigned char*>((is_k ? q0 + kd : q0) + e) : nullptr;
        L.qk_dst[n] = (is_k ? GDN_FAST_MAX_DK * 4 : 0) + e * 4;
    }
    L.qk_step = (size_t)2 * kd * 4;
    L.x0 = nullptr;
    L.x_dst = 0;
    L.x_bytes = 4;
    L.x_step = 0;
    if (lane < 8) {  // v columns 16w + 2 lane, + 1 (Dv % 4 == 0: both or neither exist)
        const uint32_t col = w * GDN_WARP_COLS + 2 * lane;
        L.x_dst = 2 * GDN_FAST_MAX_DK * 4 + 4 * lane;
        if (col < a.dv) {
            L.x0 = reinterpret_cast<const unsigned char*>(a.conv + 2 * kd + (size_t)j * a.dv + col);
            L.x_step = (size_t)cd * 2;
        } else {
            L.x0 = reinterpret_cast<const unsigned char*>(a.conv);
            L.x_bytes = 0;
        }
    } else if (lane < 10) {  // β, g
        L.x0 = reinterpret_cast<const unsigned char*>(a.gates + (lane - 8) * a.hv + j);
        L.x_dst = 2 * GDN_FAST_MAX_DK * 4 + 32 + 4 * (lane - 8);
        L.x_step = (size_t)2 * a.hv * 4;
    }
    return L;
}

// Queue token r's inputs into `tok` (this lane's share; the caller commits the group).
MT_DEVICE void ring_issue(unsigned char* tok, const RingLane& L, uint32_t r) {
#pragma unroll
    for (int n = 0; n < 2; ++n)
        if (L.qk0[n]) cp_async16(tok + L.qk_dst[n], L.qk0[n] + r * L.qk_step, 16u);
    if (L.x0) cp_async_ca<4>((uint32_t)__cvta_generic_to_shared(tok + L.x_dst), L.x0 + r * L.x_step, L.x_bytes);
}

template <int RPT>
MT_DEVICE void ring_read(RuleTok<RPT>& t, const unsigned char* tok, uint32_t row0, uint32_t cq) {
    const float* q = reinterpret_cast<const float*>(tok);
    const float* k = q + GDN_FAST_MAX_DK;
#pragma unroll
    for (int m = 0; m < RPT / 4; ++m) {
        const float4 qv = *reinterpret_cast<const float4*>(q + row0 + 4 * m);
        const float4 kv = *reinterpret_cast<const float4*>(k + row0 + 4 * m);
        t.q[4 * m] = qv.x; t.q[4 * m + 1] = qv.y; t.q[4 * m + 2] = qv.z; t.q[4 * m + 3] = qv.w;
        t.k[4 * m] = kv.x; t.k[4 * m + 1] = kv.y; t.k[4 * m + 2] = kv.z; t.k[4 * m + 3] = kv.w;
    }
    const bf16* v = reinterpret_cast<const bf16*>(tok + 2 * GDN_FAST_MAX_DK * 4) + 4 * cq;
#pragma unroll
    for (int x = 0; x < 4; ++x) t.v[x] = bf2f(v[x]);
    const float* gb = reinterpret_cast<const float*>(tok + 2 * GDN_FAST_MAX_DK * 4 + 32);
    t.beta = gb[0];
    t.g = gb[1];
}

// rule_warp<RPT, false> through the ring at `ring` (this warp's GDN_RING tokens).
template <int RPT>
MT_DEVICE void rule_warp_ring(const Rule& a, uint32_t j, uint32_t w, uint32_t slot, uint32_t first,
                              uint32_t end, unsigned char* ring) {
    const uint32_t lane = threadIdx.x & 31;
    const RuleLane L = rule_lane<RPT>(a, j, w, slot);
    // q̂ and k̂ rows past Dk (up to 8 RPT) read as zero: they are never copied.
    for (uint32_t i = lane; i < GDN_RING * GDN_TOK_BYTES / 16; i += 32)
        reinterpret_cast<uint4*>(ring)[i] = make_uint4(0, 0, 0, 0);
    __syncwarp();
    float s[RPT][4];
    tile_load<RPT>(s, a, L, L.st);
    const size_t vd = (size_t)a.hv * a.dv;
    const RingLane src = ring_lane(a, j, w, lane);
#pragma unroll
    for (uint32_t p = 0; p < GDN_RING - 1; ++p) {
        if (first + p < end) ring_issue(ring + p * GDN_TOK_BYTES, src, first + p);
        cp_async_commit();
    }
    for (uint32_t r = first; r < end; ++r) {
        cp_async_wait<GDN_RING - 2>();
        __syncwarp();  // token r is in for every lane; every lane is done with token r - 1
        RuleTok<RPT> cur;
        ring_read<RPT>(cur, ring + ((r - first) % GDN_RING) * GDN_TOK_BYTES, L.row0, L.cq);
        float o[4];
        rule_token<RPT>(s, cur, o);
        // Token r + GDN_RING - 1 goes to token r - 1's slot, after the arithmetic it may overlap.
        const uint32_t ahead = r + GDN_RING - 1;
        if (ahead < end) ring_issue(ring + ((ahead - first) % GDN_RING) * GDN_TOK_BYTES, src, ahead);
        cp_async_commit();
        if (L.rl == 0 && L.col_ok)
            *reinterpret_cast<float4*>(a.out + (size_t)r * vd + (size_t)j * a.dv + L.col0) =
                make_float4(o[0], o[1], o[2], o[3]);
    }
    cp_async_wait<0>();
    if (L.st && first < end) tile_store<RPT>(L.st, s, a, L);
}

// Whether the fast (warp-tile) path runs: see the header.
MT_DEVICE bool rule_fast(const Rule& a) {
    return a.dk <= GDN_FAST_MAX_DK && a.dk % 4 == 0 && a.dv % 4 == 0 && a.stride % 4 == 0 && aligned16(a.state) &&
           aligned16(a.qk) && aligned16(a.out);
}

// The general path: column d of head j, its Dk state entries in a local array. PER_ROW as in
// rule_warp.
template <bool PER_ROW>
MT_DEVICE void rule_column(const Rule& a, uint32_t j, uint32_t d, uint32_t slot, uint32_t first,
                           uint32_t end) {
    float col[GDN_MAX_DK];
    const uint32_t dk = a.dk, dv = a.dv, kd = a.hk * a.dk, cd = 2 * kd + a.hv * a.dv;
    const uint32_t kh = j / (a.hv / a.hk);
    const size_t vd = (size_t)a.hv * dv;
    float* st = slot == GDN_NO_SLOT
                    ? nullptr
                    : a.state + (size_t)slot * a.stride + (size_t)j * dk * dv + d;
    for (uint32_t c = 0; c < dk; ++c) col[c] = st ? st[(size_t)c * dv] : 0.0f;
    for (uint32_t r = first; r < end; ++r) {
        const float* q = a.qk + (size_t)r * 2 * kd + (size_t)kh * dk;
        const float* k = q + kd;
        const float v = bf2f(a.conv[(size_t)r * cd + 2 * kd + (size_t)j * dv + d]);
        const float beta = a.gates[(size_t)r * 2 * a.hv + j];
        const float decay = expf(a.gates[(size_t)r * 2 * a.hv + a.hv + j]);
        float kv = 0.0f;
        for (uint32_t c = 0; c < dk; ++c) {
            col[c] = __fmul_rn(col[c], decay);
            kv = fmaf(col[c], k[c], kv);
        }
        const float delta = __fmul_rn(v - kv, beta);
        float o = 0.0f;
        for (uint32_t c = 0; c < dk; ++c) {
            col[c] = fmaf(k[c], delta, col[c]);
            o = fmaf(col[c], q[c], o);
        }
        a.out[(size_t)r * vd + (size_t)j * dv + d] = o;
        if (PER_ROW) {
            float* kept = row_state(a, r, j);
            if (kept)
                for (uint32_t c = 0; c < dk; ++c) kept[(size_t)c * dv + d] = col[c];
        }
    }
    if (!PER_ROW && st && first < end)
        for (uint32_t c = 0; c < dk; ++c) st[(size_t)c * dv] = col[c];
}

// The rows first .. end-1 of a sequence's value head j, columns of group `grp` (this block's
// warps' tiles), on a sequence with `slot` (checked here). RING: stream the rows through the
// prefill ring when the launch gave every warp one (the chunked kernel); otherwise each row is
// loaded when it is needed. The arithmetic is the same either way. PER_ROW: a verify step (see
// rule_warp).
template <bool RING, bool PER_ROW>
MT_DEVICE void rule_head(const Rule& a, uint32_t j, uint32_t grp, uint32_t slot, uint32_t first, uint32_t end) {
    const uint32_t wb = blockDim.x >> 5, warp = threadIdx.x >> 5;
    const uint32_t col_lo = grp * wb * GDN_WARP_COLS;
    const uint32_t col_hi = min(a.dv, col_lo + wb * GDN_WARP_COLS);
    const size_t vd = (size_t)a.hv * a.dv;
    if ((slot != GDN_NO_SLOT && slot >= a.num_slots) || a.dk > GDN_MAX_DK) {
        mt_fault(a.kernel, a.dk > GDN_MAX_DK ? MT_FAULT_SHAPE : MT_FAULT_INDEX);
        for (uint32_t r = first; r < end; ++r)
            for (uint32_t d = col_lo + threadIdx.x; d < col_hi; d += blockDim.x)
                a.out[(size_t)r * vd + (size_t)j * a.dv + d] = f32_nan();
        return;
    }
    if (!rule_fast(a)) {
        for (uint32_t d = col_lo + threadIdx.x; d < col_hi; d += blockDim.x)
            rule_column<PER_ROW>(a, j, d, slot, first, end);
        return;
    }
    const uint32_t w = grp * wb + warp;
    if (w * GDN_WARP_COLS >= a.dv) return;
    if (RING) {  // the ring, when the launch gave every warp one
        extern __shared__ __align__(16) unsigned char gdn_ring[];
        if (dynamic_smem_bytes() >= wb * GDN_RING * GDN_TOK_BYTES && (reinterpret_cast<uintptr_t>(a.conv) & 3) == 0) {
            unsigned char* ring = gdn_ring + warp * GDN_RING * GDN_TOK_BYTES;
            if (a.dk <= 32)
                rule_warp_ring<4>(a, j, w, slot, first, end, ring);
            else if (a.dk <= 64)
                rule_warp_ring<8>(a, j, w, slot, first, end, ring);
            else
                rule_warp_ring<16>(a, j, w, slot, first, end, ring);
            return;
        }
    }
    if (a.dk <= 32) {
        rule_warp<4, PER_ROW>(a, j, w, slot, first, end);
    } else if (a.dk <= 64) {
        rule_warp<8, PER_ROW>(a, j, w, slot, first, end);
    } else {
        rule_warp<16, PER_ROW>(a, j, w, slot, first, end);
    }
}

// Sequence s's rows, clamped to the step's: first .. end-1 (none when end == first).
MT_DEVICE void seq_rows(const Rule& a, uint32_t s, uint32_t& first, uint32_t& end) {
    first = min(a.seq_start[s], a.rows);
    end = max(min(a.seq_start[s + 1], a.rows), first);
}

// One block of the rule kernels' grid: (sequence blockIdx.x, value head and column group
// blockIdx.y).
template <bool RING, bool PER_ROW>
MT_DEVICE void rule_block(const Rule& a) {
    const uint32_t s = blockIdx.x;
    if (s >= a.num_seqs) return;
    if (a.hk == 0 || a.hv == 0 || a.hv % a.hk != 0) {
        mt_fault(a.kernel, MT_FAULT_SHAPE);
        return;
    }
    const uint32_t groups = max(gridDim.y / a.hv, 1u);
    const uint32_t j = blockIdx.y / groups, grp = blockIdx.y % groups;
    if (j >= a.hv) return;
    uint32_t first, end;
    seq_rows(a, s, first, end);
    rule_head<RING, PER_ROW>(a, j, grp, a.seq_slot[s], first, end);
}

// The streamed decode kernel (gated_delta_streamed): persistent blocks of ceil(Dv / 16) warps,
// block b taking the (sequence, value head) items b, b + gridDim.x, ... (item i is sequence
// i / Hv, head i % Hv). A head's whole state (Dk x Dv f32, contiguous) comes into shared memory
// by one bulk copy, `bufs` items ahead, so the state streams from memory in 64 KiB pieces
// (Qwen3.5 heads) while earlier items compute; each warp then takes its fast-path tile from the
// copy (the lane layout and arithmetic of rule_warp, so every bit is gated_delta_recurrent's)
// and writes the new state straight back to the slot. Shared memory: GDN_STREAM_BARS bytes of
// mbarriers, then `bufs` head buffers.

// Head buffers a launch with `dyn` bytes of dynamic shared memory holds for heads of `head_bytes`.
MT_DEVICE uint32_t stream_bufs(uint32_t dyn, uint32_t head_bytes) {
    if (dyn < GDN_STREAM_BARS + head_bytes) return 0;
    return min((dyn - GDN_STREAM_BARS) / head_bytes, (uint32_t)GDN_STREAM_MAX_BUFS);
}

// Whether item `it`'s state is read from its slot: a real slot in the pool, and rows to run.
MT_DEVICE bool stream_loads(const Rule& a, uint32_t it) {
    const uint32_t s = it / a.hv, slot = a.seq_slot[s];
    uint32_t first, end;
    seq_rows(a, s, first, end);
    return slot != GDN_NO_SLOT && slot < a.num_slots && first < end;
}

// Queue item `it`'s head state into buffer `buf`, completing barrier `bar`'s phase (at once when
// the item reads none). One thread.
MT_DEVICE void stream_issue(const Rule& a, uint32_t it, uint32_t buf, uint32_t bar, uint32_t head_bytes) {
    const bool load = stream_loads(a, it);
    mbar_expect_tx(bar, load ? head_bytes : 0);
    if (load) {
        const uint32_t s = it / a.hv, j = it % a.hv;
        bulk_g2s(buf, a.state + (size_t)a.seq_slot[s] * a.stride + (size_t)j * a.dk * a.dv, head_bytes, bar);
    }
}

template <int RPT>
MT_DEVICE void rule_streamed(const Rule& a, unsigned char* smem, uint32_t bufs, uint32_t head_bytes) {
    const uint32_t items = a.num_seqs * a.hv, warp = threadIdx.x >> 5;
    const uint32_t bar0 = (uint32_t)__cvta_generic_to_shared(smem);
    unsigned char* buf0 = smem + GDN_STREAM_BARS;
    const uint32_t buf0_s = bar0 + GDN_STREAM_BARS;
    if (threadIdx.x == 0) {
        for (uint32_t b = 0; b < bufs; ++b) mbar_init(bar0 + 8 * b, 1);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        for (uint32_t b = 0; b < bufs; ++b) {
            const uint32_t it = blockIdx.x + b * gridDim.x;
            if (it < items) stream_issue(a, it, buf0_s + b * head_bytes, bar0 + 8 * b, head_bytes);
        }
    }
    __syncthreads();
    const size_t vd = (size_t)a.hv * a.dv;
    uint32_t k = 0;
    for (uint32_t it = blockIdx.x; it < items; it += gridDim.x, ++k) {
        const uint32_t b = k % bufs, s = it / a.hv, j = it % a.hv, slot = a.seq_slot[s];
        uint32_t first, end;
        seq_rows(a, s, first, end);
        const bool loads = stream_loads(a, it);
        const RuleLane L = rule_lane<RPT>(a, j, warp, slot);
        float st[RPT][4];
        mbar_wait(bar0 + 8 * b, (k / bufs) & 1);
        tile_load<RPT>(st, a, L, loads ? reinterpret_cast<const float*>(buf0 + b * head_bytes) : nullptr);
        __syncthreads();  // every warp has its tile: the buffer takes the item `bufs` ahead
        const uint32_t next = it + bufs * gridDim.x;
        if (threadIdx.x == 0 && next < items) {
            fence_async_smem();  // the reads above, before the copy's writes
            stream_issue(a, next, buf0_s + b * head_bytes, bar0 + 8 * b, head_bytes);
        }
        if (slot != GDN_NO_SLOT && slot >= a.num_slots) {
            mt_fault(a.kernel, MT_FAULT_INDEX);
            for (uint32_t r = first; r < end; ++r)
                for (uint32_t d = threadIdx.x; d < a.dv; d += blockDim.x)
                    a.out[(size_t)r * vd + (size_t)j * a.dv + d] = f32_nan();
            continue;
        }
        rule_rows<RPT, false>(st, a, L, j, first, end);
        if (loads) tile_store<RPT>(L.st, st, a, L);
    }
}
