//! Tensor-parallel ranks `1..N` of a `StepRunner`: each its model shard, step buffers, graphs
//! and forward over its pools of the shared `CacheManager`. Rank 0 is the runner itself; it
//! alone samples, and its logits (gathered over every rank's vocabulary slice) are the step's.
//!
//! Every step runs on all ranks at once, each on its own thread (the CPU backend's collectives
//! return only once every rank has reached them; on CUDA each rank's launches go to its own
//! device): each rank uploads the same step input to its own buffers and launches its shard's
//! step, the collectives inside it joining the ranks. A rank that fails aborts the group's
//! collectives, so no rank waits for it, and the step returns the first rank's own error. An
//! aborted group stays aborted: every later step fails, and the model must be loaded again.
//!
//! Invariant: every rank runs the same launches and collectives for a step: the ranks' shards
//! have the same shapes, and every rank gets the same input and decode width.

use metrale_gpu_runtime::{BufferArena, GpuError};

use super::StepRunner;
use super::forward::Forward;
use super::graphs::{GraphCache, GraphKey};
use super::sizes::StepSizes;
use super::upload::{Io, StepInput};
use crate::error::ModelError;
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
        }
    }

    /// A prefill (or mixed) step: upload `input`, launch the shard's legacy step.
    pub fn forward(&self, sizes: &StepSizes, input: &StepInput<'_>) -> Result<(), ModelError> {
        let shape = self.io(sizes).upload_forward(input)?;
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

    /// Refuse a step kind that runs on rank 0 alone (speculative steps) on a sharded model.
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
