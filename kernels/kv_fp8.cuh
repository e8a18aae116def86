// The FP8 (e4m3) KV cache's element format, shared by the stores (cache.cu, rope.cu) and the
// attention kernels (attention.cu). CPU twin: metrale_gpu_runtime::fp8::{kv_quantize,
// kv_dequant}.
//
// A store writes e4m3(value / scale): the quotient rounded once in f32 (IEEE division), then to
// e4m3 to nearest even, finite values and infinities saturated at ±448, NaN to the NaN code
// (0x7F). A read gives bf16(e4m3 * scale'), the FP8 weights' element (gemm_fp8.cuh's
// fp8_frag, on the scale factors from fp8_scale2; the NaN code reads as bf16(480 * scale')).
// The attention kernels copy a unit's e4m3 bytes into the top of each bf16 row of their ring
// and widen them in place before the MMAs, so every kernel reads the same bf16 values and keeps
// its bf16 arithmetic bit for bit.
#pragma once

#include <cuda_fp8.h>

// A pool's scale as the stores divide by it. A power of two whose reciprocal is a normal float
// (the default 1.0 among them) divides as a multiplication by that reciprocal: both round the
// same exact quotient once, subnormal results included, so the bytes are the division's, without
// its iterations and range checks.
struct KvScale {
    float scale, inv;
    bool pow2;
};

MT_DEVICE KvScale kv_scale(float scale) {
    const uint32_t bits = __float_as_uint(scale), exp = (bits >> 23) & 0xFFu;
    const bool pow2 = (bits & 0x807FFFFFu) == 0 && exp >= 1 && exp <= 253;  // 2^-126 .. 2^126
    return KvScale{scale, pow2 ? __uint_as_float((254u - exp) << 23) : 0.0f, pow2};
}

// One stored element: e4m3(x / scale).
MT_DEVICE uint8_t kv_e4m3(float x, const KvScale& s) {
    const float q = s.pow2 ? __fmul_rn(x, s.inv) : __fdiv_rn(x, s.scale);
    return (uint8_t)__nv_cvt_float_to_fp8(q, __NV_SATFINITE, __NV_E4M3);
}

// Eight stored elements at once: kv_e4m3 of the eight bf16 values in `v` (element 0 in the low
// half of v.x), element i in byte i.
MT_DEVICE uint2 kv_e4m3x8(uint4 v, const KvScale& s) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    uint32_t out[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float x = __uint_as_float((i & 1) ? (w[i / 2] & 0xFFFF0000u) : (w[i / 2] << 16));
        out[i / 4] |= (uint32_t)kv_e4m3(x, s) << (8 * (i % 4));
    }
    return make_uint2(out[0], out[1]);
}

// One head of `d` elements from bf16 `src` into e4m3 `dst` by a warp: each lane's loads first,
// then its stores (a byte store may alias the loads after it, which would serialise a loop
// that mixes them), eight elements a lane at a time.
MT_DEVICE void kv_e4m3_head(uint8_t* dst, const bf16* src, uint32_t d, const KvScale& s, uint32_t lane) {
    for (uint32_t base = 0; base < d; base += 8 * 32) {
        float x[8];
#pragma unroll
        for (uint32_t j = 0; j < 8; ++j) {
            const uint32_t i = base + lane + 32 * j;
            x[j] = i < d ? bf2f(src[i]) : 0.0f;
        }
#pragma unroll
        for (uint32_t j = 0; j < 8; ++j) {
            const uint32_t i = base + lane + 32 * j;
            if (i < d) dst[i] = kv_e4m3(x[j], s);
        }
    }
}
