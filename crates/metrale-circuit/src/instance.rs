//! `Instance`: what fixes a circuit's shapes. The architecture, the model's dimensions, the kind
//! of every layer (and of the MTP head's layer), the decode widths, the verify and draft
//! row counts and the batched verify and draft shapes to compile. The caller fills it
//! from the model's config; this crate reads no file.
//!
//! Invariants (checked by [`Instance::validate`], which building a circuit runs):
//! - at least one layer, each of a kind its architecture has;
//! - widths non-empty, strictly ascending, each >= 1; verify rows and draft rows strictly
//!   ascending, each >= 1 (empty: no verify, no draft step); batched verify shapes strictly
//!   ascending by sequences then rows, each of >= 2 sequences and more rows than sequences;
//!   batched draft shapes likewise, each of >= 2 sequences and at least a row per sequence;
//! - draft rows only with a draft layer, which is full attention of a kind the architecture
//!   has;
//! - every dimension a circuit's edge uses is present and resolves to >= 1 (checked when the
//!   circuit resolves its shapes).

use std::fmt::{self, Write as _};

use crate::error::CircuitError;
use crate::op::{FfnKind, LayerKind, LayerSpec, NormWeight, Op};
use crate::shape::Dim;

/// The architectures this crate has a circuit for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Architecture {
    /// Dense GQA: every layer full attention with a dense FFN, plain norms. Qwen3 with
    /// `qk_norm: true`; Llama with `qk_norm: false` (RoPE alone).
    DenseGqa {
        /// Per-head q/k RMSNorm before RoPE.
        qk_norm: bool,
    },
    /// Qwen3.5 dense: Gated DeltaNet and gated full attention, dense FFNs, zero-centred norms.
    Hybrid,
    /// Qwen3-Next and Qwen3.5-MoE: as [`Architecture::Hybrid`], with sparse-MoE FFNs (dense
    /// ones where the config keeps them).
    HybridMoe,
}

impl Architecture {
    /// The architecture's text name.
    pub fn name(self) -> &'static str {
        match self {
            Architecture::DenseGqa { qk_norm: true } => "dense_gqa",
            Architecture::DenseGqa { qk_norm: false } => "dense_gqa_no_qk_norm",
            Architecture::Hybrid => "hybrid",
            Architecture::HybridMoe => "hybrid_moe",
        }
    }

    /// How the decoder, q/k and final norms apply their weight.
    pub fn norm_weight(self) -> NormWeight {
        match self {
            Architecture::DenseGqa { .. } => NormWeight::Plain,
            Architecture::Hybrid | Architecture::HybridMoe => NormWeight::ZeroCentred,
        }
    }

    /// Full attention carries an output gate after each query head.
    pub fn attention_gated(self) -> bool {
        !matches!(self, Architecture::DenseGqa { .. })
    }

    /// Full attention normalises q and k per head before RoPE.
    pub fn qk_norm(self) -> bool {
        match self {
            Architecture::DenseGqa { qk_norm } => qk_norm,
            Architecture::Hybrid | Architecture::HybridMoe => true,
        }
    }

    /// The op that prepares q and k for attention: [`Op::QkNormRope`] with the
    /// architecture's norm weighting, or [`Op::Rope`] without a q/k norm.
    pub fn rope_op(self) -> Op {
        if self.qk_norm() {
            Op::QkNormRope(self.norm_weight())
        } else {
            Op::Rope
        }
    }

    /// Whether a layer of this kind exists in the architecture.
    pub fn has(self, spec: LayerSpec) -> bool {
        match self {
            Architecture::DenseGqa { .. } => {
                spec.kind == LayerKind::FullAttention && spec.ffn == FfnKind::Dense
            }
            Architecture::Hybrid => spec.ffn == FfnKind::Dense,
            Architecture::HybridMoe => true,
        }
    }
}

impl fmt::Display for Architecture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the decoder layers' projection weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum WeightFormat {
    /// bf16.
    #[default]
    Bf16,
    /// Block FP8 (e4m3 with a scale per 128 x 128 block) for the projections a pack quantizes
    /// ([`LinearRole::block_fp8_in_packs`](crate::LinearRole::block_fp8_in_packs)), in every
    /// layer and the MTP head's; the others bf16. Their rules name the FP8 kernels.
    BlockFp8,
}

impl WeightFormat {
    /// The format's text name.
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::Bf16 => "bf16",
            WeightFormat::BlockFp8 => "block_fp8",
        }
    }

    /// Whether the projection of `role` is block FP8 under this format.
    pub fn is_fp8(self, role: crate::LinearRole) -> bool {
        self == WeightFormat::BlockFp8 && role.block_fp8_in_packs()
    }
}

/// How the attention layers' KV cache stores its elements. The attention kernels compute on
/// bf16 either way (the `k_cache` / `v_cache` tensors' format); an e4m3 cache is read as
/// `bf16(e4m3 · scale')` with a K and a V scale per layer and written as
/// `e4m3(value / scale)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum KvFormat {
    /// bf16.
    #[default]
    Bf16,
    /// FP8 e4m3 with per-layer scales.
    Fp8E4m3,
}

impl KvFormat {
    /// The format's text name.
    pub fn name(self) -> &'static str {
        match self {
            KvFormat::Bf16 => "bf16",
            KvFormat::Fp8E4m3 => "e4m3",
        }
    }
}

/// The Gated DeltaNet layers' dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GdnDims {
    /// Key heads `Hk`.
    pub num_k_heads: u64,
    /// Key head dim `Dk`.
    pub k_head_dim: u64,
    /// Value heads `Hv`.
    pub num_v_heads: u64,
    /// Value head dim `Dv`.
    pub v_head_dim: u64,
    /// Conv taps `K`.
    pub conv_kernel: u64,
}

/// The shared expert of an MoE FFN.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SharedExpertDims {
    /// Width `Fs`.
    pub ffn: u64,
    /// Scaled by `sigmoid(shared_expert_gate · x)`.
    pub gated: bool,
}

/// The sparse-MoE layers' dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MoeDims {
    /// Routed experts `E`.
    pub num_experts: u64,
    /// Experts per token `K`.
    pub top_k: u64,
    /// One expert's width `F`.
    pub expert_ffn: u64,
    /// The shared expert; `None` without one.
    pub shared: Option<SharedExpertDims>,
}

/// The model's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dims {
    /// Hidden size.
    pub hidden: u64,
    /// Vocabulary.
    pub vocab: u64,
    /// Dense FFN width; unused (may be 0) when no layer has a dense FFN.
    pub ffn: u64,
    /// Query heads.
    pub num_q_heads: u64,
    /// KV heads.
    pub num_kv_heads: u64,
    /// Head dim.
    pub head_dim: u64,
    /// Columns of the block table (the most KV blocks one sequence can hold), which a
    /// fixed-address program reads with a fixed row pitch.
    pub blocks_per_seq: u64,
    /// Gated DeltaNet dims; needed when a layer is linear attention.
    pub gdn: Option<GdnDims>,
    /// MoE dims; needed when a layer's FFN is MoE.
    pub moe: Option<MoeDims>,
}

/// See the module header.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Instance {
    /// The architecture, which picks the circuit and its rule table.
    pub architecture: Architecture,
    /// Dimensions.
    pub dims: Dims,
    /// Every decoder layer, in order.
    pub layers: Vec<LayerSpec>,
    /// The decode widths (rows per step, one per sequence) to compile, ascending.
    pub widths: Vec<u64>,
    /// The row counts of the single-sequence verify steps to compile ([`Step::Verify`]),
    /// ascending: `2..=1 + K` with `K` drafts per step; empty without speculation.
    pub verify_rows: Vec<u64>,
    /// The verify steps of several sequences to compile ([`Step::Verify`] at a [`Width`] of
    /// `seqs >= 2` sequences and `rows > seqs` rows in all), ascending by sequences then rows;
    /// empty: verify steps of one sequence only.
    pub verify_batches: Vec<Width>,
    /// The row counts of the single-sequence draft steps (the MTP head's) to compile
    /// ([`Step::Draft`]), ascending: `1..=1 + K` with `K` drafts per step; empty without an MTP
    /// head that drafts.
    pub draft_rows: Vec<u64>,
    /// The draft steps of several sequences to compile ([`Step::Draft`] at a [`Width`] of
    /// `seqs >= 2` sequences and `rows >= seqs` rows in all, the last row of each sequence with
    /// logits), ascending by sequences then rows; empty: draft steps of one sequence only.
    pub draft_batches: Vec<Width>,
    /// The MTP head's decoder layer (full attention, with its own KV cache); needed when
    /// `draft_rows` or `draft_batches` is not empty.
    pub draft_layer: Option<LayerSpec>,
    /// The step ends with a greedy argmax of its logit rows.
    pub argmax: bool,
    /// How the layers' projections are stored, which picks their kernels.
    pub weights: WeightFormat,
    /// How the KV cache (the model's and the MTP head's) stores its elements.
    pub kv_cache: KvFormat,
}

/// Which step a circuit computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Step {
    /// One row per sequence, at [`Instance::widths`].
    Decode,
    /// Speculative decoding's verify step, of one sequence at [`Instance::verify_rows`] or of
    /// several at [`Instance::verify_batches`]: each sequence's last accepted token and its
    /// drafts, every row with logits, the GDN layers keeping the state after each row in the
    /// row's own SSM slot (`row_slot`) and only reading the sequence's.
    Verify,
    /// Speculative decoding's draft step, of one sequence at [`Instance::draft_rows`] or of
    /// several at [`Instance::draft_batches`]: the MTP head over rows that each read a token's embedding and a hidden row the step before
    /// left (`mtp.hidden`), through `fc`, the head's one decoder layer ([`Instance::draft_layer`])
    /// and its final norm, then the shared LM head on each sequence's last row alone.
    Draft,
}

/// The size a plan is compiled at: a step's rows and the sequences they belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Width {
    /// Sequences of the step (compared first, so batched verify shapes sort by sequences).
    pub seqs: u64,
    /// Rows of the step.
    pub rows: u64,
}

impl Width {
    /// A step of `seqs` sequences and `rows` rows in all.
    pub const fn new(rows: u64, seqs: u64) -> Width {
        Width { seqs, rows }
    }
}

impl fmt::Display for Width {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} rows of {} sequences", self.rows, self.seqs)
    }
}

impl Step {
    /// Sequences of a step of `rows` rows: one per row in decode, one in a single-sequence
    /// verify step and in a draft step.
    pub fn seqs(self, rows: u64) -> u64 {
        match self {
            Step::Decode => rows,
            Step::Verify | Step::Draft => 1,
        }
    }

    /// The width of a `rows`-row step of this kind with its usual sequences ([`Step::seqs`]).
    pub fn width(self, rows: u64) -> Width {
        Width::new(rows, self.seqs(rows))
    }

    /// Rows with logits in a step of `width`: all of them, but a draft step's one per sequence
    /// (its last).
    pub fn logit_rows(self, width: Width) -> u64 {
        match self {
            Step::Decode | Step::Verify => width.rows,
            Step::Draft => width.seqs,
        }
    }

    /// The step's text name.
    pub fn name(self) -> &'static str {
        match self {
            Step::Decode => "decode",
            Step::Verify => "verify",
            Step::Draft => "draft",
        }
    }
}

/// The padded decode widths up to `max_seqs`: 1, 2, 4, ... up to the first power of two at or
/// above it (a batch of `n` sequences runs at the next rung, padded). `max_seqs = 0` gives `[1]`.
pub fn decode_ladder(max_seqs: u64) -> Vec<u64> {
    let top = max_seqs
        .max(1)
        .checked_next_power_of_two()
        .unwrap_or(1 << 63);
    std::iter::successors(Some(1u64), |&w| w.checked_mul(2))
        .take_while(|&w| w <= top)
        .collect()
}

impl Instance {
    /// Check the invariants of the module header that need no shape.
    pub fn validate(&self) -> Result<(), CircuitError> {
        if self.layers.is_empty() {
            return Err(CircuitError::NoLayers);
        }
        for (layer, &spec) in self.layers.iter().enumerate() {
            if !self.architecture.has(spec) {
                return Err(CircuitError::LayerNotInArchitecture {
                    layer,
                    spec,
                    architecture: self.architecture.name(),
                });
            }
        }
        let ascending = self.widths.windows(2).all(|w| w[0] < w[1]);
        if self.widths.is_empty() || self.widths[0] == 0 || !ascending {
            return Err(CircuitError::BadWidths {
                widths: self.widths.clone(),
            });
        }
        let ascending = self.verify_rows.windows(2).all(|w| w[0] < w[1]);
        if self.verify_rows.first() == Some(&0) || !ascending {
            return Err(CircuitError::BadVerifyRows {
                rows: self.verify_rows.clone(),
            });
        }
        let ascending = self.verify_batches.windows(2).all(|w| w[0] < w[1]);
        if !ascending || (self.verify_batches.iter()).any(|w| w.seqs < 2 || w.rows <= w.seqs) {
            return Err(CircuitError::BadVerifyBatches {
                batches: self.verify_batches.clone(),
            });
        }
        let ascending = self.draft_batches.windows(2).all(|w| w[0] < w[1]);
        if !ascending || (self.draft_batches.iter()).any(|w| w.seqs < 2 || w.rows < w.seqs) {
            return Err(CircuitError::BadDraftBatches {
                batches: self.draft_batches.clone(),
            });
        }
        let ascending = self.draft_rows.windows(2).all(|w| w[0] < w[1]);
        if self.draft_rows.first() == Some(&0) || !ascending {
            return Err(CircuitError::BadDraftRows {
                rows: self.draft_rows.clone(),
            });
        }
        let drafts = !self.draft_rows.is_empty() || !self.draft_batches.is_empty();
        match self.draft_layer {
            None if drafts => return Err(CircuitError::NoDraftLayer),
            Some(spec) if spec.kind != LayerKind::FullAttention || !self.architecture.has(spec) => {
                return Err(CircuitError::BadDraftLayer {
                    spec,
                    architecture: self.architecture.name(),
                });
            }
            _ => {}
        }
        Ok(())
    }

    /// The widths `step` is compiled at: the decode widths, or the single-sequence verify (or
    /// draft) row counts then the batched verify (or draft) shapes.
    pub fn widths_of(&self, step: Step) -> Vec<Width> {
        let rows = match step {
            Step::Decode => &self.widths,
            Step::Verify => &self.verify_rows,
            Step::Draft => &self.draft_rows,
        };
        let batches = match step {
            Step::Decode => &[][..],
            Step::Verify => &self.verify_batches,
            Step::Draft => &self.draft_batches,
        };
        (rows.iter().map(|&r| step.width(r)))
            .chain(batches.iter().copied())
            .collect()
    }

    /// The value of `dim` in a `step` of `width`.
    pub fn dim(&self, dim: Dim, width: Width, step: Step) -> Result<u64, CircuitError> {
        let rows = width.rows;
        let d = &self.dims;
        let gdn = || d.gdn.ok_or(CircuitError::MissingDim { dim, group: "gdn" });
        let moe = || d.moe.ok_or(CircuitError::MissingDim { dim, group: "moe" });
        let q_stride = if self.architecture.attention_gated() {
            2 * d.head_dim
        } else {
            d.head_dim
        };
        // Saturating: a product that overflows stays huge, and the caller's extent check
        // never sees a wrapped small number.
        let mul = u64::saturating_mul;
        Ok(match dim {
            Dim::Rows => rows,
            Dim::Seqs => width.seqs,
            Dim::LogitRows => step.logit_rows(width),
            Dim::Hidden => d.hidden,
            Dim::Vocab => d.vocab,
            Dim::Ffn => d.ffn,
            Dim::QkvWidth => {
                mul(d.num_q_heads, q_stride).saturating_add(mul(2 * d.num_kv_heads, d.head_dim))
            }
            Dim::AttnOutWidth => mul(d.num_q_heads, d.head_dim),
            Dim::KvWidth => mul(d.num_kv_heads, d.head_dim),
            Dim::BlocksPerSeq => d.blocks_per_seq,
            Dim::GdnProjWidth => {
                let g = gdn()?;
                let value = mul(g.num_v_heads, g.v_head_dim);
                mul(2 * g.num_k_heads, g.k_head_dim)
                    .saturating_add(mul(2, value))
                    .saturating_add(mul(2, g.num_v_heads))
            }
            Dim::GdnConvDim => {
                let g = gdn()?;
                mul(2 * g.num_k_heads, g.k_head_dim)
                    .saturating_add(mul(g.num_v_heads, g.v_head_dim))
            }
            Dim::GdnQkWidth => {
                let g = gdn()?;
                mul(2 * g.num_k_heads, g.k_head_dim)
            }
            Dim::GdnVHeads => gdn()?.num_v_heads,
            Dim::GdnKHeadDim => gdn()?.k_head_dim,
            Dim::GdnVHeadDim => gdn()?.v_head_dim,
            Dim::GdnValueDim => {
                let g = gdn()?;
                mul(g.num_v_heads, g.v_head_dim)
            }
            Dim::ConvWindow => gdn()?.conv_kernel.saturating_sub(1),
            Dim::Experts => moe()?.num_experts,
            Dim::TopK => moe()?.top_k,
            Dim::ExpertFfn => moe()?.expert_ffn,
            Dim::SharedFfn => {
                moe()?
                    .shared
                    .ok_or(CircuitError::MissingDim {
                        dim,
                        group: "shared expert",
                    })?
                    .ffn
            }
        })
    }

    /// The plan text's header lines for this instance (architecture, dims, layers), each
    /// ending in a newline.
    pub(crate) fn header(&self) -> String {
        let d = &self.dims;
        let mut s = String::new();
        // Infallible: writing to a String.
        let _ = writeln!(s, "architecture {}", self.architecture);
        let _ = writeln!(
            s,
            "dims hidden={} vocab={} ffn={} q_heads={} kv_heads={} head_dim={} blocks_per_seq={}",
            d.hidden, d.vocab, d.ffn, d.num_q_heads, d.num_kv_heads, d.head_dim, d.blocks_per_seq
        );
        if let Some(g) = d.gdn {
            let _ = writeln!(
                s,
                "gdn k_heads={} k_head_dim={} v_heads={} v_head_dim={} conv_kernel={}",
                g.num_k_heads, g.k_head_dim, g.num_v_heads, g.v_head_dim, g.conv_kernel
            );
        }
        if let Some(m) = d.moe {
            let shared = match m.shared {
                None => "none".to_string(),
                Some(sh) => format!("{}{}", sh.ffn, if sh.gated { " gated" } else { "" }),
            };
            let _ = writeln!(
                s,
                "moe experts={} top_k={} expert_ffn={} shared={shared}",
                m.num_experts, m.top_k, m.expert_ffn
            );
        }
        if self.weights != WeightFormat::Bf16 {
            let _ = writeln!(s, "weights {}", self.weights.name());
        }
        if self.kv_cache != KvFormat::Bf16 {
            let _ = writeln!(s, "kv_cache {}", self.kv_cache.name());
        }
        let _ = writeln!(s, "layers {}: {}", self.layers.len(), runs(&self.layers));
        let _ = writeln!(s, "argmax {}", if self.argmax { "yes" } else { "no" });
        s
    }
}

/// `spec xN` for each run of equal consecutive layers, comma-separated.
fn runs(layers: &[LayerSpec]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while let Some(&spec) = layers.get(i) {
        let n = layers[i..].iter().take_while(|&&l| l == spec).count();
        out.push(if n == 1 {
            spec.to_string()
        } else {
            format!("{spec} x{n}")
        });
        i += n;
    }
    out.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladder_reaches_the_rung_a_full_batch_pads_to() {
        assert_eq!(decode_ladder(0), vec![1]);
        assert_eq!(decode_ladder(1), vec![1]);
        assert_eq!(decode_ladder(8), vec![1, 2, 4, 8]);
        assert_eq!(decode_ladder(9), vec![1, 2, 4, 8, 16]);
    }

    #[test]
    fn runs_compress_repeated_layers() {
        let la = LayerSpec {
            kind: LayerKind::LinearAttention,
            ffn: FfnKind::Dense,
        };
        let fa = LayerSpec {
            kind: LayerKind::FullAttention,
            ffn: FfnKind::Moe,
        };
        assert_eq!(
            runs(&[la, la, la, fa, la]),
            "linear_attention/dense x3, full_attention/moe, linear_attention/dense"
        );
    }
}
