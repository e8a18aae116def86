// The block-FP8 weight conversion the decode GEMMs (`linear_stream_fp8`,
// `linear_stream_wide_fp8`) and the FP8 expert projections (`expert_linear_fp8`) share: a lane's
// 8 e4m3 bytes and its block's scale to the bf16 values of the weight they stand for (the MMA
// fragment, in k order). Included by gemm.cu and moe.cu, and by attention.cu for the FP8 KV
// cache, whose elements stand for the same bf16 values (kv_fp8.cuh).
#pragma once

// The conversion below reads an e4m3 byte as a bf16 of the same bits shifted into place, whose
// exponent bias is 120 more than e4m3's: the bf16 holds e4m3 * 2^-120 exactly (normals and
// subnormals alike; the NaN codes, which the loader refuses, read as ±480), and so does the f32
// it widens to. The scale's factor is scale * 2^120 in f32 (exact and finite for the scales the
// loader accepts, below 2^8), so one f32 multiply (rounded to nearest even) and one rounding to
// bf16 give bf16(f32(e4m3 * scale)), the CPU twin's fp8::dequant_element: the scale is used
// as stored, not rounded to bf16 first. Integer work, two multiplies and one conversion per
// pair.
MT_DEVICE uint32_t fp8_scale2(float scale) {
    return __float_as_uint(__fmul_rn(scale, 0x1p120f));
}

// Bytes `sel` picks of `w` (two e4m3, into the high byte of each half) times the scale factor
// (`fp8_scale2`): a bf16 pair, low element first.
MT_DEVICE uint32_t fp8x2_scaled(uint32_t w, uint32_t sel, uint32_t s2) {
    const uint32_t a = __byte_perm(w, 0u, sel);
    const uint32_t bits = (a & 0x80008000u) | ((a & 0x7F007F00u) >> 4);
    const float s = __uint_as_float(s2);
    const float lo = __fmul_rn(__uint_as_float(bits << 16), s);
    const float hi = __fmul_rn(__uint_as_float(bits & 0xFFFF0000u), s);
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// `__byte_perm` selectors: bytes 0, 1 (and 2, 3) of a word into the high bytes of two halves.
#define FP8_PAIR_LO 0x1404u
#define FP8_PAIR_HI 0x3424u

// A lane's 8 bytes (k 8q..8q+7 of its row) times their block's scale factor (`fp8_scale2`): the
// MMA fragment of bf16(f32(e4m3 * scale)) of each, `linear`'s fragment of `dequant_fp8`'s
// weight.
MT_DEVICE uint4 fp8_frag(uint2 q, uint32_t s2) {
    return make_uint4(fp8x2_scaled(q.x, FP8_PAIR_LO, s2), fp8x2_scaled(q.x, FP8_PAIR_HI, s2),
                      fp8x2_scaled(q.y, FP8_PAIR_LO, s2), fp8x2_scaled(q.y, FP8_PAIR_HI, s2));
}
