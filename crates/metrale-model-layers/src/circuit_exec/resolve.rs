//! Which binding, weights and pools a node of each block reads: a decoder layer's
//! (`Block::Layer`), the model's head's (`Block::Embed`, `Block::Head`), or the MTP draft
//! head's (`Block::Draft`: its own norms and `fc`; `Block::DraftLayer`: its decoder layer and
//! that layer's KV pools).

use metrale_circuit::{Block, Kernel};
use metrale_gpu_runtime::DevicePtr;

use super::bindings::{
    AttnFacts, BoundWeight, CircuitLayer, FfnFacts, GdnFacts, MixerFacts, MoeFacts, WeightSlot,
    expected_family,
};
use super::emit::Emitter;
use super::error::{BindingProblem, CircuitExecError};
use super::fixed::LayerPools;
use crate::layer::{KvBinding, SsmBinding};
use crate::ops::BlockScales;
use crate::ops_hybrid::GdnProjLayout;

type Result<T> = std::result::Result<T, CircuitExecError>;

impl Emitter<'_> {
    /// The weight bound in `slot` of `block`, if one is.
    fn bound(&self, block: Block, slot: WeightSlot) -> Option<&BoundWeight> {
        match block {
            Block::Layer(_) | Block::DraftLayer(_) => {
                self.layer(block).ok().and_then(|l| l.weights.get(&slot))
            }
            Block::Embed | Block::Head => self.head.weight(slot),
            Block::Draft => self.draft.and_then(|d| d.weight(slot)),
        }
    }

    /// The block scales of the weight in `slot` of `block`: `Some` for a block-FP8 weight.
    pub(super) fn bound_scales(&self, block: Block, slot: WeightSlot) -> Option<BlockScales> {
        self.bound(block, slot).and_then(|b| b.weight().scales)
    }

    /// The weight in `slot` as `kernel` reads it.
    pub(super) fn weight(
        &self,
        block: Block,
        slot: WeightSlot,
        kernel: Kernel,
    ) -> Result<DevicePtr> {
        let Some(bound) = self.bound(block, slot) else {
            return Err(CircuitExecError::Bindings {
                problems: vec![BindingProblem::MissingWeight { block, slot }],
            });
        };
        let expected = expected_family(kernel, slot);
        if bound.family() != expected {
            return Err(CircuitExecError::WeightFormat {
                block,
                slot,
                kernel,
                bound: bound.family(),
                expected,
            });
        }
        Ok(bound.ptr())
    }

    pub(super) fn layer(&self, block: Block) -> Result<&CircuitLayer> {
        match block {
            Block::Layer(i) => self.layers.get(i),
            Block::DraftLayer(i) => self.draft_layers.get(i),
            Block::Embed | Block::Head | Block::Draft => None,
        }
        .ok_or(Self::mismatch(block, "a layer binding"))
    }

    fn mismatch(block: Block, what: &'static str) -> CircuitExecError {
        CircuitExecError::MissingFacts { block, what }
    }

    pub(super) fn attn(&self, block: Block) -> Result<AttnFacts> {
        match self.layer(block)?.mixer {
            MixerFacts::Attention(a) => Ok(a),
            MixerFacts::Gdn(_) => Err(Self::mismatch(block, "attention facts")),
        }
    }

    /// Where a step of `rows` rows of `block`'s GDN layer holds its input projection: q|k|v|z
    /// and b|a apart where the layer binds its b|a rows on their own (its input projection's
    /// emitter writes them so), else one fused matrix.
    pub(super) fn gdn_layout(&self, block: Block, rows: u64) -> Result<GdnProjLayout> {
        let g = self.gdn(block)?;
        let split = self.bound(block, WeightSlot::GdnInProjBa).is_some();
        let rows = self.u32(block, "rows", rows)?;
        Ok(GdnProjLayout::of_step(&g.heads, rows, split)?)
    }

    pub(super) fn gdn(&self, block: Block) -> Result<GdnFacts> {
        match self.layer(block)?.mixer {
            MixerFacts::Gdn(g) => Ok(g),
            MixerFacts::Attention(_) => Err(Self::mismatch(block, "Gated DeltaNet facts")),
        }
    }

    pub(super) fn moe(&self, block: Block) -> Result<MoeFacts> {
        match self.layer(block)?.ffn {
            FfnFacts::Moe(m) => Ok(m),
            FfnFacts::Dense { .. } => Err(Self::mismatch(block, "MoE facts")),
        }
    }

    fn pools(&self, block: Block) -> LayerPools {
        self.fixed.pools(block)
    }

    pub(super) fn kv(&self, block: Block) -> Result<KvBinding> {
        self.pools(block)
            .kv
            .ok_or(Self::mismatch(block, "a KV cache binding"))
    }

    pub(super) fn ssm(&self, block: Block) -> Result<SsmBinding> {
        self.pools(block)
            .ssm
            .ok_or(Self::mismatch(block, "an SSM state binding"))
    }
}
