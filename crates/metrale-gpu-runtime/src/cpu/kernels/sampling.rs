//! CPU twin of `kernels/sampling.cu`: greedy argmax over f32 logits on the device.

use metrale_kernel_abi::ArgmaxParams;

use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `argmax` ([`ArgmaxParams`]): the lowest index of each row's maximum (NaN never wins; an
/// all-NaN row gives 0).
pub fn argmax(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ArgmaxParams = ctx.params()?;
    let (rows, vocab) = (p.rows as usize, p.vocab as usize);
    let out = ctx.slice_mut::<u32>("out", p.out, rows)?;
    let logits = ctx.slice::<f32>("logits", p.logits, rows * vocab)?;
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
