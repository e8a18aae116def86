// Causal attention of each row over its sequence's paged KV cache, on the tensor cores. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/attention.rs.
//
// Items and clusters: an item is (row, group of hb query heads sharing one key/value head); hb
// (`att_heads_per_block`) is the largest divisor of the GQA group size up to ATT_HB, so each key
// and value is read from memory once for all hb heads. The kernel is compiled with clusters of
// ATT_SPLITS blocks; cluster c of C loops over items c, c + C, c + 2C, ... (persistent: the
// launcher, ops::paged_attention, makes C about as many clusters as are resident at once, and
// more when a cluster would get over ATT_MAX_ITEMS items). Grid (ATT_SPLITS * C, 1), ATT_THREADS
// (4 warps) threads, att_dyn_bytes(dp, hb, 2) of dynamic shared memory (dp: head_dim padded to
// 32, 64, 128 or 256). Which cluster computes an item, and when, never changes its result.
//
// One item: the row's context (positions 0..=pos, ctx tokens) is cut into units of ATT_UNIT (16)
// tokens at absolute positions 16u..16u+15 (the last one partial). Block `s` of the cluster takes
// units [s * U / ATT_SPLITS, (s + 1) * U / ATT_SPLITS) (U = ceil(ctx / 16)), and warp w of the
// block every ATT_WARPS-th of those, starting at the w-th. Per unit a warp computes
// - scores S = Q Kᵀ with mma.sync m16n8k16 (bf16 in, f32 accumulate) as Sᵀ = K Qᵀ: the 16 tokens
//   are the M rows, the query heads (up to 8; those past hb are zero) the n-tile, head_dim the k
//   steps (two accumulation chains, even and odd k steps, added at the end); queries and keys
//   come from shared memory through ldmatrix;
// - an online softmax in f32 (base 2 on ex2.approx.ftz, the scale folded into log2 e) per head;
//   the probabilities are rounded to bf16 and the running sum adds the rounded values, as four
//   partial sums per head (tokens 2i, 2i + 1, 2i + 8, 2i + 9 of each unit) added at the end;
// - O += P V as Oᵀ += Vᵀ Pᵀ (V through ldmatrix.trans, Pᵀ from the score registers through
//   movmatrix), the running outputs rescaled first unless no head's maximum moved (multiplying by
//   1 is exact).
// The transposed tiles hold no zero rows (the hb heads padded to 16 M rows did: twice the MMAs
// and the register moves to zero them). An MMA's output is the same sum of the same products
// whichever operand is A, so the arithmetic, and every bit of the result, is that of the
// untransposed layout `paged_attention_prefill` keeps (att_softmax_row).
// The block then combines its warps in warp order, and the cluster its blocks through distributed
// shared memory in block order (0, 1, ..., ATT_SPLITS - 1), sums as explicit fmaf chains; the
// gate (Qwen3.5) multiplies last.
// Every split, unit and order is fixed by the row's context length and the shape (head_dim,
// group size), never by the number of rows or clusters, so a row's result is bitwise the same
// whatever the batch and whether it comes in a prefill chunk or a decode step, and runs are
// deterministic.
//
// Streaming: each warp copies its units (the 16 keys and values, cp.async with zero-fill for
// dead tokens; plain loads when head_dim or a stride is not a multiple of 8) into its own ring of
// ATT_STAGES stages in shared memory, one commit group per unit, reading each unit's block-table
// entries one unit ahead, and keeps the ring full across items: while a block combines item k,
// the copies of item k + 1 are in flight. An item's hb query rows are copied once per warp, with
// its first unit, into one of the warp's two query slots (alternating over the items the warp
// has units of: the ring holds units of at most two items). Each item's row, heads, sequence,
// context and unit range are worked out once per launch, into shared memory. The cluster barrier
// is split: a block arrives once it has combined item k and waits only after its units of item
// k + 1, then reads item k's partials from the cluster and writes its share of the outputs (the
// combine buffers alternate by item parity), so blocks do not idle at the barrier.
//
// `paged_attention_flat` (below) computes the same items without the cluster: a block takes
// whole items, its splits one after another, for steps with an item for every block.
//
// `paged_attention_prefill` (attention_prefill.cuh) computes the same per-row arithmetic for the
// rows of a prefill chunk, sixteen warps to a block and up to 64 virtual rows to an item, so each
// key and value is read once for many rows; a row's result is bitwise this kernel's.
//
// Rows whose inputs are out of range (sequence past the block tables, a context longer than
// max_blocks, a slot past num_slots) get NaN outputs, as does every row of a launch the kernel
// cannot run (head_dim > ATT_MAX_D, heads that do not group, a wrong block size, too little
// shared memory, too many items per cluster); the CPU twin fails instead.
#include "common.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#include "attention_unit.cuh"

// Query slots per warp: an item's query rows stay while its units are computed, and the ring of
// ATT_STAGES = 2 units holds units of at most two items.
#define ATT_QSLOTS 2

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

// att_copy_unit's copy for one warp (a unit inside one block, the vector path), each lane on
// fixed chunks of a few rows: L = min(8, dp / 8) lanes to a row, so a warp-wide copy reads 32 / L
// rows of 16 L contiguous bytes, and a lane's chunks of one row sit at offsets the compiler knows
// (the row stride, num_kv_heads * head_dim, is a launch argument: stepping it costs two 64-bit
// adds, once per row group instead of once per chunk).
// The copies are evicted from L2 first (a decode step reads each key once). Returns whether a
// slot is past the pool (uniform).
template <int DP>
MT_DEVICE bool att_copy_rows(const AttLaunch& a, const bf16* kb, const bf16* vb, uint32_t unit, uint32_t ctx,
                             uint32_t entry, uint32_t lane, bf16* ks, bf16* vs) {
    constexpr uint32_t RS = DP + 8, NCH = DP / 8, L = NCH < 8 ? NCH : 8, RPI = 32 / L, H = NCH / L;
    uint64_t base;
    uint32_t live;
    const bool bad = att_unit_span(a, unit, ctx, entry, base, live);
    const uint32_t r0 = lane / L, c0 = lane % L;
    const size_t off0 = (size_t)(base + r0) * a.width + 8 * c0, step = (size_t)RPI * a.width;
    const bf16* kp = kb + off0;
    const bf16* vp = vb + off0;
    const uint64_t policy = l2_evict_first_policy();
#pragma unroll
    for (uint32_t rg = 0; rg < ATT_UNIT / RPI; ++rg) {
        const uint32_t row = rg * RPI + r0;
        const bool on = row < live;
#pragma unroll
        for (uint32_t h = 0; h < H; ++h) {
            const uint32_t col = 8 * (c0 + L * h);
            const uint32_t bytes = on && col < a.d ? 16u : 0u;
            cp_async16_hint(ks + row * RS + col, kp + L * 8 * h, bytes, policy);
            cp_async16_hint(vs + row * RS + col, vp + L * 8 * h, bytes, policy);
        }
        kp += step;
        vp += step;
    }
    return bad;
}

// Copy the keys and values of unit `unit` of item `it` (its 16 tokens) into `stage` (cp.async on
// the vector path, plain loads otherwise); dead tokens and padded dimensions become zeros.
// Returns whether a slot was past the pool (uniform).
template <int DP>
MT_DEVICE bool att_issue(const AttLaunch& a, const AttItem& it, uint32_t unit, uint32_t entry,
                         bf16* stage, uint32_t lane) {
    constexpr int RS = DP + 8, NCH = DP / 8;
    bf16* ks = stage;
    bf16* vs = ks + ATT_UNIT * RS;
    const bf16* kb = a.k_cache + it.kv;
    const bf16* vb = a.v_cache + it.kv;
    if (a.vec && a.unit_blocks) return att_copy_rows<DP>(a, kb, vb, unit, it.ctx, entry, lane, ks, vs);
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

// One unit of a warp (its keys and values in `stage`, the item's queries in slot `qslot`), with
// every tile transposed so no MMA carries zero rows: scores Sᵀ = K Qᵀ (tokens x heads), the
// online softmax of heads 2c and 2c + 1 (m, l: lane (g, c) holds their maxima, and their
// partial sums over tokens 2(g / 2), +1, +8, +9), and Oᵀ += Vᵀ Pᵀ into `o` (o[t] holds dims
// 16 t + g and 16 t + g + 8 of heads 2c and 2c + 1). Each score, probability, partial sum and
// output is computed by the same operations on the same operands, in the same order, as
// att_softmax_row's layout computes it (paged_attention_prefill uses that one), so the two
// kernels stay bitwise equal; only which lane holds what differs.
template <int DP>
MT_DEVICE void att_unit(const bf16* stage, const bf16* qslot, uint32_t unit, uint32_t ctx, float scale_log2,
                        bool first, uint32_t lane, float (&o)[DP / 16][4], float (&m)[2], float (&l)[2]) {
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
// numerators `ps`, combined in split order (the last step of both decode kernels).
MT_DEVICE bf16 att_combine_splits(const AttLaunch& a, uint32_t row, uint32_t h, uint32_t e,
                                  const float (&ms)[ATT_SPLITS], const float (&ls)[ATT_SPLITS],
                                  const float (&ps)[ATT_SPLITS]) {
    float wt[ATT_SPLITS];
    const float den = att_split_weights(ms, ls, wt);
    const size_t gate_off = (size_t)row * a.row_stride + (size_t)h * a.q_head_stride + a.d + e;
    return att_finish(wt, ps, den, a.gated ? a.qkv + gate_off : nullptr);
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

// The block's combine of its warps' partials of one split, in warp order (after a barrier that
// follows every warp's att_warp_partial): the numerators into `pk` [hb][DP], each head's
// maximum and sum into `cm`, `cl` (a NaN sum when a slot was past the pool). Warp w takes heads
// w, w + ATT_WARPS, ...: each lane works out a head's weights once and applies them to its DP / 32
// dimensions (weights worked out per output cost a third of the flat kernel's time).
template <int DP>
MT_DEVICE void att_block_combine(const AttLaunch& a, const float* ow, const float (&wm)[ATT_WARPS][ATT_HB],
                                 const float (&wl)[ATT_WARPS][ATT_HB], bool bad, float* pk, float* cm, float* cl) {
    const uint32_t lane = threadIdx.x & 31;
    for (uint32_t h = threadIdx.x >> 5; h < a.hb; h += ATT_WARPS) {
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, wm[w][h]);
        float wt[ATT_WARPS];
        float den = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; ++w) {
            wt[w] = att_weight(wm[w][h], mx);
            den = fmaf(wt[w], wl[w][h], den);
        }
#pragma unroll
        for (uint32_t e = lane; e < DP; e += 32) {
            float num = 0.0f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) num = fmaf(wt[w], ow[(w * a.hb + h) * DP + e], num);
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

// A warp's units first, first + ATT_WARPS, ... (`mine` of them) of a context of `ctx` tokens,
// from its ring, into fresh running outputs `o`, maxima `m` and sums `l` (att_unit's); `issue`
// refills each stage once it has been read. `consumed` counts the warp's units (its ring
// position). Returns whether a unit's slot was past the pool (`bad_bits`, by stage, as the
// issuing left them).
template <int DP, typename Issue>
MT_DEVICE bool att_warp_units(const AttLaunch& a, const bf16* ring, const bf16* qslot, uint32_t first,
                              uint32_t mine, uint32_t ctx, const uint32_t& bad_bits, uint32_t& consumed,
                              uint32_t lane, float (&o)[DP / 16][4], float (&m)[2], float (&l)[2],
                              Issue&& issue) {
#pragma unroll
    for (int t = 0; t < DP / 16; ++t) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.0f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.0f;
    bool bad = false;
    for (uint32_t i = 0; i < mine; ++i) {
        cp_async_wait<ATT_STAGES - 1>();
        __syncwarp();
        const uint32_t st = consumed % ATT_STAGES;
        att_unit<DP>(ring + st * AttWarpLayout<DP>::STAGE, qslot, first + ATT_WARPS * i, ctx, a.scale_log2, i == 0,
                     lane, o, m, l);
        bad = bad || ((bad_bits >> st) & 1u) != 0;
        __syncwarp();
        issue(st);
        ++consumed;
    }
    return bad;
}

// Copy unit `unit` of item `it` into stage `st` of `ring` (att_issue), recording in `bad_bits`
// (a bit per stage) whether one of its slots was past the pool.
template <int DP>
MT_DEVICE void att_issue_stage(const AttLaunch& a, const AttItem& it, uint32_t unit, uint32_t entry, bf16* ring,
                               uint32_t st, uint32_t lane, uint32_t& bad_bits) {
    const bool bad = att_issue<DP>(a, it, unit, entry, ring + st * AttWarpLayout<DP>::STAGE, lane);
    bad_bits = (bad_bits & ~(1u << st)) | ((bad ? 1u : 0u) << st);
}

// The start of a warp's stream of units: its first unit's table entries (`settle`, step inputs
// no kernel writes), the wait for the kernel ahead (the cache store), then ATT_STAGES units
// queued (`issue`).
template <typename Settle, typename Issue>
MT_DEVICE void att_stream_start(Settle&& settle, Issue&& issue) {
    settle();
    pdl_wait();  // the cache store ahead has written the step's keys and values
    pdl_trigger();
#pragma unroll
    for (uint32_t st = 0; st < ATT_STAGES; ++st) issue(st);
}

// Where a warp's stream of units stands: unit `i` of the warp's units of item `k`, with the
// block-table entries it needs already requested (att_entry); `qn` counts the items whose
// queries it has copied (the next goes to slot qn % ATT_QSLOTS).
struct AttCursor {
    uint32_t k, i, entry, qn;
    AttItem it;
};

// Not inlined: each head_dim gets its own register allocation (inlined into one body, the four
// shared one and the 256-wide path spilled).
template <int DP>
__device__ __noinline__ void att_run(const AttLaunch a, unsigned char* dyn, AttShared& sh) {
    using L = AttWarpLayout<DP>;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // The partials: buf.part is [2][hb][DP], by item parity (read by the cluster).
    const AttBuffers buf = att_buffers<DP>(dyn, a.hb, warp, lane);

    // The warp's stream of units over the cluster's items runs ATT_STAGES units ahead of the
    // computing, across items; each unit's block-table entries are read one unit earlier still.
    AttCursor f{};
    if (a.nk > 0) f.it = att_item(sh.item, 0, warp);
    auto settle = [&]() {  // move to the next unit that exists and read its table entries
        while (f.k < a.nk && f.i >= f.it.mine) {
            ++f.k;
            f.i = 0;
            if (f.k < a.nk) f.it = att_item(sh.item, f.k, warp);
        }
        if (f.k < a.nk) f.entry = att_entry(a, f.it.seq, f.it.first + ATT_WARPS * f.i, f.it.ctx, lane);
    };
    uint32_t bad_bits = 0;
    auto issue_next = [&](uint32_t st) {
        if (f.k < a.nk) {
            if (f.i == 0) att_issue_queries<DP>(a, f.it, buf.qslots + (f.qn++ % ATT_QSLOTS) * L::QSLOT, lane);
            att_issue_stage<DP>(a, f.it, f.it.first + ATT_WARPS * f.i, f.entry, buf.ring, st, lane, bad_bits);
            ++f.i;
            settle();
        }
        cp_async_commit();
    };
    att_stream_start(settle, issue_next);

    // Per item: the warps' units, then (once every block has arrived for the item before) the
    // cluster's combine and output of the item before, then the block's combine of this item
    // and an arrival; the cluster waits one item late, so no block idles at the barrier.
    uint32_t consumed = 0, qused = 0;
    AttItem prev;
    prev.ctx = 0;
    AttOut pending;
    pending.n = 0;
    for (uint32_t k = 0; k < a.nk; ++k) {
        const AttItem it = att_item(sh.item, k, warp);
        const bf16* qslot = buf.qslots + (qused % ATT_QSLOTS) * L::QSLOT;
        if (it.mine > 0) ++qused;
        float o[DP / 16][4], m[2], l[2];
        const bool bad =
            att_warp_units<DP>(a, buf.ring, qslot, it.first, it.mine, it.ctx, bad_bits, consumed, lane, o, m, l, issue_next);
        const uint32_t p = k & 1;
        if (k > 0) {
            // Every block has combined item k - 1, and so has read all of item k - 2 (whose
            // buffers, of parity p, this item reuses).
            cluster_wait();
            pending = att_output<DP>(a, prev, p ^ 1u, sh, buf.part + (p ^ 1u) * a.hb * DP);
            if (tid == 0) sh.bad[p ^ 1u] = 0;
        }

        // The block's warps in warp order.
        float* pk = buf.part + p * a.hb * DP;
        att_warp_partial<DP>(a, o, m, l, buf.ow, sh.wm, sh.wl, warp, lane);
        if (bad && lane == 0) sh.bad[p] = 1;
        __syncthreads();
        att_block_combine<DP>(a, buf.ow, sh.wm, sh.wl, sh.bad[p] != 0, pk, sh.cm[p], sh.cl[p]);
        cluster_publish_arrive();
        att_store(a, pending);
        pending.n = 0;
        prev = it;
    }
    cp_async_wait<0>();
    if (a.nk > 0) {
        cluster_wait();
        const uint32_t p = (a.nk - 1) & 1;
        pending = att_output<DP>(a, prev, p, sh, buf.part + p * a.hb * DP);
    }
    // Keep this block's shared memory alive until every block of the cluster has read it.
    att_store(a, pending);
    cluster_leave_barrier();
}

// paged_attention(out: bf16 [rows, num_q_heads * head_dim], qkv: bf16 [rows, row_stride],
// k_cache, v_cache: bf16 [num_slots, num_kv_heads, head_dim], block_tables: u32 [num_seqs,
// max_blocks], row_seq: u32 [rows], positions: u32 [rows], rows, row_stride, q_head_stride,
// num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_seqs, num_slots, scale, gated).
extern "C" __global__ void __cluster_dims__(ATT_SPLITS, 1, 1) __launch_bounds__(ATT_THREADS)
    paged_attention(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                    const uint32_t* __restrict__ block_tables,
                    const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ positions,
                    uint32_t rows, uint32_t row_stride, uint32_t q_head_stride,
                    uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,
                    uint32_t block_size, uint32_t max_blocks, uint32_t num_seqs,
                    uint32_t num_slots, float scale, uint32_t gated) {
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ AttShared sh;
    // A programmatic dependent at decode sizes (ops_attention.rs). The cache store ahead of it
    // lets these blocks start only once it has waited for its own predecessor, and at more than
    // two rows only when it ends (pdl_enter_store: two blocks of this kernel take nearly all of a
    // multiprocessor's shared memory, and a cluster that cannot be placed beside that kernel's
    // blocks waits for a whole other cluster). So everything but the cache slots the store
    // writes is in place when this kernel starts: the step's inputs (row sequences, positions,
    // block tables; no kernel writes them) are read before pdl_wait (here and in att_run), the
    // queries, keys and values after it.
    const AttLaunch a = att_launch(out, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride,
                                   num_q_heads, num_kv_heads, head_dim, block_size, max_blocks,
                                   num_slots, scale, gated, rows);
    const uint32_t dp = att_padded_dim(head_dim);
    if (!att_launch_ok(a, num_kv_heads, ATT_THREADS, att_dyn_bytes(dp, a.hb, 2))) {
        att_nan_items(a, a.split, ATT_SPLITS);
        return;
    }

    // Each item's record (context 0 when the row's inputs are out of range).
    for (uint32_t k = threadIdx.x; k < a.nk; k += ATT_THREADS) {
        AttItemRec r;
        att_item_at(a, k, r.row, r.h0, r.kv);
        att_row_context(row_seq, positions, r.row, num_seqs, block_size, max_blocks, r.seq, r.ctx);
        att_split_units(r.ctx, a.split, r.ub, r.ue);
        r.pad = 0;
        sh.item[k] = r;
    }
    if (threadIdx.x == 0) sh.bad[0] = sh.bad[1] = 0;
    __syncthreads();

    att_by_dim(dp, [&](auto dim) { att_run<decltype(dim)::value>(a, att_dyn, sh); });
}

// ---------------------------------------------------------------------------------------------
// paged_attention_flat: the same function as paged_attention, bitwise, without the cluster.
//
// A block computes whole items: its warps take the units paged_attention's warps take in every
// split, one split after another (warp w of split s takes att_units(ctx, s, w)), and the block
// combines each split's warps in warp order (att_block_combine, into that split's numerators in
// shared memory), then an item's splits in split order (att_split_weights, att_finish). So every partial,
// and every combine, is paged_attention's, in the same order: only the places differ (shared
// memory of one block instead of the cluster's distributed shared memory). Blocks are
// persistent: block b of B takes items b, b + B, ...; each warp's ring runs across splits and
// items as in paged_attention.
//
// Why: at short contexts each block of a paged_attention cluster gets a unit or two of an item,
// and the cluster's barrier and combine cost more than the units (Qwen3-8B, 64 rows of context
// 385: 55 us against 24 at the copy rate; this kernel 37). Here a block's items are its own, and
// many blocks' items are in flight at once. At one row and a few rows the cluster kernel keeps
// every multiprocessor busy where this one would not (an item here is a chain of eight splits,
// each waiting on its units: 17 us for one row of context 385): the launcher (ops_attention)
// picks by items.
//
// Grid (B, 1), cluster dims (1, 1, 1) (so the launcher can ask the driver how many blocks are
// resident), ATT_THREADS threads, att_dyn_bytes(dp, hb, ATT_SPLITS) of dynamic shared memory.

// Item k of this block: (row, group of hb query heads), its key/value head's offset in a slot,
// the row's sequence and context (0: out of range).
struct AtfItemRec {
    uint32_t row, h0, kv, seq, ctx;
};

struct AtfShared {
    float wm[ATT_WARPS][ATT_HB], wl[ATT_WARPS][ATT_HB];  // each warp's max and sum per head
    float cm[ATT_SPLITS][ATT_HB], cl[ATT_SPLITS][ATT_HB];  // each split's, of the current item
    AtfItemRec item[ATT_MAX_ITEMS];
    int bad[2];  // a slot past the pool was seen, by split parity
};

// Whether warp `warp` takes any unit of a context of `ctx` tokens in any split.
MT_DEVICE bool atf_warp_has_units(uint32_t ctx, uint32_t warp) {
    bool any = false;
#pragma unroll
    for (uint32_t s = 0; s < ATT_SPLITS; ++s) {
        uint32_t first, mine;
        att_units(ctx, s, warp, first, mine);
        any = any || mine > 0;
    }
    return any;
}

// Where a warp's stream of units stands: unit `i` of its units in split `s` of item `k` (`first`,
// `mine`: that split's units of the warp), with the block-table entries it needs already
// requested; `qk` is the item whose queries it copied last, `qn` counts the items whose queries
// it has copied.
struct AtfCursor {
    uint32_t k, s, i, first, mine, entry, qk, qn;
    AtfItemRec it;
};

template <int DP>
__device__ __noinline__ void atf_run(const AttLaunch a, unsigned char* dyn, AtfShared& sh) {
    using L = AttWarpLayout<DP>;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // The partials: buf.part is [ATT_SPLITS][hb][DP], an item's splits.
    const AttBuffers buf = att_buffers<DP>(dyn, a.hb, warp, lane);

    AtfCursor f{};
    f.qk = 0xFFFFFFFFu;  // no item's queries copied yet
    if (a.nk > 0) {
        f.it = sh.item[0];
        att_units(f.it.ctx, 0, warp, f.first, f.mine);
    }
    // Move to the next unit that exists and read its table entries. (Written with a `break`
    // out of the loop at the last item, nvcc 13 compiled the next item's record load at the
    // wrong index and the blocks stopped after their first item.)
    auto settle = [&]() {
        while (f.k < a.nk && f.i >= f.mine) {
            f.i = 0;
            ++f.s;
            if (f.s == ATT_SPLITS) {
                f.s = 0;
                ++f.k;
                if (f.k < a.nk) f.it = sh.item[f.k];
            }
            if (f.k < a.nk) att_units(f.it.ctx, f.s, warp, f.first, f.mine);
        }
        if (f.k < a.nk) f.entry = att_entry(a, f.it.seq, f.first + ATT_WARPS * f.i, f.it.ctx, lane);
    };
    uint32_t bad_bits = 0;
    auto issue_next = [&](uint32_t st) {
        if (f.k < a.nk) {
            AttItem it;
            it.row = f.it.row;
            it.h0 = f.it.h0;
            it.kv = f.it.kv;
            it.seq = f.it.seq;
            it.ctx = f.it.ctx;
            if (f.qk != f.k) {
                att_issue_queries<DP>(a, it, buf.qslots + (f.qn++ % ATT_QSLOTS) * L::QSLOT, lane);
                f.qk = f.k;
            }
            att_issue_stage<DP>(a, it, f.first + ATT_WARPS * f.i, f.entry, buf.ring, st, lane, bad_bits);
            ++f.i;
            settle();
        }
        cp_async_commit();
    };
    att_stream_start(settle, issue_next);

    uint32_t consumed = 0, qused = 0;
    for (uint32_t k = 0; k < a.nk; ++k) {
        const AtfItemRec it = sh.item[k];
        const bf16* qslot = buf.qslots + (qused % ATT_QSLOTS) * L::QSLOT;
        if (atf_warp_has_units(it.ctx, warp)) ++qused;
        for (uint32_t s = 0; s < ATT_SPLITS; ++s) {
            uint32_t first, mine;
            att_units(it.ctx, s, warp, first, mine);
            float o[DP / 16][4], m[2], l[2];
            const bool bad =
                att_warp_units<DP>(a, buf.ring, qslot, first, mine, it.ctx, bad_bits, consumed, lane, o, m, l, issue_next);
            att_warp_partial<DP>(a, o, m, l, buf.ow, sh.wm, sh.wl, warp, lane);
            if (bad && lane == 0) sh.bad[s & 1] = 1;
            __syncthreads();
            att_block_combine<DP>(a, buf.ow, sh.wm, sh.wl, sh.bad[s & 1] != 0, buf.part + s * a.hb * DP, sh.cm[s], sh.cl[s]);
            // Every thread has read the warps' partials (rewritten for the next split) and this
            // split's flag (set again two splits on, after the next barrier).
            __syncthreads();
            if (tid == 0) sh.bad[s & 1] = 0;
        }
        // The item's outputs: its splits in split order, warp w taking heads w, w + ATT_WARPS,
        // ... (a head's split weights worked out once a lane).
        for (uint32_t h = warp; h < a.hb; h += ATT_WARPS) {
            float ms[ATT_SPLITS], ls[ATT_SPLITS], wt[ATT_SPLITS];
#pragma unroll
            for (int s = 0; s < ATT_SPLITS; ++s) {
                ms[s] = sh.cm[s][h];
                ls[s] = sh.cl[s][h];
            }
            const float den = att_split_weights(ms, ls, wt);
            bf16* o = a.out + ((size_t)it.row * a.hq + it.h0 + h) * a.d;
            const bf16* gate = a.qkv + (size_t)it.row * a.row_stride + (size_t)(it.h0 + h) * a.q_head_stride + a.d;
            for (uint32_t e = lane; e < a.d; e += 32) {
                float ps[ATT_SPLITS];
#pragma unroll
                for (int s = 0; s < ATT_SPLITS; ++s) ps[s] = buf.part[(s * a.hb + h) * DP + e];
                o[e] = it.ctx != 0 ? att_finish(wt, ps, den, a.gated ? gate + e : nullptr) : bf16_nan();
            }
        }
    }
    cp_async_wait<0>();
}

// paged_attention_flat(the arguments of paged_attention): paged_attention's outputs, bitwise.
extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(ATT_THREADS)
    paged_attention_flat(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                         const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                         const uint32_t* __restrict__ block_tables,
                         const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ positions,
                         uint32_t rows, uint32_t row_stride, uint32_t q_head_stride,
                         uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,
                         uint32_t block_size, uint32_t max_blocks, uint32_t num_seqs,
                         uint32_t num_slots, float scale, uint32_t gated) {
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ AtfShared sh;
    // A programmatic dependent as paged_attention is (see there): step inputs before pdl_wait.
    AttLaunch a = att_launch(out, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride,
                             num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_slots,
                             scale, gated, rows);
    // Blocks, not clusters, take the items.
    a.n_clusters = gridDim.x;
    a.cluster = blockIdx.x;
    a.split = 0;
    a.nk = a.cluster < a.n_items ? (a.n_items - a.cluster + a.n_clusters - 1) / a.n_clusters : 0;
    const uint32_t dp = att_padded_dim(head_dim);
    if (!att_launch_ok(a, num_kv_heads, ATT_THREADS, att_dyn_bytes(dp, a.hb, ATT_SPLITS))) {
        att_nan_items(a, 0, 1);
        return;
    }
    for (uint32_t k = threadIdx.x; k < a.nk; k += ATT_THREADS) {
        AtfItemRec r;
        att_item_at(a, k, r.row, r.h0, r.kv);
        att_row_context(row_seq, positions, r.row, num_seqs, block_size, max_blocks, r.seq, r.ctx);
        sh.item[k] = r;
    }
    if (threadIdx.x == 0) sh.bad[0] = sh.bad[1] = 0;
    __syncthreads();

    att_by_dim(dp, [&](auto dim) { atf_run<decltype(dim)::value>(a, att_dyn, sh); });
}

#include "attention_prefill.cuh"
