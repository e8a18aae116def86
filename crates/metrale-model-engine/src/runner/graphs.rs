//! `GraphCache`: the CUDA graphs a step runner captured, keyed by what they replay, and the
//! capture-or-replay of one step.
//!
//! Invariants:
//! - A graph replays the launches of one step shape of one forward: a forward switch destroys
//!   every graph (`clear`) before the next step.
//! - Graphs of verify and MTP steps are bounded by `max_speculative`, so the graphs' device
//!   memory stays bounded under any mix of drafts. Below the bound a step of a new shape runs
//!   eagerly until its shape has been met `capture_after` times (a capture costs milliseconds:
//!   shapes met once, while requests start or end, should not pay one); at the bound, until met
//!   `ADMIT_AFTER` times (or `capture_after`, the more), and it is then captured in place of the
//!   speculative graph replayed longest ago. Ramp-up shapes met once or twice never displace the
//!   steady state's, and a shape that comes to stay is graphed. The policy depends only on the
//!   sequence of step shapes, so every rank of a sharded model keeps the same graphs.
//! - Graph and eager launches of a step give the same bits, so which steps are graphed never
//!   changes a result.

use std::collections::HashMap;
use std::sync::Arc;

use metrale_gpu_runtime::{GpuBackend, GraphHandle, StreamHandle};

use crate::error::ModelError;

/// Times a step shape is met, while the speculative graphs are at their bound, before it is
/// captured in place of the least recently replayed one.
const ADMIT_AFTER: u32 = 3;

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
    /// Meetings of a speculative shape below the bound before it is captured.
    capture_after: u32,
    /// Graphs captured since creation (destroyed ones included).
    captures: u64,
    /// Each kept speculative graph's last replay (a tick of `replays`).
    last_replay: HashMap<GraphKey, u64>,
    /// Replays so far: the clock of `last_replay`.
    replays: u64,
    /// Times each speculative shape without a graph was met (since it last lost its graph).
    met: HashMap<GraphKey, u32>,
}

impl GraphCache {
    pub(crate) fn new(
        gpu: Arc<dyn GpuBackend>,
        stream: StreamHandle,
        max_speculative: usize,
        capture_after: u32,
    ) -> GraphCache {
        GraphCache {
            gpu,
            stream,
            graphs: HashMap::new(),
            max_speculative,
            capture_after,
            captures: 0,
            last_replay: HashMap::new(),
            replays: 0,
            met: HashMap::new(),
        }
    }

    /// Whether a graph is kept under `key`.
    pub(crate) fn contains(&self, key: GraphKey) -> bool {
        self.graphs.contains_key(&key)
    }

    /// Whether the step under `key` runs from a graph (replayed, or captured first): any
    /// decode step; a verify or MTP step whose graph is kept; one whose shape has now been met
    /// `capture_after` times while fewer graphs than the bound are kept; else one whose shape
    /// has now been met `ADMIT_AFTER` times at the bound, for which the speculative graph
    /// replayed longest ago is destroyed (see the module header). Counts the meeting of a shape
    /// that runs eagerly.
    pub(crate) fn admit(&mut self, key: GraphKey) -> Result<bool, ModelError> {
        if key.is_decode() || self.contains(key) {
            return Ok(true);
        }
        let met = self.met.entry(key).or_insert(0);
        *met += 1;
        let below = self.last_replay.len() < self.max_speculative;
        let needed = if below {
            self.capture_after
        } else {
            ADMIT_AFTER.max(self.capture_after)
        };
        if *met < needed {
            return Ok(false);
        }
        self.met.remove(&key);
        if below {
            return Ok(true);
        }
        let oldest = (self.last_replay.iter())
            .min_by_key(|&(_, &tick)| tick)
            .map(|(&k, _)| k);
        let Some(oldest) = oldest else {
            return Ok(false); // a bound of 0: no speculative graph at all
        };
        self.last_replay.remove(&oldest);
        if let Some(g) = self.graphs.remove(&oldest) {
            self.gpu.destroy_graph(g)?;
        }
        Ok(true)
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
        self.replays += 1;
        if !key.is_decode() {
            self.last_replay.insert(key, self.replays);
        }
        self.gpu.launch_graph(graph, self.stream)?;
        Ok(())
    }

    /// Destroy every graph, reporting the first failure.
    pub(crate) fn clear(&mut self) -> Result<(), ModelError> {
        self.last_replay.clear();
        self.met.clear();
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

#[cfg(test)]
mod tests {
    use metrale_gpu_runtime::CpuBackend;

    use super::*;

    fn verify(rows: u32) -> GraphKey {
        GraphKey::Verify { rows, seqs: 1 }
    }

    /// Run the step of `key` as a runner does: from a graph where admitted, else eagerly.
    /// Returns whether it ran from a graph.
    fn step(cache: &mut GraphCache, key: GraphKey) -> bool {
        let graphed = cache.admit(key).expect("admit");
        if graphed {
            cache.replay(key, || Ok(())).expect("replay");
        }
        graphed
    }

    #[test]
    fn at_the_bound_a_shape_that_keeps_coming_replaces_the_graph_replayed_longest_ago() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let s = gpu.default_stream();
        let mut cache = GraphCache::new(gpu, s, 2, 1);
        assert!(step(&mut cache, verify(4)) && step(&mut cache, verify(8)));
        assert!(step(&mut cache, verify(4)), "kept graphs replay");
        // Decode graphs never count against the bound.
        assert!(step(&mut cache, GraphKey::Decode(8)));
        assert_eq!(cache.verify_shapes(), [(4, 1), (8, 1)]);
        // A shape met in passing runs eagerly and displaces nothing.
        assert!(!step(&mut cache, verify(12)));
        assert!(!step(&mut cache, verify(12)));
        assert_eq!(cache.verify_shapes(), [(4, 1), (8, 1)]);
        // Met a third time it is captured in place of the graph replayed longest ago (8 rows:
        // 4 rows replayed after it).
        assert!(step(&mut cache, verify(12)));
        assert_eq!(cache.verify_shapes(), [(4, 1), (12, 1)]);
        assert_eq!(cache.decode_widths(), [8]);
        assert_eq!(cache.captures(), 4);
        // The displaced shape starts its count afresh.
        assert!(!step(&mut cache, verify(8)));
        assert!(step(&mut cache, verify(4)) && step(&mut cache, verify(12)));
    }

    #[test]
    fn below_the_bound_a_shape_is_captured_at_its_second_meeting() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let s = gpu.default_stream();
        let mut cache = GraphCache::new(gpu, s, 4, 2);
        // Shapes met once run eagerly and cost no capture; decode steps are graphed at once.
        assert!(!step(&mut cache, verify(4)) && !step(&mut cache, verify(8)));
        assert!(step(&mut cache, GraphKey::Decode(8)));
        assert!(cache.verify_shapes().is_empty() && cache.captures() == 1);
        // Met again, a shape is captured, then replays.
        assert!(step(&mut cache, verify(4)) && step(&mut cache, verify(4)));
        assert_eq!(cache.verify_shapes(), [(4, 1)]);
        assert_eq!(cache.captures(), 2);
    }

    #[test]
    fn a_bound_of_zero_graphs_no_speculative_step() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let s = gpu.default_stream();
        let mut cache = GraphCache::new(gpu, s, 0, 1);
        for _ in 0..4 {
            assert!(!step(&mut cache, verify(4)));
        }
        assert!(step(&mut cache, GraphKey::Decode(1)));
        assert!(cache.verify_shapes().is_empty());
    }
}
