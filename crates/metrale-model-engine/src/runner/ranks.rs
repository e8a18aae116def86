//! Tensor-parallel ranks `1..N` of a `StepRunner`: each its model shard, step buffers, graphs
//! and forward over its pools of the shared `CacheManager`. Rank 0 is the runner itself; it
//! alone samples, and its logits (gathered over every rank's vocabulary slice) are the step's.
//!
//! Every step (prefill, decode, verify, MTP) runs on all ranks at once, each on its own thread
//! (the CPU backend's collectives return only once every rank has reached them; on CUDA each
//! rank's launches go to its own device): rank 0 checks the step's input and uploads it first,
//! then each rank uploads the same input to its own buffers and launches its shard's step, the
//! collectives inside it joining the ranks. A rank that fails aborts the group's collectives,
//! so no rank waits for it, and the step returns the first rank's own error. An aborted group
//! stays aborted: every later step fails, and the model must be loaded again.
//!
//! Invariant: every rank runs the same launches and collectives for a step: the ranks' shards
//! have the same shapes, and every rank gets the same input and decode width.

use metrale_gpu_runtime::{BufferArena, GpuBackendExt, GpuError};
use metrale_model_layers::StepShape;
use metrale_model_layers::ops::{Matrix, VocabRows};

use super::StepRunner;
use super::forward::Forward;
use super::graphs::{GraphCache, GraphKey};
use super::sizes::StepSizes;
use super::upload::{Io, StepInput};
use crate::error::ModelError;
use crate::model::MtpBuffers;
use crate::options::ModelOptions;

/// One tensor-parallel rank past rank 0.
#[derive(Debug)]
pub(crate) struct RankRunner {
    /// Declared first: graphs replay the buffers and weights below, so they go first.
    pub graphs: GraphCache,
    pub forward: Forward,
    pub _arena: BufferArena,
}

impl RankRunner {
    fn io<'a>(&'a self, sizes: &'a StepSizes) -> Io<'a> {
        let model = &self.forward.model;
        Io {
            gpu: model.gpu().as_ref(),
            stream: model.stream(),
            buf: &self.forward.buf,
            sizes,
            dims: model.dims(),
            ops: model.ops(),
        }
    }

    /// A prefill (or mixed) step: upload `input` (`prompt`: its prompt rows in the prompt
    /// arithmetic, as rank 0 decided), launch the shard's legacy step.
    pub fn forward(
        &self,
        sizes: &StepSizes,
        input: &StepInput<'_>,
        prompt: bool,
    ) -> Result<(), ModelError> {
        let shape = self.io(sizes).upload_forward(input, prompt)?;
        self.forward.legacy_step(self.forward.model.ops(), shape)
    }

    /// A decode step padded to `width`: upload `input`, launch the shard's forward (rank 0
    /// samples), from a graph with `decode_graphs`.
    pub fn decode(
        &mut self,
        sizes: &StepSizes,
        options: &ModelOptions,
        input: &StepInput<'_>,
        width: usize,
    ) -> Result<(), ModelError> {
        let shape = self.io(sizes).upload(input, Some(width), None)?;
        if !options.decode_graphs {
            return self.forward.decode(shape);
        }
        let key = GraphKey::DecodeForward(shape.rows);
        if !self.graphs.contains(key) {
            self.forward.record_step(shape)?;
        }
        let forward = &self.forward;
        self.graphs.replay(key, || forward.decode(shape))
    }

    /// A verify step: upload `input` with its row slots, launch the shard's verify step (from
    /// a graph with `decode_graphs` while the speculative graphs have room, as rank 0 does).
    pub fn verify(
        &mut self,
        sizes: &StepSizes,
        options: &ModelOptions,
        input: &StepInput<'_>,
        row_slots: &[u32],
    ) -> Result<(), ModelError> {
        let shape = self.io(sizes).upload(input, None, Some(row_slots))?;
        let key = GraphKey::Verify {
            rows: shape.rows,
            seqs: shape.num_seqs,
        };
        if !options.decode_graphs || !self.graphs.admit(key)? {
            return self.forward.verify(shape);
        }
        if !self.graphs.contains(key) {
            self.forward.record_step(shape)?;
        }
        let forward = &self.forward;
        self.graphs.replay(key, || forward.verify(shape))
    }

    /// An MTP step of head layer `layer`: gather the head's hidden rows from this rank's last
    /// step (`prev` rows), upload `input`, launch the shard's head.
    pub fn mtp(
        &mut self,
        sizes: &StepSizes,
        options: &ModelOptions,
        step: &MtpRankStep<'_>,
    ) -> Result<(), ModelError> {
        let shape = mtp_upload(&self.forward, self.io(sizes), step)?;
        let key = GraphKey::Mtp {
            rows: shape.rows,
            seqs: shape.num_seqs,
            logit_rows: shape.logit_rows,
            layer: step.layer,
        };
        if !options.decode_graphs || !step.graphed || !self.graphs.admit(key)? {
            return self.forward.mtp(shape, step.layer);
        }
        let forward = &self.forward;
        self.graphs.replay(key, || forward.mtp(shape, step.layer))
    }
}

/// What every rank's part of an MTP step reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MtpRankStep<'a> {
    /// The step's rows, tables and logit rows.
    pub input: StepInput<'a>,
    /// The rows of the previous step whose final-norm output each row reads.
    pub hidden_rows: &'a [u32],
    /// Rows of the previous step.
    pub prev: usize,
    /// The head layer.
    pub layer: usize,
    /// `hidden_rows` index the take-in archive (`MtpBuffers::archive`), not the previous step.
    pub archived: bool,
    /// Whether the step may run from a graph: not a lag's flush (`StepRunner::mtp_flush`),
    /// whose row count differs from one to the next, so its shapes do not crowd the verify and
    /// draft graphs out of `max_speculative_graphs`.
    pub graphed: bool,
}

/// The uploads of an MTP step on one rank (`forward`'s buffers through `io`): the hidden-row
/// gather from the previous step's final-norm rows, the step's metadata and the
/// concatenation's row order. Returns the step's shape.
pub(crate) fn mtp_upload(
    forward: &Forward,
    io: Io<'_>,
    step: &MtpRankStep<'_>,
) -> Result<StepShape, ModelError> {
    let mb = mtp_buffers(forward)?;
    let model = &forward.model;
    let (s, n, hidden) = (
        model.stream(),
        step.input.rows.len() as u32,
        model.dims().hidden,
    );
    model.gpu().upload(mb.hidden_rows, step.hidden_rows, s)?;
    let normed = if step.archived {
        Matrix::bf16(mb.archive, mb.archive_rows as u32, hidden)
    } else {
        Matrix::bf16(forward.buf.acts.normed, step.prev as u32, hidden)
    };
    let hidden_rows = Matrix::f32(mb.hidden, n, hidden);
    let whole = VocabRows::whole(normed.rows);
    model
        .ops()
        .embedding_gather(s, hidden_rows, normed, mb.hidden_rows, whole)?;
    let shape = io.upload(&step.input, None, None)?;
    let cat_ids: Vec<u32> = (0..n).flat_map(|i| [i, n + i]).collect();
    model.gpu().upload(mb.cat_ids, &cat_ids, s)?;
    Ok(shape)
}

/// The archive copy of `StepRunner::mtp_archive` on one rank: rows `hidden_rows` of the
/// previous step's final-norm output (`prev` rows) to archive rows `at..`.
pub(crate) fn mtp_archive_copy(
    forward: &Forward,
    hidden_rows: &[u32],
    at: usize,
    prev: usize,
) -> Result<(), ModelError> {
    let mb = mtp_buffers(forward)?;
    let model = &forward.model;
    let (s, hidden) = (model.stream(), model.dims().hidden);
    model.gpu().upload(mb.hidden_rows, hidden_rows, s)?;
    let row_bytes = hidden as usize * 2;
    let out = Matrix::bf16(
        mb.archive.offset(at * row_bytes),
        hidden_rows.len() as u32,
        hidden,
    );
    let normed = Matrix::bf16(forward.buf.acts.normed, prev as u32, hidden);
    Ok(model.ops().gather_rows(s, out, normed, mb.hidden_rows)?)
}

/// The MTP head's buffers of `forward`, or the error of a runner not built for drafts.
pub(crate) fn mtp_buffers(forward: &Forward) -> Result<MtpBuffers, ModelError> {
    forward.mtp.ok_or_else(|| {
        ModelError::Step("the MTP head is not set up (load with speculative = Mtp)".into())
    })
}

/// Refuse hidden rows at or past `bound`, the rows of `what` (the previous step, the archive).
pub(crate) fn check_hidden_rows(rows: &[u32], bound: usize, what: &str) -> Result<(), ModelError> {
    match rows.iter().find(|&&r| r as usize >= bound) {
        Some(&r) => Err(ModelError::Step(format!(
            "hidden row {r} is past the {bound} rows of {what}"
        ))),
        None => Ok(()),
    }
}

/// Whether `e` is a collective that failed only because another rank aborted the group.
fn is_abort(e: &ModelError) -> bool {
    matches!(e, ModelError::Gpu(GpuError::CollectiveAborted { .. }))
}

impl StepRunner {
    /// Tensor-parallel ranks this runner drives (1: a model that is not sharded).
    pub fn num_ranks(&self) -> usize {
        1 + self.peers.len()
    }

    /// Run `rank0` on this runner and `peer` on every other rank, all at once (see the module
    /// header). Returns the first error a rank raised itself (not an abort it saw).
    pub(crate) fn on_ranks(
        &mut self,
        rank0: impl FnOnce(&mut StepRunner) -> Result<(), ModelError>,
        peer: impl Fn(&mut RankRunner, &StepSizes, &ModelOptions) -> Result<(), ModelError> + Sync,
    ) -> Result<(), ModelError> {
        if self.peers.is_empty() {
            return rank0(self);
        }
        let mut peers = std::mem::take(&mut self.peers);
        let (sizes, options) = (self.sizes, self.options.clone());
        let results = std::thread::scope(|sc| {
            let handles: Vec<_> = (peers.iter_mut())
                .map(|p| {
                    let (peer, sizes, options) = (&peer, &sizes, &options);
                    sc.spawn(move || {
                        let r = peer(p, sizes, options);
                        if r.is_err() {
                            p.forward.model.gpu().abort_collectives();
                        }
                        r
                    })
                })
                .collect();
            let r0 = rank0(self);
            if r0.is_err() {
                self.model().gpu().abort_collectives();
            }
            let mut results = vec![r0];
            for h in handles {
                results.push(h.join().unwrap_or_else(|_| {
                    Err(ModelError::Step(
                        "a tensor-parallel rank's thread panicked".into(),
                    ))
                }));
            }
            results
        });
        self.peers = peers;
        let mut errors: Vec<ModelError> = results.into_iter().filter_map(Result::err).collect();
        match errors.iter().position(|e| !is_abort(e)) {
            Some(i) => Err(errors.swap_remove(i)),
            None => errors.into_iter().next().map_or(Ok(()), Err),
        }
    }

    /// Refuse what runs on rank 0 alone (a recorded step) on a sharded model.
    pub(crate) fn single_rank(&self, what: &str) -> Result<(), ModelError> {
        if self.peers.is_empty() {
            return Ok(());
        }
        Err(ModelError::Options {
            option: "tensor_parallel_size",
            problem: format!(
                "{what} steps run on one rank; this model is sharded over {} ranks",
                self.num_ranks()
            ),
        })
    }
}
