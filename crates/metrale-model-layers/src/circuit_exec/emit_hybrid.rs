//! The emitters of the hybrid and MoE layers' ops: the GDN conv with its window, the gates,
//! the delta rule (decode and verify), the gated norm, and the MoE routing, expert projections
//! and combine. A group no emitter here lowers goes on to the draft step's emitters.
//!
//! Invariant: as every emitter, a launch here is the legacy launch for the same op, argument
//! for argument (the GDN kernels read the input projection where its emitter wrote it,
//! `Emitter::gdn_layout`, as `GatedDeltaNet::forward` lays it out).

use metrale_circuit::kernels as k;
use metrale_circuit::{Kernel, Node, Op, Tensor};
use metrale_gpu_runtime::{DType, DevicePtr};

use super::bindings::WeightSlot;
use super::emit::Emitter;
use super::error::CircuitExecError;
use crate::ops::Matrix;
use crate::ops_hybrid::{
    CausalConv1d, ExpertLinear, GatedDelta, GatedRmsNorm, GdnPrepare, GdnSeqs, MoeCombine,
    StatePool, TopkRoute,
};

type Result<T> = std::result::Result<T, CircuitExecError>;

impl Emitter<'_> {
    /// Emit a one-node group of a GDN op; otherwise on to the MoE emitters.
    pub(super) fn hybrid_single(&self, node: &Node, kernels: &[Kernel]) -> Result<bool> {
        let (ops, s, b) = (self.ops, self.stream, node.block);
        let u = |what: &'static str, v: u64| self.u32(b, what, v);
        match (node.op, kernels) {
            (
                op @ (Op::GdnConv | Op::GdnConvVerify),
                [
                    conv @ k::CAUSAL_CONV1D,
                    window @ (k::CONV_STATE_UPDATE | k::CONV_STATE_VERIFY),
                ],
            ) if (op == Op::GdnConvVerify) == (*window == k::CONV_STATE_VERIFY) => {
                let g = self.gdn(b)?;
                let ssm = self.ssm(b)?;
                let proj = self.input(node, Tensor::GdnProj)?;
                let p = CausalConv1d {
                    out: self.output(node, Tensor::GdnConv)?.ptr,
                    proj: proj.ptr,
                    layout: self.gdn_layout(b, proj.rows)?,
                    conv_state: StatePool {
                        base: self.input(node, Tensor::ConvState)?.ptr,
                        num_slots: ssm.num_slots,
                        slot_stride: ssm.conv_slot_stride,
                    },
                    weight: self.weight(b, WeightSlot::GdnConv1d, *conv)?,
                    seqs: self.seqs(node, proj.rows)?,
                    heads: g.heads,
                    kernel_size: g.conv_kernel,
                };
                ops.causal_conv1d(s, &p)?;
                if op == Op::GdnConvVerify {
                    ops.conv_state_verify(s, &p, self.input(node, Tensor::RowSlot)?.ptr)?;
                } else {
                    ops.conv_state_update(s, &p)?;
                }
            }
            (Op::GdnGates, [kernel @ k::GDN_PREPARE]) => {
                let g = self.gdn(b)?;
                let conv = self.input(node, Tensor::GdnConv)?;
                ops.gdn_prepare(
                    s,
                    &GdnPrepare {
                        qk: self.output(node, Tensor::GdnQk)?.ptr,
                        gates: self.output(node, Tensor::GdnGates)?.ptr,
                        conv: conv.ptr,
                        proj: self.input(node, Tensor::GdnProj)?.ptr,
                        layout: self.gdn_layout(b, conv.rows)?,
                        a_log: self.weight(b, WeightSlot::GdnALog, *kernel)?,
                        dt_bias: self.weight(b, WeightSlot::GdnDtBias, *kernel)?,
                        rows: u("rows", conv.rows)?,
                        heads: g.heads,
                        l2_eps: g.l2_eps,
                        q_scale: g.q_scale,
                    },
                )?;
            }
            (Op::GdnRecurrence, [k::GATED_DELTA_RECURRENT])
            | (Op::GdnRecurrenceVerify, [k::GATED_DELTA_VERIFY]) => {
                let g = self.gdn(b)?;
                let ssm = self.ssm(b)?;
                let qk = self.input(node, Tensor::GdnQk)?;
                let rule = GatedDelta {
                    out: self.output(node, Tensor::GdnCore)?.ptr,
                    state: StatePool {
                        base: self.input(node, Tensor::RecurrentState)?.ptr,
                        num_slots: ssm.num_slots,
                        slot_stride: ssm.recurrent_slot_stride,
                    },
                    qk: qk.ptr,
                    conv: self.input(node, Tensor::GdnConv)?.ptr,
                    gates: self.input(node, Tensor::GdnGates)?.ptr,
                    seqs: self.seqs(node, qk.rows)?,
                    heads: g.heads,
                };
                if node.op == Op::GdnRecurrenceVerify {
                    let row_slot = self.input(node, Tensor::RowSlot)?.ptr;
                    ops.gated_delta_verify(s, &rule, row_slot)?;
                } else {
                    ops.gated_delta_recurrent(s, &rule)?;
                }
            }
            (Op::GdnGatedNorm, [kernel @ k::GATED_RMS_NORM]) => {
                let g = self.gdn(b)?;
                let core = self.input(node, Tensor::GdnCore)?;
                ops.gated_rms_norm(
                    s,
                    &GatedRmsNorm {
                        out: self.output(node, Tensor::GdnNormed)?.ptr,
                        core: core.ptr,
                        proj: self.input(node, Tensor::GdnProj)?.ptr,
                        layout: self.gdn_layout(b, core.rows)?,
                        weight: self.weight(b, WeightSlot::GdnNorm, *kernel)?,
                        rows: u("rows", core.rows)?,
                        heads: g.heads,
                        eps: g.eps,
                    },
                )?;
            }
            _ => return self.moe_single(node, kernels),
        }
        Ok(true)
    }

    /// Emit a one-node group of an MoE op; `false` when no emitter lowers `node` to `kernels`
    /// (after the draft step's emitters).
    fn moe_single(&self, node: &Node, kernels: &[Kernel]) -> Result<bool> {
        let (ops, s, b) = (self.ops, self.stream, node.block);
        let u = |what: &'static str, v: u64| self.u32(b, what, v);
        match (node.op, kernels) {
            (
                Op::Linear(role),
                [
                    kernel @ (k::EXPERT_LINEAR
                    | k::EXPERT_LINEAR_F32OUT
                    | k::EXPERT_LINEAR_FP8
                    | k::EXPERT_LINEAR_FP8_F32OUT),
                ],
            ) => {
                let x = self.nth(node, 0, false)?;
                let ids = self.input(node, Tensor::MoeTopkIds)?;
                let out = self.nth(node, 0, true)?;
                let moe = self.moe(b)?;
                let slot = WeightSlot::Linear(role);
                let p = ExpertLinear {
                    out: out.ptr,
                    x: x.ptr,
                    w: self.weight(b, slot, *kernel)?,
                    expert_ids: ids.ptr,
                    pairs: u("pairs", out.rows)?,
                    n: u("output columns", out.cols)?,
                    k: u("input columns", x.cols)?,
                    num_experts: moe.shape.num_experts,
                    pairs_per_x_row: u("pairs per row", out.rows / x.rows.max(1))?,
                };
                // The stacked weight as the `[E * n, k]` matrix the expert kernels read.
                let scales = self.bound_scales(b, slot);
                let dtype = if scales.is_some() {
                    DType::F8E4M3
                } else {
                    DType::Bf16
                };
                let rows = p.num_experts.saturating_mul(p.n);
                let stacked = Matrix {
                    scales,
                    ..Matrix::new(p.w, dtype, rows, p.k)
                };
                let f32_out = matches!(
                    *kernel,
                    k::EXPERT_LINEAR_F32OUT | k::EXPERT_LINEAR_FP8_F32OUT
                );
                ops.expert_projection(s, &p, stacked, f32_out)?;
            }
            (Op::MoeRoute, [k::TOPK_ROUTE]) => {
                let moe = self.moe(b)?;
                let logits = self.input(node, Tensor::MoeRouterLogits)?;
                let ids = self.output(node, Tensor::MoeTopkIds)?;
                let weights = self.output(node, Tensor::MoeTopkWeights)?;
                let route = TopkRoute {
                    topk_ids: ids.ptr,
                    topk_weights: weights.ptr,
                    logits: logits.ptr,
                    rows: u("rows", logits.rows)?,
                    num_experts: u("experts", logits.cols)?,
                    top_k: u("experts per token", ids.cols)?,
                    renormalize: moe.shape.renormalize as u32,
                };
                ops.topk_route(s, &route)?;
            }
            (Op::MoeCombine, [k::MOE_COMBINE]) => {
                let out = self.output(node, Tensor::Delta)?;
                let weights = self.input(node, Tensor::MoeTopkWeights)?;
                let optional = |t: Tensor| -> Result<DevicePtr> {
                    if self.reads(node, t) {
                        Ok(self.input(node, t)?.ptr)
                    } else {
                        Ok(DevicePtr::NULL)
                    }
                };
                ops.moe_combine(
                    s,
                    &MoeCombine {
                        out: out.ptr,
                        expert_out: self.input(node, Tensor::MoeExpertOut)?.ptr,
                        topk_weights: weights.ptr,
                        shared_out: optional(Tensor::MoeSharedOut)?,
                        shared_gate: optional(Tensor::MoeSharedGate)?,
                        rows: u("rows", out.rows)?,
                        hidden: u("hidden", out.cols)?,
                        top_k: u("experts per token", weights.cols)?,
                    },
                )?;
            }
            _ => return self.draft_single(node, kernels),
        }
        Ok(true)
    }

    /// The GDN kernels' view of the step's sequences.
    fn seqs(&self, node: &Node, rows: u64) -> Result<GdnSeqs> {
        let b = node.block;
        let slot = self.input(node, Tensor::SeqSlot)?;
        Ok(GdnSeqs {
            row_seq: self.input(node, Tensor::RowSeq)?.ptr,
            seq_start: self.input(node, Tensor::SeqStart)?.ptr,
            seq_slot: slot.ptr,
            positions: self.input(node, Tensor::Positions)?.ptr,
            rows: self.u32(b, "rows", rows)?,
            num_seqs: self.u32(b, "sequences", slot.rows)?,
        })
    }
}
