//! The launchers of the sparse-MoE kernels (`moe::*`): routing, the per-pair expert projections
//! and the weighted combine, an `impl Ops` block beside `ops_hybrid` (which re-exports the
//! parameter types). Each launches its kernel with its parameter struct; launch geometry
//! depends only on shapes.

use metrale_gpu_runtime::{GpuResult, LaunchConfig, StreamHandle};
use metrale_kernel_abi::{ExpertLinearParams, MoeCombineParams, TopkRouteParams};

use crate::ops::Ops;

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
        self.go(self.k.expert_linear, expert_geometry(p), p, s)
    }

    /// As `expert_linear`, f32 out (the down projection, kept for the weighted sum).
    pub fn expert_linear_f32out(&self, s: StreamHandle, p: &ExpertLinear) -> GpuResult<()> {
        self.go(self.k.expert_linear_f32out, expert_geometry(p), p, s)
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
fn expert_geometry(p: &ExpertLinear) -> LaunchConfig {
    let experts = p.num_experts.min(p.pairs).max(1);
    let mut cols = EXPERT_MAX_COLS_PER_BLOCK;
    while cols > EXPERT_MIN_COLS_PER_BLOCK && p.n.div_ceil(cols) * experts < EXPERT_TARGET_BLOCKS {
        cols /= 2;
    }
    LaunchConfig::grid2(p.n.div_ceil(cols), experts, EXPERT_THREADS)
        .with_shared(p.num_experts.div_ceil(32).max(1) * 4)
}
