//! CPU twin of `kernels/rope.cu`: per-head RMSNorm of q and k (optional) followed by rotary
//! embedding (rotate-half layout over the first `rotary_dim` dims), in place on the projection
//! output row.
//!
//! Row layout: query head `h` starts at `h * q_head_stride` (`head_dim`, or `2 * head_dim` when a
//! gate follows each query head); key head `h` at `k_offset + h * head_dim`. Values are left alone.

use half::bf16;

use super::util::{b, f, norm_weight, rms_scale};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

#[allow(clippy::too_many_arguments)]
fn head(
    x: &mut [bf16],
    norm_w: Option<&[bf16]>,
    inv_freq: &[f32],
    pos: f32,
    rotary_dim: usize,
    eps: f32,
    unit: bool,
) {
    let d = x.len();
    let mut v: Vec<f32> = x.iter().map(|&e| f(e)).collect();
    if let Some(w) = norm_w {
        let s = rms_scale(v.iter().copied(), d, eps);
        for (e, &wi) in v.iter_mut().zip(w) {
            *e = *e * s * norm_weight(wi, unit);
        }
    }
    let half = rotary_dim / 2;
    for i in 0..half {
        let angle = pos * inv_freq[i];
        let (sin, cos) = angle.sin_cos();
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
    eps: f32,
    unit: bool,
}

impl Heads {
    fn check(&self, ctx: &KernelCtx<'_>) -> GpuResult<()> {
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

/// The optional norm weight at argument `index`.
fn norm_arg<'a>(ctx: &'a KernelCtx<'_>, index: usize, d: usize) -> GpuResult<Option<&'a [bf16]>> {
    Ok(if ctx.ptr(index)?.is_null() {
        None
    } else {
        Some(ctx.slice::<bf16>(index, d)?)
    })
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
            head(&mut row[s..s + h.d], qw, inv_freq, pos, h.rd, h.eps, h.unit);
        }
        for i in 0..h.hkv {
            let s = h.k_off + i * h.d;
            head(&mut row[s..s + h.d], kw, inv_freq, pos, h.rd, h.eps, h.unit);
        }
    }
}

/// `qk_norm_rope(qkv: bf16 [rows, row_stride] (in/out), q_norm_w: bf16 [head_dim] or NULL,
/// k_norm_w: bf16 [head_dim] or NULL, inv_freq: f32 [rotary_dim / 2], positions: u32 [rows],
/// rows, row_stride, num_q_heads, q_head_stride, k_offset, num_kv_heads, head_dim, rotary_dim,
/// eps, unit_offset)`.
pub fn qk_norm_rope(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(15)?;
    let h = Heads {
        rows: ctx.usize(5)?,
        stride: ctx.usize(6)?,
        hq: ctx.usize(7)?,
        q_stride: ctx.usize(8)?,
        k_off: ctx.usize(9)?,
        hkv: ctx.usize(10)?,
        d: ctx.usize(11)?,
        rd: ctx.usize(12)?,
        eps: ctx.f32(13)?,
        unit: ctx.u32(14)? != 0,
    };
    h.check(ctx)?;
    let qkv = ctx.slice_mut::<bf16>(0, h.rows * h.stride)?;
    let norms = (norm_arg(ctx, 1, h.d)?, norm_arg(ctx, 2, h.d)?);
    let inv_freq = ctx.slice::<f32>(3, h.rd / 2)?;
    let positions = ctx.slice::<u32>(4, h.rows)?;
    rope_rows(qkv, norms, inv_freq, positions, h);
    Ok(())
}

/// `qk_norm_rope_kv_store(qkv: bf16 [rows, row_stride] (in/out), q_norm_w, k_norm_w: bf16
/// [head_dim] or NULL, inv_freq: f32 [rotary_dim / 2], positions: u32 [rows], k_cache, v_cache:
/// bf16 [num_slots, num_kv_heads, head_dim], slot_mapping: u32 [rows], rows, row_stride,
/// num_q_heads, q_head_stride, k_offset, v_offset, num_kv_heads, head_dim, rotary_dim, eps,
/// unit_offset, num_slots)`: `qk_norm_rope` then `kv_store` in one launch, byte for byte what
/// the two launches leave (the row keeps its rotated q and k; the cache gets the rotated k and
/// the untouched v).
pub fn qk_norm_rope_kv_store(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(20)?;
    let h = Heads {
        rows: ctx.usize(8)?,
        stride: ctx.usize(9)?,
        hq: ctx.usize(10)?,
        q_stride: ctx.usize(11)?,
        k_off: ctx.usize(12)?,
        hkv: ctx.usize(14)?,
        d: ctx.usize(15)?,
        rd: ctx.usize(16)?,
        eps: ctx.f32(17)?,
        unit: ctx.u32(18)? != 0,
    };
    h.check(ctx)?;
    let (v_off, slots) = (ctx.usize(13)?, ctx.usize(19)?);
    let width = h.hkv * h.d;
    if v_off + width > h.stride {
        return Err(ctx.fail(format!(
            "v ({v_off} + {width}) does not fit a row of {}",
            h.stride
        )));
    }
    let qkv = ctx.slice_mut::<bf16>(0, h.rows * h.stride)?;
    let norms = (norm_arg(ctx, 1, h.d)?, norm_arg(ctx, 2, h.d)?);
    let inv_freq = ctx.slice::<f32>(3, h.rd / 2)?;
    let positions = ctx.slice::<u32>(4, h.rows)?;
    let k_cache = ctx.slice_mut::<bf16>(5, slots * width)?;
    let v_cache = ctx.slice_mut::<bf16>(6, slots * width)?;
    let slot_mapping = ctx.slice::<u32>(7, h.rows)?;
    rope_rows(qkv, norms, inv_freq, positions, h);
    let store = super::cache::StoreGeometry {
        stride: h.stride,
        k_off: h.k_off,
        v_off,
        width,
        slots,
    };
    super::cache::store_rows(ctx, (k_cache, v_cache), qkv, slot_mapping, store)
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "rope",
    kernels: &[
        ("qk_norm_rope", qk_norm_rope),
        ("qk_norm_rope_kv_store", qk_norm_rope_kv_store),
    ],
};
