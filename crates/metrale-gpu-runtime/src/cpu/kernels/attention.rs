//! CPU twin of `kernels/attention.cu`: causal attention of each row over its sequence's paged KV
//! cache. One kernel serves prefill and decode: a row at position `p` attends to positions
//! `0..=p` of the sequence whose block table it names, after the step's keys and values were
//! stored. Each row's result depends only on its own query and its sequence's cache, never on
//! the other rows of the step (batch invariance). FP8 pools (`kv_fp8`) are read element by
//! element as `fp8::kv_dequant` gives them, the bf16 cache they stand for.

use half::bf16;
use metrale_kernel_abi::attention::{
    PREFILL_SPLIT_THREADS, decode_shared_bytes, heads_per_block, padded_dim, prefill_rows_per_item,
    prefill_shared_bytes, prefill_split_shared_bytes, prompt_rows_per_item, prompt_shared_bytes,
};
use metrale_kernel_abi::{
    APR_D, APR_THREADS, APR_TILE, ATP_WARPS, ATT_MAX_D, ATT_MAX_ITEMS, ATT_SPLITS, ATT_UNIT,
    ATT_WARPS, PagedAttentionParams, PagedAttentionPrefillParams,
};

use super::cache::KvFormat;
use super::gemm::{stage_image_bytes, store_image_row};
use super::util::{b, f, sigmoid};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;
use crate::types::DevicePtr;

/// What `paged_attention` and `paged_attention_prefill` share: the operands and the shape.
#[derive(Debug, Clone, Copy)]
struct Shape {
    qkv: DevicePtr,
    k_cache: DevicePtr,
    v_cache: DevicePtr,
    block_tables: DevicePtr,
    row_seq: DevicePtr,
    positions: DevicePtr,
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
    kv_fp8: u32,
    k_scale: f32,
    v_scale: f32,
}

/// The [`Shape`] of a decode or prefill attention launch's parameters (the two kernels name
/// these fields alike).
macro_rules! shape_of {
    ($p:expr) => {
        Shape {
            qkv: $p.qkv,
            k_cache: $p.k_cache,
            v_cache: $p.v_cache,
            block_tables: $p.block_tables,
            row_seq: $p.row_seq,
            positions: $p.positions,
            rows: $p.rows as usize,
            row_stride: $p.row_stride as usize,
            q_head_stride: $p.q_head_stride as usize,
            hq: $p.num_q_heads as usize,
            hkv: $p.num_kv_heads as usize,
            d: $p.head_dim as usize,
            block_size: $p.block_size as usize,
            max_blocks: $p.max_blocks as usize,
            num_seqs: $p.num_seqs as usize,
            num_slots: $p.num_slots as usize,
            scale: $p.scale,
            gate: $p.gated != 0,
            kv_fp8: $p.kv_fp8,
            k_scale: $p.k_scale,
            v_scale: $p.v_scale,
        }
    };
}

impl Shape {
    fn decode(p: &PagedAttentionParams) -> Shape {
        shape_of!(p)
    }

    fn prefill(p: &PagedAttentionPrefillParams) -> Shape {
        shape_of!(p)
    }

    /// Query heads per item, as the CUDA kernels group them.
    fn heads_per_block(&self) -> usize {
        heads_per_block(self.hq as u32, self.hkv as u32) as usize
    }

    /// The launch the CUDA kernels run, as `att_launch_ok` checks it: heads that group, a head
    /// dimension up to `ATT_MAX_D`, blocks of `threads`, one grid row, clusters of `cluster`
    /// blocks taking at most `ATT_MAX_ITEMS` of `items` each, and `smem` bytes of dynamic
    /// shared memory.
    fn check_launch(
        &self,
        ctx: &KernelCtx<'_>,
        items: usize,
        (threads, cluster, smem): (u32, u32, u32),
    ) -> GpuResult<()> {
        if self.hkv == 0 || !self.hq.is_multiple_of(self.hkv) {
            return Err(ctx.fail(format!(
                "{} query heads do not group over {} kv heads",
                self.hq, self.hkv
            )));
        }
        if self.d == 0 || self.d > ATT_MAX_D as usize || self.block_size == 0 {
            return Err(ctx.fail(format!(
                "head_dim {} (1..={ATT_MAX_D}) or block_size {} the kernels do not take",
                self.d, self.block_size
            )));
        }
        let c = ctx.config();
        let clusters = (c.grid.0 / cluster) as usize;
        let per_cluster = if clusters == 0 {
            usize::MAX
        } else {
            items.div_ceil(clusters)
        };
        if c.block != (threads, 1, 1)
            || c.grid.1 != 1
            || !c.grid.0.is_multiple_of(cluster)
            || per_cluster > ATT_MAX_ITEMS as usize
            || c.shared_mem_bytes < smem
        {
            return Err(ctx.fail(format!(
                "launch {:?} x {:?} with {} bytes of shared memory for {items} items: the kernel \
                 takes blocks of {threads}, clusters of {cluster} of at most {ATT_MAX_ITEMS} items \
                 and {smem} bytes",
                c.grid, c.block, c.shared_mem_bytes
            )));
        }
        Ok(())
    }
}

/// Causal paged attention of decode and verify rows ([`PagedAttentionParams`]), through
/// clusters of `cluster` blocks each keeping `partials` combine buffers.
fn decode(ctx: &KernelCtx<'_>, cluster: u32, partials: u32) -> GpuResult<()> {
    let p: PagedAttentionParams = ctx.params()?;
    let s = Shape::decode(&p);
    let hb = s.heads_per_block();
    let smem = decode_shared_bytes(padded_dim(p.head_dim), hb as u32, partials);
    let items = s.rows * (s.hq / hb.max(1));
    s.check_launch(ctx, items, (32 * ATT_WARPS, cluster, smem))?;
    let rows: Vec<usize> = (0..s.rows).collect();
    attend(
        ctx,
        &s,
        (&rows, Softmax::Whole),
        ctx.slice_mut::<bf16>("out", p.out, s.rows * s.hq * s.d)?,
    )
}

/// `paged_attention` ([`PagedAttentionParams`]).
///
/// Query head `h` is read at `h * q_head_stride`; with `gated` = 1 its output gate follows it
/// (`[q | gate]`, `q_head_stride = 2 * head_dim`) and the output is multiplied by
/// `sigmoid(gate)`. Query head `h` reads key/value head `h / (num_q_heads / num_kv_heads)`.
pub fn paged_attention(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    decode(ctx, ATT_SPLITS, 2)
}

/// `paged_attention_flat` ([`PagedAttentionParams`]): `paged_attention`'s rows, bitwise (the
/// CUDA kernel computes each item in one block instead of a cluster; the arithmetic is the
/// same).
pub fn paged_attention_flat(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    decode(ctx, 1, ATT_SPLITS)
}

/// The prefill kernels' shape, launch check (clusters of `cluster` blocks: the walk's blocks at
/// 1, the split kernels' above) and rows.
fn prefill(
    ctx: &KernelCtx<'_>,
    cluster: u32,
) -> GpuResult<(PagedAttentionPrefillParams, Shape, Vec<usize>)> {
    let p: PagedAttentionPrefillParams = ctx.params()?;
    let s = Shape::prefill(&p);
    let items = p.n_groups as usize * (s.hq / s.heads_per_block().max(1));
    let padded = padded_dim(p.head_dim);
    let block = match cluster {
        1 => (32 * ATP_WARPS, prefill_shared_bytes(padded)),
        _ => (PREFILL_SPLIT_THREADS, prefill_split_shared_bytes(padded)),
    };
    s.check_launch(ctx, items, (block.0, cluster, block.1))?;
    let most = prefill_rows_per_item(s.heads_per_block() as u32, padded_dim(s.d as u32));
    let groups = (p.row_groups, p.n_groups as usize);
    let rows = group_rows(ctx, &s, groups, (most as usize, ATT_UNIT))?;
    Ok((p, s, rows))
}

/// `paged_attention_prefill` ([`PagedAttentionPrefillParams`]): `paged_attention` on the rows of
/// the row groups (first row, rows), bitwise the same per row. A group is 1 ..=
/// `rows_per_item` consecutive rows of one sequence whose positions lie in one 16-token unit
/// (the CUDA kernel computes a group's rows together); a malformed group fails. Rows of no group
/// are not written.
pub fn paged_attention_prefill(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    prefill_rows_out(ctx, 1)
}

/// `paged_attention_prefill`'s rows from launches of clusters of `cluster` blocks.
fn prefill_rows_out(ctx: &KernelCtx<'_>, cluster: u32) -> GpuResult<()> {
    let (p, s, rows) = prefill(ctx, cluster)?;
    attend(
        ctx,
        &s,
        (&rows, Softmax::Whole),
        ctx.slice_mut::<bf16>("out", p.out, s.rows * s.hq * s.d)?,
    )
}

/// `paged_attention_prefill_split` ([`PagedAttentionPrefillParams`]): `paged_attention_prefill`'s
/// rows, bitwise (the CUDA kernel spreads each item's splits over a cluster).
pub fn paged_attention_prefill_split(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    prefill_rows_out(ctx, ATT_SPLITS)
}

/// `paged_attention_prefill_split_staged` ([`PagedAttentionPrefillParams`]):
/// `paged_attention_prefill_staged`'s images, bitwise.
pub fn paged_attention_prefill_split_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    prefill_images(ctx, ATT_SPLITS)
}

/// `paged_attention_prefill_staged` ([`PagedAttentionPrefillParams`], `out` the stage images of
/// `[rows, num_q_heads * head_dim]`): the same rows written as the o projection's stage images
/// (`linear_tma`'s x), which `permute_k32_tiles` of the prefill kernel's output would give.
/// num_q_heads * head_dim must be a multiple of 64.
pub fn paged_attention_prefill_staged(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    prefill_images(ctx, 1)
}

/// `paged_attention_prefill_staged`'s images from launches of clusters of `cluster` blocks.
fn prefill_images(ctx: &KernelCtx<'_>, cluster: u32) -> GpuResult<()> {
    let (p, s, rows) = prefill(ctx, cluster)?;
    let width = s.hq * s.d;
    if !width.is_multiple_of(64) {
        return Err(ctx.fail(format!(
            "an output row of {width} is not whole 64-wide stages"
        )));
    }
    let mut out = vec![bf16::ZERO; s.rows * width];
    attend(ctx, &s, (&rows, Softmax::Whole), &mut out)?;
    let img = ctx.slice_mut::<bf16>("out", p.out, stage_image_bytes(s.rows, width) / 2)?;
    for &r in &rows {
        store_image_row(img, r, &out[r * width..(r + 1) * width]);
    }
    Ok(())
}

/// `paged_attention_prompt` ([`PagedAttentionPrefillParams`]): the rows of the row groups in the
/// prompt arithmetic ([`Softmax::Tiles`]), not `paged_attention`'s. The CUDA kernel takes head
/// dimension `APR_D` and bf16 pools only, an item a block of `APR_THREADS` threads, its row
/// groups within one `APR_TILE`-key tile of positions.
pub fn paged_attention_prompt(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: PagedAttentionPrefillParams = ctx.params()?;
    let s = Shape::prefill(&p);
    if s.d != APR_D as usize
        || s.kv_fp8 != 0
        || !s.row_stride.is_multiple_of(8)
        || !s.q_head_stride.is_multiple_of(8)
    {
        return Err(ctx.fail(format!(
            "head_dim {} with {} pools, rows of {} and query heads {} apart: the kernel takes \
             head_dim {APR_D}, bf16 pools and strides of whole 16-byte pieces",
            s.d,
            if s.kv_fp8 != 0 { "FP8" } else { "bf16" },
            s.row_stride,
            s.q_head_stride
        )));
    }
    let items = p.n_groups as usize * (s.hq / s.heads_per_block().max(1));
    s.check_launch(ctx, items, (APR_THREADS, 1, prompt_shared_bytes()))?;
    if (ctx.config().grid.0 as usize) < items {
        return Err(ctx.fail(format!(
            "{:?} blocks for {items} items: the kernel takes an item a block",
            ctx.config().grid
        )));
    }
    let most = prompt_rows_per_item(s.heads_per_block() as u32);
    let groups = (p.row_groups, p.n_groups as usize);
    let rows = group_rows(ctx, &s, groups, (most as usize, APR_TILE))?;
    attend(
        ctx,
        &s,
        (&rows, Softmax::Tiles),
        ctx.slice_mut::<bf16>("out", p.out, s.rows * s.hq * s.d)?,
    )
}

/// The rows of `n_groups` row groups at `groups` (the prefill and prompt kernels'), checked as
/// the CUDA kernels' items: 1 ..= `most` consecutive rows of one sequence whose positions lie in
/// one `span` of positions (a 16-token unit, or a prompt tile).
fn group_rows(
    ctx: &KernelCtx<'_>,
    s: &Shape,
    (groups, n_groups): (DevicePtr, usize),
    (most, span): (usize, u32),
) -> GpuResult<Vec<usize>> {
    let groups = ctx.slice::<u32>("row_groups", groups, 2 * n_groups)?;
    let row_seq = ctx.slice::<u32>("row_seq", s.row_seq, s.rows)?;
    let positions = ctx.slice::<u32>("positions", s.positions, s.rows)?;
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
        let at = positions[first] / span;
        if (first..first + count).any(|r| row_seq[r] != row_seq[first] || positions[r] / span != at)
        {
            return Err(ctx.fail(format!(
                "row group {i}: rows {first}..{} are not of one sequence and one {span}-token span",
                first + count
            )));
        }
        rows.extend(first..first + count);
    }
    Ok(rows)
}

/// How a row's softmax is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Softmax {
    /// Over all its keys at once (`paged_attention` and the prefill kernels, whose chains and
    /// splits the CUDA kernels fold into the same values).
    Whole,
    /// One online step a tile of `APR_TILE` keys from position 0 (`paged_attention_prompt`):
    /// the tile's maximum, the running outputs and sum corrected by 2^(m - m'), the
    /// probabilities 2^(x - m') of the scores in log2 units rounded to bf16, summed and
    /// multiplied by the values as rounded.
    Tiles,
}

/// Every head of each row in `rows`, written to its row of `out` (`[rows, num_q_heads *
/// head_dim]`), each row's softmax as `softmax` says.
fn attend(
    ctx: &KernelCtx<'_>,
    s: &Shape,
    (rows, softmax): (&[usize], Softmax),
    out: &mut [bf16],
) -> GpuResult<()> {
    let width = s.hkv * s.d;
    let qkv = ctx.slice::<bf16>("qkv", s.qkv, s.rows * s.row_stride)?;
    let format = KvFormat::new(ctx, s.kv_fp8, s.k_scale, s.v_scale)?;
    let pools = format.pools(ctx, (s.k_cache, s.v_cache), s.num_slots * width)?;
    let tables = ctx.slice::<u32>("block_tables", s.block_tables, s.num_seqs * s.max_blocks)?;
    let row_seq = ctx.slice::<u32>("row_seq", s.row_seq, s.rows)?;
    let positions = ctx.slice::<u32>("positions", s.positions, s.rows)?;
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
            for &slot in &slots {
                let k_at = slot * width + kv_at;
                let mut dot = 0.0f32;
                for (i, a) in q.iter().enumerate() {
                    dot += a * f(pools.key(k_at + i));
                }
                scores.push(dot);
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            let value = |slot: usize, i: usize| f(pools.value(slot * width + kv_at + i));
            let denom = match softmax {
                Softmax::Whole => {
                    let max = (scores.iter()).fold(f32::NEG_INFINITY, |m, &d| m.max(d * s.scale));
                    let mut denom = 0.0f32;
                    for (&d, &slot) in scores.iter().zip(&slots) {
                        let p = (d * s.scale - max).exp();
                        denom += p;
                        for (i, a) in acc.iter_mut().enumerate() {
                            *a += p * value(slot, i);
                        }
                    }
                    denom
                }
                Softmax::Tiles => {
                    let scale_log2 = s.scale * std::f32::consts::LOG2_E;
                    let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                    let tile = APR_TILE as usize;
                    for (dots, tile_slots) in scores.chunks(tile).zip(slots.chunks(tile)) {
                        let mx =
                            (dots.iter()).fold(f32::NEG_INFINITY, |m, &d| m.max(d * scale_log2));
                        let m_new = m.max(mx);
                        let corr = (m - m_new).exp2();
                        l *= corr;
                        acc.iter_mut().for_each(|a| *a *= corr);
                        for (&d, &slot) in dots.iter().zip(tile_slots) {
                            let p = f(b((d * scale_log2 - m_new).exp2()));
                            l += p;
                            for (i, a) in acc.iter_mut().enumerate() {
                                *a += p * value(slot, i);
                            }
                        }
                        m = m_new;
                    }
                    l
                }
            };
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
