// The arithmetic `sample` (kernels/sampling.cu) takes decisions with, every rounding explicit so
// the CPU twin (metrale-gpu-runtime/src/cpu/kernels/sampling.rs) computes the same bits:
// det_exp and det_log, the counter-based hash and Gumbel noise of the draw, and the
// order-preserving keys of the radix selections. Included by sampling.cu only.
#pragma once

// e^x for x <= 0 (0 below -87, and for NaN): 2^(x log2 e) split into an integer power and a
// degree-6 polynomial, every rounding explicit so the twin computes the same bits.
MT_DEVICE float det_exp(float x) {
    if (!(x > -87.0f)) return 0.0f;
    const float t = __fmul_rn(x, 1.44269504f);
    const float n = rintf(t);
    const float f = __fsub_rn(t, n);
    float p = 1.540353e-4f;
    p = __fmaf_rn(p, f, 1.333356e-3f);
    p = __fmaf_rn(p, f, 9.618129e-3f);
    p = __fmaf_rn(p, f, 5.550411e-2f);
    p = __fmaf_rn(p, f, 2.402265e-1f);
    p = __fmaf_rn(p, f, 6.931472e-1f);
    p = __fmaf_rn(p, f, 1.0f);
    return __fmul_rn(p, __int_as_float(((int)n + 127) << 23));
}

// ln x for a positive normal x: the exponent and 2 atanh((m - 1) / (m + 1)) of the mantissa m
// in [0.707, 1.414), every rounding explicit.
MT_DEVICE float det_log(float x) {
    const uint32_t b = __float_as_uint(x);
    int e = (int)((b >> 23) & 0xFFu) - 127;
    float m = __uint_as_float((b & 0x7FFFFFu) | 0x3F800000u);
    if (m > 1.41421356f) {
        m = __fmul_rn(m, 0.5f);
        e += 1;
    }
    const float f = __fsub_rn(m, 1.0f);
    const float s = __fdiv_rn(f, __fadd_rn(2.0f, f));
    const float z = __fmul_rn(s, s);
    float p = 0.11111111f;
    p = __fmaf_rn(p, z, 0.14285715f);
    p = __fmaf_rn(p, z, 0.2f);
    p = __fmaf_rn(p, z, 0.33333334f);
    p = __fmaf_rn(p, z, 1.0f);
    const float l = __fmul_rn(__fmul_rn(2.0f, s), p);
    return __fmaf_rn((float)e, 0.693147182f, l);
}

MT_DEVICE uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The Gumbel noise of token i under the row's draw `base` (= mix64(seed ^ mix64(counter +
// c))): u = (2k + 1) 2^-24 in (0, 1) from 23 hash bits, g = -ln(-ln u).
MT_DEVICE float gumbel(uint64_t base, uint32_t i) {
    const uint64_t z = mix64(base + (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull);
    const float u = __fmul_rn((float)((((uint32_t)(z >> 41)) << 1) | 1u), 5.9604645e-8f);
    return -det_log(-det_log(u));
}

// An order-preserving u32 of a float: larger keys for larger values, -0 as +0, NaN lowest (0).
MT_DEVICE uint32_t order_key(float v) {
    if (isnan(v)) return 0u;
    if (v == 0.0f) v = 0.0f;
    const uint32_t b = __float_as_uint(v);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The float of an order key: the value itself, except +0 for -0 and a NaN for key 0. Every use
// below (a difference with the maximum, a sum with Gumbel noise) gives the same bits for either
// zero, and a NaN for a NaN.
MT_DEVICE float key_value(uint32_t k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}
