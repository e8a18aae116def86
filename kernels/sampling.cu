// Token selection on the device: greedy `argmax`, and `sample`, the whole sampling surface (penalties,
// logit bias, an allowed-token mask, temperature, top-k, top-p, min-p, logprobs). CPU twins:
// metrale-gpu-runtime/src/cpu/kernels/sampling.rs.
//
// argmax. Launch: one block per row, a multiple of 32 threads up to 1024 (the launcher uses
// 1024). The result is the lowest index of the row's maximum; NaN never wins (an all-NaN row
// gives 0), exactly as the CPU twin. The comparison is a total order on (value, index), so the
// result does not depend on the reduction's shape.
#include "common.cuh"

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
// Launch: one block per row, a multiple of 32 threads up to 1024 (the launcher uses
// SAMPLE_THREADS), dynamic shared memory of ceil(vocab / 32) u32 words (a bitmap of the row's
// entry tokens). Rows are independent: a row's outputs depend on its logits, its parameters, its
// entries and its mask alone.
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
// too little dynamic shared memory a GEOMETRY fault.

// e^x for x <= 0 (0 below -87, and for NaN): 2^(x log2 e) split into an integer power and a
// degree-6 polynomial, every rounding explicit so the twin computes the same bits.
MT_DEVICE float det_exp(float x) {
    if (!(x > -87.0f)) return 0.0f;
    const float t = __fmul_rn(x, 1.44269504f);
    const float n = rintf(t);
    const float f = __fsub_rn(t, n);
    float p = 1.540353e-4f;
    p = __fmaf_rn(p, f, 1.333356e-3f);
    p = __fmaf_rn(p, f, 9.618129e-3f);
    p = __fmaf_rn(p, f, 5.550411e-2f);
    p = __fmaf_rn(p, f, 2.402265e-1f);
    p = __fmaf_rn(p, f, 6.931472e-1f);
    p = __fmaf_rn(p, f, 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

// ln x for a positive normal x: the exponent and 2 atanh((m - 1) / (m + 1)) of the mantissa m
// in [0.707, 1.414), every rounding explicit.
MT_DEVICE float det_log(float x) {
    const uint32_t b = __float_as_uint(x);
    int e = (int)((b >> 23) & 0xFFu) - 127;
    float m = __uint_as_float((b & 0x7FFFFFu) | 0x3F800000u);
    if (m > 1.41421356f) {
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    const float f = __fsub_rn(m, 1.0f);
    const float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    const float z = __fmul_rn(s, s);
    float p = 0.11111111f;
    p = __fmaf_rn(p, z, 0.14285715f);
    p = __fmaf_rn(p, z, 0.2f);
    p = __fmaf_rn(p, z, 0.33333334f);
    p = __fmaf_rn(p, z, 1.0f);
    const float l = __fmul_rn(__fmul_rn(2.0f, s), p);
    return __fmaf_rn((float)e, 0.693147182f, l);
}

MT_DEVICE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The Gumbel noise of token i under the row's draw `base` (= mix64(seed ^ mix64(counter +
// c))): u = (2k + 1) 2^-24 in (0, 1) from 23 hash bits, g = -ln(-ln u).
MT_DEVICE float gumbel(uint64_t base, uint32_t i) {
    const uint64_t z = mix64(base + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull);
    const float u = __fmul_rn((float)((((uint32_t)(z >> 41)) << 1) | 1u), 5.9604645e-8f);
    return -det_log(-det_log(u));
}

// An order-preserving u32 of a float: larger keys for larger values, -0 as +0, NaN lowest (0).
MT_DEVICE uint32_t order_key(float v) {
    if (isnan(v)) return 0u;
    if (v == 0.0f) v = 0.0f;
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

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

// The key K with W(key > K) < target <= W(key >= K), W the summed weights of the tokens `f`
// includes (f(i, key, w) -> whether token i counts, its key and weight, at most 2^40: a count, or
// a SAMPLE_MASS_BITS fixed-point mass of at most 1). With frac >= 0 the
// target is max(1, floor(frac * total weight)). Four passes of 8 bits; `above` gets W(key > K),
// `eq` W(key == K). The caller guarantees target <= the total.
template <class F>
MT_DEVICE uint32_t radix_select(uint32_t vocab, uint64_t target, double frac, F f,
                                unsigned long long* hist, unsigned long long* sel,
                                uint64_t* above_out, uint64_t* eq_out) {
    uint32_t prefix = 0, pmask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (uint32_t b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
        if (threadIdx.x == 0 && shift == 24) {
            sel[1] = target;
            sel[2] = 0;
        }
        __syncthreads();
        // Warp by warp: the lanes counting into one bin add their weights together first
        // (`__match_any_sync` groups them, each group's sum in two 20-bit halves, which cannot
        // overflow over 32 lanes), and one lane of each group adds the sum to the bin. Logits
        // share their leading bits, so most of a warp's tokens fall in a few bins, where one
        // atomic a token would serialize the whole block on them.
        const uint32_t lane = threadIdx.x & 31;
        for (uint32_t i0 = threadIdx.x - lane; i0 < vocab; i0 += blockDim.x) {
            const uint32_t i = i0 + lane;
            uint32_t key = 0;
            unsigned long long w = 0;
            const bool in = i < vocab && f(i, key, w) && w != 0 && (key & pmask) == prefix;
            const uint32_t bin = in ? (key >> shift) & 255u : 256u;
            const uint32_t peers = __match_any_sync(0xffffffffu, bin);
            const uint32_t lo = __reduce_add_sync(peers, (uint32_t)(w & 0xFFFFFull));
            const uint32_t hi = __reduce_add_sync(peers, (uint32_t)(w >> 20));
            if (in && lane == (uint32_t)__ffs(peers) - 1)
                atomicAdd(&hist[bin], ((unsigned long long)hi << 20) + lo);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long rem = sel[1], above = sel[2];
            if (shift == 24 && frac >= 0.0) {
                unsigned long long total = 0;
                for (int b = 0; b < 256; ++b) total += hist[b];
                rem = (unsigned long long)(frac * (double)total);
                if (rem == 0) rem = 1;
            }
            int digit = 0;
            for (int b = 255; b >= 0; --b) {
                if (hist[b] >= rem) {
                    digit = b;
                    break;
                }
                rem -= hist[b];
                above += hist[b];
            }
            sel[0] = (unsigned long long)digit;
            sel[1] = rem;
            sel[2] = above;
            sel[3] = hist[digit];
        }
        __syncthreads();
        prefix |= (uint32_t)sel[0] << shift;
        pmask |= 0xFFu << shift;
        *above_out = sel[2];
        *eq_out = sel[3];
        __syncthreads();
    }
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
extern "C" __global__ void sample(SAMPLE_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    extern __shared__ uint32_t touched[];  // bitmap of the row's entry tokens
    __shared__ unsigned long long hist[256];
    __shared__ unsigned long long sel[4];
    __shared__ float sv[32];
    __shared__ uint32_t si[32];
    __shared__ uint32_t top_ids[SAMPLE_TOP_MAX];
    __shared__ float top_v[SAMPLE_TOP_MAX];
    __shared__ uint32_t top_n;
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const uint32_t tid = threadIdx.x, nt = blockDim.x;
    const uint32_t words = (vocab + 31) / 32;
    uint32_t* o = out + (size_t)r * SAMPLE_OUT_WORDS;
    const uint32_t* rp = rowp + (size_t)r * SAMPLE_ROW_WORDS;
    const float* x = logits + (size_t)r * vocab;
    const uint32_t flags = rp[SAMPLE_R_FLAGS];
    const uint32_t num_top = rp[SAMPLE_R_NUM_TOP];
    const uint32_t estart = rp[SAMPLE_R_ENTRY_START], ecount = rp[SAMPLE_R_ENTRY_COUNT];
    const bool has_mask = (flags & SAMPLE_F_MASK) != 0;
    const bool geometry = nt % 32 != 0 || dynamic_smem_bytes() < words * 4;
    const bool shape = num_top > SAMPLE_TOP_MAX || estart > num_entries ||
                       ecount > num_entries - estart ||
                       (has_mask && (mask == nullptr || mask_words < words));
    const uint32_t* ent = entries + (size_t)estart * SAMPLE_ENTRY_WORDS;
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
    index = __syncthreads_or(index);
    if (geometry || shape || index) {
        if (tid == 0)
            mt_fault(MT_KERNEL_SAMPLE, geometry ? MT_FAULT_GEOMETRY : shape ? MT_FAULT_SHAPE : MT_FAULT_INDEX);
        for (uint32_t w = tid; w < SAMPLE_OUT_WORDS; w += nt) o[w] = 0xFFFFFFFFu;
        return;
    }
    const float rep = __uint_as_float(rp[SAMPLE_R_REPETITION]);
    const float pres = __uint_as_float(rp[SAMPLE_R_PRESENCE]);
    const float freq = __uint_as_float(rp[SAMPLE_R_FREQUENCY]);
    const uint32_t* mrow = has_mask ? mask + (size_t)r * mask_words : nullptr;
    const bool transformed = ecount > 0 || has_mask;
    // The transformed logit of token i (step 2).
    auto tv = [&](uint32_t i) -> float {
        float v = x[i];
        if (ecount > 0 && ((touched[i >> 5] >> (i & 31)) & 1u)) {
            const uint32_t* e = ent + (size_t)find_entry(ent, ecount, i) * SAMPLE_ENTRY_WORDS;
            v = apply_entry(v, e[1], __uint_as_float(e[2]), rep, pres, freq);
        }
        if (has_mask && !((mrow[i >> 5] >> (i & 31)) & 1u)) v = -INFINITY;
        return v;
    };
    const Best none = {__int_as_float(0x7fc00000), 0xFFFFFFFFu};

    // Step 1: the raw maximum (and argmax), the log-sum-exp, the top logprobs.
    Best raw = none;
    for (uint32_t i = tid; i < vocab; i += nt) {
        const Best c = {x[i], i};
        if (beats(c, raw)) raw = c;
    }
    raw = block_best(raw, sv, si);
    const float m = raw.v;
    float part = 0.0f;
    if (isfinite(m))
        for (uint32_t i = tid; i < vocab; i += nt) part += det_exp(__fsub_rn(x[i], m));
    const float total = block_sum(part, sv);
    const float lse = isfinite(m) ? __fadd_rn(m, det_log(total)) : m;
    const uint32_t n_top = min(num_top, vocab);
    if (n_top > 0) {
        uint64_t above, eq;
        const uint32_t k = radix_select(
            vocab, n_top, -1.0,
            [&](uint32_t i, uint32_t& key, unsigned long long& w) {
                key = order_key(x[i]);
                w = 1;
                return true;
            },
            hist, sel, &above, &eq);
        const uint32_t need = n_top - (uint32_t)above;
        if (tid == 0) top_n = 0;
        __syncthreads();
        for (uint32_t i = tid; i < vocab; i += nt) {
            const uint32_t key = order_key(x[i]);
            if (key > k || (key == k && eq == need)) {
                const uint32_t slot = atomicAdd(&top_n, 1u);
                top_ids[slot] = i;
            }
        }
        __syncthreads();
        if (eq > need) {
            // More ties at the threshold than places: the lowest indices, one pass each.
            uint32_t last = 0;
            for (uint32_t t = 0; t < need; ++t) {
                uint32_t mine = 0xFFFFFFFFu;
                for (uint32_t i = tid; i < vocab; i += nt)
                    if ((t == 0 || i > last) && order_key(x[i]) == k) {
                        mine = i;
                        break;
                    }
                last = block_min_u32(mine, si);
                if (tid == 0) top_ids[top_n++] = last;
                __syncthreads();
            }
        }
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
    for (uint32_t j = tid; j < SAMPLE_TOP_MAX; j += nt) {
        o[2 + j] = j < n_top ? top_ids[j] : 0xFFFFFFFFu;
        o[2 + SAMPLE_TOP_MAX + j] =
            j < n_top ? __float_as_uint(__fsub_rn(top_v[j], lse)) : 0x7fc00000u;
    }

    // Step 3: the transformed maximum; the greedy token.
    Best best = raw;
    if (transformed) {
        best = none;
        for (uint32_t i = tid; i < vocab; i += nt) {
            const Best c = {tv(i), i};
            if (beats(c, best)) best = c;
        }
        best = block_best(best, sv, si);
    }
    uint32_t token = best.i == 0xFFFFFFFFu ? 0u : best.i;

    // Step 4: a draw from the kept set.
    if (!(flags & SAMPLE_F_GREEDY)) {
        const float temp = __uint_as_float(rp[SAMPLE_R_TEMPERATURE]);
        const uint32_t top_k = rp[SAMPLE_R_TOP_K];
        const float top_p = __uint_as_float(rp[SAMPLE_R_TOP_P]);
        const float min_p = __uint_as_float(rp[SAMPLE_R_MIN_P]);
        const float smax = __fdiv_rn(best.v, temp);
        const bool use_k = top_k > 0 && top_k < vocab;
        const bool use_p = top_p < 1.0f;
        uint64_t above, eq;
        uint32_t kk = 0, kp = 0;
        if (use_k)
            kk = radix_select(
                vocab, top_k, -1.0,
                [&](uint32_t i, uint32_t& key, unsigned long long& w) {
                    key = order_key(__fdiv_rn(tv(i), temp));
                    w = 1;
                    return true;
                },
                hist, sel, &above, &eq);
        if (use_p)
            kp = radix_select(
                vocab, 1, (double)top_p,
                [&](uint32_t i, uint32_t& key, unsigned long long& w) {
                    const float s = __fdiv_rn(tv(i), temp);
                    key = order_key(s);
                    w = (unsigned long long)__fmul_rn(det_exp(__fsub_rn(s, smax)),
                                                      (float)(1ull << SAMPLE_MASS_BITS));
                    return key >= kk;
                },
                hist, sel, &above, &eq);
        const uint64_t base =
            mix64((((uint64_t)rp[SAMPLE_R_SEED_HI] << 32) | rp[SAMPLE_R_SEED_LO]) ^
                  mix64((uint64_t)rp[SAMPLE_R_COUNTER] + 0x632BE59BD9B4E019ull));
        Best pick = none;
        for (uint32_t i = tid; i < vocab; i += nt) {
            const float s = __fdiv_rn(tv(i), temp);
            const uint32_t key = order_key(s);
            if (key < kk || key < kp) continue;
            if (min_p > 0.0f && !(det_exp(__fsub_rn(s, smax)) >= min_p)) continue;
            const Best c = {__fadd_rn(s, gumbel(base, i)), i};
            if (beats(c, pick)) pick = c;
        }
        pick = block_best(pick, sv, si);
        if (pick.i != 0xFFFFFFFFu) token = pick.i;
    }
    if (tid == 0) {
        o[0] = token;
        o[1] = __float_as_uint(__fsub_rn(x[token], lse));
    }
}
