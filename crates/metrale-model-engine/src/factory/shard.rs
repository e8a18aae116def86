//! Tensor-parallel shards: which part of each weight rank `r` of `N` holds (Megatron-style),
//! and the model config one rank's shard runs as.
//!
//! - Attention: query heads split evenly; KV heads split evenly, or, when there are fewer KV
//!   heads than ranks, each rank holds the one KV head its query heads read (replicated over
//!   `N / kv_heads` ranks). q/k/v (and the output gate rows that follow each query head) are
//!   column-parallel (output rows split), o is row-parallel (input columns split) and ends
//!   with an all-reduce.
//! - Dense MLP: gate and up column-parallel, down row-parallel.
//! - Gated DeltaNet: value heads split evenly; key heads split evenly, or replicated like KV
//!   heads when fewer than the ranks; the conv1d channels, `A_log`, `dt_bias` and the recurrent
//!   state follow the heads; out is row-parallel.
//! - MoE: tensor-parallel experts. Every rank holds every expert (and the shared expert) at
//!   `1 / N` of its width and routes every token itself (the router is replicated and reads
//!   the same bits on every rank, so every rank picks the same experts); each rank's combine
//!   is its part of the sum, all-reduced. Expert parallelism would need a token exchange
//!   (all-to-all) or expert-masked kernels, and balances only over many tokens; tensor-parallel
//!   experts keep the kernels as they are and every rank's load equal at any batch.
//! - Embedding and LM head: vocabulary-parallel, each rank a contiguous `1 / N` of the
//!   vocabulary (the same rows of both, one tensor when tied). A rank's embedding lookup writes
//!   zeros for the tokens other ranks hold and the all-reduce makes every row whole (exactly:
//!   one addend is the row, the others zero); the LM head's logits are all-gathered so the
//!   sampler reads the whole vocabulary on every rank.
//! - Norms, the router and the shared-expert gate are replicated.
//! - MTP head: its decoder layers sharded as the model's; its `fc` (hidden in, hidden out of
//!   a concatenation of two normed rows) and norms replicated.
//!
//! Invariant: what must divide does (heads, widths, vocabulary), checked before anything is
//! read, each failure a `ModelError::Options` naming `tensor_parallel_size` and the dimension.

use std::ops::Range;
use std::sync::Arc;

use metrale_config::ModelConfig;
use metrale_gpu_runtime::GpuBackend;

use crate::error::ModelError;

/// Rank `rank` of a tensor-parallel group of `size`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankShard {
    /// This rank, `0..size`.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
}

fn refuse(problem: String) -> ModelError {
    ModelError::Options {
        option: "tensor_parallel_size",
        problem,
    }
}

impl RankShard {
    /// This rank's part of `total` things split evenly (the caller checked `size` divides it).
    pub fn split(&self, total: usize) -> Range<usize> {
        let n = total / self.size;
        self.rank * n..(self.rank + 1) * n
    }

    /// This rank's KV (or GDN key) heads of `total`: an even split when there are at least as
    /// many as ranks, else the one head this rank's query (value) heads read.
    pub fn grouped(&self, total: usize) -> Range<usize> {
        if total >= self.size {
            self.split(total)
        } else {
            let h = self.rank / (self.size / total.max(1));
            h..h + 1
        }
    }

    /// The shard of each backend of a tensor-parallel group (`gpus[r]` drives rank `r` and must
    /// report it, `GpuBackend::tp_rank`) for `config`; `None` for one backend, which holds the
    /// whole model. Refused when the group's size is not one, or the model does not split over
    /// it.
    pub fn of_group(
        config: &ModelConfig,
        gpus: &[Arc<dyn GpuBackend>],
    ) -> Result<Option<Vec<RankShard>>, ModelError> {
        let size = gpus.len();
        RankShard::check_size(size)?;
        if size == 1 {
            return Ok(None);
        }
        RankShard::check(config, size)?;
        (gpus.iter().enumerate())
            .map(|(rank, gpu)| {
                let tp = gpu.tp_rank();
                if (tp.rank, tp.size) != (rank, size) {
                    return Err(refuse(format!(
                        "backend {rank} of {size} drives rank {} of a group of {}",
                        tp.rank, tp.size
                    )));
                }
                Ok(RankShard { rank, size })
            })
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// Check that `size` is a group size: 1, 2, 4 or 8.
    pub fn check_size(size: usize) -> Result<(), ModelError> {
        if matches!(size, 1 | 2 | 4 | 8) {
            Ok(())
        } else {
            Err(refuse(format!("{size} ranks (1, 2, 4 or 8)")))
        }
    }

    /// Check that `config` shards over `size` ranks: every split dimension divides, and heads
    /// shared by groups of ranks divide the ranks.
    pub fn check(config: &ModelConfig, size: usize) -> Result<(), ModelError> {
        RankShard::check_size(size)?;
        let divides = |what: &str, n: usize| {
            if n.is_multiple_of(size) {
                Ok(())
            } else {
                Err(refuse(format!("{size} ranks do not divide {what} ({n})")))
            }
        };
        let grouped = |what: &str, n: usize| {
            if n.is_multiple_of(size) || (n > 0 && size.is_multiple_of(n)) {
                Ok(())
            } else {
                Err(refuse(format!(
                    "{what} ({n}) neither split evenly over nor divide {size} ranks"
                )))
            }
        };
        let a = &config.attention;
        divides("num_attention_heads", a.num_attention_heads)?;
        grouped("num_key_value_heads", a.num_key_value_heads)?;
        divides("intermediate_size", config.intermediate_size)?;
        divides("vocab_size", config.tokens.vocab_size)?;
        if let Some(l) = &config.linear {
            divides("linear_num_value_heads", l.num_value_heads)?;
            grouped("linear_num_key_heads", l.num_key_heads)?;
        }
        if let Some(m) = &config.moe {
            divides("moe_intermediate_size", m.moe_intermediate_size)?;
            divides(
                "shared_expert_intermediate_size",
                m.shared_expert_intermediate_size,
            )?;
        }
        if size > 1 && config.checkpoint.quantization.is_some() {
            return Err(refuse(format!(
                "{size} ranks of an FP8 checkpoint: block-FP8 weights are read whole (their \
                 block scales do not slice with them); tensor parallelism loads bf16, f16 or \
                 f32 checkpoints"
            )));
        }
        Ok(())
    }

    /// The config one rank's shard runs as: its heads and widths, the vocabulary whole (the
    /// step's token ids and gathered logits span it).
    pub fn config(&self, config: &ModelConfig) -> ModelConfig {
        let mut c = config.clone();
        let a = &mut c.attention;
        a.num_attention_heads = self.split(a.num_attention_heads).len();
        a.num_key_value_heads = self.grouped(a.num_key_value_heads).len();
        c.intermediate_size = self.split(c.intermediate_size).len();
        if let Some(l) = c.linear.as_mut() {
            l.num_value_heads = self.split(l.num_value_heads).len();
            l.num_key_heads = self.grouped(l.num_key_heads).len();
        }
        if let Some(m) = c.moe.as_mut() {
            m.moe_intermediate_size = self.split(m.moe_intermediate_size).len();
            m.shared_expert_intermediate_size = self.split(m.shared_expert_intermediate_size).len();
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_heads_split_or_follow_their_query_heads() {
        // 4 query heads over 2 KV heads.
        let at = |rank, size| RankShard { rank, size };
        assert_eq!(at(1, 2).split(4), 2..4);
        assert_eq!(at(1, 2).grouped(2), 1..2);
        // Four ranks, one query head each: ranks 0 and 1 read KV head 0, ranks 2 and 3 head 1.
        let heads: Vec<_> = (0..4).map(|r| at(r, 4).grouped(2)).collect();
        assert_eq!(heads, vec![0..1, 0..1, 1..2, 1..2]);
        // One KV head: every rank holds it.
        assert!((0..4).all(|r| at(r, 4).grouped(1) == (0..1)));
        assert_eq!(at(3, 8).grouped(16), 6..8);
    }
}
