//! `GatedDeltaNet`: the linear-attention mixer of the Qwen3.5 / Qwen3.5-MoE / Qwen3-Next families
//! (transformers' `Qwen3_5GatedDeltaNet`, `Qwen3NextGatedDeltaNet`), over a step of rows whose
//! sequences carry their conv window and recurrent state in SSM pool slots.
//!
//! One forward: input projection → causal conv + SiLU (reading each sequence's window) →
//! window update → L2-normalised q, k and the gates β, g → gated delta rule (token by token when
//! every sequence has one row, else in position-aligned chunks of 64) → per-head RMSNorm times
//! `silu(z)` → output projection into `delta`. A verify step (`StepShape::verify`) runs the rule
//! token by token and keeps the window and state after every row in the row's own slot
//! (`StepBuffers::row_slot`), so a rejected draft rolls back by choosing a slot.
//!
//! Weight layouts the loader produces (Hk key heads of Dk, Hv value heads of Dv, r = Hv / Hk,
//! `conv_dim = 2*Hk*Dk + Hv*Dv`, K conv taps):
//! - `in_proj` and `in_proj_ba`, the input projection's rows `[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)
//!   | z (Hv*Dv) | b (Hv) | a (Hv)]`. Qwen3.5 / Qwen3.5-MoE: `in_proj_qkv`, `in_proj_z`,
//!   `in_proj_b`, `in_proj_a` stacked in that order. Qwen3-Next: the rows of `in_proj_qkvz` and
//!   `in_proj_ba`, which are grouped per key head, permuted by
//!   [`GdnShape::qwen3_next_in_proj_rows`]. A bf16 model holds them all in `in_proj`, bf16
//!   `[conv_dim + Hv*Dv + 2*Hv, hidden]`, one GEMM writing `[rows, proj_width]`. A block-FP8
//!   model (an FP8 pack, which keeps b and a in bf16, or one quantized at load) holds the
//!   q|k|v|z rows in `in_proj`, block FP8 `[conv_dim + Hv*Dv, hidden]`, and the b|a rows in
//!   `in_proj_ba`, bf16 `[2*Hv, hidden]`: two GEMMs write the same buffer, `[rows, conv_dim +
//!   Hv*Dv]` and then `[rows, 2*Hv]` ([`GdnProjLayout::split`]), so the FP8 rows are read as
//!   FP8. Every projected element is the same dot product either way, so the two layouts give
//!   the same bits.
//! - `conv1d`, bf16 `[conv_dim, K]`: `conv1d.weight` `[conv_dim, 1, K]` as stored (its channels
//!   are already `[q | k | v]` in every family).
//! - `a_log`, `dt_bias`: f32 `[Hv]`, the checkpoint's `A_log` and `dt_bias` widened to f32.
//! - `norm`, bf16 `[Dv]`: `norm.weight`, applied as `x * w` (not `1 + w`).
//! - `out_proj`, bf16 `[hidden, Hv*Dv]`.
//!
//! Invariants:
//! - The layer reads `normed` and the step's sequence buffers, writes only `StepBuffers::gdn`,
//!   `delta` and its slots of the SSM pools; each row's result depends only on its sequence's
//!   rows and state (batch invariance).

#[cfg(test)]
pub(crate) mod tests;

use std::collections::BTreeMap;

use metrale_circuit::LinearRole;
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{DevicePtr, GpuError, GpuResult};

use crate::circuit_exec::{BoundWeight, GdnFacts, WeightSlot};
use crate::layer::LayerCtx;
use crate::ops::Matrix;
use crate::ops_hybrid::{
    CausalConv1d, GatedDelta, GatedRmsNorm, GdnHeads, GdnPrepare, GdnProjLayout, GdnSeqs, StatePool,
};
use crate::weight_map::DenseWeight;

/// Rows per chunk of the chunked delta rule (transformers' `chunk_size`, FLA's `BT`).
pub const GDN_CHUNK: u32 = 64;
/// The L2-norm epsilon of q and k (transformers' `l2norm`).
pub const GDN_L2_EPS: f32 = 1e-6;

/// q's scale in `gdn_prepare`: `1 / sqrt(Dk)`, computed in f64 as transformers does.
pub(crate) fn gdn_q_scale(k_head_dim: u32) -> f32 {
    (k_head_dim as f64).powf(-0.5) as f32
}

/// The dimensions of a GDN layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnShape {
    /// Heads.
    pub heads: GdnHeads,
    /// Conv taps `K` (`linear_conv_kernel_dim`).
    pub conv_kernel: u32,
    /// Epsilon of the gated RMSNorm (`rms_norm_eps`).
    pub eps: f32,
}

/// Where a row of the fused input projection comes from in a Qwen3-Next checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InProjSource {
    /// A row of `linear_attn.in_proj_qkvz.weight`.
    Qkvz(usize),
    /// A row of `linear_attn.in_proj_ba.weight`.
    Ba(usize),
}

impl GdnShape {
    /// The GDN shape of a hybrid config; `None` for a family without linear attention.
    pub fn from_config(config: &ModelConfig) -> Option<GdnShape> {
        let l = config.linear.as_ref()?;
        Some(GdnShape {
            heads: GdnHeads {
                num_k_heads: l.num_key_heads as u32,
                k_head_dim: l.key_head_dim as u32,
                num_v_heads: l.num_value_heads as u32,
                v_head_dim: l.value_head_dim as u32,
            },
            conv_kernel: l.conv_kernel_dim as u32,
            eps: config.rms_norm_eps,
        })
    }

    /// For each row of the fused `[q | k | v | z | b | a]` projection, its source row in
    /// Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`.
    ///
    /// Those hold, per key head `h`, `in_proj_qkvz` rows `h*G ..`: `[q_h (Dk) | k_h (Dk) |
    /// v of value heads h*r..h*r+r (r*Dv) | z of the same (r*Dv)]` with `G = 2*Dk + 2*r*Dv`, and
    /// `in_proj_ba` rows `h*2r ..`: `[b of value heads h*r.. (r) | a of the same (r)]`
    /// (`fix_query_key_value_ordering`). So, for key head `h`, value head `j = h*r + m`:
    /// `q[h*Dk + i] ← qkvz[h*G + i]`, `k[h*Dk + i] ← qkvz[h*G + Dk + i]`,
    /// `v[j*Dv + i] ← qkvz[h*G + 2*Dk + m*Dv + i]`, `z[j*Dv + i] ← qkvz[h*G + 2*Dk + r*Dv + m*Dv + i]`,
    /// `b[j] ← ba[h*2r + m]`, `a[j] ← ba[h*2r + r + m]`.
    pub fn qwen3_next_in_proj_rows(&self) -> Vec<InProjSource> {
        let h = &self.heads;
        let (hk, dk, dv) = (
            h.num_k_heads as usize,
            h.k_head_dim as usize,
            h.v_head_dim as usize,
        );
        let r = (h.num_v_heads / h.num_k_heads.max(1)) as usize;
        let g = 2 * dk + 2 * r * dv;
        let mut rows = Vec::with_capacity(h.proj_width() as usize);
        for part in 0..2 {
            for kh in 0..hk {
                rows.extend((0..dk).map(|i| InProjSource::Qkvz(kh * g + part * dk + i)));
            }
        }
        for part in 0..2 {
            for kh in 0..hk {
                for m in 0..r {
                    let at = kh * g + 2 * dk + part * r * dv + m * dv;
                    rows.extend((0..dv).map(|i| InProjSource::Qkvz(at + i)));
                }
            }
        }
        for part in 0..2 {
            for kh in 0..hk {
                rows.extend((0..r).map(|m| InProjSource::Ba(kh * 2 * r + part * r + m)));
            }
        }
        rows
    }
}

/// One GDN layer's weights; layouts in the module header.
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// bf16 `[conv_dim + Hv*Dv + 2*Hv, hidden]`: `[q | k | v | z | b | a]`; or, with
    /// `in_proj_ba`, `[conv_dim + Hv*Dv, hidden]`: `[q | k | v | z]` (block FP8).
    pub in_proj: DenseWeight,
    /// bf16 `[2*Hv, hidden]`: `[b | a]`, where they are not rows of `in_proj`.
    pub in_proj_ba: Option<DenseWeight>,
    /// bf16 `[conv_dim, K]`.
    pub conv1d: DenseWeight,
    /// f32 `[Hv]`: `A_log`.
    pub a_log: DenseWeight,
    /// f32 `[Hv]`: `dt_bias`.
    pub dt_bias: DenseWeight,
    /// bf16 `[Dv]`: the gated norm's plain weight.
    pub norm: DenseWeight,
    /// bf16 `[hidden, Hv*Dv]`.
    pub out_proj: DenseWeight,
    /// Dimensions.
    pub shape: GdnShape,
}

impl GatedDeltaNet {
    /// Run the mixer on `normed`, leaving the projected output in `delta` and each sequence's
    /// state advanced past its rows. `staged`: `normed` was also written as stage images there
    /// (`Ops::linear_staging`), which the input projection reads.
    pub fn forward(&self, cx: &LayerCtx<'_>, staged: Option<DevicePtr>) -> GpuResult<()> {
        let (ops, s, buf, d) = (cx.ops, cx.stream, cx.buf, cx.dims);
        let ssm = cx.ssm.ok_or_else(|| GpuError::KernelFailed {
            kernel: "GatedDeltaNet::forward".into(),
            problem: "a GDN layer was run without an SSM state binding".into(),
        })?;
        let (rows, h, g) = (cx.shape.rows, self.shape.heads, &buf.gdn);
        let seqs = GdnSeqs {
            row_seq: buf.meta.row_seq,
            seq_start: buf.meta.seq_start,
            seq_slot: buf.meta.seq_slot,
            positions: buf.meta.positions,
            rows,
            num_seqs: cx.shape.num_seqs,
        };
        let layout = GdnProjLayout::of_step(&h, rows, self.in_proj_ba.is_some())?;
        let normed = Matrix::bf16(buf.acts.normed, rows, d.hidden);
        let proj = Matrix::bf16(g.proj, rows, layout.proj_stride);
        match staged {
            Some(images) => ops.linear_staged(s, (proj, normed, self.in_proj.matrix()), images)?,
            None => ops.linear(s, proj, normed, self.in_proj.matrix())?,
        }
        if let Some(ba) = &self.in_proj_ba {
            let at = g.proj.offset(layout.ba_offset as usize * 2);
            let ba_out = Matrix::bf16(at, rows, layout.ba_stride);
            ops.linear(s, ba_out, normed, ba.matrix())?;
        }
        let conv = CausalConv1d {
            out: g.conv,
            proj: g.proj,
            layout,
            conv_state: StatePool {
                base: ssm.conv,
                num_slots: ssm.num_slots,
                slot_stride: ssm.conv_slot_stride,
            },
            weight: self.conv1d.ptr,
            seqs,
            heads: h,
            kernel_size: self.shape.conv_kernel,
        };
        ops.causal_conv1d(s, &conv)?;
        if cx.shape.verify {
            ops.conv_state_verify(s, &conv, buf.meta.row_slot)?;
        } else {
            ops.conv_state_update(s, &conv)?;
        }
        ops.gdn_prepare(
            s,
            &GdnPrepare {
                qk: g.qk,
                gates: g.gates,
                conv: g.conv,
                proj: g.proj,
                layout,
                a_log: self.a_log.ptr,
                dt_bias: self.dt_bias.ptr,
                rows,
                heads: h,
                l2_eps: GDN_L2_EPS,
                q_scale: gdn_q_scale(h.k_head_dim),
            },
        )?;
        let rule = GatedDelta {
            out: g.core,
            state: StatePool {
                base: ssm.recurrent,
                num_slots: ssm.num_slots,
                slot_stride: ssm.recurrent_slot_stride,
            },
            qk: g.qk,
            conv: g.conv,
            gates: g.gates,
            seqs,
            heads: h,
        };
        // A verify step: token by token, each row's state kept in its own slot. One row per
        // sequence: decode. Otherwise chunks; a one-row chunk is the recurrent step bitwise, so
        // the choice never changes a sequence's result.
        if cx.shape.verify {
            ops.gated_delta_verify(s, &rule, buf.meta.row_slot)?;
        } else if rows == cx.shape.num_seqs {
            ops.gated_delta_recurrent(s, &rule)?;
        } else {
            ops.gated_delta_chunked(s, &rule, GDN_CHUNK)?;
        }
        ops.gated_rms_norm(
            s,
            &GatedRmsNorm {
                out: g.normed,
                core: g.core,
                proj: g.proj,
                layout,
                weight: self.norm.ptr,
                rows,
                heads: h,
                eps: self.shape.eps,
            },
        )?;
        let normed = Matrix::bf16(g.normed, rows, h.value_dim());
        cx.row_parallel(normed, self.out_proj.matrix())
    }

    /// Bind the mixer's weights into `weights` and return the facts its kernels read.
    pub(crate) fn circuit_facts(
        &self,
        weights: &mut BTreeMap<WeightSlot, BoundWeight>,
    ) -> GdnFacts {
        for (slot, w) in [
            (WeightSlot::Linear(LinearRole::GdnInProj), &self.in_proj),
            (WeightSlot::Linear(LinearRole::GdnOut), &self.out_proj),
            (WeightSlot::GdnConv1d, &self.conv1d),
            (WeightSlot::GdnALog, &self.a_log),
            (WeightSlot::GdnDtBias, &self.dt_bias),
            (WeightSlot::GdnNorm, &self.norm),
        ] {
            weights.insert(slot, w.into());
        }
        if let Some(ba) = &self.in_proj_ba {
            weights.insert(WeightSlot::GdnInProjBa, ba.into());
        }
        GdnFacts {
            heads: self.shape.heads,
            conv_kernel: self.shape.conv_kernel,
            eps: self.shape.eps,
            l2_eps: GDN_L2_EPS,
            q_scale: gdn_q_scale(self.shape.heads.k_head_dim),
        }
    }
}
