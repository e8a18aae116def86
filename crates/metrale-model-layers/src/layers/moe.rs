//! `MoeMlp`: the sparse mixture-of-experts FFN of Qwen3-Next and Qwen3.5-MoE (transformers'
//! `Qwen3NextSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`): a softmax top-k router, SwiGLU experts
//! run over the step's (row, choice) pairs straight from stacked weights, and a shared expert
//! scaled by `sigmoid(shared_expert_gate · x)`. No host loop over experts: seven launches
//! whatever the routing.
//!
//! Weight layouts the loader produces (E experts of width F, shared width Fs, hidden H). In
//! transformers 5 the model holds fused `mlp.experts.gate_up_proj` `[E, 2F, H]` and
//! `mlp.experts.down_proj` `[E, H, F]`, but `save_pretrained` writes the per-expert checkpoint
//! format (`mlp.experts.{e}.gate_proj.weight` `[F, H]`, `.up_proj.weight` `[F, H]`,
//! `.down_proj.weight` `[H, F]`), so the loader stacks those:
//! - `router`, bf16 `[E, H]`: `mlp.gate.weight`.
//! - `experts_gate_up`, bf16 `[E, 2F, H]`: expert `e`'s `[gate_proj; up_proj]` (gate rows first),
//!   experts in index order; the same bytes as transformers' fused `gate_up_proj`.
//! - `experts_down`, bf16 `[E, H, F]`: the experts' `down_proj` in index order.
//! - Both stacked expert weights may instead be block FP8 (an FP8 pack's experts, or experts
//!   quantized at load): e4m3 bytes of the same layout with the scale grid of the
//!   `[E * rows, cols]` matrix (128-row blocks where each expert's parts are multiples of 128
//!   rows, else a scale row per weight row); the FP8 expert kernels read them.
//! - shared expert: `gate_up` bf16 `[2Fs, H]` (`shared_expert.gate_proj` then `up_proj`), `down`
//!   bf16 `[H, Fs]`, `gate` bf16 `[1, H]` (`mlp.shared_expert_gate.weight`).
//!
//! Invariants:
//! - Reads `normed`, writes `StepBuffers::moe` and `delta`; each row's result depends only on its
//!   own input (batch invariance).

#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use metrale_circuit::LinearRole;
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{DevicePtr, GpuResult};

use crate::circuit_exec::{BoundWeight, FfnFacts, MoeFacts, SharedFacts, WeightSlot};
use crate::layer::LayerCtx;
use crate::ops::Matrix;
use crate::ops_hybrid::{ExpertLinear, MoeCombine};
use crate::ops_moe::TopkRoute;
use crate::weight_map::DenseWeight;

/// The dimensions of a MoE layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeShape {
    /// Routed experts `E`.
    pub num_experts: u32,
    /// Experts per token `K`.
    pub top_k: u32,
    /// One expert's width `F` (`moe_intermediate_size`).
    pub expert_ffn: u32,
    /// Renormalise the top-k probabilities (`norm_topk_prob`; always for Qwen3.5-MoE).
    pub renormalize: bool,
}

impl MoeShape {
    /// The MoE shape of a config; `None` without MoE layers.
    pub fn from_config(config: &ModelConfig) -> Option<MoeShape> {
        let m = config.moe.as_ref()?;
        Some(MoeShape {
            num_experts: m.num_experts as u32,
            top_k: m.num_experts_per_tok as u32,
            expert_ffn: m.moe_intermediate_size as u32,
            renormalize: m.norm_topk_prob,
        })
    }
}

/// The always-on shared expert.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// bf16 `[2 * ffn, hidden]`: `[gate_proj; up_proj]`.
    pub gate_up: DenseWeight,
    /// bf16 `[hidden, ffn]`.
    pub down: DenseWeight,
    /// bf16 `[1, hidden]`: `shared_expert_gate`; `None` for an ungated shared expert.
    pub gate: Option<DenseWeight>,
    /// Width `Fs` (`shared_expert_intermediate_size`).
    pub ffn: u32,
}

/// One MoE FFN's weights; layouts in the module header.
#[derive(Debug, Clone)]
pub struct MoeMlp {
    /// bf16 `[E, hidden]`.
    pub router: DenseWeight,
    /// bf16 or block FP8 `[E, 2F, hidden]`.
    pub experts_gate_up: DenseWeight,
    /// bf16 or block FP8 `[E, hidden, F]`.
    pub experts_down: DenseWeight,
    /// The shared expert, when the family has one.
    pub shared: Option<SharedExpert>,
    /// Dimensions.
    pub shape: MoeShape,
}

impl MoeMlp {
    /// Run the FFN on `normed`, leaving the result in `delta`.
    pub fn forward(&self, cx: &LayerCtx<'_>) -> GpuResult<()> {
        let (ops, s, buf, d, rows) = (cx.ops, cx.stream, cx.buf, cx.dims, cx.shape.rows);
        let (m, sh) = (&buf.moe, &self.shape);
        let (e, k, f) = (sh.num_experts, sh.top_k, sh.expert_ffn);
        let pairs = rows * k;
        let normed = Matrix::bf16(buf.acts.normed, rows, d.hidden);
        let logits = Matrix::f32(m.router_logits, rows, e);
        ops.linear_f32out(s, logits, normed, self.router.matrix())?;
        let route = TopkRoute {
            topk_ids: m.topk_ids,
            topk_weights: m.topk_weights,
            logits: m.router_logits,
            rows,
            num_experts: e,
            top_k: k,
            renormalize: sh.renormalize as u32,
        };
        ops.topk_route(s, &route)?;
        let gate_up = ExpertLinear {
            out: m.expert_gate_up,
            x: buf.acts.normed,
            w: self.experts_gate_up.ptr,
            expert_ids: m.topk_ids,
            pairs,
            n: 2 * f,
            k: d.hidden,
            num_experts: e,
            pairs_per_x_row: k,
        };
        ops.expert_projection(s, &gate_up, stacked(&self.experts_gate_up), false)?;
        let expert_act = Matrix::bf16(m.expert_act, pairs, f);
        ops.silu_mul(s, expert_act, Matrix::bf16(m.expert_gate_up, pairs, 2 * f))?;
        let down = ExpertLinear {
            out: m.expert_out,
            x: m.expert_act,
            w: self.experts_down.ptr,
            expert_ids: m.topk_ids,
            pairs,
            n: d.hidden,
            k: f,
            num_experts: e,
            pairs_per_x_row: 1,
        };
        ops.expert_projection(s, &down, stacked(&self.experts_down), true)?;
        // Sharded, every rank holds each expert at a slice of its width: each pair's f32
        // down-projection partial sums are summed over the ranks in place, so every rank
        // combines the whole experts' outputs as the unsharded layer does.
        if cx.sharded() {
            let out = Matrix::f32(m.expert_out, pairs, d.hidden);
            ops.all_reduce_sum(s, out, out)?;
        }
        let (mut shared_out, mut shared_gate) = (DevicePtr::NULL, DevicePtr::NULL);
        if let Some(se) = &self.shared {
            let gate_up = Matrix::bf16(m.shared_gate_up, rows, 2 * se.ffn);
            let act = Matrix::bf16(m.shared_act, rows, se.ffn);
            ops.linear(s, gate_up, normed, se.gate_up.matrix())?;
            ops.silu_mul(s, act, gate_up)?;
            let out = Matrix::bf16(m.shared_out, rows, d.hidden);
            if cx.sharded() {
                // Each rank's slice of the shared expert's width: its partial sums in f32,
                // summed over the ranks and rounded once, as the whole projection rounds them.
                let partial = Matrix::f32(buf.acts.partial, rows, d.hidden);
                ops.linear_f32out(s, partial, act, se.down.matrix())?;
                ops.all_reduce_sum(s, out, partial)?;
            } else {
                ops.linear(s, out, act, se.down.matrix())?;
            }
            shared_out = m.shared_out;
            if let Some(g) = &se.gate {
                let gate = Matrix::f32(m.shared_gate, rows, 1);
                ops.linear_f32out(s, gate, normed, g.matrix())?;
                shared_gate = m.shared_gate;
            }
        }
        ops.moe_combine(
            s,
            &MoeCombine {
                out: buf.acts.delta,
                expert_out: m.expert_out,
                topk_weights: m.topk_weights,
                shared_out,
                shared_gate,
                rows,
                hidden: d.hidden,
                top_k: k,
            },
        )
    }

    /// Bind the FFN's weights into `weights` and return the facts its kernels read.
    pub(crate) fn circuit_facts(
        &self,
        weights: &mut BTreeMap<WeightSlot, BoundWeight>,
    ) -> FfnFacts {
        use LinearRole::*;
        weights.insert(WeightSlot::Linear(Router), (&self.router).into());
        weights.insert(
            WeightSlot::Linear(ExpertGateUp),
            (&self.experts_gate_up).into(),
        );
        weights.insert(WeightSlot::Linear(ExpertDown), (&self.experts_down).into());
        if let Some(se) = &self.shared {
            weights.insert(WeightSlot::Linear(SharedGateUp), (&se.gate_up).into());
            weights.insert(WeightSlot::Linear(SharedDown), (&se.down).into());
            if let Some(g) = &se.gate {
                weights.insert(WeightSlot::Linear(SharedGate), g.into());
            }
        }
        FfnFacts::Moe(MoeFacts {
            shape: self.shape,
            shared: self.shared.as_ref().map(|se| SharedFacts {
                ffn: se.ffn,
                gated: se.gate.is_some(),
            }),
        })
    }
}

/// A stacked expert weight `[E, n, k]` as the `[E * n, k]` matrix the expert kernels read.
fn stacked(w: &DenseWeight) -> Matrix {
    let clamp = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
    let k = w.shape.last().copied().unwrap_or(1);
    let rows = w.shape.iter().product::<usize>() / k.max(1);
    Matrix {
        scales: w.scales,
        ..Matrix::new(w.ptr, w.dtype, clamp(rows), clamp(k))
    }
}
