//! CPU twin of `kernels/activation.cu`: the SwiGLU gate, `silu(gate) * up`.

use half::bf16;

use super::util::{b, f, silu};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `silu(gate) * up` rounded to bf16 for each of `rows` rows of `gate_up` (gate then up, `ffn`
/// each): what `silu_mul` writes, and `linear_swiglu`.
pub(crate) fn silu_mul_rows(gate_up: &[bf16], rows: usize, ffn: usize) -> Vec<bf16> {
    (0..rows)
        .flat_map(|r| {
            let (g, u) = gate_up[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
            g.iter().zip(u).map(|(&gv, &uv)| b(silu(f(gv)) * f(uv)))
        })
        .collect()
}

/// `silu_mul(out: bf16 [rows, ffn], gate_up: bf16 [rows, 2 * ffn], rows, ffn)`: each row of
/// `gate_up` holds the gate projection then the up projection (the fused `[gate; up]` weight).
pub fn silu_mul(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(4)?;
    let (rows, ffn) = (ctx.usize(2)?, ctx.usize(3)?);
    let act = silu_mul_rows(ctx.slice::<bf16>(1, rows * 2 * ffn)?, rows, ffn);
    ctx.slice_mut::<bf16>(0, rows * ffn)?.copy_from_slice(&act);
    Ok(())
}

/// `silu_mul_staged(img: stage images of [rows, ffn], act: bf16 [rows, ffn] or NULL, gate_up:
/// bf16 [rows, 2 * ffn], rows, ffn)`: `silu_mul` written as `linear_tma`'s stage images (padding
/// left as it was), and as rows at `act` where it is not NULL.
pub fn silu_mul_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(5)?;
    let (rows, ffn) = (ctx.usize(3)?, ctx.usize(4)?);
    if ffn % 8 != 0 {
        return Err(ctx.fail(format!("ffn = {ffn} is not a multiple of 8")));
    }
    let act = silu_mul_rows(ctx.slice::<bf16>(2, rows * 2 * ffn)?, rows, ffn);
    let img = ctx.slice_mut::<bf16>(0, super::gemm::stage_image_bytes(rows, ffn) / 2)?;
    for (r, row) in act.chunks(ffn.max(1)).enumerate() {
        super::gemm::store_image_row(img, r, row);
    }
    if !ctx.ptr(1)?.is_null() {
        ctx.slice_mut::<bf16>(1, rows * ffn)?.copy_from_slice(&act);
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "activation",
    kernels: &[("silu_mul", silu_mul), ("silu_mul_staged", silu_mul_staged)],
};
