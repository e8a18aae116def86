//! CPU twins of `kernels/gemm.cu`: `out = x · wᵀ` with a bf16 weight in the checkpoint's
//! `[out_features, in_features]` layout, accumulated in f32 over `k` in index order, so every
//! output element is computed the same way whatever `m` is.

use half::bf16;

use super::util::{b, f};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `x · wᵀ` in f32, `[m, n]` row-major, for x given (rows of `k`) and the weight at argument
/// `w_arg`.
fn gemm_of(
    ctx: &KernelCtx<'_>,
    x: &[bf16],
    w_arg: usize,
    (m, n, k): (usize, usize, usize),
) -> GpuResult<Vec<f32>> {
    let w = ctx.slice::<bf16>(w_arg, n * k)?;
    let wf: Vec<f32> = w.iter().map(|&e| f(e)).collect();
    let mut xr = vec![0.0f32; k];
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for (dst, &src) in xr.iter_mut().zip(&x[i * k..(i + 1) * k]) {
            *dst = f(src);
        }
        for j in 0..n {
            let mut acc = 0.0f32;
            for (a, c) in xr.iter().zip(&wf[j * k..(j + 1) * k]) {
                acc += a * c;
            }
            out.push(acc);
        }
    }
    Ok(out)
}

/// `x · wᵀ` (the weight at argument `w_arg`) into argument 0: bf16, or f32 (`f32_out`: the LM
/// head's logits).
fn store_gemm(
    ctx: &KernelCtx<'_>,
    x: &[bf16],
    w_arg: usize,
    dims: (usize, usize, usize),
    f32_out: bool,
) -> GpuResult<()> {
    let acc = gemm_of(ctx, x, w_arg, dims)?;
    if f32_out {
        ctx.slice_mut::<f32>(0, acc.len())?.copy_from_slice(&acc);
    } else {
        for (o, &v) in ctx.slice_mut::<bf16>(0, acc.len())?.iter_mut().zip(&acc) {
            *o = b(v);
        }
    }
    Ok(())
}

/// `linear` and `linear_f32out`: x at argument 1, then w, m, n, k.
fn linear_any(ctx: &KernelCtx<'_>, f32_out: bool) -> GpuResult<()> {
    ctx.expect_args(6)?;
    let (m, n, k) = (ctx.usize(3)?, ctx.usize(4)?, ctx.usize(5)?);
    store_gemm(ctx, ctx.slice::<bf16>(1, m * k)?, 2, (m, n, k), f32_out)
}

/// `linear(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k)`.
pub fn linear(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, false)
}

/// `linear_f32out(out: f32 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k)`: the LM head,
/// whose logits stay f32.
pub fn linear_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, true)
}

/// `linear_swiglu(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [2 n, k], m, n, k)`: `linear` into
/// `[gate | up]` rows of `2 n` (rounded to bf16 as `linear` writes them), then `silu_mul`'s
/// twin, in one launch.
pub fn linear_swiglu(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(6)?;
    let (m, n, k) = (ctx.usize(3)?, ctx.usize(4)?, ctx.usize(5)?);
    let x = ctx.slice::<bf16>(1, m * k)?;
    let gate_up: Vec<bf16> = gemm_of(ctx, x, 2, (m, 2 * n, k))?
        .into_iter()
        .map(b)
        .collect();
    let act = super::activation::silu_mul_rows(&gate_up, m, n);
    ctx.slice_mut::<bf16>(0, m * n)?.copy_from_slice(&act);
    Ok(())
}

/// Bytes of `permute_k32_tiles`'s stage images of an `[m, k]` matrix: per 128-row tile, one
/// 16 KiB image per stage of 64 k (the rows and k past the ends zero).
pub fn stage_image_bytes(m: usize, k: usize) -> usize {
    m.div_ceil(128) * k.div_ceil(64) * 16384
}

/// Byte offset in the stage images of 16-byte unit `t` (`k32_pairs` order) of chunk `c` (32 k)
/// of row `row`, `steps` stages of 64 k per row tile: kernels/gemm.cu's `img_offset`.
fn image_offset(row: usize, c: usize, t: usize, steps: usize) -> usize {
    let (r, cc) = (row % 128, c % 2);
    ((row / 128) * steps + c / 2) * 16384 + r * 128 + (((cc * 4 + t) ^ (r % 8)) << 4)
}

/// Row `row` of an `[m, k]` bf16 matrix (`values`, k of them) into its stage images `img`
/// (halfwords): what the `_staged` producers write.
pub(crate) fn store_image_row(img: &mut [bf16], row: usize, values: &[bf16]) {
    let steps = values.len().div_ceil(64);
    for (col, &v) in values.iter().enumerate() {
        let byte = pair_offset(row, col / 32, (col % 32) / 2, steps) + (col % 2) * 2;
        img[byte / 2] = v;
    }
}

/// The 4-byte pair `p` (k 2p, 2p + 1) of a 32-k chunk sits in unit p % 4 at position p / 4.
fn pair_offset(row: usize, c: usize, p: usize, steps: usize) -> usize {
    image_offset(row, c, p % 4, steps) + (p / 4) * 4
}

/// `permute_k32_tiles(out: image, x: bf16 [m, k], m, k)`: x as `linear_tma`'s stage images
/// (layout at kernels/gemm.cu).
pub fn permute_k32_tiles(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(4)?;
    let (m, k) = (ctx.usize(2)?, ctx.usize(3)?);
    if k % 8 != 0 {
        return Err(ctx.fail(format!("k = {k} is not a multiple of 8")));
    }
    let x = ctx.slice::<u32>(1, m * k / 2)?;
    let img = ctx.slice_mut::<u32>(0, stage_image_bytes(m, k) / 4)?;
    img.fill(0);
    let steps = k.div_ceil(64);
    for row in 0..m {
        for pair in 0..k / 2 {
            let (c, p) = (pair / 16, pair % 16);
            img[pair_offset(row, c, p, steps) / 4] = x[row * k / 2 + pair];
        }
    }
    Ok(())
}

/// x back from the stage images of an `[m, k]` matrix at argument `index`.
fn x_from_images(ctx: &KernelCtx<'_>, index: usize, m: usize, k: usize) -> GpuResult<Vec<bf16>> {
    let img = ctx.slice::<u32>(index, stage_image_bytes(m, k) / 4)?;
    let steps = k.div_ceil(64);
    let mut x = vec![bf16::ZERO; m * k];
    for row in 0..m {
        for pair in 0..k / 2 {
            let v = img[pair_offset(row, pair / 16, pair % 16, steps) / 4];
            x[row * k + 2 * pair] = bf16::from_bits(v as u16);
            x[row * k + 2 * pair + 1] = bf16::from_bits((v >> 16) as u16);
        }
    }
    Ok(x)
}

/// `linear_tma` and `linear_tma_f32out`: x from its stage images at argument 1, then w, the
/// tensor map (the device's, not read here), m, n, k.
fn linear_tma_any(ctx: &KernelCtx<'_>, f32_out: bool) -> GpuResult<()> {
    ctx.expect_args(7)?;
    let (m, n, k) = (ctx.usize(4)?, ctx.usize(5)?, ctx.usize(6)?);
    store_gemm(ctx, &x_from_images(ctx, 1, m, k)?, 2, (m, n, k), f32_out)
}

/// `linear_tma(out: bf16 [m, n], xt: stage images of x, w: bf16 [n, k], wmap, m, n, k)`:
/// `linear` with x from `permute_k32_tiles`.
pub fn linear_tma(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_tma_any(ctx, false)
}

/// `linear_tma_f32out(out: f32 [m, n], xt, w, wmap, m, n, k)`: likewise, f32 out.
pub fn linear_tma_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_tma_any(ctx, true)
}

/// `linear_stream_tma` and `linear_stream_tma_f32out`: x's rows at argument 1, or, where
/// argument 2 is not NULL, x from its stage images there (what the device reads when the shape
/// lets it: the producer wrote both, so checking the images here checks what the H200 reads);
/// then w, the tensor map (the device's, not read here), m, n, k.
fn linear_stream_tma_any(ctx: &KernelCtx<'_>, f32_out: bool) -> GpuResult<()> {
    ctx.expect_args(8)?;
    let (m, n, k) = (ctx.usize(5)?, ctx.usize(6)?, ctx.usize(7)?);
    if ctx.ptr(2)?.is_null() {
        store_gemm(ctx, ctx.slice::<bf16>(1, m * k)?, 3, (m, n, k), f32_out)
    } else {
        store_gemm(ctx, &x_from_images(ctx, 2, m, k)?, 3, (m, n, k), f32_out)
    }
}

/// `linear_stream_tma(out: bf16 [m, n], x: bf16 [m, k], ximg: x's stage images or NULL, w:
/// bf16 [n, k], wmap, m, n, k)`: `linear`, the weight read on the device through its tensor map.
pub fn linear_stream_tma(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_stream_tma_any(ctx, false)
}

/// `linear_stream_tma_f32out(out: f32 [m, n], x, ximg, w, wmap, m, n, k)`: likewise, f32 out.
pub fn linear_stream_tma_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_stream_tma_any(ctx, true)
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "gemm",
    kernels: &[
        ("linear", linear),
        ("linear_f32out", linear_f32out),
        // The decode kernels of `kernels/gemm.cu` compute the same functions.
        ("linear_stream", linear),
        ("linear_stream_f32out", linear_f32out),
        ("linear_stream_b4", linear),
        ("linear_stream_b4_f32out", linear_f32out),
        ("linear_swiglu", linear_swiglu),
        ("linear_stream_wide", linear),
        ("linear_stream_wide_f32out", linear_f32out),
        ("permute_k32_tiles", permute_k32_tiles),
        ("linear_tma", linear_tma),
        ("linear_tma_f32out", linear_tma_f32out),
        ("linear_stream_tma", linear_stream_tma),
        ("linear_stream_tma_f32out", linear_stream_tma_f32out),
    ],
};
