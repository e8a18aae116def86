// The building blocks of the decode attention kernels (`paged_attention`,
// `paged_attention_flat`; kernels/attention.cu has the design and the numerics): the items'
// records, the copies of queries, keys and values into each warp's ring, one unit's MMAs and
// softmax, the warp, block and cluster combines and the output. Included by attention.cu only,
// after attention_unit.cuh.
#pragma once

// Dynamic shared memory of both decode kernels: every warp's ring of ATT_STAGES stages, each a
// unit's 16 key rows and 16 value rows of dp + 8 bf16 (the 16-byte pad puts the 8 rows of every
// ldmatrix in distinct banks), then its ATT_QSLOTS query slots of ATT_HB rows; then the warps'
// f32 partials [ATT_WARPS][hb][dp] and the kernel's own, `partials` of [hb][dp]
// (paged_attention: 2, by item parity; paged_attention_flat: one per split). The launcher
// computes the same.
MT_DEVICE uint32_t att_dyn_bytes(uint32_t dp, uint32_t hb, uint32_t partials) {
    return ATT_WARPS * (ATT_STAGES * 2u * ATT_UNIT + ATT_QSLOTS * ATT_HB) * (dp + 8u) * 2u +
           (ATT_WARPS + partials) * hb * dp * 4u;
}

// The sequence and context (positions[row] + 1) of decode row `row`, both 0 when its inputs are
// out of range (a sequence past the block tables, a context longer than max_blocks).
MT_DEVICE void att_row_context(const uint32_t* row_seq, const uint32_t* positions, uint32_t row, uint32_t num_seqs,
                               uint32_t block_size, uint32_t max_blocks, uint32_t& seq, uint32_t& ctx) {
    seq = row_seq[row];
    ctx = positions[row] + 1;
    const bool ok = seq < num_seqs && ctx != 0 && (ctx + block_size - 1) / block_size <= max_blocks;
    seq = ok ? seq : 0;
    ctx = ok ? ctx : 0;
}

// Whether a decode launch takes the plain path (its bodies instantiated with PLAIN = true): pools
// copied 16 bytes a chunk, every unit inside one block of a power-of-two size (the usual 16-token
// blocks). Known at compile time, the unit copies and table reads lose the branches the
// other layouts need (a decode warp's unit is a chain of dependent instructions: every one adds).
MT_DEVICE bool att_plain(const AttLaunch& a) { return a.vec && a.unit_blocks && a.bs_shift < 32; }

// A compile-time flag for att_by_body's bodies.
template <bool B>
struct AttFlag {
    static constexpr bool value = B;
};

// The decode kernels' choice of body: run(dim, fp8, plain), each a compile-time tag (AttDim,
// AttFlag): bf16 or FP8 pools, on the plain path (att_plain) or in another layout.
template <typename F>
MT_DEVICE void att_by_body(uint32_t dp, const AttLaunch& a, uint32_t kv_fp8, F&& run) {
    att_by_dim(dp, [&](auto dim) {
        if (kv_fp8 != 0 && att_plain(a))
            run(dim, AttFlag<true>(), AttFlag<true>());
        else if (kv_fp8 != 0)
            run(dim, AttFlag<true>(), AttFlag<false>());
        else if (att_plain(a))
            run(dim, AttFlag<false>(), AttFlag<true>());
        else
            run(dim, AttFlag<false>(), AttFlag<false>());
    });
}

// Item k of this cluster, as the launch's first barrier leaves it in shared memory: (row, group
// of hb query heads) number cluster + k * n_clusters, its key/value head's offset in a slot, the
// row's sequence and context (0: out of range), and the units [ub, ue) of this block's split.
struct __align__(16) AttItemRec {
    uint32_t row, h0, kv, seq, ctx, ub, ue, pad;
};

// Item k as warp `warp` sees it: the record and the units of it the warp takes.
struct AttItem {
    uint32_t row, h0, kv, seq, ctx, first, mine;
};

MT_DEVICE AttItem att_item(const AttItemRec* recs, uint32_t k, uint32_t warp) {
    const AttItemRec r = recs[k];
    AttItem it;
    it.row = r.row;
    it.h0 = r.h0;
    it.kv = r.kv;
    it.seq = r.seq;
    it.ctx = r.ctx;
    att_part_units(r.ub, r.ue, warp, it.first, it.mine);
    return it;
}

// Copy the hb query rows of item `it` into query slot `qs` (rows hb..7 stay zero; cp.async on
// the vector path, plain loads otherwise).
template <int DP>
MT_DEVICE void att_issue_queries(const AttLaunch& a, const AttItem& it, bf16* qs, uint32_t lane) {
    constexpr int RS = DP + 8, NCH = DP / 8;
    const bf16* q = a.qkv + (size_t)it.row * a.row_stride + (size_t)it.h0 * a.q_head_stride;
    if (a.vec) {
#pragma unroll
        for (uint32_t i = 0; i < (ATT_HB * NCH + 31) / 32; ++i) {
            const uint32_t idx = lane + 32 * i, h = idx / NCH, ch = idx % NCH;
            if (h < a.hb && 8 * ch < a.d)
                cp_async16(qs + h * RS + 8 * ch, q + (size_t)h * a.q_head_stride + 8 * ch, 16u);
        }
    } else {
        for (uint32_t idx = lane; idx < a.hb * DP; idx += 32) {
            const uint32_t h = idx / DP, e = idx % DP;
            qs[h * RS + e] = e < a.d ? q[(size_t)h * a.q_head_stride + e] : __ushort_as_bfloat16((unsigned short)0);
        }
    }
}

// Which of a unit's rows a copy moves: its keys, its values, or both.
#define ATT_K 1u
#define ATT_V 2u
#define ATT_KV 3u

// Where a pool row's 16-byte chunk at element `col` lands in a stage (the last argument's type
// picks the pool's element): bf16 rows in place, FP8 (e4m3) rows' bytes at the top of their ring
// row (att_fp8_row), where the widening finds them.
template <int DP>
MT_DEVICE bf16* att_ring_at(bf16* rows, uint32_t row, uint32_t col, const bf16*) {
    return rows + row * (DP + 8) + col;
}
template <int DP>
MT_DEVICE unsigned char* att_ring_at(bf16* rows, uint32_t row, uint32_t col, const uint8_t*) {
    return att_fp8_row<DP>(rows, row) + col;
}

// att_copy_unit's copy for one warp (a unit inside one block, the vector path) from a pool of
// elements T (bf16, or FP8 bytes), each lane on fixed 16-byte chunks of a few rows: L = min(16,
// chunks a row) lanes to a row, so a warp-wide copy reads 32 / L rows of 16 L contiguous bytes (a
// whole bf16 row up to head_dim 128, an FP8 one up to 256), and a lane's chunks of one row sit at
// offsets the compiler knows (the row stride, num_kv_heads * head_dim elements, is a launch
// argument: stepping it costs two 64-bit adds, once per row group instead of once per chunk).
// `parts` picks the keys, the values or both; an inactive copy (a warp past its last unit)
// moves nothing, so the caller need not branch around it.
// The copies are evicted from L2 first (a decode step reads each key once). Returns whether a
// slot is past the pool (uniform).
template <int DP, bool PLAIN, typename T>
MT_DEVICE bool att_copy_rows(const AttLaunch& a, const T* kb, const T* vb, uint32_t unit, uint32_t ctx,
                             uint32_t entry, uint32_t lane, bf16* ks, bf16* vs, uint32_t parts, bool active) {
    constexpr uint32_t EPC = 16 / sizeof(T);  // elements a 16-byte chunk
    constexpr uint32_t NCH = DP / EPC, L = NCH < 16 ? NCH : 16, RPI = 32 / L, H = NCH / L;
    uint64_t base;
    uint32_t live;
    const bool bad = att_unit_span<PLAIN>(a, unit, ctx, entry, base, live) && active;
    if (!active) live = 0;
    const uint32_t r0 = lane / L, c0 = lane % L;
    const size_t off0 = (size_t)(base + r0) * a.width + EPC * c0, step = (size_t)RPI * a.width;
    const T* kp = kb + off0;
    const T* vp = vb + off0;
    const uint64_t policy = l2_evict_first_policy();
#pragma unroll
    for (uint32_t rg = 0; rg < ATT_UNIT / RPI; ++rg) {
        const uint32_t row = rg * RPI + r0;
        const bool on = row < live;
#pragma unroll
        for (uint32_t h = 0; h < H; ++h) {
            const uint32_t col = EPC * (c0 + L * h);
            const uint32_t bytes = on && col < a.d ? 16u : 0u;
            if (parts & ATT_K) cp_async16_hint(att_ring_at<DP>(ks, row, col, kp), kp + L * EPC * h, bytes, policy);
            if (parts & ATT_V) cp_async16_hint(att_ring_at<DP>(vs, row, col, vp), vp + L * EPC * h, bytes, policy);
        }
        kp += step;
        vp += step;
    }
    return bad;
}

// A pool's element on the device: bf16, or the e4m3 bytes of an FP8 pool.
template <bool FP8>
struct AttPoolElem {
    using T = bf16;
};
template <>
struct AttPoolElem<true> {
    using T = uint8_t;
};

// Copy the keys and values of unit `unit` of item `it` (its 16 tokens) into `stage`: where the
// unit lies inside one block on the vector path, att_copy_rows (FP8 pools' bytes to the rows'
// tops); otherwise a slot per token, cp.async on the vector path (att_fp8_copy for FP8 pools)
// and plain loads otherwise. Dead tokens and padded dimensions become zeros.
// `parts` and `active` (att_copy_rows's): only the plain path asks for less than a whole, active
// unit; the other copies ignore them.
// Returns whether a slot was past the pool (uniform).
template <int DP, bool FP8, bool PLAIN>
MT_DEVICE bool att_issue(const AttLaunch& a, const AttItem& it, uint32_t unit, uint32_t entry,
                         bf16* stage, uint32_t lane, uint32_t parts, bool active) {
    using T = typename AttPoolElem<FP8>::T;
    constexpr int RS = DP + 8, NCH = DP / 8;
    bf16* ks = stage;
    bf16* vs = ks + ATT_UNIT * RS;
    const T* kb = reinterpret_cast<const T*>(a.k_cache) + it.kv;
    const T* vb = reinterpret_cast<const T*>(a.v_cache) + it.kv;
    if (PLAIN || (a.vec && a.unit_blocks))
        return att_copy_rows<DP, PLAIN>(a, kb, vb, unit, it.ctx, entry, lane, ks, vs, parts, active);
    if constexpr (FP8) {
        uint32_t slot, live;
        const bool bad = att_fp8_slots(a, unit, it.ctx, entry, lane, slot, live);
        att_fp8_copy<DP>(a, kb, vb, slot, live, 0, ATT_UNIT, ks, vs, lane);
        return bad;
    } else {
        uint32_t slot, live;
        bool bad;
        att_slot(a, unit, it.ctx, entry, lane, slot, live, bad);
        if (a.vec) {
#pragma unroll
            for (int i = 0; i < ATT_UNIT * NCH / 32; ++i) {
                const uint32_t idx = lane + 32 * i, tok = idx / NCH, ch = idx % NCH;
                const uint32_t s = __shfl_sync(0xffffffffu, slot, tok);
                const bool on = __shfl_sync(0xffffffffu, live, tok) != 0 && 8 * ch < a.d;
                const size_t off = on ? (size_t)s * a.width + 8 * ch : 0;
                cp_async16(ks + tok * RS + 8 * ch, kb + off, on ? 16u : 0u);
                cp_async16(vs + tok * RS + 8 * ch, vb + off, on ? 16u : 0u);
            }
        } else {
#pragma unroll 1
            for (int i = 0; i < ATT_UNIT * DP / 32; ++i) {
                const uint32_t idx = lane + 32 * i, tok = idx / DP, e = idx % DP;
                const uint32_t s = __shfl_sync(0xffffffffu, slot, tok);
                const bool on = __shfl_sync(0xffffffffu, live, tok) != 0 && e < a.d;
                const size_t off = (size_t)s * a.width + e;
                ks[tok * RS + e] = on ? kb[off] : __ushort_as_bfloat16((unsigned short)0);
                vs[tok * RS + e] = on ? vb[off] : __ushort_as_bfloat16((unsigned short)0);
            }
        }
        return __any_sync(0xffffffffu, bad);
    }
}

// One unit of a warp (its keys and values in `stage`, the item's queries in slot `qslot`), with
// every tile transposed so no MMA carries zero rows: scores Sᵀ = K Qᵀ (tokens x heads), the
// online softmax of heads 2c and 2c + 1 (m, l: lane (g, c) holds their maxima, and their
// partial sums over tokens 2(g / 2), +1, +8, +9), and Oᵀ += Vᵀ Pᵀ into `o` (o[t] holds dims
// 16 t + g and 16 t + g + 8 of heads 2c and 2c + 1). Each score, probability, partial sum and
// output is computed by the same operations on the same operands, in the same order, as
// att_softmax_row's layout computes it (paged_attention_prefill uses that one), so the two
// kernels stay bitwise equal; only which lane holds what differs. `mid` runs once the scores are
// in, when the stage's key rows are no longer read.
template <int DP, typename Mid>
MT_DEVICE void att_unit(const bf16* stage, const bf16* qslot, uint32_t unit, uint32_t ctx, float scale_log2,
                        bool first, uint32_t lane, float (&o)[DP / 16][4], float (&m)[2], float (&l)[2], Mid&& mid) {
    constexpr int RS = DP + 8;
    const uint32_t g = lane >> 2, mat = lane >> 3, row = lane & 7;
    const uint32_t qs = (uint32_t)__cvta_generic_to_shared(qslot);
    const uint32_t ks = (uint32_t)__cvta_generic_to_shared(stage);
    const uint32_t vs = ks + ATT_UNIT * RS * 2;

    // Sᵀ = K Qᵀ, a k step of 16 dims at a time. A: key matrices (tokens 0-7 | 8-15) x (dims 0-7
    // | 8-15 of the step); B: query matrices heads 0-7 x dims 8 mat.. of a 32-dim pair of steps.
    // Two accumulation chains (even and odd k steps), added at the end. s[chain]: tokens g
    // (0, 1) and g + 8 (2, 3) of heads 2c (0, 2) and 2c + 1 (1, 3).
    float s[2][4] = {};
    const uint32_t q_addr = qs + (row * RS + 8 * mat) * 2;
    const uint32_t k_addr = ks + ((row + ((mat & 1) << 3)) * RS + ((mat >> 1) << 3)) * 2;
#pragma unroll
    for (int kp = 0; kp < DP / 32; ++kp) {
        uint32_t qb[4], ka[4], kb[4];
        att_ldsm4(qb, q_addr + kp * 64);
        att_ldsm4(ka, k_addr + (2 * kp) * 32);
        att_ldsm4(kb, k_addr + (2 * kp + 1) * 32);
        att_mma16(s[0][0], s[0][1], s[0][2], s[0][3], ka[0], ka[1], ka[2], ka[3], qb[0], qb[1]);
        att_mma16(s[1][0], s[1][1], s[1][2], s[1][3], kb[0], kb[1], kb[2], kb[3], qb[2], qb[3]);
    }
    mid();  // the keys are read: the caller may refill their rows

    // The online softmax of heads 2c + j over tokens g + 8e.
    float x[2][2], mx[2], corr[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        mx[j] = -INFINITY;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t t = unit * ATT_UNIT + g + 8 * e;
            x[j][e] = t < ctx ? __fmul_rn(__fadd_rn(s[0][2 * e + j], s[1][2 * e + j]), scale_log2) : -INFINITY;
            mx[j] = fmaxf(mx[j], x[j][e]);
        }
#pragma unroll
        for (int d = 4; d < 32; d *= 2) mx[j] = fmaxf(mx[j], __shfl_xor_sync(0xffffffffu, mx[j], d));
    }
    float m_new[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        m_new[j] = fmaxf(m[j], mx[j]);  // finite: a unit holds at least one live token
        corr[j] = att_exp2(m[j] - m_new[j]);
    }
    // pt[e]: token g + 8e's probabilities of heads 2c and 2c + 1, rounded to bf16: the lane's
    // part of Pᵀ, and (with the neighbouring token, from lane g ^ 1) of each head's sum.
    uint32_t pt[2];
    float sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        pt[e] = att_pack_bf16(att_exp2(x[0][e] - m_new[0]), att_exp2(x[1][e] - m_new[1]));
        const uint32_t nb = __shfl_xor_sync(0xffffffffu, pt[e], 4);
        sum[0] = __fadd_rn(sum[0], __fadd_rn(__uint_as_float(pt[e] << 16), __uint_as_float(nb << 16)));
        sum[1] = __fadd_rn(sum[1], __fadd_rn(__uint_as_float(pt[e] & 0xFFFF0000u), __uint_as_float(nb & 0xFFFF0000u)));
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        l[j] = fmaf(l[j], corr[j], sum[j]);
        m[j] = m_new[j];
    }
    const bool rescale = att_rescale(first, corr[0] != 1.0f || corr[1] != 1.0f);

    // Oᵀ += Vᵀ Pᵀ, 16 dims a tile: A is Vᵀ through ldmatrix.trans (matrices (tokens 0-7 |
    // 8-15) x (dims 0-7 | 8-15 of the tile)); B is Pᵀ's two 8x8 halves transposed back into the
    // MMA's column layout (heads g, tokens 2c, 2c + 1 and 2c + 8, 2c + 9).
    const uint32_t pb0 = att_transpose8(pt[0]), pb1 = att_transpose8(pt[1]);
    const uint32_t v_addr = vs + ((row + ((mat >> 1) << 3)) * RS + ((mat & 1) << 3)) * 2;
#pragma unroll
    for (int t = 0; t < DP / 16; ++t) {
        uint32_t va[4];
        att_ldsm4_t(va, v_addr + t * 32);
        if (rescale) {
            o[t][0] *= corr[0];
            o[t][1] *= corr[1];
            o[t][2] *= corr[0];
            o[t][3] *= corr[1];
        }
        att_mma16(o[t][0], o[t][1], o[t][2], o[t][3], va[0], va[1], va[2], va[3], pb0, pb1);
    }
}

// A launch a decode kernel cannot run: after the wait for the kernel ahead, NaN for this
// block's share of its items' outputs, block `part` of the `parts` that write each item.
MT_DEVICE void att_nan_items(const AttLaunch& a, uint32_t part, uint32_t parts) {
    pdl_wait();
    pdl_trigger();
    if (a.hq == 0) return;
    for (uint32_t k = 0; k < a.nk; ++k) {
        uint32_t row, h0, kv;
        att_item_at(a, k, row, h0, kv);
        bf16* o = a.out + ((size_t)row * a.hq + h0) * a.d;
        for (uint32_t i = part * ATT_THREADS + threadIdx.x; i < a.hb * a.d; i += parts * ATT_THREADS)
            o[i] = bf16_nan();
    }
}

// Output `e` of query head `h` of row `row` from its splits' maxima `ms`, sums `ls` and
// numerators `ps`, folded in split order (the last step of both decode kernels).
MT_DEVICE bf16 att_combine_splits(const AttLaunch& a, uint32_t row, uint32_t h, uint32_t e,
                                  const float (&ms)[ATT_SPLITS], const float (&ls)[ATT_SPLITS],
                                  const float (&ps)[ATT_SPLITS]) {
    float wt[ATT_SPLITS], wp[ATT_SPLITS], den;
    att_fold_all(ms, ls, wt, wp, den);
    const size_t gate_off = (size_t)row * a.row_stride + (size_t)h * a.q_head_stride + a.d + e;
    return att_finish(wt, wp, ps, den, a.gated ? a.qkv + gate_off : nullptr);
}

// A warp's partial of an item's split after its units (outputs `o`, per-head maxima `m` and the
// lanes' partial sums `l`, as att_unit leaves them) into the block's buffers: its outputs into
// `ow` [ATT_WARPS][hb][DP], its maxima and sums (each head's four partial sums added in
// att_softmax_row's order) into `wm`, `wl`.
template <int DP>
MT_DEVICE void att_warp_partial(const AttLaunch& a, const float (&o)[DP / 16][4], const float (&m)[2], float (&l)[2],
                                float* ow, float (&wm)[ATT_WARPS][ATT_HB], float (&wl)[ATT_WARPS][ATT_HB],
                                uint32_t warp, uint32_t lane) {
    const uint32_t g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 8);
        l[j] += __shfl_xor_sync(0xffffffffu, l[j], 16);
    }
#pragma unroll
    for (uint32_t j = 0; j < 2; ++j) {
        const uint32_t h = 2 * c + j;
        if (h < a.hb) {
            float* w = ow + (warp * a.hb + h) * DP + g;
#pragma unroll
            for (int t = 0; t < DP / 16; ++t) {
                w[16 * t] = o[t][j];
                w[16 * t + 8] = o[t][2 + j];
            }
        }
    }
#pragma unroll
    for (uint32_t j = 0; j < 2; ++j)
        if (g == 0 && 2 * c + j < a.hb) {
            wm[warp][2 * c + j] = m[j];
            wl[warp][2 * c + j] = l[j];
        }
}

// The block's fold of its warps' chains of one split, in chain (warp) order (after a barrier
// that follows every warp's att_warp_partial): the numerators into `pk` [hb][DP], each head's
// maximum and sum into `cm`, `cl` (a NaN sum when a slot was past the pool). Warp w takes heads
// w, w + ATT_WARPS, ...: each lane works out a head's weights once and applies them to its DP / 32
// dimensions (weights worked out per output cost a third of the flat kernel's time).
template <int DP>
MT_DEVICE void att_block_combine(const AttLaunch& a, const float* ow, const float (&wm)[ATT_WARPS][ATT_HB],
                                 const float (&wl)[ATT_WARPS][ATT_HB], bool bad, float* pk, float* cm, float* cl) {
    const uint32_t lane = threadIdx.x & 31;
    for (uint32_t h = threadIdx.x >> 5; h < a.hb; h += ATT_WARPS) {
        float ms[ATT_WARPS], ls[ATT_WARPS], wt[ATT_WARPS], wp[ATT_WARPS], den;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            ms[w] = wm[w][h];
            ls[w] = wl[w][h];
        }
        const float mx = att_fold_all(ms, ls, wt, wp, den);
#pragma unroll
        for (uint32_t e = lane; e < DP; e += 32) {
            float num = 0.0f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) num = att_fold(num, ow[(w * a.hb + h) * DP + e], wt[w], wp[w]);
            pk[h * DP + e] = num;
        }
        if (lane == 0) {
            cm[h] = mx;
            cl[h] = bad ? __int_as_float(0x7FFFFFFF) : den;
        }
    }
}

// Block-level shared state beside the dynamic buffers.
struct AttShared {
    float wm[ATT_WARPS][ATT_HB], wl[ATT_WARPS][ATT_HB];  // each warp's max and sum per head
    float cm[2][ATT_HB], cl[2][ATT_HB];  // the block's, by item parity (read by the cluster)
    AttItemRec item[ATT_MAX_ITEMS];
    int bad[2];  // a slot past the pool was seen, by item parity
    uint32_t kv2[2];  // FP8 pools' scale factors (att_kv_scales)
};

// This thread's outputs of an item, computed before the block's arrival at the cluster barrier
// and stored after it: the arrival's release fence waits for the thread's outstanding global
// stores, so storing first would put their latency on every item.
#define ATT_OUT_PER (ATT_HB * ATT_MAX_D / (ATT_SPLITS * ATT_THREADS))
struct AttOut {
    bf16 v[ATT_OUT_PER];
    size_t off[ATT_OUT_PER];
    uint32_t n;
};

MT_DEVICE void att_store(const AttLaunch& a, const AttOut& o) {
#pragma unroll
    for (int j = 0; j < ATT_OUT_PER; ++j)
        if ((uint32_t)j < o.n) a.out[o.off[j]] = o.v[j];
}

// The cluster's combine of one item (blocks in block order): this block's share of the hb * d
// outputs, NaN for an item whose inputs are out of range.
template <int DP>
MT_DEVICE AttOut att_output(const AttLaunch& a, const AttItem& it, uint32_t p, AttShared& sh, const float* pk) {
    cg::cluster_group cluster = cg::this_cluster();
    AttOut out;
    out.n = 0;
#pragma unroll
    for (int j = 0; j < ATT_OUT_PER; ++j) {
        const uint32_t idx = a.split * ATT_THREADS + threadIdx.x + j * ATT_SPLITS * ATT_THREADS;
        if (idx >= a.hb * a.d) break;
        const uint32_t h = idx / a.d, e = idx % a.d;
        out.off[j] = ((size_t)it.row * a.hq + it.h0 + h) * a.d + e;
        out.n = j + 1;
        if (it.ctx == 0) {
            out.v[j] = bf16_nan();
            continue;
        }
        float ms[ATT_SPLITS], ls[ATT_SPLITS], ps[ATT_SPLITS];
#pragma unroll
        for (int s = 0; s < ATT_SPLITS; ++s) {
            ms[s] = cluster.map_shared_rank(&sh.cm[p][0], s)[h];
            ls[s] = cluster.map_shared_rank(&sh.cl[p][0], s)[h];
            ps[s] = cluster.map_shared_rank(pk, s)[h * DP + e];
        }
        out.v[j] = att_combine_splits(a, it.row, it.h0 + h, e, ms, ls, ps);
    }
    return out;
}

// A warp's slice of the decode kernels' dynamic shared memory, in bf16 elements: ATT_STAGES
// stages of a unit's 16 key rows and 16 value rows, then ATT_QSLOTS query slots of ATT_HB rows
// (rows dp + 8 wide: the 16-byte pad puts the 8 rows of every ldmatrix in distinct banks).
template <int DP>
struct AttWarpLayout {
    static constexpr uint32_t STAGE = 2 * ATT_UNIT * (DP + 8), QSLOT = ATT_HB * (DP + 8);
    static constexpr uint32_t WARP = ATT_STAGES * STAGE + ATT_QSLOTS * QSLOT;
};

// The decode kernels' buffers in the dynamic shared memory: this warp's ring and query slots
// (zeroed: query rows past hb and dimensions past head_dim are never copied, so they stay zero),
// then the block's f32 partials, the warps' `ow` [ATT_WARPS][hb][DP] and the kernel's `part`.
struct AttBuffers {
    bf16* ring;
    bf16* qslots;
    float* ow;
    float* part;
};

template <int DP>
MT_DEVICE AttBuffers att_buffers(unsigned char* dyn, uint32_t hb, uint32_t warp, uint32_t lane) {
    using L = AttWarpLayout<DP>;
    AttBuffers b;
    b.ring = reinterpret_cast<bf16*>(dyn) + (size_t)warp * L::WARP;
    b.qslots = b.ring + ATT_STAGES * L::STAGE;
    b.ow = reinterpret_cast<float*>(dyn + ATT_WARPS * L::WARP * 2);
    b.part = b.ow + ATT_WARPS * hb * DP;
    for (uint32_t i = lane; i < L::WARP / 8; i += 32) store16(b.ring + 8 * i, make_uint4(0, 0, 0, 0));
    __syncwarp();
    return b;
}

// A warp's chain: units first, first + 1, ... (`mine` of them) of a context of `ctx` tokens,
// from its ring, into fresh running outputs `o`, maxima `m` and sums `l` (att_unit's); `issue`
// refills each stage once it has been read. `consumed` counts the warp's units (its ring
// position). Returns whether a unit's slot was past the pool (`bad_bits`, by stage, as the
// issuing left them). PLAIN (att_plain): a unit's keys and values are two commit groups, and a
// stage's keys are refilled as soon as its unit's scores are in, so those copies' instructions
// fill the softmax's waits instead of lengthening the unit (`issue(st, parts)`: ATT_K, ATT_V or
// ATT_KV).
template <int DP, bool FP8, bool PLAIN, typename Issue>
MT_DEVICE bool att_warp_units(const AttLaunch& a, bf16* ring, const bf16* qslot, uint32_t first,
                              uint32_t mine, uint32_t ctx, const uint32_t& bad_bits, uint32_t& consumed,
                              uint32_t lane, float (&o)[DP / 16][4], float (&m)[2], float (&l)[2],
                              const uint32_t (&kv2)[2], Issue&& issue) {
#pragma unroll
    for (int t = 0; t < DP / 16; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    bool bad = false;
    for (uint32_t i = 0; i < mine; ++i) {
        // The plain path waits here for the unit's keys alone (its values too at a warp's first
        // unit of an item, whose group carries the queries) and for the values once the scores
        // are in, so an FP8 unit's values are widened beside the softmax instead of ahead of the
        // scores.
        if constexpr (PLAIN) {
            if (i == 0)
                cp_async_wait<2 * ATT_STAGES - 2>();
            else
                cp_async_wait<2 * ATT_STAGES - 1>();
        } else {
            cp_async_wait<ATT_STAGES - 1>();
        }
        __syncwarp();
        const uint32_t st = consumed % ATT_STAGES;
        bf16* stage = ring + st * AttWarpLayout<DP>::STAGE;
        if constexpr (FP8 && PLAIN)
            att_widen_rows<DP, 8>(kv2, stage, ATT_UNIT, [](uint32_t r) { return r; }, lane);
        else if constexpr (FP8)
            att_widen_rows<DP, 16>(kv2, stage, 2 * ATT_UNIT, [](uint32_t r) { return r; }, lane);
        att_unit<DP>(stage, qslot, first + i, ctx, a.scale_log2, i == 0, lane, o, m, l, [&]() {
            if constexpr (PLAIN) {
                __syncwarp();
                issue(st, ATT_K);
                cp_async_wait<2 * ATT_STAGES - 1>();  // the values (committed before the keys just queued)
                __syncwarp();
                if constexpr (FP8)
                    att_widen_rows<DP, 8>(kv2, stage, ATT_UNIT, [](uint32_t r) { return ATT_UNIT + r; }, lane);
            }
        });
        bad = bad || ((bad_bits >> st) & 1u) != 0;
        __syncwarp();
        issue(st, PLAIN ? ATT_V : ATT_KV);
        ++consumed;
    }
    return bad;
}

// Copy unit `unit` of item `it` into stage `st` of `ring` (att_issue), recording in `bad_bits`
// (a bit per stage) whether one of its slots was past the pool.
template <int DP, bool FP8, bool PLAIN>
MT_DEVICE void att_issue_stage(const AttLaunch& a, const AttItem& it, uint32_t unit, uint32_t entry, bf16* ring,
                               uint32_t st, uint32_t lane, uint32_t& bad_bits, uint32_t parts,
                               bool active = true) {
    const bool bad =
        att_issue<DP, FP8, PLAIN>(a, it, unit, entry, ring + st * AttWarpLayout<DP>::STAGE, lane, parts, active);
    // Recorded with the values (a stage's keys are refilled before its unit's flag is read).
    if (parts & ATT_V) bad_bits = (bad_bits & ~(1u << st)) | ((bad ? 1u : 0u) << st);
}

// The start of a warp's stream of units: its first unit's table entries (`settle`, step inputs
// no kernel writes), the wait for the kernel ahead (the cache store), then ATT_STAGES units
// queued (`issue`; PLAIN: keys and values as two commit groups each, as att_warp_units takes them).
template <bool PLAIN, typename Settle, typename Issue>
MT_DEVICE void att_stream_start(Settle&& settle, Issue&& issue) {
    settle();
    pdl_wait();  // the cache store ahead has written the step's keys and values
    pdl_trigger();
#pragma unroll
    for (uint32_t st = 0; st < ATT_STAGES; ++st) {
        if constexpr (PLAIN) {
            issue(st, ATT_K);
            issue(st, ATT_V);
        } else {
            issue(st, ATT_KV);
        }
    }
}
