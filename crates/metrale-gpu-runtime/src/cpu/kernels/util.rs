//! Small numeric helpers shared by the CPU kernels: bf16 conversion and the f32 math every twin
//! uses, so CPU and CUDA agree on formulas (not on rounding, which the tests bound).

use half::bf16;

/// bf16 to f32 (exact).
#[inline]
pub fn f(x: bf16) -> f32 {
    x.to_f32()
}

/// f32 to bf16, round to nearest even.
#[inline]
pub fn b(x: f32) -> bf16 {
    bf16::from_f32(x)
}

/// The SiLU activation, `x * sigmoid(x)`, in f32.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// The logistic sigmoid in f32.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `1 / sqrt(mean(x^2) + eps)` over a row, accumulated in f32 in index order.
#[inline]
pub fn rms_scale(row: impl Iterator<Item = f32>, cols: usize, eps: f32) -> f32 {
    let mut sum = 0.0f32;
    for v in row {
        sum += v * v;
    }
    1.0 / (sum / cols as f32 + eps).sqrt()
}

/// The norm weight as applied: `w` for the standard convention, `1 + w` for the zero-centred one.
#[inline]
pub fn norm_weight(w: bf16, unit_offset: bool) -> f32 {
    if unit_offset { 1.0 + f(w) } else { f(w) }
}
