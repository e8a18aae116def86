// The block-FP8 weight conversion the decode GEMMs (`linear_stream_fp8`,
// `linear_stream_wide_fp8`) and the FP8 expert projections (`expert_linear_fp8`) share: a lane's
// 8 e4m3 bytes and its block's scale to the bf16 values of the weight they stand for (the MMA
// fragment, in k order). Included by gemm.cu and moe.cu, and by attention.cu for the FP8 KV
// cache, whose elements stand for the same bf16 values (kv_fp8.cuh).
#pragma once

// The conversion below reads an e4m3 byte as a bf16 of the same bits shifted into place, whose
// exponent bias is 120 more than e4m3's: the bf16 holds e4m3 * 2^-120 exactly (normals and
// subnormals alike; the NaN codes, which the loader refuses, read as ±480). The scale's factor
// is bf16(scale) * 2^120 (exact for the scales the loader accepts, below 2^8), so one bf16
// multiply, rounded to nearest even, gives bf16(e4m3 * bf16(scale)) from the exact product:
// integer work and one multiply per pair, no conversion instructions (whose rate is a fraction
// of the weight stream's).
MT_DEVICE uint32_t fp8_scale2(float scale) {
    const __nv_bfloat16 s = __hmul(__float2bfloat16_rn(scale), __float2bfloat16_rn(0x1p120f));
    const __nv_bfloat162 s2 = __halves2bfloat162(s, s);
    return *reinterpret_cast<const uint32_t*>(&s2);
}

// Bytes `sel` picks of `w` (two e4m3, into the high byte of each half) times the scale pair:
// a bf16 pair, low element first.
MT_DEVICE uint32_t fp8x2_scaled(uint32_t w, uint32_t sel, uint32_t s2) {
    const uint32_t a = __byte_perm(w, 0u, sel);
    const uint32_t bits = (a & 0x80008000u) | ((a & 0x7F007F00u) >> 4);
    const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&bits),
                                     *reinterpret_cast<const __nv_bfloat162*>(&s2));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// `__byte_perm` selectors: bytes 0, 1 (and 2, 3) of a word into the high bytes of two halves.
#define FP8_PAIR_LO 0x1404u
#define FP8_PAIR_HI 0x3424u

// A lane's 8 bytes (k 8q..8q+7 of its row) times their block's scale pair (`fp8_scale2`): the
// MMA fragment of bf16(e4m3 * bf16(scale)) of each, `linear`'s fragment of `dequant_fp8`'s weight.
MT_DEVICE uint4 fp8_frag(uint2 q, uint32_t s2) {
    return make_uint4(fp8x2_scaled(q.x, FP8_PAIR_LO, s2), fp8x2_scaled(q.x, FP8_PAIR_HI, s2),
                      fp8x2_scaled(q.y, FP8_PAIR_LO, s2), fp8x2_scaled(q.y, FP8_PAIR_HI, s2));
}
