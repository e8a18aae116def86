// `paged_attention_prompt`: the causal attention of prompt rows in an arithmetic of their own
// (not `paged_attention`'s): one softmax chain a row over its keys in tiles of APR_TILE (64) from
// position 0, each tile one online-softmax step (the tile's maximum, the correction of the
// running outputs, the probabilities rounded to bf16 and summed as rounded, then P V). A row's
// result depends on its query, its context and the cache alone: not on the step's other rows,
// nor on how its prompt was cut into chunks. CPU twin: `paged_attention_prompt` in
// metrale-gpu-runtime/src/cpu/kernels/attention.rs. Included by attention.cu.
//
// Items: a row group of prompt rows (ops::attention_step_plan: consecutive rows of one sequence
// whose positions lie in one APR_TILE-key tile, at most prompt_rows_per_item) by a group of hb
// query heads sharing a key/value head; virtual row v = j * hb + h (head h0 + h of row first + j),
// APR_VROWS (128) of them. A block is three warpgroups and computes one item: warpgroup 0 copies
// (cp.async: the queries, then each tile's key and value tokens in 16-byte pieces into the
// no-swizzle core-matrix layouts the warpgroup MMAs read) into one ring of APR_STAGES tiles, and
// warpgroups 1 and 2 compute virtual rows 0-63 and 64-127 from it, so both read every tile the
// copies bring once (a consumer whose virtual rows are all padding stops at once). A consumer's
// tile: S = Q Kᵀ by eight m64n64k16 from shared memory (one accumulation chain), the softmax in
// registers, O += P V by four m64n128k16 with P as the register operand and V read through the
// instruction's transpose; tile t's P V runs beside tile t + 1's scores and softmax, and the two
// consumers take turns issuing their MMAs. Blocks take the items last first (the longest
// contexts first).
//
// Grid (items, 1), APR_THREADS threads, apr_shared_bytes() of dynamic shared memory (one block a
// multiprocessor). The sm_90a cubin only: the compute_90 PTX reports a SHAPE fault and writes
// NaN. The launcher runs it for head_dim 128, bf16 pools and hb * rows per item <= APR_VROWS
// only; another launch reports a GEOMETRY or SHAPE fault and writes NaN to the groups' rows. A
// malformed group gets NaN outputs; rows of no group are not written.

// Virtual rows of an item, and of one consumer. APR_THREADS, APR_TILE, APR_STAGES, APR_ROWS and
// APR_D come from abi.cuh.
#define APR_VROWS 128
#define APR_CROWS 64

constexpr uint32_t APR_CQ_BYTES = APR_CROWS * APR_D * 2;  // a consumer's queries
constexpr uint32_t APR_TILE_BYTES = APR_TILE * APR_D * 2;  // a tile's keys, or its values
constexpr uint32_t APR_RING_BYTES = APR_STAGES * 2 * APR_TILE_BYTES;
// The two consumers' queries, the ring, then the barriers (full and empty a stage, the
// queries' one).
constexpr uint32_t APR_BAR_OFF = 2 * APR_CQ_BYTES + APR_RING_BYTES;
constexpr uint32_t APR_BARS = 2 * APR_STAGES + 1;

MT_DEVICE uint32_t apr_shared_bytes() { return 128 + APR_BAR_OFF + APR_BARS * 8; }

// Byte offset of element (row r, k) of a k-major no-swizzle operand of `rows` rows: k step k / 16
// a block of rows * 32 bytes, in it core matrix (r / 8, k-half) at ((r / 8) * 2 + half) * 128 and
// its row r % 8 at 16 (r % 8). Descriptor strides: 128 bytes between k-halves, 256 between
// 8-row groups.
MT_DEVICE uint32_t apr_kmaj(uint32_t rows, uint32_t r, uint32_t k) {
    return (k / 16) * rows * 32 + ((r / 8) * 2 + (k % 16) / 8) * 128 + (r % 8) * 16 + (k % 8) * 2;
}

// Byte offset of V's element (token k of 16, dimension n) for the transposed reading: core
// matrix (n / 8, k / 8) at ((n / 8) * 2 + k / 8) * 128, its row k % 8 holding dimensions
// 8 (n / 8) .. + 7.
MT_DEVICE uint32_t apr_mn(uint32_t n, uint32_t k) { return ((n / 8) * 2 + k / 8) * 128 + (k % 8) * 16 + (n % 8) * 2; }

// The no-swizzle descriptor of the operand at `addr`: leading byte offset 128, stride 256.
MT_DEVICE uint64_t apr_desc(uint32_t addr) {
    return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)(128 >> 4) << 16) | ((uint64_t)(256 >> 4) << 32);
}

#define APR_ACC32_REGS                                                                                        \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, " \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31"

// d[32] (+)= A B, A 64 x 16 and B 64 x 16 (k-major), both by descriptor; `acc` false ignores d.
MT_DEVICE void apr_m64n64(float (&d)[32], uint64_t da, uint64_t db, bool acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" APR_ACC32_REGS
                 "}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC16(d, 0), WG_ACC16(d, 16)
                 : "l"(da), "l"(db), "r"((uint32_t)acc));
}

// d[64] += A B: A 64 x 16 from registers (a warp's mma.sync A fragment), B 16 x 128 by
// descriptor, read through the instruction's transpose (B's N contiguous).
MT_DEVICE void apr_m64n128_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" WG_ACC64_REGS
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
                 : WG_ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// 16 bytes from global `src` to shared address `dst` (`bytes` 16, or 0: zeros).
MT_DEVICE void apr_cp16(uint32_t dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// The block's item: its rows (first, count), sequence, first query head, key/value head offset
// in a slot, each row's context and the largest (0: a malformed group or an item past the
// launch's).
struct AprItem {
    uint32_t row, cnt, seq, h0, kv, ctx;
    uint32_t ctxs[APR_ROWS];
};

// Consumers an item needs: the second only where its virtual rows 64-127 hold a row.
MT_DEVICE uint32_t apr_consumers(const AprItem& it, uint32_t hb) { return it.cnt * hb > APR_CROWS ? 2 : 1; }

// The producer's 128 threads `pt` (warp w, lane l): the item's queries, then every tile of keys
// and values into the ring. Thread pt copies pieces 4 w + l / 8 (16 bytes each) of the keys and
// values of tokens 8 k + l % 8 (k < 8), so a warp's copy reads whole 32-byte sectors of eight
// tokens and writes eight distinct 16-byte bank groups. A token past the item's context, or in a
// slot past the pool (reported), becomes zeros.
MT_DEVICE void apr_produce(const AprItem& it, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                           const uint32_t* block_tables, uint32_t row_stride, uint32_t q_head_stride, uint32_t hb,
                           uint32_t block_size, uint32_t max_blocks, uint32_t num_slots, size_t width, uint32_t qa,
                           uint32_t ring, uint32_t full, uint32_t empty, uint32_t qbar, uint32_t pt) {
    // Queries likewise: pieces pt / 8 of virtual rows 8 i + pt % 8.
    for (uint32_t i = 0; i < APR_VROWS / 8; ++i) {
        const uint32_t v = 8 * i + pt % 8, e = 8 * (pt / 8);
        const bool on = v / hb < it.cnt;
        const bf16* src = on ? qkv + (size_t)(it.row + v / hb) * row_stride + (size_t)(it.h0 + v % hb) * q_head_stride + e
                             : qkv;
        apr_cp16(qa + (v / APR_CROWS) * APR_CQ_BYTES + apr_kmaj(APR_CROWS, v % APR_CROWS, e), src, on ? 16u : 0u);
    }
    cp_async_mbar_arrive(qbar);
    const uint32_t tiles = (it.ctx + APR_TILE - 1) / APR_TILE;
    const uint32_t* table = block_tables + (size_t)it.seq * max_blocks;
    const uint32_t e = 8 * (4 * (pt / 32) + (pt % 32) / 8), tl = pt % 8;
    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t s = t % APR_STAGES, ka = ring + s * 2 * APR_TILE_BYTES, va = ka + APR_TILE_BYTES;
        mbar_wait(empty + s * 8, ((t / APR_STAGES) & 1) ^ 1);
#pragma unroll
        for (uint32_t k = 0; k < APR_TILE / 8; ++k) {
            const uint32_t tp = 8 * k + tl, tok = t * APR_TILE + tp;
            uint32_t slot = 0;
            bool live = tok < it.ctx;
            if (live) {
                slot = table[tok / block_size] * block_size + tok % block_size;
                if (slot >= num_slots) {
                    mt_fault(MT_KERNEL_PAGED_ATTENTION_PROMPT, MT_FAULT_INDEX);
                    live = false;
                }
            }
            const size_t at = live ? (size_t)slot * width + it.kv + e : 0;
            const uint32_t bytes = live ? 16u : 0u;
            apr_cp16(ka + apr_kmaj(APR_TILE, tp, e), k_cache + at, bytes);
            apr_cp16(va + (tp / 16) * 16 * APR_D * 2 + apr_mn(e, tp % 16), v_cache + at, bytes);
        }
        cp_async_mbar_arrive(full + s * 8);
    }
}

// S = Q Kᵀ of a consumer's queries at `qa` and the tile's keys at `ka`, issued (one chain of
// eight m64n64k16; the caller fences, commits and waits).
MT_DEVICE void apr_scores(float (&sc)[32], uint32_t qa, uint32_t ka) {
#pragma unroll
    for (int k = 0; k < APR_D / 16; ++k)
        apr_m64n64(sc, apr_desc(qa + k * APR_CROWS * 32), apr_desc(ka + k * APR_TILE * 32), k > 0);
}

// One softmax step over tile t's 64 scores for each of the thread's two rows (contexts `ctx`,
// quad lane q4): the tile's maximum, the running maximum `m` and sum `l` updated, the
// probabilities rounded to bf16 into `pk` (the P V MMA's A fragments) and the outputs'
// correction 2^(m - m') into `corr`.
MT_DEVICE void apr_softmax(const float (&sc)[32], uint32_t t, const uint32_t (&ctx)[2], uint32_t q4, float scale_log2,
                           float (&m)[2], float (&l)[2], uint32_t (&pk)[4][4], float (&corr)[2]) {
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        float x[8][2], mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const uint32_t key = t * APR_TILE + 8 * nb + 2 * q4 + e;
                x[nb][e] = key < ctx[rh] ? __fmul_rn(sc[4 * nb + 2 * rh + e], scale_log2) : -INFINITY;
                mx = fmaxf(mx, x[nb][e]);
            }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Finite: a row's first tile holds its first key, and a later tile past its context
        // leaves the maximum where it was (correction 1, probabilities 0).
        const float mnew = fmaxf(m[rh], mx);
        corr[rh] = att_exp2(m[rh] - mnew);
        float sum = 0.0f;
#pragma unroll
        for (int nb = 0; nb < 8; ++nb) {
            const uint32_t pp = att_pack_bf16(att_exp2(x[nb][0] - mnew), att_exp2(x[nb][1] - mnew));
            sum = __fadd_rn(sum, __fadd_rn(__uint_as_float(pp << 16), __uint_as_float(pp & 0xFFFF0000u)));
            // k16 slice nb / 2: a0 / a1 its first 8 keys of rows g / g + 8, a2 / a3 the next.
            pk[nb / 2][(nb % 2) * 2 + rh] = pp;
        }
        l[rh] = fmaf(l[rh], corr[rh], sum);
        m[rh] = mnew;
    }
}

// The two consumers' turns (256 threads: one warpgroup waits, the other arrives).
MT_DEVICE void apr_turn_sync(uint32_t id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
MT_DEVICE void apr_turn_arrive(uint32_t id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

// O += P V of the tile's values at `va` (four m64n128k16, P the register operand), issued.
MT_DEVICE void apr_pv(float (&o)[64], const uint32_t (&pk)[4][4], uint32_t va) {
#pragma unroll
    for (int j = 0; j < 4; ++j) apr_m64n128_rs(o, pk[j], apr_desc(va + j * 16 * APR_D * 2));
}

// The running outputs times each row's correction (accumulator element i is row
// g + 8 ((i / 2) % 2)).
MT_DEVICE void apr_rescale(float (&o)[64], const float (&corr)[2]) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = __fmul_rn(o[i], corr[(i >> 1) & 1]);
}

// Consumer c's warpgroup (thread wt of 128) over virtual rows 64 c .. 64 c + 63 of the item:
// every tile, then the rows written.
MT_DEVICE void apr_consume(const AprItem& it, bf16* out, const bf16* qkv, uint32_t row_stride, uint32_t q_head_stride,
                           uint32_t hb, uint32_t hq, float scale_log2, bool gated, uint32_t c, bool pingpong,
                           uint32_t qa, uint32_t ring, uint32_t full, uint32_t empty, uint32_t qbar, uint32_t wt) {
    const uint32_t warp = wt / 32, lane = wt % 32, g = lane / 4, q4 = lane % 4;
    // This thread's two virtual rows (g and g + 8 of the warp's 16) and their contexts; a
    // padding row attends to the first key (its output is not written), so it stays finite.
    uint32_t vr[2], ctx[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        vr[rh] = APR_CROWS * c + 16 * warp + g + 8 * rh;
        const uint32_t j = vr[rh] / hb;
        ctx[rh] = j < it.cnt ? it.ctxs[j] : 1u;
    }
    float o[64], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, sc[32], corr[2];
    // Two sets of probabilities: tile t's, read by its P V in flight, and tile t + 1's.
    uint32_t pa[4][4], pb[4][4];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    const uint32_t tiles = (it.ctx + APR_TILE - 1) / APR_TILE;
    mbar_wait(qbar, 0);
    mbar_wait(full, 0);
    fence_async_smem();  // the producer's cp.async writes, to the MMAs
    wg_fence();
    apr_scores(sc, qa, ring);
    wg_commit();
    wg_wait0();
    wg_pin(sc);
    apr_softmax(sc, 0, ctx, q4, scale_log2, m, l, pa, corr);
    apr_rescale(o, corr);
    // Tile t's P V runs beside tile t + 1's scores and softmax; the outputs' correction for
    // tile t + 1 waits for it (the order of every row's operations is the plain loop's).
    // With both consumers computing, they take turns to issue a step's MMAs (named barriers
    // 1 + c: consumer c waits on its own, then lets the other go), so one's softmax runs while
    // the other's MMAs hold the tensor cores. Consumer 1 lets consumer 0 go first, and
    // consumer 0 takes the last turn it is given after its loop.
    if (pingpong && c == 1) apr_turn_arrive(1);
    const auto step = [&](uint32_t t, uint32_t(&p)[4][4], uint32_t(&pn)[4][4]) {
        const uint32_t s = t % APR_STAGES, s1 = (t + 1) % APR_STAGES;
        mbar_wait(full + s1 * 8, ((t + 1) / APR_STAGES) & 1);
        fence_async_smem();
        wg_pin(p);
        if (pingpong) apr_turn_sync(1 + c);
        wg_fence();
        apr_scores(sc, qa, ring + s1 * 2 * APR_TILE_BYTES);
        wg_commit();
        apr_pv(o, p, ring + s * 2 * APR_TILE_BYTES + APR_TILE_BYTES);
        wg_commit();
        if (pingpong) apr_turn_arrive(2 - c);
        wg_wait1();
        wg_pin(sc);
        apr_softmax(sc, t + 1, ctx, q4, scale_log2, m, l, pn, corr);
        wg_wait0();
        wg_pin(o);
        mbar_arrive(empty + s * 8);
        apr_rescale(o, corr);
    };
    const auto last = [&](uint32_t t, uint32_t(&p)[4][4]) {
        const uint32_t s = t % APR_STAGES;
        wg_pin(p);
        wg_fence();
        apr_pv(o, p, ring + s * 2 * APR_TILE_BYTES + APR_TILE_BYTES);
        wg_commit();
        wg_wait0();
        wg_pin(o);
        mbar_arrive(empty + s * 8);
    };
    for (uint32_t t = 0;; t += 2) {
        if (t + 1 >= tiles) {
            last(t, pa);
            break;
        }
        step(t, pa, pb);
        if (t + 2 >= tiles) {
            last(t + 1, pb);
            break;
        }
        step(t + 1, pb, pa);
    }
    if (pingpong && c == 0) apr_turn_sync(1);
    // The rows: the numerators over the sums (the quad's four partial sums added in lane
    // order), times the gate.
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        const uint32_t q0 = lane & ~3u;
        float den = __shfl_sync(0xffffffffu, l[rh], q0);
#pragma unroll
        for (uint32_t k = 1; k < 4; ++k) den = __fadd_rn(den, __shfl_sync(0xffffffffu, l[rh], q0 + k));
        const uint32_t j = vr[rh] / hb, h = it.h0 + vr[rh] % hb;
        if (j >= it.cnt || it.ctx == 0) continue;
        const size_t row = it.row + j;
        bf16* dst = out + row * (size_t)hq * APR_D + (size_t)h * APR_D;
        const bf16* gate = qkv + row * row_stride + (size_t)h * q_head_stride + APR_D;
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            if (((i >> 1) & 1) != rh) continue;
            const uint32_t col = 8 * (i / 4) + 2 * q4 + (i & 1);
            dst[col] = att_value(o[i], den, gated ? gate + col : nullptr);
        }
    }
}

extern "C" __global__ void __launch_bounds__(APR_THREADS, 1) paged_attention_prompt(PAGED_ATTENTION_PREFILL_PARAMS) {
#if !defined(__CUDA_ARCH_FEAT_SM90_ALL)
    // The compute_90 PTX has no warpgroup MMAs: a SHAPE fault, NaN rows (the engine runs the
    // prompt kernel on Hopper's sm_90a cubin only).
    mt_fault(MT_KERNEL_PAGED_ATTENTION_PROMPT, MT_FAULT_SHAPE);
    for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
        for (uint32_t i = threadIdx.x; i < num_q_heads * head_dim; i += blockDim.x)
            out[(size_t)r * num_q_heads * head_dim + i] = bf16_nan();
#else
    extern __shared__ __align__(128) unsigned char apr_dyn[];
    __shared__ AprItem it;
    const uint32_t base0 = (uint32_t)__cvta_generic_to_shared(apr_dyn);
    const uint32_t base = base0 + ((128 - (base0 & 127)) & 127);
    const uint32_t hb = att_heads_per_block(num_q_heads, num_kv_heads);
    const uint32_t groups = num_q_heads / hb, n_items = n_groups * groups;
    const uint32_t group = num_kv_heads > 0 ? num_q_heads / num_kv_heads : 1;
    const uint32_t rpi = min((uint32_t)APR_ROWS, APR_VROWS / hb);
    uint32_t dyn_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    const bool shape_ok = num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && head_dim == APR_D &&
                          kv_fp8 == 0 && block_size > 0 && q_head_stride % 8 == 0 && row_stride % 8 == 0 &&
                          aligned16(qkv) && aligned16(k_cache) && aligned16(v_cache);
    const bool geometry_ok = blockDim.x == APR_THREADS && gridDim.y == 1 && gridDim.x >= n_items &&
                             dyn_bytes >= apr_shared_bytes();
    if (!shape_ok || !geometry_ok) {
        mt_fault(MT_KERNEL_PAGED_ATTENTION_PROMPT, shape_ok ? MT_FAULT_GEOMETRY : MT_FAULT_SHAPE);
        const uint32_t width = num_q_heads * head_dim;
        for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
            for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) out[(size_t)r * width + i] = bf16_nan();
        return;
    }
    const uint32_t bars = base + APR_BAR_OFF;
    const uint32_t full = bars, empty = bars + APR_STAGES * 8, qbar = bars + 2 * APR_STAGES * 8;
    // The block's item (atp_kernel's checks of a group: 1..rpi rows of one sequence), and the
    // barriers: the producer's 128 threads fill a stage, the active consumers' threads empty it.
    if (threadIdx.x == 0) {
        it.row = it.cnt = it.seq = it.h0 = it.kv = it.ctx = 0;
        if (blockIdx.x < n_items) {
            const uint32_t n = n_items - 1 - blockIdx.x;
            const uint32_t gi = n / groups, h0 = (n % groups) * hb;
            const uint32_t r = row_groups[2 * gi], cnt = row_groups[2 * gi + 1];
            bool ok = cnt >= 1 && cnt <= rpi && r < rows && cnt <= rows - r;
            const uint32_t seq = ok ? row_seq[r] : 0;
            uint32_t ctx = 0;
            for (uint32_t i = 0; ok && i < cnt; ++i) {
                const uint32_t ci = positions[r + i] + 1;
                ok = row_seq[r + i] == seq && ci != 0;
                it.ctxs[i] = ci;
                ctx = max(ctx, ci);
            }
            ok = ok && seq < num_seqs && (ctx + block_size - 1) / block_size <= max_blocks;
            it.row = r;
            it.cnt = r < rows ? min(min(cnt, rows - r), rpi) : 0;
            it.seq = ok ? seq : 0;
            it.h0 = h0;
            it.kv = (h0 / group) * head_dim;
            it.ctx = ok ? ctx : 0;
        }
        const uint32_t consumers = apr_consumers(it, hb);
        for (uint32_t s = 0; s < APR_STAGES; ++s) {
            mbar_init(full + s * 8, 128);
            mbar_init(empty + s * 8, 128 * consumers);
        }
        mbar_init(qbar, 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();
    const uint32_t tid = threadIdx.x, wg = tid / 128, wt = tid % 128;
    if (it.ctx == 0) {
        // A malformed group (or none): NaN to the rows it names.
        for (uint32_t i = tid; i < it.cnt * hb * APR_D; i += APR_THREADS) {
            const uint32_t j = i / (hb * APR_D), h = it.h0 + (i / APR_D) % hb;
            out[(size_t)(it.row + j) * num_q_heads * APR_D + (size_t)h * APR_D + i % APR_D] = bf16_nan();
        }
        return;
    }
    const size_t width = (size_t)num_kv_heads * head_dim;
    if (wg == 0) {
        apr_produce(it, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride, hb, block_size, max_blocks,
                    num_slots, width, base, base + 2 * APR_CQ_BYTES, full, empty, qbar, wt);
        return;
    }
    const uint32_t c = wg - 1;
    const uint32_t consumers = apr_consumers(it, hb);
    if (c >= consumers) return;  // only padding rows
    apr_consume(it, out, qkv, row_stride, q_head_stride, hb, num_q_heads, scale * ATT_LOG2E, gated != 0, c,
                consumers == 2, base + c * APR_CQ_BYTES, base + 2 * APR_CQ_BYTES, full, empty, qbar, wt);
#endif
}
