// Per-head RMSNorm of q and k (optional) followed by rotary embedding (rotate-half layout over
// the first rotary_dim dims), in place on the projection output row. CPU twin:
// metrale-gpu-runtime/src/cpu/kernels/rope.rs.
//
// Launch: grid (rows, num_q_heads + num_kv_heads), one warp (32 threads) per head, and
// head_dim * 4 bytes of dynamic shared memory (the head in f32).
// Row layout: query head h starts at h * q_head_stride; key head h at k_offset + h * head_dim.
// Values are left alone. Shapes the CPU twin rejects (odd or too large rotary_dim, heads that
// do not fit the row) leave the row untouched.
#include "common.cuh"

// qk_norm_rope(qkv: bf16 [rows, row_stride] (in/out), q_norm_w: bf16 [head_dim] or NULL,
// k_norm_w: bf16 [head_dim] or NULL, inv_freq: f32 [rotary_dim / 2], positions: u32 [rows],
// rows, row_stride, num_q_heads, q_head_stride, k_offset, num_kv_heads, head_dim, rotary_dim,
// eps, unit_offset).
extern "C" __global__ void qk_norm_rope(bf16* __restrict__ qkv, const bf16* __restrict__ q_norm_w,
                                        const bf16* __restrict__ k_norm_w,
                                        const float* __restrict__ inv_freq,
                                        const uint32_t* __restrict__ positions, uint32_t rows,
                                        uint32_t row_stride, uint32_t num_q_heads,
                                        uint32_t q_head_stride, uint32_t k_offset,
                                        uint32_t num_kv_heads, uint32_t head_dim,
                                        uint32_t rotary_dim, float eps, uint32_t unit_offset) {
    extern __shared__ float buf[];
    const uint32_t r = blockIdx.x, hh = blockIdx.y, lane = threadIdx.x;
    const uint32_t d = head_dim, rd = rotary_dim;
    if (r >= rows || hh >= num_q_heads + num_kv_heads || blockDim.x != 32) return;
    if (rd > d || rd % 2 != 0) return;
    if ((num_q_heads > 0 && (num_q_heads - 1) * q_head_stride + d > row_stride) ||
        k_offset + num_kv_heads * d > row_stride)
        return;
    const bool is_q = hh < num_q_heads;
    bf16* x = qkv + (size_t)r * row_stride + (is_q ? hh * q_head_stride : k_offset + (hh - num_q_heads) * d);
    const bf16* nw = is_q ? q_norm_w : k_norm_w;
    const bool vec = d % 8 == 0 && aligned16(x);

    if (vec) {
        for (uint32_t v = lane; v < d / 8; v += 32) {
            float f[8];
            unpack8(load16(x + 8 * v), f);
#pragma unroll
            for (int j = 0; j < 8; ++j) buf[8 * v + j] = f[j];
        }
    } else {
        for (uint32_t i = lane; i < d; i += 32) buf[i] = bf2f(x[i]);
    }
    __syncwarp();

    if (nw != nullptr) {
        float ss = 0.0f;
        for (uint32_t i = lane; i < d; i += 32) ss += buf[i] * buf[i];
        ss = warp_sum(ss);
        const float s = 1.0f / sqrtf(ss / (float)d + eps);
        __syncwarp();
        for (uint32_t i = lane; i < d; i += 32) buf[i] = buf[i] * s * norm_weight(nw[i], unit_offset != 0);
        __syncwarp();
    }

    const float pos = (float)positions[r];
    const uint32_t half = rd / 2;
    for (uint32_t i = lane; i < half; i += 32) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        const float x1 = buf[i], x2 = buf[i + half];
        x[i] = f2bf(x1 * cs - x2 * sn);
        x[i + half] = f2bf(x2 * cs + x1 * sn);
    }
    for (uint32_t i = rd + lane; i < d; i += 32) x[i] = f2bf(buf[i]);
}
