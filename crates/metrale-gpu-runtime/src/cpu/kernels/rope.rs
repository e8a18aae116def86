//! CPU twin of `kernels/rope.cu`: per-head RMSNorm of q and k (optional) followed by rotary
//! embedding (rotate-half layout over the first `rotary_dim` dims), in place on the projection
//! output row.
//!
//! Row layout: query head `h` starts at `h * q_head_stride` (`head_dim`, or `2 * head_dim` when a
//! gate follows each query head); key head `h` at `k_offset + h * head_dim`. Values are left alone.

use half::bf16;

use super::util::{b, f, norm_weight, rms_scale};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

#[allow(clippy::too_many_arguments)]
fn head(
    x: &mut [bf16],
    norm_w: Option<&[bf16]>,
    inv_freq: &[f32],
    pos: f32,
    rotary_dim: usize,
    eps: f32,
    unit: bool,
) {
    let d = x.len();
    let mut v: Vec<f32> = x.iter().map(|&e| f(e)).collect();
    if let Some(w) = norm_w {
        let s = rms_scale(v.iter().copied(), d, eps);
        for (e, &wi) in v.iter_mut().zip(w) {
            *e = *e * s * norm_weight(wi, unit);
        }
    }
    let half = rotary_dim / 2;
    for i in 0..half {
        let angle = pos * inv_freq[i];
        let (sin, cos) = angle.sin_cos();
        let (x1, x2) = (v[i], v[i + half]);
        v[i] = x1 * cos - x2 * sin;
        v[i + half] = x2 * cos + x1 * sin;
    }
    for (o, e) in x.iter_mut().zip(v) {
        *o = b(e);
    }
}

/// `qk_norm_rope(qkv: bf16 [rows, row_stride] (in/out), q_norm_w: bf16 [head_dim] or NULL,
/// k_norm_w: bf16 [head_dim] or NULL, inv_freq: f32 [rotary_dim / 2], positions: u32 [rows],
/// rows, row_stride, num_q_heads, q_head_stride, k_offset, num_kv_heads, head_dim, rotary_dim,
/// eps, unit_offset)`.
pub fn qk_norm_rope(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(15)?;
    let rows = ctx.usize(5)?;
    let stride = ctx.usize(6)?;
    let (hq, q_stride, k_off, hkv, d, rd) = (
        ctx.usize(7)?,
        ctx.usize(8)?,
        ctx.usize(9)?,
        ctx.usize(10)?,
        ctx.usize(11)?,
        ctx.usize(12)?,
    );
    let (eps, unit) = (ctx.f32(13)?, ctx.u32(14)? != 0);
    if rd > d || !rd.is_multiple_of(2) {
        return Err(ctx.fail(format!(
            "rotary_dim {rd} must be even and at most head_dim {d}"
        )));
    }
    if (hq > 0 && (hq - 1) * q_stride + d > stride) || k_off + hkv * d > stride {
        return Err(ctx.fail(format!("heads do not fit a row of {stride} elements")));
    }
    let qkv = ctx.slice_mut::<bf16>(0, rows * stride)?;
    let qw = if ctx.ptr(1)?.is_null() {
        None
    } else {
        Some(ctx.slice::<bf16>(1, d)?)
    };
    let kw = if ctx.ptr(2)?.is_null() {
        None
    } else {
        Some(ctx.slice::<bf16>(2, d)?)
    };
    let inv_freq = ctx.slice::<f32>(3, rd / 2)?;
    let positions = ctx.slice::<u32>(4, rows)?;
    for r in 0..rows {
        let row = &mut qkv[r * stride..(r + 1) * stride];
        let pos = positions[r] as f32;
        for h in 0..hq {
            head(
                &mut row[h * q_stride..h * q_stride + d],
                qw,
                inv_freq,
                pos,
                rd,
                eps,
                unit,
            );
        }
        for h in 0..hkv {
            let s = k_off + h * d;
            head(&mut row[s..s + d], kw, inv_freq, pos, rd, eps, unit);
        }
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "rope",
    kernels: &[("qk_norm_rope", qk_norm_rope)],
};
