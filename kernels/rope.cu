// Per-head RMSNorm of q and k (optional) followed by rotary embedding (rotate-half layout over
// the first rotary_dim dims, cos and sin times attention_scaling), in place on the projection
// output row. CPU twin: metrale-gpu-runtime/src/cpu/kernels/rope.rs.
//
// Launch: one warp per head, a block's warps on heads of one row: grid (rows, ceil(heads / W)),
// W warps (32 W threads) per block, (W + 1) * head_dim * 4 bytes of dynamic shared memory (the
// row's rotation table, then each warp's head in f32); the launcher takes W = 1 at decode sizes
// and 8 for prefill, where one-warp blocks would leave a long launch bound by block
// scheduling. The block computes the row's sines and cosines once (`rope_table`) for all its
// warps: the same sincosf of the same product for every head. `qk_norm_rope_kv_store` fuses the
// cache store (kernels/cache.cu) into the same launch; see it below.
// Row layout: query head h starts at h * q_head_stride; key head h at k_offset + h * head_dim.
// Values are left alone. Shapes the kernel cannot take (odd or too large rotary_dim, heads that
// do not fit the row) leave the row untouched and report a SHAPE fault, a grid or block it is
// not written for a GEOMETRY fault; the CPU twin rejects both.
#include "common.cuh"
#include "kv_fp8.cuh"

// The rotation of position `pos`: table[i] = (sin, cos) of pos * inv_freq[i], i < rd / 2, each
// multiplied by `scale` (YaRN's attention factor; 1 otherwise, which leaves them exact), by the
// whole block, which then synchronizes (every thread of the block must call it).
MT_DEVICE void rope_table(float2* table, const float* inv_freq, float pos, uint32_t rd, float scale) {
    for (uint32_t i = threadIdx.x; i < rd / 2; i += blockDim.x) {
        float sn, cs;
        sincosf(pos * inv_freq[i], &sn, &cs);
        table[i] = make_float2(sn * scale, cs * scale);
    }
    __syncthreads();
}

// E consecutive bf16 (E of 1, 2, 4 or 8) from `src` to `dst`, both aligned to 2E bytes, in one
// access each.
template <int E>
MT_DEVICE void copy_run(bf16* dst, const bf16* src) {
    if constexpr (E == 8)
        *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    else if constexpr (E == 4)
        *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
    else if constexpr (E == 2)
        *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
    else
        dst[0] = src[0];
}

// `norm_rope_head` with the head in registers: lane l holds dims E l .. E l + E - 1 (E = d / 32),
// read and written E at a time; the rotation's partner dims (i + rd / 2, or i - rd / 2) sit in
// lane l ^ (rd / 2E), one shuffle a dim: a third of the instructions of the shared-memory path
// below, which leaves a long launch compute-bound. The caller checks the layout (`lanes_fit`).
template <int E>
MT_DEVICE void norm_rope_lanes(bf16* x, bf16* copy, const bf16* nw, const float2* table, uint32_t d, uint32_t rd,
                               float eps, bool unit, uint32_t lane) {
    const uint32_t i0 = E * lane;
    float f[E];
    __align__(16) bf16 h[E];
    copy_run<E>(h, x + i0);
#pragma unroll
    for (int j = 0; j < E; ++j) f[j] = bf2f(h[j]);
    if (nw != nullptr) {
        float ss = 0.0f;
#pragma unroll
        for (int j = 0; j < E; ++j) ss += f[j] * f[j];
        ss = warp_sum(ss);
        const float s = 1.0f / sqrtf(ss / (float)d + eps);
#pragma unroll
        for (int j = 0; j < E; ++j) f[j] = f[j] * s * norm_weight(nw[i0 + j], unit);
    }
    const uint32_t half = rd / 2;
    if (half > 0) {
        const uint32_t mate = half / E;
        float o[E];
#pragma unroll
        for (int j = 0; j < E; ++j) o[j] = __shfl_xor_sync(0xffffffffu, f[j], mate);
        if (i0 < rd) {
#pragma unroll
            for (int j = 0; j < E; ++j) {
                const uint32_t i = i0 + j;
                if (i < half) {
                    const float2 t = table[i];
                    f[j] = f[j] * t.y - o[j] * t.x;
                } else {
                    const float2 t = table[i - half];
                    f[j] = f[j] * t.y + o[j] * t.x;
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < E; ++j) h[j] = f2bf(f[j]);
    copy_run<E>(x + i0, h);
    if (copy != nullptr) copy_run<E>(copy + i0, h);
}

// Whether `norm_rope_lanes` takes a head of d dims (E = d / 32 of 1, 2, 4 or 8, its E-dim runs
// aligned in `x` and `copy`) rotated over rd: the partner lane is lane ^ (rd / 2E), which needs
// rd / 2 a multiple of E and rd / 2E a power of two (rd = d always is; Qwen3.5's rd = d / 4 is).
MT_DEVICE bool lanes_fit(const bf16* x, const bf16* copy, uint32_t d, uint32_t rd) {
    const uint32_t e = d / 32, half = rd / 2;
    if (d % 32 != 0 || (e != 1 && e != 2 && e != 4 && e != 8)) return false;
    const uintptr_t mask = 2 * e - 1;
    if (((uintptr_t)x & mask) != 0 || ((uintptr_t)copy & mask) != 0) return false;
    if (half == 0) return true;
    const uint32_t mate = half / e;
    return half % e == 0 && mate <= 16 && (mate & (mate - 1)) == 0;
}

// One head of one row: load it into shared memory as f32, RMSNorm it when `nw` is set, rotate
// the first rd dims by `table` (rope_table's), and write it back in place (and to `copy` too,
// when set: the fused kernel's cache slot). One warp. Heads `lanes_fit` takes run in registers
// (`norm_rope_lanes`); the shared-memory path serves the other shapes.
MT_DEVICE void norm_rope_head(bf16* x, bf16* copy, const bf16* nw, const float2* table, uint32_t d,
                              uint32_t rd, float eps, bool unit, float* buf, uint32_t lane) {
    if (lanes_fit(x, copy, d, rd)) {
        switch (d / 32) {
            case 1: norm_rope_lanes<1>(x, copy, nw, table, d, rd, eps, unit, lane); return;
            case 2: norm_rope_lanes<2>(x, copy, nw, table, d, rd, eps, unit, lane); return;
            case 4: norm_rope_lanes<4>(x, copy, nw, table, d, rd, eps, unit, lane); return;
            default: norm_rope_lanes<8>(x, copy, nw, table, d, rd, eps, unit, lane); return;
        }
    }
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
        for (uint32_t i = lane; i < d; i += 32) buf[i] = buf[i] * s * norm_weight(nw[i], unit);
        __syncwarp();
    }

    const uint32_t half = rd / 2;
    for (uint32_t i = lane; i < half; i += 32) {
        const float sn = table[i].x, cs = table[i].y;
        const float x1 = buf[i], x2 = buf[i + half];
        buf[i] = x1 * cs - x2 * sn;
        buf[i + half] = x2 * cs + x1 * sn;
    }
    __syncwarp();
    for (uint32_t i = lane; i < d; i += 32) {
        const bf16 o = f2bf(buf[i]);
        x[i] = o;
        if (copy != nullptr) copy[i] = o;
    }
}

// Whether the row layout fits (the CPU twin's checks); shapes that do not leave the row alone.
MT_DEVICE bool heads_fit(uint32_t row_stride, uint32_t num_q_heads, uint32_t q_head_stride,
                         uint32_t k_offset, uint32_t num_kv_heads, uint32_t head_dim,
                         uint32_t rotary_dim) {
    if (rotary_dim > head_dim || rotary_dim % 2 != 0) return false;
    if (num_q_heads > 0 && (num_q_heads - 1) * q_head_stride + head_dim > row_stride) return false;
    return k_offset + num_kv_heads * head_dim <= row_stride;
}

// qk_norm_rope(qkv: bf16 [rows, row_stride] (in/out), q_norm_w: bf16 [head_dim] or NULL,
// k_norm_w: bf16 [head_dim] or NULL, inv_freq: f32 [rotary_dim / 2], positions: u32 [rows],
// rows, row_stride, num_q_heads, q_head_stride, k_offset, num_kv_heads, head_dim, rotary_dim,
// attention_scaling, eps, unit_offset).
extern "C" __global__ void qk_norm_rope(QK_NORM_ROPE_PARAMS) {
    pdl_wait();  // a programmatic dependent (ops): the kernel ahead has finished
    pdl_trigger();
    extern __shared__ float bufs[];
    const uint32_t warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint32_t r = blockIdx.x, hh = blockIdx.y * warps + warp;
    // A launch has one block per row (at least one): past `rows` only when there are none.
    if (r >= rows || blockDim.x % 32 != 0 ||
        !heads_fit(row_stride, num_q_heads, q_head_stride, k_offset, num_kv_heads, head_dim, rotary_dim)) {
        if (rows != 0)
            mt_fault(MT_KERNEL_QK_NORM_ROPE, r >= rows || blockDim.x % 32 != 0 ? MT_FAULT_GEOMETRY : MT_FAULT_SHAPE);
        return;  // uniform over the block
    }
    float2* table = reinterpret_cast<float2*>(bufs);
    rope_table(table, inv_freq, (float)positions[r], rotary_dim, attention_scaling);
    if (hh >= num_q_heads + num_kv_heads) return;
    const bool is_q = hh < num_q_heads;
    bf16* x = qkv + (size_t)r * row_stride +
              (is_q ? hh * q_head_stride : k_offset + (hh - num_q_heads) * head_dim);
    norm_rope_head(x, nullptr, is_q ? q_norm_w : k_norm_w, table, head_dim, rotary_dim, eps, unit_offset != 0,
                   bufs + (1 + warp) * head_dim, lane);
}

// qk_norm_rope_kv_store(qkv: bf16 [rows, row_stride] (in/out), q_norm_w, k_norm_w: bf16
// [head_dim] or NULL, inv_freq: f32 [rotary_dim / 2], positions: u32 [rows], k_cache, v_cache:
// bf16 [num_slots, num_kv_heads, head_dim], slot_mapping: u32 [rows], rows, row_stride,
// num_q_heads, q_head_stride, k_offset, v_offset, num_kv_heads, head_dim, rotary_dim,
// attention_scaling, eps, unit_offset, num_slots).
//
// `qk_norm_rope` followed by `kv_store` (kernels/cache.cu) in one launch, byte for byte, laid
// out as `qk_norm_rope` with num_q_heads + 2 * num_kv_heads heads a row: warps of q and k heads
// run the same per-head code as `qk_norm_rope` and a k head also writes its rounded result to the
// cache slot (with kv_fp8, its e4m3 bytes, from the rounded key the row holds); the last
// num_kv_heads warps copy the row's value heads (or store their e4m3 bytes). A padding slot
// (u32::MAX) writes no cache; nor does a slot past num_slots, which also reports an INDEX fault
// as `kv_store` does (the row is still rotated, as the two launches would).
extern "C" __global__ void qk_norm_rope_kv_store(QK_NORM_ROPE_KV_STORE_PARAMS) {
    // A programmatic dependent (ops): the kernel ahead has finished. The attention after it
    // starts early at one or two rows only (pdl_enter_store).
    pdl_enter_store(rows);
    extern __shared__ float bufs[];
    const uint32_t warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32, d = head_dim;
    const uint32_t r = blockIdx.x, hh = blockIdx.y * warps + warp;
    // A launch has one block per row (at least one): past `rows` only when there are none.
    if (r >= rows || blockDim.x % 32 != 0 ||
        !heads_fit(row_stride, num_q_heads, q_head_stride, k_offset, num_kv_heads, d, rotary_dim) ||
        v_offset + num_kv_heads * d > row_stride) {
        if (rows != 0)
            mt_fault(MT_KERNEL_QK_NORM_ROPE_KV_STORE,
                     r >= rows || blockDim.x % 32 != 0 ? MT_FAULT_GEOMETRY : MT_FAULT_SHAPE);
        return;  // uniform over the block
    }
    float2* table = reinterpret_cast<float2*>(bufs);
    rope_table(table, inv_freq, (float)positions[r], rotary_dim, attention_scaling);
    if (hh >= num_q_heads + 2 * num_kv_heads) return;
    float* buf = bufs + (1 + warp) * d;
    const uint32_t slot = slot_mapping[r];
    const bool store = slot != 0xFFFFFFFFu && slot < num_slots;
    if (slot != 0xFFFFFFFFu && !store && hh == num_q_heads) mt_fault(MT_KERNEL_QK_NORM_ROPE_KV_STORE, MT_FAULT_INDEX);
    bf16* row = qkv + (size_t)r * row_stride;
    const size_t slot_base = (size_t)slot * num_kv_heads * d;
    if (hh < num_q_heads) {
        norm_rope_head(row + hh * q_head_stride, nullptr, q_norm_w, table, d, rotary_dim, eps, unit_offset != 0,
                       buf, lane);
    } else if (hh < num_q_heads + num_kv_heads) {
        const uint32_t h = hh - num_q_heads;
        bf16* k = row + k_offset + h * d;
        const bool fp8 = kv_fp8 != 0;
        norm_rope_head(k, store && !fp8 ? k_cache + slot_base + h * d : nullptr, k_norm_w, table, d, rotary_dim,
                       eps, unit_offset != 0, buf, lane);
        if (store && fp8) {
            // The rounded key as the row now holds it (written by this warp's lanes).
            __syncwarp();
            kv_e4m3_head(reinterpret_cast<uint8_t*>(k_cache) + slot_base + h * d, k, d, kv_scale(k_scale), lane);
        }
    } else if (store) {
        const uint32_t h = hh - num_q_heads - num_kv_heads;
        const bf16* src = row + v_offset + h * d;
        if (kv_fp8 != 0) {
            kv_e4m3_head(reinterpret_cast<uint8_t*>(v_cache) + slot_base + h * d, src, d, kv_scale(v_scale), lane);
        } else {
            bf16* dst = v_cache + slot_base + h * d;
            for (uint32_t i = lane; i < d; i += 32) dst[i] = src[i];
        }
    }
}
