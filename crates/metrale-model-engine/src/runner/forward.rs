//! `Forward`: the launches of a step shape under the selected forward — the model's own layer
//! walk (`legacy`), or the circuit executor's program for the shape where it compiled one — over
//! the runner's fixed buffers and the cache's pools. It reads no step input: `upload.rs` writes
//! that to the buffers first, so whatever it launches can be captured as a graph.
//!
//! Which steps run a circuit program: decode steps (one per ladder width), and verify steps and
//! MTP steps through the head's first layer with a logit row per sequence, of one sequence or
//! of up to `ModelOptions::circuit_speculative_seqs`, of `1 + K` rows a sequence at most.
//! Every other step (prefill chunks, steps of more sequences, MTP steps where a sequence has
//! no logit row, longer take-ins) runs the legacy launches, whichever forward is selected.

use metrale_model_layers::circuit_exec::{CircuitExec, LayerPools, Program, Recorder, Width};
use metrale_model_layers::{KvBinding, Ops, StepBuffers, StepShape};

use crate::error::ModelError;
use crate::model::{Model, MtpBuffers};

/// See the module header.
#[derive(Debug)]
pub(crate) struct Forward {
    /// The circuit executor whose programs run the steps it compiled; `None`: the legacy
    /// forward. Declared first so it is freed before the weights it reads.
    pub circuit: Option<CircuitExec>,
    pub model: Model,
    pub buf: StepBuffers,
    /// The MTP head's buffers, when it drafts.
    pub mtp: Option<MtpBuffers>,
    /// Each layer's KV and SSM pools.
    pub pools: Vec<LayerPools>,
    /// The drafting MTP head's KV pools, one per head layer.
    pub head_pools: Vec<KvBinding>,
}

impl Forward {
    /// The legacy launches of a step of `shape` through `ops`.
    pub fn legacy_step(&self, ops: &Ops, shape: StepShape) -> Result<(), ModelError> {
        self.model.launch_step(ops, &self.buf, &self.pools, shape)
    }

    /// The legacy launches of a step of `shape`, recorded instead of run.
    pub fn record_step(
        &self,
        shape: StepShape,
    ) -> Result<Vec<metrale_model_layers::circuit_exec::Launch>, ModelError> {
        let (recorder, ops) = Recorder::over(self.model.ops());
        self.legacy_step(&ops, shape)?;
        Ok(recorder.take())
    }

    /// The launches of a decode step of `shape` (a ladder width): its circuit program, or the
    /// legacy step.
    pub fn decode(&self, shape: StepShape) -> Result<(), ModelError> {
        let Some(exec) = &self.circuit else {
            return self.legacy_step(self.model.ops(), shape);
        };
        let program = exec.program(u64::from(shape.rows)).ok_or_else(|| {
            ModelError::Step(format!(
                "the circuit has no program for {} rows",
                shape.rows
            ))
        })?;
        self.replay(program)
    }

    /// The circuit's verify program for a verify step of `shape`, when the circuit forward is
    /// selected and compiled one for its rows and sequences.
    pub fn verify_program(&self, shape: StepShape) -> Option<&Program> {
        let width = Width::new(u64::from(shape.rows), u64::from(shape.num_seqs));
        (self.circuit.as_ref()).and_then(|e| e.verify_program(width))
    }

    /// The launches of a verify step: its circuit verify program when there is one, else the
    /// legacy step.
    pub fn verify(&self, shape: StepShape) -> Result<(), ModelError> {
        match self.verify_program(shape) {
            Some(p) => self.replay(p),
            None => self.legacy_step(self.model.ops(), shape),
        }
    }

    /// The circuit's draft program for an MTP step of `shape` through head layer `layer`, when
    /// the circuit forward is selected and has one (see the module header).
    pub fn draft_program(&self, shape: StepShape, layer: usize) -> Option<&Program> {
        let width = Width::new(u64::from(shape.rows), u64::from(shape.num_seqs));
        (self.circuit.as_ref())
            .filter(|_| shape.logit_rows == shape.num_seqs && layer == 0)
            .and_then(|e| e.draft_program(width))
    }

    /// The head's launches for `shape` under the selected forward: the draft program when there
    /// is one, else the legacy launches through its layer `layer`.
    pub fn mtp(&self, shape: StepShape, layer: usize) -> Result<(), ModelError> {
        match self.draft_program(shape, layer) {
            Some(p) => self.replay(p),
            None => self.legacy_mtp(self.model.ops(), shape, layer),
        }
    }

    /// The legacy launches of the head for `shape` through `ops`, via its layer `layer`, after
    /// the hidden-row gather.
    pub fn legacy_mtp(&self, ops: &Ops, shape: StepShape, layer: usize) -> Result<(), ModelError> {
        let (mtp, kv) = match (&self.mtp, self.head_pools.get(layer)) {
            (Some(m), Some(&kv)) => (m, kv),
            _ => {
                return Err(ModelError::Step(format!(
                    "the MTP head is not set up to run layer {layer} (load with speculative = Mtp)"
                )));
            }
        };
        self.model.launch_mtp(ops, &self.buf, mtp, kv, shape, layer)
    }

    fn replay(&self, program: &Program) -> Result<(), ModelError> {
        Ok(program.replay(self.model.gpu().as_ref(), self.model.stream())?)
    }
}
