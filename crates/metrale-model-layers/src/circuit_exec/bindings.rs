//! `CircuitBindings`, the supertrait of `TransformerLayer` through which a layer hands the
//! circuit executor its weights by role ([`WeightSlot`], [`BoundWeight`]) and the facts its
//! kernels need ([`MixerFacts`], [`FfnFacts`]); [`HeadBinding`], the model's own weights; and
//! [`check_bindings`], which refuses a model its circuit would misdescribe.
//!
//! Invariants:
//! - Layers keep owning their weights; a binding is a copy of addresses and shapes.
//! - A layer lists in `unmodelled` every feature it carries that the circuit does not model, so
//!   a plan never runs over a layer it misdescribes.
//! - `check_bindings` reports every problem of a model in one error, in layer order: an
//!   unbound layer, an unmodelled feature, a layer whose kind or facts disagree with the
//!   circuit, a missing, misshapen or unread weight, a layer-count mismatch.
//! - A bound weight carries its storage format; compilation checks it against the format the
//!   plan's kernel reads (`compile.rs`).

use std::collections::BTreeMap;
use std::fmt;

use metrale_cache::KvDtype;
use metrale_circuit::{
    Block, Circuit, FfnKind, KvFormat, LayerKind, LayerSpec, LinearRole, NormRole, Op, WeightFormat,
};
use metrale_gpu_runtime::{DType, DevicePtr, GpuResult, StreamHandle};

use super::error::{BindingProblem, CircuitExecError, Part};
use super::fixed::LayerPools;
use super::weights_check::weight_problems;
use crate::layer::ModelDims;
use crate::layers::MoeShape;
use crate::ops::Ops;
use crate::ops_hybrid::GdnHeads;
use crate::weight_map::DenseWeight;

/// Which weight of a layer (or of the model's head) a circuit node reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum WeightSlot {
    /// The mixer's input RMSNorm (`input_layernorm`).
    InputNorm,
    /// The FFN's input RMSNorm (`post_attention_layernorm`).
    PostNorm,
    /// A projection by role: the fused ones (`Qkv`, `GateUp`, `GdnInProj`, the stacked
    /// experts) as the loader fused them; `LmHead` on the head.
    Linear(LinearRole),
    /// Attention's per-head q RMSNorm.
    QNorm,
    /// Attention's per-head k RMSNorm.
    KNorm,
    /// Gated DeltaNet `A_log` (f32).
    GdnALog,
    /// Gated DeltaNet `dt_bias` (f32).
    GdnDtBias,
    /// Gated DeltaNet conv1d taps.
    GdnConv1d,
    /// Gated DeltaNet gated output norm.
    GdnNorm,
    /// The Gated DeltaNet input projection's b and a rows, bf16, where they are a weight of
    /// their own (the q|k|v|z rows in `Linear(GdnInProj)` are block FP8); the input
    /// projection's node reads both.
    GdnInProjBa,
    /// The token embedding (head binding).
    Embedding,
    /// The final RMSNorm (head binding).
    FinalNorm,
    /// The MTP head's norm of the token embedding (`pre_fc_norm_embedding`, draft binding).
    DraftNormEmbedding,
    /// The MTP head's norm of the hidden row (`pre_fc_norm_hidden`, draft binding).
    DraftNormHidden,
    /// The MTP head's norm before the LM head (`mtp.norm`, draft binding).
    DraftNorm,
}

impl fmt::Display for WeightSlot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightSlot::InputNorm => f.write_str("input_norm"),
            WeightSlot::PostNorm => f.write_str("post_norm"),
            WeightSlot::Linear(role) => write!(f, "linear({role})"),
            WeightSlot::QNorm => f.write_str("q_norm"),
            WeightSlot::KNorm => f.write_str("k_norm"),
            WeightSlot::GdnALog => f.write_str("gdn.a_log"),
            WeightSlot::GdnDtBias => f.write_str("gdn.dt_bias"),
            WeightSlot::GdnConv1d => f.write_str("gdn.conv1d"),
            WeightSlot::GdnNorm => f.write_str("gdn.norm"),
            WeightSlot::GdnInProjBa => f.write_str("gdn.in_proj_ba"),
            WeightSlot::Embedding => f.write_str("embedding"),
            WeightSlot::FinalNorm => f.write_str("final_norm"),
            WeightSlot::DraftNormEmbedding => f.write_str("pre_fc_norm_embedding"),
            WeightSlot::DraftNormHidden => f.write_str("pre_fc_norm_hidden"),
            WeightSlot::DraftNorm => f.write_str("mtp.norm"),
        }
    }
}

/// A bound weight and its storage format.
#[derive(Debug, Clone, PartialEq)]
pub enum BoundWeight {
    /// Unquantized, in its element type (bf16 projections and norms; the GDN vectors f32).
    Dense(DenseWeight),
    /// Block FP8 (e4m3 with its block scales): a projection of an FP8 checkpoint or of a model
    /// quantized at load.
    BlockFp8(DenseWeight),
}

impl BoundWeight {
    /// The format family, as the kernels' weight formats are spelled (`bf16`, `f32`,
    /// `fp8_e4m3`, ...).
    pub fn family(&self) -> &'static str {
        self.weight().dtype.name()
    }

    /// Where the data starts.
    pub fn ptr(&self) -> DevicePtr {
        self.weight().ptr
    }

    /// Dims, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.weight().shape
    }

    /// The weight.
    pub fn weight(&self) -> &DenseWeight {
        match self {
            BoundWeight::Dense(w) | BoundWeight::BlockFp8(w) => w,
        }
    }
}

impl From<&DenseWeight> for BoundWeight {
    fn from(w: &DenseWeight) -> BoundWeight {
        if w.dtype == DType::F8E4M3 {
            BoundWeight::BlockFp8(w.clone())
        } else {
            BoundWeight::Dense(w.clone())
        }
    }
}

/// A full-attention layer's rotary embedding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeFacts {
    /// Rotated dims per head (the inverse frequencies are the model's `StepBuffers::inv_freq`).
    pub rotary_dim: u32,
    /// Factor on every cos and sin (`ModelDims::rope_attention_scaling`).
    pub attention_scaling: f32,
}

/// What a full-attention layer's kernels need beyond its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttnFacts {
    /// Query heads.
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Head dim.
    pub head_dim: u32,
    /// Each query head carries an output gate (`[q | gate]`).
    pub gated: bool,
    /// Per-head q and k RMSNorms before RoPE.
    pub qk_norm: bool,
    /// Rotary embedding.
    pub rope: RopeFacts,
    /// Softmax scale (`Attention::softmax_scale`).
    pub softmax_scale: f32,
}

/// What a Gated DeltaNet layer's kernels need beyond its weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnFacts {
    /// Head shape.
    pub heads: GdnHeads,
    /// Conv taps.
    pub conv_kernel: u32,
    /// Epsilon of the gated RMSNorm.
    pub eps: f32,
    /// Epsilon of the q/k L2 norms.
    pub l2_eps: f32,
    /// q's scale (`GatedDeltaNet::q_scale`).
    pub q_scale: f32,
}

/// The mixer a layer runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MixerFacts {
    /// Full attention.
    Attention(AttnFacts),
    /// Gated DeltaNet.
    Gdn(GdnFacts),
}

impl MixerFacts {
    /// The circuit's name for this mixer.
    pub fn kind(&self) -> LayerKind {
        match self {
            MixerFacts::Attention(_) => LayerKind::FullAttention,
            MixerFacts::Gdn(_) => LayerKind::LinearAttention,
        }
    }
}

/// The shared expert of an MoE FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedFacts {
    /// Width.
    pub ffn: u32,
    /// Scaled by `sigmoid(shared_expert_gate · x)`.
    pub gated: bool,
}

/// What an MoE FFN's kernels need beyond its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeFacts {
    /// Experts, top-k, expert width, renormalisation.
    pub shape: MoeShape,
    /// The shared expert, when the layer has one.
    pub shared: Option<SharedFacts>,
}

/// The FFN a layer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FfnFacts {
    /// Dense SwiGLU of this width.
    Dense {
        /// Width.
        ffn: u32,
    },
    /// Sparse MoE.
    Moe(MoeFacts),
}

impl FfnFacts {
    /// The circuit's name for this FFN.
    pub fn kind(&self) -> FfnKind {
        match self {
            FfnFacts::Dense { .. } => FfnKind::Dense,
            FfnFacts::Moe(_) => FfnKind::Moe,
        }
    }
}

/// One decoder layer, as the executor sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct CircuitLayer {
    /// The mixer.
    pub mixer: MixerFacts,
    /// The FFN.
    pub ffn: FfnFacts,
    /// Weights by slot.
    pub weights: BTreeMap<WeightSlot, BoundWeight>,
    /// Features present on this layer that the circuit does not model.
    pub unmodelled: Vec<String>,
}

impl CircuitLayer {
    /// The layer's kinds, as the circuit spells them.
    pub fn spec(&self) -> LayerSpec {
        LayerSpec {
            kind: self.mixer.kind(),
            ffn: self.ffn.kind(),
        }
    }
}

/// A supertrait of `TransformerLayer`; see the module header.
pub trait CircuitBindings {
    /// Build whatever the bound kernels read that the layer builds lazily, so a binding can
    /// hand it out; queued on `stream`. Nothing is built lazily.
    fn circuit_prepare(&self, _ops: &Ops, _stream: StreamHandle) -> GpuResult<()> {
        Ok(())
    }

    /// This layer for the circuit executor; `None` for a layer type it does not bind. `dims`
    /// are the model's, as the layer's forward reads them.
    fn circuit_layer(&self, _dims: &ModelDims) -> Option<CircuitLayer> {
        None
    }
}

/// The model's own weights: the embedding the first node reads, the final norm and the LM
/// head; and the features of the step's ends that the circuit does not model.
#[derive(Debug, Clone, PartialEq)]
pub struct HeadBinding {
    /// `[vocab, hidden]`.
    pub embedding: BoundWeight,
    /// `[hidden]`.
    pub final_norm: BoundWeight,
    /// `[vocab, hidden]`.
    pub lm_head: BoundWeight,
    /// Features of the head the circuit does not model.
    pub unmodelled: Vec<String>,
}

impl HeadBinding {
    /// The weight in `slot`, if the head has one there.
    pub fn weight(&self, slot: WeightSlot) -> Option<&BoundWeight> {
        match slot {
            WeightSlot::Embedding => Some(&self.embedding),
            WeightSlot::FinalNorm => Some(&self.final_norm),
            WeightSlot::Linear(LinearRole::LmHead) => Some(&self.lm_head),
            _ => None,
        }
    }
}

/// The weight a norm of `role` reads.
pub(crate) fn norm_slot(role: NormRole) -> WeightSlot {
    match role {
        NormRole::Input => WeightSlot::InputNorm,
        NormRole::Post => WeightSlot::PostNorm,
        NormRole::Final => WeightSlot::FinalNorm,
        NormRole::DraftEmbedding => WeightSlot::DraftNormEmbedding,
        NormRole::DraftHidden => WeightSlot::DraftNormHidden,
        NormRole::DraftFinal => WeightSlot::DraftNorm,
    }
}

/// The weights a node of `op` reads under the weight format `format`; the final norm's and the
/// step ends' are the head's. Under block FP8 the GDN input projection's node reads its q|k|v|z
/// rows (FP8) and its b|a rows (bf16).
pub(crate) fn slots_read(op: Op, format: WeightFormat) -> Vec<WeightSlot> {
    let norm = norm_slot;
    match op {
        Op::Embedding => vec![WeightSlot::Embedding],
        Op::RmsNorm { role, .. } | Op::AddRmsNorm { role, .. } => vec![norm(role)],
        Op::Linear(role @ LinearRole::GdnInProj) if format.is_fp8(role) => {
            vec![WeightSlot::Linear(role), WeightSlot::GdnInProjBa]
        }
        Op::Linear(role) => vec![WeightSlot::Linear(role)],
        Op::QkNormRope(_) => vec![WeightSlot::QNorm, WeightSlot::KNorm],
        Op::GdnConv | Op::GdnConvVerify => vec![WeightSlot::GdnConv1d],
        Op::GdnGates => vec![WeightSlot::GdnALog, WeightSlot::GdnDtBias],
        Op::GdnGatedNorm => vec![WeightSlot::GdnNorm],
        Op::ResidualAdd
        | Op::Rope
        | Op::KvStore
        | Op::PagedAttention { .. }
        | Op::GdnRecurrence
        | Op::GdnRecurrenceVerify
        | Op::MoeRoute
        | Op::MoeCombine
        | Op::SiluMul
        | Op::GatherRows
        | Op::DraftConcat
        | Op::Argmax => Vec::new(),
    }
}

/// The facts of `layer` (at `part`) that differ from the circuit's instance.
fn fact_problems(part: Part, layer: &CircuitLayer, circuit: &Circuit) -> Vec<BindingProblem> {
    let instance = circuit.instance();
    let (d, arch) = (&instance.dims, instance.architecture);
    let mut out = Vec::new();
    let mut fact = |fact: &'static str, model: String, circuit: String| {
        if model != circuit {
            out.push(BindingProblem::FactDisagrees {
                part,
                fact,
                model,
                circuit,
            });
        }
    };
    let s = |v: u64| v.to_string();
    match layer.mixer {
        MixerFacts::Attention(a) => {
            fact("query heads", s(a.num_q_heads.into()), s(d.num_q_heads));
            fact("KV heads", s(a.num_kv_heads.into()), s(d.num_kv_heads));
            fact("head dim", s(a.head_dim.into()), s(d.head_dim));
            fact(
                "the attention output gate",
                a.gated.to_string(),
                arch.attention_gated().to_string(),
            );
            fact(
                "the q/k norm",
                a.qk_norm.to_string(),
                arch.qk_norm().to_string(),
            );
        }
        MixerFacts::Gdn(g) => {
            let (k_heads, k_dim, v_heads, v_dim, taps) = match d.gdn {
                Some(c) => (
                    c.num_k_heads,
                    c.k_head_dim,
                    c.num_v_heads,
                    c.v_head_dim,
                    c.conv_kernel,
                ),
                None => (0, 0, 0, 0, 0),
            };
            fact("GDN key heads", s(g.heads.num_k_heads.into()), s(k_heads));
            fact("GDN key head dim", s(g.heads.k_head_dim.into()), s(k_dim));
            fact("GDN value heads", s(g.heads.num_v_heads.into()), s(v_heads));
            fact("GDN value head dim", s(g.heads.v_head_dim.into()), s(v_dim));
            fact("GDN conv taps", s(g.conv_kernel.into()), s(taps));
        }
    }
    match layer.ffn {
        FfnFacts::Dense { ffn } => fact("the FFN width", s(ffn.into()), s(d.ffn)),
        FfnFacts::Moe(m) => {
            let c = d.moe;
            let (e, k, f) = c.map_or((0, 0, 0), |c| (c.num_experts, c.top_k, c.expert_ffn));
            fact("experts", s(m.shape.num_experts.into()), s(e));
            fact("experts per token", s(m.shape.top_k.into()), s(k));
            fact("the expert width", s(m.shape.expert_ffn.into()), s(f));
            let show = |sh: Option<(u64, bool)>| match sh {
                None => "none".to_string(),
                Some((w, g)) => format!("{w}{}", if g { " gated" } else { "" }),
            };
            fact(
                "the shared expert",
                show(m.shared.map(|x| (x.ffn.into(), x.gated))),
                show(c.and_then(|c| c.shared).map(|x| (x.ffn, x.gated))),
            );
        }
    }
    out
}

/// Every problem of `layers` and `head` against `circuit`, layer by layer, then the head's and
/// the layer count; with `pools`, also each layer's missing cache or state pool. The bound
/// layers, in order.
pub(crate) fn binding_problems(
    circuit: &Circuit,
    layers: &[Option<CircuitLayer>],
    head: &HeadBinding,
    pools: Option<&[LayerPools]>,
) -> Result<(Vec<BindingProblem>, Vec<CircuitLayer>), CircuitExecError> {
    let mut problems = Vec::new();
    let mut bound = Vec::with_capacity(layers.len());
    let mut agrees = vec![false; layers.len()];
    let kinds = circuit.layer_kinds();
    let ffns = circuit.ffn_kinds();
    for (i, l) in layers.iter().enumerate() {
        let Some(l) = l else {
            problems.push(BindingProblem::Unbound {
                part: Part::Layer(i),
            });
            continue;
        };
        bound.push(l.clone());
        let (Some(&kind), Some(&ffn)) = (kinds.get(i), ffns.get(i)) else {
            problems.extend(
                l.unmodelled
                    .iter()
                    .map(|feature| BindingProblem::Unmodelled {
                        part: Part::Layer(i),
                        feature: feature.clone(),
                    }),
            );
            continue;
        };
        let pool = pools.map(|p| p.get(i).copied().unwrap_or_default());
        let want = LayerSpec { kind, ffn };
        agrees[i] = layer_problems(Part::Layer(i), l, want, pool, circuit, &mut problems);
    }
    for feature in &head.unmodelled {
        problems.push(BindingProblem::Unmodelled {
            part: Part::Head,
            feature: feature.clone(),
        });
    }
    let lookup = |block: Block, slot: WeightSlot| match block {
        Block::Layer(l) => match layers.get(l) {
            Some(Some(layer)) if agrees.get(l) == Some(&true) => Some(layer.weights.get(&slot)),
            _ => None,
        },
        Block::Embed | Block::Head => Some(head.weight(slot)),
        Block::Draft | Block::DraftLayer(_) => None,
    };
    let checked: Vec<(Block, &CircuitLayer)> = (layers.iter().enumerate())
        .filter(|&(i, _)| agrees[i])
        .filter_map(|(i, l)| Some((Block::Layer(i), l.as_ref()?)))
        .collect();
    weight_problems(circuit, &lookup, &checked, &mut problems)?;
    if layers.len() != kinds.len() {
        problems.push(BindingProblem::LayerCount {
            model: layers.len(),
            circuit: kinds.len(),
        });
    }
    Ok((problems, bound))
}

/// The problems of one bound layer at `part` against the circuit's `want` (its unmodelled
/// features, its kinds, its facts and, with `pool`, its missing cache or state pool and a KV
/// pool stored otherwise than the instance's `kv_cache` says); whether
/// its kinds agree, so that its weights can be checked.
pub(crate) fn layer_problems(
    part: Part,
    layer: &CircuitLayer,
    want: LayerSpec,
    pool: Option<LayerPools>,
    circuit: &Circuit,
    problems: &mut Vec<BindingProblem>,
) -> bool {
    for feature in &layer.unmodelled {
        problems.push(BindingProblem::Unmodelled {
            part,
            feature: feature.clone(),
        });
    }
    if layer.spec() != want {
        problems.push(BindingProblem::KindDisagrees {
            part,
            model: layer.spec(),
            circuit: want,
        });
        return false;
    }
    problems.extend(fact_problems(part, layer, circuit));
    if let Some(p) = pool {
        let missing = match layer.mixer {
            MixerFacts::Attention(_) if p.kv.is_none() => Some("KV cache"),
            MixerFacts::Gdn(_) if p.ssm.is_none() => Some("SSM state"),
            _ => None,
        };
        if let Some(pool) = missing {
            problems.push(BindingProblem::MissingPool { part, pool });
        }
        let expected = circuit.instance().kv_cache;
        if let (MixerFacts::Attention(_), Some(kv)) = (&layer.mixer, p.kv)
            && kv_format(kv.dtype) != expected
        {
            problems.push(BindingProblem::KvStorage {
                part,
                expected: expected.name(),
                found: kv_format(kv.dtype).name(),
            });
        }
    }
    true
}

/// The circuit's name for a KV pool's element format (bf16 and e4m3 are the pools' formats).
pub fn kv_format(dtype: KvDtype) -> KvFormat {
    if dtype == KvDtype::Fp8 {
        KvFormat::Fp8E4m3
    } else {
        KvFormat::Bf16
    }
}

/// Refuse a model the circuit misdescribes, listing every problem in one
/// [`CircuitExecError::Bindings`]; else the bound layers, in order.
pub fn check_bindings(
    circuit: &Circuit,
    layers: &[Option<CircuitLayer>],
    head: &HeadBinding,
) -> Result<Vec<CircuitLayer>, CircuitExecError> {
    let (problems, bound) = binding_problems(circuit, layers, head, None)?;
    if problems.is_empty() {
        Ok(bound)
    } else {
        Err(CircuitExecError::Bindings { problems })
    }
}

/// The format family kernel reads `slot` in: the GDN gates read `A_log` and `dt_bias` as f32,
/// the block-FP8 projections' kernels e4m3 bytes (with their scales), every other kernel bf16.
pub(crate) fn expected_family(kernel: metrale_circuit::Kernel, slot: WeightSlot) -> &'static str {
    use metrale_circuit::kernels as k;
    match (kernel, slot) {
        (k::GDN_PREPARE, WeightSlot::GdnALog | WeightSlot::GdnDtBias) => DType::F32.name(),
        (k::LINEAR_STREAM_FP8 | k::EXPERT_LINEAR_FP8 | k::EXPERT_LINEAR_FP8_F32OUT, _) => {
            DType::F8E4M3.name()
        }
        _ => DType::Bf16.name(),
    }
}
