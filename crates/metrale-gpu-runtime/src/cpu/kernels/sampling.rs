//! CPU twin of `kernels/sampling.cu`: greedy argmax over f32 logits on the device.

use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `argmax(out: u32 [rows], logits: f32 [rows, vocab], rows, vocab)`: the lowest index of each
/// row's maximum (NaN never wins).
pub fn argmax(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(4)?;
    let (rows, vocab) = (ctx.usize(2)?, ctx.usize(3)?);
    let out = ctx.slice_mut::<u32>(0, rows)?;
    let logits = ctx.slice::<f32>(1, rows * vocab)?;
    for (r, o) in out.iter_mut().enumerate() {
        let row = &logits[r * vocab..(r + 1) * vocab];
        let mut best = 0usize;
        for (i, &v) in row.iter().enumerate() {
            if v > row[best] || (row[best].is_nan() && !v.is_nan()) {
                best = i;
            }
        }
        *o = best as u32;
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "sampling",
    kernels: &[("argmax", argmax)],
};
