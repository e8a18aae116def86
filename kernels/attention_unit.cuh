// The pieces both attention kernels share, included by attention.cu before either kernel: the
// geometry constants, the unit split, the MMA, ldmatrix and movmatrix wrappers, the per-row
// softmax step, the combine arithmetic, the launch fields and the slot lookup. A row's result is
// bitwise the same in both kernels: its split, its combine and, operation for operation, its
// softmax are the same (the prefill kernel runs att_softmax_row; the decode kernel holds its
// tiles transposed and runs the same operations on the same operands from other lanes, in
// att_unit); the GPU tests compare the two kernels bit for bit.

#define ATT_THREADS (32 * ATT_WARPS)
#define ATT_LOG2E 1.4426950408889634f

// Query heads per cluster: the largest divisor of the group size that is at most ATT_HB (1 when
// the heads do not group). The launcher computes the same.
MT_DEVICE uint32_t att_heads_per_block(uint32_t hq, uint32_t hkv) {
    if (hkv == 0 || hq % hkv != 0) return 1;
    const uint32_t g = hq / hkv;
    for (uint32_t b = ATT_HB; b > 1; --b)
        if (g % b == 0) return b;
    return 1;
}

// head_dim padded to the tensor-core tile the kernel is instantiated for.
MT_DEVICE uint32_t att_padded_dim(uint32_t d) {
    return d <= 32 ? 32 : d <= 64 ? 64 : d <= 128 ? 128 : 256;
}

// The units [ub, ue) of a row's context (ctx tokens) that block `split` takes.
MT_DEVICE void att_split_units(uint32_t ctx, uint32_t split, uint32_t& ub, uint32_t& ue) {
    const uint32_t units = (ctx + ATT_UNIT - 1) / ATT_UNIT;
    ub = (uint32_t)((uint64_t)split * units / ATT_SPLITS);
    ue = (uint32_t)((uint64_t)(split + 1) * units / ATT_SPLITS);
}

// Of a split's units [ub, ue), the chain warp `part` takes: `mine` consecutive units from
// `first`, the split cut into ATT_WARPS chains as it is cut from the context (in proportion).
MT_DEVICE void att_part_units(uint32_t ub, uint32_t ue, uint32_t part, uint32_t& first, uint32_t& mine) {
    const uint32_t n = ue - ub;
    first = ub + part * n / ATT_WARPS;
    mine = ub + (part + 1) * n / ATT_WARPS - first;
}

// The units of a row's context (ctx tokens) that warp `part` of block `split` takes. Both kernels
// cut a context this way.
MT_DEVICE void att_units(uint32_t ctx, uint32_t split, uint32_t part, uint32_t& first, uint32_t& mine) {
    uint32_t ub, ue;
    att_split_units(ctx, split, ub, ue);
    att_part_units(ub, ue, part, first, mine);
}

// d0..d3 (an m16n8k16 result: rows g and g + 8, columns 2c, 2c + 1) += A B: a0 / a2 hold A row
// g's k 2c, 2c+1 / 2c+8, 2c+9, a1 / a3 row g + 8's; b0 / b1 hold B column g's same k (g = lane /
// 4, c = lane % 4).
MT_DEVICE void att_mma16(float& d0, float& d1, float& d2, float& d3, uint32_t a0, uint32_t a1,
                         uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

MT_DEVICE void att_ldsm4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

MT_DEVICE void att_ldsm4_t(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

// The fragment of the transpose of the 8x8 bf16 matrix whose fragment (row g, columns 2c and
// 2c + 1 in each lane) is `x` (movmatrix).
MT_DEVICE uint32_t att_transpose8(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

MT_DEVICE uint32_t att_pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// 2^x on the special-function unit, results below 2^-126 flushed to zero (exp2f's range
// scaling costs two instructions per call, and the softmax calls it five times a row per unit).
MT_DEVICE float att_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Whether a warp must rescale its running outputs by this unit's corrections: not on its first
// unit of an item (the outputs are zeros) and not when every row's maximum stayed (each factor
// is 1). Skipping is exact, and both kernels decide the same way.
MT_DEVICE bool att_rescale(bool first, bool moved) { return !first && __any_sync(0xffffffffu, moved); }

// One row's online-softmax step over a unit, on the quad of lanes holding the row: its scores
// in two chains (s0 + s1, [n-tile][column pair]) scaled, tokens past `ctx` masked, the running
// max `m` and sum `l` updated (the sum adds the bf16-rounded probabilities), `corr` the factor
// for the row's running output and `pa` its probabilities as the A operand of P V. The prefill
// kernel runs every row through this function; the decode kernel's transposed att_unit repeats
// its operations, in this order, for each value.
MT_DEVICE void att_softmax_row(const float (&s0)[2][2], const float (&s1)[2][2], uint32_t unit,
                               uint32_t ctx, float scale_log2, uint32_t c, float& m, float& l,
                               float& corr, uint32_t (&pa)[2]) {
    float x[2][2];
    float mx = -INFINITY;
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const uint32_t t = unit * ATT_UNIT + 8 * n + 2 * c + e;
            x[n][e] = t < ctx ? __fmul_rn(__fadd_rn(s0[n][e], s1[n][e]), scale_log2) : -INFINITY;
            mx = fmaxf(mx, x[n][e]);
        }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float m_new = fmaxf(m, mx);  // finite: a unit holds at least one live token
    corr = att_exp2(m - m_new);
    float sum = 0.0f;
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        pa[n] = att_pack_bf16(att_exp2(x[n][0] - m_new), att_exp2(x[n][1] - m_new));
        sum = __fadd_rn(sum, __fadd_rn(__uint_as_float(pa[n] << 16), __uint_as_float(pa[n] & 0xFFFF0000u)));
    }
    l = fmaf(l, corr, sum);
    m = m_new;
}

// Folds, the one way partials combine: a partial (maximum m, sum l, numerators p) joins a
// running total (M, L, P) as M' = max(M, m), L' = l 2^(m - M') + L 2^(M - M'), P' likewise, each
// an fmaf over an explicit product, with weight 0 for a side that saw no token (maximum -inf).
// A split folds its ATT_WARPS chains in chain order from an empty total, an item its splits in
// split order; so a walk over a row's units that starts each chain afresh and folds it as it
// ends (the chain into its split's total, the split into the row's) computes the bits of the
// kernels that run the chains side by side.

// The weights of a fold of a partial of maximum `m` into a total of maximum `M`: the total's
// `wt`, the partial's `wp`, and the new maximum `mn`.
MT_DEVICE void att_fold_weights(float M, float m, float& mn, float& wt, float& wp) {
    mn = fmaxf(M, m);
    wt = M == -INFINITY ? 0.0f : att_exp2(M - mn);
    wp = m == -INFINITY ? 0.0f : att_exp2(m - mn);
}

// One value of a fold: the total's `total` and the partial's `part` under their weights.
MT_DEVICE float att_fold(float total, float part, float wt, float wp) { return fmaf(part, wp, __fmul_rn(total, wt)); }

// The weights of N partials (maxima `ms`) folded in order from an empty total, into `wt` and `wp`;
// the sums `ls` folded into `den`; returns the total's maximum.
template <int N>
MT_DEVICE float att_fold_all(const float (&ms)[N], const float (&ls)[N], float (&wt)[N], float (&wp)[N], float& den) {
    float mx = -INFINITY;
    den = 0.0f;
#pragma unroll
    for (int s = 0; s < N; ++s) {
        float mn;
        att_fold_weights(mx, ms[s], mn, wt[s], wp[s]);
        den = att_fold(den, ls[s], wt[s], wp[s]);
        mx = mn;
    }
    return mx;
}

// One output value from its folded numerator and sum, times the output gate when there is one
// (every attention kernel's last step).
MT_DEVICE bf16 att_value(float num, float den, const bf16* gate) {
    float val = num / den;
    if (gate != nullptr) val *= sigmoidf_acc(bf2f(*gate));
    return f2bf(val);
}

// One output of an item: its splits' numerators `ps` folded in split order under the weights of
// att_fold_all, over the folded sum `den` (att_value).
MT_DEVICE bf16 att_finish(const float* wt, const float* wp, const float (&ps)[ATT_SPLITS], float den,
                          const bf16* gate) {
    float num = 0.0f;
#pragma unroll
    for (int s = 0; s < ATT_SPLITS; ++s) num = att_fold(num, ps[s], wt[s], wp[s]);
    return att_value(num, den, gate);
}

// The launch, as one block sees it.
struct AttLaunch {
    bf16* out;
    const bf16* qkv;
    const bf16* k_cache;
    const bf16* v_cache;
    const uint32_t* block_tables;
    uint32_t row_stride, q_head_stride, hq, d, block_size, max_blocks, num_slots;
    uint32_t bs_shift;  // log2(block_size) when it is a power of two, else 32
    bool unit_blocks;   // block_size is a multiple of ATT_UNIT: a unit's tokens share one block
    uint32_t hb, group, groups, n_items, n_clusters, cluster, split, nk;
    size_t width;  // elements per slot (num_kv_heads * head_dim)
    float scale_log2;
    bool gated, vec;
};

// The fields both kernels share, from the launch arguments; `items` is the number of rows
// (`paged_attention`) or row groups (`paged_attention_prefill`).
MT_DEVICE AttLaunch att_launch(bf16* out, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                               const uint32_t* block_tables, uint32_t row_stride, uint32_t q_head_stride,
                               uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,
                               uint32_t block_size, uint32_t max_blocks, uint32_t num_slots, float scale,
                               uint32_t gated, uint32_t items, uint32_t kv_fp8) {
    AttLaunch a;
    a.out = out;
    a.qkv = qkv;
    a.k_cache = k_cache;
    a.v_cache = v_cache;
    a.block_tables = block_tables;
    a.row_stride = row_stride;
    a.q_head_stride = q_head_stride;
    a.hq = num_q_heads;
    a.d = head_dim;
    a.block_size = block_size;
    a.max_blocks = max_blocks;
    a.num_slots = num_slots;
    a.bs_shift = block_size != 0 && (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : 32u;
    a.unit_blocks = block_size != 0 && block_size % ATT_UNIT == 0;
    a.hb = att_heads_per_block(num_q_heads, num_kv_heads);
    a.group = num_kv_heads > 0 ? num_q_heads / num_kv_heads : 1;
    a.groups = num_q_heads / a.hb;
    a.n_items = items * a.groups;
    a.n_clusters = gridDim.x / ATT_SPLITS;
    a.cluster = blockIdx.x / ATT_SPLITS;
    a.split = blockIdx.x % ATT_SPLITS;
    a.nk = a.cluster < a.n_items ? (a.n_items - a.cluster + a.n_clusters - 1) / a.n_clusters : 0;
    a.width = (size_t)num_kv_heads * head_dim;
    a.scale_log2 = scale * ATT_LOG2E;
    a.gated = gated != 0;
    // FP8 rows are copied 16 bytes (16 elements) at a time.
    a.vec = head_dim % (kv_fp8 != 0 ? 16 : 8) == 0 && q_head_stride % 8 == 0 && row_stride % 8 == 0 &&
            aligned16(qkv) && aligned16(k_cache) && aligned16(v_cache);
    return a;
}

// Item k of this cluster (number cluster + k * n_clusters): its row (`paged_attention`) or row
// group (`paged_attention_prefill`) `ri`, its first query head `h0` and its key/value head's
// offset `kv` in a slot.
MT_DEVICE void att_item_at(const AttLaunch& a, uint32_t k, uint32_t& ri, uint32_t& h0, uint32_t& kv) {
    const uint32_t n = a.cluster + k * a.n_clusters;
    ri = n / a.groups;
    h0 = (n % a.groups) * a.hb;
    kv = (h0 / a.group) * a.d;
}

// Token t's block-table column and offset in its block (shifts for the usual power-of-two block
// sizes: a division per unit costs as much as the unit's softmax).
// PLAIN: the launch takes the decode kernels' plain path (att_plain), so the size is a power of
// two.
template <bool PLAIN = false>
MT_DEVICE uint32_t att_block_col(const AttLaunch& a, uint32_t t) {
    return PLAIN || a.bs_shift < 32 ? t >> a.bs_shift : t / a.block_size;
}

template <bool PLAIN = false>
MT_DEVICE uint32_t att_block_off(const AttLaunch& a, uint32_t t) {
    return PLAIN || a.bs_shift < 32 ? t & (a.block_size - 1) : t % a.block_size;
}

// The block-table entry lane `lane` reads ahead for unit `unit` of a context of `ctx` tokens:
// the unit's one block in every lane when units lie within blocks, else (lanes 0..15) the block
// of token 16 * unit + lane.
template <bool PLAIN = false>
MT_DEVICE uint32_t att_entry(const AttLaunch& a, uint32_t seq, uint32_t unit, uint32_t ctx, uint32_t lane) {
    const bool unit_blocks = PLAIN || a.unit_blocks;
    const uint32_t t = unit * ATT_UNIT + (unit_blocks ? 0u : lane);
    return (unit_blocks || lane < ATT_UNIT) && t < ctx
               ? a.block_tables[(size_t)seq * a.max_blocks + att_block_col<PLAIN>(a, t)]
               : 0u;
}

// A unit that lies inside one block (a.unit_blocks; `entry` its block): the slot of its token 0
// (`base`, so token t is slot base + t) and its live tokens, none when a live token's slot is
// past the pool, which is what it returns (uniform).
template <bool PLAIN = false>
MT_DEVICE bool att_unit_span(const AttLaunch& a, uint32_t unit, uint32_t ctx, uint32_t entry, uint64_t& base,
                             uint32_t& live) {
    const uint32_t t0 = unit * ATT_UNIT;
    base = (uint64_t)entry * a.block_size + att_block_off<PLAIN>(a, t0);
    live = min((uint32_t)ATT_UNIT, ctx - t0);
    const bool bad = base + live > a.num_slots;
    if (bad) live = 0;
    return bad;
}

// Copy a unit that lies inside one block (att_unit_span): N 16-byte chunks of its keys and
// values, dimensions 8 ch..8 ch + 7 of tokens tok0, tok0 + step, ..., into rows of `ks` and `vs`
// (RS elements each) by cp.async, in lanes with `copy` set; tokens past the context and
// dimensions past head_dim become zeros. Returns (uniform) whether a live token's slot is past
// the pool, in which case nothing is copied. One multiply per lane instead of a slot shuffle and
// a 64-bit multiply per chunk. A dead chunk's copy keeps its (possibly out-of-range) address and
// reads no byte: choosing a safe address cost four selects a chunk.
template <int RS, int N>
MT_DEVICE bool att_copy_unit(const AttLaunch& a, const bf16* kb, const bf16* vb, uint32_t unit, uint32_t ctx,
                             uint32_t entry, bool copy, uint32_t tok0, uint32_t step, uint32_t ch, bf16* ks,
                             bf16* vs) {
    uint64_t base;
    uint32_t live;
    const bool bad = att_unit_span(a, unit, ctx, entry, base, live);
    if (!copy) return bad;
    const bool dim_on = 8 * ch < a.d;
    const size_t off0 = (size_t)(base + tok0) * a.width + 8 * ch, stride = (size_t)step * a.width;
    const bf16* kp = kb + off0;
    const bf16* vp = vb + off0;
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const uint32_t tok = tok0 + i * step;
        const bool on = dim_on && tok < live;
        cp_async16(ks + tok * RS + 8 * ch, kp, on ? 16u : 0u);
        cp_async16(vs + tok * RS + 8 * ch, vp, on ? 16u : 0u);
        kp += stride;
        vp += stride;
    }
    return bad;
}

// Lanes 0..15: the slot of token 16 * unit + lane of a context of `ctx` tokens (`entry`: its
// block, read ahead); `live` when it exists, `bad` when it is past the pool.
MT_DEVICE void att_slot(const AttLaunch& a, uint32_t unit, uint32_t ctx, uint32_t entry, uint32_t lane,
                        uint32_t& slot, uint32_t& live, bool& bad) {
    slot = 0;
    live = 0;
    bad = false;
    const uint32_t t = unit * ATT_UNIT + lane;
    if (lane < ATT_UNIT && t < ctx) {
        const uint64_t s = (uint64_t)entry * a.block_size + att_block_off(a, t);
        if (s < a.num_slots) {
            slot = (uint32_t)s;
            live = 1;
        } else {
            bad = true;
        }
    }
}

// FP8 pools (kv_fp8: the kernels' bodies instantiated with FP8 = true, the scale factors in
// their shared state, `kv2`). A ring row of RS = DP + 8 bf16 is 2 DP + 16 bytes; a unit's e4m3 bytes
// land in the top DP of them (from byte DP + 16, 16-byte aligned), and att_widen_rows rewrites
// each row as the bf16 values they stand for (bf16(e4m3 * scale'), fp8_frag) from byte 0,
// so the MMAs read bf16 rows exactly as from a bf16 pool.
template <int DP>
MT_DEVICE unsigned char* att_fp8_row(bf16* rows, uint32_t row) {
    return reinterpret_cast<unsigned char*>(rows + row * (DP + 8)) + DP + 16;
}

// Lanes 0..15: the slot of token 16 * unit + lane (live when it exists); returns (uniform)
// whether a live token's slot is past the pool, in which case no token is live.
MT_DEVICE bool att_fp8_slots(const AttLaunch& a, uint32_t unit, uint32_t ctx, uint32_t entry, uint32_t lane,
                             uint32_t& slot, uint32_t& live) {
    bool bad;
    if (a.unit_blocks) {
        uint64_t base;
        uint32_t n;
        bad = att_unit_span(a, unit, ctx, entry, base, n);
        slot = (uint32_t)(base + (lane & (ATT_UNIT - 1)));
        live = lane < ATT_UNIT && lane < n ? 1u : 0u;
    } else {
        att_slot(a, unit, ctx, entry, lane, slot, live, bad);
        bad = __any_sync(0xffffffffu, bad);
        if (bad) live = 0;
    }
    return bad;
}

// Copy the e4m3 bytes of tokens tok0 .. tok0 + ntok - 1 of a unit (their slots and liveness in
// lanes 0..15, att_fp8_slots) into the top of their key rows (`ks`) and value rows (`vs`): 16
// bytes a chunk by cp.async on the vector path, bytes by plain stores otherwise; dead tokens and
// dimensions past head_dim become zero bytes (which widen to zeros).
template <int DP>
MT_DEVICE void att_fp8_copy(const AttLaunch& a, const uint8_t* kb, const uint8_t* vb, uint32_t slot, uint32_t live,
                            uint32_t tok0, uint32_t ntok, bf16* ks, bf16* vs, uint32_t lane) {
    // Every lane runs every pass (the shuffles read the slot lanes), copying where its chunk
    // exists.
    if (a.vec) {
        constexpr uint32_t NC = DP / 16;
        const uint64_t policy = l2_evict_first_policy();
        for (uint32_t i0 = 0; i0 < ntok * NC; i0 += 32) {
            const uint32_t idx = i0 + lane, tok = (tok0 + idx / NC) & (ATT_UNIT - 1), ch = idx % NC;
            const uint32_t s = __shfl_sync(0xffffffffu, slot, tok);
            const bool on = __shfl_sync(0xffffffffu, live, tok) != 0 && 16 * ch < a.d;
            const size_t off = on ? (size_t)s * a.width + 16 * ch : 0;
            if (idx < ntok * NC) {
                cp_async16_hint(att_fp8_row<DP>(ks, tok) + 16 * ch, kb + off, on ? 16u : 0u, policy);
                cp_async16_hint(att_fp8_row<DP>(vs, tok) + 16 * ch, vb + off, on ? 16u : 0u, policy);
            }
        }
    } else {
        for (uint32_t i0 = 0; i0 < ntok * DP; i0 += 32) {
            const uint32_t idx = i0 + lane, tok = (tok0 + idx / DP) & (ATT_UNIT - 1), e = idx % DP;
            const uint32_t s = __shfl_sync(0xffffffffu, slot, tok);
            const bool on = __shfl_sync(0xffffffffu, live, tok) != 0 && e < a.d && idx < ntok * DP;
            const size_t off = (size_t)s * a.width + e;
            if (idx < ntok * DP) {
                att_fp8_row<DP>(ks, tok)[e] = on ? kb[off] : (uint8_t)0;
                att_fp8_row<DP>(vs, tok)[e] = on ? vb[off] : (uint8_t)0;
            }
        }
    }
}

// Widen `n` rows of a stage (row(i): the i-th, rows 0..15 keys, 16..31 values) from the e4m3
// bytes at their top to bf16 from their start, in place, by one warp after its copies landed
// (and a __syncwarp): each pass reads whole rows into registers, P chunks of 8 bytes a lane,
// syncs, then writes them. A warp that widens a whole unit alone (the decode kernels) takes
// P = 16, all of a unit's rows at head_dim 128 in one pass: the passes' loads, conversions and
// stores are latency its few warps cannot hide.
template <int DP, int P = 4, typename Row>
MT_DEVICE void att_widen_rows(const uint32_t (&kv2)[2], bf16* stage, uint32_t n, Row&& row, uint32_t lane) {
    constexpr uint32_t C8 = DP / 8, ROWS = 32 * P / C8;  // 8-byte chunks a row; rows a pass
    for (uint32_t r0 = 0; r0 < n; r0 += ROWS) {
        uint2 q[P];
#pragma unroll
        for (uint32_t p = 0; p < P; ++p) {
            const uint32_t idx = lane + 32 * p, i = r0 + idx / C8, c = idx % C8;
            if (i < n) q[p] = *reinterpret_cast<const uint2*>(att_fp8_row<DP>(stage, row(i)) + 8 * c);
        }
        __syncwarp();
#pragma unroll
        for (uint32_t p = 0; p < P; ++p) {
            const uint32_t idx = lane + 32 * p, i = r0 + idx / C8, c = idx % C8;
            if (i < n) {
                const uint32_t r = row(i);
                store16(stage + r * (DP + 8) + 8 * c, fp8_frag(q[p], kv2[r < ATT_UNIT ? 0 : 1]));
            }
        }
        __syncwarp();
    }
}

// The scale factors of the K and V pools (fp8_scale2), as the kernels keep them in shared
// memory.
MT_DEVICE void att_kv_scales(uint32_t (&kv2)[2], float k_scale, float v_scale) {
    kv2[0] = fp8_scale2(k_scale);
    kv2[1] = fp8_scale2(v_scale);
}

// The padded head dimension as a compile-time constant: run(AttDim<dp>()) for dp 32, 64, 128 or
// 256 (att_padded_dim's values), each kernel instantiating its body per tile width.
template <int D>
struct AttDim {
    static constexpr int value = D;
};

template <typename F>
MT_DEVICE void att_by_dim(uint32_t dp, F&& run) {
    switch (dp) {
        case 32: run(AttDim<32>()); break;
        case 64: run(AttDim<64>()); break;
        case 128: run(AttDim<128>()); break;
        default: run(AttDim<256>()); break;
    }
}

// Whether a launch's shape is one the kernels run (uniform over the launch, so every block of a
// cluster takes the same path): heads that group, a head_dim the tiles hold, `threads` per
// block, items per cluster within ATT_MAX_ITEMS and at least `smem` bytes of shared memory.
MT_DEVICE bool att_launch_ok(const AttLaunch& a, uint32_t num_kv_heads, uint32_t threads, uint32_t smem) {
    uint32_t dyn_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    return num_kv_heads > 0 && a.hq % num_kv_heads == 0 && a.d > 0 && a.d <= ATT_MAX_D &&
           a.block_size > 0 && blockDim.x == threads && gridDim.y == 1 &&
           (a.n_items + a.n_clusters - 1) / a.n_clusters <= ATT_MAX_ITEMS && dyn_bytes >= smem;
}

// Record why att_launch_ok refused kernel `kernel`'s launch: heads or a head dimension the
// kernels do not take (a shape), or else the geometry.
MT_DEVICE void att_refuse(uint32_t kernel, const AttLaunch& a, uint32_t num_kv_heads) {
    const bool shape = num_kv_heads == 0 || a.hq % num_kv_heads != 0 || a.d == 0 || a.d > ATT_MAX_D || a.block_size == 0;
    mt_fault(kernel, shape ? MT_FAULT_SHAPE : MT_FAULT_GEOMETRY);
}
