//! `DraftBinding`: the MTP draft head as the executor sees it (its two input norms, `fc`, its
//! final norm, its decoder layer by slot with the attention facts of its cache), and
//! [`draft_problems`], its part of `check_bindings`: every problem labelled as the draft
//! head's (`Part::Draft`, `Part::DraftLayer`, `Block::Draft`, `Block::DraftLayer`).
//!
//! Invariants:
//! - The draft circuit models one head layer (`Instance::draft_layer`), the layer every draft
//!   of the Qwen3.5 / Qwen3-Next checkpoints runs; a head of several layers is refused.
//! - The embedding and the LM head the draft step reads are the model's ([`HeadBinding`]).

use metrale_circuit::{Block, Circuit, LinearRole};

use super::bindings::{BoundWeight, CircuitLayer, HeadBinding, WeightSlot, layer_problems};
use super::error::{BindingProblem, CircuitExecError, Part};
use super::fixed::LayerPools;
use super::weights_check::weight_problems;

/// See the module header.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftBinding {
    /// `[hidden]`: `pre_fc_norm_embedding`.
    pub norm_embedding: BoundWeight,
    /// `[hidden]`: `pre_fc_norm_hidden`.
    pub norm_hidden: BoundWeight,
    /// `[hidden, 2 * hidden]`: `fc`.
    pub fc: BoundWeight,
    /// `[hidden]`: `mtp.norm`.
    pub norm: BoundWeight,
    /// The head's decoder layers, in order (`CircuitBindings::circuit_layer`).
    pub layers: Vec<Option<CircuitLayer>>,
    /// Features of the head the circuit does not model.
    pub unmodelled: Vec<String>,
}

impl DraftBinding {
    /// The head's own weight in `slot`, if it has one there.
    pub fn weight(&self, slot: WeightSlot) -> Option<&BoundWeight> {
        match slot {
            WeightSlot::DraftNormEmbedding => Some(&self.norm_embedding),
            WeightSlot::DraftNormHidden => Some(&self.norm_hidden),
            WeightSlot::DraftNorm => Some(&self.norm),
            WeightSlot::Linear(LinearRole::Fc) => Some(&self.fc),
            _ => None,
        }
    }
}

/// Every problem of `draft` (with the head layers' `pools`) against the draft circuit `circuit`,
/// the model's `head` supplying the embedding and the LM head; the bound head layers, in order.
/// Without a binding, the one problem is that the head is unbound.
pub(crate) fn draft_problems(
    circuit: &Circuit,
    draft: Option<&DraftBinding>,
    head: &HeadBinding,
    pools: &[LayerPools],
) -> Result<(Vec<BindingProblem>, Vec<CircuitLayer>), CircuitExecError> {
    let Some(draft) = draft else {
        let unbound = BindingProblem::Unbound { part: Part::Draft };
        return Ok((vec![unbound], Vec::new()));
    };
    let mut problems: Vec<BindingProblem> = (draft.unmodelled.iter())
        .map(|feature| BindingProblem::Unmodelled {
            part: Part::Draft,
            feature: feature.clone(),
        })
        .collect();
    if draft.layers.len() != 1 {
        problems.push(BindingProblem::Unmodelled {
            part: Part::Draft,
            feature: format!(
                "an MTP head of {} layers (the draft circuit has one)",
                draft.layers.len()
            ),
        });
    }
    let want = circuit
        .instance()
        .draft_layer
        .ok_or(CircuitExecError::Circuit(
            metrale_circuit::CircuitError::NoDraftLayer,
        ))?;
    let mut bound = Vec::with_capacity(draft.layers.len());
    let mut agrees = false;
    if let Some(first) = draft.layers.first() {
        match first {
            None => problems.push(BindingProblem::Unbound {
                part: Part::DraftLayer(0),
            }),
            Some(layer) => {
                let pool = pools.first().copied().unwrap_or_default();
                let part = Part::DraftLayer(0);
                agrees = layer_problems(part, layer, want, Some(pool), circuit, &mut problems);
            }
        }
    }
    bound.extend(draft.layers.iter().flatten().cloned());
    let layer = draft.layers.first().and_then(Option::as_ref);
    let lookup = |block: Block, slot: WeightSlot| match block {
        Block::Embed | Block::Head => Some(head.weight(slot)),
        Block::Draft => Some(draft.weight(slot)),
        Block::DraftLayer(0) if agrees => layer.map(|l| l.weights.get(&slot)),
        Block::Layer(_) | Block::DraftLayer(_) => None,
    };
    let checked: Vec<(Block, &CircuitLayer)> = match layer {
        Some(l) if agrees => vec![(Block::DraftLayer(0), l)],
        _ => Vec::new(),
    };
    weight_problems(circuit, &lookup, &checked, &mut problems)?;
    Ok((problems, bound))
}
