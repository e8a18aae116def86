//! CPU twin of `kernels/activation.cu`: the SwiGLU gate, `silu(gate) * up`.

use half::bf16;

use super::util::{b, f, silu};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `silu_mul(out: bf16 [rows, ffn], gate_up: bf16 [rows, 2 * ffn], rows, ffn)`: each row of
/// `gate_up` holds the gate projection then the up projection (the fused `[gate; up]` weight).
pub fn silu_mul(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(4)?;
    let (rows, ffn) = (ctx.usize(2)?, ctx.usize(3)?);
    let out = ctx.slice_mut::<bf16>(0, rows * ffn)?;
    let gu = ctx.slice::<bf16>(1, rows * 2 * ffn)?;
    for r in 0..rows {
        let (g, u) = gu[r * 2 * ffn..(r + 1) * 2 * ffn].split_at(ffn);
        for ((o, &gv), &uv) in out[r * ffn..(r + 1) * ffn].iter_mut().zip(g).zip(u) {
            *o = b(silu(f(gv)) * f(uv));
        }
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "activation",
    kernels: &[("silu_mul", silu_mul)],
};
