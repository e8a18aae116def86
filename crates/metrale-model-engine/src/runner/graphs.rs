//! `GraphCache`: the CUDA graphs a step runner captured, keyed by what they replay, and the
//! capture-or-replay of one step.
//!
//! Invariants:
//! - A graph replays the launches of one step shape of one forward: a forward switch destroys
//!   every graph (`clear`) before the next step.
//! - Graphs of verify and MTP steps are bounded by `max_speculative`; a step of a new shape past
//!   that runs eagerly, so the graphs' device memory stays bounded under any mix of drafts.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_gpu_runtime::{GpuBackend, GraphHandle, StreamHandle};

use crate::error::ModelError;

/// What a captured graph replays: one kind of step at one shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum GraphKey {
    /// A decode step of this padded width, its sampler included.
    Decode(u32),
    /// The forward of a decode step of this padded width, without its sampler (a step with
    /// constrained rows samples after their masks are uploaded).
    DecodeForward(u32),
    /// A verify step of this many rows and sequences.
    Verify {
        /// Rows (every one with logits).
        rows: u32,
        /// Sequences.
        seqs: u32,
    },
    /// An MTP step.
    Mtp {
        rows: u32,
        seqs: u32,
        logit_rows: u32,
        layer: usize,
    },
}

impl GraphKey {
    /// A decode step's graph (with or without its sampler): never bounded.
    fn is_decode(self) -> bool {
        matches!(self, GraphKey::Decode(_) | GraphKey::DecodeForward(_))
    }
}

/// See the module header.
#[derive(Debug)]
pub struct GraphCache {
    gpu: Arc<dyn GpuBackend>,
    stream: StreamHandle,
    graphs: HashMap<GraphKey, GraphHandle>,
    max_speculative: usize,
    /// Graphs captured since creation (destroyed ones included).
    captures: u64,
}

impl GraphCache {
    pub(crate) fn new(
        gpu: Arc<dyn GpuBackend>,
        stream: StreamHandle,
        max_speculative: usize,
    ) -> GraphCache {
        GraphCache {
            gpu,
            stream,
            graphs: HashMap::new(),
            max_speculative,
            captures: 0,
        }
    }

    /// Whether a graph is kept under `key`.
    pub(crate) fn contains(&self, key: GraphKey) -> bool {
        self.graphs.contains_key(&key)
    }

    /// Whether a graph may be replayed (or captured) under `key`: any decode step, or a verify
    /// or MTP step whose graph is kept already or while fewer than the bound are.
    pub(crate) fn has_room(&self, key: GraphKey) -> bool {
        if key.is_decode() || self.contains(key) {
            return true;
        }
        let kept = (self.graphs.keys()).filter(|k| !k.is_decode()).count();
        kept < self.max_speculative
    }

    /// Replay the graph under `key`, first capturing `launch`'s launches on the stream when
    /// there is none.
    pub(crate) fn replay(
        &mut self,
        key: GraphKey,
        launch: impl FnOnce() -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let graph = match self.graphs.get(&key) {
            Some(&g) => g,
            None => {
                self.gpu.begin_capture(self.stream)?;
                let captured = launch();
                let ended = self.gpu.end_capture(self.stream);
                captured?;
                let g = ended?;
                self.graphs.insert(key, g);
                self.captures += 1;
                g
            }
        };
        self.gpu.launch_graph(graph, self.stream)?;
        Ok(())
    }

    /// Destroy every graph, reporting the first failure.
    pub(crate) fn clear(&mut self) -> Result<(), ModelError> {
        let mut first = Ok(());
        for (_, g) in self.graphs.drain() {
            if let Err(e) = self.gpu.destroy_graph(g)
                && first.is_ok()
            {
                first = Err(e.into());
            }
        }
        first
    }

    /// Graphs captured so far, every kind, those destroyed since included: a step that
    /// captures pays for it once, so a timed run that captures is not a warm one.
    pub fn captures(&self) -> u64 {
        self.captures
    }

    /// Decode widths captured so far, ascending.
    pub fn decode_widths(&self) -> Vec<u32> {
        let mut w: Vec<u32> = (self.graphs.keys())
            .filter_map(|k| match *k {
                GraphKey::Decode(w) => Some(w),
                _ => None,
            })
            .collect();
        w.sort_unstable();
        w
    }

    /// The (rows, sequences) of the verify steps captured so far, ascending.
    pub fn verify_shapes(&self) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = (self.graphs.keys())
            .filter_map(|k| match *k {
                GraphKey::Verify { rows, seqs } => Some((rows, seqs)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        out
    }

    /// The (rows, sequences) of the MTP steps captured so far, ascending, without repeats (a
    /// shape may have graphs for several logit-row counts and head layers).
    pub fn mtp_shapes(&self) -> Vec<(u32, u32)> {
        let mut out: Vec<(u32, u32)> = (self.graphs.keys())
            .filter_map(|k| match *k {
                GraphKey::Mtp { rows, seqs, .. } => Some((rows, seqs)),
                _ => None,
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

impl Drop for GraphCache {
    fn drop(&mut self) {
        if let Err(e) = self.clear() {
            tracing::warn!("destroying a captured graph failed: {e}");
        }
    }
}
