//! CPU twins of `kernels/norm.cu`: RMSNorm over the f32 residual stream, plain or fused with the
//! residual add. `unit_offset` selects the zero-centred convention `x * (1 + w)` of the Qwen3.5 /
//! Qwen3-Next families; 0 is the standard `x * w`.

use half::bf16;
use metrale_kernel_abi::{AddRmsNormParams, AddRmsNormStagedParams, RmsNormParams};

use super::util::{b, f, norm_weight, rms_scale};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

fn normalize_row(out: &mut [bf16], x: &[f32], w: &[bf16], eps: f32, unit_offset: bool) {
    let s = rms_scale(x.iter().copied(), x.len(), eps);
    for ((o, &v), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = b(v * s * norm_weight(wi, unit_offset));
    }
}

/// `rms_norm` ([`RmsNormParams`]): `out = rms_norm(x) * w`.
pub fn rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: RmsNormParams = ctx.params()?;
    let (rows, cols, unit) = (p.rows as usize, p.cols as usize, p.unit_offset != 0);
    let out = ctx.slice_mut::<bf16>("out", p.out, rows * cols)?;
    let x = ctx.slice::<f32>("x", p.x, rows * cols)?;
    let w = ctx.slice::<bf16>("w", p.w, cols)?;
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        normalize_row(&mut out[row.clone()], &x[row], w, p.eps, unit);
    }
    Ok(())
}

/// `add_rms_norm` ([`AddRmsNormParams`]): `residual += delta`, then `out = rms_norm(residual)`.
pub fn add_rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: AddRmsNormParams = ctx.params()?;
    let (rows, cols, unit) = (p.rows as usize, p.cols as usize, p.unit_offset != 0);
    let residual = ctx.slice_mut::<f32>("residual", p.residual, rows * cols)?;
    let delta = ctx.slice::<bf16>("delta", p.delta, rows * cols)?;
    let w = ctx.slice::<bf16>("w", p.w, cols)?;
    let out = ctx.slice_mut::<bf16>("out", p.out, rows * cols)?;
    for (r, d) in residual.iter_mut().zip(delta) {
        *r += f(*d);
    }
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        normalize_row(&mut out[row.clone()], &residual[row], w, p.eps, unit);
    }
    Ok(())
}

/// `add_rms_norm_staged` ([`AddRmsNormStagedParams`]): `add_rms_norm`, the rows of `out` also
/// written as `linear_tma`'s stage images (padding left as it was). The kernel stages on its
/// vector path only: `cols % 8 == 0` and 16-byte aligned operands, else it fails.
pub fn add_rms_norm_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: AddRmsNormStagedParams = ctx.params()?;
    let (rows, cols, unit) = (p.rows as usize, p.cols as usize, p.unit_offset != 0);
    if cols % 8 != 0 {
        return Err(ctx.fail(format!("cols = {cols} is not a multiple of 8")));
    }
    if [p.residual, p.delta, p.w, p.out]
        .iter()
        .any(|q| !q.0.is_multiple_of(16))
    {
        return Err(ctx.fail("residual, delta, w and out must be 16-byte aligned"));
    }
    let residual = ctx.slice_mut::<f32>("residual", p.residual, rows * cols)?;
    let delta = ctx.slice::<bf16>("delta", p.delta, rows * cols)?;
    let w = ctx.slice::<bf16>("w", p.w, cols)?;
    let out = ctx.slice_mut::<bf16>("out", p.out, rows * cols)?;
    let img =
        ctx.slice_mut::<bf16>("img", p.img, super::gemm::stage_image_bytes(rows, cols) / 2)?;
    for (r, d) in residual.iter_mut().zip(delta) {
        *r += f(*d);
    }
    for r in 0..rows {
        let row = r * cols..(r + 1) * cols;
        normalize_row(
            &mut out[row.clone()],
            &residual[row.clone()],
            w,
            p.eps,
            unit,
        );
        super::gemm::store_image_row(img, r, &out[row]);
    }
    Ok(())
}
