//! CPU twin of `kernels/rope.cu`: per-head RMSNorm of q and k (optional) followed by rotary
//! embedding (rotate-half layout over the first `rotary_dim` dims), in place on the projection
//! output row. Cos and sin are multiplied by `attention_scaling` in f32 before the rotation, as
//! transformers multiplies its f32 tables (YaRN; 1 otherwise, which leaves them exact).
//!
//! Row layout: query head `h` starts at `h * q_head_stride` (`head_dim`, or `2 * head_dim` when a
//! gate follows each query head); key head `h` at `k_offset + h * head_dim`. Values are left alone.

use half::bf16;
use metrale_kernel_abi::{QkNormRopeKvStoreParams, QkNormRopeParams};

use super::util::{b, f, norm_weight, rms_scale};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// One head `x` of a row at position `pos`: normalised by `norm_w` (if any), then rotated over
/// its first `h.rd` dims by cos and sin times `h.scale`.
fn head(x: &mut [bf16], norm_w: Option<&[bf16]>, inv_freq: &[f32], pos: f32, h: &Heads) {
    let d = x.len();
    let mut v: Vec<f32> = x.iter().map(|&e| f(e)).collect();
    if let Some(w) = norm_w {
        let s = rms_scale(v.iter().copied(), d, h.eps);
        for (e, &wi) in v.iter_mut().zip(w) {
            *e = *e * s * norm_weight(wi, h.unit);
        }
    }
    let half = h.rd / 2;
    for i in 0..half {
        let angle = pos * inv_freq[i];
        let (sin, cos) = angle.sin_cos();
        let (sin, cos) = (sin * h.scale, cos * h.scale);
        let (x1, x2) = (v[i], v[i + half]);
        v[i] = x1 * cos - x2 * sin;
        v[i + half] = x2 * cos + x1 * sin;
    }
    for (o, e) in x.iter_mut().zip(v) {
        *o = b(e);
    }
}

/// Where the heads sit in a row, as both kernels of this family take it.
#[derive(Debug, Clone, Copy)]
struct Heads {
    rows: usize,
    stride: usize,
    hq: usize,
    q_stride: usize,
    k_off: usize,
    hkv: usize,
    d: usize,
    rd: usize,
    scale: f32,
    eps: f32,
    unit: bool,
}

impl Heads {
    /// The launch's geometry and the heads' fit in a row, as the CUDA kernels check them: blocks
    /// of whole warps, no more blocks of rows than rows, even `rotary_dim` up to `head_dim`, and
    /// every head inside the row.
    fn check(&self, ctx: &KernelCtx<'_>) -> GpuResult<()> {
        let c = ctx.config();
        if !c.block.0.is_multiple_of(32) || (self.rows > 0 && c.grid.0 as usize > self.rows) {
            return Err(ctx.fail(format!(
                "launched as {:?} blocks of {:?} threads: the kernel takes whole warps and a block \
                 of rows per row",
                c.grid, c.block
            )));
        }
        let Heads {
            stride,
            hq,
            q_stride,
            k_off,
            hkv,
            d,
            rd,
            ..
        } = *self;
        if rd > d || !rd.is_multiple_of(2) {
            return Err(ctx.fail(format!(
                "rotary_dim {rd} must be even and at most head_dim {d}"
            )));
        }
        if (hq > 0 && (hq - 1) * q_stride + d > stride) || k_off + hkv * d > stride {
            return Err(ctx.fail(format!("heads do not fit a row of {stride} elements")));
        }
        Ok(())
    }
}

/// Normalise and rotate every q and k head of every row, in place.
fn rope_rows(
    qkv: &mut [bf16],
    (qw, kw): (Option<&[bf16]>, Option<&[bf16]>),
    inv_freq: &[f32],
    positions: &[u32],
    h: Heads,
) {
    for r in 0..h.rows {
        let row = &mut qkv[r * h.stride..(r + 1) * h.stride];
        let pos = positions[r] as f32;
        for i in 0..h.hq {
            let s = i * h.q_stride;
            head(&mut row[s..s + h.d], qw, inv_freq, pos, &h);
        }
        for i in 0..h.hkv {
            let s = h.k_off + i * h.d;
            head(&mut row[s..s + h.d], kw, inv_freq, pos, &h);
        }
    }
}

/// The [`Heads`] of a rope launch's parameters (both rope kernels name these fields alike).
macro_rules! heads_of {
    ($p:expr) => {
        Heads {
            rows: $p.rows as usize,
            stride: $p.row_stride as usize,
            hq: $p.num_q_heads as usize,
            q_stride: $p.q_head_stride as usize,
            k_off: $p.k_offset as usize,
            hkv: $p.num_kv_heads as usize,
            d: $p.head_dim as usize,
            rd: $p.rotary_dim as usize,
            scale: $p.attention_scaling,
            eps: $p.eps,
            unit: $p.unit_offset != 0,
        }
    };
}

/// `qk_norm_rope` ([`QkNormRopeParams`]): every q and k head of every row normalised (where a
/// norm weight is given) and rotated, in place.
pub fn qk_norm_rope(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: QkNormRopeParams = ctx.params()?;
    let h = heads_of!(p);
    h.check(ctx)?;
    let qkv = ctx.slice_mut::<bf16>("qkv", p.qkv, h.rows * h.stride)?;
    let norms = (
        ctx.slice_opt::<bf16>("q_norm_w", p.q_norm_w, h.d)?,
        ctx.slice_opt::<bf16>("k_norm_w", p.k_norm_w, h.d)?,
    );
    let inv_freq = ctx.slice::<f32>("inv_freq", p.inv_freq, h.rd / 2)?;
    let positions = ctx.slice::<u32>("positions", p.positions, h.rows)?;
    rope_rows(qkv, norms, inv_freq, positions, h);
    Ok(())
}

/// `qk_norm_rope_kv_store` ([`QkNormRopeKvStoreParams`]): `qk_norm_rope` then `kv_store` in one
/// launch, byte for byte what the two launches leave (the row keeps its rotated q and k; the
/// cache gets the rotated k and the untouched v).
pub fn qk_norm_rope_kv_store(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: QkNormRopeKvStoreParams = ctx.params()?;
    let h = heads_of!(p);
    h.check(ctx)?;
    let (v_off, slots) = (p.v_offset as usize, p.num_slots as usize);
    let width = h.hkv * h.d;
    if v_off + width > h.stride {
        return Err(ctx.fail(format!(
            "v ({v_off} + {width}) does not fit a row of {}",
            h.stride
        )));
    }
    let qkv = ctx.slice_mut::<bf16>("qkv", p.qkv, h.rows * h.stride)?;
    let norms = (
        ctx.slice_opt::<bf16>("q_norm_w", p.q_norm_w, h.d)?,
        ctx.slice_opt::<bf16>("k_norm_w", p.k_norm_w, h.d)?,
    );
    let inv_freq = ctx.slice::<f32>("inv_freq", p.inv_freq, h.rd / 2)?;
    let positions = ctx.slice::<u32>("positions", p.positions, h.rows)?;
    let format = super::cache::KvFormat::new(ctx, p.kv_fp8, p.k_scale, p.v_scale)?;
    let mut pools = format.pools_mut(ctx, (p.k_cache, p.v_cache), slots * width)?;
    let slot_mapping = ctx.slice::<u32>("slot_mapping", p.slot_mapping, h.rows)?;
    rope_rows(qkv, norms, inv_freq, positions, h);
    let store = super::cache::StoreGeometry {
        stride: h.stride,
        k_off: h.k_off,
        v_off,
        width,
        slots,
    };
    super::cache::store_rows(ctx, &mut pools, qkv, slot_mapping, store)
}
