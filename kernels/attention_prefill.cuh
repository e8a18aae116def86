// `paged_attention_prefill`: the causal attention of a prefill chunk's rows, bitwise
// `paged_attention` row by row, included by attention.cu (whose helpers it uses).
//
// Items: a row group (ops::attention_row_groups: up to ATP_ROWS consecutive rows of one sequence
// whose positions lie in one 16-token unit, so their contexts cut into the same units, splits and
// chains) by a group of hb query heads sharing a key/value head. Its virtual rows v = j * hb + h
// (head h0 + h of row first + j) are the M rows of the item's MMA tiles: 64 virtual rows (4 tiles
// of 16) up to head_dim 128, 32 at 256 (`atp_vrows`). Blocks are persistent and take whole
// items, the longest contexts first (block b of B: items n - 1 - b, n - 1 - b - B, ...).
//
// A block is ATP_WARPS (4) warps; each computes one tile of 16 virtual rows, or at head_dim 256
// one half of a tile's output dimensions (both halves compute the tile's scores). The block walks
// the item's units in order: each unit's keys and values land in a ring of `atp_stages` stages
// (each warp copies a quarter of the 16 tokens), one block barrier a unit, and every warp runs
// the unit's scores, softmax and P V for its rows (atp_unit: `att_unit`'s operations for rows g
// and g + 8, att_softmax_row for each). The walk follows `paged_attention`'s arithmetic: a chain
// (att_units of each split and warp) starts from an empty state and is folded, when it ends,
// into its split's total (registers); a split's total is folded, when the split ends, into the
// row's (numerators in shared memory, a thread's own elements); every fold is att_fold's, in the
// order of the decode kernels' folds, so a row's result is bitwise theirs. After its last split
// the block writes the item's rows (the numerators over the sums, times the gate).
//
// Grid (blocks, 1; clusters of one block, so the launcher can ask the driver how many are
// resident), ATP_THREADS threads, atp_shared_bytes(dp) of dynamic shared memory (two blocks a
// multiprocessor). A malformed row group, or a launch the kernel cannot run, gets NaN outputs
// (the latter also reports a GEOMETRY fault); rows of no group are not written.
//
// The split kernels (`paged_attention_prefill_split`, `_split_staged`) compute the same rows in
// clusters of ATT_SPLITS blocks, block s taking only split s of each of its cluster's items. A
// split block is ATT_WARPS groups of ATP_WARPS warps (atp_run_split): group w walks chain w of
// the split for the item's tiles, with a ring of its own, so the split's chains run side by side
// (four warps a scheduler where a walking block has one or two); the chains are folded into the
// split's total in chain order, then the splits' totals through the cluster's shared memory in
// split order (atp_split_rows), each fold the walk's. A walk's time is its longest item's; a step
// whose few long row groups (a prefill chunk's late rows beside short decode rows) would keep a
// handful of blocks walking long after the rest are done gives those groups to a split launch
// (ops::attention_prefill_plan), ATT_SPLITS * ATT_WARPS warp groups on each item.
//
// Why a walk: computing an item's chains side by side, as the decode kernels do, needs their
// partials combined per item through shared (and a cluster's distributed shared) memory, with a
// barrier each; a prefill item has 64 rows where a decode item has a few, so those combines
// cost more than the units they join, except where items are few and long (the split kernels).
// The walk folds in registers, and the keys and values of a unit are read once for all the
// item's rows.

#define ATP_THREADS (32 * ATP_WARPS)
#define ATP_MAX_VROWS 64

// Virtual rows of an item, stages of the ring, rows per item: the launcher computes the same
// (ops_attention).
MT_DEVICE uint32_t atp_vrows(uint32_t dp) { return dp > 128 ? 32u : 64u; }

MT_DEVICE uint32_t atp_stages(uint32_t dp) { return dp > 128 ? 2u : 3u; }

MT_DEVICE uint32_t atp_rows_per_item(uint32_t hb, uint32_t dp) { return min(ATP_ROWS, atp_vrows(dp) / hb); }

// A ring: atp_stages(dp) stages, each a unit's 16 keys then 16 values of dp + 8 bf16.
MT_DEVICE uint32_t atp_ring_bytes(uint32_t dp) { return atp_stages(dp) * 2u * ATT_UNIT * (dp + 8u) * 2u; }

// Dynamic shared memory: the ring, the item's queries [vrows][dp + 8] bf16, and each thread's
// folded numerators, f32 [ATP_FOLD][ATP_THREADS] (element i of thread t at i * ATP_THREADS + t:
// no bank conflicts).
MT_DEVICE uint32_t atp_shared_bytes(uint32_t dp) {
    return atp_ring_bytes(dp) + atp_vrows(dp) * (dp + 8u) * 2u + ATP_FOLD * ATP_THREADS * 4u;
}

// A split kernel's block: ATT_WARPS chain groups of ATP_WARPS warps, and its dynamic shared
// memory: a ring a group, then the queries and the split's folded numerators as in
// atp_shared_bytes (one block a multiprocessor). The chains' exchange reuses the rings.
#define ATPS_THREADS (ATP_THREADS * ATT_WARPS)

MT_DEVICE uint32_t atp_split_shared_bytes(uint32_t dp) {
    return atp_shared_bytes(dp) + (ATT_WARPS - 1u) * atp_ring_bytes(dp);
}

struct AtpShared {
    uint32_t seq[ATT_MAX_ITEMS], ctx[ATT_MAX_ITEMS], h0[ATT_MAX_ITEMS];
    uint32_t kv[ATT_MAX_ITEMS];  // the key/value head's offset in a slot
    uint32_t grp[ATT_MAX_ITEMS][2 + ATP_ROWS];  // first row, rows, each row's context
    // The staged kernel's output: the o projection's stage images (null: `out`), with their 64-k
    // stages a row tile. Here rather than in AttLaunch, whose every field costs the unit loop
    // registers.
    unsigned char* img;
    uint32_t img_steps;
    uint32_t kv2[2];  // FP8 pools' scale factors (att_kv_scales)
    // The split kernels' exchange: each thread's maxima and sums of its two rows for the split
    // this block walked (its numerators go to the fold buffer), read by the cluster.
    float xm[2][ATP_THREADS], xl[2][ATP_THREADS];
};

// Item k of this block. `ctx` is the largest context of its rows (0: out of range), `units` its
// units of 16 keys.
struct AtpItem {
    uint32_t row, cnt, h0, kv, seq, ctx, units;
};

MT_DEVICE AtpItem atp_item(const AtpShared& sh, uint32_t k) {
    AtpItem it;
    it.row = sh.grp[k][0];
    it.cnt = sh.grp[k][1];
    it.h0 = sh.h0[k];
    it.kv = sh.kv[k];
    it.seq = sh.seq[k];
    it.ctx = sh.ctx[k];
    it.units = (it.ctx + ATT_UNIT - 1) / ATT_UNIT;
    return it;
}

// Warp `j` copies its quarter (tokens 4j..4j+3) of unit `unit`'s keys and values
// into `stage` (cp.async on the vector path, plain loads otherwise; dead tokens and padded
// dimensions become zeros). Returns whether a slot was past the pool (the same in every warp).
template <int DP, bool FP8>
MT_DEVICE bool atp_issue(const AttLaunch& a, const AtpItem& it, uint32_t unit, uint32_t entry, bf16* stage,
                         uint32_t lane, uint32_t j) {
    constexpr int RS = DP + 8, NCH = DP / 8, PER = 4 * NCH;
    bf16* ks = stage;
    bf16* vs = stage + ATT_UNIT * RS;
    if constexpr (FP8) {
        uint32_t slot, live;
        const bool bad = att_fp8_slots(a, unit, it.ctx, entry, lane, slot, live);
        const uint8_t* kb8 = reinterpret_cast<const uint8_t*>(a.k_cache) + it.kv;
        const uint8_t* vb8 = reinterpret_cast<const uint8_t*>(a.v_cache) + it.kv;
        att_fp8_copy<DP>(a, kb8, vb8, slot, live, 4 * j, 4, ks, vs, lane);
        return bad;
    }
    const bf16* kb = a.k_cache + it.kv;
    const bf16* vb = a.v_cache + it.kv;
    if (a.vec && a.unit_blocks)
        return att_copy_unit<RS, (PER + 31) / 32>(a, kb, vb, unit, it.ctx, entry, PER >= 32 || lane < PER,
                                                  4 * j + lane / NCH, 32 / NCH, lane % NCH, ks, vs);
    uint32_t slot, live;
    bool bad;
    att_slot(a, unit, it.ctx, entry, lane, slot, live, bad);
    if (a.vec) {
#pragma unroll
        for (int i = 0; i < (PER + 31) / 32; ++i) {
            const uint32_t idx = lane + 32 * i, tok = (4 * j + idx / NCH) & (ATT_UNIT - 1), ch = idx % NCH;
            const uint32_t s = __shfl_sync(0xffffffffu, slot, tok);
            const bool on = __shfl_sync(0xffffffffu, live, tok) != 0 && 8 * ch < a.d;
            if (PER % 32 == 0 || idx < PER) {
                const size_t off = on ? (size_t)s * a.width + 8 * ch : 0;
                cp_async16(ks + tok * RS + 8 * ch, kb + off, on ? 16u : 0u);
                cp_async16(vs + tok * RS + 8 * ch, vb + off, on ? 16u : 0u);
            }
        }
    } else {
#pragma unroll 1
        for (int i = 0; i < 4 * DP / 32; ++i) {
            const uint32_t idx = lane + 32 * i, tok = 4 * j + idx / DP, e = idx % DP;
            const uint32_t s = __shfl_sync(0xffffffffu, slot, tok);
            const bool on = __shfl_sync(0xffffffffu, live, tok) != 0 && e < a.d;
            const size_t off = (size_t)s * a.width + e;
            ks[tok * RS + e] = on ? kb[off] : __ushort_as_bfloat16((unsigned short)0);
            vs[tok * RS + e] = on ? vb[off] : __ushort_as_bfloat16((unsigned short)0);
        }
    }
    return __any_sync(0xffffffffu, bad);
}

// The queries of item k into `qs` ([vrows][DP + 8]), by the whole block, any size (cp.async on
// the vector path: the caller waits): virtual rows past the item's rows, dimensions past
// head_dim and every row of an out-of-range item are zeros.
template <int DP>
MT_DEVICE void atp_load_q(const AttLaunch& a, const AtpShared& sh, uint32_t k, bf16* qs) {
    constexpr int RS = DP + 8, NCH = RS / 8;
    const uint32_t vrows = atp_vrows(DP);
    const uint32_t row = sh.grp[k][0], cnt = sh.ctx[k] != 0 ? sh.grp[k][1] : 0, h0 = sh.h0[k];
    auto q_at = [&](uint32_t v) {
        return a.qkv + (size_t)(row + v / a.hb) * a.row_stride + (size_t)(h0 + v % a.hb) * a.q_head_stride;
    };
    if (a.vec) {
        for (uint32_t idx = threadIdx.x; idx < vrows * NCH; idx += blockDim.x) {
            const uint32_t v = idx / NCH, ch = idx % NCH;
            const bool on = v / a.hb < cnt && 8 * ch < a.d;
            cp_async16(qs + v * RS + 8 * ch, on ? q_at(v) + 8 * ch : a.qkv, on ? 16u : 0u);
        }
    } else {
        for (uint32_t idx = threadIdx.x; idx < vrows * RS; idx += blockDim.x) {
            const uint32_t v = idx / RS, e = idx % RS;
            qs[v * RS + e] = v / a.hb < cnt && e < a.d ? q_at(v)[e] : __ushort_as_bfloat16((unsigned short)0);
        }
    }
}

// One unit of a warp: scores of tile t's 16 virtual rows against the unit's 16 tokens, the
// online softmax of rows g and g + 8 (contexts ctx0, ctx1) and P V into the output dimensions of
// part hp (DH of them).
template <int DP, int DH>
MT_DEVICE void atp_unit(const bf16* stage, const bf16* q, uint32_t t, uint32_t hp, uint32_t unit,
                        uint32_t ctx0, uint32_t ctx1, float scale_log2, bool first, uint32_t lane, float (&o)[DH / 8][4],
                        float (&m)[2], float (&l)[2]) {
    constexpr int RS = DP + 8;
    const uint32_t c = lane & 3, mat = lane >> 3, row = lane & 7;
    const uint32_t ks = (uint32_t)__cvta_generic_to_shared(stage);
    const uint32_t vs = ks + ATT_UNIT * RS * 2;
    // Query matrices: (rows 0-7 | 8-15) x (dims 0-7 | 8-15 of the k step); key matrices as in
    // att_unit. Two accumulation chains (even and odd k steps), as there.
    const uint32_t q_addr =
        (uint32_t)__cvta_generic_to_shared(q) + ((16 * t + row + ((mat & 1) << 3)) * RS + ((mat >> 1) << 3)) * 2;
    const uint32_t k_addr = ks + ((row + ((mat >> 1) << 3)) * RS + ((mat & 1) << 3)) * 2;
    float s[2][2][2][2] = {};  // [row g | g + 8][chain][n-tile][c0, c1]
#pragma unroll
    for (int kp = 0; kp < DP / 32; ++kp) {
        uint32_t qa0[4], qa1[4], b0[4], b1[4];
        att_ldsm4(qa0, q_addr + (2 * kp) * 32);
        att_ldsm4(qa1, q_addr + (2 * kp + 1) * 32);
        att_ldsm4(b0, k_addr + (2 * kp) * 32);
        att_ldsm4(b1, k_addr + (2 * kp + 1) * 32);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
            att_mma16(s[0][0][n][0], s[0][0][n][1], s[1][0][n][0], s[1][0][n][1], qa0[0], qa0[1], qa0[2],
                      qa0[3], b0[2 * n], b0[2 * n + 1]);
            att_mma16(s[0][1][n][0], s[0][1][n][1], s[1][1][n][0], s[1][1][n][1], qa1[0], qa1[1], qa1[2],
                      qa1[3], b1[2 * n], b1[2 * n + 1]);
        }
    }

    float corr[2];
    uint32_t pa[2][2];
    att_softmax_row(s[0][0], s[0][1], unit, ctx0, scale_log2, c, m[0], l[0], corr[0], pa[0]);
    att_softmax_row(s[1][0], s[1][1], unit, ctx1, scale_log2, c, m[1], l[1], corr[1], pa[1]);
    const bool rescale = att_rescale(first, corr[0] != 1.0f || corr[1] != 1.0f);

    const uint32_t v_addr = vs + ((row + ((mat & 1) << 3)) * RS + ((mat >> 1) << 3) + hp * DH) * 2;
#pragma unroll
    for (int dd = 0; dd < DH / 16; ++dd) {
        uint32_t b[4];
        att_ldsm4_t(b, v_addr + dd * 32);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float(&on)[4] = o[2 * dd + h];
            if (rescale) {
                on[0] *= corr[0];
                on[1] *= corr[0];
                on[2] *= corr[1];
                on[3] *= corr[1];
            }
            att_mma16(on[0], on[1], on[2], on[3], pa[0][0], pa[1][0], pa[0][1], pa[1][1], b[2 * h], b[2 * h + 1]);
        }
    }
}

// Output element `col` of row `r` (rows of `width`): into `out`, or for the staged kernel
// into the o projection's stage images `img` (`steps` 64-k stages a row tile).
MT_DEVICE void atp_store(bf16* out, unsigned char* img, uint32_t steps, uint32_t width, uint32_t r, uint32_t col,
                         bf16 v) {
    if (img != nullptr)
        *reinterpret_cast<bf16*>(img + img_elem_offset(r, col, steps)) = v;
    else
        out[(size_t)r * width + col] = v;
}

MT_DEVICE void atp_put(const AttLaunch& a, const AtpShared& sh, uint32_t r, uint32_t col, bf16 v) {
    atp_store(a.out, sh.img, sh.img_steps, a.hq * a.d, r, col, v);
}

// A row pair's fold state (rows g and g + 8 of a warp's tile): maxima, sums and this thread's
// numerators (`o` as atp_unit leaves them).
template <int DH>
struct AtpFold {
    float o[DH / 8][4];
    float m[2], l[2];
};

template <int DH>
MT_DEVICE void atp_clear(AtpFold<DH>& f) {
#pragma unroll
    for (int n = 0; n < DH / 8; ++n) f.o[n][0] = f.o[n][1] = f.o[n][2] = f.o[n][3] = 0.0f;
    f.m[0] = f.m[1] = -INFINITY;
    f.l[0] = f.l[1] = 0.0f;
}

// Fold a chain (`c`, its sums still one partial a quad lane) into its split's total `s`: the
// chain's sums added over the quad in att_softmax_row's order (as the decode kernels' warp
// partials add them), then att_fold under att_fold_weights, numerators and sums alike; `c` is
// left empty for the next chain. Every lane runs it (the shuffles).
template <int DH>
MT_DEVICE void atp_fold_chain(AtpFold<DH>& s, AtpFold<DH>& c) {
    float wt[2], wp[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        c.l[r] += __shfl_xor_sync(0xffffffffu, c.l[r], 1);
        c.l[r] += __shfl_xor_sync(0xffffffffu, c.l[r], 2);
        float mn;
        att_fold_weights(s.m[r], c.m[r], mn, wt[r], wp[r]);
        s.l[r] = att_fold(s.l[r], c.l[r], wt[r], wp[r]);
        s.m[r] = mn;
    }
#pragma unroll
    for (int n = 0; n < DH / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s.o[n][e] = att_fold(s.o[n][e], c.o[n][e], wt[e >> 1], wp[e >> 1]);
    atp_clear(c);
}

// Fold a split's total `s` (its sums NaN when a slot was past the pool) into the row's total:
// maxima and sums `fm`, `fl` in registers, numerators in shared memory `fo` (this thread's
// elements, ATP_FOLD of them, at i * ATP_THREADS); `first`: the row's total is empty.
template <int DH>
MT_DEVICE void atp_fold_split(const AtpFold<DH>& s, bool bad, float (&fm)[2], float (&fl)[2], float* fo, bool first) {
    float wt[2], wp[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float mn;
        att_fold_weights(fm[r], s.m[r], mn, wt[r], wp[r]);
        fl[r] = att_fold(fl[r], bad ? __int_as_float(0x7FFFFFFF) : s.l[r], wt[r], wp[r]);
        fm[r] = mn;
    }
#pragma unroll
    for (int n = 0; n < DH / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float* at = fo + (4 * n + e) * ATP_THREADS;
            *at = att_fold(first ? 0.0f : *at, s.o[n][e], wt[e >> 1], wp[e >> 1]);
        }
}

// Where the block's stream of units stands: unit `i` of item `k`, with the block-table entries it
// needs already requested (att_entry).
struct AtpCursor {
    uint32_t k, i, entry;
    AtpItem it;
};

// The rows of item `it` from a split kernel's cluster: each block the outputs of its share of
// the n-tiles (n % ATT_SPLITS == its split) of this thread's rows v0 and v1, the cluster's split
// totals (maxima and sums in sh.xm / sh.xl, numerators at `fo`, this thread's elements) folded
// in split order as atp_fold_split folds them (att_fold_all, att_finish), NaN for an item whose
// inputs are out of range. Not inlined: the walk's loop keeps its registers.
template <int DH>
__device__ __noinline__ void atp_split_rows(const AttLaunch& a, AtpShared& sh, const AtpItem& it, const float* fo,
                                            uint32_t v0, uint32_t hp) {
    cg::cluster_group cluster = cg::this_cluster();
    const uint32_t tid = threadIdx.x, c = tid & 3, used = it.cnt * a.hb;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const uint32_t v = v0 + 8 * r;
        if (v >= used) continue;
        float ms[ATT_SPLITS], ls[ATT_SPLITS], wt[ATT_SPLITS], wp[ATT_SPLITS], den;
#pragma unroll
        for (int b = 0; b < ATT_SPLITS; ++b) {
            ms[b] = cluster.map_shared_rank(&sh.xm[r][0], b)[tid];
            ls[b] = cluster.map_shared_rank(&sh.xl[r][0], b)[tid];
        }
        att_fold_all(ms, ls, wt, wp, den);
        const uint32_t row = it.row + v / a.hb, h = it.h0 + v % a.hb;
        const bf16* gate = a.qkv + (size_t)row * a.row_stride + (size_t)h * a.q_head_stride + a.d;
#pragma unroll
        for (int n = 0; n < DH / 8; ++n) {
            if ((uint32_t)n % ATT_SPLITS != a.split) continue;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const uint32_t col = hp * DH + 8 * n + 2 * c + e;
                if (col >= a.d) continue;
                float ps[ATT_SPLITS];
#pragma unroll
                for (int b = 0; b < ATT_SPLITS; ++b)
                    ps[b] = cluster.map_shared_rank(fo, b)[(4 * n + 2 * r + e) * ATP_THREADS];
                atp_put(a, sh, row, h * a.d + col,
                        it.ctx != 0 ? att_finish(wt, wp, ps, den, a.gated ? gate + col : nullptr) : bf16_nan());
            }
        }
    }
}

// The walk (`paged_attention_prefill`, `_staged`). Not inlined: each head_dim gets its own
// register allocation.
template <int DP, bool FP8>
__device__ __noinline__ void atp_run(const AttLaunch a, unsigned char* dyn, AtpShared& sh) {
    constexpr int HP = DP > 128 ? 2 : 1, DH = DP / HP, RS = DP + 8;
    constexpr uint32_t STAGES = DP > 128 ? 2 : 3, VROWS = DP > 128 ? 32 : 64;
    constexpr uint32_t UNIT_ELEMS = 2 * ATT_UNIT * RS;
    static_assert(DH / 2 <= ATP_FOLD, "a thread's fold state is at most ATP_FOLD elements");
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t g = lane >> 2, c = lane & 3;
    const uint32_t t = warp / HP, hp = warp % HP;
    bf16* ring = reinterpret_cast<bf16*>(dyn);
    bf16* qs = ring + (size_t)STAGES * UNIT_ELEMS;
    float* fo = reinterpret_cast<float*>(qs + VROWS * RS) + tid;  // this thread's numerators

    AtpCursor f;
    f.k = 0;
    f.i = 0;
    f.entry = 0;
    if (a.nk > 0) {
        f.it = atp_item(sh, 0);
    }
    auto settle = [&]() {  // move to the next unit that exists and read its table entries
        while (f.k < a.nk && f.i >= f.it.units) {
            ++f.k;
            if (f.k < a.nk) {
                f.it = atp_item(sh, f.k);
                f.i = 0;
            }
        }
        if (f.k < a.nk) f.entry = att_entry(a, f.it.seq, f.i, f.it.ctx, lane);
    };
    uint32_t bad_bits = 0;
    auto issue_next = [&](uint32_t st) {
        if (f.k < a.nk) {
            const bool bad =
                atp_issue<DP, FP8>(a, f.it, f.i, f.entry, ring + st * UNIT_ELEMS, lane, warp);
            bad_bits = (bad_bits & ~(1u << st)) | ((bad ? 1u : 0u) << st);
            ++f.i;
            settle();
        }
        cp_async_commit();
    };
    settle();
#pragma unroll
    for (uint32_t st = 0; st + 1 < STAGES; ++st) issue_next(st);

    // Per item: its queries, then its splits and chains in order (a unit's copies land
    // STAGES - 1 units ahead; one block barrier per unit makes a stage's copies visible and frees
    // the stage read before), each chain folded into its split as it ends and each split into
    // the rows' totals, then the rows.
    uint32_t consumed = 0;
    for (uint32_t k = 0; k < a.nk; ++k) {
        const AtpItem it = atp_item(sh, k);
        const uint32_t v0 = 16 * t + g, v1 = v0 + 8;
        const uint32_t* rc = &sh.grp[k][2];
        const uint32_t ctx0 = v0 / a.hb < it.cnt ? rc[v0 / a.hb] : it.ctx;
        const uint32_t ctx1 = v1 / a.hb < it.cnt ? rc[v1 / a.hb] : it.ctx;
        const bool active = 16 * t < it.cnt * a.hb;  // the tile holds a row of the item
        __syncthreads();  // every warp is done with the previous item's queries
        atp_load_q<DP>(a, sh, k, qs);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        AtpFold<DH> ch, sp;  // the running chain and split
        atp_clear(ch);
        float fm[2] = {-INFINITY, -INFINITY}, fl[2] = {0.0f, 0.0f};
        for (uint32_t s = 0; s < ATT_SPLITS; ++s) {
            atp_clear(sp);
            bool bad = false;
            for (uint32_t w = 0; w < ATT_WARPS; ++w) {
                uint32_t first, mine;
                att_units(it.ctx, s, w, first, mine);
                for (uint32_t i = 0; i < mine; ++i) {
                    // All but the latest STAGES - 2 groups (queued after this unit's) landed.
                    cp_async_wait<STAGES - 2>();
                    const uint32_t st = consumed % STAGES;
                    if constexpr (FP8) {
                        // This warp's quarter of the unit: key rows 4w..4w+3, value rows 16 + 4w...
                        __syncwarp();
                        att_widen_rows<DP>(sh.kv2, ring + st * UNIT_ELEMS, 8,
                                           [warp](uint32_t i) { return (i < 4 ? 0u : ATT_UNIT - 4u) + 4 * warp + i; },
                                           lane);
                    }
                    __syncthreads();
                    issue_next((consumed + STAGES - 1) % STAGES);
                    if (active)
                        atp_unit<DP, DH>(ring + st * UNIT_ELEMS, qs, t, hp, first + i, ctx0, ctx1, a.scale_log2,
                                         i == 0, lane, ch.o, ch.m, ch.l);
                    bad = bad || ((bad_bits >> st) & 1u) != 0;
                    ++consumed;
                }
                atp_fold_chain(sp, ch);
            }
            atp_fold_split(sp, bad, fm, fl, fo, s == 0);
        }

        // The item's rows: this thread's elements of rows v0 and v1 (the tile's rows that are
        // the item's), NaN for an item whose inputs are out of range.
        const uint32_t used = it.cnt * a.hb;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const uint32_t v = r == 0 ? v0 : v1;
            if (v >= used) continue;
            const uint32_t row = it.row + v / a.hb, h = it.h0 + v % a.hb;
            const bf16* gate = a.qkv + (size_t)row * a.row_stride + (size_t)h * a.q_head_stride + a.d;
#pragma unroll
            for (int n = 0; n < DH / 8; ++n)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const uint32_t col = hp * DH + 8 * n + 2 * c + e;
                    if (col >= a.d) continue;
                    const float num = fo[(4 * n + 2 * r + e) * ATP_THREADS];
                    atp_put(a, sh, row, h * a.d + col,
                            it.ctx != 0 ? att_value(num, fl[r], a.gated ? gate + col : nullptr) : bf16_nan());
                }
        }
    }
    cp_async_wait<0>();
}

// Group `w`'s barrier: its ATP_WARPS warps, which share its ring (barrier 0 is the block's).
MT_DEVICE void atp_group_sync(uint32_t w) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + w), "n"(ATP_THREADS) : "memory");
}

// The split kernels' block: group w (warps ATP_WARPS w ..) walks chain w of split a.split of each
// item, its warps computing the item's tiles as the walk's do (each unit's keys and values in the
// group's ring, one group barrier a unit); then, once every group is done, the chains are folded
// into the split's total in chain order by group 0 (atp_fold_chain's operations, the other
// groups' chains read from the exchange that overlays the rings), and the cluster folds the
// splits. Not inlined: each head_dim gets its own register allocation.
template <int DP, bool FP8>
__device__ __noinline__ void atp_run_split(const AttLaunch a, unsigned char* dyn, AtpShared& sh) {
    constexpr int HP = DP > 128 ? 2 : 1, DH = DP / HP, RS = DP + 8;
    constexpr uint32_t STAGES = DP > 128 ? 2 : 3, VROWS = DP > 128 ? 32 : 64;
    constexpr uint32_t UNIT_ELEMS = 2 * ATT_UNIT * RS;
    // A chain's exchanged state a thread: its numerators, then maxima and sums.
    constexpr uint32_t XS = DH / 2 + 4;
    static_assert(DH / 2 <= ATP_FOLD, "a thread's fold state is at most ATP_FOLD elements");
    static_assert((ATT_WARPS - 1) * XS * ATP_THREADS * 4 <= ATT_WARPS * STAGES * UNIT_ELEMS * 2,
                  "the chains' exchange fits over the rings");
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t w = warp / ATP_WARPS, j = warp % ATP_WARPS, gt = tid % ATP_THREADS;
    const uint32_t g = lane >> 2;
    const uint32_t t = j / HP, hp = j % HP;
    bf16* ring = reinterpret_cast<bf16*>(dyn) + (size_t)w * STAGES * UNIT_ELEMS;
    bf16* qs = reinterpret_cast<bf16*>(dyn) + (size_t)ATT_WARPS * STAGES * UNIT_ELEMS;
    float* fo = reinterpret_cast<float*>(qs + VROWS * RS) + gt;  // group 0: its split's numerators
    float* xch = reinterpret_cast<float*>(dyn) + gt;  // chain w's state at (w - 1) * XS * ATP_THREADS

    for (uint32_t k = 0; k < a.nk; ++k) {
        const AtpItem it = atp_item(sh, k);
        const uint32_t v0 = 16 * t + g, v1 = v0 + 8;
        const uint32_t* rc = &sh.grp[k][2];
        const uint32_t ctx0 = v0 / a.hb < it.cnt ? rc[v0 / a.hb] : it.ctx;
        const uint32_t ctx1 = v1 / a.hb < it.cnt ? rc[v1 / a.hb] : it.ctx;
        const bool active = 16 * t < it.cnt * a.hb;  // the tile holds a row of the item
        __syncthreads();  // every warp is done with the previous item's queries and exchange
        atp_load_q<DP>(a, sh, k, qs);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        // The group's chain: its units' copies land STAGES - 1 units ahead, each block-table
        // entry requested a unit before its copy.
        uint32_t first, mine;
        att_units(it.ctx, a.split, w, first, mine);
        AtpFold<DH> ch;
        atp_clear(ch);
        bool bad = false;
        uint32_t bad_bits = 0, issued = 0;
        uint32_t entry = mine > 0 ? att_entry(a, it.seq, first, it.ctx, lane) : 0u;
        auto issue_next = [&]() {
            if (issued < mine) {
                const uint32_t st = issued % STAGES;
                const bool b = atp_issue<DP, FP8>(a, it, first + issued, entry, ring + st * UNIT_ELEMS, lane, j);
                bad_bits = (bad_bits & ~(1u << st)) | ((b ? 1u : 0u) << st);
                ++issued;
                if (issued < mine) entry = att_entry(a, it.seq, first + issued, it.ctx, lane);
            }
            cp_async_commit();
        };
#pragma unroll
        for (uint32_t st = 0; st + 1 < STAGES; ++st) issue_next();
        for (uint32_t i = 0; i < mine; ++i) {
            // All but the latest STAGES - 2 groups (queued after this unit's) landed.
            cp_async_wait<STAGES - 2>();
            const uint32_t st = i % STAGES;
            if constexpr (FP8) {
                // This warp's quarter of the unit: key rows 4j..4j+3, value rows 16 + 4j...
                __syncwarp();
                att_widen_rows<DP>(sh.kv2, ring + st * UNIT_ELEMS, 8,
                                   [j](uint32_t r) { return (r < 4 ? 0u : ATT_UNIT - 4u) + 4 * j + r; }, lane);
            }
            atp_group_sync(w);
            issue_next();
            if (active)
                atp_unit<DP, DH>(ring + st * UNIT_ELEMS, qs, t, hp, first + i, ctx0, ctx1, a.scale_log2, i == 0,
                                 lane, ch.o, ch.m, ch.l);
            bad = bad || ((bad_bits >> st) & 1u) != 0;
        }
        cp_async_wait<0>();
        // The chain's sums over the quad, as atp_fold_chain adds them.
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            ch.l[r] += __shfl_xor_sync(0xffffffffu, ch.l[r], 1);
            ch.l[r] += __shfl_xor_sync(0xffffffffu, ch.l[r], 2);
        }
        __syncthreads();  // every group is done with its ring: the exchange overlays them
        if (w > 0) {
            float* x = xch + (w - 1) * XS * ATP_THREADS;
#pragma unroll
            for (int n = 0; n < DH / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) x[(4 * n + e) * ATP_THREADS] = ch.o[n][e];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                x[(DH / 2 + r) * ATP_THREADS] = ch.m[r];
                x[(DH / 2 + 2 + r) * ATP_THREADS] = ch.l[r];
            }
        }
        // The exchange is whole before group 0 reads it; then the chains' bad flags are reduced.
        __syncthreads();
        bad = __syncthreads_or(bad) != 0;
        if (w == 0) {
            // The split's total: chains 0 .. ATT_WARPS - 1 folded in order into an empty state,
            // the weights first, then each numerator through the same folds.
            float sm[2] = {-INFINITY, -INFINITY}, sl[2] = {0.0f, 0.0f}, wt[ATT_WARPS][2], wp[ATT_WARPS][2];
#pragma unroll
            for (int q = 0; q < ATT_WARPS; ++q)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float cm = q == 0 ? ch.m[r] : xch[((q - 1) * XS + DH / 2 + r) * ATP_THREADS];
                    const float cl = q == 0 ? ch.l[r] : xch[((q - 1) * XS + DH / 2 + 2 + r) * ATP_THREADS];
                    float mn;
                    att_fold_weights(sm[r], cm, mn, wt[q][r], wp[q][r]);
                    sl[r] = att_fold(sl[r], cl, wt[q][r], wp[q][r]);
                    sm[r] = mn;
                }
#pragma unroll
            for (int n = 0; n < DH / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float o = att_fold(0.0f, ch.o[n][e], wt[0][e >> 1], wp[0][e >> 1]);
#pragma unroll
                    for (int q = 1; q < ATT_WARPS; ++q)
                        o = att_fold(o, xch[((q - 1) * XS + 4 * n + e) * ATP_THREADS], wt[q][e >> 1], wp[q][e >> 1]);
                    fo[(4 * n + e) * ATP_THREADS] = o;
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                sh.xm[r][gt] = sm[r];
                sh.xl[r][gt] = bad ? __int_as_float(0x7FFFFFFF) : sl[r];
            }
        }
        // Every block's rows once all have published their split's total, and a barrier before
        // the next item overwrites them.
        cluster_publish_arrive();
        cluster_wait();
        if (w == 0) atp_split_rows<DH>(a, sh, it, fo, v0, hp);
        cluster_leave_barrier();
    }
}

// The kernel arguments after the output, as parameters and as arguments.
#define ATP_ARGS qkv, k_cache, v_cache, block_tables, row_seq, positions, rows, row_stride, q_head_stride, \
    num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_seqs, num_slots, scale, gated, row_groups, n_groups, \
    kv_fp8, k_scale, v_scale
#define ATP_PARAMS const bf16* __restrict__ qkv, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache, \
    const uint32_t* __restrict__ block_tables, const uint32_t* __restrict__ row_seq,                                   \
    const uint32_t* __restrict__ positions, uint32_t rows, uint32_t row_stride, uint32_t q_head_stride,                \
    uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t max_blocks,           \
    uint32_t num_seqs, uint32_t num_slots, float scale, uint32_t gated, const uint32_t* __restrict__ row_groups,       \
    uint32_t n_groups, uint32_t kv_fp8, float k_scale, float v_scale

// paged_attention_prefill(the arguments of paged_attention, with row_groups: u32 [n_groups, 2]
// (first row, rows) after the pointers and n_groups last): `paged_attention` on the rows of the
// groups, bitwise, each
// group's rows (1 ..= atp_rows_per_item consecutive rows of one sequence whose positions lie in
// the same 16-token unit) in one item, so each key and value is read once for all of them. Rows
// of no group are not written; a malformed group gets NaN outputs.
//
// paged_attention_prefill_staged(img, then the same arguments): the same rows written as the o
// projection's stage images of [rows, num_q_heads * head_dim] (kernels/common.cuh) instead of
// `out`, so `linear_tma` reads them without `permute_k32_tiles`; the launcher stages only
// num_q_heads * head_dim % 64 == 0. Image rows of no group are not written.
//
// paged_attention_prefill_split and paged_attention_prefill_split_staged: the same rows from
// clusters of ATT_SPLITS blocks of ATPS_THREADS threads (atp_split_shared_bytes of dynamic
// shared memory), cluster c of C taking items c, c + C, ... and block s of it split s of each,
// its chains side by side (for launches of few long items: a prefill chunk's late rows beside a
// step's decode rows), the chains and then the splits folded in order, so every row is bitwise
// the walk's.
template <bool SPLIT>
MT_DEVICE void atp_kernel(uint32_t kernel, bf16* __restrict__ out, unsigned char* __restrict__ img, ATP_PARAMS) {
    extern __shared__ __align__(16) unsigned char atp_dyn[];
    __shared__ AtpShared sh;
    AttLaunch a = att_launch(out, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride, num_q_heads,
                             num_kv_heads, head_dim, block_size, max_blocks, num_slots, scale, gated, n_groups,
                             kv_fp8);
    if constexpr (!SPLIT) {
        // Blocks, not clusters, take the items.
        a.n_clusters = gridDim.x;
        a.cluster = blockIdx.x;
        a.split = 0;
        a.nk = a.cluster < a.n_items ? (a.n_items - a.cluster + a.n_clusters - 1) / a.n_clusters : 0;
    }
    const uint32_t width = num_q_heads * head_dim, steps = (width + 63) / 64;
    const uint32_t dp = att_padded_dim(head_dim);
    const uint32_t rpi = atp_rows_per_item(a.hb, dp);
    if (!att_launch_ok(a, num_kv_heads, SPLIT ? ATPS_THREADS : ATP_THREADS,
                       SPLIT ? atp_split_shared_bytes(dp) : atp_shared_bytes(dp))) {
        mt_fault(kernel, MT_FAULT_GEOMETRY);
        if (num_q_heads == 0) return;
        for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
            for (uint32_t i = threadIdx.x; i < width; i += blockDim.x)
                atp_store(out, img, steps, width, r, i, bf16_nan());
        return;
    }

    // Each item's rows, sequence and context (0 when the group is malformed or its inputs are
    // out of range: a group must be 1..rpi rows of one sequence whose contexts span the same
    // units).
    for (uint32_t k = threadIdx.x; k < a.nk; k += blockDim.x) {
        // Item number n_items - 1 - (block + k * blocks): the later row groups, whose contexts
        // are longer, first.
        const uint32_t n = a.n_items - 1 - (a.cluster + k * a.n_clusters);
        const uint32_t gi = n / a.groups, h0 = (n % a.groups) * a.hb, kv = (h0 / a.group) * a.d;
        const uint32_t r = row_groups[2 * gi], cnt = row_groups[2 * gi + 1];
        bool ok = cnt >= 1 && cnt <= rpi && r < rows && cnt <= rows - r;
        const uint32_t seq = ok ? row_seq[r] : 0, ctx0 = ok ? positions[r] + 1 : 0;
        uint32_t ctx = ctx0;
        sh.grp[k][2] = ctx0;
        for (uint32_t i = 1; ok && i < cnt; ++i) {
            const uint32_t ci = positions[r + i] + 1;
            ok = row_seq[r + i] == seq && ci != 0 && (ci - 1) / ATT_UNIT == (ctx0 - 1) / ATT_UNIT;
            ctx = max(ctx, ci);
            sh.grp[k][2 + i] = ci;
        }
        sh.grp[k][0] = r;
        // A malformed group writes NaN to the rows it names that exist, at most rpi.
        sh.grp[k][1] = r < rows ? min(min(cnt, rows - r), rpi) : 0;
        ok = ok && seq < num_seqs && ctx0 != 0 && (ctx + block_size - 1) / block_size <= max_blocks;
        sh.seq[k] = ok ? seq : 0;
        sh.ctx[k] = ok ? ctx : 0;
        sh.h0[k] = h0;
        sh.kv[k] = kv;
    }
    if (threadIdx.x == 0) {
        sh.img = img;
        sh.img_steps = steps;
        att_kv_scales(sh.kv2, k_scale, v_scale);
    }
    __syncthreads();

    att_by_dim(dp, [&](auto dim) {
        constexpr int DP = decltype(dim)::value;
        if constexpr (SPLIT) {
            if (kv_fp8 != 0)
                atp_run_split<DP, true>(a, atp_dyn, sh);
            else
                atp_run_split<DP, false>(a, atp_dyn, sh);
        } else {
            if (kv_fp8 != 0)
                atp_run<DP, true>(a, atp_dyn, sh);
            else
                atp_run<DP, false>(a, atp_dyn, sh);
        }
    });
}

extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(ATP_THREADS, 2)
    paged_attention_prefill(PAGED_ATTENTION_PREFILL_PARAMS) {
    atp_kernel<false>(MT_KERNEL_PAGED_ATTENTION_PREFILL, out, nullptr, ATP_ARGS);
}

extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(ATP_THREADS, 2)
    paged_attention_prefill_staged(PAGED_ATTENTION_PREFILL_PARAMS) {
    // `out`: the images.
    atp_kernel<false>(MT_KERNEL_PAGED_ATTENTION_PREFILL_STAGED, nullptr, reinterpret_cast<unsigned char*>(out),
                      ATP_ARGS);
}

extern "C" __global__ void __cluster_dims__(ATT_SPLITS, 1, 1) __launch_bounds__(ATPS_THREADS, 1)
    paged_attention_prefill_split(PAGED_ATTENTION_PREFILL_PARAMS) {
    atp_kernel<true>(MT_KERNEL_PAGED_ATTENTION_PREFILL_SPLIT, out, nullptr, ATP_ARGS);
}

extern "C" __global__ void __cluster_dims__(ATT_SPLITS, 1, 1) __launch_bounds__(ATPS_THREADS, 1)
    paged_attention_prefill_split_staged(PAGED_ATTENTION_PREFILL_PARAMS) {
    atp_kernel<true>(MT_KERNEL_PAGED_ATTENTION_PREFILL_SPLIT_STAGED, nullptr, reinterpret_cast<unsigned char*>(out),
                     ATP_ARGS);
}
