//! `DecoderLayer`: input norm, a mixer (attention, or Gated DeltaNet in the hybrid families),
//! post norm, an FFN (dense or sparse MoE). The input norm is fused with the add of the previous layer's output.

use std::collections::BTreeMap;

use metrale_gpu_runtime::{DevicePtr, GpuResult};

use super::{Attention, GatedDeltaNet, Mlp, MoeMlp};
use crate::circuit_exec::{CircuitBindings, CircuitLayer, MixerFacts, WeightSlot};
use crate::layer::{LayerCtx, ModelDims, TransformerLayer};
use crate::ops::Matrix;
use crate::weight_map::DenseWeight;

/// The token mixer of a layer.
#[derive(Debug, Clone)]
#[expect(
    clippy::large_enum_variant,
    reason = "one mixer per layer, built once at load: boxing would buy nothing"
)]
pub enum Mixer {
    /// Full softmax attention over the paged KV cache.
    Attention(Attention),
    /// Gated DeltaNet linear attention over the SSM state pool.
    GatedDeltaNet(GatedDeltaNet),
}

/// The feed-forward block of a layer.
#[derive(Debug, Clone)]
pub enum Ffn {
    /// Dense SwiGLU.
    Dense(Mlp),
    /// Sparse mixture of experts with a shared expert.
    Moe(Box<MoeMlp>),
}

/// See the module header.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// `input_layernorm`.
    pub input_norm: DenseWeight,
    /// `post_attention_layernorm`.
    pub post_norm: DenseWeight,
    /// The mixer.
    pub mixer: Mixer,
    /// The FFN.
    pub ffn: Ffn,
}

impl TransformerLayer for DecoderLayer {
    fn forward(&self, cx: &LayerCtx<'_>) -> GpuResult<()> {
        let (ops, s, buf, d, rows) = (cx.ops, cx.stream, cx.buf, cx.dims, cx.shape.rows);
        // The norm ahead of a dense projection also writes its rows as the projection's stage
        // images where the staging buffer serves it (`Ops::linear_staging`): prefill sizes
        // (sparing the projection's permute) and most decode sizes (the projection's blocks
        // bulk-copy their segments of x).
        let mixer_staged = match &self.mixer {
            _ if cx.first => None,
            Mixer::Attention(a) => ops.linear_staging(s, a.qkv.matrix(), rows)?,
            Mixer::GatedDeltaNet(g) => ops.linear_staging(s, g.in_proj.matrix(), rows)?,
        };
        if cx.first {
            let normed = Matrix::bf16(buf.acts.normed, rows, d.hidden);
            let residual = Matrix::f32(buf.acts.residual, rows, d.hidden);
            ops.rms_norm(s, normed, residual, &d.norm(self.input_norm.ptr))?;
        } else {
            self.residual_norm(cx, self.input_norm.ptr, mixer_staged)?;
        }
        match &self.mixer {
            Mixer::Attention(a) => a.forward(cx, mixer_staged)?,
            Mixer::GatedDeltaNet(g) => g.forward(cx, mixer_staged)?,
        }
        let ffn_staged = match &self.ffn {
            Ffn::Dense(m) => ops.linear_staging(s, m.gate_up.matrix(), rows)?,
            Ffn::Moe(_) => None,
        };
        self.residual_norm(cx, self.post_norm.ptr, ffn_staged)?;
        match &self.ffn {
            Ffn::Dense(m) => m.forward(cx, ffn_staged),
            Ffn::Moe(m) => m.forward(cx),
        }
    }

    fn uses_kv_cache(&self) -> bool {
        matches!(self.mixer, Mixer::Attention(_))
    }

    fn uses_ssm_state(&self) -> bool {
        matches!(self.mixer, Mixer::GatedDeltaNet(_))
    }
}

impl CircuitBindings for DecoderLayer {
    fn circuit_layer(&self, dims: &ModelDims) -> Option<CircuitLayer> {
        let mut weights = BTreeMap::new();
        let mut unmodelled = Vec::new();
        weights.insert(WeightSlot::InputNorm, (&self.input_norm).into());
        weights.insert(WeightSlot::PostNorm, (&self.post_norm).into());
        let mixer = match &self.mixer {
            Mixer::Attention(a) => {
                MixerFacts::Attention(a.circuit_facts(dims, &mut weights, &mut unmodelled))
            }
            Mixer::GatedDeltaNet(g) => MixerFacts::Gdn(g.circuit_facts(&mut weights)),
        };
        let ffn = match &self.ffn {
            Ffn::Dense(m) => m.circuit_facts(&mut weights),
            Ffn::Moe(m) => m.circuit_facts(&mut weights),
        };
        Some(CircuitLayer {
            mixer,
            ffn,
            weights,
            unmodelled,
        })
    }
}

impl DecoderLayer {
    /// `residual += delta; normed = rms_norm(residual) · norm`, the rows also written as stage
    /// images at `staged` when given.
    fn residual_norm(
        &self,
        cx: &LayerCtx<'_>,
        norm: DevicePtr,
        staged: Option<DevicePtr>,
    ) -> GpuResult<()> {
        let (ops, s, buf, d, rows) = (cx.ops, cx.stream, cx.buf, cx.dims, cx.shape.rows);
        let residual = Matrix::f32(buf.acts.residual, rows, d.hidden);
        let delta = Matrix::bf16(buf.acts.delta, rows, d.hidden);
        let normed = Matrix::bf16(buf.acts.normed, rows, d.hidden);
        match staged {
            Some(images) => {
                ops.add_rms_norm_staged(s, (residual, delta, normed), images, &d.norm(norm))
            }
            None => ops.add_rms_norm(s, residual, delta, normed, &d.norm(norm)),
        }
    }
}
