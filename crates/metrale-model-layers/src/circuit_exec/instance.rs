//! The circuit's view of a config: [`model_instance`] fills a `metrale_circuit::Instance` from
//! a `ModelConfig` (the architecture by family, the dimensions, every layer's kinds), and
//! [`launcher_kernels`] is the set of kernels the executor can launch, which `Fusions::All`
//! lowers against.
//!
//! Invariants:
//! - The instance depends on the config and the sizes passed in only, so `metrale circuit plan`
//!   (a config, no weights) prints the plan the engine compiles for the same checkpoint.
//! - The step ends at the logits: the engine samples outside the step, so `argmax` is off.

use std::sync::Arc;

use metrale_circuit::{
    Architecture, Circuit, Dims, FfnKind, Fusions, GdnDims, Instance, KernelSet, KvFormat,
    LayerKind, LayerSpec, Lowering, MoeDims, Plan, RuleTable, SharedExpertDims, Step, WeightFormat,
    Width,
};
use metrale_config::{LayerType, ModelConfig, ModelFamily};

use super::error::CircuitExecError;
use crate::ops::Kernels;
use crate::ops_fused::LINEAR_SWIGLU_M_MAX;

/// The circuit architecture of a config's family: Qwen3 is dense GQA with q/k norms, Llama
/// without; Qwen3.5 is the dense hybrid; Qwen3-Next and Qwen3.5-MoE the MoE hybrid.
pub fn architecture(config: &ModelConfig) -> Architecture {
    match config.family {
        ModelFamily::Qwen3 => Architecture::DenseGqa { qk_norm: true },
        ModelFamily::Llama => Architecture::DenseGqa { qk_norm: false },
        ModelFamily::Qwen35 if config.moe.is_none() => Architecture::Hybrid,
        ModelFamily::Qwen35 | ModelFamily::Qwen3Next | ModelFamily::Qwen35Moe => {
            Architecture::HybridMoe
        }
    }
}

/// The steps a model compiles programs for: the decode widths, the verify and draft row counts
/// of one sequence, and the verify and draft shapes of several (each empty: none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepWidths {
    /// Decode widths (rows, one per sequence), ascending.
    pub decode: Vec<u64>,
    /// Row counts of single-sequence verify steps, ascending.
    pub verify_rows: Vec<u64>,
    /// Verify shapes of several sequences, ascending.
    pub verify_batches: Vec<Width>,
    /// Row counts of single-sequence draft steps, ascending.
    pub draft_rows: Vec<u64>,
    /// Draft shapes of several sequences, ascending.
    pub draft_batches: Vec<Width>,
}

/// The instance of `config` with `blocks_per_seq` block-table columns, compiled at `widths`,
/// its projections stored as `weights` and its KV cache as `kv_cache`.
/// The draft layer is the MTP head's when the config declares one or draft steps are asked for
/// (the head's tensors decide whether a checkpoint has one, not always its config): full
/// attention, with an MoE FFN in the MoE families (as the loader builds it).
/// The shared expert is gated whenever there is one, as in every MoE family transformers
/// defines; a checkpoint without the gate is refused when it is bound.
pub fn model_instance(
    config: &ModelConfig,
    blocks_per_seq: u64,
    widths: StepWidths,
    weights: WeightFormat,
    kv_cache: KvFormat,
) -> Result<Instance, CircuitExecError> {
    let u = |n: usize| n as u64;
    let gdn = config.linear.as_ref().map(|l| GdnDims {
        num_k_heads: u(l.num_key_heads),
        k_head_dim: u(l.key_head_dim),
        num_v_heads: u(l.num_value_heads),
        v_head_dim: u(l.value_head_dim),
        conv_kernel: u(l.conv_kernel_dim),
    });
    let moe = config.moe.as_ref().map(|m| MoeDims {
        num_experts: u(m.num_experts),
        top_k: u(m.num_experts_per_tok),
        expert_ffn: u(m.moe_intermediate_size),
        shared: (m.shared_expert_intermediate_size > 0).then(|| SharedExpertDims {
            ffn: u(m.shared_expert_intermediate_size),
            gated: true,
        }),
    });
    let layers = config
        .layer_types
        .iter()
        .enumerate()
        .map(|(i, t)| LayerSpec {
            kind: match t {
                LayerType::FullAttention => LayerKind::FullAttention,
                LayerType::LinearAttention => LayerKind::LinearAttention,
            },
            ffn: if config.layer_is_moe(i) {
                FfnKind::Moe
            } else {
                FfnKind::Dense
            },
        })
        .collect();
    let instance = Instance {
        architecture: architecture(config),
        dims: Dims {
            hidden: u(config.hidden_size),
            vocab: u(config.tokens.vocab_size),
            ffn: u(config.intermediate_size),
            num_q_heads: u(config.attention.num_attention_heads),
            num_kv_heads: u(config.attention.num_key_value_heads),
            head_dim: u(config.attention.head_dim),
            blocks_per_seq,
            gdn,
            moe,
        },
        layers,
        draft_layer: (config.mtp_num_layers > 0
            || !widths.draft_rows.is_empty()
            || !widths.draft_batches.is_empty())
        .then_some(LayerSpec {
            kind: LayerKind::FullAttention,
            ffn: if config.moe.is_some() {
                FfnKind::Moe
            } else {
                FfnKind::Dense
            },
        }),
        widths: widths.decode,
        verify_rows: widths.verify_rows,
        verify_batches: widths.verify_batches,
        draft_rows: widths.draft_rows,
        draft_batches: widths.draft_batches,
        argmax: false,
        weights,
        kv_cache,
    };
    instance.validate()?;
    Ok(instance)
}

/// The weight format of `config`'s checkpoint: block FP8 for an FP8 pack
/// (`quantization_config`) or when the model is quantized at load (`quantize_at_load`), as the
/// loader stores the projections; else bf16.
pub fn weight_format(config: &ModelConfig, quantize_at_load: bool) -> WeightFormat {
    if quantize_at_load || config.checkpoint.quantization.is_some() {
        WeightFormat::BlockFp8
    } else {
        WeightFormat::Bf16
    }
}

/// The kernels the executor has a launcher for (`ops::Kernels`): what a plan may lower to.
pub fn launcher_kernels() -> KernelSet {
    KernelSet::from_names(Kernels::NAMES.iter().copied())
}

/// `instance`'s plan of `step` at `width` with its architecture's rule table, lowered with
/// `fusions` against `kernels` as the executor lowers that width ([`kernels_at`]).
pub fn plan_at(
    instance: &Instance,
    step: Step,
    fusions: Fusions,
    kernels: &KernelSet,
    width: Width,
) -> Result<Plan, CircuitExecError> {
    let circuit = Arc::new(Circuit::for_step(instance, step)?);
    plan_of_width(&circuit, instance, fusions, kernels, width)
}

/// `circuit` at `width` lowered with `instance`'s rule table ([`rules_of`]) and `fusions`
/// against [`kernels_at`] its rows.
fn plan_of_width(
    circuit: &Arc<Circuit>,
    instance: &Instance,
    fusions: Fusions,
    kernels: &KernelSet,
    width: Width,
) -> Result<Plan, CircuitExecError> {
    let kernels = kernels_at(kernels, width.rows);
    let rules = rules_of(instance);
    let lowering = Lowering {
        rules: &rules,
        fusions,
        kernels: &kernels,
    };
    Ok(Plan::compile(circuit, &lowering, width)?)
}

/// `instance`'s rule table, the same at every width. A block-FP8 projection is
/// `linear_stream_fp8`'s family: its launcher (`Ops::linear`) picks the decode kernels up to
/// [`FP8_STREAM_M_MAX`](crate::ops_gemm::FP8_STREAM_M_MAX) rows and `linear_tma_fp8` (or the
/// bf16 kernels on the dequantized weight) above them, every one the rows of `linear` on the
/// dequantized weight (`compile::VARIANTS`, `compile::PRELUDES`).
pub fn rules_of(instance: &Instance) -> RuleTable {
    RuleTable::for_instance(instance, &[metrale_circuit::kernels::LINEAR_STREAM_FP8])
}

/// The kernels a plan of `rows` rows may lower to: `kernels` less those that serve only fewer
/// rows. `gemm::linear_swiglu` is a narrow decode kernel: above [`LINEAR_SWIGLU_M_MAX`] rows
/// the gate/up projection's own kernel (through its tensor map) then `silu_mul_staged` (writing
/// the down projection's input images) is the faster path.
pub fn kernels_at(kernels: &KernelSet, rows: u64) -> KernelSet {
    if rows > u64::from(LINEAR_SWIGLU_M_MAX) {
        kernels
            .clone()
            .without(metrale_circuit::kernels::LINEAR_SWIGLU)
    } else {
        kernels.clone()
    }
}

/// Every width of `circuit` lowered with `instance`'s rule table at that width and `fusions`
/// against [`kernels_at`] that width.
pub(crate) fn plans_by_width(
    circuit: &Arc<Circuit>,
    instance: &Instance,
    fusions: Fusions,
    kernels: &KernelSet,
) -> Result<Vec<Plan>, CircuitExecError> {
    circuit
        .widths()
        .into_iter()
        .map(|width| plan_of_width(circuit, instance, fusions, kernels, width))
        .collect()
}
