//! What a model's steps and caches are sized for, derived once from its config, its weights and
//! the options: the most rows, sequences and logit rows of a step, the block-table width, and
//! the cache layout (KV pools for the attention layers and a drafting MTP head, SSM slots and
//! snapshot entries for hybrid models). Speculative decoding with `K` drafts widens the logits
//! to `1 + K` rows per sequence and gives each sequence `1 + K` SSM slots.

use metrale_cache::{CacheLayout, KvCacheLayout, SsmLayout};
use metrale_config::ModelConfig;
use metrale_model_layers::layers::GdnShape;

use crate::error::ModelError;
use crate::model::Model;
use crate::options::{MAX_DRAFT_TOKENS, ModelOptions, Speculative};
use crate::runner::prefix::snapshot_interval;

/// The limits of one step, fixed at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepSizes {
    /// Most rows in one step.
    pub max_rows: usize,
    /// Most sequences in one step.
    pub max_seqs: usize,
    /// Most rows with logits in one step (`max_seqs`, times `1 + K` with `K` drafts).
    pub max_logit_rows: usize,
    /// Block-table columns per sequence.
    pub max_blocks: usize,
    /// Longest sequence (prompt plus output).
    pub max_seq_len: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Drafts per sequence the buffers hold (`K`; 0 without speculation).
    pub drafts: usize,
    /// Whether the MTP head runs (speculation with `Speculative::Mtp`).
    pub drafting: bool,
}

/// The longest sequence `options` give `config`: `max_seq_len`, or the config's
/// `max_position_embeddings` capped at 4096.
pub(crate) fn max_seq_len(config: &ModelConfig, options: &ModelOptions) -> usize {
    options
        .max_seq_len
        .unwrap_or(config.attention.max_position_embeddings.min(4096))
}

/// Block-table columns per sequence (`max_seq_len / block_size`, rounded up).
pub(crate) fn max_blocks(
    config: &ModelConfig,
    options: &ModelOptions,
) -> Result<usize, ModelError> {
    if options.block_size == 0 {
        return Err(bad("block_size", "must be positive".into()));
    }
    Ok(max_seq_len(config, options).div_ceil(options.block_size))
}

fn bad(option: &'static str, problem: String) -> ModelError {
    ModelError::Options { option, problem }
}

/// Check `options` for `model` and size its steps and caches.
pub(crate) fn size(
    model: &Model,
    options: &ModelOptions,
) -> Result<(StepSizes, CacheLayout), ModelError> {
    let config = model.config();
    if options.block_size == 0 || options.max_batch_tokens == 0 || options.max_decode_seqs == 0 {
        return Err(bad(
            "block_size / max_batch_tokens / max_decode_seqs",
            "must be positive".into(),
        ));
    }
    let max_seq_len = max_seq_len(config, options);
    if max_seq_len == 0 {
        return Err(bad("max_seq_len", "must be positive".into()));
    }
    // Positions and slots are u32 on the device.
    if u32::try_from(max_seq_len).is_err() {
        return Err(bad(
            "max_seq_len",
            format!(
                "{max_seq_len} tokens; positions are 32-bit, so at most {}",
                u32::MAX
            ),
        ));
    }
    if let Some(pct) = options.mixed_step_slowdown_pct
        && pct <= 100
    {
        return Err(bad(
            "mixed_step_slowdown_pct",
            format!(
                "{pct} %; a mixed step cannot take less than a plain decode step (more than 100)"
            ),
        ));
    }
    let interval = snapshot_interval(options.block_size);
    if let Some(stride) = options.ssm_snapshot_stride
        && (stride == 0 || !stride.is_multiple_of(interval))
    {
        return Err(bad(
            "ssm_snapshot_stride",
            format!(
                "{stride} tokens; it must be a positive multiple of the snapshot interval \
                 {interval} (lcm of block_size {} and 64)",
                options.block_size
            ),
        ));
    }
    let drafting = check_speculative(options, model)?;
    let max_seqs = options.max_decode_seqs;
    // A verify step holds 1 + K rows per sequence, each with logits; each sequence holds
    // 1 + K SSM slots (its own and one per draft, for rollback).
    let per_seq = 1 + options.draft_tokens();
    let max_logit_rows = max_seqs * per_seq;
    let max_blocks = max_seq_len.div_ceil(options.block_size);
    let sizes = StepSizes {
        max_rows: options.max_batch_tokens.max(max_logit_rows),
        max_seqs,
        max_logit_rows,
        max_blocks,
        max_seq_len,
        block_size: options.block_size,
        drafts: options.draft_tokens(),
        drafting,
    };
    let layers = model.cache_layers();
    let ssm = match GdnShape::from_config(config) {
        Some(g) if layers.num_ssm > 0 => Some(SsmLayout {
            num_gdn_layers: layers.num_ssm,
            slots: max_seqs * per_seq,
            conv_dim: g.heads.conv_dim() as usize,
            conv_kernel: g.conv_kernel as usize,
            num_v_heads: g.heads.num_v_heads as usize,
            k_head_dim: g.heads.k_head_dim as usize,
            v_head_dim: g.heads.v_head_dim as usize,
        }),
        None if layers.num_ssm > 0 => {
            return Err(ModelError::Unsupported(
                "GDN layers without linear-attention settings".into(),
            ));
        }
        _ => None,
    };
    // A drafting MTP head's layers get KV pools of their own after the model's, addressed
    // through the same block tables.
    let head_layers = match (drafting, model.mtp_head()) {
        (true, Some(h)) => h.layers.len(),
        _ => 0,
    };
    let mut kv = KvCacheLayout {
        num_layers: layers.num_kv + head_layers,
        num_kv_heads: config.attention.num_key_value_heads,
        head_dim: config.attention.head_dim,
        block_size: options.block_size,
        num_blocks: max_seqs * max_blocks + 1,
        dtype: options.kv_cache_dtype.resolve(config),
    };
    kv.num_blocks = match (options.num_kv_blocks, options.kv_cache_bytes) {
        (Some(n), _) => n,
        (None, Some(bytes)) => {
            let n = kv.blocks_in(bytes);
            if n < 2 {
                return Err(bad(
                    "kv_cache_bytes",
                    format!(
                        "{bytes} bytes hold {n} blocks of {} bytes over {} layers; the cache \
                         needs the dummy block and one more",
                        2 * kv.block_bytes(),
                        kv.num_layers
                    ),
                ));
            }
            n
        }
        (None, None) => kv.num_blocks,
    };
    let layout = CacheLayout {
        kv,
        snapshot_slots: if ssm.is_some() {
            options.snapshot_slots()
        } else {
            0
        },
        ssm,
    };
    Ok((sizes, layout))
}

/// Check the speculative options against the weights; whether the MTP head runs.
fn check_speculative(options: &ModelOptions, model: &Model) -> Result<bool, ModelError> {
    if options.speculative != Speculative::Off
        && !(1..=MAX_DRAFT_TOKENS).contains(&options.num_draft_tokens)
    {
        return Err(bad(
            "num_draft_tokens",
            format!(
                "{} drafts per step; 1 to {MAX_DRAFT_TOKENS} are allowed",
                options.num_draft_tokens
            ),
        ));
    }
    match options.speculative {
        Speculative::Off | Speculative::External => Ok(false),
        Speculative::Mtp => match model.mtp_head() {
            Some(m) if !m.layers.is_empty() => Ok(true),
            _ => Err(bad(
                "speculative",
                "MTP drafting needs the checkpoint's multi-token-prediction head (`mtp.*` \
                 tensors, with at least one layer), which it does not have"
                    .into(),
            )),
        },
    }
}
