//! CPU twin of `kernels/activation.cu`: the SwiGLU gate, `silu(gate) * up`.

use half::bf16;
use metrale_kernel_abi::{SiluMulParams, SiluMulStagedParams};

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

/// `silu_mul` ([`SiluMulParams`]): each row of `gate_up` holds the gate projection then the up
/// projection (the fused `[gate; up]` weight).
pub fn silu_mul(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: SiluMulParams = ctx.params()?;
    let (rows, ffn) = (p.rows as usize, p.ffn as usize);
    let act = silu_mul_rows(
        ctx.slice::<bf16>("gate_up", p.gate_up, rows * 2 * ffn)?,
        rows,
        ffn,
    );
    ctx.slice_mut::<bf16>("out", p.out, rows * ffn)?
        .copy_from_slice(&act);
    Ok(())
}

/// `silu_mul_staged` ([`SiluMulStagedParams`]): `silu_mul` written as `linear_tma`'s stage
/// images (padding left as it was), and as rows at `act` where it is not null. The kernel has
/// only its vector path: `ffn % 8 == 0` and 16-byte aligned `gate_up` and `act`, else it fails.
pub fn silu_mul_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: SiluMulStagedParams = ctx.params()?;
    let (rows, ffn) = (p.rows as usize, p.ffn as usize);
    if ffn % 8 != 0 {
        return Err(ctx.fail(format!("ffn = {ffn} is not a multiple of 8")));
    }
    if !p.gate_up.0.is_multiple_of(16) || !p.act.0.is_multiple_of(16) {
        return Err(ctx.fail("gate_up and act must be 16-byte aligned"));
    }
    let act = silu_mul_rows(
        ctx.slice::<bf16>("gate_up", p.gate_up, rows * 2 * ffn)?,
        rows,
        ffn,
    );
    let img = ctx.slice_mut::<bf16>("img", p.img, super::gemm::stage_image_bytes(rows, ffn) / 2)?;
    for (r, row) in act.chunks(ffn.max(1)).enumerate() {
        super::gemm::store_image_row(img, r, row);
    }
    if !p.act.is_null() {
        ctx.slice_mut::<bf16>("act", p.act, rows * ffn)?
            .copy_from_slice(&act);
    }
    Ok(())
}
