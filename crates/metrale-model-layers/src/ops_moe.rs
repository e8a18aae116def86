//! The launchers of the sparse-MoE kernels (`moe::*`): routing, the per-pair expert projections
//! and the weighted combine, an `impl Ops` block beside `ops_hybrid` (which re-exports the
//! parameter types). Each builds its kernel's flat argument list in the order the CPU twin in
//! `metrale-gpu-runtime::cpu::kernels::moe` documents (pointers, then scalars); launch geometry
//! depends only on shapes.

use metrale_gpu_runtime::{DevicePtr, GpuResult, KernelArg, LaunchConfig, StreamHandle};

use crate::ops::Ops;

/// Threads per block of the expert projections (8 warps, a warp per output column at a time).
const EXPERT_THREADS: u32 = 256;
/// Most and fewest output columns per block of the expert projections.
const EXPERT_MAX_COLS_PER_BLOCK: u32 = 32;
const EXPERT_MIN_COLS_PER_BLOCK: u32 = 8;
/// Blocks the expert projections aim for before widening their column blocks.
const EXPERT_TARGET_BLOCKS: u32 = 1024;

/// The parameters of `expert_linear` and `expert_linear_f32out`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertLinear {
    /// bf16 (or f32) `[pairs, n]`.
    pub out: DevicePtr,
    /// bf16 `[pairs / pairs_per_x_row, k]`.
    pub x: DevicePtr,
    /// bf16 `[num_experts, n, k]`.
    pub w: DevicePtr,
    /// u32 `[pairs]`: the expert of each pair.
    pub expert_ids: DevicePtr,
    /// (row, choice) pairs.
    pub pairs: u32,
    /// Output columns.
    pub n: u32,
    /// Input columns.
    pub k: u32,
    /// Experts in `w`.
    pub num_experts: u32,
    /// Pairs that share one row of `x` (`top_k` for the gate|up projection, 1 for down).
    pub pairs_per_x_row: u32,
}

impl ExpertLinear {
    fn args(&self) -> [KernelArg; 9] {
        [
            self.out.into(),
            self.x.into(),
            self.w.into(),
            self.expert_ids.into(),
            self.pairs.into(),
            self.n.into(),
            self.k.into(),
            self.num_experts.into(),
            self.pairs_per_x_row.into(),
        ]
    }
}

/// The parameters of `moe_combine`.
#[derive(Debug, Clone, Copy)]
pub struct MoeCombine {
    /// bf16 `[rows, hidden]`.
    pub out: DevicePtr,
    /// f32 `[rows * top_k, hidden]`.
    pub expert_out: DevicePtr,
    /// f32 `[rows, top_k]`.
    pub topk_weights: DevicePtr,
    /// bf16 `[rows, hidden]`, or NULL without a shared expert.
    pub shared_out: DevicePtr,
    /// f32 `[rows]` gate logits, or NULL for an ungated shared expert.
    pub shared_gate: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Hidden size.
    pub hidden: u32,
    /// Experts per row.
    pub top_k: u32,
}

impl Ops {
    /// Softmax over the router logits, top-k, optional renormalisation. One warp per row.
    #[allow(clippy::too_many_arguments)]
    pub fn topk_route(
        &self,
        s: StreamHandle,
        topk_ids: DevicePtr,
        topk_weights: DevicePtr,
        logits: DevicePtr,
        rows: u32,
        num_experts: u32,
        top_k: u32,
        renormalize: bool,
    ) -> GpuResult<()> {
        let args: [KernelArg; 7] = [
            topk_ids.into(),
            topk_weights.into(),
            logits.into(),
            rows.into(),
            num_experts.into(),
            top_k.into(),
            (renormalize as u32).into(),
        ];
        self.go(self.k.topk_route, LaunchConfig::linear(rows, 32), &args, s)
    }

    /// Each (row, choice) pair through its expert's slice of a stacked weight, bf16 out.
    pub fn expert_linear(&self, s: StreamHandle, p: &ExpertLinear) -> GpuResult<()> {
        self.go(self.k.expert_linear, expert_geometry(p), &p.args(), s)
    }

    /// As `expert_linear`, f32 out (the down projection, kept for the weighted sum).
    pub fn expert_linear_f32out(&self, s: StreamHandle, p: &ExpertLinear) -> GpuResult<()> {
        self.go(
            self.k.expert_linear_f32out,
            expert_geometry(p),
            &p.args(),
            s,
        )
    }

    /// The weighted sum of each row's experts plus its gated shared expert, bf16 out.
    pub fn moe_combine(&self, s: StreamHandle, p: &MoeCombine) -> GpuResult<()> {
        let args: [KernelArg; 8] = [
            p.out.into(),
            p.expert_out.into(),
            p.topk_weights.into(),
            p.shared_out.into(),
            p.shared_gate.into(),
            p.rows.into(),
            p.hidden.into(),
            p.top_k.into(),
        ];
        self.go(
            self.k.moe_combine,
            LaunchConfig::linear(p.rows, 256),
            &args,
            s,
        )
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
