// Token selection on the device: greedy `argmax`, and `sample`, the whole sampling surface (penalties,
// logit bias, an allowed-token mask, temperature, top-k, top-p, min-p, logprobs). CPU twins:
// metrale-gpu-runtime/src/cpu/kernels/sampling.rs.
//
// argmax. Launch: one block per row, a multiple of 32 threads up to 1024 (the launcher uses
// 1024). The result is the lowest index of the row's maximum; NaN never wins (an all-NaN row
// gives 0), exactly as the CPU twin. The comparison is a total order on (value, index), so the
// result does not depend on the reduction's shape.
#include "common.cuh"

#include <cooperative_groups.h>

#include "sampling_math.cuh"

namespace cg = cooperative_groups;

struct Best {
    float v;
    uint32_t i;
};

// Whether `a` beats `b`: a number beats NaN; a larger number wins; ties go to the lower index.
MT_DEVICE bool beats(Best a, Best b) {
    const bool an = isnan(a.v), bn = isnan(b.v);
    if (an != bn) return bn;
    if (!an && a.v != b.v) return a.v > b.v;
    return a.i < b.i;
}

MT_DEVICE Best warp_best(Best b) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        Best other;
        other.v = __shfl_xor_sync(0xffffffffu, b.v, o);
        other.i = __shfl_xor_sync(0xffffffffu, b.i, o);
        if (beats(other, b)) b = other;
    }
    return b;
}

// argmax(out: u32 [rows], logits: f32 [rows, vocab], rows, vocab).
extern "C" __global__ void argmax(ARGMAX_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const float* x = logits + (size_t)r * vocab;
    Best best;
    best.v = __int_as_float(0x7fc00000);
    best.i = 0xFFFFFFFFu;
    if (vocab % 4 == 0 && aligned16(x)) {
        for (uint32_t v = threadIdx.x; v < vocab / 4; v += blockDim.x) {
            const float4 a = *reinterpret_cast<const float4*>(x + 4 * v);
            const float e[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const Best c = {e[j], 4 * v + j};
                if (beats(c, best)) best = c;
            }
        }
    } else {
        for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
            const Best c = {x[i], i};
            if (beats(c, best)) best = c;
        }
    }
    best = warp_best(best);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        sv[warp] = best.v;
        si[warp] = best.i;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) >> 5;
        Best b;
        b.v = lane < warps ? sv[lane] : __int_as_float(0x7fc00000);
        b.i = lane < warps ? si[lane] : 0xFFFFFFFFu;
        b = warp_best(b);
        if (lane == 0) out[r] = b.i == 0xFFFFFFFFu ? 0u : b.i;
    }
}

// ---- sample
//
// Launch: a cluster of SAMPLE_SPLITS blocks per row (grid rows * SAMPLE_SPLITS), a multiple of 32
// threads of at least 256 a block (the launcher uses SAMPLE_THREADS), dynamic shared memory of
// ceil(vocab / 32) u32 words (a bitmap of the row's entry tokens), followed, where the launch
// gives room for them, by a u32 per token of the block's slice (the slice's order keys of s,
// below, computed once and read by every later pass; without the room each pass computes them
// again). Block b of a row's cluster takes the tokens [b L, (b + 1) L), L = ceil(vocab /
// SAMPLE_SPLITS), and the blocks combine their partial results through distributed shared
// memory: maxima and integer histograms exactly, the log-sum-exp's partial sums in block order.
// Rows are independent: a row's outputs depend on its logits, its parameters, its entries and its
// mask alone.
//
// Per row, in order (the definitions of transformers and vLLM):
// 1. Logprobs are the log_softmax of the model's raw logits, before any transform: the chosen
//    token's, and the top `num_top` (ids by descending logit, ties by lower index).
// 2. Transforms, per token t with an entry: banned (min_tokens) -> -inf; if t is in the prompt or
//    the output, the repetition penalty (x < 0 ? x * r : x / r); if it is in the output
//    `count` times, x -= frequency * count, then x -= presence; then x += bias. Tokens the mask
//    (when the row has one) does not allow -> -inf.
// 3. Greedy rows take the lowest index of the transformed maximum (NaN never wins), which is
//    `argmax` of the raw logits when the row has no entries and no mask.
// 4. Other rows: s = x / temperature; keep the tokens whose order key (below) is at least the
//    top_k-th largest; of those, the smallest set of highest keys whose probability mass reaches
//    top_p (by a threshold key: ties at it are kept); and those with exp(s - max s) >= min_p.
//    The token is the kept token of the largest s + Gumbel(u), u a counter-based hash of (seed,
//    counter, token): an exact draw from softmax(s) over the kept set (the Gumbel-max trick),
//    parallel, and reproducible from the seed and the draw counter alone.
//
// Determinism: the thresholds are radix selections over order keys (four passes of 8 bits) with
// integer histograms; top-p sums fixed-point masses (SAMPLE_MASS_BITS fraction bits) as
// integers, so every decision is exact and order-free; exp and log are computed by det_exp /
// det_log with explicit roundings (the twin does the same operations), so tokens match the twin
// bit for bit. Only the log-sum-exp of the logprobs is a float reduction (fixed order).
//
// A row with num_top > SAMPLE_TOP_MAX, an entry range outside `entries`, an entry token outside
// the vocabulary or out of order, or a mask flag without a mask writes 0xFFFFFFFF to all its
// output words and reports a SHAPE or INDEX fault; a block size that is not a multiple of 32 or
// under 256, or too little dynamic shared memory a GEOMETRY fault.

// The best of a block (every thread gets it); sv/si hold 32 entries each.
MT_DEVICE Best block_best(Best b, float* sv, uint32_t* si) {
    b = warp_best(b);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        sv[warp] = b.v;
        si[warp] = b.i;
    }
    __syncthreads();
    if (warp == 0) {
        Best c;
        c.v = lane < warps ? sv[lane] : __int_as_float(0x7fc00000);
        c.i = lane < warps ? si[lane] : 0xFFFFFFFFu;
        c = warp_best(c);
        if (lane == 0) {
            sv[0] = c.v;
            si[0] = c.i;
        }
    }
    __syncthreads();
    Best r;
    r.v = sv[0];
    r.i = si[0];
    __syncthreads();
    return r;
}

MT_DEVICE uint32_t block_min_u32(uint32_t v, uint32_t* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    uint32_t r = 0xFFFFFFFFu;
    for (int w = 0; w < warps; ++w) r = min(r, scratch[w]);
    __syncthreads();
    return r;
}

// A histogram bin's weight as SAMPLE_LIMBS u32 sums of 14-bit limbs: shared-memory atomics are
// native on 32 bits (a 64-bit add is a compare-and-swap loop, which spins whenever warps add to
// the same bin, and logits crowd into few bins). A weight is at most 2^40 (a mass of 1) and a
// block adds at most 2^15 of them (a slice of a vocabulary up to 2^18), so no limb sum exceeds
// 2^29.
#define SAMPLE_LIMBS 3
#define SAMPLE_LIMB_BITS 14

// What the blocks of a row's cluster exchange: per kind (histograms; scalars) two slots, taken
// by the parity of the exchange's sequence number of that kind (the same in every block, since
// every block runs the same exchanges). A block writes its slot, arrives at the cluster barrier,
// waits, and reads the slot of every block. A slot is written again two exchanges of its kind
// later, after the barrier of the exchange between, which no block passes before every block
// has read the slot: one barrier an exchange suffices.
struct SampleXch {
    uint32_t hist[2][SAMPLE_LIMBS][256];
    float v[2];
    uint32_t i[2];
};

// The cluster of the calling block, its exchange slots and their sequence numbers.
struct RowCluster {
    cg::cluster_group cl;
    SampleXch* x;
    uint32_t hist_n, scalar_n;

    // Publish (v, i) (every thread holds them) in this block's next scalar slot, then wait for
    // the cluster; the slot's index is returned.
    MT_DEVICE uint32_t publish(float v, uint32_t i) {
        const uint32_t p = scalar_n++ & 1u;
        if (threadIdx.x == 0) {
            x->v[p] = v;
            x->i[p] = i;
        }
        cluster_publish_arrive();
        cluster_wait();
        return p;
    }

    MT_DEVICE const SampleXch* at(uint32_t rank) { return cl.map_shared_rank(x, rank); }

    // The best of the cluster (every thread of every block gets it).
    MT_DEVICE Best best(Best b, float* sv, uint32_t* si) {
        b = block_best(b, sv, si);
        const uint32_t p = publish(b.v, b.i);
        Best r = {__int_as_float(0x7fc00000), 0xFFFFFFFFu};
#pragma unroll
        for (uint32_t s = 0; s < SAMPLE_SPLITS; ++s) {
            const SampleXch* o = at(s);
            const Best c = {o->v[p], o->i[p]};
            if (beats(c, r)) r = c;
        }
        return r;
    }

    // The sum of the cluster, the blocks' sums added in block order.
    MT_DEVICE float sum(float v, float* sv) {
        const uint32_t p = publish(block_sum(v, sv), 0);
        float t = 0.0f;
#pragma unroll
        for (uint32_t s = 0; s < SAMPLE_SPLITS; ++s) t = __fadd_rn(t, at(s)->v[p]);
        return t;
    }

    MT_DEVICE uint32_t min_u32(uint32_t v, uint32_t* si) {
        const uint32_t p = publish(0.0f, block_min_u32(v, si));
        uint32_t r = 0xFFFFFFFFu;
#pragma unroll
        for (uint32_t s = 0; s < SAMPLE_SPLITS; ++s) r = min(r, at(s)->i[p]);
        return r;
    }
};

// Tokens a thread loads before it works on them: the passes are bound by the latency of their
// loads (a slice is about 37 tokens a thread), so each thread keeps this many in flight.
#define SAMPLE_UNROLL 4

// Visit the block's tokens [lo, hi): load(i) for SAMPLE_UNROLL tokens of the thread first, then
// f(i, valid, value) for each (valid: i < hi; an invalid one gets a default value). Lanes of a
// warp take neighbouring tokens.
template <class L, class F>
MT_DEVICE void for_slice(uint32_t lo, uint32_t hi, L load, F f) {
    using V = decltype(load(0u));
    const uint32_t lane = threadIdx.x & 31, nt = blockDim.x;
    for (uint32_t i0 = lo + threadIdx.x - lane; i0 < hi; i0 += SAMPLE_UNROLL * nt) {
        V v[SAMPLE_UNROLL];
#pragma unroll
        for (uint32_t u = 0; u < SAMPLE_UNROLL; ++u) {
            const uint32_t i = i0 + u * nt + lane;
            v[u] = i < hi ? load(i) : V{};
        }
#pragma unroll
        for (uint32_t u = 0; u < SAMPLE_UNROLL; ++u) {
            const uint32_t i = i0 + u * nt + lane;
            f(i, i < hi, v[u]);
        }
    }
}

// The key K with W(key > K) < target <= W(key >= K), W the summed weights of the row's tokens
// that `f` includes (f(i, load(i), key, w) -> whether token i counts, its key and weight, at most
// 2^40: a count, or a SAMPLE_MASS_BITS fixed-point mass of at most 1). With frac >= 0 the target is
// max(1, floor(frac * total weight)). Four passes of 8 bits, each over the block's tokens [lo,
// hi) into a histogram the cluster sums; every block then finds the digit from the summed
// histogram (the same in all). `above` gets W(key > K), `eq` W(key == K). The caller guarantees
// target <= the total. MASS: the weights are masses (kept in SAMPLE_LIMBS limbs), else counts (one
// limb). `scan` holds 11 words.
template <bool MASS, class L, class F>
MT_DEVICE uint32_t radix_select(RowCluster& rc, uint32_t lo, uint32_t hi, uint64_t target,
                                double frac, L load, F f, unsigned long long* scan, uint64_t* above_out,
                                uint64_t* eq_out) {
    // A count needs the low limb alone (a block counts at most 2^15 tokens).
    constexpr uint32_t LIMBS = MASS ? SAMPLE_LIMBS : 1;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    uint32_t prefix = 0, pmask = 0;
    unsigned long long rem = target, above = 0, eq = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const uint32_t p = rc.hist_n++ & 1u;
        uint32_t(*hist)[256] = rc.x->hist[p];
        for (uint32_t b = tid; b < LIMBS * 256; b += blockDim.x) hist[b / 256][b % 256] = 0;
        __syncthreads();
        // One atomic a token and limb. Grouping a warp's lanes by bin first (`__match_any_sync`,
        // then one atomic a group) costs more than the atomics it saves: the sampler ran 1.7 times
        // slower with it.
        for_slice(lo, hi, load, [&](uint32_t i, bool valid, auto v) {
            uint32_t key = 0;
            unsigned long long w = 0;
            if (!(valid && f(i, v, key, w) && w != 0 && (key & pmask) == prefix)) return;
            const uint32_t bin = (key >> shift) & 255u;
#pragma unroll
            for (uint32_t l = 0; l < LIMBS; ++l)
                atomicAdd(&hist[l][bin],
                          (uint32_t)(w >> (l * SAMPLE_LIMB_BITS)) &
                              (l + 1 < LIMBS ? (1u << SAMPLE_LIMB_BITS) - 1 : 0xFFFFFFFFu));
        });
        cluster_publish_arrive();
        cluster_wait();
        // Thread b < 256: bin b over the cluster, then S(b), the weight of bins >= b (a suffix
        // sum within the warp, then the warps above).
        unsigned long long h = 0;
        if (tid < 256) {
#pragma unroll
            for (uint32_t s = 0; s < SAMPLE_SPLITS; ++s) {
                const SampleXch* o = rc.at(s);
#pragma unroll
                for (uint32_t l = 0; l < LIMBS; ++l)
                    h += (unsigned long long)o->hist[p][l][tid] << (l * SAMPLE_LIMB_BITS);
            }
        }
        unsigned long long sfx = h;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const unsigned long long t = __shfl_down_sync(0xffffffffu, sfx, o);
            if (lane + o < 32) sfx += t;
        }
        if (tid < 256 && lane == 0) scan[warp] = sfx;
        if (tid == 0) {
            // Where no bin reaches the target (it exceeds the total): digit 0, everything above.
            scan[8] = 0;
            scan[10] = h;
        }
        __syncthreads();
        unsigned long long total = 0;
        for (uint32_t w = 0; w < 8; ++w) total += scan[w];
        if (tid < 256)
            for (uint32_t w = warp + 1; w < 8; ++w) sfx += scan[w];
        if (shift == 24 && frac >= 0.0) {
            rem = (unsigned long long)(frac * (double)total);
            if (rem == 0) rem = 1;
        }
        if (tid == 0) scan[9] = total;
        __syncthreads();
        // The digit: the bin with S(b) >= rem > S(b + 1) (unique, when rem <= the total).
        if (tid < 256 && sfx >= rem && sfx - h < rem) {
            scan[8] = tid;
            scan[9] = sfx - h;
            scan[10] = h;
        }
        __syncthreads();
        const uint32_t digit = (uint32_t)scan[8];
        rem -= scan[9];
        above += scan[9];
        eq = scan[10];
        prefix |= digit << shift;
        pmask |= 0xFFu << shift;
        // `scan` is written again only after the next pass's cluster barrier.
    }
    *above_out = above;
    *eq_out = eq;
    return prefix;
}

// The entry of token t among a row's `n` entries (sorted by token; t is one of them).
MT_DEVICE uint32_t find_entry(const uint32_t* ent, uint32_t n, uint32_t t) {
    uint32_t lo = 0, hi = n;
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) >> 1;
        if (ent[(size_t)mid * SAMPLE_ENTRY_WORDS] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

// A logit under its entry (count word c, bias b): see the header, step 2.
MT_DEVICE float apply_entry(float x, uint32_t c, float b, float rep, float pres, float freq) {
    if (c & SAMPLE_E_BAN) return -INFINITY;
    const uint32_t cnt = c & SAMPLE_E_COUNT_MASK;
    if (cnt > 0 || (c & SAMPLE_E_PROMPT)) x = x < 0.0f ? __fmul_rn(x, rep) : __fdiv_rn(x, rep);
    if (cnt > 0) {
        x = __fsub_rn(x, __fmul_rn(freq, (float)cnt));
        x = __fsub_rn(x, pres);
    }
    return __fadd_rn(x, b);
}

// sample(out: u32 [rows, SAMPLE_OUT_WORDS], logits: f32 [rows, vocab], rowp: u32 [rows,
// SAMPLE_ROW_WORDS], entries: u32 [num_entries, SAMPLE_ENTRY_WORDS], mask: u32 [rows,
// mask_words] or null, rows, vocab, num_entries, mask_words).
extern "C" __global__ void __cluster_dims__(SAMPLE_SPLITS, 1, 1)
    __launch_bounds__(SAMPLE_THREADS, 2) sample(SAMPLE_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    extern __shared__ uint32_t touched[];  // bitmap of the row's entry tokens, then the key cache
    __shared__ SampleXch xch;
    __shared__ unsigned long long scan[11];
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    __shared__ uint32_t top_ids[SAMPLE_TOP_MAX];
    __shared__ float top_v[SAMPLE_TOP_MAX];
    __shared__ uint32_t top_n;
    RowCluster rc = {cg::this_cluster(), &xch, 0, 0};
    const uint32_t rank = rc.cl.block_rank();
    const uint32_t r = blockIdx.x / SAMPLE_SPLITS;
    if (r >= rows) return;  // the whole cluster: its blocks share the row
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    const uint32_t words = (vocab + 31) / 32;
    const uint32_t slice = (vocab + SAMPLE_SPLITS - 1) / SAMPLE_SPLITS;
    const uint32_t lo = min(vocab, rank * slice), hi = min(vocab, lo + slice);
    uint32_t* o = out + (size_t)r * SAMPLE_OUT_WORDS;
    const uint32_t* rp = rowp + (size_t)r * SAMPLE_ROW_WORDS;
    const float* x = logits + (size_t)r * vocab;
    const uint32_t flags = rp[SAMPLE_R_FLAGS];
    const uint32_t num_top = rp[SAMPLE_R_NUM_TOP];
    const uint32_t estart = rp[SAMPLE_R_ENTRY_START], ecount = rp[SAMPLE_R_ENTRY_COUNT];
    const bool has_mask = (flags & SAMPLE_F_MASK) != 0;
    const bool geometry = nt % 32 != 0 || nt < 256 || dynamic_smem_bytes() < words * 4;
    const bool shape = num_top > SAMPLE_TOP_MAX || estart > num_entries ||
                       ecount > num_entries - estart ||
                       (has_mask && (mask == nullptr || mask_words < words));
    const uint32_t* ent = entries + (size_t)estart * SAMPLE_ENTRY_WORDS;
    if (tid == 0) top_n = 0;
    bool index = false;
    if (!geometry && !shape && ecount > 0) {
        for (uint32_t w = tid; w < words; w += nt) touched[w] = 0;
        __syncthreads();
        for (uint32_t j = tid; j < ecount; j += nt) {
            const uint32_t t = ent[(size_t)j * SAMPLE_ENTRY_WORDS];
            if (t >= vocab || (j > 0 && ent[(size_t)(j - 1) * SAMPLE_ENTRY_WORDS] >= t)) index = true;
            else atomicOr(&touched[t >> 5], 1u << (t & 31));
        }
    }
    // Every block of the cluster reaches the same verdict (the same row, the same entries), so
    // on a fault they all leave here, before any exchange.
    index = __syncthreads_or(index);
    if (geometry || shape || index) {
        if (rank == 0) {
            if (tid == 0)
                mt_fault(MT_KERNEL_SAMPLE,
                         geometry ? MT_FAULT_GEOMETRY : shape ? MT_FAULT_SHAPE : MT_FAULT_INDEX);
            for (uint32_t w = tid; w < SAMPLE_OUT_WORDS; w += nt) o[w] = 0xFFFFFFFFu;
        }
        return;
    }
    const float rep = __uint_as_float(rp[SAMPLE_R_REPETITION]);
    const float pres = __uint_as_float(rp[SAMPLE_R_PRESENCE]);
    const float freq = __uint_as_float(rp[SAMPLE_R_FREQUENCY]);
    const uint32_t* mrow = has_mask ? mask + (size_t)r * mask_words : nullptr;
    const bool transformed = ecount > 0 || has_mask;
    // The transformed logit of token i, whose raw logit is v (step 2).
    auto tv = [&](uint32_t i, float v) -> float {
        if (ecount > 0 && ((touched[i >> 5] >> (i & 31)) & 1u)) {
            const uint32_t* e = ent + (size_t)find_entry(ent, ecount, i) * SAMPLE_ENTRY_WORDS;
            v = apply_entry(v, e[1], __uint_as_float(e[2]), rep, pres, freq);
        }
        if (has_mask && !((mrow[i >> 5] >> (i & 31)) & 1u)) v = -INFINITY;
        return v;
    };
    const Best none = {__int_as_float(0x7fc00000), 0xFFFFFFFFu};
    auto logit = [&](uint32_t i) { return x[i]; };

    // Step 1: the raw maximum (and argmax), the log-sum-exp, the top logprobs.
    Best raw = none;
    for_slice(lo, hi, logit, [&](uint32_t i, bool valid, float v) {
        const Best c = {v, i};
        if (valid && beats(c, raw)) raw = c;
    });
    raw = rc.best(raw, sv, si);
    const float m = raw.v;
    float part = 0.0f;
    if (isfinite(m))
        for_slice(lo, hi, logit, [&](uint32_t, bool valid, float v) {
            if (valid) part += det_exp(__fsub_rn(v, m));
        });
    const float total = rc.sum(part, sv);
    const float lse = isfinite(m) ? __fadd_rn(m, det_log(total)) : m;
    const uint32_t n_top = min(num_top, vocab);
    if (n_top > 0) {
        uint64_t above, eq;
        const uint32_t k = radix_select<false>(
            rc, lo, hi, n_top, -1.0, logit,
            [&](uint32_t, float v, uint32_t& key, unsigned long long& w) {
                key = order_key(v);
                w = 1;
                return true;
            },
            scan, &above, &eq);
        const uint32_t need = n_top - (uint32_t)above;
        // The tokens above the threshold (and those at it when all of them are needed) into
        // block 0's list.
        uint32_t* list = rc.cl.map_shared_rank(top_ids, 0);
        uint32_t* count = rc.cl.map_shared_rank(&top_n, 0);
        for_slice(lo, hi, logit, [&](uint32_t i, bool valid, float v) {
            const uint32_t key = order_key(v);
            if (valid && (key > k || (key == k && eq == need))) list[atomicAdd(count, 1u)] = i;
        });
        rc.cl.sync();  // a release barrier: the remote writes above are visible to block 0
        if (eq > need) {
            // More ties at the threshold than places: the lowest indices, one pass each.
            uint32_t last = 0;
            for (uint32_t t = 0; t < need; ++t) {
                uint32_t mine = 0xFFFFFFFFu;
                for (uint32_t i = lo + tid; i < hi; i += nt)
                    if ((t == 0 || i > last) && order_key(x[i]) == k) {
                        mine = i;
                        break;
                    }
                last = rc.min_u32(mine, si);
                if (rank == 0 && tid == 0) top_ids[top_n++] = last;
            }
        }
        if (rank == 0) {
            if (tid == 0) {
                // Descending key, ties by lower index.
                for (uint32_t a = 0; a < n_top; ++a) top_v[a] = x[top_ids[a]];
                for (uint32_t a = 1; a < n_top; ++a) {
                    const uint32_t id = top_ids[a];
                    const float v = top_v[a];
                    const uint32_t kv = order_key(v);
                    uint32_t b = a;
                    while (b > 0) {
                        const uint32_t kb = order_key(top_v[b - 1]);
                        if (kb > kv || (kb == kv && top_ids[b - 1] < id)) break;
                        top_ids[b] = top_ids[b - 1];
                        top_v[b] = top_v[b - 1];
                        --b;
                    }
                    top_ids[b] = id;
                    top_v[b] = v;
                }
            }
            __syncthreads();
        }
    }
    if (rank == 0)
        for (uint32_t j = tid; j < SAMPLE_TOP_MAX; j += nt) {
            o[2 + j] = j < n_top ? top_ids[j] : 0xFFFFFFFFu;
            o[2 + SAMPLE_TOP_MAX + j] =
                j < n_top ? __float_as_uint(__fsub_rn(top_v[j], lse)) : 0x7fc00000u;
        }

    // Step 3: the transformed maximum (the greedy token); for a sampled row, the order keys of
    // s into the cache where it fits.
    const bool sampled = !(flags & SAMPLE_F_GREEDY);
    const float temp = __uint_as_float(rp[SAMPLE_R_TEMPERATURE]);
    uint32_t* cache = touched + words;
    const bool cached = sampled && dynamic_smem_bytes() >= (words + slice) * 4;
    Best best = raw;
    if (transformed || cached) {
        Best b = none;
        for_slice(lo, hi, logit, [&](uint32_t i, bool valid, float raw_v) {
            if (!valid) return;
            const float v = tv(i, raw_v);
            const Best c = {v, i};
            if (beats(c, b)) b = c;
            if (cached) cache[i - lo] = order_key(__fdiv_rn(v, temp));
        });
        if (transformed) best = rc.best(b, sv, si);
    }
    uint32_t token = best.i == 0xFFFFFFFFu ? 0u : best.i;

    // Step 4: a draw from the kept set.
    if (sampled) {
        // The order key of s for token i (the passes visit a thread's tokens in the same order,
        // so a thread reads only the cache entries it wrote).
        auto skey = [&](uint32_t i) -> uint32_t {
            return cached ? cache[i - lo] : order_key(__fdiv_rn(tv(i, x[i]), temp));
        };
        const uint32_t top_k = rp[SAMPLE_R_TOP_K];
        const float top_p = __uint_as_float(rp[SAMPLE_R_TOP_P]);
        const float min_p = __uint_as_float(rp[SAMPLE_R_MIN_P]);
        const float smax = __fdiv_rn(best.v, temp);
        const bool use_k = top_k > 0 && top_k < vocab;
        const bool use_p = top_p < 1.0f;
        uint64_t above, eq;
        uint32_t kk = 0, kp = 0;
        if (use_k)
            kk = radix_select<false>(
                rc, lo, hi, top_k, -1.0, skey,
                [&](uint32_t, uint32_t k, uint32_t& key, unsigned long long& w) {
                    key = k;
                    w = 1;
                    return true;
                },
                scan, &above, &eq);
        if (use_p)
            kp = radix_select<true>(
                rc, lo, hi, 1, (double)top_p, skey,
                [&](uint32_t, uint32_t k, uint32_t& key, unsigned long long& w) {
                    key = k;
                    w = (unsigned long long)__fmul_rn(det_exp(__fsub_rn(key_value(key), smax)),
                                                      (float)(1ull << SAMPLE_MASS_BITS));
                    return key >= kk;
                },
                scan, &above, &eq);
        const uint64_t base =
            mix64((((uint64_t)rp[SAMPLE_R_SEED_HI] << 32) | rp[SAMPLE_R_SEED_LO]) ^
                  mix64((uint64_t)rp[SAMPLE_R_COUNTER] + 0x632BE59BD9B4E019ull));
        Best pick = none;
        for_slice(lo, hi, skey, [&](uint32_t i, bool valid, uint32_t key) {
            if (!valid || key < kk || key < kp) return;
            const float s = key_value(key);
            if (min_p > 0.0f && !(det_exp(__fsub_rn(s, smax)) >= min_p)) return;
            const Best c = {__fadd_rn(s, gumbel(base, i)), i};
            if (beats(c, pick)) pick = c;
        });
        pick = rc.best(pick, sv, si);
        if (pick.i != 0xFFFFFFFFu) token = pick.i;
    }
    if (rank == 0 && tid == 0) {
        o[0] = token;
        o[1] = __float_as_uint(__fsub_rn(x[token], lse));
    }
    // Keep this block's shared memory alive until every block of the cluster has read it.
    cluster_leave_barrier();
}
