//! CPU twins of `kernels/gemm.cu`: `out = x · wᵀ` with a bf16 weight in the checkpoint's
//! `[out_features, in_features]` layout, accumulated in f32 over `k` in index order, so every
//! output element is computed the same way whatever `m` is. A block-FP8 weight is dequantized
//! first (`crate::fp8`), so its rows are `linear`'s of the dequantized weight, as on the device.

use half::bf16;
use metrale_kernel_abi::{
    DequantFp8Params, FP8_BLOCK, FP8_CONVERT_THREADS, LIN_DEC_THREADS, LIN_STREAM_WARPS,
    LIN_THREADS, LIN_TMA_THREADS, LinearFp8Params, LinearParams, LinearStreamTmaFp8Params,
    LinearStreamTmaParams, LinearTmaFp8Params, LinearTmaParams, LinearTmaSwigluFp8Params,
    LinearTmaSwigluParams, PermuteK32TilesParams, QuantizeFp8Params,
};

use super::util::{b, f};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;
use crate::fp8;
use crate::types::DevicePtr;

/// `x · wᵀ` in f32, `[m, n]` row-major, for x given (rows of `k`) and the weight at `w`.
fn gemm_of(
    ctx: &KernelCtx<'_>,
    x: &[bf16],
    w: DevicePtr,
    dims: (usize, usize, usize),
) -> GpuResult<Vec<f32>> {
    let (_, n, k) = dims;
    Ok(gemm_host(x, ctx.slice::<bf16>("w", w, n * k)?, dims))
}

/// `x · wᵀ` in f32 of host rows: the one arithmetic of every `linear` twin.
fn gemm_host(x: &[bf16], w: &[bf16], (m, n, k): (usize, usize, usize)) -> Vec<f32> {
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
    out
}

/// f32 rows into bf16 `out`, rounded to nearest even.
fn store_bf16(ctx: &KernelCtx<'_>, out: DevicePtr, acc: &[f32]) -> GpuResult<()> {
    for (o, &v) in ctx
        .slice_mut::<bf16>("out", out, acc.len())?
        .iter_mut()
        .zip(acc)
    {
        *o = b(v);
    }
    Ok(())
}

/// `x · wᵀ` into `out`: bf16, or f32 (`f32_out`: the LM head's logits).
fn store_gemm(
    ctx: &KernelCtx<'_>,
    (out, x, w): (DevicePtr, &[bf16], DevicePtr),
    dims: (usize, usize, usize),
    f32_out: bool,
) -> GpuResult<()> {
    let acc = gemm_of(ctx, x, w, dims)?;
    if f32_out {
        ctx.slice_mut::<f32>("out", out, acc.len())?
            .copy_from_slice(&acc);
        Ok(())
    } else {
        store_bf16(ctx, out, &acc)
    }
}

/// The shape `(m, n, k)`, after checking the block size the CUDA kernel is written for
/// (`threads`; a launch of no rows or no columns does nothing, whatever its geometry).
fn dims(
    ctx: &KernelCtx<'_>,
    (m, n, k): (u32, u32, u32),
    threads: u32,
) -> GpuResult<(usize, usize, usize)> {
    if m > 0 && n > 0 {
        ctx.require_block(threads)?;
    }
    Ok((m as usize, n as usize, k as usize))
}

/// `linear` and its direct-load variants ([`LinearParams`]) on blocks of `threads`.
fn linear_any(ctx: &KernelCtx<'_>, f32_out: bool, threads: u32) -> GpuResult<()> {
    let p: LinearParams = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), threads)?;
    let x = ctx.slice::<bf16>("x", p.x, m * k)?;
    store_gemm(ctx, (p.out, x, p.w), (m, n, k), f32_out)
}

/// `linear`: `out[m, n] = x[m, k] · w[n, k]ᵀ`, bf16 out; the tiled prefill kernel's blocks of
/// `LIN_THREADS`.
pub fn linear(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, false, LIN_THREADS)
}

/// `linear_f32out`: `linear` with f32 out (the LM head, whose logits stay f32).
pub fn linear_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, true, LIN_THREADS)
}

/// `linear_stream`: `linear` from the narrow decode kernel's blocks.
pub fn linear_stream(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, false, LIN_STREAM_WARPS * 32)
}

/// `linear_stream_f32out`: `linear_f32out` from the narrow decode kernel's blocks.
pub fn linear_stream_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, true, LIN_STREAM_WARPS * 32)
}

/// `linear_stream_b4`: `linear` from the narrow decode kernel of smaller batches.
pub fn linear_stream_b4(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, false, LIN_STREAM_WARPS * 32)
}

/// `linear_stream_b4_f32out`: likewise, f32 out.
pub fn linear_stream_b4_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, true, LIN_STREAM_WARPS * 32)
}

/// `linear_stream_wide`: `linear` from the wide decode kernel's clusters.
pub fn linear_stream_wide(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, false, LIN_STREAM_WARPS * 32)
}

/// `linear_stream_wide_f32out`: likewise, f32 out.
pub fn linear_stream_wide_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_any(ctx, true, LIN_STREAM_WARPS * 32)
}

/// `linear_swiglu` ([`LinearParams`], w `[2 n, k]`): `linear` into `[gate | up]` rows of `2 n`
/// (rounded to bf16 as `linear` writes them), then `silu_mul`'s twin, in one launch.
pub fn linear_swiglu(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: LinearParams = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_STREAM_WARPS * 32)?;
    let x = ctx.slice::<bf16>("x", p.x, m * k)?;
    let gate_up: Vec<bf16> = gemm_of(ctx, x, p.w, (m, 2 * n, k))?
        .into_iter()
        .map(b)
        .collect();
    let act = super::activation::silu_mul_rows(&gate_up, m, n);
    ctx.slice_mut::<bf16>("out", p.out, m * n)?
        .copy_from_slice(&act);
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

/// `permute_k32_tiles` ([`PermuteK32TilesParams`]): x as `linear_tma`'s stage images (layout at
/// kernels/gemm.cu).
pub fn permute_k32_tiles(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: PermuteK32TilesParams = ctx.params()?;
    let (m, k) = (p.m as usize, p.k as usize);
    if k % 8 != 0 {
        return Err(ctx.fail(format!("k = {k} is not a multiple of 8")));
    }
    let x = ctx.slice::<u32>("x", p.x, m * k / 2)?;
    let img = ctx.slice_mut::<u32>("out", p.out, stage_image_bytes(m, k) / 4)?;
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

/// x back from the stage images `img` of an `[m, k]` matrix.
fn x_from_images(ctx: &KernelCtx<'_>, img: DevicePtr, m: usize, k: usize) -> GpuResult<Vec<bf16>> {
    let img = ctx.slice::<u32>("images", img, stage_image_bytes(m, k) / 4)?;
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

/// `linear_tma` and `linear_tma_f32out` ([`LinearTmaParams`]): x from its stage images (the
/// tensor map is the device's, not read here).
fn linear_tma_any(ctx: &KernelCtx<'_>, f32_out: bool) -> GpuResult<()> {
    let p: LinearTmaParams = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_TMA_THREADS)?;
    let x = x_from_images(ctx, p.xt, m, k)?;
    store_gemm(ctx, (p.out, &x, p.w), (m, n, k), f32_out)
}

/// `linear_tma`: `linear` with x from `permute_k32_tiles`.
pub fn linear_tma(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_tma_any(ctx, false)
}

/// `linear_tma_f32out`: likewise, f32 out.
pub fn linear_tma_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_tma_any(ctx, true)
}

/// `linear_stream_tma` and `linear_stream_tma_f32out` ([`LinearStreamTmaParams`]): x's rows, or,
/// where `ximg` is not null, x from its stage images there (what the device reads when the shape
/// lets it: the producer wrote both, so checking the images here checks what the device reads);
/// the tensor map is the device's, not read here.
fn linear_stream_tma_any(ctx: &KernelCtx<'_>, f32_out: bool) -> GpuResult<()> {
    let p: LinearStreamTmaParams = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_DEC_THREADS)?;
    if p.ximg.is_null() {
        let x = ctx.slice::<bf16>("x", p.x, m * k)?;
        store_gemm(ctx, (p.out, x, p.w), (m, n, k), f32_out)
    } else {
        let x = x_from_images(ctx, p.ximg, m, k)?;
        store_gemm(ctx, (p.out, &x, p.w), (m, n, k), f32_out)
    }
}

/// `linear_stream_tma`: `linear`, the weight read on the device through its tensor map.
pub fn linear_stream_tma(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_stream_tma_any(ctx, false)
}

/// `linear_stream_tma_f32out`: likewise, f32 out.
pub fn linear_stream_tma_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_stream_tma_any(ctx, true)
}

/// The bytes and scale grid of an fp8 `[n, k]` weight whose scale rows each cover
/// `2^scale_row_shift` weight rows, dequantized.
pub(super) fn fp8_weight(
    ctx: &KernelCtx<'_>,
    (w, scales): (DevicePtr, DevicePtr),
    (n, k): (usize, usize),
    scale_row_shift: u32,
) -> GpuResult<Vec<bf16>> {
    let q = ctx.slice::<u8>("w", w, n * k)?;
    let rows = if n == 0 {
        0
    } else {
        ((n - 1) >> scale_row_shift) + 1
    };
    let s = ctx.slice::<f32>("scales", scales, rows * fp8::scale_cols(k))?;
    Ok(fp8::dequant(q, s, (n, k), scale_row_shift))
}

/// `linear_stream_fp8` ([`LinearFp8Params`]): `linear` of the dequantized weight, bf16 out.
pub fn linear_stream_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: LinearFp8Params = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_STREAM_WARPS * 32)?;
    let x = ctx.slice::<bf16>("x", p.x, m * k)?;
    let w = fp8_weight(ctx, (p.w, p.scales), (n, k), p.scale_row_shift)?;
    store_bf16(ctx, p.out, &gemm_host(x, &w, (m, n, k)))
}

/// `linear_stream_wide_fp8`: the same function from the wide decode kernel's clusters.
pub fn linear_stream_wide_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    linear_stream_fp8(ctx)
}

/// `linear_tma_fp8` ([`LinearTmaFp8Params`]): `linear` of the dequantized weight with x from its
/// stage images (the tensor map is the device's, not read here), bf16 out.
pub fn linear_tma_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: LinearTmaFp8Params = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_TMA_THREADS)?;
    let x = x_from_images(ctx, p.xt, m, k)?;
    let w = fp8_weight(ctx, (p.w, p.scales), (n, k), p.scale_row_shift)?;
    store_bf16(ctx, p.out, &gemm_host(&x, &w, (m, n, k)))
}

/// The SwiGLU of x (`[m, k]`) by the `[2 n, k]` gate/up weight `w` (f32 sums rounded to bf16 as
/// `linear` stores them, then `silu_mul`'s twin) into the stage images at `img`: the rows
/// `linear_tma_swiglu` writes (image rows past `m` left as they were).
fn swiglu_images(
    ctx: &KernelCtx<'_>,
    img: DevicePtr,
    (x, w): (&[bf16], &[bf16]),
    (m, n, k): (usize, usize, usize),
) -> GpuResult<()> {
    if n % 64 != 0 {
        return Err(ctx.fail(format!("n = {n} is not a multiple of 64")));
    }
    let gate_up: Vec<bf16> = gemm_host(x, w, (m, 2 * n, k)).into_iter().map(b).collect();
    let act = super::activation::silu_mul_rows(&gate_up, m, n);
    let img = ctx.slice_mut::<bf16>("img", img, stage_image_bytes(m, n) / 2)?;
    for (r, row) in act.chunks(n.max(1)).enumerate() {
        store_image_row(img, r, row);
    }
    Ok(())
}

/// `linear_tma_swiglu` ([`LinearTmaSwigluParams`]): `linear_tma` of x's stage images by the
/// `[2 n, k]` gate/up weight, then `silu_mul_staged` (images only), in one launch (the tensor
/// map is the device's, not read here).
pub fn linear_tma_swiglu(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: LinearTmaSwigluParams = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_TMA_THREADS)?;
    let x = x_from_images(ctx, p.xt, m, k)?;
    let w = ctx.slice::<bf16>("w", p.w, 2 * n * k)?;
    swiglu_images(ctx, p.img, (&x, w), (m, n, k))
}

/// `linear_tma_swiglu_fp8` ([`LinearTmaSwigluFp8Params`]): `linear_tma_swiglu` of the dequantized
/// weight.
pub fn linear_tma_swiglu_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: LinearTmaSwigluFp8Params = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_TMA_THREADS)?;
    let x = x_from_images(ctx, p.xt, m, k)?;
    let w = fp8_weight(ctx, (p.w, p.scales), (2 * n, k), p.scale_row_shift)?;
    swiglu_images(ctx, p.img, (&x, &w), (m, n, k))
}

/// `linear_stream_tma_fp8` ([`LinearStreamTmaFp8Params`]): `linear` of the dequantized weight,
/// x from its rows or its stage images as `linear_stream_tma` reads them, bf16 out.
pub fn linear_stream_tma_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: LinearStreamTmaFp8Params = ctx.params()?;
    let (m, n, k) = dims(ctx, (p.m, p.n, p.k), LIN_DEC_THREADS)?;
    let w = fp8_weight(ctx, (p.w, p.scales), (n, k), p.scale_row_shift)?;
    let acc = if p.ximg.is_null() {
        gemm_host(ctx.slice::<bf16>("x", p.x, m * k)?, &w, (m, n, k))
    } else {
        gemm_host(&x_from_images(ctx, p.ximg, m, k)?, &w, (m, n, k))
    };
    store_bf16(ctx, p.out, &acc)
}

/// `dequant_fp8` ([`DequantFp8Params`]): the weight as bf16.
pub fn dequant_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: DequantFp8Params = ctx.params()?;
    let (n, k) = (p.n as usize, p.k as usize);
    ctx.require_block(FP8_CONVERT_THREADS)?;
    let w = fp8_weight(ctx, (p.w, p.scales), (n, k), p.scale_row_shift)?;
    ctx.slice_mut::<bf16>("out", p.out, n * k)?
        .copy_from_slice(&w);
    Ok(())
}

/// `quantize_fp8` ([`QuantizeFp8Params`]): the block recipe (`crate::fp8::quantize`).
pub fn quantize_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: QuantizeFp8Params = ctx.params()?;
    let (n, k) = (p.n as usize, p.k as usize);
    ctx.require_block(FP8_CONVERT_THREADS)?;
    let block = FP8_BLOCK as usize;
    let w = ctx.slice::<bf16>("w", p.w, n * k)?;
    let (q, scales) = fp8::quantize(w, (n, k));
    ctx.slice_mut::<u8>("out", p.out, n * k)?
        .copy_from_slice(&q);
    ctx.slice_mut::<f32>("scales", p.scales, n.div_ceil(block) * k.div_ceil(block))?
        .copy_from_slice(&scales);
    Ok(())
}
