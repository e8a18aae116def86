//! `TransformerModel::new`: size and allocate everything a model's steps touch, once — the KV
//! cache, the SSM state pool (hybrid models), and the step buffers in one arena — from the
//! config and the options. Speculative decoding with `K` drafts widens the logits to `1 + K`
//! rows per sequence, gives each sequence `1 + K` SSM slots, and adds the MTP head's KV pools
//! and input buffers.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_cache::{KvCacheLayout, PagedKvCache, SsmLayout, SsmSnapshotPool, SsmStatePool};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::arena::ArenaLayout;
use metrale_gpu_runtime::{BufferArena, DType, GpuBackend, GpuBackendExt};
use metrale_model_layers::layer::{GdnBuffers, MoeBuffers};
use metrale_model_layers::layers::{GdnShape, MoeShape};
use metrale_model_layers::ops_gemm::{self, LinearStaging};
use metrale_model_layers::{ModelDims, Ops, StepBuffers, TransformerLayer};

use crate::error::ModelError;
use crate::options::{MAX_DRAFT_TOKENS, ModelOptions, Speculative};

use super::mtp::MtpBuffers;
use super::{ModelWeights, TransformerModel};

impl TransformerModel {
    /// Build the model around loaded layers: size and allocate the KV cache and step buffers.
    pub fn new(
        config: ModelConfig,
        options: ModelOptions,
        gpu: Arc<dyn GpuBackend>,
        weights: ModelWeights,
        layers: Vec<Box<dyn TransformerLayer>>,
    ) -> Result<TransformerModel, ModelError> {
        let dims = ModelDims::from_config(&config);
        let ops = Ops::new(gpu.clone())?;
        let stream = gpu.default_stream();
        if options.block_size == 0 || options.max_batch_tokens == 0 || options.max_decode_seqs == 0
        {
            return Err(ModelError::Options {
                option: "block_size / max_batch_tokens / max_decode_seqs",
                problem: "must be positive".into(),
            });
        }
        let max_seq_len = options
            .max_seq_len
            .unwrap_or(config.max_position_embeddings.min(4096));
        if max_seq_len == 0 {
            return Err(ModelError::Options {
                option: "max_seq_len",
                problem: "must be positive".into(),
            });
        }
        let interval = super::prefix::snapshot_interval(options.block_size);
        if let Some(stride) = options.ssm_snapshot_stride
            && (stride == 0 || !stride.is_multiple_of(interval))
        {
            return Err(ModelError::Options {
                option: "ssm_snapshot_stride",
                problem: format!(
                    "{stride} tokens; it must be a positive multiple of the snapshot interval \
                     {interval} (lcm of block_size {} and 64)",
                    options.block_size
                ),
            });
        }
        let max_blocks = max_seq_len.div_ceil(options.block_size);
        let max_seqs = options.max_decode_seqs;
        let spec = check_speculative(&options, &weights)?;
        // A verify step holds 1 + K rows per sequence, each with logits; each sequence holds
        // 1 + K SSM slots (its own and one per draft, for rollback).
        let per_seq = 1 + options.draft_tokens();
        let max_logit_rows = max_seqs * per_seq;
        let max_rows = options.max_batch_tokens.max(max_logit_rows);
        let num_blocks = options.num_kv_blocks.unwrap_or(max_seqs * max_blocks + 1);

        let mut kv_layer = Vec::with_capacity(layers.len());
        let mut ssm_layer = Vec::with_capacity(layers.len());
        let (mut n_attn, mut n_gdn) = (0, 0);
        for l in &layers {
            kv_layer.push(l.uses_kv_cache().then(|| {
                n_attn += 1;
                n_attn - 1
            }));
            ssm_layer.push(l.uses_ssm_state().then(|| {
                n_gdn += 1;
                n_gdn - 1
            }));
        }
        let gdn = GdnShape::from_config(&config);
        let ssm_layout = gdn.map(|g| SsmLayout {
            num_gdn_layers: n_gdn,
            slots: max_seqs * per_seq,
            conv_dim: g.heads.conv_dim() as usize,
            conv_kernel: g.conv_kernel as usize,
            num_v_heads: g.heads.num_v_heads as usize,
            k_head_dim: g.heads.k_head_dim as usize,
            v_head_dim: g.heads.v_head_dim as usize,
        });
        let ssm = match ssm_layout {
            Some(l) if n_gdn > 0 => Some(SsmStatePool::new(gpu.clone(), l)?),
            _ if n_gdn > 0 => {
                return Err(ModelError::Unsupported(
                    "GDN layers without linear-attention settings".into(),
                ));
            }
            _ => None,
        };
        let ssm_snapshots = match ssm_layout {
            Some(l) if ssm.is_some() && options.snapshot_slots() > 0 => Some(SsmSnapshotPool::new(
                gpu.clone(),
                SsmLayout {
                    slots: options.snapshot_slots(),
                    ..l
                },
            )?),
            _ => None,
        };
        let moe = MoeShape::from_config(&config);
        // The MTP head's layers get KV pools of their own after the model's, addressed through
        // the same block tables.
        let n_mtp = spec.then(|| weights.mtp.as_ref().map_or(0, |m| m.layers.len()));
        let kv = PagedKvCache::new(
            gpu.clone(),
            KvCacheLayout {
                num_layers: n_attn + n_mtp.unwrap_or(0),
                num_kv_heads: config.num_key_value_heads,
                head_dim: config.head_dim,
                block_size: options.block_size,
                num_blocks,
            },
        )?;

        let (h, r, s) = (dims.hidden as usize, max_rows, max_seqs);
        let mut layout = ArenaLayout::default();
        layout
            .add("residual", DType::F32, r * h)
            .add("normed", DType::Bf16, r * h)
            .add("delta", DType::Bf16, r * h)
            .add("qkv", DType::Bf16, r * dims.qkv_width() as usize)
            .add("attn_out", DType::Bf16, r * dims.attn_out_width() as usize)
            .add("gate_up", DType::Bf16, r * 2 * dims.ffn as usize)
            .add("act", DType::Bf16, r * dims.ffn as usize)
            .add("token_ids", DType::U32, r)
            .add("positions", DType::U32, r)
            .add("row_seq", DType::U32, r)
            .add("att_groups", DType::U32, 2 * r)
            .add("slot_mapping", DType::U32, r)
            .add("block_tables", DType::U32, s * max_blocks)
            .add("logit_rows", DType::U32, max_logit_rows)
            .add("logits_in", DType::Bf16, max_logit_rows * h)
            .add("logits", DType::F32, max_logit_rows * dims.vocab as usize)
            .add("sampled", DType::U32, max_logit_rows)
            .add(
                "inv_freq",
                DType::F32,
                (dims.rotary_dim as usize / 2).max(1),
            )
            .add("seq_start", DType::U32, s + 1)
            .add("seq_slot", DType::U32, s)
            .add("row_slot", DType::U32, r);
        if let Some(g) = gdn.filter(|_| ssm.is_some()) {
            let hd = g.heads;
            let (key_dim, value_dim) = (
                (hd.num_k_heads * hd.k_head_dim) as usize,
                (hd.num_v_heads * hd.v_head_dim) as usize,
            );
            layout
                .add("gdn.proj", DType::Bf16, r * hd.proj_width() as usize)
                .add("gdn.conv", DType::Bf16, r * hd.conv_dim() as usize)
                .add("gdn.qk", DType::F32, r * 2 * key_dim)
                .add("gdn.gates", DType::F32, r * 2 * hd.num_v_heads as usize)
                .add("gdn.core", DType::F32, r * value_dim)
                .add("gdn.normed", DType::Bf16, r * value_dim);
        }
        let shared_ffn = config
            .moe
            .as_ref()
            .map_or(0, |m| m.shared_expert_intermediate_size);
        if let Some(m) = moe {
            let (e, k, f) = (
                m.num_experts as usize,
                m.top_k as usize,
                m.expert_ffn as usize,
            );
            layout
                .add("moe.router_logits", DType::F32, r * e)
                .add("moe.topk_ids", DType::U32, r * k)
                .add("moe.topk_weights", DType::F32, r * k)
                .add("moe.expert_gate_up", DType::Bf16, r * k * 2 * f)
                .add("moe.expert_act", DType::Bf16, r * k * f)
                .add("moe.expert_out", DType::F32, r * k * h)
                .add("moe.shared_gate_up", DType::Bf16, r * 2 * shared_ffn.max(1))
                .add("moe.shared_act", DType::Bf16, r * shared_ffn.max(1))
                .add("moe.shared_out", DType::Bf16, r * h)
                .add("moe.shared_gate", DType::F32, r);
        }
        if spec {
            layout
                .add("mtp.hidden_rows", DType::U32, r)
                .add("mtp.hidden", DType::F32, r * h)
                .add("mtp.cat_src", DType::Bf16, 2 * r * h)
                .add("mtp.cat_ids", DType::U32, 2 * r)
                .add("mtp.cat", DType::Bf16, r * 2 * h);
        }
        // `linear`'s prefill kernel stages x here (`Ops::set_linear_staging`): rows up to the
        // step's, k up to the widest input of any projection.
        let value_dim = gdn
            .filter(|_| ssm.is_some())
            .map_or(0, |g| g.heads.num_v_heads * g.heads.v_head_dim);
        let widest_input = [
            dims.hidden * if spec { 2 } else { 1 },
            dims.ffn,
            dims.attn_out_width(),
            value_dim,
            u32::try_from(shared_ffn).unwrap_or(u32::MAX),
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        // A map slot per projection: at most eight a layer (MoE: router, shared expert's three;
        // GDN: its input projections and output), the MTP head's layers and the LM head. The
        // slots and the images come whatever the step's rows: decode projections of 9..128 rows
        // read their weights through the maps too (`linear_stream_tma`), and most of them their
        // x from images their producer writes. (Without the slots, a model of
        // `max_batch_tokens` <= 128 ran every such projection through the map-less kernel:
        // Qwen3.5-9B's batch-64 step 11.5 against 9.0 ms on the H200.)
        let map_slots = 8 * (layers.len() + n_mtp.unwrap_or(0) + 1);
        let image_bytes = ops_gemm::linear_staging_bytes(r as u32, widest_input);
        let total = LinearStaging::bytes(image_bytes, map_slots);
        layout.add("linear_staging", DType::U32, total.div_ceil(4));
        let arena = BufferArena::build(gpu.clone(), &layout)?;
        let p = |n: &str| arena.get(n).ptr;
        ops.set_linear_staging(Some(LinearStaging::at(
            p("linear_staging"),
            image_bytes,
            map_slots,
        )));
        let buf = StepBuffers {
            residual: p("residual"),
            normed: p("normed"),
            delta: p("delta"),
            qkv: p("qkv"),
            attn_out: p("attn_out"),
            gate_up: p("gate_up"),
            act: p("act"),
            token_ids: p("token_ids"),
            positions: p("positions"),
            row_seq: p("row_seq"),
            att_groups: p("att_groups"),
            slot_mapping: p("slot_mapping"),
            block_tables: p("block_tables"),
            logit_rows: p("logit_rows"),
            logits_in: p("logits_in"),
            logits: p("logits"),
            sampled: p("sampled"),
            inv_freq: p("inv_freq"),
            seq_start: p("seq_start"),
            seq_slot: p("seq_slot"),
            row_slot: p("row_slot"),
            gdn: if ssm.is_some() {
                GdnBuffers {
                    proj: p("gdn.proj"),
                    conv: p("gdn.conv"),
                    qk: p("gdn.qk"),
                    gates: p("gdn.gates"),
                    core: p("gdn.core"),
                    normed: p("gdn.normed"),
                }
            } else {
                GdnBuffers::default()
            },
            moe: if moe.is_some() {
                MoeBuffers {
                    router_logits: p("moe.router_logits"),
                    topk_ids: p("moe.topk_ids"),
                    topk_weights: p("moe.topk_weights"),
                    expert_gate_up: p("moe.expert_gate_up"),
                    expert_act: p("moe.expert_act"),
                    expert_out: p("moe.expert_out"),
                    shared_gate_up: p("moe.shared_gate_up"),
                    shared_act: p("moe.shared_act"),
                    shared_out: p("moe.shared_out"),
                    shared_gate: p("moe.shared_gate"),
                }
            } else {
                MoeBuffers::default()
            },
        };
        let mtp = spec.then(|| MtpBuffers {
            hidden_rows: p("mtp.hidden_rows"),
            hidden: p("mtp.hidden"),
            cat_src: p("mtp.cat_src"),
            cat_ids: p("mtp.cat_ids"),
            cat: p("mtp.cat"),
            first_kv_layer: n_attn,
        });
        gpu.upload(buf.inv_freq, &config.rope.inv_freq(), stream)?;
        gpu.synchronize(stream)?;
        Ok(TransformerModel {
            config,
            dims,
            options,
            gpu,
            ops,
            stream,
            weights,
            layers,
            kv_layer,
            kv,
            ssm_layer,
            ssm,
            ssm_snapshots,
            buf,
            max_rows,
            max_seqs,
            max_logit_rows,
            max_blocks,
            max_seq_len,
            mtp,
            last_rows: 0,
            draft_program_steps: 0,
            graphs: HashMap::new(),
            circuit: None,
            _arena: arena,
        })
    }
}

/// Check the speculative options against the weights; whether the MTP head runs.
fn check_speculative(options: &ModelOptions, weights: &ModelWeights) -> Result<bool, ModelError> {
    if options.speculative != Speculative::Off
        && !(1..=MAX_DRAFT_TOKENS).contains(&options.num_draft_tokens)
    {
        return Err(ModelError::Options {
            option: "num_draft_tokens",
            problem: format!(
                "{} drafts per step; 1 to {MAX_DRAFT_TOKENS} are allowed",
                options.num_draft_tokens
            ),
        });
    }
    match options.speculative {
        Speculative::Off | Speculative::External => Ok(false),
        Speculative::Mtp => match &weights.mtp {
            Some(m) if !m.layers.is_empty() => Ok(true),
            _ => Err(ModelError::Options {
                option: "speculative",
                problem: "MTP drafting needs the checkpoint's multi-token-prediction head \
                              (`mtp.*` tensors, with at least one layer), which it does not have"
                    .into(),
            }),
        },
    }
}
