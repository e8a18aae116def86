// Causal attention of each row over its sequence's paged KV cache. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/attention.rs.
//
// Launch (ops::paged_attention): grid (ATT_SPLITS * num_q_heads / hb, rows), ATT_THREADS
// threads, ATT_KV_STAGE bytes of dynamic shared memory; the kernel is compiled with a cluster of
// ATT_SPLITS blocks along x. hb (`att_heads_per_block`) is the largest divisor of the GQA group size up to ATT_HB:
// a cluster computes the hb query heads that share one key/value head for one row, so each key
// and value vector is read once for all of them.
//
// Split-KV (flash decoding): the row's context (positions 0..=pos) is cut into ATT_SPLITS
// contiguous ranges of ceil(ctx / ATT_SPLITS) tokens; block `s` of the cluster runs an online
// softmax in f32 over range `s` in tiles (on the vector path each tile's keys and values are
// first copied into shared memory with cp.async, keys and values as two groups, so the values
// arrive while the scores are computed), then the cluster combines the
// ranges through distributed shared memory in range order (0, 1, ..., ATT_SPLITS - 1). The split
// count is a compile-time constant, so a row's result depends on its context length alone,
// never on the batch, and every order (scores: a power-of-two group of lanes per token reduced
// by xor shuffles; values: groups of threads taking tokens round-robin, summed in group order;
// ranges in range order) is fixed by (head_dim, blockDim), so results are deterministic.
//
// Rows whose inputs are out of range (sequence past the block tables, a context longer than
// max_blocks, a slot past num_slots, head_dim > ATT_MAX_D) get NaN outputs (errors on the CPU).
#include "common.cuh"

#include <cooperative_groups.h>

namespace cg = cooperative_groups;

#define ATT_SPLITS 8
#define ATT_TILE 256
#define ATT_HB 4
#define ATT_MAX_D 512
#define ATT_VEC_MAX_D 256
#define ATT_THREADS 256
#define ATT_UNROLL 4
// Per-group value partials: groups * d <= 8 * ATT_THREADS on the vector path, so
// ATT_HB * 8 * ATT_THREADS floats bound every layout.
#define ATT_PART (ATT_HB * 8 * ATT_THREADS)
// Dynamic shared memory: a tile's keys then values (vector path), later the value partials.
#define ATT_KV_STAGE (80 * 1024)

// Query heads per cluster: the largest divisor of the group size that is at most ATT_HB (1 when
// the heads do not group). The launcher computes the same.
MT_DEVICE uint32_t att_heads_per_block(uint32_t hq, uint32_t hkv) {
    if (hkv == 0 || hq % hkv != 0) return 1;
    const uint32_t g = hq / hkv;
    for (uint32_t b = ATT_HB; b > 1; --b)
        if (g % b == 0) return b;
    return 1;
}

// paged_attention(out: bf16 [rows, num_q_heads * head_dim], qkv: bf16 [rows, row_stride],
// k_cache, v_cache: bf16 [num_slots, num_kv_heads, head_dim], block_tables: u32 [num_seqs,
// max_blocks], row_seq: u32 [rows], positions: u32 [rows], rows, row_stride, q_head_stride,
// num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_seqs, num_slots, scale, gated).
extern "C" __global__ void __cluster_dims__(ATT_SPLITS, 1, 1) __launch_bounds__(ATT_THREADS, 2)
    paged_attention(bf16* __restrict__ out, const bf16* __restrict__ qkv,
                    const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                    const uint32_t* __restrict__ block_tables,
                    const uint32_t* __restrict__ row_seq, const uint32_t* __restrict__ positions,
                    uint32_t rows, uint32_t row_stride, uint32_t q_head_stride,
                    uint32_t num_q_heads, uint32_t num_kv_heads, uint32_t head_dim,
                    uint32_t block_size, uint32_t max_blocks, uint32_t num_seqs,
                    uint32_t num_slots, float scale, uint32_t gated) {
    // Queries in f32; after the tile loop, the block's combined (unnormalised) partial.
    __shared__ __align__(16) float q_s[ATT_HB * ATT_MAX_D];
    __shared__ float p_s[ATT_HB * ATT_TILE];
    __shared__ uint32_t slot_s[ATT_TILE];
    extern __shared__ __align__(16) unsigned char att_dyn[];  // ATT_KV_STAGE bytes
    float* part_s = reinterpret_cast<float*>(att_dyn);        // after the tile loop
    __shared__ float ml_s[2 * ATT_HB];  // running max, then running sum, per head
    __shared__ int bad_s;

    const uint32_t split = blockIdx.x % ATT_SPLITS;
    const uint32_t hb = att_heads_per_block(num_q_heads, num_kv_heads);
    const uint32_t h0 = (blockIdx.x / ATT_SPLITS) * hb, r = blockIdx.y;
    // Uniform over the cluster (same h0 and r), so no block waits at a cluster barrier alone.
    if (h0 >= num_q_heads || r >= rows) return;
    const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const uint32_t d = head_dim;
    const uint32_t cluster_threads = ATT_SPLITS * blockDim.x;
    bf16* o = out + ((size_t)r * num_q_heads + h0) * d;

    const uint32_t seq = row_seq[r];
    const uint32_t ctx_len = positions[r] + 1;
    const bool vec = d % 8 == 0 && d <= ATT_VEC_MAX_D && aligned16(k_cache) && aligned16(v_cache);
    // Value layout: `units` threads cover a head (8 contiguous dims each on the vector path, else
    // dims u, u + units, ...), `groups` copies of them take the tile's tokens round-robin.
    const uint32_t units = vec ? d / 8 : (d < blockDim.x ? d : blockDim.x);
    const uint32_t groups = units > 0 ? blockDim.x / units : 0;
    const uint32_t per = vec ? 8 : (units > 0 ? (d + units - 1) / units : 0);
    const bool shape_ok = num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 && d > 0 &&
                          d <= ATT_MAX_D && block_size > 0 && seq < num_seqs && ctx_len != 0 &&
                          (ctx_len + block_size - 1) / block_size <= max_blocks &&
                          blockDim.x % 32 == 0 && blockDim.x <= ATT_THREADS && per <= 8 &&
                          groups * hb * d <= ATT_PART;
    if (!shape_ok) {
        for (uint32_t i = split * blockDim.x + tid; i < hb * d; i += cluster_threads) o[i] = bf16_nan();
        return;
    }
    const uint32_t group = num_q_heads / num_kv_heads;
    const size_t width = (size_t)num_kv_heads * d;
    const size_t kv_at = (size_t)(h0 / group) * d;
    const bf16* qrow = qkv + (size_t)r * row_stride;
    const uint32_t* table = block_tables + (size_t)seq * max_blocks;
    const uint32_t chunk = (ctx_len + ATT_SPLITS - 1) / ATT_SPLITS;
    const uint32_t t_begin = min(ctx_len, split * chunk);
    const uint32_t t_end = min(ctx_len, t_begin + chunk);
    // Tokens per tile: the vector path stages a tile's keys and values in `att_dyn`.
    const uint32_t tile = vec ? min((uint32_t)ATT_TILE, (uint32_t)ATT_KV_STAGE / (4 * d)) : ATT_TILE;
    uint4* k_s = reinterpret_cast<uint4*>(att_dyn);  // [tile][d / 8]
    uint4* v_s = k_s + (size_t)tile * (d / 8);

    for (uint32_t i = tid; i < hb * d; i += blockDim.x)
        q_s[i] = bf2f(qrow[(size_t)(h0 + i / d) * q_head_stride + i % d]);
    if (tid == 0) bad_s = 0;

    // Score layout: `lpt` lanes per token (a power of two), `tpw` tokens per warp.
    const uint32_t nvec = vec ? d / 8 : d;
    uint32_t lpt = 1;
    while (lpt < nvec && lpt < 32) lpt <<= 1;
    const uint32_t tpw = 32 / lpt;
    const uint32_t sub = lane / lpt, sl = lane % lpt;
    const uint32_t unit = tid % units, grp = tid / units;
    const bool v_active = grp < groups;
    __syncthreads();

    // On the vector path each lane owns one 8-dim vector of every query (d <= 256 <= 8 * 32).
    float qr[ATT_HB][8];
#pragma unroll
    for (int j = 0; j < ATT_HB; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e)
            qr[j][e] = (vec && j < (int)hb && sl < nvec) ? q_s[j * d + 8 * sl + e] : 0.0f;

    float m_run[ATT_HB], l_run[ATT_HB], acc[ATT_HB][8];
#pragma unroll
    for (int j = 0; j < ATT_HB; ++j) {
        m_run[j] = -INFINITY;
        l_run[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[j][e] = 0.0f;
    }

    for (uint32_t start = t_begin; start < t_end; start += tile) {
        const uint32_t n_t = min(tile, t_end - start);
        // 1. Slots of the tile.
        for (uint32_t i = tid; i < n_t; i += blockDim.x) {
            const uint32_t t = start + i;
            const uint64_t slot64 = (uint64_t)table[t / block_size] * block_size + t % block_size;
            const bool ok = slot64 < num_slots;
            slot_s[i] = ok ? (uint32_t)slot64 : 0u;
            if (!ok) bad_s = 1;
        }
        __syncthreads();
        if (vec) {
            // Keys (group 1), then values (group 2) of the tile into shared memory.
            const uint32_t nv = d / 8, tile_vecs = n_t * nv;
            for (uint32_t idx = tid; idx < tile_vecs; idx += blockDim.x)
                cp_async16(k_s + idx, k_cache + (size_t)slot_s[idx / nv] * width + kv_at + 8 * (idx % nv), 16u);
            cp_async_commit();
            for (uint32_t idx = tid; idx < tile_vecs; idx += blockDim.x)
                cp_async16(v_s + idx, v_cache + (size_t)slot_s[idx / nv] * width + kv_at + 8 * (idx % nv), 16u);
            cp_async_commit();
            cp_async_wait<1>();
            __syncthreads();
        }
        // 2. Scores of every head of the block.
        if (vec) {
            const uint32_t round = nwarps * tpw;
            for (uint32_t base = warp * tpw; base < n_t; base += round * ATT_UNROLL) {
                uint4 kv[ATT_UNROLL];
#pragma unroll
                for (int u = 0; u < ATT_UNROLL; ++u) {
                    const uint32_t i = base + u * round + sub;
                    kv[u] = (i < n_t && sl < nvec) ? k_s[(size_t)i * nvec + sl] : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int u = 0; u < ATT_UNROLL; ++u) {
                    const uint32_t i = base + u * round + sub;
                    float kf[8];
                    unpack8(kv[u], kf);
                    float dot[ATT_HB];
#pragma unroll
                    for (int j = 0; j < ATT_HB; ++j) {
                        dot[j] = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) dot[j] += qr[j][e] * kf[e];
                        for (uint32_t off = lpt / 2; off > 0; off >>= 1)
                            dot[j] += __shfl_xor_sync(0xffffffffu, dot[j], off);
                    }
                    if (i < n_t && sl == 0) {
#pragma unroll
                        for (int j = 0; j < ATT_HB; ++j)
                            if (j < (int)hb) p_s[j * ATT_TILE + i] = dot[j] * scale;
                    }
                }
            }
        } else {
            for (uint32_t base = warp * tpw; base < n_t; base += nwarps * tpw) {
                const uint32_t i = base + sub;
                const bf16* k = k_cache + (size_t)(i < n_t ? slot_s[i] : 0u) * width + kv_at;
                for (uint32_t j = 0; j < hb; ++j) {
                    float dot = 0.0f;
                    if (i < n_t)
                        for (uint32_t e = sl; e < d; e += lpt) dot += q_s[j * d + e] * bf2f(k[e]);
                    for (uint32_t off = lpt / 2; off > 0; off >>= 1)
                        dot += __shfl_xor_sync(0xffffffffu, dot, off);
                    if (i < n_t && sl == 0) p_s[j * ATT_TILE + i] = dot * scale;
                }
            }
        }
        __syncthreads();
        // 3. Tile max and probabilities per head; every warp computes the same values.
        float m_new[ATT_HB], corr[ATT_HB];
#pragma unroll
        for (int j = 0; j < ATT_HB; ++j) {
            float mx = -INFINITY;
            if (j < (int)hb)
                for (uint32_t i = lane; i < n_t; i += 32) mx = fmaxf(mx, p_s[j * ATT_TILE + i]);
            mx = warp_max(mx);
            m_new[j] = fmaxf(m_run[j], mx);
            corr[j] = j < (int)hb ? expf(m_run[j] - m_new[j]) : 0.0f;
        }
        __syncthreads();
        for (uint32_t idx = tid; idx < hb * n_t; idx += blockDim.x) {
            const uint32_t j = idx / n_t, i = idx % n_t;
            float mj = m_new[0];
#pragma unroll
            for (int jj = 1; jj < ATT_HB; ++jj)
                if ((uint32_t)jj == j) mj = m_new[jj];
            p_s[j * ATT_TILE + i] = expf(p_s[j * ATT_TILE + i] - mj);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < ATT_HB; ++j) {
            float sum = 0.0f;
            if (j < (int)hb)
                for (uint32_t i = lane; i < n_t; i += 32) sum += p_s[j * ATT_TILE + i];
            sum = warp_sum(sum);
            l_run[j] = l_run[j] * corr[j] + sum;
            m_run[j] = m_new[j];
        }
        // 4. Values.
        if (vec) {
            cp_async_wait<0>();
            __syncthreads();
        }
        if (v_active) {
#pragma unroll
            for (int j = 0; j < ATT_HB; ++j)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j][e] *= corr[j];
            if (vec) {
                for (uint32_t i0 = grp; i0 < n_t; i0 += groups * ATT_UNROLL) {
                    uint4 vv[ATT_UNROLL];
#pragma unroll
                    for (int u = 0; u < ATT_UNROLL; ++u) {
                        const uint32_t i = i0 + u * groups;
                        vv[u] = i < n_t ? v_s[(size_t)i * (d / 8) + unit] : make_uint4(0, 0, 0, 0);
                    }
#pragma unroll
                    for (int u = 0; u < ATT_UNROLL; ++u) {
                        const uint32_t i = i0 + u * groups;
                        if (i >= n_t) break;
                        float vf[8];
                        unpack8(vv[u], vf);
#pragma unroll
                        for (int j = 0; j < ATT_HB; ++j) {
                            if (j >= (int)hb) break;
                            const float p = p_s[j * ATT_TILE + i];
#pragma unroll
                            for (int e = 0; e < 8; ++e) acc[j][e] += p * vf[e];
                        }
                    }
                }
            } else {
                for (uint32_t i = grp; i < n_t; i += groups) {
                    const bf16* v = v_cache + (size_t)slot_s[i] * width + kv_at;
#pragma unroll
                    for (int j = 0; j < ATT_HB; ++j) {
                        if (j >= (int)hb) break;
                        const float p = p_s[j * ATT_TILE + i];
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            const uint32_t dim = unit + e * units;
                            if (e < (int)per && dim < d) acc[j][e] += p * bf2f(v[dim]);
                        }
                    }
                }
            }
        }
        __syncthreads();
    }

    // Combine the value groups in group order into this range's partial (kept in q_s).
    if (v_active) {
#pragma unroll
        for (int j = 0; j < ATT_HB; ++j) {
            if (j >= (int)hb) break;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const uint32_t dim = vec ? 8 * unit + e : unit + e * units;
                if (e < (int)per && dim < d) part_s[(grp * hb + j) * d + dim] = acc[j][e];
            }
        }
    }
    __syncthreads();
    for (uint32_t idx = tid; idx < hb * d; idx += blockDim.x) {
        const uint32_t j = idx / d, e = idx % d;
        float a = 0.0f;
        for (uint32_t g = 0; g < groups; ++g) a += part_s[(g * hb + j) * d + e];
        q_s[idx] = a;
    }
    if (tid == 0) {
#pragma unroll
        for (int j = 0; j < ATT_HB; ++j) {
            ml_s[j] = m_run[j];
            ml_s[ATT_HB + j] = l_run[j];
        }
    }

    // Combine the ranges across the cluster in range order; the cluster's threads share the
    // hb * d outputs.
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    for (uint32_t idx = split * blockDim.x + tid; idx < hb * d; idx += cluster_threads) {
        const uint32_t j = idx / d, e = idx % d;
        float mx = -INFINITY;
        for (uint32_t s = 0; s < ATT_SPLITS; ++s) mx = fmaxf(mx, cluster.map_shared_rank(ml_s, s)[j]);
        float num = 0.0f, den = 0.0f;
        bool bad = false;
        for (uint32_t s = 0; s < ATT_SPLITS; ++s) {
            const float ms = cluster.map_shared_rank(ml_s, s)[j];
            const float w = ms == -INFINITY ? 0.0f : expf(ms - mx);
            den += w * cluster.map_shared_rank(ml_s, s)[ATT_HB + j];
            num += w * cluster.map_shared_rank(q_s, s)[idx];
            bad = bad || *cluster.map_shared_rank(&bad_s, s) != 0;
        }
        float val = num / den;
        if (gated) val *= sigmoidf_acc(bf2f(qrow[(size_t)(h0 + j) * q_head_stride + d + e]));
        o[(size_t)j * d + e] = bad ? bf16_nan() : f2bf(val);
    }
    // Keep this block's shared memory alive until every block of the cluster has read it.
    cluster.sync();
}
