//! `MtpHead`: the weights of the multi-token-prediction head that Qwen3.5 / Qwen3-Next
//! checkpoints ship (`mtp.*`), loaded with the model and kept for speculative decoding.
//!
//! The head drafts the token after next: `fc([pre_fc_norm_embedding(embed(x_{t+1})) |
//! pre_fc_norm_hidden(h_t)])`, one decoder layer with its own KV cache, `norm`, and the model's
//! LM head. Its norms follow the family's zero-centred convention. The circuit executor's
//! draft programs read it through [`MtpHead::circuit_binding`].

use super::DecoderLayer;
use crate::circuit_exec::{CircuitBindings, DraftBinding};
use crate::layer::ModelDims;
use crate::weight_map::DenseWeight;

/// See the module header.
#[derive(Debug, Clone)]
pub struct MtpHead {
    /// `[hidden, 2 * hidden]`: projects `[normed embedding | normed hidden]`.
    pub fc: DenseWeight,
    /// `[hidden]`: the norm of the next token's embedding.
    pub pre_fc_norm_embedding: DenseWeight,
    /// `[hidden]`: the norm of the target model's last hidden state.
    pub pre_fc_norm_hidden: DenseWeight,
    /// The head's decoder layers (full attention), in order.
    pub layers: Vec<DecoderLayer>,
    /// `[hidden]`: the norm before the shared LM head.
    pub norm: DenseWeight,
}

impl MtpHead {
    /// The head for the circuit executor's draft step: its norms and `fc`, and each layer's
    /// binding (`CircuitBindings::circuit_layer`) at the model's `dims`.
    pub fn circuit_binding(&self, dims: &ModelDims) -> DraftBinding {
        DraftBinding {
            norm_embedding: (&self.pre_fc_norm_embedding).into(),
            norm_hidden: (&self.pre_fc_norm_hidden).into(),
            fc: (&self.fc).into(),
            norm: (&self.norm).into(),
            layers: self.layers.iter().map(|l| l.circuit_layer(dims)).collect(),
            unmodelled: Vec::new(),
        }
    }
}
