//! CPU twins of `kernels/moe.cu`: the sparse MoE block of Qwen3-Next / Qwen3.5-MoE
//! (transformers' `*SparseMoeBlock`: top-k router, SwiGLU experts, sigmoid-gated shared expert),
//! without host loops over experts.
//!
//! One MoE layer over `rows` tokens, E experts, top-k `K`, expert width F, hidden H:
//! 1. `gemm::linear_f32out`: router logits, f32 `[rows, E]`, from the router weight `[E, H]`.
//! 2. `topk_route`: per row the K chosen experts (`topk_ids`, u32 `[rows, K]`) and their weights
//!    (`topk_weights`, f32 `[rows, K]`).
//! 3. `expert_linear` over the `rows * K` (row, choice) pairs, pair `p = row * K + choice`:
//!    gate|up projection by the chosen expert's slice of the stacked `[E, 2F, H]` weight, bf16
//!    `[rows * K, 2F]`.
//! 4. `activation::silu_mul` over the pairs: bf16 `[rows * K, F]`.
//! 5. `expert_linear_f32out`: down projection by the stacked `[E, H, F]` weight, f32
//!    `[rows * K, H]`. Block-FP8 experts run `expert_linear_fp8` / `expert_linear_fp8_f32out`,
//!    the same function of the weight they stand for.
//! 6. The shared expert as a dense SwiGLU MLP (`gemm::linear`, `silu_mul`, `gemm::linear`), bf16
//!    `[rows, H]`, and its gate logit `gemm::linear_f32out` with the `[1, H]` weight, f32 `[rows]`.
//! 7. `moe_combine`: `out = Σ_choice weight · expert_out + sigmoid(gate) · shared`, bf16.
//!
//! Invariants:
//! - Every output element is a fixed-order f32 sum over its own row's (or pair's) inputs, so a
//!   row's result does not depend on the other rows of the step or on how a CUDA twin groups
//!   the pairs by expert (batch invariance).
//! - Ties in the router go to the lower expert index; the chosen experts are listed by
//!   descending probability.

#[cfg(test)]
mod tests;

use half::bf16;
use metrale_kernel_abi::{
    ExpertLinearFp8Params, ExpertLinearParams, MoeCombineParams, TopkRouteParams,
};

use super::gemm::fp8_weight;
use super::util::{b, f, sigmoid};
use crate::DevicePtr;
use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `topk_route` ([`TopkRouteParams`]).
///
/// Per row: `p = softmax(logits)` in f32 (max subtracted, sums in index order); the `top_k`
/// largest `p` by descending value (ties: lower index first); weights `p_i`, or
/// `p_i / Σ_chosen p` (summed in choice order) when `renormalize` is 1 (`norm_topk_prob`;
/// always on for Qwen3.5-MoE).
pub fn topk_route(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: TopkRouteParams = ctx.params()?;
    let (rows, e, k, renorm) = (
        p.rows as usize,
        p.num_experts as usize,
        p.top_k as usize,
        p.renormalize != 0,
    );
    if k == 0 || k > e {
        return Err(ctx.fail(format!(
            "top_k {k} must be in 1..={e} (the number of experts)"
        )));
    }
    let ids = ctx.slice_mut::<u32>("topk_ids", p.topk_ids, rows * k)?;
    let weights = ctx.slice_mut::<f32>("topk_weights", p.topk_weights, rows * k)?;
    let logits = ctx.slice::<f32>("logits", p.logits, rows * e)?;
    let mut probs = vec![0.0f32; e];
    let mut taken = vec![false; e];
    for r in 0..rows {
        let row = &logits[r * e..(r + 1) * e];
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0f32;
        for (p, &l) in probs.iter_mut().zip(row) {
            *p = (l - max).exp();
            sum += *p;
        }
        for p in probs.iter_mut() {
            *p /= sum;
        }
        taken.fill(false);
        let (ids, weights) = (
            &mut ids[r * k..(r + 1) * k],
            &mut weights[r * k..(r + 1) * k],
        );
        for choice in 0..k {
            let mut best = None::<usize>;
            for i in 0..e {
                if !taken[i] && best.is_none_or(|bi| probs[i] > probs[bi]) {
                    best = Some(i);
                }
            }
            let bi = best.ok_or_else(|| ctx.fail("no expert left to choose"))?;
            taken[bi] = true;
            ids[choice] = bi as u32;
            weights[choice] = probs[bi];
        }
        if renorm {
            let mut total = 0.0f32;
            for &w in weights.iter() {
                total += w;
            }
            for w in weights.iter_mut() {
                *w /= total;
            }
        }
    }
    Ok(())
}

/// The shapes and inputs of one expert projection launch, whatever its weight format.
struct ExpertLaunch {
    x: DevicePtr,
    expert_ids: DevicePtr,
    pairs: usize,
    n: usize,
    k: usize,
    num_experts: usize,
    per: usize,
}

impl From<&ExpertLinearParams> for ExpertLaunch {
    fn from(p: &ExpertLinearParams) -> ExpertLaunch {
        ExpertLaunch::new(
            p.x,
            p.expert_ids,
            [p.pairs, p.n, p.k, p.num_experts, p.pairs_per_x_row],
        )
    }
}

impl From<&ExpertLinearFp8Params> for ExpertLaunch {
    fn from(p: &ExpertLinearFp8Params) -> ExpertLaunch {
        ExpertLaunch::new(
            p.x,
            p.expert_ids,
            [p.pairs, p.n, p.k, p.num_experts, p.pairs_per_x_row],
        )
    }
}

impl ExpertLaunch {
    fn new(x: DevicePtr, expert_ids: DevicePtr, [pairs, n, k, e, per]: [u32; 5]) -> ExpertLaunch {
        ExpertLaunch {
            x,
            expert_ids,
            pairs: pairs as usize,
            n: n as usize,
            k: k as usize,
            num_experts: e as usize,
            per: per as usize,
        }
    }
}

/// The shared body of the expert projections: `store(p, col, acc)` for every pair and output
/// column, `acc = Σ_i x[p / pairs_per_x_row][i] · w[ids[p]][col][i]` in f32, `i` in order, `w`
/// the stacked `[num_experts, n, k]` weight as bf16.
fn expert_gemm(
    ctx: &KernelCtx<'_>,
    p: &ExpertLaunch,
    w: &[bf16],
    mut store: impl FnMut(usize, f32),
) -> GpuResult<()> {
    let (pairs, n, k, e, per) = (p.pairs, p.n, p.k, p.num_experts, p.per);
    if per == 0 || !pairs.is_multiple_of(per) {
        return Err(ctx.fail(format!(
            "{pairs} pairs are not whole rows of {per} pairs per input row"
        )));
    }
    let x = ctx.slice::<bf16>("x", p.x, pairs / per * k)?;
    let ids = ctx.slice::<u32>("expert_ids", p.expert_ids, pairs)?;
    let mut xr = vec![0.0f32; k];
    for (p, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= e {
            return Err(ctx.fail(format!("pair {p}: expert {id} is past the {e} experts")));
        }
        let row = p / per;
        for (dst, &src) in xr.iter_mut().zip(&x[row * k..(row + 1) * k]) {
            *dst = f(src);
        }
        let we = &w[id * n * k..(id + 1) * n * k];
        for col in 0..n {
            let mut acc = 0.0f32;
            for (a, &c) in xr.iter().zip(&we[col * k..(col + 1) * k]) {
                acc += a * f(c);
            }
            store(p * n + col, acc);
        }
    }
    Ok(())
}

/// The bf16 stacked weight of a bf16 launch.
fn bf16_experts<'a>(ctx: &'a KernelCtx<'_>, p: &ExpertLinearParams) -> GpuResult<&'a [bf16]> {
    let (e, n, k) = (p.num_experts as usize, p.n as usize, p.k as usize);
    ctx.slice::<bf16>("w", p.w, e * n * k)
}

/// The stacked weight of a block-FP8 launch, dequantized as one `[num_experts * n, k]` weight.
fn fp8_experts(ctx: &KernelCtx<'_>, p: &ExpertLinearFp8Params) -> GpuResult<Vec<bf16>> {
    let rows = p.num_experts as usize * p.n as usize;
    fp8_weight(
        ctx,
        (p.w, p.scales),
        (rows, p.k as usize),
        p.scale_row_shift,
    )
}

/// `expert_linear` ([`ExpertLinearParams`]): `out[p] = x[p / pairs_per_x_row] ·
/// w[expert_ids[p]]ᵀ`. With `pairs_per_x_row = top_k` and
/// `expert_ids = topk_ids` this is the experts' gate|up projection of each (row, choice) pair.
pub fn expert_linear(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ExpertLinearParams = ctx.params()?;
    let out = ctx.slice_mut::<bf16>("out", p.out, p.pairs as usize * p.n as usize)?;
    expert_gemm(ctx, &(&p).into(), bf16_experts(ctx, &p)?, |i, v| {
        out[i] = b(v)
    })
}

/// `expert_linear_f32out` ([`ExpertLinearParams`]): as `expert_linear` with an f32 output; the experts' down projection
/// (`pairs_per_x_row = 1`), kept in f32 until the weighted sum.
pub fn expert_linear_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ExpertLinearParams = ctx.params()?;
    let out = ctx.slice_mut::<f32>("out", p.out, p.pairs as usize * p.n as usize)?;
    expert_gemm(ctx, &(&p).into(), bf16_experts(ctx, &p)?, |i, v| out[i] = v)
}

/// `expert_linear_fp8` ([`ExpertLinearFp8Params`]): `expert_linear` of the dequantized weight
/// (each element bf16(e4m3 · its block's scale'), `crate::fp8`).
pub fn expert_linear_fp8(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ExpertLinearFp8Params = ctx.params()?;
    let out = ctx.slice_mut::<bf16>("out", p.out, p.pairs as usize * p.n as usize)?;
    expert_gemm(ctx, &(&p).into(), &fp8_experts(ctx, &p)?, |i, v| {
        out[i] = b(v)
    })
}

/// `expert_linear_fp8_f32out` ([`ExpertLinearFp8Params`]): as `expert_linear_fp8`, f32 out.
pub fn expert_linear_fp8_f32out(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ExpertLinearFp8Params = ctx.params()?;
    let out = ctx.slice_mut::<f32>("out", p.out, p.pairs as usize * p.n as usize)?;
    expert_gemm(ctx, &(&p).into(), &fp8_experts(ctx, &p)?, |i, v| out[i] = v)
}

/// `moe_combine` ([`MoeCombineParams`]):
/// `out[r] = Σ_choice topk_weights[r][choice] · expert_out[r·top_k + choice]` (choice in order)
/// `+ sigmoid(shared_gate[r]) · shared_out[r]` (the gate factor is 1 when `shared_gate` is NULL;
/// no shared term when `shared_out` is NULL), in f32, bf16 out.
pub fn moe_combine(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: MoeCombineParams = ctx.params()?;
    let (rows, hidden, k) = (p.rows as usize, p.hidden as usize, p.top_k as usize);
    let out = ctx.slice_mut::<bf16>("out", p.out, rows * hidden)?;
    let expert_out = ctx.slice::<f32>("expert_out", p.expert_out, rows * k * hidden)?;
    let weights = ctx.slice::<f32>("topk_weights", p.topk_weights, rows * k)?;
    let shared = ctx.slice_opt::<bf16>("shared_out", p.shared_out, rows * hidden)?;
    let gate = ctx.slice_opt::<f32>("shared_gate", p.shared_gate, rows)?;
    for r in 0..rows {
        let g = gate.map_or(1.0, |g| sigmoid(g[r]));
        for c in 0..hidden {
            let mut acc = 0.0f32;
            for choice in 0..k {
                acc += weights[r * k + choice] * expert_out[(r * k + choice) * hidden + c];
            }
            if let Some(s) = shared {
                acc += g * f(s[r * hidden + c]);
            }
            out[r * hidden + c] = b(acc);
        }
    }
    Ok(())
}
