//! `metrale bench --tensor-parallel-size N`: decode steps of a random-weight model sharded over
//! the N backends of a tensor-parallel group (`factory::random_ranks`), each beside its floor
//! per GPU: the bytes one rank reads (its weights, its KV heads and state for every sequence)
//! over the copy bandwidth measured in this run, plus the collectives a step runs, each at the
//! latency measured in this run at the step's size (all ranks exchanging at once).
//!
//! Invariants:
//! - Every rank issues the same collectives in the same order: each measurement runs on every
//!   rank's thread at once.
//! - The collectives counted per step are the ones the model launches: an all-reduce after the
//!   embedding, after each mixer's output projection and after each FFN (a sparse-MoE FFN: its
//!   experts' pairs, and its shared expert's output when it has one), and the all-gather of the
//!   LM head's logits.

use std::sync::Arc;

use metrale_config::ModelConfig;
use metrale_gpu_runtime::{DevicePtr, GpuBackend};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::Matrix;

use super::work::{decode_weight_bytes, kv_bytes_per_token, ssm_bytes_per_seq};
use super::{copy_bandwidth, time_decode, time_ms};
use crate::error::ModelError;
use crate::factory::{self, RankShard};
use crate::options::{ModelOptions, Quantization};
use crate::runner::StepRunner;

/// Collectives issued back to back per timed run of one collective's latency.
const LATENCY_REPEATS: usize = 20;

/// What to measure.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct TpBenchOptions {
    /// The whole model's shape (each rank builds its shard).
    pub config: ModelConfig,
    /// Decode batch sizes. Default 1 and 32.
    pub decode_batches: Vec<usize>,
    /// Context length of every decoding sequence. Default 1024.
    pub context: usize,
    /// Timed repetitions per figure (the median is reported). Default 10.
    pub iters: usize,
    /// Bytes of each buffer of the copy-bandwidth measurement (on rank 0's GPU). Default 1 GiB.
    pub copy_bytes: usize,
}

impl TpBenchOptions {
    /// Defaults for `config`.
    pub fn new(config: ModelConfig) -> TpBenchOptions {
        TpBenchOptions {
            config,
            decode_batches: vec![1, 32],
            context: 1024,
            iters: 10,
            copy_bytes: 1 << 30,
        }
    }
}

/// The collectives of one decode step and their measured latencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCollectives {
    /// All-reduces of `[rows, hidden]` f32 (the embedding, the mixers, the dense FFNs and the
    /// shared experts).
    pub all_reduces: usize,
    /// Median latency of one, µs.
    pub all_reduce_us: f64,
    /// All-reduces of the experts' `[rows * top_k, hidden]` f32 pairs (one per sparse-MoE FFN).
    pub expert_all_reduces: usize,
    /// Median latency of one, µs (0 without MoE layers).
    pub expert_all_reduce_us: f64,
    /// Median latency of the logits' all-gather (`[rows, vocab / N]` from each rank), µs.
    pub gather_us: f64,
}

impl StepCollectives {
    /// Collectives per step (the gather included).
    pub fn count(&self) -> usize {
        self.all_reduces + self.expert_all_reduces + 1
    }

    /// Their measured time per step, ms.
    pub fn ms(&self) -> f64 {
        (self.all_reduces as f64 * self.all_reduce_us
            + self.expert_all_reduces as f64 * self.expert_all_reduce_us
            + self.gather_us)
            * 1e-3
    }
}

/// One decode figure of a sharded model.
#[derive(Debug, Clone, PartialEq)]
pub struct TpDecodeFigure {
    /// Sequences in the step.
    pub batch: usize,
    /// Rows of the step (the batch padded up the decode ladder): the collectives' size.
    pub rows: usize,
    /// Median step time, ms.
    pub ms: f64,
    /// Bytes one rank reads in the step: its weights (its rows of the LM head, the experts its
    /// rows choose at its width) and its KV heads and SSM state of every sequence.
    pub rank_bytes: f64,
    /// The step's collectives.
    pub collectives: StepCollectives,
    /// The floor per GPU: `rank_bytes` over the copy bandwidth plus the collectives' time, ms.
    pub floor_ms: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct TpReport {
    /// Backend name.
    pub backend: String,
    /// Ranks (GPUs).
    pub ranks: usize,
    /// Device-to-device copy bandwidth (read + write) of rank 0's GPU, GB/s.
    pub copy_gb_s: f64,
    /// Weight bytes one rank reads in a decode step of one row.
    pub rank_weight_bytes: f64,
    /// Decode figures by batch.
    pub decode: Vec<TpDecodeFigure>,
}

/// Run `f(rank, gpu)` on every rank's thread at once; the results in rank order.
fn on_ranks<T: Send>(
    gpus: &[Arc<dyn GpuBackend>],
    f: impl Fn(usize, &Arc<dyn GpuBackend>) -> Result<T, ModelError> + Sync,
) -> Result<Vec<T>, ModelError> {
    std::thread::scope(|sc| {
        let f = &f;
        let handles: Vec<_> = (gpus.iter().enumerate())
            .map(|(r, g)| {
                sc.spawn(move || {
                    let out = f(r, g);
                    if out.is_err() {
                        g.abort_collectives();
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(ModelError::Step(
                        "a benchmark rank's thread panicked".into(),
                    ))
                })
            })
            .collect()
    })
}

/// Median latency of one all-reduce of `[rows, cols]` f32 in place (`gather`: of the all-gather
/// of `[rows, cols]` from each rank), every rank issuing it at once, µs (rank 0's timing).
fn collective_us(
    gpus: &[Arc<dyn GpuBackend>],
    rows: usize,
    cols: usize,
    gather: bool,
    iters: usize,
) -> Result<f64, ModelError> {
    let n = gpus.len();
    let times = on_ranks(gpus, |_, gpu| {
        let ops = Ops::new(gpu.clone())?;
        let s = gpu.default_stream();
        let (r, c) = (rows as u32, cols as u32);
        let local = gpu.alloc(rows * cols * 4)?;
        let out = if gather {
            gpu.alloc(rows * cols * n * 4)?
        } else {
            DevicePtr::NULL
        };
        gpu.memset(local, 0, rows * cols * 4, s)?;
        let ms = time_ms(gpu.as_ref(), s, iters, || {
            for _ in 0..LATENCY_REPEATS {
                let m = Matrix::f32(local, r, c);
                if gather {
                    ops.all_gather_cols(s, Matrix::f32(out, r, c * n as u32), m)?;
                } else {
                    ops.all_reduce_sum(s, m, m)?;
                }
            }
            Ok(())
        });
        gpu.free(local)?;
        if gather {
            gpu.free(out)?;
        }
        ms
    })?;
    Ok(times[0] * 1e3 / LATENCY_REPEATS as f64)
}

/// The collectives of a decode step of `rows` rows of `c` on `gpus`, measured.
fn step_collectives(
    gpus: &[Arc<dyn GpuBackend>],
    c: &ModelConfig,
    rows: usize,
    iters: usize,
) -> Result<StepCollectives, ModelError> {
    let layers = c.num_hidden_layers;
    let moe_layers = (0..layers).filter(|&i| c.layer_is_moe(i)).count();
    let shared = c
        .moe
        .as_ref()
        .is_some_and(|m| m.shared_expert_intermediate_size > 0);
    let dense_ffns = layers - moe_layers;
    let all_reduces = 1 + layers + dense_ffns + if shared { moe_layers } else { 0 };
    let top_k = c.moe.as_ref().map_or(0, |m| m.num_experts_per_tok);
    let expert_all_reduce_us = if moe_layers > 0 {
        collective_us(gpus, rows * top_k, c.hidden_size, false, iters)?
    } else {
        0.0
    };
    let vocab_cols = c.tokens.vocab_size / gpus.len();
    Ok(StepCollectives {
        all_reduces,
        all_reduce_us: collective_us(gpus, rows, c.hidden_size, false, iters)?,
        expert_all_reduces: moe_layers,
        expert_all_reduce_us,
        gather_us: collective_us(gpus, rows, vocab_cols, true, iters)?,
    })
}

/// The config rank 0 of `size` runs as, with its rows of the vocabulary as the vocabulary:
/// what the rank reads is what a whole model of this config reads.
fn counted_shard(c: &ModelConfig, size: usize) -> ModelConfig {
    let shard = RankShard { rank: 0, size };
    let mut counted = shard.config(c);
    counted.tokens.vocab_size = shard.split(c.tokens.vocab_size).len();
    counted
}

/// Bytes one rank of `size` reads in a decode step of `batch` sequences of `context` tokens:
/// the shard's weights with its rows of the vocabulary, its KV heads and SSM state.
fn rank_bytes(c: &ModelConfig, size: usize, batch: usize, context: usize) -> f64 {
    let counted = counted_shard(c, size);
    let kv = crate::options::KvCacheDtype::Auto.resolve(&counted);
    let per_seq =
        (context + 1) as f64 * kv_bytes_per_token(&counted, kv) + ssm_bytes_per_seq(&counted);
    decode_weight_bytes(&counted, Quantization::AsStored, batch) + batch as f64 * per_seq
}

/// Run the tensor-parallel decode benchmark on the backends of one group (`gpus[r]` drives
/// rank `r`).
pub fn tensor_parallel_bench(
    gpus: &[Arc<dyn GpuBackend>],
    opts: &TpBenchOptions,
) -> Result<TpReport, ModelError> {
    let c = &opts.config;
    let size = gpus.len();
    let copy_gb_s = copy_bandwidth(&gpus[0], opts.copy_bytes, opts.iters)?;
    let max_batch = opts.decode_batches.iter().copied().max().unwrap_or(1);
    let block_size = 16;
    let blocks_per_seq = (opts.context + 1).div_ceil(block_size);
    let options = ModelOptions::default()
        .max_batch_tokens(max_batch.max(16))
        .max_seq_len(opts.context + 1)
        .block_size(block_size)
        .num_kv_blocks(max_batch * blocks_per_seq + 1)
        .max_decode_seqs(max_batch)
        .decode_graphs(true)
        .prefix_caching(false)
        .tensor_parallel_size(size);
    let models = factory::random_ranks(c, gpus, 0x5eed)?;
    let (mut runner, mut cache) = StepRunner::new_ranks(models, options)?;
    let gpu0 = gpus[0].clone();
    let mut decode = Vec::new();
    for &batch in &opts.decode_batches {
        let shape = (batch, opts.context, opts.iters);
        let ms = time_decode(&mut runner, &mut cache, shape, |_| Ok(()))?;
        let width = runner.options().decode_width(batch).unwrap_or(batch);
        let collectives = step_collectives(gpus, c, width, opts.iters)?;
        let bytes = rank_bytes(c, size, batch, opts.context);
        decode.push(TpDecodeFigure {
            batch,
            rows: width,
            ms,
            rank_bytes: bytes,
            collectives,
            floor_ms: bytes / (copy_gb_s * 1e9) * 1e3 + collectives.ms(),
        });
    }
    Ok(TpReport {
        backend: gpu0.name().to_string(),
        ranks: size,
        copy_gb_s,
        rank_weight_bytes: decode_weight_bytes(&counted_shard(c, size), Quantization::AsStored, 1),
        decode,
    })
}

impl TpReport {
    /// The human-readable table: each step beside its floor per GPU.
    pub fn table(&self) -> String {
        let mut s = format!(
            "backend {} x {} ranks: copy {:.0} GB/s (rank 0), weights {:.2} GB a rank\n",
            self.backend,
            self.ranks,
            self.copy_gb_s,
            self.rank_weight_bytes / 1e9
        );
        s += "decode  batch  rows   ms/step   floor ms   x floor   tok/s   GB a rank   collectives   all-reduce µs   expert µs   gather µs   collectives ms\n";
        for d in &self.decode {
            let c = &d.collectives;
            s += &format!(
                "        {:>5} {:>5} {:>9.3} {:>10.3} {:>9.2} {:>7.0} {:>11.3} {:>13} {:>15.1} {:>11.1} {:>11.1} {:>16.3}\n",
                d.batch,
                d.rows,
                d.ms,
                d.floor_ms,
                d.ms / d.floor_ms,
                d.batch as f64 / (d.ms * 1e-3),
                d.rank_bytes / 1e9,
                c.count(),
                c.all_reduce_us,
                c.expert_all_reduce_us,
                c.gather_us,
                c.ms()
            );
        }
        s
    }
}

/// A tensor-parallel report of a tiny shape on `gpus` (one timed run each), for the tests.
pub fn tensor_parallel_smoke(
    gpus: &[Arc<dyn GpuBackend>],
    config: ModelConfig,
) -> Result<TpReport, ModelError> {
    let mut o = TpBenchOptions::new(config);
    o.decode_batches = vec![1, 3];
    o.context = 20;
    o.iters = 1;
    o.copy_bytes = 1 << 16;
    tensor_parallel_bench(gpus, &o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrale_gpu_runtime::CpuBackend;

    fn group(n: usize) -> Vec<Arc<dyn GpuBackend>> {
        (CpuBackend::tensor_parallel_group(n, Default::default()).into_iter())
            .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
            .collect()
    }

    #[test]
    fn the_tensor_parallel_benchmark_runs_a_dense_shape_on_two_cpu_ranks() {
        let config = super::super::tiny_for_cpu().unwrap();
        let report = tensor_parallel_smoke(&group(2), config.clone()).unwrap();
        assert_eq!(report.ranks, 2);
        assert_eq!(report.decode.len(), 2);
        // 2 layers: the embedding, then the attention and the MLP of each, and the gather.
        let c = &report.decode[0].collectives;
        assert_eq!((c.all_reduces, c.expert_all_reduces, c.count()), (5, 0, 6));
        assert!(c.all_reduce_us > 0.0 && c.gather_us > 0.0);
        for d in &report.decode {
            assert!(d.ms > 0.0 && d.floor_ms > d.collectives.ms() && d.collectives.ms() > 0.0);
        }
        // A rank reads about half the whole model's weights: its heads and widths and half
        // the LM head (the norms are whole on every rank).
        let whole = decode_weight_bytes(&config, Quantization::AsStored, 1);
        let rank = report.rank_weight_bytes;
        assert!(
            rank > 0.45 * whole && rank < 0.6 * whole,
            "{rank} of {whole}"
        );
        let table = report.table();
        assert!(
            table.contains("x 2 ranks") && table.contains("collectives"),
            "{table}"
        );
    }

    #[test]
    fn the_tensor_parallel_benchmark_counts_a_moe_shapes_expert_collectives() {
        let config = super::super::tiny_moe_for_cpu().unwrap();
        let report = tensor_parallel_smoke(&group(2), config).unwrap();
        // 4 layers with a sparse-MoE FFN and a shared expert: the embedding, 4 mixers, 4
        // shared experts; 4 experts' all-reduces; the gather.
        let c = &report.decode[1].collectives;
        assert_eq!((c.all_reduces, c.expert_all_reduces, c.count()), (9, 4, 14));
        assert!(c.expert_all_reduce_us > 0.0);
        // Three sequences read more KV and state than one.
        assert!(report.decode[1].rank_bytes > report.decode[0].rank_bytes);
    }
}
