// The sparse MoE block of Qwen3-Next / Qwen3.5-MoE: router top-k, the routed experts'
// projections over (row, choice) pairs, and the weighted combine. CPU twins (the reference, with
// the argument lists and semantics): metrale-gpu-runtime/src/cpu/kernels/moe.rs.
//
// Launch geometry (ops_hybrid.rs builds it from shapes only):
// - topk_route: a warp per row, rows blockIdx.x * (blockDim.x / 32) + warp.
// - expert_linear / expert_linear_f32out (and their block-FP8 twins, expert_linear_fp8 /
//   expert_linear_fp8_f32out): grid (column blocks, min(num_experts, pairs)), 256
//   threads, ceil(num_experts / 32) * 4 bytes of dynamic shared memory (a bitmap of the experts).
//   Block (x, u) serves the u-th expert (ascending index) that some pair routes to, for output
//   columns [x * cpb, (x + 1) * cpb) with cpb = ceil(n / gridDim.x); blocks past the number of
//   routed experts return at once. So each routed expert's weight rows are read from memory once
//   per launch (a warp per column, 16-byte loads, all pairs of that expert served from one pass
//   over the row, up to 8 at a time from registers), whatever the batch is.
// - moe_combine: a block per row, threads over the hidden columns.
//
// Numerics: an expert output element is a per-lane f32 chain over k (lane l takes the 8-wide
// chunks l, l + 32, ... in order, a chunk's 8 products in order), then the warp's xor butterfly:
// a function of k and the layout only, so a pair's outputs are bitwise the same whichever block
// serves it and whatever other pairs share the launch (batch invariance), and run to run. A
// block-FP8 expert weight is converted to the bf16 it stands for as it is read (the dense FP8
// GEMMs' conversion), so its outputs are bitwise the bf16 kernel's on the dequantized weight.
#include "common.cuh"
#include "gemm_fp8.cuh"  // the e4m3 conversion of the FP8 experts

// Largest number of one expert's pairs a block collects before computing them.
#define MOE_LIST 256
// Pairs whose accumulators a warp holds at once.
#define MOE_PB 8

MT_DEVICE float moe_f32_nan() { return __int_as_float(0x7FFFFFFF); }

// ---------------------------------------------------------------------------------------------
// Router.

// (v, i) comes before (bv, bi) in the router's order: larger probability first, then lower index.
MT_DEVICE bool route_before(float v, uint32_t i, float bv, uint32_t bi) {
    return v > bv || (v == bv && i < bi);
}

// topk_route(topk_ids: u32 [rows, top_k], topk_weights: f32 [rows, top_k], logits: f32 [rows,
// num_experts], rows, num_experts, top_k, renormalize). p = softmax(logits) in f32; the top_k
// largest p by descending value, ties to the lower index; weights p (or p / Σ_chosen p in choice
// order). Choice c is the first expert after choice c - 1 in the order (p desc, index asc), found
// by a lane-strided scan and an xor-butterfly arg-max, so every lane agrees bitwise. Rows whose
// probabilities hold a NaN (a NaN logit) get the id num_experts (out of range) and NaN weights.
extern "C" __global__ void topk_route(TOPK_ROUTE_PARAMS) {
    const uint32_t lane = threadIdx.x & 31;
    const uint32_t r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const uint32_t e = num_experts, k = top_k;
    uint32_t* ids = topk_ids + (size_t)r * k;
    float* weights = topk_weights + (size_t)r * k;
    if (k == 0 || k > e) {
        mt_fault(MT_KERNEL_TOPK_ROUTE, MT_FAULT_SHAPE);
        for (uint32_t c = lane; c < k; c += 32) {
            ids[c] = e;
            weights[c] = moe_f32_nan();
        }
        return;
    }
    const float* lg = logits + (size_t)r * e;
    float mx = -INFINITY;
    for (uint32_t i = lane; i < e; i += 32) mx = fmaxf(mx, lg[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (uint32_t i = lane; i < e; i += 32) sum += expf(lg[i] - mx);
    sum = warp_sum(sum);
    float prev_v = INFINITY;
    uint32_t prev_i = 0;
    float total = 0.0f;
    bool nan_row = false;
    for (uint32_t c = 0; c < k; ++c) {
        float best_v = -1.0f;
        uint32_t best_i = 0xFFFFFFFFu;
        for (uint32_t i = lane; i < e; i += 32) {
            const float p = expf(lg[i] - mx) / sum;
            if (p != p) nan_row = true;
            const bool after_prev = c == 0 || route_before(prev_v, prev_i, p, i);
            if (after_prev && route_before(p, i, best_v, best_i)) {
                best_v = p;
                best_i = i;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best_v, o);
            const uint32_t oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (route_before(ov, oi, best_v, best_i)) {
                best_v = ov;
                best_i = oi;
            }
        }
        nan_row = __any_sync(0xffffffffu, nan_row);
        if (nan_row || best_i >= e) {
            nan_row = true;
            break;
        }
        if (lane == 0) {
            ids[c] = best_i;
            weights[c] = best_v;
        }
        total += best_v;
        prev_v = best_v;
        prev_i = best_i;
    }
    if (nan_row) {
        for (uint32_t c = lane; c < k; c += 32) {
            ids[c] = e;
            weights[c] = moe_f32_nan();
        }
        return;
    }
    if (renormalize != 0 && lane == 0)
        for (uint32_t c = 0; c < k; ++c) weights[c] = weights[c] / total;
}

// ---------------------------------------------------------------------------------------------
// Expert projections.

MT_DEVICE void store_out(bf16* p, float v) { *p = f2bf(v); }
MT_DEVICE void store_out(float* p, float v) { *p = v; }
MT_DEVICE void store_nan(bf16* p) { *p = bf16_nan(); }
MT_DEVICE void store_nan(float* p) { *p = moe_f32_nan(); }

// The stacked weight of the expert projections, one type per storage format, read as one
// `[num_experts * n, k]` matrix: `load` reads 8-wide chunk `ch` of row `row` (its k 8ch..8ch+7;
// `vec`: k % 8 == 0 and an aligned base, so the chunk is one aligned vector) as a `Raw`,
// `unpack` makes it 8 floats, `elem` reads one element. Every format gives the floats of the
// bf16 weight its values stand for, so the products and their order are the same.
struct ExpertWBf16 {
    const bf16* w;
    using Raw = uint4;
    MT_DEVICE bool vec(uint32_t k) const { return k % 8 == 0 && aligned16(w); }
    MT_DEVICE Raw load(size_t row, uint32_t k, uint32_t ch) const { return load16(w + row * k + 8 * ch); }
    MT_DEVICE void unpack(const Raw& r, float (&out)[8]) const { unpack8(r, out); }
    MT_DEVICE float elem(size_t row, uint32_t k, uint32_t i) const { return bf2f(w[row * k + i]); }
};

// A block-FP8 weight: e4m3 bytes and an f32 scale per block of FP8_BLOCK columns by 2^shift
// rows; an element is bf16(e4m3 * scale') (gemm_fp8.cuh), `dequant_fp8`'s weight. A chunk
// of 8 never straddles two column blocks (FP8_BLOCK % 8 == 0).
struct ExpertWFp8 {
    const uint8_t* w;
    const float* scales;
    uint32_t shift;    // log2 of the weight rows a scale row covers
    uint32_t kblocks;  // scale columns: ceil(k / FP8_BLOCK)
    struct Raw {
        uint2 q;
        float scale;
    };
    MT_DEVICE bool vec(uint32_t k) const { return k % 8 == 0 && aligned8(w); }
    MT_DEVICE float scale(size_t row, uint32_t col) const {
        return __ldg(scales + (row >> shift) * kblocks + col / FP8_BLOCK);
    }
    MT_DEVICE Raw load(size_t row, uint32_t k, uint32_t ch) const {
        return Raw{*reinterpret_cast<const uint2*>(w + row * k + 8 * ch), scale(row, 8 * ch)};
    }
    MT_DEVICE void unpack(const Raw& r, float (&out)[8]) const { unpack8(fp8_frag(r.q, fp8_scale2(r.scale)), out); }
    MT_DEVICE float elem(size_t row, uint32_t k, uint32_t i) const {
        const uint32_t v = fp8x2_scaled(w[row * k + i], FP8_PAIR_LO, fp8_scale2(scale(row, i)));
        return __uint_as_float(v << 16);  // the low half: the element's bf16 as a float
    }
};

// Dot products of weight row `row` (k values of format W) with the x rows of `np` (<= MOE_PB)
// pairs; lane-strided 8-wide chunks when `vec`, single elements otherwise; reduced over the warp.
template <typename W>
MT_DEVICE void expert_dots(float (&acc)[MOE_PB], const W& w, size_t row, const bf16* const (&xr)[MOE_PB],
                           uint32_t np, uint32_t k, bool vec) {
    const uint32_t lane = threadIdx.x & 31;
#pragma unroll
    for (int b = 0; b < MOE_PB; ++b) acc[b] = 0.0f;
    if (vec) {
        // Lane l takes the 8-wide chunks l, l + 32, l + 64, ... in order, four at a time: their
        // weight loads are all issued (past the row's end: none) before the first product.
        const uint32_t chunks = k / 8;
        for (uint32_t base = 0; base < chunks; base += 128) {
            typename W::Raw raw[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint32_t ch = base + lane + 32 * u;
                if (ch < chunks) raw[u] = w.load(row, k, ch);
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const uint32_t ch = base + lane + 32 * u;
                if (ch >= chunks) break;
                float wf[8];
                w.unpack(raw[u], wf);
#pragma unroll
                for (int b = 0; b < MOE_PB; ++b) {
                    if (b < (int)np) {
                        float xf[8];
                        unpack8(load16(xr[b] + 8 * ch), xf);
#pragma unroll
                        for (int t = 0; t < 8; ++t) acc[b] = fmaf(xf[t], wf[t], acc[b]);
                    }
                }
            }
        }
    } else {
        for (uint32_t i = lane; i < k; i += 32) {
            const float wv = w.elem(row, k, i);
#pragma unroll
            for (int b = 0; b < MOE_PB; ++b)
                if (b < (int)np) acc[b] = fmaf(bf2f(xr[b][i]), wv, acc[b]);
        }
    }
#pragma unroll
    for (int b = 0; b < MOE_PB; ++b) acc[b] = warp_sum(acc[b]);
}

// The body of both expert projections (see the header).
template <typename OUT, typename W>
MT_DEVICE void expert_block(OUT* __restrict__ out, const bf16* __restrict__ x, const W& w,
                            const uint32_t* __restrict__ expert_ids, uint32_t pairs, uint32_t n,
                            uint32_t k, uint32_t num_experts, uint32_t per, uint32_t kernel) {
    extern __shared__ uint32_t routed[];  // ceil(num_experts / 32) words
    __shared__ uint32_t list[MOE_LIST];
    __shared__ uint32_t list_len, scan_at, expert;
    if (n == 0) return;
    if (per == 0) {
        mt_fault(kernel, MT_FAULT_SHAPE);
        return;
    }
    const uint32_t words = (num_experts + 31) / 32;
    const uint32_t cpb = (n + gridDim.x - 1) / gridDim.x;
    const uint32_t c0 = blockIdx.x * cpb, c1 = min(n, c0 + cpb);
    if (c0 >= n) return;
    for (uint32_t i = threadIdx.x; i < words; i += blockDim.x) routed[i] = 0;
    __syncthreads();
    for (uint32_t p = threadIdx.x; p < pairs; p += blockDim.x) {
        const uint32_t id = expert_ids[p];
        if (id < num_experts) {
            atomicOr(&routed[id >> 5], 1u << (id & 31));
        } else if (blockIdx.y == 0) {
            mt_fault(kernel, MT_FAULT_INDEX);
            for (uint32_t c = c0; c < c1; ++c) store_nan(out + (size_t)p * n + c);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        uint32_t e = 0xFFFFFFFFu, seen = 0;
        for (uint32_t i = 0; i < words; ++i) {
            const uint32_t bits = routed[i];
            const uint32_t cnt = __popc(bits);
            if (seen + cnt > blockIdx.y) {
                uint32_t rest = bits;
                for (uint32_t skip = blockIdx.y - seen; skip > 0; --skip) rest &= rest - 1;
                e = 32 * i + (__ffs(rest) - 1);
                break;
            }
            seen += cnt;
        }
        expert = e;
        scan_at = 0;
    }
    __syncthreads();
    const uint32_t e = expert;
    if (e == 0xFFFFFFFFu) return;
    const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const bool vec = w.vec(k) && aligned16(x);
    while (true) {
        // Warp 0 collects the next pairs of expert e, in ascending order, into `list`.
        if (warp == 0) {
            uint32_t at = scan_at, len = 0;
            while (at < pairs && len + 32 <= MOE_LIST) {
                const uint32_t p = at + lane;
                const bool mine = p < pairs && expert_ids[p] == e;
                const uint32_t ballot = __ballot_sync(0xffffffffu, mine);
                if (mine) list[len + __popc(ballot & ((1u << lane) - 1))] = p;
                len += __popc(ballot);
                at += 32;
            }
            if (lane == 0) {
                list_len = len;
                scan_at = at;
            }
        }
        __syncthreads();
        const uint32_t len = list_len;
        if (len == 0) break;
        for (uint32_t c = c0 + warp; c < c1; c += warps) {
            for (uint32_t b0 = 0; b0 < len; b0 += MOE_PB) {
                const uint32_t np = min(len - b0, (uint32_t)MOE_PB);
                const bf16* xr[MOE_PB];
#pragma unroll
                for (int b = 0; b < MOE_PB; ++b)
                    xr[b] = x + (size_t)(list[b0 + min((uint32_t)b, np - 1)] / per) * k;
                float acc[MOE_PB];
                expert_dots(acc, w, (size_t)e * n + c, xr, np, k, vec);
                if (lane < np) {
                    float v = acc[0];
#pragma unroll
                    for (int b = 1; b < MOE_PB; ++b)
                        if (lane == (uint32_t)b) v = acc[b];
                    store_out(out + (size_t)list[b0 + lane] * n + c, v);
                }
            }
        }
        const bool more = scan_at < pairs;
        __syncthreads();
        if (!more) break;
    }
}

// expert_linear(out: bf16 [pairs, n], x: bf16 [pairs / pairs_per_x_row, k], w: bf16
// [num_experts, n, k], expert_ids: u32 [pairs], pairs, n, k, num_experts, pairs_per_x_row):
// out[p] = x[p / pairs_per_x_row] · w[expert_ids[p]]ᵀ. Pairs with an expert id past
// num_experts get NaN outputs.
extern "C" __global__ void expert_linear(EXPERT_LINEAR_PARAMS(bf16)) {
    expert_block(out, x, ExpertWBf16{w}, expert_ids, pairs, n, k, num_experts, pairs_per_x_row,
                 MT_KERNEL_EXPERT_LINEAR);
}

// expert_linear_f32out: as expert_linear, f32 out.
extern "C" __global__ void expert_linear_f32out(EXPERT_LINEAR_PARAMS(float)) {
    expert_block(out, x, ExpertWBf16{w}, expert_ids, pairs, n, k, num_experts, pairs_per_x_row,
                 MT_KERNEL_EXPERT_LINEAR_F32OUT);
}

// expert_linear_fp8(out: bf16 [pairs, n], x, w: fp8 e4m3 [num_experts, n, k], scales: f32
// [ceil(num_experts * n / 2^scale_row_shift), ceil(k / FP8_BLOCK)], expert_ids, pairs, n, k,
// num_experts, pairs_per_x_row, scale_row_shift): `expert_linear` of the weight
// bf16(f32(w * scale)), each pair's outputs bitwise `expert_linear`'s on `dequant_fp8`'s output
// (the same products in the same order, each weight converted as it is read).
extern "C" __global__ void expert_linear_fp8(EXPERT_LINEAR_FP8_PARAMS(bf16)) {
    const ExpertWFp8 wf{w, scales, scale_row_shift, (k + FP8_BLOCK - 1) / FP8_BLOCK};
    expert_block(out, x, wf, expert_ids, pairs, n, k, num_experts, pairs_per_x_row, MT_KERNEL_EXPERT_LINEAR_FP8);
}

// expert_linear_fp8_f32out: as expert_linear_fp8, f32 out.
extern "C" __global__ void expert_linear_fp8_f32out(EXPERT_LINEAR_FP8_PARAMS(float)) {
    const ExpertWFp8 wf{w, scales, scale_row_shift, (k + FP8_BLOCK - 1) / FP8_BLOCK};
    expert_block(out, x, wf, expert_ids, pairs, n, k, num_experts, pairs_per_x_row,
                 MT_KERNEL_EXPERT_LINEAR_FP8_F32OUT);
}

// ---------------------------------------------------------------------------------------------
// Combine.

// moe_combine(out: bf16 [rows, hidden], expert_out: f32 [rows * top_k, hidden], topk_weights:
// f32 [rows, top_k], shared_out: bf16 [rows, hidden] or NULL, shared_gate: f32 [rows] or NULL,
// rows, hidden, top_k): out[r] = Σ_choice weight · expert_out (choice in order)
// + sigmoid(gate) · shared (gate factor 1 without a gate, no term without shared_out).
extern "C" __global__ void moe_combine(MOE_COMBINE_PARAMS) {
    const uint32_t r = blockIdx.x;
    if (r >= rows) return;
    const float* wt = topk_weights + (size_t)r * top_k;
    const float* eo = expert_out + (size_t)r * top_k * hidden;
    const float g = shared_gate ? sigmoidf_acc(shared_gate[r]) : 1.0f;
    const bf16* sh = shared_out ? shared_out + (size_t)r * hidden : nullptr;
    bf16* o = out + (size_t)r * hidden;
    for (uint32_t c = threadIdx.x; c < hidden; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t choice = 0; choice < top_k; ++choice)
            acc += wt[choice] * eo[(size_t)choice * hidden + c];
        if (sh) acc += g * bf2f(sh[c]);
        o[c] = f2bf(acc);
    }
}
