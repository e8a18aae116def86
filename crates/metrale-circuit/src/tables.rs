//! One rule table per architecture ([`RuleTable::for_architecture`]). Each table is its
//! architecture's reference rows (what the legacy forward launches, op by op) followed by its
//! fused rows; the rows shared by several architectures (the step's ends, attention, GDN, the
//! FFNs) are written once below, and every kernel name comes from `kernels.rs`.
//!
//! Invariant: the reference rows of the dense table lower one dense Qwen3 decode step to
//! exactly `embed::embedding_gather`; per layer `norm::rms_norm` (first) or
//! `norm::add_rms_norm`, `gemm::linear`, `rope::qk_norm_rope`, `cache::kv_store`,
//! `attention::paged_attention`, `gemm::linear`, `norm::add_rms_norm`, `gemm::linear`,
//! `activation::silu_mul`, `gemm::linear`; then `norm::add_rms_norm`, `embed::gather_rows`,
//! `gemm::linear_f32out` and, when asked, `sampling::argmax`. A test holds it to that.

use crate::instance::{Architecture, Instance, WeightFormat};
use crate::kernels as k;
use crate::op::{LinearRole, NormRole, NormWeight, Op};
use crate::rules::{Kernel, Numerics, Rule, RuleTable};

use LinearRole::*;
use NormRole::{DraftEmbedding, DraftFinal, DraftHidden, Final, Input, Post};
use Numerics::{BitIdentical, Differs, Reference};

fn rule(chain: &[Op], kernels: &[Kernel], numerics: Numerics) -> Rule {
    Rule {
        chain: chain.to_vec(),
        kernels: kernels.to_vec(),
        numerics,
    }
}

impl RuleTable {
    /// The table of `instance`: its architecture's ([`RuleTable::for_architecture`]) for its
    /// weight format. Under [`WeightFormat::BlockFp8`] the reference rule of each FP8 dense
    /// projection launches `fp8_linear` (the caller's FP8 path: `gemm::linear_stream_fp8`, whose
    /// launcher picks the kernel by rows as `gemm::linear`'s does; the GDN input projection's
    /// then `gemm::linear` of its bf16 b|a rows), the
    /// experts' `moe::expert_linear_fp8` and its f32-out twin, and the fused
    /// rules that take an FP8 projection, whose kernels read bf16 weights, are left out.
    pub fn for_instance(instance: &Instance, fp8_linear: &[Kernel]) -> RuleTable {
        let table = RuleTable::for_architecture(instance.architecture);
        let format = instance.weights;
        if format == WeightFormat::Bf16 {
            return table;
        }
        let fp8 = |op: &Op| matches!(op, Op::Linear(role) if format.is_fp8(*role));
        let rules = table
            .rules
            .into_iter()
            .filter(|r| r.numerics == Reference || !r.chain.iter().any(fp8))
            .map(|mut r| {
                if r.numerics == Reference && r.chain.iter().any(fp8) {
                    // The GDN input projection: its FP8 q|k|v|z rows, then its bf16 b|a rows.
                    let ba = r.chain == [Op::Linear(GdnInProj)];
                    r.kernels = (r.kernels.iter())
                        .flat_map(|&kernel| match kernel {
                            k::LINEAR if ba => [fp8_linear, &[k::LINEAR]].concat(),
                            k::LINEAR => fp8_linear.to_vec(),
                            k::EXPERT_LINEAR => vec![k::EXPERT_LINEAR_FP8],
                            k::EXPERT_LINEAR_F32OUT => vec![k::EXPERT_LINEAR_FP8_F32OUT],
                            other => vec![other],
                        })
                        .collect();
                }
                r
            })
            .collect();
        RuleTable { rules }
    }

    /// The table of `architecture`.
    pub fn for_architecture(architecture: Architecture) -> RuleTable {
        let rules = match architecture {
            Architecture::DenseGqa { .. } => dense_gqa(architecture),
            Architecture::Hybrid => hybrid(architecture),
            Architecture::HybridMoe => hybrid_moe(architecture),
        };
        // Built in, so not checked with `RuleTable::new`: the `tables_are_well_formed` test
        // holds every table to its invariants instead.
        RuleTable { rules }
    }
}

/// Qwen3 dense and Llama.
fn dense_gqa(arch: Architecture) -> Vec<Rule> {
    let mut t = step_ends(arch.norm_weight());
    t.extend(attention(arch));
    t.extend(dense_ffn());
    t.extend([rope_kv_store(arch), swiglu(GateUp)]);
    t
}

/// Qwen3.5 dense.
fn hybrid(arch: Architecture) -> Vec<Rule> {
    let mut t = step_ends(arch.norm_weight());
    t.extend(attention(arch));
    t.extend(gdn());
    t.extend(dense_ffn());
    t.extend([rope_kv_store(arch), gdn_decode_step(), swiglu(GateUp)]);
    t
}

/// Qwen3-Next and Qwen3.5-MoE.
fn hybrid_moe(arch: Architecture) -> Vec<Rule> {
    let mut t = step_ends(arch.norm_weight());
    t.extend(attention(arch));
    t.extend(gdn());
    t.extend(dense_ffn());
    t.extend(moe());
    t.extend([
        rope_kv_store(arch),
        gdn_decode_step(),
        swiglu(GateUp),
        swiglu(SharedGateUp),
        expert_silu_down(),
    ]);
    t
}

/// Fused: q/k norm + RoPE and the KV-cache store in one launch, byte for byte the two.
fn rope_kv_store(arch: Architecture) -> Rule {
    rule(
        &[arch.rope_op(), Op::KvStore],
        &[k::QK_NORM_ROPE_KV_STORE],
        BitIdentical,
    )
}

/// Fused: the GDN conv, gates and recurrence of one token per sequence.
fn gdn_decode_step() -> Rule {
    rule(
        &[Op::GdnConv, Op::GdnGates, Op::GdnRecurrence],
        &[k::proposed::GDN_DECODE_STEP],
        Differs,
    )
}

/// Fused: the `[gate ; up]` projection `role` with SiLU·mul in its epilogue
/// (`gemm::linear_swiglu`), byte for byte the two launches: each gate and up column is summed
/// and rounded to bf16 as `linear` writes it before the activation.
fn swiglu(role: LinearRole) -> Rule {
    rule(
        &[Op::Linear(role), Op::SiluMul],
        &[k::LINEAR_SWIGLU],
        BitIdentical,
    )
}

/// Fused (proposed): the experts' down projection applying SiLU·mul on load, the activation
/// kept in f32.
fn expert_silu_down() -> Rule {
    rule(
        &[Op::SiluMul, Op::Linear(ExpertDown)],
        &[k::proposed::EXPERT_LINEAR_SILU_F32OUT],
        Differs,
    )
}

/// Embedding, the decoder norms, the head, and the MTP head's own ops.
fn step_ends(w: NormWeight) -> Vec<Rule> {
    vec![
        rule(&[Op::Embedding], &[k::EMBEDDING_GATHER], Reference),
        rule(
            &[Op::RmsNorm {
                role: Input,
                weight: w,
            }],
            &[k::RMS_NORM],
            Reference,
        ),
        rule(
            &[Op::AddRmsNorm {
                role: Input,
                weight: w,
            }],
            &[k::ADD_RMS_NORM],
            Reference,
        ),
        rule(
            &[Op::AddRmsNorm {
                role: Post,
                weight: w,
            }],
            &[k::ADD_RMS_NORM],
            Reference,
        ),
        rule(
            &[Op::AddRmsNorm {
                role: Final,
                weight: w,
            }],
            &[k::ADD_RMS_NORM],
            Reference,
        ),
        rule(&[Op::GatherRows], &[k::GATHER_ROWS], Reference),
        rule(&[Op::Linear(LmHead)], &[k::LINEAR_F32OUT], Reference),
        // The MTP head's own ops (draft steps).
        rule(
            &[Op::RmsNorm {
                role: DraftEmbedding,
                weight: w,
            }],
            &[k::RMS_NORM],
            Reference,
        ),
        rule(
            &[Op::RmsNorm {
                role: DraftHidden,
                weight: w,
            }],
            &[k::RMS_NORM],
            Reference,
        ),
        rule(&[Op::DraftConcat], &[k::GATHER_ROWS], Reference),
        rule(&[Op::Linear(Fc)], &[k::LINEAR_F32OUT], Reference),
        rule(
            &[Op::AddRmsNorm {
                role: DraftFinal,
                weight: w,
            }],
            &[k::ADD_RMS_NORM],
            Reference,
        ),
        rule(&[Op::Argmax], &[k::ARGMAX], Reference),
    ]
}

/// Full attention. `Rope` (no q/k norm) runs the q/k-norm kernel with NULL norm weights.
fn attention(arch: Architecture) -> Vec<Rule> {
    let gated = arch.attention_gated();
    vec![
        rule(&[Op::Linear(Qkv)], &[k::LINEAR], Reference),
        rule(&[arch.rope_op()], &[k::QK_NORM_ROPE], Reference),
        rule(&[Op::KvStore], &[k::KV_STORE], Reference),
        rule(
            &[Op::PagedAttention { gated }],
            &[k::PAGED_ATTENTION],
            Reference,
        ),
        rule(&[Op::Linear(O)], &[k::LINEAR], Reference),
    ]
}

/// Gated DeltaNet, one token per sequence (decode) or every row kept (verify).
fn gdn() -> Vec<Rule> {
    vec![
        rule(&[Op::Linear(GdnInProj)], &[k::LINEAR], Reference),
        rule(
            &[Op::GdnConv],
            &[k::CAUSAL_CONV1D, k::CONV_STATE_UPDATE],
            Reference,
        ),
        rule(&[Op::GdnGates], &[k::GDN_PREPARE], Reference),
        rule(&[Op::GdnRecurrence], &[k::GATED_DELTA_RECURRENT], Reference),
        rule(
            &[Op::GdnConvVerify],
            &[k::CAUSAL_CONV1D, k::CONV_STATE_VERIFY],
            Reference,
        ),
        rule(
            &[Op::GdnRecurrenceVerify],
            &[k::GATED_DELTA_VERIFY],
            Reference,
        ),
        rule(&[Op::GdnGatedNorm], &[k::GATED_RMS_NORM], Reference),
        rule(&[Op::Linear(GdnOut)], &[k::LINEAR], Reference),
    ]
}

/// Dense SwiGLU.
fn dense_ffn() -> Vec<Rule> {
    vec![
        rule(&[Op::Linear(GateUp)], &[k::LINEAR], Reference),
        rule(&[Op::SiluMul], &[k::SILU_MUL], Reference),
        rule(&[Op::Linear(Down)], &[k::LINEAR], Reference),
    ]
}

/// Sparse MoE and its shared expert (whose `silu_mul` is the dense FFN's rule).
fn moe() -> Vec<Rule> {
    vec![
        rule(&[Op::Linear(Router)], &[k::LINEAR_F32OUT], Reference),
        rule(&[Op::MoeRoute], &[k::TOPK_ROUTE], Reference),
        rule(&[Op::Linear(ExpertGateUp)], &[k::EXPERT_LINEAR], Reference),
        rule(
            &[Op::Linear(ExpertDown)],
            &[k::EXPERT_LINEAR_F32OUT],
            Reference,
        ),
        rule(&[Op::Linear(SharedGateUp)], &[k::LINEAR], Reference),
        rule(&[Op::Linear(SharedDown)], &[k::LINEAR], Reference),
        rule(&[Op::Linear(SharedGate)], &[k::LINEAR_F32OUT], Reference),
        rule(&[Op::MoeCombine], &[k::MOE_COMBINE], Reference),
    ]
}
