//! CPU twins of `kernels/norm.cu`: RMSNorm over the f32 residual stream, plain or fused with the
//! residual add. `unit_offset` selects the zero-centred convention `x * (1 + w)` of the Qwen3.5 /
//! Qwen3-Next families; 0 is the standard `x * w`.

use half::bf16;

use super::util::{b, f, norm_weight, rms_scale};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

fn normalize_row(out: &mut [bf16], x: &[f32], w: &[bf16], eps: f32, unit_offset: bool) {
    let s = rms_scale(x.iter().copied(), x.len(), eps);
    for ((o, &v), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = b(v * s * norm_weight(wi, unit_offset));
    }
}

/// `rms_norm(out: bf16 [rows, cols], x: f32 [rows, cols], w: bf16 [cols], rows, cols, eps,
/// unit_offset)`.
pub fn rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(7)?;
    let (rows, cols, eps, unit) = (ctx.usize(3)?, ctx.usize(4)?, ctx.f32(5)?, ctx.u32(6)? != 0);
    let out = ctx.slice_mut::<bf16>(0, rows * cols)?;
    let x = ctx.slice::<f32>(1, rows * cols)?;
    let w = ctx.slice::<bf16>(2, cols)?;
    for r in 0..rows {
        normalize_row(
            &mut out[r * cols..(r + 1) * cols],
            &x[r * cols..(r + 1) * cols],
            w,
            eps,
            unit,
        );
    }
    Ok(())
}

/// `add_rms_norm(residual: f32 [rows, cols] (in/out), delta: bf16 [rows, cols], w: bf16 [cols],
/// out: bf16 [rows, cols], rows, cols, eps, unit_offset)`: `residual += delta`, then
/// `out = rms_norm(residual)`.
pub fn add_rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(8)?;
    let (rows, cols, eps, unit) = (ctx.usize(4)?, ctx.usize(5)?, ctx.f32(6)?, ctx.u32(7)? != 0);
    let residual = ctx.slice_mut::<f32>(0, rows * cols)?;
    let delta = ctx.slice::<bf16>(1, rows * cols)?;
    let w = ctx.slice::<bf16>(2, cols)?;
    let out = ctx.slice_mut::<bf16>(3, rows * cols)?;
    for (r, d) in residual.iter_mut().zip(delta) {
        *r += f(*d);
    }
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        normalize_row(&mut out[row.clone()], &residual[row], w, eps, unit);
    }
    Ok(())
}

/// `add_rms_norm_staged(residual, delta, w, out, img: stage images of [rows, cols], rows, cols,
/// eps, unit_offset)`: `add_rms_norm`, the rows of `out` also written as `linear_tma`'s stage
/// images (padding left as it was).
pub fn add_rms_norm_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(9)?;
    let (rows, cols, eps, unit) = (ctx.usize(5)?, ctx.usize(6)?, ctx.f32(7)?, ctx.u32(8)? != 0);
    if cols % 8 != 0 {
        return Err(ctx.fail(format!("cols = {cols} is not a multiple of 8")));
    }
    let residual = ctx.slice_mut::<f32>(0, rows * cols)?;
    let delta = ctx.slice::<bf16>(1, rows * cols)?;
    let w = ctx.slice::<bf16>(2, cols)?;
    let out = ctx.slice_mut::<bf16>(3, rows * cols)?;
    let img = ctx.slice_mut::<bf16>(4, super::gemm::stage_image_bytes(rows, cols) / 2)?;
    for (r, d) in residual.iter_mut().zip(delta) {
        *r += f(*d);
    }
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        normalize_row(&mut out[row.clone()], &residual[row.clone()], w, eps, unit);
        super::gemm::store_image_row(img, r, &out[row]);
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "norm",
    kernels: &[
        ("rms_norm", rms_norm),
        ("add_rms_norm", add_rms_norm),
        ("add_rms_norm_staged", add_rms_norm_staged),
    ],
};
