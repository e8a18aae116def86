//! The circuit of each architecture: one decode (or verify) step, node by node, in the order the engine's
//! legacy forward launches it (`Model::launch_step`, `DecoderLayer::forward` and the
//! mixers and FFNs it calls).
//!
//! The step is: embedding; per layer the input norm (a plain RMSNorm on the first layer, the
//! residual add fused with the norm after), the mixer (full attention or Gated DeltaNet), the
//! post norm (add fused), the FFN (dense or MoE), each leaving its output in `delta`; then the
//! final norm (add fused), the logit rows, the LM head and, when asked, the argmax. What varies
//! by architecture is which layers exist, the norm weighting, the q/k norm and the attention
//! gate, all read from [`Architecture`]. A verify step differs only in its GDN layers, whose
//! conv and rule keep the state after each row in the row's slot ([`Step::Verify`]). A draft
//! step ([`Step::Draft`]) is the MTP head: the embedding, the head's two input norms, their
//! concat and `fc`, its one decoder layer (the same subgraph a decoder layer has), its final
//! norm, and the shared LM head on the logit row (`Model::launch_mtp`).

use crate::circuit::Builder;
use crate::error::CircuitError;
use crate::instance::{Architecture, Instance, Step};
use crate::op::{Block, FfnKind, LayerKind, LayerSpec, LinearRole, NormRole, Op};
use crate::tensor::Tensor as T;

/// Append `instance`'s step to `b`; a draft step without a draft layer is refused.
pub(crate) fn build(instance: &Instance, step: Step, b: &mut Builder) -> Result<(), CircuitError> {
    let arch = instance.architecture;
    b.node(Block::Embed, Op::Embedding, &[T::TokenIds], &[T::Residual]);
    if step == Step::Draft {
        let layer = instance.draft_layer.ok_or(CircuitError::NoDraftLayer)?;
        draft_head(b, instance, layer);
    } else {
        for (i, &layer) in instance.layers.iter().enumerate() {
            decoder_layer(b, instance, Block::Layer(i), layer, step);
        }
        add_norm(b, Block::Head, NormRole::Final, arch);
    }
    lm_head(b, instance);
    Ok(())
}

/// One decoder layer, `residual` (plus `delta` after the first) to `delta`.
fn decoder_layer(b: &mut Builder, instance: &Instance, blk: Block, layer: LayerSpec, step: Step) {
    let arch = instance.architecture;
    if matches!(blk, Block::Layer(0) | Block::DraftLayer(_)) {
        let op = Op::RmsNorm {
            role: NormRole::Input,
            weight: arch.norm_weight(),
        };
        b.node(blk, op, &[T::Residual], &[T::Normed]);
    } else {
        add_norm(b, blk, NormRole::Input, arch);
    }
    match layer.kind {
        LayerKind::FullAttention => attention(b, blk, arch),
        LayerKind::LinearAttention => gdn(b, blk, step),
    }
    add_norm(b, blk, NormRole::Post, arch);
    match layer.ffn {
        FfnKind::Dense => dense_ffn(b, blk),
        FfnKind::Moe => moe_ffn(b, blk, instance),
    }
}

/// The MTP head after the embedding (`Model::launch_mtp`): the normed embedding
/// and the normed hidden row side by side, `fc` into the residual stream, the head's layer
/// (its first: a plain input norm), and its final norm.
fn draft_head(b: &mut Builder, instance: &Instance, layer: LayerSpec) {
    let (blk, weight) = (Block::Draft, instance.architecture.norm_weight());
    let norm = |role| Op::RmsNorm { role, weight };
    b.node(
        blk,
        norm(NormRole::DraftEmbedding),
        &[T::Residual],
        &[T::MtpNormedEmbedding],
    );
    b.node(
        blk,
        norm(NormRole::DraftHidden),
        &[T::MtpHidden],
        &[T::MtpNormedHidden],
    );
    b.node(
        blk,
        Op::DraftConcat,
        &[T::MtpNormedEmbedding, T::MtpNormedHidden, T::MtpCatIds],
        &[T::MtpCat],
    );
    b.node(
        blk,
        Op::Linear(LinearRole::Fc),
        &[T::MtpCat],
        &[T::Residual],
    );
    decoder_layer(b, instance, Block::DraftLayer(0), layer, Step::Draft);
    add_norm(b, blk, NormRole::DraftFinal, instance.architecture);
}

/// The logit rows of `normed`, the LM head and, when asked, the argmax.
fn lm_head(b: &mut Builder, instance: &Instance) {
    let head = Block::Head;
    b.node(
        head,
        Op::GatherRows,
        &[T::Normed, T::LogitRows],
        &[T::LogitsIn],
    );
    b.node(
        head,
        Op::Linear(LinearRole::LmHead),
        &[T::LogitsIn],
        &[T::Logits],
    );
    if instance.argmax {
        b.node(head, Op::Argmax, &[T::Logits], &[T::Sampled]);
    }
}

/// `residual += delta; normed = norm(residual)`.
fn add_norm(b: &mut Builder, blk: Block, role: NormRole, arch: Architecture) {
    b.node(
        blk,
        Op::AddRmsNorm {
            role,
            weight: arch.norm_weight(),
        },
        &[T::Residual, T::Delta],
        &[T::Residual, T::Normed],
    );
}

/// Full attention, `normed` to `delta`.
fn attention(b: &mut Builder, blk: Block, arch: Architecture) {
    b.node(blk, Op::Linear(LinearRole::Qkv), &[T::Normed], &[T::Qkv]);
    b.node(blk, arch.rope_op(), &[T::Qkv, T::Positions], &[T::Qkv]);
    b.node(
        blk,
        Op::KvStore,
        &[T::Qkv, T::SlotMapping, T::KCache, T::VCache],
        &[T::KCache, T::VCache],
    );
    b.node(
        blk,
        Op::PagedAttention {
            gated: arch.attention_gated(),
        },
        &[
            T::Qkv,
            T::KCache,
            T::VCache,
            T::BlockTables,
            T::RowSeq,
            T::Positions,
        ],
        &[T::AttnOut],
    );
    b.node(blk, Op::Linear(LinearRole::O), &[T::AttnOut], &[T::Delta]);
}

/// Gated DeltaNet, `normed` to `delta`: one token per sequence (decode), or each sequence's
/// rows token by token with the state after each row kept in its row slot (verify).
fn gdn(b: &mut Builder, blk: Block, step: Step) {
    const SEQS: [T; 4] = [T::RowSeq, T::SeqStart, T::SeqSlot, T::Positions];
    let verify = step == Step::Verify;
    let (conv, rule) = if verify {
        (Op::GdnConvVerify, Op::GdnRecurrenceVerify)
    } else {
        (Op::GdnConv, Op::GdnRecurrence)
    };
    b.node(
        blk,
        Op::Linear(LinearRole::GdnInProj),
        &[T::Normed],
        &[T::GdnProj],
    );
    let mut reads = vec![T::GdnProj, T::ConvState];
    reads.extend(SEQS);
    reads.extend(verify.then_some(T::RowSlot));
    b.node(blk, conv, &reads, &[T::GdnConv, T::ConvState]);
    b.node(
        blk,
        Op::GdnGates,
        &[T::GdnConv, T::GdnProj],
        &[T::GdnQk, T::GdnGates],
    );
    let mut reads = vec![T::GdnQk, T::GdnConv, T::GdnGates, T::RecurrentState];
    reads.extend(SEQS);
    reads.extend(verify.then_some(T::RowSlot));
    b.node(blk, rule, &reads, &[T::GdnCore, T::RecurrentState]);
    b.node(
        blk,
        Op::GdnGatedNorm,
        &[T::GdnCore, T::GdnProj],
        &[T::GdnNormed],
    );
    b.node(
        blk,
        Op::Linear(LinearRole::GdnOut),
        &[T::GdnNormed],
        &[T::Delta],
    );
}

/// Dense SwiGLU, `normed` to `delta`.
fn dense_ffn(b: &mut Builder, blk: Block) {
    b.node(
        blk,
        Op::Linear(LinearRole::GateUp),
        &[T::Normed],
        &[T::GateUp],
    );
    b.node(blk, Op::SiluMul, &[T::GateUp], &[T::Act]);
    b.node(blk, Op::Linear(LinearRole::Down), &[T::Act], &[T::Delta]);
}

/// Sparse MoE with its shared expert, `normed` to `delta`.
fn moe_ffn(b: &mut Builder, blk: Block, instance: &Instance) {
    use LinearRole::*;
    b.node(blk, Op::Linear(Router), &[T::Normed], &[T::MoeRouterLogits]);
    b.node(
        blk,
        Op::MoeRoute,
        &[T::MoeRouterLogits],
        &[T::MoeTopkIds, T::MoeTopkWeights],
    );
    b.node(
        blk,
        Op::Linear(ExpertGateUp),
        &[T::Normed, T::MoeTopkIds],
        &[T::MoeExpertGateUp],
    );
    b.node(blk, Op::SiluMul, &[T::MoeExpertGateUp], &[T::MoeExpertAct]);
    b.node(
        blk,
        Op::Linear(ExpertDown),
        &[T::MoeExpertAct, T::MoeTopkIds],
        &[T::MoeExpertOut],
    );
    let mut combine = vec![T::MoeExpertOut, T::MoeTopkWeights];
    // Without MoE dims the circuit still gets built; resolving its shapes then names the
    // missing dims.
    let shared = instance.dims.moe.and_then(|m| m.shared);
    if let Some(shared) = shared {
        b.node(
            blk,
            Op::Linear(SharedGateUp),
            &[T::Normed],
            &[T::MoeSharedGateUp],
        );
        b.node(blk, Op::SiluMul, &[T::MoeSharedGateUp], &[T::MoeSharedAct]);
        b.node(
            blk,
            Op::Linear(SharedDown),
            &[T::MoeSharedAct],
            &[T::MoeSharedOut],
        );
        combine.push(T::MoeSharedOut);
        if shared.gated {
            b.node(
                blk,
                Op::Linear(SharedGate),
                &[T::Normed],
                &[T::MoeSharedGate],
            );
            combine.push(T::MoeSharedGate);
        }
    }
    b.node(blk, Op::MoeCombine, &combine, &[T::Delta]);
}
