//! CPU twin of `kernels/attention.cu`: causal attention of each row over its sequence's paged KV
//! cache. One kernel serves prefill and decode: a row at position `p` attends to positions
//! `0..=p` of the sequence whose block table it names, after the step's keys and values were
//! stored. Each row's result depends only on its own query and its sequence's cache, never on
//! the other rows of the step (batch invariance).

use half::bf16;

use super::gemm::{stage_image_bytes, store_image_row};
use super::util::{b, f, sigmoid};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// The arguments `paged_attention` and `paged_attention_prefill` share, in launch order.
struct Shape {
    rows: usize,
    row_stride: usize,
    q_head_stride: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    block_size: usize,
    max_blocks: usize,
    num_seqs: usize,
    num_slots: usize,
    scale: f32,
    gate: bool,
}

/// `paged_attention(out: bf16 [rows, num_q_heads * head_dim], qkv: bf16 [rows, row_stride],
/// k_cache, v_cache: bf16 [num_slots, num_kv_heads, head_dim], block_tables: u32 [num_seqs,
/// max_blocks], row_seq: u32 [rows], positions: u32 [rows], rows, row_stride, q_head_stride,
/// num_q_heads, num_kv_heads, head_dim, block_size, max_blocks, num_seqs, num_slots, scale,
/// gated)`.
///
/// Query head `h` is read at `h * q_head_stride`; with `gated` = 1 its output gate follows it
/// (`[q | gate]`, `q_head_stride = 2 * head_dim`) and the output is multiplied by
/// `sigmoid(gate)`. Query head `h` reads key/value head `h / (num_q_heads / num_kv_heads)`.
pub fn paged_attention(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(19)?;
    let s = shape(ctx)?;
    let rows: Vec<usize> = (0..s.rows).collect();
    attend_out(ctx, &s, &rows)
}

/// `paged_attention_flat(the arguments of paged_attention)`: `paged_attention`'s rows, bitwise
/// (the CUDA kernel computes each item in one block instead of a cluster; the arithmetic is the
/// same).
pub fn paged_attention_flat(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    paged_attention(ctx)
}

/// `paged_attention_prefill(the arguments of paged_attention, row_groups: u32 [n_groups, 2],
/// n_groups)`: `paged_attention` on the rows of the groups (first row, rows), bitwise the same
/// per row. A group is 1 ..= `rows_per_item` consecutive rows of one sequence whose positions lie
/// in one 16-token unit (the CUDA kernel computes a group's rows together); a malformed group
/// fails. Rows of no group are not written.
pub fn paged_attention_prefill(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(21)?;
    let s = shape(ctx)?;
    attend_out(ctx, &s, &prefill_rows(ctx, &s)?)
}

/// `paged_attention_prefill_staged(img: stage images of [rows, num_q_heads * head_dim], then
/// the arguments of paged_attention_prefill after `out`)`: the same rows written as the o
/// projection's stage images (`linear_tma`'s x), which `permute_k32_tiles` of the prefill
/// kernel's output would give. num_q_heads * head_dim must be a multiple of 64.
pub fn paged_attention_prefill_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(21)?;
    let s = shape(ctx)?;
    let width = s.hq * s.d;
    if !width.is_multiple_of(64) {
        return Err(ctx.fail(format!(
            "an output row of {width} is not whole 64-wide stages"
        )));
    }
    let rows = prefill_rows(ctx, &s)?;
    let mut out = vec![bf16::ZERO; s.rows * width];
    attend(ctx, &s, &rows, &mut out)?;
    let img = ctx.slice_mut::<bf16>(0, stage_image_bytes(s.rows, width) / 2)?;
    for &r in &rows {
        store_image_row(img, r, &out[r * width..(r + 1) * width]);
    }
    Ok(())
}

/// The rows of the prefill kernels' row groups (arguments 19 and 20), checked as the CUDA
/// kernel's items: 1 ..= `rows_per_item` consecutive rows of one sequence in one 16-token unit.
fn prefill_rows(ctx: &KernelCtx<'_>, s: &Shape) -> GpuResult<Vec<usize>> {
    let n_groups = ctx.usize(20)?;
    let groups = ctx.slice::<u32>(19, 2 * n_groups)?;
    let row_seq = ctx.slice::<u32>(5, s.rows)?;
    let positions = ctx.slice::<u32>(6, s.rows)?;
    let most = rows_per_item(heads_per_block(s.hq, s.hkv), s.d);
    let mut rows = Vec::new();
    for (i, g) in groups.chunks_exact(2).enumerate() {
        let (first, count) = (g[0] as usize, g[1] as usize);
        if count == 0 || count > most || first + count > s.rows {
            return Err(ctx.fail(format!(
                "row group {i}: rows {first}..{} (at most {most}, of {} rows)",
                first + count,
                s.rows
            )));
        }
        let unit = positions[first] / 16;
        if (first..first + count).any(|r| row_seq[r] != row_seq[first] || positions[r] / 16 != unit)
        {
            return Err(ctx.fail(format!(
                "row group {i}: rows {first}..{} are not of one sequence and one 16-token unit",
                first + count
            )));
        }
        rows.extend(first..first + count);
    }
    Ok(rows)
}

/// Query heads per block of the CUDA kernel (`att_heads_per_block`): the largest divisor of the
/// group size up to `ATTENTION_HB`.
fn heads_per_block(hq: usize, hkv: usize) -> usize {
    let group = hq / hkv;
    (1..=ATTENTION_HB.min(group))
        .rev()
        .find(|b| group.is_multiple_of(*b))
        .unwrap_or(1)
}

/// Most query heads one CUDA cluster computes (`ATT_HB`).
const ATTENTION_HB: usize = 8;

/// Rows per row group of the CUDA prefill kernel (`atp_rows_per_item`): its items hold 64
/// (row, head) pairs up to head_dim 128 and 32 above, and at most one 16-token unit of rows.
fn rows_per_item(heads_per_block: usize, head_dim: usize) -> usize {
    let virtual_rows = if head_dim > 128 { 32 } else { 64 };
    (virtual_rows / heads_per_block).min(16)
}

fn shape(ctx: &KernelCtx<'_>) -> GpuResult<Shape> {
    let s = Shape {
        rows: ctx.usize(7)?,
        row_stride: ctx.usize(8)?,
        q_head_stride: ctx.usize(9)?,
        hq: ctx.usize(10)?,
        hkv: ctx.usize(11)?,
        d: ctx.usize(12)?,
        block_size: ctx.usize(13)?,
        max_blocks: ctx.usize(14)?,
        num_seqs: ctx.usize(15)?,
        num_slots: ctx.usize(16)?,
        scale: ctx.f32(17)?,
        gate: ctx.u32(18)? != 0,
    };
    if s.hkv == 0 || !s.hq.is_multiple_of(s.hkv) {
        return Err(ctx.fail(format!(
            "{} query heads do not group over {} kv heads",
            s.hq, s.hkv
        )));
    }
    Ok(s)
}

/// [`attend`] into the output rows at argument 0 (`[rows, num_q_heads * head_dim]`).
fn attend_out(ctx: &KernelCtx<'_>, s: &Shape, rows: &[usize]) -> GpuResult<()> {
    attend(ctx, s, rows, ctx.slice_mut::<bf16>(0, s.rows * s.hq * s.d)?)
}

/// Every head of each row in `rows`, written to its row of `out` (`[rows, num_q_heads *
/// head_dim]`).
fn attend(ctx: &KernelCtx<'_>, s: &Shape, rows: &[usize], out: &mut [bf16]) -> GpuResult<()> {
    let width = s.hkv * s.d;
    let qkv = ctx.slice::<bf16>(1, s.rows * s.row_stride)?;
    let k_cache = ctx.slice::<bf16>(2, s.num_slots * width)?;
    let v_cache = ctx.slice::<bf16>(3, s.num_slots * width)?;
    let tables = ctx.slice::<u32>(4, s.num_seqs * s.max_blocks)?;
    let row_seq = ctx.slice::<u32>(5, s.rows)?;
    let positions = ctx.slice::<u32>(6, s.rows)?;
    let group = s.hq / s.hkv;
    let mut scores = Vec::new();
    let mut acc = vec![0.0f32; s.d];
    for &r in rows {
        let seq = row_seq[r] as usize;
        if seq >= s.num_seqs {
            return Err(ctx.fail(format!(
                "row {r}: sequence {seq} is past the {} block tables",
                s.num_seqs
            )));
        }
        let ctx_len = positions[r] as usize + 1;
        if ctx_len.div_ceil(s.block_size) > s.max_blocks {
            return Err(ctx.fail(format!(
                "row {r}: position {} needs more than {} blocks",
                ctx_len - 1,
                s.max_blocks
            )));
        }
        let table = &tables[seq * s.max_blocks..(seq + 1) * s.max_blocks];
        let mut slots = Vec::with_capacity(ctx_len);
        for t in 0..ctx_len {
            let slot = table[t / s.block_size] as usize * s.block_size + t % s.block_size;
            if slot >= s.num_slots {
                return Err(ctx.fail(format!(
                    "row {r}: token {t} maps to slot {slot}, past {}",
                    s.num_slots
                )));
            }
            slots.push(slot);
        }
        for h in 0..s.hq {
            let q_at = r * s.row_stride + h * s.q_head_stride;
            let q: Vec<f32> = qkv[q_at..q_at + s.d].iter().map(|&e| f(e)).collect();
            let kv_at = (h / group) * s.d;
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for &slot in &slots {
                let k = &k_cache[slot * width + kv_at..slot * width + kv_at + s.d];
                let mut dot = 0.0f32;
                for (a, &kb) in q.iter().zip(k) {
                    dot += a * f(kb);
                }
                let sc = dot * s.scale;
                max = max.max(sc);
                scores.push(sc);
            }
            let mut denom = 0.0f32;
            for sc in scores.iter_mut() {
                *sc = (*sc - max).exp();
                denom += *sc;
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (&p, &slot) in scores.iter().zip(&slots) {
                let v = &v_cache[slot * width + kv_at..slot * width + kv_at + s.d];
                for (a, &vb) in acc.iter_mut().zip(v) {
                    *a += p * f(vb);
                }
            }
            let o = &mut out[(r * s.hq + h) * s.d..(r * s.hq + h + 1) * s.d];
            for (i, (dst, a)) in o.iter_mut().zip(&acc).enumerate() {
                let mut val = a / denom;
                if s.gate {
                    val *= sigmoid(f(qkv[q_at + s.d + i]));
                }
                *dst = b(val);
            }
        }
    }
    Ok(())
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "attention",
    kernels: &[
        ("paged_attention", paged_attention),
        ("paged_attention_flat", paged_attention_flat),
        ("paged_attention_prefill", paged_attention_prefill),
        (
            "paged_attention_prefill_staged",
            paged_attention_prefill_staged,
        ),
    ],
};
