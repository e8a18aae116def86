//! The launchers of the sparse-MoE kernels (`moe::*`): routing, the per-pair expert projections
//! and the weighted combine, an `impl Ops` block beside `ops_hybrid` (which re-exports the
//! parameter types). Each launches its kernel with its parameter struct; launch geometry
//! depends only on shapes.

use metrale_gpu_runtime::{DType, GpuResult, LaunchConfig, StreamHandle};
use metrale_kernel_abi::{
    ExpertLinearFp8Params, ExpertLinearParams, MoeCombineParams, TopkRouteParams,
};

use crate::ops::Ops;
use crate::ops_view::{Matrix, Operands};

/// Threads per block of the expert projections (8 warps, a warp per output column at a time).
const EXPERT_THREADS: u32 = 256;
/// Most and fewest output columns per block of the expert projections.
const EXPERT_MAX_COLS_PER_BLOCK: u32 = 32;
const EXPERT_MIN_COLS_PER_BLOCK: u32 = 8;
/// Blocks the expert projections aim for before widening their column blocks.
const EXPERT_TARGET_BLOCKS: u32 = 1024;

/// The parameters of `topk_route`: the kernel's own struct (`renormalize` 1: the weights
/// renormalised over the chosen experts).
pub type TopkRoute = TopkRouteParams;

/// The parameters of `expert_linear` and `expert_linear_f32out`: the kernels' own struct
/// (`pairs_per_x_row`: `top_k` for the gate|up projection, 1 for down).
pub type ExpertLinear = ExpertLinearParams;

/// The parameters of `expert_linear_fp8` and `expert_linear_fp8_f32out`: the kernels' own
/// struct (the stacked weight block FP8, with its scale grid).
pub type ExpertLinearFp8 = ExpertLinearFp8Params;

/// The parameters of `moe_combine`: the kernel's own struct (`shared_out` NULL without a
/// shared expert, `shared_gate` NULL for an ungated one).
pub type MoeCombine = MoeCombineParams;

impl Ops {
    /// Softmax over the router logits, top-k, optional renormalisation. One warp per row.
    pub fn topk_route(&self, s: StreamHandle, p: &TopkRoute) -> GpuResult<()> {
        self.go(self.k.topk_route, LaunchConfig::linear(p.rows, 32), p, s)
    }

    /// Each (row, choice) pair through its expert's slice of a stacked weight, bf16 out.
    pub fn expert_linear(&self, s: StreamHandle, p: &ExpertLinear) -> GpuResult<()> {
        self.go(
            self.k.expert_linear,
            expert_geometry(p.pairs, p.n, p.num_experts),
            p,
            s,
        )
    }

    /// As `expert_linear`, f32 out (the down projection, kept for the weighted sum).
    pub fn expert_linear_f32out(&self, s: StreamHandle, p: &ExpertLinear) -> GpuResult<()> {
        let geometry = expert_geometry(p.pairs, p.n, p.num_experts);
        self.go(self.k.expert_linear_f32out, geometry, p, s)
    }

    /// The expert projection `p` (its `w` aside) through the stacked weight `w`, `[num_experts *
    /// n, k]` as the model stores it: `expert_linear` (or `_f32out`) for bf16,
    /// `expert_linear_fp8` (or `_f32out`) for block FP8 with its scales.
    pub fn expert_projection(
        &self,
        s: StreamHandle,
        p: &ExpertLinear,
        w: Matrix,
        f32_out: bool,
    ) -> GpuResult<()> {
        let check = Operands {
            kernel: match (w.dtype, f32_out) {
                (DType::F8E4M3, false) => "moe::expert_linear_fp8",
                (DType::F8E4M3, true) => "moe::expert_linear_fp8_f32out",
                (_, false) => "moe::expert_linear",
                (_, true) => "moe::expert_linear_f32out",
            },
        };
        let rows = p.num_experts.saturating_mul(p.n);
        let what = "the experts' count, output columns and inputs";
        let p = ExpertLinear { w: w.ptr, ..*p };
        if w.dtype != DType::F8E4M3 {
            check.exactly("w", &w, DType::Bf16, (rows, p.k), what)?;
            return if f32_out {
                self.expert_linear_f32out(s, &p)
            } else {
                self.expert_linear(s, &p)
            };
        }
        check.exactly("w", &w, DType::F8E4M3, (rows, p.k), what)?;
        let scales = w
            .scales
            .ok_or_else(|| check.bad("w", "is fp8_e4m3 without its block scales".into()))?;
        let q = ExpertLinearFp8 {
            out: p.out,
            x: p.x,
            w: p.w,
            scales: scales.ptr,
            expert_ids: p.expert_ids,
            pairs: p.pairs,
            n: p.n,
            k: p.k,
            num_experts: p.num_experts,
            pairs_per_x_row: p.pairs_per_x_row,
            scale_row_shift: scales.row_shift,
        };
        if f32_out {
            self.expert_linear_fp8_f32out(s, &q)
        } else {
            self.expert_linear_fp8(s, &q)
        }
    }

    /// `expert_linear` of a block-FP8 stacked weight (bitwise `expert_linear` of the bf16 weight
    /// it stands for).
    pub fn expert_linear_fp8(&self, s: StreamHandle, p: &ExpertLinearFp8) -> GpuResult<()> {
        let geometry = expert_geometry(p.pairs, p.n, p.num_experts);
        self.go(self.k.expert_linear_fp8, geometry, p, s)
    }

    /// As `expert_linear_fp8`, f32 out.
    pub fn expert_linear_fp8_f32out(&self, s: StreamHandle, p: &ExpertLinearFp8) -> GpuResult<()> {
        let geometry = expert_geometry(p.pairs, p.n, p.num_experts);
        self.go(self.k.expert_linear_fp8_f32out, geometry, p, s)
    }

    /// The weighted sum of each row's experts plus its gated shared expert, bf16 out.
    pub fn moe_combine(&self, s: StreamHandle, p: &MoeCombine) -> GpuResult<()> {
        self.go(self.k.moe_combine, LaunchConfig::linear(p.rows, 256), p, s)
    }
}

/// The expert projections' grid (`kernels/moe.cu`): y over the routed experts (at most
/// `min(num_experts, pairs)`; block y serves the y-th routed expert, the others return at once),
/// x over blocks of output columns, 32 of them, or fewer (down to 8) while the grid has fewer than
/// `EXPERT_TARGET_BLOCKS` blocks; a bitmap of the experts in dynamic shared memory. A pair's
/// outputs do not depend on the grid.
fn expert_geometry(pairs: u32, n: u32, num_experts: u32) -> LaunchConfig {
    let experts = num_experts.min(pairs).max(1);
    let mut cols = EXPERT_MAX_COLS_PER_BLOCK;
    while cols > EXPERT_MIN_COLS_PER_BLOCK && n.div_ceil(cols) * experts < EXPERT_TARGET_BLOCKS {
        cols /= 2;
    }
    LaunchConfig::grid2(n.div_ceil(cols), experts, EXPERT_THREADS)
        .with_shared(num_experts.div_ceil(32).max(1) * 4)
}
