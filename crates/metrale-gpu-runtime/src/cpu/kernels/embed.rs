//! CPU twins of `kernels/embed.cu`: token embedding gather, row gather, and f32 values rounded
//! to bf16.

use half::bf16;
use metrale_kernel_abi::{EmbeddingGatherParams, GatherRowsParams, RoundBf16Params};

use super::util::f;
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `embedding_gather` ([`EmbeddingGatherParams`]): `out[r] = table[ids[r] - row_start]`, widened
/// to f32 (the residual stream), where the table holds the id's row, zeros where it does not (a
/// vocabulary-parallel rank's slice). An id past the vocabulary fails the launch.
pub fn embedding_gather(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: EmbeddingGatherParams = ctx.params()?;
    let (rows, hidden, vocab) = (p.rows as usize, p.hidden as usize, p.vocab as usize);
    let (start, table_rows) = (p.row_start as usize, p.table_rows as usize);
    let out = ctx.slice_mut::<f32>("out", p.out, rows * hidden)?;
    let table = ctx.slice::<bf16>("table", p.table, table_rows * hidden)?;
    let ids = ctx.slice::<u32>("ids", p.ids, rows)?;
    for (r, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= vocab {
            return Err(ctx.fail(format!(
                "row {r}: token id {id} is outside the vocabulary ({vocab})"
            )));
        }
        let row = &mut out[r * hidden..(r + 1) * hidden];
        if id < start || id - start >= table_rows {
            row.fill(0.0);
            continue;
        }
        let src = &table[(id - start) * hidden..(id - start + 1) * hidden];
        for (o, &w) in row.iter_mut().zip(src) {
            *o = f(w);
        }
    }
    Ok(())
}

/// `gather_rows` ([`GatherRowsParams`]): `out[i] = x[row_ids[i]]`. A row id past the source
/// fails the launch.
pub fn gather_rows(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: GatherRowsParams = ctx.params()?;
    let (n, cols, src_rows) = (p.n as usize, p.cols as usize, p.src_rows as usize);
    let out = ctx.slice_mut::<bf16>("out", p.out, n * cols)?;
    let x = ctx.slice::<bf16>("x", p.x, src_rows * cols)?;
    let ids = ctx.slice::<u32>("row_ids", p.row_ids, n)?;
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

/// `round_bf16` ([`RoundBf16Params`]): `out[i] = bf16(x[i])`, rounded to nearest even.
pub fn round_bf16(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: RoundBf16Params = ctx.params()?;
    let n = p.n as usize;
    let out = ctx.slice_mut::<bf16>("out", p.out, n)?;
    let x = ctx.slice::<f32>("x", p.x, n)?;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = bf16::from_f32(v);
    }
    Ok(())
}
