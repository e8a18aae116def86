// `paged_attention_prompt`: the causal attention of prompt rows in an arithmetic of their own
// (not `paged_attention`'s): one softmax chain a row over its keys in tiles of APR_TILE (64) from
// position 0, each tile one online-softmax step (the tile's maximum, the correction of the
// running outputs, the probabilities rounded to bf16 and summed as rounded, then P V). A row's
// result depends on its query, its context and the cache alone: not on the step's other rows,
// nor on how its prompt was cut into chunks. CPU twin: `paged_attention_prompt` in
// metrale-gpu-runtime/src/cpu/kernels/attention.rs. Included by attention.cu.
//
// Items are `paged_attention_prefill`'s: a row group (ops::attention_row_groups) by a group of hb
// query heads sharing a key/value head, virtual row v = j * hb + h (head h0 + h of row first +
// j), 64 virtual rows. A block is three warpgroups: warpgroup 0 copies (cp.async: each key and
// value token's 16-byte pieces into the no-swizzle core-matrix layouts the warpgroup MMAs read)
// and warpgroups 1 and 2 each compute one item, the block's items n_items - 1 - 2 b and
// n_items - 2 - 2 b (the longest contexts first), each from a ring of its own (APR_STAGES tiles of
// keys and values, the queries beside it). A consumer's tile: S = Q Kᵀ by eight m64n64k16 from
// shared memory (one accumulation chain), the softmax in registers, O += P V by four m64n128k16
// with P as the register operand and V read through the instruction's transpose.
//
// Grid (ceil(items / 2), 1), APR_THREADS threads, apr_shared_bytes() of dynamic shared memory
// (one block a multiprocessor). The sm_90a cubin only: the compute_90 PTX reports a SHAPE fault
// and writes NaN. The launcher runs it for head_dim 128, bf16 pools and hb * rows
// per item <= 64 only; another launch reports a GEOMETRY or SHAPE fault and writes NaN to the
// groups' rows. A malformed group gets NaN outputs; rows of no group are not written.

// Virtual rows of an item (the prefill kernel's at head_dim 128). APR_THREADS, APR_TILE,
// APR_STAGES and APR_D come from abi.cuh.
#define APR_VROWS 64

constexpr uint32_t APR_Q_BYTES = APR_VROWS * APR_D * 2;
constexpr uint32_t APR_TILE_BYTES = APR_TILE * APR_D * 2;  // a tile's keys, or its values
constexpr uint32_t APR_RING_BYTES = APR_STAGES * 2 * APR_TILE_BYTES;
// Per consumer: its queries, its ring; then the barriers (per consumer: full and empty per
// stage, the queries' one).
constexpr uint32_t APR_BAR_OFF = 2 * (APR_Q_BYTES + APR_RING_BYTES);
constexpr uint32_t APR_BARS = 2 * (2 * APR_STAGES + 1);

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

// One item as a block sees it: its rows (first, count), sequence, first query head, key/value
// head offset in a slot, each row's context and the largest (0: a malformed group or an item
// past the launch's).
struct AprItem {
    uint32_t row, cnt, seq, h0, kv, ctx;
    uint32_t ctxs[ATP_ROWS];
};

struct AprShared {
    AprItem it[2];
};

// The producer's 64 threads `pt` of consumer c: the item's queries, then every tile of keys and
// values into the consumer's ring. A token past the item's context, or in a slot past the pool
// (reported), becomes zeros.
MT_DEVICE void apr_produce(const AprItem& it, const bf16* qkv, const bf16* k_cache, const bf16* v_cache,
                           const uint32_t* block_tables, uint32_t row_stride, uint32_t q_head_stride, uint32_t hb,
                           uint32_t block_size, uint32_t max_blocks, uint32_t num_slots, size_t width, uint32_t qa,
                           uint32_t ring, uint32_t full, uint32_t empty, uint32_t qbar, uint32_t pt) {
    for (uint32_t idx = pt; idx < APR_VROWS * (APR_D / 8); idx += 64) {
        const uint32_t v = idx / (APR_D / 8), e = 8 * (idx % (APR_D / 8));
        const bool on = v / hb < it.cnt;
        const bf16* src = on ? qkv + (size_t)(it.row + v / hb) * row_stride + (size_t)(it.h0 + v % hb) * q_head_stride + e
                             : qkv;
        apr_cp16(qa + apr_kmaj(APR_VROWS, v, e), src, on ? 16u : 0u);
    }
    cp_async_mbar_arrive(qbar);
    const uint32_t tiles = (it.ctx + APR_TILE - 1) / APR_TILE;
    const uint32_t* table = block_tables + (size_t)it.seq * max_blocks;
    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t s = t % APR_STAGES, ka = ring + s * 2 * APR_TILE_BYTES, va = ka + APR_TILE_BYTES;
        mbar_wait(empty + s * 8, ((t / APR_STAGES) & 1) ^ 1);
        // Thread pt: token pt of the tile, its 16 pieces of keys and 16 of values.
        const uint32_t tok = t * APR_TILE + pt;
        uint32_t slot = 0;
        bool live = tok < it.ctx;
        if (live) {
            slot = table[tok / block_size] * block_size + tok % block_size;
            if (slot >= num_slots) {
                mt_fault(MT_KERNEL_PAGED_ATTENTION_PROMPT, MT_FAULT_INDEX);
                live = false;
            }
        }
        const bf16* kp = k_cache + (live ? (size_t)slot * width + it.kv : 0);
        const bf16* vp = v_cache + (live ? (size_t)slot * width + it.kv : 0);
        const uint32_t vd = va + (pt / 16) * 16 * APR_D * 2;
#pragma unroll
        for (uint32_t c = 0; c < APR_D / 8; ++c) {
            apr_cp16(ka + apr_kmaj(APR_TILE, pt, 8 * c), kp + 8 * c, live ? 16u : 0u);
            apr_cp16(vd + apr_mn(8 * c, pt % 16), vp + 8 * c, live ? 16u : 0u);
        }
        cp_async_mbar_arrive(full + s * 8);
    }
}

// A consumer warpgroup (thread wt of 128) over its item: every tile, then the rows written.
MT_DEVICE void apr_consume(const AprItem& it, bf16* out, const bf16* qkv, uint32_t row_stride, uint32_t q_head_stride,
                           uint32_t hb, uint32_t hq, float scale_log2, bool gated, uint32_t qa, uint32_t ring,
                           uint32_t full, uint32_t empty, uint32_t qbar, uint32_t wt) {
    const uint32_t warp = wt / 32, lane = wt % 32, g = lane / 4, q4 = lane % 4;
    // This thread's two virtual rows (g and g + 8 of the warp's 16) and their contexts; a
    // padding row attends to the first key (its output is not written), so it stays finite.
    uint32_t vr[2], ctx[2];
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
        vr[rh] = 16 * warp + g + 8 * rh;
        const uint32_t j = vr[rh] / hb;
        ctx[rh] = j < it.cnt ? it.ctxs[j] : 1u;
    }
    float o[64], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;
    const uint32_t tiles = (it.ctx + APR_TILE - 1) / APR_TILE;
    mbar_wait(qbar, 0);
    for (uint32_t t = 0; t < tiles; ++t) {
        const uint32_t s = t % APR_STAGES, ka = ring + s * 2 * APR_TILE_BYTES, va = ka + APR_TILE_BYTES;
        mbar_wait(full + s * 8, (t / APR_STAGES) & 1);
        fence_async_smem();  // the producer's cp.async writes, to the MMAs
        float sc[32];
        wg_fence();
#pragma unroll
        for (int k = 0; k < APR_D / 16; ++k)
            apr_m64n64(sc, apr_desc(qa + k * APR_VROWS * 32), apr_desc(ka + k * APR_TILE * 32), k > 0);
        wg_commit();
        wg_wait0();
        // One softmax step over the tile's 64 keys for each of the thread's two rows.
        uint32_t pk[4][4];
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
            const float mnew = fmaxf(m[rh], mx), corr = att_exp2(m[rh] - mnew);
            float sum = 0.0f;
#pragma unroll
            for (int nb = 0; nb < 8; ++nb) {
                const uint32_t pp = att_pack_bf16(att_exp2(x[nb][0] - mnew), att_exp2(x[nb][1] - mnew));
                sum = __fadd_rn(sum, __fadd_rn(__uint_as_float(pp << 16), __uint_as_float(pp & 0xFFFF0000u)));
                // k16 slice nb / 2: a0 / a1 its first 8 keys of rows g / g + 8, a2 / a3 the next.
                pk[nb / 2][(nb % 2) * 2 + rh] = pp;
            }
            l[rh] = fmaf(l[rh], corr, sum);
            m[rh] = mnew;
#pragma unroll
            for (int i = 0; i < 64; ++i)
                if (((i >> 1) & 1) == rh) o[i] = __fmul_rn(o[i], corr);
        }
        wg_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) apr_m64n128_rs(o, pk[j], apr_desc(va + j * 16 * APR_D * 2));
        wg_commit();
        wg_wait0();
        mbar_arrive(empty + s * 8);
    }
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
    __shared__ AprShared sh;
    const uint32_t base0 = (uint32_t)__cvta_generic_to_shared(apr_dyn);
    const uint32_t base = base0 + ((128 - (base0 & 127)) & 127);
    const uint32_t hb = att_heads_per_block(num_q_heads, num_kv_heads);
    const uint32_t groups = num_q_heads / hb, n_items = n_groups * groups;
    const uint32_t group = num_kv_heads > 0 ? num_q_heads / num_kv_heads : 1;
    const uint32_t rpi = min((uint32_t)ATP_ROWS, APR_VROWS / hb);
    uint32_t dyn_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn_bytes));
    const bool shape_ok = num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && head_dim == APR_D &&
                          kv_fp8 == 0 && block_size > 0 && q_head_stride % 8 == 0 && row_stride % 8 == 0 &&
                          aligned16(qkv) && aligned16(k_cache) && aligned16(v_cache);
    const bool geometry_ok = blockDim.x == APR_THREADS && gridDim.y == 1 && 2 * gridDim.x >= n_items &&
                             dyn_bytes >= apr_shared_bytes();
    if (!shape_ok || !geometry_ok) {
        mt_fault(MT_KERNEL_PAGED_ATTENTION_PROMPT, shape_ok ? MT_FAULT_GEOMETRY : MT_FAULT_SHAPE);
        const uint32_t width = num_q_heads * head_dim;
        for (uint32_t r = blockIdx.x; r < rows; r += gridDim.x)
            for (uint32_t i = threadIdx.x; i < width; i += blockDim.x) out[(size_t)r * width + i] = bf16_nan();
        return;
    }
    // The block's two items (atp_kernel's checks of a group: 1..rpi rows of one sequence).
    if (threadIdx.x < 2) {
        const uint32_t c = threadIdx.x, k = 2 * blockIdx.x + c;
        AprItem& it = sh.it[c];
        it.row = it.cnt = it.seq = it.h0 = it.kv = it.ctx = 0;
        if (k < n_items) {
            const uint32_t n = n_items - 1 - k;
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
    }
    const uint32_t bars = base + APR_BAR_OFF;
    if (threadIdx.x == 0) {
        for (uint32_t c = 0; c < 2; ++c) {
            const uint32_t b = bars + c * (2 * APR_STAGES + 1) * 8;
            for (uint32_t s = 0; s < APR_STAGES; ++s) {
                mbar_init(b + s * 8, 64);
                mbar_init(b + (APR_STAGES + s) * 8, 128);
            }
            mbar_init(b + 2 * APR_STAGES * 8, 64);
        }
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    __syncthreads();
    const uint32_t tid = threadIdx.x, wg = tid / 128, wt = tid % 128;
    const uint32_t c = wg == 0 ? wt / 64 : wg - 1;
    const AprItem& it = sh.it[c];
    const uint32_t qa = base + c * (APR_Q_BYTES + APR_RING_BYTES), ring = qa + APR_Q_BYTES;
    const uint32_t b = bars + c * (2 * APR_STAGES + 1) * 8;
    const uint32_t full = b, empty = b + APR_STAGES * 8, qbar = b + 2 * APR_STAGES * 8;
    if (it.ctx == 0) {
        // A malformed group (or none): NaN to the rows it names, from its consumer.
        if (wg != 0)
            for (uint32_t i = wt; i < it.cnt * hb * APR_D; i += 128) {
                const uint32_t j = i / (hb * APR_D), h = it.h0 + (i / APR_D) % hb;
                out[(size_t)(it.row + j) * num_q_heads * APR_D + (size_t)h * APR_D + i % APR_D] = bf16_nan();
            }
        return;
    }
    const size_t width = (size_t)num_kv_heads * head_dim;
    if (wg == 0) {
        apr_produce(it, qkv, k_cache, v_cache, block_tables, row_stride, q_head_stride, hb, block_size, max_blocks,
                    num_slots, width, qa, ring, full, empty, qbar, wt % 64);
        return;
    }
    apr_consume(it, out, qkv, row_stride, q_head_stride, hb, num_q_heads, scale * ATT_LOG2E, gated != 0, qa, ring,
                full, empty, qbar, wt);
#endif
}
