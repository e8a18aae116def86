// The block-FP8 weight conversion the decode GEMMs (`linear_stream_fp8`,
// `linear_stream_wide_fp8`) and the FP8 expert projections (`expert_linear_fp8`) share: a lane's
// 8 e4m3 bytes and its block's scale to the bf16 values of the weight they stand for (the MMA
// fragment, in k order). Included by gemm.cu and moe.cu, and by attention.cu for the FP8 KV
// cache, whose elements stand for the same bf16 values (kv_fp8.cuh).
#pragma once

// The conversion below reads an e4m3 byte as a bf16 of the same bits shifted into place, whose
// exponent bias is 120 more than e4m3's: the bf16 x holds e4m3 * 2^-120 exactly (normals and
// subnormals alike; the NaN codes, which the loader refuses, read as ±480). The scale enters
// as two bf16 factors of s = scale * 2^120 (exact and finite for the scales the loader accepts,
// below 2^7): hi = bf16(s) and lo = s - hi rounded to 4 significant bits. x * lo has at most 8
// significant bits, so the bf16 multiply giving it is exact, and the bf16 fma x * hi + (x * lo)
// rounds once: the element is bf16(e4m3 * scale'), scale' = (hi + lo) * 2^-120 the scale to
// about 12 significant bits, which the CPU twin's fp8::dequant_element computes the same way.
// Integer work, one bf16x2 multiply and one bf16x2 fma a pair; the scale's split is computed
// once per scale load.

// The scale factor a conversion takes: bf16(s) in the high half, the rest rounded to nearest
// even at 4 significant bits (as a bf16, exactly) in the low half.
MT_DEVICE uint32_t fp8_scale2(float scale) {
    const float s = __fmul_rn(scale, 0x1p120f);
    const __nv_bfloat16 hi = __float2bfloat16_rn(s);
    const uint32_t r = __float_as_uint(__fsub_rn(s, __bfloat162float(hi)));  // exact
    const uint32_t lo = (r + 0x7FFFFu + ((r >> 20) & 1u)) & 0xFFF00000u;
    return ((uint32_t)__bfloat16_as_ushort(hi) << 16) | (lo >> 16);
}

MT_DEVICE __nv_bfloat162 fp8_as_bf162(uint32_t v) { return *reinterpret_cast<const __nv_bfloat162*>(&v); }

// Bytes `sel` picks of `w` (two e4m3, into the high byte of each half) times the scale factor
// (`fp8_scale2`): a bf16 pair, low element first.
MT_DEVICE uint32_t fp8x2_scaled(uint32_t w, uint32_t sel, uint32_t s2) {
    const uint32_t a = __byte_perm(w, 0u, sel);
    const __nv_bfloat162 x = fp8_as_bf162((a & 0x80008000u) | ((a & 0x7F007F00u) >> 4));
    const __nv_bfloat162 hi = fp8_as_bf162(__byte_perm(s2, 0u, 0x3232u));
    const __nv_bfloat162 lo = fp8_as_bf162(__byte_perm(s2, 0u, 0x1010u));
    const __nv_bfloat162 v = __hfma2(x, hi, __hmul2(x, lo));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// `__byte_perm` selectors: bytes 0, 1 (and 2, 3) of a word into the high bytes of two halves.
#define FP8_PAIR_LO 0x1404u
#define FP8_PAIR_HI 0x3424u

// A lane's 8 bytes (k 8q..8q+7 of its row) times their block's scale factor (`fp8_scale2`): the
// MMA fragment of each element (bf16(e4m3 * scale')), `linear`'s fragment of `dequant_fp8`'s
// weight.
MT_DEVICE uint4 fp8_frag(uint2 q, uint32_t s2) {
    return make_uint4(fp8x2_scaled(q.x, FP8_PAIR_LO, s2), fp8x2_scaled(q.x, FP8_PAIR_HI, s2),
                      fp8x2_scaled(q.y, FP8_PAIR_LO, s2), fp8x2_scaled(q.y, FP8_PAIR_HI, s2));
}
