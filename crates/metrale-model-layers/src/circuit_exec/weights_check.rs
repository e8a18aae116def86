//! The weight check of `check_bindings`: every weight a circuit's node reads is bound, stored as
//! the instance's weight format says (a projection bf16 or block FP8; the GDN input
//! projection's separate b|a rows bf16), with the number of
//! elements (and the row length) the node reads it with, and every weight of a checked layer is
//! read by some node. Shared by the decode circuit (decoder layers, the head)
//! and the draft circuit (the MTP head, its layer, and the shared embedding and LM head).

use std::collections::BTreeMap;

use metrale_circuit::{Block, Circuit, LinearRole, NodeId};
use metrale_gpu_runtime::DType;

use super::bindings::{BoundWeight, CircuitLayer, WeightSlot, slots_read};
use super::error::{BindingProblem, CircuitExecError};

/// Elements a node reads from a weight, and the innermost dimension it reads, derived from
/// the circuit's extents at its first width.
fn expected_weight(
    circuit: &Circuit,
    extents: &[Vec<u64>],
    node: NodeId,
    slot: WeightSlot,
) -> Option<(u64, Option<u64>)> {
    let n = circuit.node(node)?;
    let ext = |i: usize| extents.get(n.inputs.get(i)?.0).map(Vec::as_slice);
    let out = |i: usize| extents.get(n.outputs.get(i)?.0).map(Vec::as_slice);
    let d = &circuit.instance().dims;
    let numel = |e: &[u64]| e.iter().product::<u64>();
    Some(match slot {
        WeightSlot::InputNorm
        | WeightSlot::PostNorm
        | WeightSlot::FinalNorm
        | WeightSlot::DraftNormEmbedding
        | WeightSlot::DraftNormHidden
        | WeightSlot::DraftNorm => (d.hidden, None),
        WeightSlot::Embedding => (d.vocab * d.hidden, Some(d.hidden)),
        WeightSlot::QNorm | WeightSlot::KNorm => (d.head_dim, None),
        WeightSlot::GdnConv1d => {
            let g = d.gdn?;
            let conv_dim = 2 * g.num_k_heads * g.k_head_dim + g.num_v_heads * g.v_head_dim;
            (conv_dim * g.conv_kernel, Some(g.conv_kernel))
        }
        WeightSlot::GdnALog | WeightSlot::GdnDtBias => (d.gdn?.num_v_heads, None),
        WeightSlot::GdnNorm => (d.gdn?.v_head_dim, None),
        WeightSlot::GdnInProjBa => {
            let k = *ext(0)?.last()?;
            (2 * d.gdn?.num_v_heads * k, Some(k))
        }
        WeightSlot::Linear(role @ LinearRole::GdnInProj)
            if circuit.instance().weights.is_fp8(role) =>
        {
            // The q|k|v|z rows: the projection's width but b and a.
            let (x, y) = (ext(0)?, out(0)?);
            let (m, k) = (*x.first()?, *x.last()?);
            let ba = 2 * d.gdn?.num_v_heads;
            ((numel(y) / m.max(1)).checked_sub(ba)? * k, Some(k))
        }
        WeightSlot::Linear(LinearRole::ExpertGateUp | LinearRole::ExpertDown) => {
            let (x, y) = (ext(0)?, out(0)?);
            let (k, cols) = (*x.last()?, *y.last()?);
            (d.moe?.num_experts * cols * k, Some(k))
        }
        WeightSlot::Linear(_) => {
            let (x, y) = (ext(0)?, out(0)?);
            let (m, k) = (*x.first()?, *x.last()?);
            (numel(y) / m.max(1) * k, Some(k))
        }
    })
}

/// What a block's node finds bound in a slot: `None` when the block is reported elsewhere (an
/// unbound, missing or disagreeing layer), else the weight, if any.
pub(crate) type Lookup<'a> = dyn Fn(Block, WeightSlot) -> Option<Option<&'a BoundWeight>> + 'a;

/// Whether the circuit's nodes read the same weights the model bound (`lookup`), with the
/// shapes they read them with, and whether every weight of the `checked` layers is read;
/// problems are pushed onto `problems`.
pub(crate) fn weight_problems<'a>(
    circuit: &Circuit,
    lookup: &Lookup<'a>,
    checked: &[(Block, &'a CircuitLayer)],
    problems: &mut Vec<BindingProblem>,
) -> Result<(), CircuitExecError> {
    let first = (circuit.widths().first().copied()).unwrap_or(circuit.step().width(1));
    let extents = circuit.extents(first)?;
    let mut read: BTreeMap<Block, Vec<WeightSlot>> = BTreeMap::new();
    for (i, node) in circuit.nodes().iter().enumerate() {
        for slot in slots_read(node.op, circuit.instance().weights) {
            read.entry(node.block).or_default().push(slot);
            let Some(bound) = lookup(node.block, slot) else {
                continue;
            };
            let Some(bound) = bound else {
                problems.push(BindingProblem::MissingWeight {
                    block: node.block,
                    slot,
                });
                continue;
            };
            let Some((expected, last)) = expected_weight(circuit, &extents, NodeId(i), slot) else {
                continue;
            };
            let format = circuit.instance().weights;
            let expected_format = match slot {
                WeightSlot::Linear(role) if format.is_fp8(role) => DType::F8E4M3.name(),
                WeightSlot::Linear(_) | WeightSlot::GdnInProjBa => DType::Bf16.name(),
                _ => bound.family(),
            };
            if bound.family() != expected_format {
                problems.push(BindingProblem::WeightStorage {
                    block: node.block,
                    slot,
                    format: format.name(),
                    expected: expected_format,
                    found: bound.family(),
                });
            }
            let shape = bound.shape();
            let numel = shape.iter().map(|&d| d as u64).product::<u64>();
            let last_ok = last.is_none_or(|l| shape.last().map(|&d| d as u64) == Some(l));
            if numel != expected || !last_ok {
                problems.push(BindingProblem::WeightShape {
                    block: node.block,
                    slot,
                    expected,
                    last,
                    found: shape.to_vec(),
                });
            }
        }
    }
    for &(block, layer) in checked {
        let reads = read.get(&block).map(Vec::as_slice).unwrap_or(&[]);
        for &slot in layer.weights.keys() {
            if !reads.contains(&slot) {
                problems.push(BindingProblem::UnreadWeight { block, slot });
            }
        }
    }
    Ok(())
}
