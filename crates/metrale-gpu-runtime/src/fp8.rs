//! Block FP8 on the host: the e4m3 element format (OCP `e4m3fn`: 4 exponent bits of bias 7, 3
//! mantissa bits, no infinities, `S.1111.111` the only NaN, ±448 the largest finite values),
//! the checkpoints' block quantization recipe, and dequantization. The CPU twins of
//! `gemm::quantize_fp8`, `gemm::dequant_fp8` and `gemm::linear_stream_fp8`, and the weight
//! loader, all use these, so host and device agree bit for bit.
//!
//! Invariants:
//! - [`f32_to_e4m3`] rounds to nearest, ties to even, saturates finite values at ±448 and keeps
//!   NaN a NaN, as CUDA's `__nv_cvt_float_to_fp8(.., __NV_SATFINITE, __NV_E4M3)` does.
//! - A dequantized element is `bf16(e4m3 · scale')`, rounded once to nearest even, where
//!   `scale'` ([`scale_factors`]) is the scale to about 12 significant bits: `hi = bf16(scale)`
//!   plus the rest `scale - hi` rounded to 4 significant bits. The kernels apply it as one
//!   bf16x2 multiply (`e4m3 · lo`, exact) and one bf16x2 fma a pair of elements, on factors
//!   times 2^120 (`kernels/gemm_fp8.cuh`), so a block's scale costs almost nothing over bf16
//!   (it is off by at most 2^-13 of itself, where rounding it to bf16 could be off by 2^-9).
//!   The NaN codes read as ±480 (what the kernels' bit conversion gives); the loader refuses
//!   weights holding them, and scales outside [0, `MAX_SCALE`), so the kernels' factors stay
//!   finite.
//! - An FP8 KV cache element is `kv_quantize(value, scale) = e4m3(value / scale)` and reads as
//!   `kv_dequant(byte, scale)`, the weights' element (`bf16(e4m3 · scale')`); a pool's
//!   scale is finite and in (0, `MAX_SCALE`) ([`kv_scale_ok`]).
//! - The block recipe: blocks of [`FP8_BLOCK`] rows by [`FP8_BLOCK`] columns (partial blocks at
//!   the edges); scale = the block's amax / 448 in f32 (1 for a block without a nonzero finite
//!   element); each element `e4m3(w / scale)`.

use half::bf16;
pub use metrale_kernel_abi::{FP8_BLOCK, FP8_BLOCK_ROW_SHIFT};

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// Block scales must be below this (and not negative): the kernels' factors hold
/// `scale · 2^120` rounded to bf16, which must stay finite.
pub const MAX_SCALE: f32 = 128.0;

/// Whether `byte` is one of e4m3's two NaN codes.
pub fn is_nan_code(byte: u8) -> bool {
    byte & 0x7F == 0x7F
}

/// The value of an e4m3 byte (exact in f32).
pub fn e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let (e, m) = ((byte >> 3) & 0xF, byte & 7);
    if e == 0xF && m == 7 {
        return f32::NAN;
    }
    let magnitude = if e == 0 {
        f32::from(m) * (-9.0f32).exp2()
    } else {
        (1.0 + f32::from(m) / 8.0) * (f32::from(e) - 7.0).exp2()
    };
    sign * magnitude
}

/// `x` as e4m3: round to nearest even, finite values saturated at ±448, NaN to NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    if x.is_nan() {
        return 0x7F;
    }
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Subnormals (and the rounding up into the smallest normal, code 8): steps of 2^-9.
    if a < (-6.0f32).exp2() {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // a = 2^e · f, f in [1, 2): f · 8 rounded is 8..=16, 16 carrying into the next exponent.
    let e = ((a.to_bits() >> 23) & 0xFF) as i32 - 127;
    // 2^-e exactly (e is -6..=8 here, so the exponent field stays normal).
    let inv = f32::from_bits(((127 - e) as u32) << 23);
    let t = (a * inv * 8.0).round_ties_even() as u32;
    let (e, t) = if t == 16 { (e + 1, 8) } else { (e, t) };
    let code = (((e + 7) as u32) << 3) | (t - 8);
    sign | code.min(0x7E) as u8
}

/// The scale's two factors as the kernels' `fp8_scale2` computes them, on `s = scale · 2^120`:
/// `hi = bf16(s)` and `lo` the rest `s - hi` rounded to nearest even at 4 significant bits. An
/// element applies `scale' = (hi + lo) · 2^-120`.
pub fn scale_factors(scale: f32) -> (f32, f32) {
    // 2^120, exactly.
    let s = scale * f32::from_bits((127 + 120) << 23);
    let hi = bf16::from_f32(s).to_f32();
    let r = (s - hi).to_bits();
    let lo = f32::from_bits(r.wrapping_add(0x7_FFFF + ((r >> 20) & 1)) & 0xFFF0_0000);
    (hi, lo)
}

/// `v` rounded to bf16, to nearest even, once (`v` zero or in bf16's normal range, which every
/// element of a scale of at least 2^-117 is; going through f32 could round twice).
fn bf16_nearest(v: f64) -> bf16 {
    let b = v.to_bits();
    let r = b.wrapping_add((1u64 << 44) - 1 + ((b >> 45) & 1)) & !((1u64 << 45) - 1);
    // Eight significant bits now: exact in f32 and in bf16.
    bf16::from_f32(f64::from_bits(r) as f32)
}

/// One dequantized element: `bf16(e4m3 · scale')` with [`scale_factors`] (see the module
/// invariants; a NaN code reads as ±480).
#[inline]
pub fn dequant_element(byte: u8, scale: f32) -> bf16 {
    scaled_element(byte, scale_factors(scale))
}

/// [`dequant_element`] on its scale's factors, for callers that apply one scale to many bytes.
#[inline]
fn scaled_element(byte: u8, (hi, lo): (f32, f32)) -> bf16 {
    let value = if is_nan_code(byte) {
        if byte & 0x80 != 0 { -480.0 } else { 480.0 }
    } else {
        e4m3_to_f32(byte)
    };
    // As the kernels compute it: x = e4m3 · 2^-120 (the constant is 2^-120 exactly) times both
    // factors, summed, rounded once. Every step is exact in f64 (at most 4 + 8 and 4 + 4
    // significant bits, the two within 2^40 of each other).
    let x = f64::from(value) * f64::from_bits((1023 - 120) << 52);
    bf16_nearest(x * f64::from(hi) + x * f64::from(lo))
}

/// Every byte's [`dequant_element`] under `scale`, indexed by the byte: what the CPU twins look
/// elements up in, where one scale covers many.
pub fn dequant_table(scale: f32) -> [bf16; 256] {
    let factors = scale_factors(scale);
    std::array::from_fn(|b| scaled_element(b as u8, factors))
}

/// Whether `scale` is one a KV cache pool may use: finite, positive and below [`MAX_SCALE`] (the
/// kernels' factor `scale · 2^120` stays a finite f32, and `value / scale` is defined).
pub fn kv_scale_ok(scale: f32) -> bool {
    scale.is_finite() && scale > 0.0 && scale < MAX_SCALE
}

/// One FP8 KV cache element as stored: `e4m3(value / scale)` ([`f32_to_e4m3`]: round to
/// nearest even, finite values and infinities saturated at ±448, NaN to the NaN code), the
/// quotient rounded once in f32, as the CUDA stores compute it.
#[inline]
pub fn kv_quantize(value: bf16, scale: f32) -> u8 {
    f32_to_e4m3(value.to_f32() / scale)
}

/// One FP8 KV cache element as every attention kernel reads it: [`dequant_element`],
/// `bf16(e4m3 · scale')` (the NaN code reads as bf16(±480 · scale')).
#[inline]
pub fn kv_dequant(byte: u8, scale: f32) -> bf16 {
    dequant_element(byte, scale)
}

/// Columns of the scale grid of a `[.., k]` weight.
pub fn scale_cols(k: usize) -> usize {
    k.div_ceil(FP8_BLOCK as usize)
}

/// A block-FP8 `[n, k]` weight as bf16, each element [`dequant_element`] with the scale of its
/// block: scale row `row >> scale_row_shift`, column `col / FP8_BLOCK`.
pub fn dequant(
    q: &[u8],
    scales: &[f32],
    (n, k): (usize, usize),
    scale_row_shift: u32,
) -> Vec<bf16> {
    let kb = scale_cols(k);
    let mut out = Vec::with_capacity(n * k);
    // The factors of the scale row the rows share, worked out once per scale row.
    let mut factors: Vec<(f32, f32)> = Vec::new();
    let mut factors_row = usize::MAX;
    for (row, qrow) in q.chunks_exact(k.max(1)).take(n).enumerate() {
        let srow = row >> scale_row_shift;
        if srow != factors_row {
            factors = scales[srow * kb..][..kb]
                .iter()
                .map(|&s| scale_factors(s))
                .collect();
            factors_row = srow;
        }
        out.extend(
            (qrow.iter().enumerate())
                .map(|(c, &e)| scaled_element(e, factors[c / FP8_BLOCK as usize])),
        );
    }
    out
}

/// A bf16 `[n, k]` weight quantized with the block recipe: the e4m3 bytes `[n, k]` and the f32
/// scales `[ceil(n / FP8_BLOCK), ceil(k / FP8_BLOCK)]`. Rows of blocks are quantized on as many
/// threads as the host has (each block's result does not depend on which thread computes it).
pub fn quantize(w: &[bf16], (n, k): (usize, usize)) -> (Vec<u8>, Vec<f32>) {
    let block = FP8_BLOCK as usize;
    let (rb, kb) = (n.div_ceil(block), scale_cols(k));
    let mut scales = vec![1.0f32; rb * kb];
    let mut q = vec![0u8; n * k];
    if n == 0 || k == 0 {
        return (q, scales);
    }
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let per_thread = rb.div_ceil(threads);
    std::thread::scope(|scope| {
        let work = (q.chunks_mut(per_thread * block * k))
            .zip(scales.chunks_mut(per_thread * kb))
            .enumerate();
        for (t, (q, scales)) in work {
            let first_row = t * per_thread * block;
            scope.spawn(move || {
                let rows = q.len() / k;
                quantize_rows(
                    &w[first_row * k..(first_row + rows) * k],
                    q,
                    scales,
                    (rows, k),
                );
            });
        }
    });
    (q, scales)
}

/// [`quantize`] of `rows` rows (a whole number of row blocks, or the last ones) into `q` and
/// their scale rows.
fn quantize_rows(w: &[bf16], q: &mut [u8], scales: &mut [f32], (n, k): (usize, usize)) {
    let block = FP8_BLOCK as usize;
    let kb = scale_cols(k);
    for br in 0..n.div_ceil(block) {
        let rows = br * block..((br + 1) * block).min(n);
        for bc in 0..kb {
            let cols = bc * block..((bc + 1) * block).min(k);
            let amax = (rows.clone())
                .flat_map(|r| w[r * k + cols.start..r * k + cols.end].iter())
                .map(|v| v.to_f32().abs())
                .fold(0.0f32, f32::max);
            let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
            scales[br * kb + bc] = s;
            for r in rows.clone() {
                for c in cols.clone() {
                    q[r * k + c] = f32_to_e4m3(w[r * k + c].to_f32() / s);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips_and_the_extremes_are_the_formats() {
        for code in 0u8..=255 {
            let v = e4m3_to_f32(code);
            if code & 0x7F == 0x7F {
                assert!(v.is_nan(), "{code:#04x}");
                continue;
            }
            // -0 encodes as 0x80, +0 as 0x00: both round-trip.
            assert_eq!(f32_to_e4m3(v), code, "{code:#04x} = {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), (-9.0f32).exp2());
        assert_eq!(e4m3_to_f32(0x08), (-6.0f32).exp2());
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // Between 1 (0x38) and 1.125 (0x39): the midpoint goes to the even code, 1.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.07), 0x39);
        // Between 1.125 (0x39) and 1.25 (0x3A): the midpoint goes to 1.25.
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        // The top binade carries into the next exponent: 1.96875 rounds to 2 (0x40).
        assert_eq!(f32_to_e4m3(1.96875), 0x40);
        // Past the largest finite value: saturated, never NaN.
        assert_eq!(f32_to_e4m3(470.0), 0x7E);
        assert_eq!(f32_to_e4m3(-1.0e9), 0xFE);
        assert_eq!(f32_to_e4m3(f32::INFINITY), 0x7E);
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7F);
        // Subnormals: half the smallest step rounds to zero (even), 1.5 steps to 2.
        assert_eq!(f32_to_e4m3((-10.0f32).exp2()), 0x00);
        assert_eq!(f32_to_e4m3(1.5 * (-9.0f32).exp2()), 0x02);
    }

    #[test]
    fn kv_elements_are_e4m3_of_value_over_scale_and_read_back_with_the_bf16_scale() {
        let v = |x: f32| bf16::from_f32(x);
        // 3 / 0.25 = 12 exactly (1.5 * 2^3: code 0x54); reads back as 12 * 0.25.
        assert_eq!(kv_quantize(v(3.0), 0.25), 0x54);
        assert_eq!(kv_dequant(0x54, 0.25).to_f32(), 3.0);
        // Past 448 * scale saturates; infinities too; NaN keeps the NaN code, which reads as
        // bf16(480 * scale).
        assert_eq!(kv_quantize(v(1000.0), 2.0), 0x7E);
        assert_eq!(kv_quantize(v(f32::NEG_INFINITY), 1.0), 0xFE);
        assert_eq!(kv_quantize(v(f32::NAN), 1.0), 0x7F);
        assert_eq!(kv_dequant(0x7F, 0.5).to_f32(), 240.0);
        // The scale to 12 significant bits, not rounded to bf16 first: 0x09 is 1.125 / 64, times
        // 0.1 reads 0.0017547607; with the scale rounded to bf16 it would read 0.0017623901.
        let s = 0.1f32;
        assert_eq!(kv_dequant(0x09, s).to_f32(), 0.0017547607);
        assert_ne!(
            kv_dequant(0x09, s),
            bf16::from_f32(0.017578125 * bf16::from_f32(s).to_f32())
        );
        for ok in [1.0, 1e-6, 127.9] {
            assert!(kv_scale_ok(ok), "{ok}");
        }
        for bad in [0.0, -1.0, 128.0, f32::NAN, f32::INFINITY] {
            assert!(!kv_scale_ok(bad), "{bad}");
        }
    }

    #[test]
    fn the_applied_scale_is_within_2_to_the_minus_13_and_elements_round_once() {
        let mut rng = metrale_testkit::Rng::new(11);
        let (mut off_f32, mut total) = (0, 0);
        for i in 0..2000 {
            // Scales over the range the loader accepts, amax / 448 for amax from 2^-20 to 2^13.
            let scale = rng.uniform(-20.0, 13.0).exp2() / E4M3_MAX;
            let (hi, lo) = scale_factors(scale);
            let s = f64::from(scale) * 2f64.powi(120);
            assert_eq!(bf16::from_f32(hi).to_f32(), hi, "{scale}: hi is a bf16");
            assert_eq!(
                lo.to_bits() & 0xF_FFFF,
                0,
                "{scale}: lo has 4 significant bits"
            );
            let rel = ((f64::from(hi) + f64::from(lo)) - s).abs() / s;
            assert!(rel <= 2f64.powi(-13), "{scale}: scale' off by {rel}");
            // The element is within half a bf16 step of the product with the stored scale,
            // plus scale''s error.
            let byte = (i % 254) as u8;
            let byte = if is_nan_code(byte) { 0x10 } else { byte };
            let v = f64::from(e4m3_to_f32(byte));
            let got = f64::from(dequant_element(byte, scale).to_f32());
            let exact = v * f64::from(scale);
            assert!((got - exact).abs() <= exact.abs() * (2f64.powi(-8) + 2f64.powi(-12)));
            total += 1;
            off_f32 += usize::from(
                dequant_element(byte, scale) != bf16::from_f32(e4m3_to_f32(byte) * scale),
            );
        }
        // scale' is so close to the scale that the elements almost never differ from the f32
        // product's.
        assert!(
            off_f32 * 50 < total,
            "{off_f32} of {total} differ from bf16(f32(e4m3 * scale))"
        );
        // A scale that is a bf16 applies exactly.
        assert_eq!(scale_factors(0.375), (0.375 * 2f32.powi(120), 0.0));
    }

    #[test]
    fn quantized_blocks_reach_448_and_dequantize_within_the_format_step() {
        let (n, k) = (200, 300);
        let mut rng = metrale_testkit::Rng::new(7);
        // Blocks of different magnitudes, so each needs its own scale.
        let w: Vec<bf16> = (0..n * k)
            .map(|i| {
                let magnitude = (1 + (i / k) / 128 + 3 * ((i % k) / 128)) as f32;
                bf16::from_f32(rng.uniform(-0.5, 0.5) * magnitude)
            })
            .collect();
        let (q, scales) = quantize(&w, (n, k));
        assert_eq!(scales.len(), 2 * 3);
        let back = dequant(&q, &scales, (n, k), FP8_BLOCK_ROW_SHIFT);
        for (i, (&orig, &deq)) in w.iter().zip(&back).enumerate() {
            let s = scales[(i / k / 128) * 3 + (i % k) / 128];
            // e4m3 keeps 3 mantissa bits: within 1/16 relative, or a subnormal step.
            let err = (orig.to_f32() - deq.to_f32()).abs();
            assert!(
                err <= orig.to_f32().abs() / 16.0 + s * (-9.0f32).exp2() + 1e-6,
                "{i}"
            );
        }
        // Every block's largest element maps to ±448 exactly.
        for (b, &s) in scales.iter().enumerate() {
            let (br, bc) = (b / 3, b % 3);
            let max = (br * 128..((br + 1) * 128).min(n))
                .flat_map(|r| (bc * 128..((bc + 1) * 128).min(k)).map(move |c| r * k + c))
                .map(|i| q[i] & 0x7F)
                .max();
            assert_eq!(max, Some(0x7E), "block {b} (scale {s})");
        }
        // A row-per-scale grid gives the same values as the block grid it expands.
        let per_row: Vec<f32> = (0..n)
            .flat_map(|r| scales[(r / 128) * 3..][..3].to_vec())
            .collect();
        assert_eq!(dequant(&q, &per_row, (n, k), 0), back);
    }
}
