//! CPU twins of `kernels/gemm.cu`: `out = x · wᵀ` with a bf16 weight in the checkpoint's
//! `[out_features, in_features]` layout, accumulated in f32 over `k` in index order, so every
//! output element is computed the same way whatever `m` is.

use half::bf16;

use super::util::{b, f};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

fn gemm(ctx: &KernelCtx<'_>, store: impl Fn(usize, f32) -> GpuResult<()>) -> GpuResult<()> {
    let (m, n, k) = (ctx.usize(3)?, ctx.usize(4)?, ctx.usize(5)?);
    let x = ctx.slice::<bf16>(1, m * k)?;
    let w = ctx.slice::<bf16>(2, n * k)?;
    let wf: Vec<f32> = w.iter().map(|&e| f(e)).collect();
    let mut xr = vec![0.0f32; k];
    for i in 0..m {
        for (dst, &src) in xr.iter_mut().zip(&x[i * k..(i + 1) * k]) {
            *dst = f(src);
        }
        for j in 0..n {
            let mut acc = 0.0f32;
            for (a, c) in xr.iter().zip(&wf[j * k..(j + 1) * k]) {
                acc += a * c;
            }
            store(i * n + j, acc)?;
        }
    }
    Ok(())
}

/// `linear(out: bf16 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k)`.
pub fn linear(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(6)?;
    let (m, n) = (ctx.usize(3)?, ctx.usize(4)?);
    let out = std::cell::RefCell::new(ctx.slice_mut::<bf16>(0, m * n)?);
    gemm(ctx, |i, v| {
        out.borrow_mut()[i] = b(v);
        Ok(())
    })
}

/// `linear_f32out(out: f32 [m, n], x: bf16 [m, k], w: bf16 [n, k], m, n, k)`: the LM head,
/// whose logits stay f32.
pub fn linear_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(6)?;
    let (m, n) = (ctx.usize(3)?, ctx.usize(4)?);
    let out = std::cell::RefCell::new(ctx.slice_mut::<f32>(0, m * n)?);
    gemm(ctx, |i, v| {
        out.borrow_mut()[i] = v;
        Ok(())
    })
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
        ("linear_stream_wide", linear),
        ("linear_stream_wide_f32out", linear_f32out),
    ],
};
