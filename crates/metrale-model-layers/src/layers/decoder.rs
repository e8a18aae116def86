//! `DecoderLayer`: input norm, a mixer (attention, or Gated DeltaNet in the hybrid families),
//! post norm, an FFN (dense or sparse MoE). The input norm is fused with the add of the previous layer's output.

use std::collections::BTreeMap;

use metrale_gpu_runtime::GpuResult;

use super::{Attention, GatedDeltaNet, Mlp, MoeMlp};
use crate::circuit_exec::{CircuitBindings, CircuitLayer, MixerFacts, WeightSlot};
use crate::layer::{LayerCtx, ModelDims, TransformerLayer};
use crate::weight_map::DenseWeight;

/// The token mixer of a layer.
#[derive(Debug, Clone)]
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
    Moe(MoeMlp),
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
        if cx.first {
            ops.rms_norm(
                s,
                buf.normed,
                buf.residual,
                self.input_norm.ptr,
                rows,
                d.hidden,
                d.eps,
                d.unit_offset,
            )?;
        } else {
            ops.add_rms_norm(
                s,
                buf.residual,
                buf.delta,
                self.input_norm.ptr,
                buf.normed,
                rows,
                d.hidden,
                d.eps,
                d.unit_offset,
            )?;
        }
        match &self.mixer {
            Mixer::Attention(a) => a.forward(cx)?,
            Mixer::GatedDeltaNet(g) => g.forward(cx)?,
        }
        ops.add_rms_norm(
            s,
            buf.residual,
            buf.delta,
            self.post_norm.ptr,
            buf.normed,
            rows,
            d.hidden,
            d.eps,
            d.unit_offset,
        )?;
        match &self.ffn {
            Ffn::Dense(m) => m.forward(cx),
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
