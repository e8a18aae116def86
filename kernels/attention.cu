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
// split s, units [s * U / ATT_SPLITS, (s + 1) * U / ATT_SPLITS) (U = ceil(ctx / 16)), and warp w
// of the block chain w of the split: its n units cut in ATT_WARPS runs the same way, units
// [w * n / ATT_WARPS, (w + 1) * n / ATT_WARPS) of the split, in order. Per unit a warp computes
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
// The block then folds its warps' chains in chain order into the split's partial, and the
// cluster the splits through distributed shared memory in split order (0, 1, ...,
// ATT_SPLITS - 1): each fold is att_fold's (attention_unit.cuh), so a kernel that walks a row's
// units in order, starting each chain afresh and folding it as it ends, gets the same bits. The
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
// The usual layout (16-byte chunks, units inside power-of-two blocks: att_plain; bf16 or FP8
// pools) runs bodies compiled for it alone: no branches for the other layouts around the copies
// and table reads, each pool row copied whole by a few lanes (an FP8 row's bytes to its ring
// row's top, as att_fp8_copy leaves them), and a unit's keys and values are copied as two commit
// groups, the values waited for (and an FP8 unit's widened) only once the unit's scores are in,
// a stage's keys refilled as soon as those scores are in (the copies' instructions fill the
// softmax's waits). Which path runs changes no result.
//
// `paged_attention_flat` (below) computes the same items without the cluster: a block takes
// whole items, its splits one after another, for steps with an item for every block.
//
// `paged_attention_prefill` (attention_prefill.cuh) computes the same per-row arithmetic for the
// rows of a prefill chunk, sixteen warps to a block and up to 64 virtual rows to an item, so each
// key and value is read once for many rows; a row's result is bitwise this kernel's.
//
// FP8 pools (kv_fp8): the copies move the e4m3 bytes (half the bytes a token) into the top of
// each ring row and the warp that copied them widens them in place to bf16(e4m3 * scale')
// before the unit's MMAs (attention_unit.cuh, kv_fp8.cuh); from there every kernel runs its bf16
// arithmetic unchanged, so the three kernels stay bitwise equal on FP8 pools too.
//
// Rows whose inputs are out of range (sequence past the block tables, a context longer than
// max_blocks, a slot past num_slots) get NaN outputs. So does every row of a launch the kernel
// cannot run (head_dim > ATT_MAX_D, heads that do not group, a wrong block size, too little
// shared memory, too many items per cluster), and the kernel reports the refusal as a fault
// (`att_refuse`: SHAPE or GEOMETRY); the CPU twin fails the launch.
//
// The decode kernels' building blocks (item records, the copies into the rings, one unit's
// MMAs, the warp, block and cluster combines, the output) are in attention_decode.cuh; this file
// holds each kernel's loop over its items.
#include "common.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#include "gemm_fp8.cuh"
#include "kv_fp8.cuh"
#include "attention_unit.cuh"
#include "attention_decode.cuh"

// Where a warp's stream of units stands: unit `i` of the warp's units of item `k`, with the
// block-table entries it needs already requested (att_entry); `qn` counts the items whose
// queries it has copied (the next goes to slot qn % ATT_QSLOTS).
struct AttCursor {
    uint32_t k, i, entry, qn;
    AttItem it;
};

// Not inlined: each head_dim gets its own register allocation (inlined into one body, the four
// shared one and the 256-wide path spilled).
template <int DP, bool FP8, bool PLAIN>
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
        if (f.k < a.nk) f.entry = att_entry<PLAIN>(a, f.it.seq, f.it.first + f.i, f.it.ctx, lane);
    };
    uint32_t bad_bits = 0;
    // `parts`: the unit's keys (ATT_K: the cursor stays), values (ATT_V) or both (ATT_KV).
    auto issue_next = [&](uint32_t st, uint32_t parts) {
        if (parts == ATT_K) {
            // Without a branch, so the copies can be scheduled among the softmax's instructions
            // (predicated off past the warp's last unit).
            att_issue_stage<DP, FP8, PLAIN>(a, f.it, f.it.first + f.i, f.entry, buf.ring, st, lane, bad_bits, parts,
                                            f.k < a.nk);
        } else if (f.k < a.nk) {
            if (f.i == 0) att_issue_queries<DP>(a, f.it, buf.qslots + (f.qn++ % ATT_QSLOTS) * L::QSLOT, lane);
            att_issue_stage<DP, FP8, PLAIN>(a, f.it, f.it.first + f.i, f.entry, buf.ring, st, lane, bad_bits, parts);
            ++f.i;
            settle();
        }
        cp_async_commit();
    };
    att_stream_start<PLAIN>(settle, issue_next);

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
            att_warp_units<DP, FP8, PLAIN>(a, buf.ring, qslot, it.first, it.mine, it.ctx, bad_bits, consumed, lane, o,
                                           m, l, sh.kv2, issue_next);
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
    paged_attention(PAGED_ATTENTION_PARAMS) {
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
                                   num_slots, scale, gated, rows, kv_fp8);
    const uint32_t dp = att_padded_dim(head_dim);
    if (!att_launch_ok(a, num_kv_heads, ATT_THREADS, att_dyn_bytes(dp, a.hb, 2))) {
        att_refuse(MT_KERNEL_PAGED_ATTENTION, a, num_kv_heads);
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
    if (threadIdx.x == 0) {
        sh.bad[0] = sh.bad[1] = 0;
        att_kv_scales(sh.kv2, k_scale, v_scale);
    }
    __syncthreads();

    att_by_body(dp, a, kv_fp8, [&](auto dim, auto fp8, auto plain) {
        att_run<decltype(dim)::value, decltype(fp8)::value, decltype(plain)::value>(a, att_dyn, sh);
    });
}

// ---------------------------------------------------------------------------------------------
// paged_attention_flat: the same function as paged_attention, bitwise, without the cluster.
//
// A block computes whole items: its warps take the chains paged_attention's warps take in every
// split, one split after another (warp w of split s takes att_units(ctx, s, w)), and the block
// folds each split's chains in chain order (att_block_combine, into that split's numerators in
// shared memory), then an item's splits in split order (att_fold_all, att_finish). So every
// partial, and every fold, is paged_attention's, in the same order: only the places differ
// (shared memory of one block instead of the cluster's distributed shared memory). Blocks are
// persistent: block b of B takes items b, b + B, ...; each warp's ring runs across splits and
// items as in paged_attention.
//
// Why: at short contexts each block of a paged_attention cluster gets a unit or two of an item,
// and the cluster's barrier and combine cost more than the units (at many rows of a few hundred
// tokens, over twice the time of the copies). Here a block's items are its own, and many
// blocks' items are in flight at once. At one row and a few rows the cluster kernel keeps every
// multiprocessor busy where this one would not (an item here is a chain of eight splits, each
// waiting on its units): the launcher (ops_attention) picks by items.
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
    uint32_t kv2[2];  // FP8 pools' scale factors (att_kv_scales)
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

template <int DP, bool FP8, bool PLAIN>
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
        if (f.k < a.nk) f.entry = att_entry<PLAIN>(a, f.it.seq, f.first + f.i, f.it.ctx, lane);
    };
    uint32_t bad_bits = 0;
    auto issue_next = [&](uint32_t st, uint32_t parts) {  // `parts`: as att_run's
        AttItem it;
        it.row = f.it.row;
        it.h0 = f.it.h0;
        it.kv = f.it.kv;
        it.seq = f.it.seq;
        it.ctx = f.it.ctx;
        if (parts == ATT_K) {
            att_issue_stage<DP, FP8, PLAIN>(a, it, f.first + f.i, f.entry, buf.ring, st, lane, bad_bits, parts,
                                            f.k < a.nk);
        } else if (f.k < a.nk) {
            if (f.qk != f.k) {
                att_issue_queries<DP>(a, it, buf.qslots + (f.qn++ % ATT_QSLOTS) * L::QSLOT, lane);
                f.qk = f.k;
            }
            att_issue_stage<DP, FP8, PLAIN>(a, it, f.first + f.i, f.entry, buf.ring, st, lane, bad_bits, parts);
            ++f.i;
            settle();
        }
        cp_async_commit();
    };
    att_stream_start<PLAIN>(settle, issue_next);

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
                att_warp_units<DP, FP8, PLAIN>(a, buf.ring, qslot, first, mine, it.ctx, bad_bits, consumed, lane, o,
                                               m, l, sh.kv2, issue_next);
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
            float ms[ATT_SPLITS], ls[ATT_SPLITS], wt[ATT_SPLITS], wp[ATT_SPLITS], den;
#pragma unroll
            for (int s = 0; s < ATT_SPLITS; ++s) {
                ms[s] = sh.cm[s][h];
                ls[s] = sh.cl[s][h];
            }
            att_fold_all(ms, ls, wt, wp, den);
            bf16* o = a.out + ((size_t)it.row * a.hq + it.h0 + h) * a.d;
            const bf16* gate = a.qkv + (size_t)it.row * a.row_stride + (size_t)(it.h0 + h) * a.q_head_stride + a.d;
            for (uint32_t e = lane; e < a.d; e += 32) {
                float ps[ATT_SPLITS];
#pragma unroll
                for (int s = 0; s < ATT_SPLITS; ++s) ps[s] = buf.part[(s * a.hb + h) * DP + e];
                o[e] = it.ctx != 0 ? att_finish(wt, wp, ps, den, a.gated ? gate + e : nullptr) : bf16_nan();
            }
        }
    }
    cp_async_wait<0>();
}

// paged_attention_flat(the arguments of paged_attention): paged_attention's outputs, bitwise.
extern "C" __global__ void __cluster_dims__(1, 1, 1) __launch_bounds__(ATT_THREADS)
    paged_attention_flat(PAGED_ATTENTION_PARAMS) {
    extern __shared__ __align__(16) unsigned char att_dyn[];
    __shared__ AtfShared sh;
    // A programmatic dependent as paged_attention is (see there): step inputs before pdl_wait.
    AttLaunch a = att_launch(out, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride,
                             num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_slots,
                             scale, gated, rows, kv_fp8);
    // Blocks, not clusters, take the items.
    a.n_clusters = gridDim.x;
    a.cluster = blockIdx.x;
    a.split = 0;
    a.nk = a.cluster < a.n_items ? (a.n_items - a.cluster + a.n_clusters - 1) / a.n_clusters : 0;
    const uint32_t dp = att_padded_dim(head_dim);
    if (!att_launch_ok(a, num_kv_heads, ATT_THREADS, att_dyn_bytes(dp, a.hb, ATT_SPLITS))) {
        att_refuse(MT_KERNEL_PAGED_ATTENTION_FLAT, a, num_kv_heads);
        att_nan_items(a, 0, 1);
        return;
    }
    for (uint32_t k = threadIdx.x; k < a.nk; k += ATT_THREADS) {
        AtfItemRec r;
        att_item_at(a, k, r.row, r.h0, r.kv);
        att_row_context(row_seq, positions, r.row, num_seqs, block_size, max_blocks, r.seq, r.ctx);
        sh.item[k] = r;
    }
    if (threadIdx.x == 0) {
        sh.bad[0] = sh.bad[1] = 0;
        att_kv_scales(sh.kv2, k_scale, v_scale);
    }
    __syncthreads();

    att_by_body(dp, a, kv_fp8, [&](auto dim, auto fp8, auto plain) {
        atf_run<decltype(dim)::value, decltype(fp8)::value, decltype(plain)::value>(a, att_dyn, sh);
    });
}

#include "attention_prefill.cuh"
#include "attention_prompt.cuh"
