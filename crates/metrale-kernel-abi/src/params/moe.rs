//! Parameters of the MoE kernels (`kernels/moe.cu`).

use crate::kernel_params;

kernel_params! {
    /// `moe::topk_route`: the router's top-k experts and their weights per row.
    pub struct TopkRouteParams("TOPK_ROUTE_PARAMS") {
        /// u32 `[rows, top_k]`.
        topk_ids: ptr "uint32_t* __restrict__",
        /// f32 `[rows, top_k]`.
        topk_weights: ptr "float* __restrict__",
        /// f32 `[rows, num_experts]`.
        logits: ptr "const float* __restrict__",
        /// Rows.
        rows: u32,
        /// Experts.
        num_experts: u32,
        /// Choices per row.
        top_k: u32,
        /// 1: the weights renormalised over the chosen experts.
        renormalize: u32,
    }
}

kernel_params! {
    /// `moe::expert_linear` and `moe::expert_linear_f32out`: each (row, choice) pair through its
    /// expert's projection.
    pub struct ExpertLinearParams("EXPERT_LINEAR_PARAMS") {
        /// `[pairs, n]`, bf16 or f32.
        out: ptr "OutT* __restrict__",
        /// bf16 `[pairs / pairs_per_x_row, k]`.
        x: ptr "const bf16* __restrict__",
        /// bf16 `[num_experts, n, k]`.
        w: ptr "const bf16* __restrict__",
        /// u32 `[pairs]`: each pair's expert.
        expert_ids: ptr "const uint32_t* __restrict__",
        /// Pairs.
        pairs: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
        /// Experts.
        num_experts: u32,
        /// Pairs sharing one row of `x`.
        pairs_per_x_row: u32,
    }
}

kernel_params! {
    /// `moe::expert_linear_fp8` and `moe::expert_linear_fp8_f32out`: `expert_linear` of a
    /// block-FP8 stacked weight, each element standing for bf16(e4m3 · its block's scale').
    pub struct ExpertLinearFp8Params("EXPERT_LINEAR_FP8_PARAMS") {
        /// `[pairs, n]`, bf16 or f32.
        out: ptr "OutT* __restrict__",
        /// bf16 `[pairs / pairs_per_x_row, k]`.
        x: ptr "const bf16* __restrict__",
        /// fp8 e4m3 `[num_experts, n, k]`, read as one `[num_experts * n, k]` weight.
        w: ptr "const uint8_t* __restrict__",
        /// f32 `[ceil(num_experts * n / 2^scale_row_shift), ceil(k / FP8_BLOCK)]`: the scale of
        /// each block of the `[num_experts * n, k]` weight.
        scales: ptr "const float* __restrict__",
        /// u32 `[pairs]`: each pair's expert.
        expert_ids: ptr "const uint32_t* __restrict__",
        /// Pairs.
        pairs: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
        /// Experts.
        num_experts: u32,
        /// Pairs sharing one row of `x`.
        pairs_per_x_row: u32,
        /// log2 of the weight rows one scale row covers: `FP8_BLOCK_ROW_SHIFT` (128-row blocks,
        /// which never straddle two experts: `n` is a multiple of 128) or 0 (a scale row per
        /// weight row).
        scale_row_shift: u32,
    }
}

kernel_params! {
    /// `moe::moe_combine`: the experts' outputs weighed and summed, plus the gated shared
    /// expert.
    pub struct MoeCombineParams("MOE_COMBINE_PARAMS") {
        /// bf16 `[rows, hidden]`.
        out: ptr "bf16* __restrict__",
        /// f32 `[rows * top_k, hidden]`.
        expert_out: ptr "const float* __restrict__",
        /// f32 `[rows, top_k]`.
        topk_weights: ptr "const float* __restrict__",
        /// bf16 `[rows, hidden]` or null.
        shared_out: ptr "const bf16* __restrict__",
        /// f32 `[rows]` or null.
        shared_gate: ptr "const float* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns.
        hidden: u32,
        /// Choices per row.
        top_k: u32,
    }
}
