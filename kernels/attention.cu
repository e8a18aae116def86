// Causal attention of each row over its sequence's paged KV cache, on the tensor cores. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/attention.rs.
//
// Items and clusters: an item is (row, group of hb query heads sharing one key/value head); hb
// (`att_heads_per_block`) is the largest divisor of the GQA group size up to ATT_HB, so each key
// and value is read from memory once for all hb heads. The kernel is compiled with clusters of
// ATT_SPLITS blocks; cluster c of C loops over items c, c + C, c + 2C, ... (persistent: the
// launcher, ops::paged_attention, makes C about as many clusters as are resident at once, and
// more when a cluster would get over ATT_MAX_ITEMS items). Grid (ATT_SPLITS * C, 1), ATT_THREADS
// (4 warps) threads, att_shared_bytes(dp, hb) of dynamic shared memory (dp: head_dim padded to
// 32, 64, 128 or 256). Which cluster computes an item, and when, never changes its result.
//
// One item: the row's context (positions 0..=pos, ctx tokens) is cut into units of ATT_UNIT (16)
// tokens at absolute positions 16u..16u+15 (the last one partial). Block `s` of the cluster takes
// units [s * U / ATT_SPLITS, (s + 1) * U / ATT_SPLITS) (U = ceil(ctx / 16)), and warp w of the
// block every ATT_WARPS-th of those, starting at the w-th. Per unit a warp computes
// - scores S = Q Kᵀ with mma.sync m16n8k16 (bf16 in, f32 accumulate): the hb query heads are the
//   M rows 0..hb-1 (rows hb..15 are zero), the 16 tokens two n-tiles, head_dim the k steps (two
//   accumulation chains, even and odd k steps, added at the end); queries and keys come from
//   shared memory through ldmatrix;
// - an online softmax in f32 (base 2 on ex2.approx.ftz, the scale folded into log2 e) per head
//   over the quad of lanes holding its row; the probabilities are rounded to bf16 and the running
//   sum adds the rounded values;
// - O += P V with mma.sync (P from the score registers, V through ldmatrix.trans), the running
//   outputs rescaled first unless no row's maximum moved (multiplying by 1 is exact).
// The block then combines its warps in warp order, and the cluster its blocks through distributed
// shared memory in block order (0, 1, ..., ATT_SPLITS - 1), sums as explicit fmaf chains; the
// gate (Qwen3.5) multiplies last.
// Every split, unit and order is fixed by the row's context length and the shape (head_dim,
// group size), never by the number of rows or clusters, so a row's result is bitwise the same
// whatever the batch and whether it comes in a prefill chunk or a decode step, and runs are
// deterministic.
//
// Streaming: each warp copies its units (the hb query rows and the 16 keys and values, cp.async
// with zero-fill for dead tokens; plain loads when head_dim or a stride is not a multiple of 8)
// into its own ring of ATT_STAGES stages in shared memory, one commit group per unit, reading
// each unit's block-table entries one unit ahead, and keeps the ring full across items: while a
// block combines item k, the copies of item k + 1 are in flight. The cluster barrier is split:
// a block arrives once it has combined item k and waits only after its units of item k + 1, then
// reads item k's partials from the cluster and writes its share of the outputs (the combine
// buffers alternate by item parity), so blocks do not idle at the barrier.
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

// Dynamic shared memory: every warp's ring of ATT_STAGES stages, each a unit's hb (of ATT_HB)
// query rows, 16 key rows and 16 value rows of dp + 8 bf16 (the 16-byte pad puts the 8 rows of
// every ldmatrix in distinct banks); then the warps' f32 partials [ATT_WARPS][hb][dp] and the
// block's, by item parity, [2][hb][dp]. The launcher computes the same.
MT_DEVICE uint32_t att_shared_bytes(uint32_t dp, uint32_t hb) {
    return ATT_WARPS * ATT_STAGES * (ATT_HB + 2u * ATT_UNIT) * (dp + 8u) * 2u +
           (ATT_WARPS + 2u) * hb * dp * 4u;
}

// Item k of this cluster: (row, group of hb query heads) number cluster + k * n_clusters, and
// the units of it this block's warp `warp` takes. `ctx` is the row's context (0: out of range).
struct AttItem {
    uint32_t row, h0, kv, seq, ctx, first, mine;  // kv: the item's key/value head's offset in a slot
};

MT_DEVICE AttItem att_item(const AttLaunch& a, uint32_t k, const uint32_t* seq_s,
                           const uint32_t* ctx_s, uint32_t warp) {
    AttItem it;
    const uint32_t n = a.cluster + k * a.n_clusters;
    it.row = n / a.groups;
    it.h0 = (n % a.groups) * a.hb;
    it.kv = (it.h0 / a.group) * a.d;
    it.seq = seq_s[k];
    it.ctx = ctx_s[k];  // 0: the row's inputs are out of range
    att_units(it.ctx, a.split, warp, it.first, it.mine);
    return it;
}

// Copy unit `unit` of item `it` into `stage`: the hb query rows (rows hb..7 stay zero), then the
// keys and values of its 16 tokens (cp.async on the vector path, plain loads otherwise); dead
// tokens and padded dimensions become zeros. Returns whether a slot was past the pool (uniform).
template <int DP>
MT_DEVICE bool att_issue(const AttLaunch& a, const AttItem& it, uint32_t unit, uint32_t entry,
                         bf16* stage, uint32_t lane) {
    constexpr int RS = DP + 8, NCH = DP / 8;
    bf16* qs = stage;
    bf16* ks = stage + ATT_HB * RS;
    bf16* vs = ks + ATT_UNIT * RS;
    const bf16* q = a.qkv + (size_t)it.row * a.row_stride + (size_t)it.h0 * a.q_head_stride;
    const bf16* kb = a.k_cache + it.kv;
    const bf16* vb = a.v_cache + it.kv;
    if (a.vec) {
        for (uint32_t idx = lane; idx < a.hb * NCH; idx += 32) {
            const uint32_t h = idx / NCH, ch = idx % NCH;
            if (8 * ch < a.d) cp_async16(qs + h * RS + 8 * ch, q + (size_t)h * a.q_head_stride + 8 * ch, 16u);
        }
    }
    if (a.vec && a.unit_blocks)
        return att_copy_unit<RS, ATT_UNIT * NCH / 32, true>(a, kb, vb, unit, it.ctx, entry, true, lane / NCH, 32 / NCH,
                                                      lane % NCH, ks, vs);
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
        for (uint32_t idx = lane; idx < a.hb * DP; idx += 32) {
            const uint32_t h = idx / DP, e = idx % DP;
            qs[h * RS + e] = e < a.d ? q[(size_t)h * a.q_head_stride + e] : __ushort_as_bfloat16((unsigned short)0);
        }
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

// One unit of a warp: scores, online softmax and P V into (o, m, l) of head g = lane / 4.
template <int DP>
MT_DEVICE void att_unit(const bf16* stage, uint32_t unit, uint32_t ctx, float scale_log2, bool first,
                        uint32_t lane, float (&o)[DP / 8][2], float& m, float& l) {
    constexpr int RS = DP + 8;
    const uint32_t c = lane & 3, mat = lane >> 3, row = lane & 7;
    const uint32_t qs = (uint32_t)__cvta_generic_to_shared(stage);
    const uint32_t ks = qs + ATT_HB * RS * 2;
    const uint32_t vs = ks + ATT_UNIT * RS * 2;

    // S = Q Kᵀ. Query matrices: heads 0-7 x dims 8 mat.. of a 32-dim pair of k steps; key
    // matrices: (tokens 0-7 | 8-15) x (dims 0-7 | 8-15 of the k step). Two accumulation chains
    // (even and odd k steps), added at the end.
    float s[2][2][2] = {};  // [chain][n-tile][c0, c1]
    const uint32_t q_addr = qs + (row * RS + 8 * mat) * 2;
    const uint32_t k_addr = ks + ((row + ((mat >> 1) << 3)) * RS + ((mat & 1) << 3)) * 2;
#pragma unroll
    for (int kp = 0; kp < DP / 32; ++kp) {
        uint32_t qa[4], b0[4], b1[4];
        att_ldsm4(qa, q_addr + kp * 64);
        att_ldsm4(b0, k_addr + (2 * kp) * 32);
        att_ldsm4(b1, k_addr + (2 * kp + 1) * 32);
        att_mma(s[0][0][0], s[0][0][1], qa[0], qa[1], b0[0], b0[1]);
        att_mma(s[0][1][0], s[0][1][1], qa[0], qa[1], b0[2], b0[3]);
        att_mma(s[1][0][0], s[1][0][1], qa[2], qa[3], b1[0], b1[1]);
        att_mma(s[1][1][0], s[1][1][1], qa[2], qa[3], b1[2], b1[3]);
    }

    float corr;
    uint32_t pa[2];
    att_softmax_row(s[0], s[1], unit, ctx, scale_log2, c, m, l, corr, pa);
    const bool rescale = att_rescale(first, corr != 1.0f);

    // O += P V: matrices (tokens 0-7 | 8-15) x (dims 0-7 | 8-15 of the 16-dim step), transposed.
    const uint32_t v_addr = vs + ((row + ((mat & 1) << 3)) * RS + ((mat >> 1) << 3)) * 2;
#pragma unroll
    for (int dd = 0; dd < DP / 16; ++dd) {
        uint32_t b[4];
        att_ldsm4_t(b, v_addr + dd * 32);
        if (rescale) {
            o[2 * dd][0] *= corr;
            o[2 * dd][1] *= corr;
            o[2 * dd + 1][0] *= corr;
            o[2 * dd + 1][1] *= corr;
        }
        att_mma(o[2 * dd][0], o[2 * dd][1], pa[0], pa[1], b[0], b[1]);
        att_mma(o[2 * dd + 1][0], o[2 * dd + 1][1], pa[0], pa[1], b[2], b[3]);
    }
}

// The NaN outputs of an item whose inputs are out of range (this block's share).
MT_DEVICE void att_nan_item(const AttLaunch& a, uint32_t row, uint32_t h0) {
    bf16* o = a.out + ((size_t)row * a.hq + h0) * a.d;
    for (uint32_t i = a.split * ATT_THREADS + threadIdx.x; i < a.hb * a.d; i += ATT_SPLITS * ATT_THREADS)
        o[i] = bf16_nan();
}

// Block-level shared state beside the dynamic buffers.
struct AttShared {
    float wm[ATT_WARPS][ATT_HB], wl[ATT_WARPS][ATT_HB];  // each warp's max and sum per head
    float cm[2][ATT_HB], cl[2][ATT_HB];  // the block's, by item parity (read by the cluster)
    uint32_t seq[ATT_MAX_ITEMS], ctx[ATT_MAX_ITEMS];
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
        float ms[ATT_SPLITS], ls[ATT_SPLITS], ps[ATT_SPLITS], wt[ATT_SPLITS];
#pragma unroll
        for (int s = 0; s < ATT_SPLITS; ++s) {
            ms[s] = cluster.map_shared_rank(&sh.cm[p][0], s)[h];
            ls[s] = cluster.map_shared_rank(&sh.cl[p][0], s)[h];
            ps[s] = cluster.map_shared_rank(pk, s)[h * DP + e];
        }
        float mx = -INFINITY;
#pragma unroll
        for (int s = 0; s < ATT_SPLITS; ++s) mx = fmaxf(mx, ms[s]);
        float den = 0.0f;
#pragma unroll
        for (int s = 0; s < ATT_SPLITS; ++s) {
            wt[s] = att_weight(ms[s], mx);
            den = fmaf(wt[s], ls[s], den);
        }
        const size_t gate_off = (size_t)it.row * a.row_stride + (size_t)(it.h0 + h) * a.q_head_stride + a.d + e;
        out.v[j] = att_finish(wt, ps, den, a.gated ? a.qkv + gate_off : nullptr);
    }
    return out;
}

// Where a warp's stream of units stands: unit `i` of the warp's units of item `k`, with the
// block-table entries it needs already requested (att_entry).
struct AttCursor {
    uint32_t k, i, entry;
    AttItem it;
};

// Not inlined: each head_dim gets its own register allocation (inlined into one body, the four
// shared one and the 256-wide path spilled).
template <int DP>
__device__ __noinline__ void att_run(const AttLaunch a, unsigned char* dyn, AttShared& sh) {
    constexpr uint32_t STAGE_ELEMS = (ATT_HB + 2 * ATT_UNIT) * (DP + 8);
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const uint32_t g = lane >> 2, c = lane & 3;
    bf16* ring = reinterpret_cast<bf16*>(dyn) + (size_t)warp * ATT_STAGES * STAGE_ELEMS;
    float* ow = reinterpret_cast<float*>(dyn + ATT_WARPS * ATT_STAGES * STAGE_ELEMS * 2);  // [W][hb][DP]
    float* part = ow + ATT_WARPS * a.hb * DP;  // [2][hb][DP], by item parity (read by the cluster)
    // Query rows past hb and dimensions past head_dim are never copied: zero them once.
    for (uint32_t i = lane; i < ATT_STAGES * STAGE_ELEMS / 8; i += 32)
        store16(ring + 8 * i, make_uint4(0, 0, 0, 0));
    __syncwarp();

    // The warp's stream of units over the cluster's items runs ATT_STAGES units ahead of the
    // computing, across items; each unit's block-table entries are read one unit earlier still.
    AttCursor f;
    f.k = 0;
    f.i = 0;
    f.entry = 0;
    if (a.nk > 0) f.it = att_item(a, 0, sh.seq, sh.ctx, warp);
    auto settle = [&]() {  // move to the next unit that exists and read its table entries
        while (f.k < a.nk && f.i >= f.it.mine) {
            ++f.k;
            f.i = 0;
            if (f.k < a.nk) f.it = att_item(a, f.k, sh.seq, sh.ctx, warp);
        }
        if (f.k < a.nk) f.entry = att_entry(a, f.it.seq, f.it.first + ATT_WARPS * f.i, f.it.ctx, lane);
    };
    uint32_t bad_bits = 0;
    auto issue_next = [&](uint32_t st) {
        if (f.k < a.nk) {
            const bool bad = att_issue<DP>(a, f.it, f.it.first + ATT_WARPS * f.i, f.entry,
                                           ring + st * STAGE_ELEMS, lane);
            bad_bits = (bad_bits & ~(1u << st)) | ((bad ? 1u : 0u) << st);
            ++f.i;
            settle();
        }
        cp_async_commit();
    };
    settle();
#pragma unroll
    for (uint32_t st = 0; st < ATT_STAGES; ++st) issue_next(st);

    // Per item: the warps' units, then (once every block has arrived for the item before) the
    // cluster's combine and output of the item before, then the block's combine of this item
    // and an arrival; the cluster waits one item late, so no block idles at the barrier.
    uint32_t consumed = 0;
    AttItem prev;
    prev.ctx = 0;
    AttOut pending;
    pending.n = 0;
    for (uint32_t k = 0; k < a.nk; ++k) {
        const AttItem it = att_item(a, k, sh.seq, sh.ctx, warp);
        float o[DP / 8][2];
#pragma unroll
        for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = 0.0f;
        float m = -INFINITY, l = 0.0f;
        bool bad = false;
        for (uint32_t i = 0; i < it.mine; ++i) {
            cp_async_wait<ATT_STAGES - 1>();
            __syncwarp();
            const uint32_t st = consumed % ATT_STAGES;
            att_unit<DP>(ring + st * STAGE_ELEMS, it.first + ATT_WARPS * i, it.ctx, a.scale_log2, i == 0, lane, o, m, l);
            bad = bad || ((bad_bits >> st) & 1u) != 0;
            __syncwarp();
            issue_next(st);
            ++consumed;
        }
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);

        const uint32_t p = k & 1;
        if (k > 0) {
            // Every block has combined item k - 1, and so has read all of item k - 2 (whose
            // buffers, of parity p, this item reuses).
            cluster_wait();
            pending = att_output<DP>(a, prev, p ^ 1u, sh, part + (p ^ 1u) * a.hb * DP);
            if (tid == 0) sh.bad[p ^ 1u] = 0;
        }

        // The block's warps in warp order.
        float* pk = part + p * a.hb * DP;
        if (g < a.hb) {
#pragma unroll
            for (int n = 0; n < DP / 8; ++n) {
                ow[(warp * a.hb + g) * DP + 8 * n + 2 * c] = o[n][0];
                ow[(warp * a.hb + g) * DP + 8 * n + 2 * c + 1] = o[n][1];
            }
            if (c == 0) {
                sh.wm[warp][g] = m;
                sh.wl[warp][g] = l;
            }
        }
        if (bad && lane == 0) sh.bad[p] = 1;
        __syncthreads();
        for (uint32_t idx = tid; idx < a.hb * DP; idx += ATT_THREADS) {
            const uint32_t h = idx / DP;
            float mx = -INFINITY;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) mx = fmaxf(mx, sh.wm[w][h]);
            float num = 0.0f, den = 0.0f;
#pragma unroll
            for (int w = 0; w < ATT_WARPS; ++w) {
                const float wt = att_weight(sh.wm[w][h], mx);
                num = fmaf(wt, ow[w * a.hb * DP + idx], num);
                den = fmaf(wt, sh.wl[w][h], den);
            }
            pk[idx] = num;
            if (idx % DP == 0) {
                sh.cm[p][h] = mx;
                sh.cl[p][h] = sh.bad[p] ? __int_as_float(0x7FFFFFFF) : den;
            }
        }
        cluster_publish_arrive();
        att_store(a, pending);
        pending.n = 0;
        prev = it;
    }
    cp_async_wait<0>();
    if (a.nk > 0) {
        cluster_wait();
        const uint32_t p = (a.nk - 1) & 1;
        pending = att_output<DP>(a, prev, p, sh, part + p * a.hb * DP);
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
    // does not trigger early, so these blocks are placed once its blocks have left: two blocks
    // of this kernel take nearly all of a multiprocessor's registers, and a cluster that cannot
    // be placed waits for a whole other cluster to finish.
    pdl_wait();
    pdl_trigger();
    const AttLaunch a = att_launch(out, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride,
                                   num_q_heads, num_kv_heads, head_dim, block_size, max_blocks,
                                   num_slots, scale, gated, rows);
    const uint32_t dp = att_padded_dim(head_dim);
    if (!att_launch_ok(a, num_kv_heads, ATT_THREADS, att_shared_bytes(dp, a.hb))) {
        if (num_q_heads == 0) return;
        for (uint32_t k = 0; k < a.nk; ++k) {
            const uint32_t n = a.cluster + k * a.n_clusters;
            att_nan_item(a, n / a.groups, (n % a.groups) * a.hb);
        }
        return;
    }

    // Each item's sequence and context (0 when the row's inputs are out of range).
    for (uint32_t k = threadIdx.x; k < a.nk; k += ATT_THREADS) {
        const uint32_t r = (a.cluster + k * a.n_clusters) / a.groups;
        const uint32_t seq = row_seq[r], ctx = positions[r] + 1;
        const bool ok = seq < num_seqs && ctx != 0 && (ctx + block_size - 1) / block_size <= max_blocks;
        sh.seq[k] = ok ? seq : 0;
        sh.ctx[k] = ok ? ctx : 0;
    }
    if (threadIdx.x == 0) sh.bad[0] = sh.bad[1] = 0;
    __syncthreads();

    att_by_dim(dp, [&](auto dim) { att_run<decltype(dim)::value>(a, att_dyn, sh); });
}

#include "attention_prefill.cuh"
