//! `TransformerModel`: the loaded layers, the KV cache and the step buffers, and `forward`, which
//! runs one step of rows (prefill chunks and decode rows alike) and leaves logits for the rows
//! that asked for them.
//!
//! Invariants:
//! - Every buffer a step touches was allocated at load (`BufferArena`); a step allocates nothing
//!   on the device and only uploads its metadata to fixed addresses.
//! - A row's result depends only on its token, position and sequence cache, never on the other
//!   rows of the step.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_cache::{BlockTable, PagedKvCache, SsmSnapshotPool, SsmStatePool};
use metrale_config::ModelConfig;
use metrale_gpu_runtime::{BufferArena, GpuBackend, GpuBackendExt, GraphHandle, StreamHandle};
use metrale_model_layers::circuit_exec::CircuitExec;
use metrale_model_layers::layer::SsmBinding;
use metrale_model_layers::layers::MtpHead;
use metrale_model_layers::ops::Matrix;
use metrale_model_layers::weight_map::DenseWeight;
use metrale_model_layers::{
    KvBinding, LayerCtx, ModelDims, Ops, StepBuffers, StepShape, TransformerLayer,
};

use crate::error::ModelError;
use crate::options::ModelOptions;

mod build;
mod mtp;
mod prefix;
mod upload;
mod verify;

pub use mtp::MtpStep;
pub use prefix::{ChunkCuts, prefill_chunk};

/// One row of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRow {
    /// Input token.
    pub token: u32,
    /// Its position in its sequence.
    pub position: u32,
    /// Its sequence: an index into the step's block tables. Rows of one sequence are
    /// contiguous and in position order, and sequences appear in index order.
    pub seq: u32,
}

/// One step's input.
#[derive(Debug, Clone, Copy)]
pub struct StepInput<'a> {
    /// The rows, in order.
    pub rows: &'a [StepRow],
    /// The block table of each sequence in the step; they must cover every row's position.
    pub tables: &'a [&'a BlockTable],
    /// Indices of the rows whose logits are wanted.
    pub logit_rows: &'a [u32],
    /// The SSM state slot of each sequence (hybrid models; empty for models without GDN
    /// layers).
    pub ssm_slots: &'a [u32],
}

/// The model's non-layer weights.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed: DenseWeight,
    /// `[hidden]`.
    pub final_norm: DenseWeight,
    /// `[vocab, hidden]` (the embedding when tied).
    pub lm_head: DenseWeight,
    /// The multi-token-prediction head, when the checkpoint ships one (run by speculative
    /// decoding, `TransformerModel::mtp_step`).
    pub mtp: Option<MtpHead>,
}

/// What a captured graph replays: one kind of step at one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum GraphKey {
    /// A decode step of this padded width, of whichever forward is selected.
    Decode(u32),
    /// A verify step of this many rows and sequences, of whichever forward is selected.
    Verify {
        /// Rows (every one with logits).
        rows: u32,
        /// Sequences.
        seqs: u32,
    },
    /// An MTP step of whichever forward is selected (the circuit's draft program, or the
    /// legacy launches).
    Mtp {
        rows: u32,
        seqs: u32,
        logit_rows: u32,
        layer: usize,
    },
}

/// See the module header.
#[derive(Debug)]
pub struct TransformerModel {
    pub(crate) config: ModelConfig,
    pub(crate) dims: ModelDims,
    pub(crate) options: ModelOptions,
    pub(crate) gpu: Arc<dyn GpuBackend>,
    pub(crate) ops: Ops,
    pub(crate) stream: StreamHandle,
    pub(crate) weights: ModelWeights,
    pub(crate) layers: Vec<Box<dyn TransformerLayer>>,
    /// For each layer, its KV-cache layer index when it is an attention layer.
    kv_layer: Vec<Option<usize>>,
    kv: PagedKvCache,
    /// For each layer, its SSM-pool layer index when it is a GDN layer.
    ssm_layer: Vec<Option<usize>>,
    /// Every GDN layer's conv and recurrent state per slot (hybrid models).
    ssm: Option<SsmStatePool>,
    /// Copies of that state at prefix positions (hybrid models with prefix caching).
    ssm_snapshots: Option<SsmSnapshotPool>,
    pub(crate) buf: StepBuffers,
    max_rows: usize,
    max_seqs: usize,
    /// Rows with logits in one step: `max_seqs * (1 + K)` with `K` drafts per verify step.
    max_logit_rows: usize,
    pub(crate) max_blocks: usize,
    max_seq_len: usize,
    /// The MTP head's buffers and KV layers, when speculative decoding runs it.
    pub(crate) mtp: Option<mtp::MtpBuffers>,
    /// Rows of the last step run (padding included): what `normed` holds.
    last_rows: usize,
    /// MTP steps that ran the circuit's draft program (`mtp.rs`).
    draft_program_steps: u64,
    /// Captured steps (with `decode_graphs`), by what they replay.
    pub(crate) graphs: HashMap<GraphKey, GraphHandle>,
    /// The circuit executor whose programs run decode; `None`: the legacy forward
    /// (`model_circuit.rs`). Declared before the arena so it drops first.
    pub(crate) circuit: Option<CircuitExec>,
    _arena: BufferArena,
}

impl TransformerModel {
    /// The multi-token-prediction head's weights, when the checkpoint has them.
    pub fn mtp_head(&self) -> Option<&MtpHead> {
        self.weights.mtp.as_ref()
    }

    /// The config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The options the model was built with.
    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// Draft up to `k` tokens per verify step from now on (`speculative` on): at most what the
    /// model was built for (`num_draft_tokens` at load sizes the buffers and slots).
    pub fn set_num_draft_tokens(&mut self, k: usize) -> Result<(), ModelError> {
        let built = (self.max_logit_rows / self.max_seqs).saturating_sub(1);
        if self.options.speculative == crate::options::Speculative::Off || !(1..=built).contains(&k)
        {
            return Err(ModelError::Options {
                option: "num_draft_tokens",
                problem: format!(
                    "{k} drafts per step; this model was built for 1 to {built} (speculative on)"
                ),
            });
        }
        self.options.num_draft_tokens = k;
        Ok(())
    }

    /// The backend.
    pub fn gpu(&self) -> &Arc<dyn GpuBackend> {
        &self.gpu
    }

    /// Longest sequence the model serves.
    pub fn max_seq_len(&self) -> usize {
        self.max_seq_len
    }

    /// Most rows in one step.
    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Most sequences in one step.
    pub fn max_seqs(&self) -> usize {
        self.max_seqs
    }

    /// Most rows with logits in one step (`max_seqs`, times `1 + K` with `K` drafts).
    pub fn max_logit_rows(&self) -> usize {
        self.max_logit_rows
    }

    /// The KV cache (its allocator hands out blocks to sequences).
    pub fn kv_cache(&mut self) -> &mut PagedKvCache {
        &mut self.kv
    }

    /// Whether the model keeps per-sequence SSM state (it has GDN layers).
    pub fn has_ssm_state(&self) -> bool {
        self.ssm.is_some()
    }

    /// A zeroed SSM state slot for a new sequence; `None` for a model without GDN layers.
    pub fn alloc_ssm_slot(&mut self) -> Result<Option<u32>, ModelError> {
        let Some(pool) = self.ssm.as_mut() else {
            return Ok(None);
        };
        let slot = pool.alloc_slot()?;
        pool.zero_slot(slot, self.stream)?;
        Ok(Some(slot))
    }

    /// Return a sequence's SSM state slot.
    pub fn free_ssm_slot(&mut self, slot: u32) -> Result<(), ModelError> {
        if let Some(pool) = self.ssm.as_mut() {
            pool.free_slot(slot)?;
        }
        Ok(())
    }

    /// SSM state slots in the pool (`None` for a model without GDN layers).
    pub fn num_ssm_slots(&self) -> Option<usize> {
        self.ssm.as_ref().map(SsmStatePool::num_slots)
    }

    /// Free SSM state slots (`None` for a model without GDN layers).
    pub fn free_ssm_slots(&self) -> Option<usize> {
        self.ssm.as_ref().map(SsmStatePool::num_free)
    }

    /// Run one step: embed, every layer, the final norm, and the LM head on the logit rows.
    /// Logits are left on the device; read them with [`TransformerModel::logits`].
    pub fn forward(&mut self, input: &StepInput<'_>) -> Result<(), ModelError> {
        self.check(input)?;
        let shape = self.upload_forward(input)?;
        self.last_rows = shape.rows as usize;
        self.launch_step(shape)?;
        Ok(())
    }

    /// Upload `input` as [`TransformerModel::forward`] does and return the step's launches
    /// without running them (the legacy forward, as every prefill runs): for a launch-by-launch
    /// profile of a prefill.
    pub fn forward_launches(
        &mut self,
        input: &StepInput<'_>,
    ) -> Result<Vec<metrale_model_layers::circuit_exec::Launch>, ModelError> {
        self.check(input)?;
        let shape = self.upload_forward(input)?;
        self.last_rows = shape.rows as usize;
        self.record_step(shape)
    }

    /// Run one decode step: row `i` is sequence `i`'s next token. The step is padded to the
    /// decode ladder width and, with `decode_graphs`, replayed from a graph captured the first
    /// time that width runs. Logit row `i` belongs to sequence `i`.
    pub fn decode(
        &mut self,
        rows: &[StepRow],
        tables: &[&BlockTable],
        ssm_slots: &[u32],
    ) -> Result<(), ModelError> {
        if rows.iter().enumerate().any(|(i, r)| r.seq as usize != i) || rows.len() != tables.len() {
            return Err(ModelError::Step(
                "a decode step has one row per sequence, row i for sequence i".into(),
            ));
        }
        let logit_rows: Vec<u32> = (0..rows.len() as u32).collect();
        let input = StepInput {
            rows,
            tables,
            logit_rows: &logit_rows,
            ssm_slots,
        };
        self.check(&input)?;
        let width = self.options.decode_width(rows.len()).ok_or_else(|| {
            ModelError::Step(format!(
                "{} sequences exceed max_decode_seqs {}",
                rows.len(),
                self.options.max_decode_seqs
            ))
        })?;
        let shape = self.upload(&input, Some(width), None)?;
        self.last_rows = shape.rows as usize;
        if !self.options.decode_graphs {
            return self.launch_decode(shape);
        }
        let key = GraphKey::Decode(shape.rows);
        if self.circuit.is_none() {
            self.map_before_capture(key, shape)?;
        }
        self.replay(key, |m| m.launch_decode(shape))
    }

    /// Before the first capture under `key` of a step that runs the legacy launches: record
    /// them once (nothing runs), which uploads the tensor maps its projections read
    /// (`Ops::linear` makes a weight's map on first use, but not while a graph is captured,
    /// and runs a slower kernel with the same rows instead). A circuit program made its maps
    /// when it was compiled.
    pub(crate) fn map_before_capture(
        &self,
        key: GraphKey,
        shape: StepShape,
    ) -> Result<(), ModelError> {
        if !self.graphs.contains_key(&key) {
            self.record_step(shape)?;
        }
        Ok(())
    }

    /// Replay the graph captured under `key`, first capturing `launch`'s launches on the
    /// model's stream when there is none.
    pub(crate) fn replay(
        &mut self,
        key: GraphKey,
        launch: impl FnOnce(&Self) -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let graph = match self.graphs.get(&key) {
            Some(&g) => g,
            None => {
                self.gpu.begin_capture(self.stream)?;
                let captured = launch(self);
                let ended = self.gpu.end_capture(self.stream);
                captured?;
                let g = ended?;
                self.graphs.insert(key, g);
                g
            }
        };
        self.gpu.launch_graph(graph, self.stream)?;
        Ok(())
    }

    /// Whether a graph may be replayed (or captured) under `key`, a verify or MTP step: it is
    /// kept already, or fewer than `ModelOptions::max_speculative_graphs` such graphs are.
    pub(crate) fn graph_room(&self, key: GraphKey) -> bool {
        let kept = (self.graphs.keys())
            .filter(|k| matches!(k, GraphKey::Verify { .. } | GraphKey::Mtp { .. }))
            .count();
        self.graphs.contains_key(&key) || kept < self.options.max_speculative_graphs
    }

    /// The launches of one decode step of the selected forward: the circuit program of its
    /// width, or the legacy step.
    fn launch_decode(&self, shape: StepShape) -> Result<(), ModelError> {
        let Some(exec) = &self.circuit else {
            return self.launch_step(shape);
        };
        let program = exec.program(u64::from(shape.rows)).ok_or_else(|| {
            ModelError::Step(format!(
                "the circuit has no program for {} rows",
                shape.rows
            ))
        })?;
        Ok(program.replay(self.gpu.as_ref(), self.stream)?)
    }

    /// The launches of one step, reading only the step buffers (what a graph would capture).
    fn launch_step(&self, shape: StepShape) -> Result<(), ModelError> {
        self.launch_step_with(&self.ops, shape)
    }

    /// KV-cache layer `k` (the model's attention layers, then the MTP head's), as a step sees it.
    pub(crate) fn kv_binding(&self, k: usize) -> KvBinding {
        let pools = self.kv.layer(k);
        KvBinding {
            k: pools.k,
            v: pools.v,
            block_size: self.kv.block_size() as u32,
            num_slots: self.kv.num_slots() as u32,
        }
    }

    /// Layer `i`'s KV cache and SSM state, as its forward (and the circuit) sees them.
    pub(crate) fn layer_bindings(&self, i: usize) -> (Option<KvBinding>, Option<SsmBinding>) {
        let kv = self
            .kv_layer
            .get(i)
            .copied()
            .flatten()
            .map(|k| self.kv_binding(k));
        let ssm = match (self.ssm_layer.get(i).copied().flatten(), &self.ssm) {
            (Some(g), Some(pool)) => pool.layer(g).map(|p| SsmBinding {
                conv: p.conv,
                recurrent: p.recurrent,
                conv_slot_stride: (p.conv_slot_bytes / 4) as u32,
                recurrent_slot_stride: (p.recurrent_slot_bytes / 4) as u32,
                num_slots: pool.num_slots() as u32,
            }),
            _ => None,
        };
        (kv, ssm)
    }

    /// The legacy step through `ops` (the model's launchers, or recording ones).
    pub(crate) fn launch_step_with(&self, ops: &Ops, shape: StepShape) -> Result<(), ModelError> {
        let (s, b, d) = (self.stream, &self.buf, &self.dims);
        let residual = Matrix::f32(b.residual, shape.rows, d.hidden);
        ops.embedding_gather(s, residual, self.weights.embed.matrix(), b.token_ids)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let (kv, ssm) = self.layer_bindings(i);
            let cx = LayerCtx {
                ops,
                stream: s,
                buf: b,
                shape,
                dims: d,
                kv,
                ssm,
                first: i == 0,
            };
            layer.forward(&cx)?;
        }
        let (delta, normed) = (
            Matrix::bf16(b.delta, shape.rows, d.hidden),
            Matrix::bf16(b.normed, shape.rows, d.hidden),
        );
        let norm = d.norm(self.weights.final_norm.ptr);
        ops.add_rms_norm(s, residual, delta, normed, &norm)?;
        self.launch_lm_head(ops, shape)
    }

    /// The LM head on the step's logit rows of `normed`.
    fn launch_lm_head(&self, ops: &Ops, shape: StepShape) -> Result<(), ModelError> {
        let (s, b, d) = (self.stream, &self.buf, &self.dims);
        if shape.logit_rows > 0 {
            let logits_in = Matrix::bf16(b.logits_in, shape.logit_rows, d.hidden);
            let normed = Matrix::bf16(b.normed, shape.rows, d.hidden);
            ops.gather_rows(s, logits_in, normed, b.logit_rows)?;
            let logits = Matrix::f32(b.logits, shape.logit_rows, d.vocab);
            ops.linear_f32out(s, logits, logits_in, self.weights.lm_head.matrix())?;
        }
        Ok(())
    }

    /// Decode widths captured as graphs so far.
    pub fn captured_widths(&self) -> Vec<u32> {
        let mut w: Vec<u32> = self
            .graphs
            .keys()
            .filter_map(|k| match k {
                GraphKey::Decode(w) => Some(*w),
                _ => None,
            })
            .collect();
        w.sort_unstable();
        w
    }

    /// The logits of the last step's first `n` logit rows, `[n][vocab]`.
    pub fn logits(&self, n: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let v = self.dims.vocab as usize;
        let flat: Vec<f32> = self.gpu.download(self.buf.logits, n * v, self.stream)?;
        Ok(flat.chunks(v).map(<[f32]>::to_vec).collect())
    }

    /// Greedy tokens of the last step's first `n` logit rows, computed on the device.
    pub fn greedy(&self, n: usize) -> Result<Vec<u32>, ModelError> {
        let logits = Matrix::f32(self.buf.logits, n as u32, self.dims.vocab);
        self.ops.argmax(self.stream, self.buf.sampled, logits)?;
        Ok(self.gpu.download(self.buf.sampled, n, self.stream)?)
    }
}

impl Drop for TransformerModel {
    fn drop(&mut self) {
        // Graphs hold the arena's and the weights' addresses: release them first.
        for (_, g) in self.graphs.drain() {
            if let Err(e) = self.gpu.destroy_graph(g) {
                tracing::warn!("TransformerModel: destroying a decode graph failed: {e}");
            }
        }
    }
}
