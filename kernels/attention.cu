// Causal attention of each row over its sequence's paged KV cache. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/attention.rs.
//
// Launch: grid (num_q_heads, rows), 128 threads (any multiple of 32 up to 1024 works), no
// dynamic shared memory. One block computes one (query head, row): an online softmax in f32 over
// the row's context (positions 0..=pos) in tiles of ATT_TILE tokens, read through the block
// table. Scores: each token's dot product is split over a power-of-two group of lanes and
// reduced by xor shuffles; values: each thread owns up to 8 dims of one "group" of threads, the
// groups take the tile's tokens round-robin and are summed in group order at the end. Every
// order is fixed by (head_dim, blockDim), so the result is deterministic and does not depend on
// the other rows of the launch.
//
// Rows whose inputs are out of range (sequence past the block tables, a context longer than
// max_blocks, a slot past num_slots, head_dim > ATT_MAX_D) get NaN outputs (errors on the CPU).
#include "common.cuh"

#define ATT_TILE 128
#define ATT_MAX_D 512
#define ATT_PART 1024

struct AttnArgs {
    uint32_t rows, row_stride, q_head_stride, hq, hkv, d, block_size, max_blocks, num_seqs, num_slots;
    float scale;
    bool gated;
};

// paged_attention(out: bf16 [rows, num_q_heads * head_dim], qkv: bf16 [rows, row_stride],
// k_cache, v_cache: bf16 [num_slots, num_kv_heads, head_dim], block_tables: u32 [num_seqs,
// max_blocks], row_seq: u32 [rows], positions: u32 [rows], rows, row_stride, q_head_stride,
// num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_seqs, num_slots, scale, gated).
extern "C" __global__ void paged_attention(
    bf16* __restrict__ out, const bf16* __restrict__ qkv, const bf16* __restrict__ k_cache,
    const bf16* __restrict__ v_cache, const uint32_t* __restrict__ block_tables,
    const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ positions, uint32_t rows,
    uint32_t row_stride, uint32_t q_head_stride, uint32_t num_q_heads, uint32_t num_kv_heads,
    uint32_t head_dim, uint32_t block_size, uint32_t max_blocks, uint32_t num_seqs,
    uint32_t num_slots, float scale, uint32_t gated) {
    __shared__ __align__(16) float q_s[ATT_MAX_D];
    __shared__ float p_s[ATT_TILE];
    __shared__ uint32_t slot_s[ATT_TILE];
    __shared__ __align__(16) float part_s[ATT_PART];
    __shared__ int bad_s;

    const uint32_t h = blockIdx.x, r = blockIdx.y;
    if (h >= num_q_heads || r >= rows) return;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const uint32_t d = head_dim;
    bf16* o = out + ((size_t)r * num_q_heads + h) * d;

    const uint32_t seq = row_seq[r];
    const uint32_t ctx_len = positions[r] + 1;
    const bool shape_ok = num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && d > 0 &&
                          d <= ATT_MAX_D && block_size > 0 && seq < num_seqs &&
                          ctx_len != 0 && (ctx_len + block_size - 1) / block_size <= max_blocks &&
                          blockDim.x % 32 == 0;
    if (!shape_ok) {
        for (uint32_t i = tid; i < d; i += blockDim.x) o[i] = bf16_nan();
        return;
    }
    const uint32_t group = num_q_heads / num_kv_heads;
    const size_t width = (size_t)num_kv_heads * d;
    const size_t kv_at = (size_t)(h / group) * d;
    const bf16* q = qkv + (size_t)r * row_stride + (size_t)h * q_head_stride;
    const uint32_t* table = block_tables + (size_t)seq * max_blocks;

    // Vector path: 16-byte loads of keys and values (d % 8 == 0 keeps every head 16-aligned).
    const bool vec = d % 8 == 0 && aligned16(k_cache) && aligned16(v_cache);
    for (uint32_t i = tid; i < d; i += blockDim.x) q_s[i] = bf2f(q[i]);
    if (tid == 0) bad_s = 0;

    // Score layout: `lpt` lanes per token (a power of two), `tpw` tokens per warp.
    const uint32_t nvec = vec ? d / 8 : d;
    uint32_t lpt = 1;
    while (lpt < nvec && lpt < 32) lpt <<= 1;
    const uint32_t tpw = 32 / lpt;
    const uint32_t sub = lane / lpt, sl = lane % lpt;

    // Value layout: `units` threads cover the head (each 8 contiguous dims on the vector path,
    // else dims u, u + units, ...), `groups` copies of them take tokens round-robin.
    const uint32_t units = vec ? d / 8 : (d < blockDim.x ? d : blockDim.x);
    const uint32_t groups = blockDim.x / units;
    const uint32_t unit = tid % units, grp = tid / units;
    const bool v_active = grp < groups;
    const uint32_t per = vec ? 8 : (d + units - 1) / units;  // dims per thread, at most 8
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = 0.0f;
    if (per > 8 || groups * d > ATT_PART) {
        for (uint32_t i = tid; i < d; i += blockDim.x) o[i] = bf16_nan();
        return;
    }
    __syncthreads();

    float m_run = -INFINITY, l_run = 0.0f;
    for (uint32_t start = 0; start < ctx_len; start += ATT_TILE) {
        const uint32_t n_t = min((uint32_t)ATT_TILE, ctx_len - start);
        // 1. Slots and scores of the tile.
        for (uint32_t base = warp * tpw; base < n_t; base += nwarps * tpw) {
            const uint32_t i = base + sub;
            float dot = 0.0f;
            uint32_t slot = 0;
            bool ok = false;
            if (i < n_t) {
                const uint32_t t = start + i;
                const uint64_t slot64 = (uint64_t)table[t / block_size] * block_size + t % block_size;
                ok = slot64 < num_slots;
                slot = ok ? (uint32_t)slot64 : 0u;
                if (ok) {
                    const bf16* k = k_cache + (size_t)slot * width + kv_at;
                    if (vec) {
                        for (uint32_t v = sl; v < nvec; v += lpt) {
                            float kf[8];
                            unpack8(load16(k + 8 * v), kf);
                            const float4 qa = *reinterpret_cast<const float4*>(q_s + 8 * v);
                            const float4 qb = *reinterpret_cast<const float4*>(q_s + 8 * v + 4);
                            dot += qa.x * kf[0]; dot += qa.y * kf[1]; dot += qa.z * kf[2]; dot += qa.w * kf[3];
                            dot += qb.x * kf[4]; dot += qb.y * kf[5]; dot += qb.z * kf[6]; dot += qb.w * kf[7];
                        }
                    } else {
                        for (uint32_t e = sl; e < d; e += lpt) dot += q_s[e] * bf2f(k[e]);
                    }
                }
            }
            for (uint32_t off = lpt / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
            if (i < n_t && sl == 0) {
                p_s[i] = dot * scale;
                slot_s[i] = slot;
                if (!ok) bad_s = 1;
            }
        }
        __syncthreads();
        // 2. Tile max, computed the same way by every warp.
        float mx = -INFINITY;
        for (uint32_t i = lane; i < n_t; i += 32) mx = fmaxf(mx, p_s[i]);
        mx = warp_max(mx);
        const float m_new = fmaxf(m_run, mx);
        const float corr = expf(m_run - m_new);
        __syncthreads();
        // 3. Probabilities.
        for (uint32_t i = tid; i < n_t; i += blockDim.x) p_s[i] = expf(p_s[i] - m_new);
        __syncthreads();
        float sum = 0.0f;
        for (uint32_t i = lane; i < n_t; i += 32) sum += p_s[i];
        sum = warp_sum(sum);
        l_run = l_run * corr + sum;
        m_run = m_new;
        // 4. Values.
        if (v_active) {
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] *= corr;
            for (uint32_t i = grp; i < n_t; i += groups) {
                const float p = p_s[i];
                const bf16* v = v_cache + (size_t)slot_s[i] * width + kv_at;
                if (vec) {
                    float vf[8];
                    unpack8(load16(v + 8 * unit), vf);
#pragma unroll
                    for (int j = 0; j < 8; ++j) acc[j] += p * vf[j];
                } else {
#pragma unroll
                    for (int j = 0; j < 8; ++j) {
                        const uint32_t e = unit + j * units;
                        if (j < (int)per && e < d) acc[j] += p * bf2f(v[e]);
                    }
                }
            }
        }
        __syncthreads();
    }

    // Combine the groups in order, normalise, gate, store.
    if (v_active) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint32_t e = vec ? 8 * unit + j : unit + j * units;
            if (j < (int)per && e < d) part_s[grp * d + e] = acc[j];
        }
    }
    __syncthreads();
    const bool bad = bad_s != 0;
    for (uint32_t e = tid; e < d; e += blockDim.x) {
        float a = 0.0f;
        for (uint32_t g = 0; g < groups; ++g) a += part_s[g * d + e];
        float val = a / l_run;
        if (gated) val *= sigmoidf_acc(bf2f(q[d + e]));
        o[e] = bad ? bf16_nan() : f2bf(val);
    }
}
