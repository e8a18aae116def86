//! `TransformerModel::mtp_step`: one step of the multi-token-prediction head, the drafter of
//! speculative decoding.
//!
//! Which hidden state feeds the head, and at which position. A head row at position `p` reads
//! `h_p`, the target's *final-norm output* (after `model.norm`, the LM head's input) of the row
//! whose input token was `x_p`, together with the embedding of the next token `x_{p+1}`, and
//! runs its layer at position `p` (RoPE and KV slot of `p`); its output predicts `x_{p+2}`:
//! `fc([pre_fc_norm_embedding(embed(x_{p+1})) | pre_fc_norm_hidden(h_p)])`, the head's layer,
//! `mtp.norm`, the shared LM head. For the next draft the head is reused: the row at `p + 1`
//! reads the embedding of the draft it just made and, as its hidden state, the head's own
//! output after `mtp.norm`. This is how vLLM (`qwen3_next_mtp.py`, whose target model returns
//! its hidden states after `self.norm`; `eagle.py` shifts the input ids left by one and keeps
//! the target's positions) and SGLang (`qwen3_next_mtp.py`, reading the hidden states its
//! logits processor captures before the LM head; `EagleDraftInput.prepare_for_extend` shifts
//! the ids the same way) feed the Qwen3-Next head. One row off in either the token or the
//! position still runs, but its drafts are rarely accepted.
//!
//! With `decode_graphs`, an MTP step replays a graph captured the first time its (rows,
//! sequences, logit rows, head layer) runs: its launches take only those counts and read which
//! rows belong to which sequence from the step buffers `upload` fills, so batched drafts are
//! graphed like single ones, up to `ModelOptions::max_speculative_graphs` shapes with the
//! verify steps' (then new shapes launch eagerly). The gather of the previous step's hidden
//! rows, whose bound is that step's row count, stays outside the graph. The launches are the
//! same either way.
//!
//! With the circuit forward (`ForwardSelect::Circuit`), an MTP step of one sequence with one
//! logit row (each draft of a chain, and the take-in that gives draft 1) and a row count the
//! executor compiled (`1..=1 + K`, `CircuitExec::draft_program`) replays the draft program of
//! that row count instead of the legacy launches (graphed under the same key, since a forward
//! switch drops every graph); other MTP steps (several sequences, no logit row, a longer
//! take-in after a prefill chunk, a head layer past the first) run the legacy launches.
//! `draft_program_steps` counts the steps that ran a draft program.
//!
//! Invariants:
//! - `hidden_rows` index the rows of the step run just before (a target step or an MTP step):
//!   the step's first launch gathers them out of `normed` (widened to f32), before anything
//!   overwrites it.
//! - The head's layers use KV pools of their own (`MtpBuffers::first_kv_layer` on) through the
//!   sequences' block tables; they touch no SSM state and no target KV pool.

use metrale_cache::BlockTable;
use metrale_gpu_runtime::{DevicePtr, GpuBackendExt};
use metrale_model_layers::ops::Matrix;
use metrale_model_layers::{LayerCtx, Ops, StepShape, TransformerLayer};

use super::{GraphKey, StepInput, StepRow, TransformerModel};
use crate::error::ModelError;

/// The MTP head's step buffers (rows `R` = the model's `max_rows`, hidden `H`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct MtpBuffers {
    /// u32 `[R]`: the rows of the previous step whose final-norm output each row reads.
    pub hidden_rows: DevicePtr,
    /// f32 `[R, H]`: those rows, widened.
    pub hidden: DevicePtr,
    /// bf16 `[2R, H]`: the normed embeddings (rows `0..n`), then the normed hidden states
    /// (rows `n..2n`).
    pub cat_src: DevicePtr,
    /// u32 `[2R]`: `[0, n, 1, n + 1, ...]`, which interleaves `cat_src` into `cat`.
    pub cat_ids: DevicePtr,
    /// bf16 `[R, 2H]`: `[normed embedding | normed hidden]` per row, `fc`'s input.
    pub cat: DevicePtr,
    /// The KV-cache layer of the head's first layer.
    pub first_kv_layer: usize,
}

/// One MTP step.
#[derive(Debug, Clone, Copy)]
pub struct MtpStep<'a> {
    /// The rows: `position` is `p`, `token` is the token *after* it (`x_{p+1}`), `seq` indexes
    /// `tables`; rows of a sequence contiguous and in position order.
    pub rows: &'a [StepRow],
    /// The block table of each sequence (the target's: the head's pools share its blocks).
    pub tables: &'a [&'a BlockTable],
    /// For each row, the row of the previous step whose final-norm output is its `h_p`.
    pub hidden_rows: &'a [u32],
    /// Rows whose logits (drafts) are wanted.
    pub logit_rows: &'a [u32],
    /// Which draft of a chain this step makes, from 0; the head's layer `depth % layers` runs
    /// (one layer in the Qwen3.5 / Qwen3-Next checkpoints).
    pub depth: usize,
}

impl TransformerModel {
    /// Whether the MTP head is set up to run (`speculative = Mtp` and the checkpoint has one).
    pub fn has_mtp(&self) -> bool {
        self.mtp.is_some()
    }

    /// Run one MTP step (see the module header); its logits replace the last step's.
    pub fn mtp_step(&mut self, step: &MtpStep<'_>) -> Result<(), ModelError> {
        let mb = self.mtp.ok_or_else(|| {
            ModelError::Step("the MTP head is not set up (load with speculative = Mtp)".into())
        })?;
        let input = StepInput {
            rows: step.rows,
            tables: step.tables,
            logit_rows: step.logit_rows,
            ssm_slots: &[],
        };
        self.check_rows(&input)?;
        if step.hidden_rows.len() != step.rows.len() {
            return Err(ModelError::Step(format!(
                "{} hidden rows for {} MTP rows",
                step.hidden_rows.len(),
                step.rows.len()
            )));
        }
        let prev = self.last_rows;
        if let Some(&r) = step.hidden_rows.iter().find(|&&r| r as usize >= prev) {
            return Err(ModelError::Step(format!(
                "hidden row {r} is past the {prev} rows of the previous step"
            )));
        }
        let (s, n, hidden) = (self.stream, step.rows.len() as u32, self.dims.hidden);
        self.gpu.upload(mb.hidden_rows, step.hidden_rows, s)?;
        let (hidden_rows, normed) = (
            Matrix::f32(mb.hidden, n, hidden),
            Matrix::bf16(self.buf.normed, prev as u32, hidden),
        );
        self.ops
            .embedding_gather(s, hidden_rows, normed, mb.hidden_rows)?;
        let shape = self.upload(&input, None, None)?;
        let cat_ids: Vec<u32> = (0..n).flat_map(|i| [i, n + i]).collect();
        self.gpu.upload(mb.cat_ids, &cat_ids, s)?;
        self.last_rows = n as usize;
        let head = self
            .weights
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::Step("the checkpoint has no MTP head".into()))?;
        let layer = step.depth % head.layers.len().max(1);
        if self.draft_program(shape, layer).is_some() {
            self.draft_program_steps += 1;
        }
        let key = GraphKey::Mtp {
            rows: shape.rows,
            seqs: shape.num_seqs,
            logit_rows: shape.logit_rows,
            layer,
        };
        if !self.options.decode_graphs || !self.graph_room(key) {
            return self.launch_mtp(shape, layer);
        }
        self.replay(key, |m| m.launch_mtp(shape, layer))
    }

    /// MTP steps that ran the circuit's draft program (eagerly or from a graph) so far.
    pub fn draft_program_steps(&self) -> u64 {
        self.draft_program_steps
    }

    /// The circuit's draft program for an MTP step of `shape` through head layer `layer`, when
    /// the circuit forward is selected and has one (see the module header).
    fn draft_program(
        &self,
        shape: StepShape,
        layer: usize,
    ) -> Option<&metrale_model_layers::circuit_exec::Program> {
        let single = shape.num_seqs == 1 && shape.logit_rows == 1 && layer == 0;
        (self.circuit.as_ref())
            .filter(|_| single)
            .and_then(|e| e.draft_program(u64::from(shape.rows)))
    }

    /// The head's launches for `shape` under the selected forward: the draft program when
    /// there is one, else the legacy launches through its layer `layer`.
    fn launch_mtp(&self, shape: StepShape, layer: usize) -> Result<(), ModelError> {
        match self.draft_program(shape, layer) {
            Some(p) => Ok(p.replay(self.gpu.as_ref(), self.stream)?),
            None => self.launch_mtp_with(&self.ops, shape, layer),
        }
    }

    /// The legacy launches of the head for `shape` through `ops`, via its layer `layer`, after
    /// the hidden-row gather.
    pub(crate) fn launch_mtp_with(
        &self,
        ops: &Ops,
        shape: StepShape,
        layer: usize,
    ) -> Result<(), ModelError> {
        let mb = self.mtp.ok_or_else(|| {
            ModelError::Step("the MTP head is not set up (load with speculative = Mtp)".into())
        })?;
        let head = self
            .weights
            .mtp
            .as_ref()
            .ok_or_else(|| ModelError::Step("the checkpoint has no MTP head".into()))?;
        let (s, b, d) = (self.stream, &self.buf, &self.dims);
        let n = shape.rows;
        let residual = Matrix::f32(b.residual, n, d.hidden);
        ops.embedding_gather(s, residual, self.weights.embed.matrix(), b.token_ids)?;
        let halves = [
            (mb.cat_src, b.residual, head.pre_fc_norm_embedding.ptr),
            (
                mb.cat_src.offset(n as usize * d.hidden as usize * 2),
                mb.hidden,
                head.pre_fc_norm_hidden.ptr,
            ),
        ];
        for (out, x, w) in halves {
            let (out, x) = (Matrix::bf16(out, n, d.hidden), Matrix::f32(x, n, d.hidden));
            ops.rms_norm(s, out, x, &d.norm(w))?;
        }
        let (cat, cat_src) = (
            Matrix::bf16(mb.cat, 2 * n, d.hidden),
            Matrix::bf16(mb.cat_src, 2 * n, d.hidden),
        );
        ops.gather_rows(s, cat, cat_src, mb.cat_ids)?;
        let cat = Matrix::bf16(mb.cat, n, 2 * d.hidden);
        ops.linear_f32out(s, residual, cat, head.fc.matrix())?;
        let i = layer;
        let layer = head
            .layers
            .get(i)
            .ok_or_else(|| ModelError::Step("the MTP head has no layers".into()))?;
        layer.forward(&LayerCtx {
            ops,
            stream: s,
            buf: b,
            shape,
            dims: d,
            kv: Some(self.kv_binding(mb.first_kv_layer + i)),
            ssm: None,
            first: true,
        })?;
        let (delta, normed) = (
            Matrix::bf16(b.delta, n, d.hidden),
            Matrix::bf16(b.normed, n, d.hidden),
        );
        ops.add_rms_norm(s, residual, delta, normed, &d.norm(head.norm.ptr))?;
        self.launch_lm_head(ops, shape)
    }
}
