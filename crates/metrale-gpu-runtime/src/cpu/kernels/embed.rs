//! CPU twins of `kernels/embed.cu`: token embedding gather and row gather.

use half::bf16;

use super::util::f;
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `embedding_gather(out: f32 [rows, hidden], table: bf16 [vocab, hidden], ids: u32 [rows],
/// rows, hidden, vocab)`: `out[r] = table[ids[r]]`, widened to f32 (the residual stream).
pub fn embedding_gather(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(6)?;
    let (rows, hidden, vocab) = (ctx.usize(3)?, ctx.usize(4)?, ctx.usize(5)?);
    let out = ctx.slice_mut::<f32>(0, rows * hidden)?;
    let table = ctx.slice::<bf16>(1, vocab * hidden)?;
    let ids = ctx.slice::<u32>(2, rows)?;
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= vocab {
            return Err(ctx.fail(format!(
                "row {r}: token id {id} is outside the vocabulary ({vocab})"
            )));
        }
        let src = &table[id * hidden..(id + 1) * hidden];
        for (o, &w) in out[r * hidden..(r + 1) * hidden].iter_mut().zip(src) {
            *o = f(w);
        }
    }
    Ok(())
}

/// `gather_rows(out: bf16 [n, cols], x: bf16 [src_rows, cols], row_ids: u32 [n], n, cols,
/// src_rows)`: `out[i] = x[row_ids[i]]`.
pub fn gather_rows(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(6)?;
    let (n, cols, src_rows) = (ctx.usize(3)?, ctx.usize(4)?, ctx.usize(5)?);
    let out = ctx.slice_mut::<bf16>(0, n * cols)?;
    let x = ctx.slice::<bf16>(1, src_rows * cols)?;
    let ids = ctx.slice::<u32>(2, n)?;
    for (i, &r) in ids.iter().enumerate() {
        let r = r as usize;
        if r >= src_rows {
            return Err(ctx.fail(format!(
                "row id {r} at {i} is past the {src_rows} source rows"
            )));
        }
        out[i * cols..(i + 1) * cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "embed",
    kernels: &[
        ("embedding_gather", embedding_gather),
        ("gather_rows", gather_rows),
    ],
};
