//! Where a decode step's time goes: every kernel of one decoder layer (and the embedding and LM
//! head) at a decode batch, launched through the same `Ops` launchers with the model's shapes,
//! captured as a graph of `REPS` launches and replayed (so each figure includes the in-graph
//! launch gap, as in a captured step), times how often the step runs it.
//!
//! Invariants:
//! - Every buffer is filled (random bf16, or a non-zero byte pattern) before it is read; weights
//!   rotate over enough copies that the L2 cache cannot serve a repeat.
//! - Everything allocated here is freed before returning.

use std::sync::Arc;

use metrale_cache::{KvDtype, KvScales};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{DevicePtr, GpuBackend, GpuBackendExt, StreamHandle};
use metrale_model_layers::ops::{KvStore, Matrix, PagedAttention, QkNormRope, VocabRows};
use metrale_model_layers::{KvBinding, ModelDims, Ops};

use super::median;
use crate::error::ModelError;

/// Launches per captured graph.
const REPS: usize = 20;

/// Weight bytes each rotated projection spans at least, so repeats miss the L2 cache (50 MB).
const ROTATE_BYTES: usize = 160 << 20;

/// Tokens per KV block.
const BLOCK: u32 = 16;

/// One kernel of the step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepPart {
    /// What runs (kernel and role).
    pub name: String,
    /// Launches per decode step.
    pub per_step: u32,
    /// Median time of one launch, µs.
    pub us: f64,
}

/// A decode step at one batch, kernel by kernel.
#[derive(Debug, Clone, PartialEq)]
pub struct Breakdown {
    /// Sequences in the step.
    pub batch: u32,
    /// Context of each sequence.
    pub context: u32,
    /// The kernels.
    pub parts: Vec<StepPart>,
}

impl Breakdown {
    /// The sum of every part times its count, ms.
    pub fn total_ms(&self) -> f64 {
        self.parts
            .iter()
            .map(|p| p.us * f64::from(p.per_step))
            .sum::<f64>()
            / 1e3
    }
}

/// Allocations of the breakdown, freed on drop.
struct Pool<'a> {
    gpu: &'a dyn GpuBackend,
    ops: &'a Ops,
    s: StreamHandle,
    live: Vec<DevicePtr>,
    seed: u64,
    /// Timed replays of each part's graph.
    iters: usize,
}

impl Pool<'_> {
    fn raw(&mut self, bytes: usize) -> Result<DevicePtr, ModelError> {
        let p = self.gpu.alloc(bytes.max(16))?;
        self.live.push(p);
        Ok(p)
    }

    /// `n` random bf16 in [offset - scale / 2, offset + scale / 2) (roughly).
    fn bf16(&mut self, n: usize, offset: f32, scale: f32) -> Result<DevicePtr, ModelError> {
        let p = self.raw(n * 2)?;
        self.seed += 1;
        self.ops
            .fill_uniform_bf16(self.s, p, n as u64, self.seed, offset, scale)?;
        Ok(p)
    }

    /// A device copy of `values`.
    fn upload(&mut self, values: &[impl bytemuck::Pod]) -> Result<DevicePtr, ModelError> {
        let p = self.raw(std::mem::size_of_val(values))?;
        self.gpu.upload(p, values, self.s)?;
        Ok(p)
    }

    /// `name`, run `per_step` times a step, timed by `time_launch`.
    fn part(
        &self,
        name: &str,
        per_step: u32,
        f: &dyn Fn(usize) -> Result<(), ModelError>,
    ) -> Result<StepPart, ModelError> {
        Ok(StepPart {
            name: name.to_string(),
            per_step,
            us: time_launch(self.gpu, self.s, self.iters, f)?,
        })
    }

    /// `bytes` set to a non-zero pattern (f32 0.0115 everywhere).
    fn pattern(&mut self, bytes: usize) -> Result<DevicePtr, ModelError> {
        let p = self.raw(bytes)?;
        self.gpu.memset(p, 0x3C, bytes, self.s)?;
        Ok(p)
    }

    /// Enough copies of an `[n, k]` weight that together they span `ROTATE_BYTES`.
    fn weights(&mut self, n: u32, k: u32) -> Result<Vec<DevicePtr>, ModelError> {
        let bytes = n as usize * k as usize * 2;
        let copies = ROTATE_BYTES.div_ceil(bytes).clamp(1, 8);
        let scale = (3.0 / k as f32).sqrt();
        (0..copies)
            .map(|_| self.bf16(n as usize * k as usize, 0.0, scale))
            .collect()
    }
}

impl Drop for Pool<'_> {
    fn drop(&mut self) {
        for p in self.live.drain(..) {
            if let Err(e) = self.gpu.free(p) {
                tracing::warn!("bench breakdown: freeing a buffer failed: {e}");
            }
        }
    }
}

/// Median µs of one launch of `f(i)` (i = 0, 1, ...), from a captured graph of `REPS` of them.
fn time_launch(
    gpu: &dyn GpuBackend,
    s: StreamHandle,
    iters: usize,
    f: &dyn Fn(usize) -> Result<(), ModelError>,
) -> Result<f64, ModelError> {
    gpu.begin_capture(s)?;
    let captured = (0..REPS).try_for_each(f);
    let graph = gpu.end_capture(s);
    captured?;
    let graph = graph?;
    let (a, b) = (gpu.create_event()?, gpu.create_event()?);
    let mut runs = Vec::with_capacity(iters);
    for i in 0..iters.max(1) + 1 {
        gpu.record_event(a, s)?;
        gpu.launch_graph(graph, s)?;
        gpu.record_event(b, s)?;
        let ms = f64::from(gpu.event_elapsed_ms(a, b)?);
        if i > 0 {
            runs.push(ms * 1e3 / REPS as f64);
        }
    }
    gpu.destroy_graph(graph)?;
    Ok(median(runs))
}

/// The step's kernels at `batch` sequences of `context` tokens each (the new token at position
/// `context`), for a dense model of shape `c`, the KV cache in `kv`.
pub fn decode_breakdown(
    gpu: &Arc<dyn GpuBackend>,
    c: &ModelConfig,
    (batch, context): (u32, u32),
    kv: KvDtype,
    iters: usize,
) -> Result<Breakdown, ModelError> {
    let g = gpu.as_ref();
    let ops = Ops::new(gpu.clone())?;
    let s = gpu.default_stream();
    let d = ModelDims::from_config(c);
    let layers = c.num_hidden_layers as u32;
    let mut pool = Pool {
        gpu: g,
        ops: &ops,
        s,
        live: Vec::new(),
        seed: 0xb5ea4,
        iters,
    };
    let (b, h) = (batch as usize, d.hidden as usize);
    let residual = pool.pattern(b * h * 4)?;
    let normed = pool.bf16(b * h, 0.0, 2.0)?;
    let delta = pool.bf16(b * h, 0.0, 0.2)?;
    let qkv = pool.bf16(b * d.qkv_width() as usize, 0.0, 2.0)?;
    let attn_out = pool.bf16(b * d.attn_out_width() as usize, 0.0, 2.0)?;
    let gate_up = pool.bf16(b * 2 * d.ffn as usize, 0.0, 4.0)?;
    let act = pool.bf16(b * d.ffn as usize, 0.0, 2.0)?;
    let norm_w = pool.bf16(h, 1.0, 0.2)?;
    let w_qkv = pool.weights(d.qkv_width(), d.hidden)?;
    let w_o = pool.weights(d.hidden, d.attn_out_width())?;
    let w_gate_up = pool.weights(2 * d.ffn, d.hidden)?;
    let w_down = pool.weights(d.hidden, d.ffn)?;
    let lm_head = pool.bf16(d.vocab as usize * h, 0.0, (3.0 / h as f32).sqrt())?;
    let logits = pool.raw(b * d.vocab as usize * 4)?;
    let logits_in = pool.bf16(b * h, 0.0, 2.0)?;
    // Row i is sequence i, and reads token i.
    let seqs: Vec<u32> = (0..batch).collect();
    let row_seq = pool.upload(&seqs)?;
    let token_ids = pool.upload(&seqs)?;
    let io = AttentionIo {
        qkv,
        attn_out,
        row_seq,
    };
    let attention = AttentionStep::new(&mut pool, c, (batch, context), kv, io)?;
    g.synchronize(s)?;

    let linear = |name: &str, out, x, w: &[DevicePtr], n, k| {
        pool.part(&format!("linear {name} {n}x{k}"), layers, &|i| {
            let (out, x) = (Matrix::bf16(out, batch, n), Matrix::bf16(x, batch, k));
            Ok(ops.linear(s, out, x, Matrix::bf16(w[i % w.len()], n, k))?)
        })
    };
    let rows = |p, cols| Matrix::bf16(p, batch, cols);
    let table = Matrix::bf16(lm_head, d.vocab, d.hidden);
    let mut parts = vec![pool.part("embedding_gather", 1, &|_| {
        let out = Matrix::f32(residual, batch, d.hidden);
        Ok(ops.embedding_gather(s, out, table, token_ids, VocabRows::whole(d.vocab))?)
    })?];
    parts.push(pool.part("add_rms_norm", 2 * layers, &|_| {
        let r = Matrix::f32(residual, batch, d.hidden);
        let (dl, n) = (rows(delta, d.hidden), rows(normed, d.hidden));
        Ok(ops.add_rms_norm(s, r, dl, n, &d.norm(norm_w))?)
    })?);
    parts.push(linear("qkv", qkv, normed, &w_qkv, d.qkv_width(), d.hidden)?);
    parts.extend(attention.parts(&pool, layers)?);
    let o_width = d.attn_out_width();
    parts.push(linear("o", delta, attn_out, &w_o, d.hidden, o_width)?);
    let (up, ffn2) = (&w_gate_up, 2 * d.ffn);
    parts.push(linear("gate_up", gate_up, normed, up, ffn2, d.hidden)?);
    parts.push(pool.part("silu_mul", layers, &|_| {
        Ok(ops.silu_mul(s, rows(act, d.ffn), rows(gate_up, 2 * d.ffn))?)
    })?);
    parts.push(linear("down", delta, act, &w_down, d.hidden, d.ffn)?);
    parts.push(pool.part("gather_rows", 1, &|_| {
        let (out, x) = (rows(logits_in, d.hidden), rows(normed, d.hidden));
        Ok(ops.gather_rows(s, out, x, row_seq)?)
    })?);
    let head = format!("linear_f32out lm_head {}x{}", d.vocab, d.hidden);
    parts.push(pool.part(&head, 1, &|_| {
        let out = Matrix::f32(logits, batch, d.vocab);
        Ok(ops.linear_f32out(s, out, rows(logits_in, d.hidden), table)?)
    })?);
    g.synchronize(s)?;
    Ok(Breakdown {
        batch,
        context: context + 1,
        parts,
    })
}

/// The step buffers the attention kernels share with the rest of the layer.
struct AttentionIo {
    qkv: DevicePtr,
    attn_out: DevicePtr,
    row_seq: DevicePtr,
}

/// The attention block's kernels (rotation, cache store, paged attention) with the KV cache,
/// block tables and positions of `batch` sequences of `context` tokens: sequence i owns blocks
/// i * max_blocks .. (i + 1) * max_blocks, and its new token sits at position `context`.
struct AttentionStep {
    rope: QkNormRope,
    store: KvStore,
    attention: PagedAttention,
    context: u32,
}

impl AttentionStep {
    fn new(
        pool: &mut Pool<'_>,
        c: &ModelConfig,
        (batch, context): (u32, u32),
        dtype: KvDtype,
        io: AttentionIo,
    ) -> Result<Self, ModelError> {
        let d = ModelDims::from_config(c);
        let head_norm = pool.bf16(d.head_dim as usize, 1.0, 0.2)?;
        let inv_freq = pool.upload(&c.attention.rope.inv_freq())?;
        let max_blocks = (context + 1).div_ceil(BLOCK);
        let num_slots = batch * max_blocks * BLOCK;
        let kv_elems = num_slots as usize * (d.num_kv_heads * d.head_dim) as usize;
        let k_cache = pool.bf16(kv_elems, 0.0, 2.0)?;
        let v_cache = pool.bf16(kv_elems, 0.0, 2.0)?;
        let tables: Vec<u32> = (0..batch * max_blocks).collect();
        let block_tables = pool.upload(&tables)?;
        let positions = pool.upload(&vec![context; batch as usize])?;
        let slots: Vec<u32> = (0..batch)
            .map(|i| i * max_blocks * BLOCK + context)
            .collect();
        let slot_mapping = pool.upload(&slots)?;
        let norms = (head_norm, head_norm);
        let kv = KvBinding {
            k: k_cache,
            v: v_cache,
            block_size: BLOCK,
            num_slots,
            // bf16-sized pools; an FP8 cache reads the first half of each as e4m3 bytes.
            dtype,
            scales: KvScales { k: 0.5, v: 0.25 },
        };
        Ok(Self {
            rope: d.rope_params(io.qkv, norms, inv_freq, positions, batch),
            store: d.store_params(io.qkv, &kv, slot_mapping, batch),
            attention: PagedAttention {
                out: io.attn_out,
                qkv: io.qkv,
                k_cache,
                v_cache,
                block_tables,
                row_seq: io.row_seq,
                positions,
                rows: batch,
                row_stride: d.qkv_width(),
                q_head_stride: d.q_head_stride(),
                num_q_heads: d.num_q_heads,
                num_kv_heads: d.num_kv_heads,
                head_dim: d.head_dim,
                block_size: BLOCK,
                max_blocks,
                num_seqs: batch,
                num_slots,
                scale: 1.0 / (d.head_dim as f32).sqrt(),
                gated: d.attn_gated,
                kv_dtype: kv.dtype,
                kv_scales: kv.scales,
            },
            context,
        })
    }

    /// The three kernels, each run `layers` times a step.
    fn parts(&self, pool: &Pool<'_>, layers: u32) -> Result<Vec<StepPart>, ModelError> {
        let (ops, s) = (pool.ops, pool.s);
        let name = format!("paged_attention ctx {}", self.context + 1);
        Ok(vec![
            pool.part("qk_norm_rope", layers, &|_| {
                Ok(ops.qk_norm_rope(s, &self.rope)?)
            })?,
            pool.part("kv_store", layers, &|_| Ok(ops.kv_store(s, &self.store)?))?,
            pool.part(&name, layers, &|_| {
                Ok(ops.paged_attention(s, &self.attention)?)
            })?,
        ])
    }
}
