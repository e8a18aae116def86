//! The kernel manifest: every kernel as `(module, name)`, with its parameter struct. The CPU twin
//! table (`metrale-gpu-runtime`), the launchers' table of resolved kernels
//! (`metrale-model-layers::ops::Kernels`) and the circuit's kernel names (`metrale-circuit`) are
//! generated from it by [`for_each_kernel!`](crate::for_each_kernel), and `cargo xtask kernels`
//! checks the compiled modules' entry points against it ([`check_module_entries`]), so a kernel
//! missing from one of them, or one of them naming a kernel the manifest does not, fails the
//! build.
//!
//! Adding a kernel: its `.cu` source (the signature written with its parameter struct's macro
//! from `kernels/abi.cuh`), its CPU twin (a function named like it in the twin module of its
//! family), an entry here, and its launcher in `metrale-model-layers`.

use crate::layout::{KernelParams, ParamsLayout};

/// Calls `$callback! { ... }` with every kernel of the manifest, in manifest order, each as
///
/// ```text
/// /// what it computes
/// module::name => CONST_NAME(ParamsType),
/// ```
///
/// `CONST_NAME` is the kernel's name in upper case (the circuit's constants, the device fault
/// codes' `MT_KERNEL_` names); `ParamsType` its parameter struct in this crate.
#[macro_export]
macro_rules! for_each_kernel {
    ($callback:ident) => {
        $callback! {
            /// `out = silu(gate) * up` over rows of `[gate | up]`.
            activation::silu_mul => SILU_MUL($crate::SiluMulParams),
            /// `silu_mul` written as the down projection's stage images (and rows).
            activation::silu_mul_staged => SILU_MUL_STAGED($crate::SiluMulStagedParams),
            /// Causal paged attention of decode and verify rows: a cluster per item.
            attention::paged_attention => PAGED_ATTENTION($crate::PagedAttentionParams),
            /// `paged_attention`'s rows, bitwise, from a block per item.
            attention::paged_attention_flat => PAGED_ATTENTION_FLAT($crate::PagedAttentionParams),
            /// `paged_attention` on the row groups of a prefill chunk.
            attention::paged_attention_prefill => PAGED_ATTENTION_PREFILL($crate::PagedAttentionPrefillParams),
            /// `paged_attention_prefill` written as the o projection's stage images.
            attention::paged_attention_prefill_staged => PAGED_ATTENTION_PREFILL_STAGED($crate::PagedAttentionPrefillParams),
            /// `paged_attention_prefill`'s rows from clusters, a block a split of each item.
            attention::paged_attention_prefill_split => PAGED_ATTENTION_PREFILL_SPLIT($crate::PagedAttentionPrefillParams),
            /// `paged_attention_prefill_split` written as the o projection's stage images.
            attention::paged_attention_prefill_split_staged => PAGED_ATTENTION_PREFILL_SPLIT_STAGED($crate::PagedAttentionPrefillParams),
            /// The causal attention of prompt rows in their own arithmetic: one softmax chain a row
            /// over 64-key tiles (head_dim 128, bf16 pools).
            attention::paged_attention_prompt => PAGED_ATTENTION_PROMPT($crate::PagedAttentionPrefillParams),
            /// Each row's k and v into its slot of the paged KV cache.
            cache::kv_store => KV_STORE($crate::KvStoreParams),
            /// Token ids to embedding rows (the f32 residual).
            embed::embedding_gather => EMBEDDING_GATHER($crate::EmbeddingGatherParams),
            /// The rows that get logits.
            embed::gather_rows => GATHER_ROWS($crate::GatherRowsParams),
            /// f32 values rounded to bf16 (the all-reduce's sums as a bf16 activation).
            embed::round_bf16 => ROUND_BF16($crate::RoundBf16Params),
            /// Causal conv and SiLU over each sequence's window and rows.
            gdn::causal_conv1d => CAUSAL_CONV1D($crate::CausalConv1dParams),
            /// Each sequence's conv window advanced past its rows.
            gdn::conv_state_update => CONV_STATE_UPDATE($crate::ConvStateUpdateParams),
            /// A verify step's conv windows, each row's kept in its row slot.
            gdn::conv_state_verify => CONV_STATE_VERIFY($crate::ConvStateVerifyParams),
            /// L2-normalised q and k, and the gates.
            gdn::gdn_prepare => GDN_PREPARE($crate::GdnPrepareParams),
            /// The delta rule, one token per sequence and step, from each warp's own tile.
            gdn::gated_delta_recurrent => GATED_DELTA_RECURRENT($crate::GatedDeltaParams),
            /// The recurrent kernel's rows, bitwise, from persistent blocks streaming each head's
            /// state.
            gdn::gated_delta_streamed => GATED_DELTA_STREAMED($crate::GatedDeltaParams),
            /// The delta rule over a prefill chunk, bitwise the recurrent kernel's rows.
            gdn::gated_delta_chunked => GATED_DELTA_CHUNKED($crate::GatedDeltaChunkedParams),
            /// The delta rule of a verify step, each row's state kept in its row slot.
            gdn::gated_delta_verify => GATED_DELTA_VERIFY($crate::GatedDeltaVerifyParams),
            /// The gated output norm.
            gdn::gated_rms_norm => GATED_RMS_NORM($crate::GatedRmsNormParams),
            /// `out = x · wᵀ`, bf16 out: the tiled prefill kernel.
            gemm::linear => LINEAR($crate::LinearParams),
            /// `linear`, f32 out (LM head, MoE router, shared-expert gate).
            gemm::linear_f32out => LINEAR_F32OUT($crate::LinearParams),
            /// `linear` at up to 16 rows: persistent blocks of narrow units.
            gemm::linear_stream => LINEAR_STREAM($crate::LinearParams),
            /// `linear_stream`, f32 out.
            gemm::linear_stream_f32out => LINEAR_STREAM_F32OUT($crate::LinearParams),
            /// `linear_stream` with smaller batches, three blocks a multiprocessor.
            gemm::linear_stream_b4 => LINEAR_STREAM_B4($crate::LinearParams),
            /// `linear_stream_b4`, f32 out.
            gemm::linear_stream_b4_f32out => LINEAR_STREAM_B4_F32OUT($crate::LinearParams),
            /// `linear` at up to 128 rows: a cluster per tile of 128 columns by 64 rows.
            gemm::linear_stream_wide => LINEAR_STREAM_WIDE($crate::LinearParams),
            /// `linear_stream_wide`, f32 out.
            gemm::linear_stream_wide_f32out => LINEAR_STREAM_WIDE_F32OUT($crate::LinearParams),
            /// The gate/up projection writing `silu(gate) * up`, byte for byte `linear` then
            /// `silu_mul`.
            gemm::linear_swiglu => LINEAR_SWIGLU($crate::LinearParams),
            /// x written as the stage images `linear_tma` copies whole.
            gemm::permute_k32_tiles => PERMUTE_K32_TILES($crate::PermuteK32TilesParams),
            /// `linear` of stage images, the weight through its tensor map (prefill).
            gemm::linear_tma => LINEAR_TMA($crate::LinearTmaParams),
            /// `linear_tma`, f32 out.
            gemm::linear_tma_f32out => LINEAR_TMA_F32OUT($crate::LinearTmaParams),
            /// `linear` at 9..128 rows, the weight through its tensor map.
            gemm::linear_stream_tma => LINEAR_STREAM_TMA($crate::LinearStreamTmaParams),
            /// `linear_stream_tma`, f32 out.
            gemm::linear_stream_tma_f32out => LINEAR_STREAM_TMA_F32OUT($crate::LinearStreamTmaParams),
            /// `linear_stream` of a block-FP8 weight (bf16 out).
            gemm::linear_stream_fp8 => LINEAR_STREAM_FP8($crate::LinearFp8Params),
            /// `linear_stream_wide` of a block-FP8 weight (bf16 out).
            gemm::linear_stream_wide_fp8 => LINEAR_STREAM_WIDE_FP8($crate::LinearFp8Params),
            /// `linear_tma` of a block-FP8 weight, converted as the MMAs read it (prefill).
            gemm::linear_tma_fp8 => LINEAR_TMA_FP8($crate::LinearTmaFp8Params),
            /// The gate/up projection and the SwiGLU of a prefill, written as the down
            /// projection's stage images.
            gemm::linear_tma_swiglu => LINEAR_TMA_SWIGLU($crate::LinearTmaSwigluParams),
            /// `linear_tma_swiglu` of a block-FP8 weight.
            gemm::linear_tma_swiglu_fp8 => LINEAR_TMA_SWIGLU_FP8($crate::LinearTmaSwigluFp8Params),
            /// `linear_stream_tma` of a block-FP8 weight (17..128 rows).
            gemm::linear_stream_tma_fp8 => LINEAR_STREAM_TMA_FP8($crate::LinearStreamTmaFp8Params),
            /// A block-FP8 weight as bf16.
            gemm::dequant_fp8 => DEQUANT_FP8($crate::DequantFp8Params),
            /// A bf16 weight to block FP8.
            gemm::quantize_fp8 => QUANTIZE_FP8($crate::QuantizeFp8Params),
            /// Reproducible uniform bf16 fills (benchmark weights).
            init::fill_uniform_bf16 => FILL_UNIFORM_BF16($crate::FillUniformBf16Params),
            /// The router's top-k experts and weights.
            moe::topk_route => TOPK_ROUTE($crate::TopkRouteParams),
            /// Each (row, choice) pair through its expert's projection, bf16 out.
            moe::expert_linear => EXPERT_LINEAR($crate::ExpertLinearParams),
            /// `expert_linear`, f32 out.
            moe::expert_linear_f32out => EXPERT_LINEAR_F32OUT($crate::ExpertLinearParams),
            /// `expert_linear` of a block-FP8 stacked weight, bf16 out.
            moe::expert_linear_fp8 => EXPERT_LINEAR_FP8($crate::ExpertLinearFp8Params),
            /// `expert_linear_fp8`, f32 out.
            moe::expert_linear_fp8_f32out => EXPERT_LINEAR_FP8_F32OUT($crate::ExpertLinearFp8Params),
            /// The experts' outputs weighed and summed, plus the gated shared expert.
            moe::moe_combine => MOE_COMBINE($crate::MoeCombineParams),
            /// RMSNorm of the f32 residual (plain or `1 + w` by its `unit_offset`).
            norm::rms_norm => RMS_NORM($crate::RmsNormParams),
            /// Residual add, then RMSNorm.
            norm::add_rms_norm => ADD_RMS_NORM($crate::AddRmsNormParams),
            /// `add_rms_norm`, also writing the next projection's stage images.
            norm::add_rms_norm_staged => ADD_RMS_NORM_STAGED($crate::AddRmsNormStagedParams),
            /// Per-head q/k RMSNorm (none with null weights), then RoPE, in place.
            rope::qk_norm_rope => QK_NORM_ROPE($crate::QkNormRopeParams),
            /// `qk_norm_rope` and the cache store in one launch, the same arithmetic.
            rope::qk_norm_rope_kv_store => QK_NORM_ROPE_KV_STORE($crate::QkNormRopeKvStoreParams),
            /// The greedy token of each row.
            sampling::argmax => ARGMAX($crate::ArgmaxParams),
            /// Each row's token, its logprob and the top logprobs, after the sampling transforms.
            sampling::sample => SAMPLE($crate::SampleParams),
        }
    };
}

/// One kernel of the manifest.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelInfo {
    /// Its module: the `.cu` file's stem and the CPU twin's module.
    pub module: &'static str,
    /// Its function name.
    pub name: &'static str,
    /// Its name in upper case (`MT_KERNEL_<name>` in `kernels/abi.cuh`).
    pub const_name: &'static str,
    /// Its parameter struct.
    pub params: &'static ParamsLayout,
    /// What it computes (its manifest entry's documentation, line by line).
    pub doc: &'static [&'static str],
}

impl KernelInfo {
    /// `module::name`.
    pub fn label(&self) -> String {
        format!("{}::{}", self.module, self.name)
    }
}

macro_rules! kernel_infos {
    ($(
        #[doc = $doc:literal]
        $(#[doc = $more:literal])*
        $module:ident :: $name:ident => $konst:ident($params:ty)
    ),* $(,)?) => {
        /// Every kernel, in manifest order (a kernel's index is its fault code's).
        pub const KERNELS: &[KernelInfo] = &[
            $(KernelInfo {
                module: stringify!($module),
                name: stringify!($name),
                const_name: stringify!($konst),
                params: &<$params as KernelParams>::LAYOUT,
                doc: &[$doc $(, $more)*],
            },)*
        ];
    };
}

crate::for_each_kernel!(kernel_infos);

/// The manifest index of `module::name`.
pub fn kernel_index(module: &str, name: &str) -> Option<usize> {
    KERNELS
        .iter()
        .position(|k| k.module == module && k.name == name)
}

/// The manifest entry of `module::name`.
pub fn kernel_info(module: &str, name: &str) -> Option<&'static KernelInfo> {
    kernel_index(module, name).map(|i| &KERNELS[i])
}

/// Every module of the manifest, sorted, once each.
pub fn modules() -> Vec<&'static str> {
    let mut m: Vec<&'static str> = KERNELS.iter().map(|k| k.module).collect();
    m.sort_unstable();
    m.dedup();
    m
}

/// Every parameter struct, once each, in the order of the first kernel that takes it.
pub fn params_layouts() -> Vec<&'static ParamsLayout> {
    let mut out: Vec<&'static ParamsLayout> = Vec::new();
    for k in KERNELS {
        if !out.iter().any(|p| p.name == k.params.name) {
            out.push(k.params);
        }
    }
    out
}

/// The entry points a PTX module declares: each `.entry` with its parameters' sizes in order.
pub fn ptx_entries(ptx: &str) -> Vec<(String, Vec<usize>)> {
    let mut entries = Vec::new();
    let mut rest = ptx;
    while let Some(at) = rest.find(".entry ") {
        rest = &rest[at + ".entry ".len()..];
        let Some(open) = rest.find('(') else { break };
        let name = rest[..open].trim().to_string();
        let close = rest[open..].find(')').map_or(rest.len(), |c| open + c);
        let sizes = rest[open + 1..close]
            .split(',')
            .filter_map(|param| {
                let ty = param.split_whitespace().nth(1)?;
                Some(match ty {
                    ".u64" | ".s64" | ".b64" | ".f64" => 8,
                    ".u32" | ".s32" | ".b32" | ".f32" => 4,
                    ".u16" | ".s16" | ".b16" | ".f16" => 2,
                    _ => 1,
                })
            })
            .collect();
        entries.push((name, sizes));
        rest = &rest[close..];
    }
    entries
}

/// Checks a compiled module against the manifest: its `.entry` points (from its PTX) are
/// exactly the manifest's kernels of `module`, each with its parameter struct's parameter
/// sizes in order. Every problem, named, on failure.
pub fn check_module_entries(module: &str, ptx: &str) -> Result<(), Vec<String>> {
    let entries = ptx_entries(ptx);
    let mut problems = Vec::new();
    for k in KERNELS.iter().filter(|k| k.module == module) {
        match entries.iter().find(|(n, _)| n == k.name) {
            None => problems.push(format!(
                "the manifest's kernel `{}` has no `extern \"C\" __global__` entry in kernels/{module}.cu",
                k.label()
            )),
            Some((_, sizes)) => {
                let want: Vec<usize> = k.params.params().map(|(_, s)| s).collect();
                if *sizes != want {
                    problems.push(format!(
                        "`{}` takes parameters of {sizes:?} bytes, but its struct {} lays out {want:?} (write its signature with {})",
                        k.label(),
                        k.params.name,
                        k.params.c_macro
                    ));
                }
            }
        }
    }
    for (name, _) in &entries {
        if kernel_index(module, name).is_none() {
            problems.push(format!(
                "kernels/{module}.cu defines the entry `{name}`, which the manifest \
                 (crates/metrale-kernel-abi/src/manifest.rs) does not list"
            ));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_listed_once_and_named_in_upper_case() {
        for (i, k) in KERNELS.iter().enumerate() {
            assert_eq!(k.const_name, k.name.to_uppercase(), "{}", k.label());
            assert_eq!(
                kernel_index(k.module, k.name),
                Some(i),
                "{} twice",
                k.label()
            );
            assert!(
                KERNELS.iter().filter(|o| o.name == k.name).count() == 1,
                "two modules name a kernel `{}`",
                k.name
            );
        }
    }

    /// The PTX of a module: one entry per kernel with `sizes`.
    fn ptx(entries: &[(&str, &[&str])]) -> String {
        let mut s = String::from(".version 9.0\n.target sm_90a\n");
        for (name, types) in entries {
            let params: Vec<String> = types
                .iter()
                .enumerate()
                .map(|(i, t)| format!("\t.param {t} {name}_param_{i}"))
                .collect();
            s.push_str(&format!(
                ".visible .entry {name}(\n{}\n)\n{{\n\tret;\n}}\n",
                params.join(",\n")
            ));
        }
        s
    }

    const KV: &[&str] = &[
        ".u64", ".u64", ".u64", ".u64", ".u32", ".u32", ".u32", ".u32", ".u32", ".u32", ".u32",
        ".u32", ".f32", ".f32",
    ];

    #[test]
    fn a_module_matching_the_manifest_passes() {
        assert_eq!(
            check_module_entries("cache", &ptx(&[("kv_store", KV)])),
            Ok(())
        );
        assert_eq!(
            ptx_entries(&ptx(&[("kv_store", KV)])),
            vec![(
                "kv_store".to_string(),
                vec![8, 8, 8, 8, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4]
            )]
        );
    }

    #[test]
    fn a_renamed_missing_or_reshaped_entry_is_named() {
        let renamed = check_module_entries("cache", &ptx(&[("kv_store2", KV)])).unwrap_err();
        assert!(
            renamed
                .iter()
                .any(|p| p.contains("`cache::kv_store` has no")),
            "{renamed:?}"
        );
        assert!(
            renamed.iter().any(|p| p.contains("entry `kv_store2`")),
            "{renamed:?}"
        );
        let short = check_module_entries("cache", &ptx(&[("kv_store", &KV[..10])])).unwrap_err();
        assert!(short[0].contains("KV_STORE_PARAMS"), "{short:?}");
        let empty = check_module_entries("sampling", &ptx(&[])).unwrap_err();
        assert!(empty[0].contains("sampling::argmax"), "{empty:?}");
    }
}
