//! Collectives of tensor parallelism: the two operations the ranks of a sharded model exchange
//! data with ([`Collective`]), the rank a backend drives ([`TpRank`]), and the CPU backend's
//! communicator ([`CpuCommunicator`]): ranks as threads meeting at a barrier.
//!
//! A collective is a backend operation, not a kernel of the manifest: on CUDA it is NCCL's (an
//! all-reduce or all-gather queued on the stream and captured in graphs like a launch); the CPU
//! backend runs it when its stream reaches it, recording it while the stream captures.
//!
//! Invariants:
//! - Every rank of a group issues the same collectives in the same order; a rank whose
//!   collective disagrees with the others' (kind or size) fails it on every rank.
//! - An all-reduce sums the ranks' values in f32 and rounds once to the output's dtype; every
//!   rank gets the same bits. The CPU communicator sums in rank order `0, 1, ..., N - 1`, so a
//!   run gives the same bits every time; NCCL (CUDA) sums in its ring or tree order, which
//!   `cuda/nccl.rs` and docs/ARCHITECTURE.md describe.
//! - Once a communicator is aborted (a rank failed a step), every collective on it fails at
//!   once instead of waiting for the rank that left.

use std::sync::Arc;

use half::bf16;
use parking_lot::{Condvar, Mutex};

use crate::error::{GpuError, GpuResult};
use crate::types::{DType, DevicePtr};

/// The rank a backend drives in its tensor-parallel group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpRank {
    /// This backend's rank, `0..size`.
    pub rank: usize,
    /// Ranks in the group (1: no tensor parallelism).
    pub size: usize,
}

impl TpRank {
    /// A backend alone: rank 0 of 1.
    pub const SINGLE: TpRank = TpRank { rank: 0, size: 1 };
}

/// One collective over every rank of a group, queued on a stream like a launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// `out = Σ_rank input` elementwise over `elems` elements: the inputs (`input_dtype`, f32 or
    /// bf16) widened to f32 and summed in rank order, the sum written as `out_dtype` (f32, or
    /// bf16 rounded to nearest even) on every rank. `out` may be `input` when the dtypes agree.
    /// On CUDA: NCCL's all-reduce, f32 into f32 only (the launcher `ops::all_reduce_sum` sums
    /// in f32 on every backend and rounds a bf16 activation with a launch of its own).
    AllReduceSum {
        /// The result, `[elems]` of `out_dtype`.
        out: DevicePtr,
        /// F32 or Bf16.
        out_dtype: DType,
        /// This rank's addend, `[elems]` of `input_dtype`.
        input: DevicePtr,
        /// F32 or Bf16.
        input_dtype: DType,
        /// Elements.
        elems: usize,
    },
    /// f32 `out[rows, size * cols]`: rank `r`'s `input[rows, cols]` in columns
    /// `r * cols .. (r + 1) * cols` of every row, on every rank (the vocabulary-parallel LM
    /// head's logits). On CUDA: one NCCL all-gather per row in one group call, each received
    /// into its row, so the columns land in place with no permutation.
    AllGatherCols {
        /// f32 `[rows, size * cols]`.
        out: DevicePtr,
        /// f32 `[rows, cols]`, this rank's columns.
        input: DevicePtr,
        /// Rows.
        rows: usize,
        /// Columns per rank.
        cols: usize,
    },
}

impl Collective {
    /// The collective's name, for errors.
    pub fn name(&self) -> &'static str {
        match self {
            Collective::AllReduceSum { .. } => "all_reduce_sum",
            Collective::AllGatherCols { .. } => "all_gather_cols",
        }
    }

    /// Elements of this rank's input.
    pub fn input_elems(&self) -> usize {
        match *self {
            Collective::AllReduceSum { elems, .. } => elems,
            Collective::AllGatherCols { rows, cols, .. } => rows * cols,
        }
    }

    /// This rank's input (pointer, dtype).
    pub fn input(&self) -> (DevicePtr, DType) {
        match *self {
            Collective::AllReduceSum {
                input, input_dtype, ..
            } => (input, input_dtype),
            Collective::AllGatherCols { input, .. } => (input, DType::F32),
        }
    }

    /// Check the dtypes, for rank `rank` of `size`.
    pub fn check(&self, size: usize) -> GpuResult<()> {
        let bad = |problem: String| {
            Err(GpuError::Collective {
                op: self.name(),
                problem,
            })
        };
        if size == 0 {
            return bad("a group of no ranks".into());
        }
        if let Collective::AllReduceSum {
            out_dtype,
            input_dtype,
            ..
        } = *self
        {
            for (what, d) in [("input", input_dtype), ("output", out_dtype)] {
                if !matches!(d, DType::F32 | DType::Bf16) {
                    return bad(format!("{what} dtype {} (f32 or bf16 only)", d.name()));
                }
            }
        }
        Ok(())
    }
}

/// What a rank brings to an exchange: its collective's name and size, and its values in f32.
#[derive(Debug, Clone)]
struct Contribution {
    op: &'static str,
    elems: usize,
    values: Vec<f32>,
}

#[derive(Debug, Default)]
struct Round {
    /// Contributions of the round being gathered, by rank.
    slots: Vec<Option<Contribution>>,
    arrived: usize,
    /// Rounds completed.
    generation: u64,
    /// The contributions of the last completed round, by rank.
    last: Arc<Vec<Contribution>>,
    aborted: bool,
}

/// The CPU backend's communicator, shared by the group's backends (one a rank, each driven by
/// its own thread): each collective is an exchange of every rank's values at a barrier, after
/// which every rank computes the result from all of them in rank order.
#[derive(Debug)]
pub struct CpuCommunicator {
    size: usize,
    round: Mutex<Round>,
    wake: Condvar,
}

impl CpuCommunicator {
    /// A communicator for `size` ranks.
    pub fn new(size: usize) -> Arc<CpuCommunicator> {
        Arc::new(CpuCommunicator {
            size,
            round: Mutex::new(Round {
                slots: vec![None; size],
                ..Round::default()
            }),
            wake: Condvar::new(),
        })
    }

    /// Ranks in the group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Fail every collective waiting now or issued later: a rank left the group's step.
    pub fn abort(&self) {
        self.round.lock().aborted = true;
        self.wake.notify_all();
    }

    fn aborted(op: &'static str) -> GpuError {
        GpuError::CollectiveAborted { op }
    }

    /// Rank `rank`'s values in; every rank's out, in rank order, once all have arrived.
    fn exchange(&self, rank: usize, mine: Contribution) -> GpuResult<Arc<Vec<Contribution>>> {
        let op = mine.op;
        let mut round = self.round.lock();
        if round.aborted {
            return Err(Self::aborted(op));
        }
        if round.slots.get(rank).is_none_or(Option::is_some) {
            return Err(GpuError::Collective {
                op,
                problem: format!(
                    "rank {rank} of {} joined a round it is already in",
                    self.size
                ),
            });
        }
        round.slots[rank] = Some(mine);
        round.arrived += 1;
        let generation = round.generation;
        if round.arrived == self.size {
            let all: Vec<Contribution> = round.slots.iter_mut().filter_map(Option::take).collect();
            round.last = Arc::new(all);
            round.arrived = 0;
            round.generation += 1;
            self.wake.notify_all();
        } else {
            while round.generation == generation && !round.aborted {
                self.wake.wait(&mut round);
            }
            if round.generation == generation {
                return Err(Self::aborted(op));
            }
        }
        Ok(round.last.clone())
    }

    /// Run `op` for rank `rank`: its input `values` (widened to f32) in, the values to write to
    /// the output (f32, before conversion to the output's dtype) out.
    pub(crate) fn run(
        &self,
        rank: usize,
        op: &Collective,
        values: Vec<f32>,
    ) -> GpuResult<Vec<f32>> {
        let all = self.exchange(
            rank,
            Contribution {
                op: op.name(),
                elems: op.input_elems(),
                values,
            },
        )?;
        if let Some((r, c)) =
            (all.iter().enumerate()).find(|(_, c)| (c.op, c.elems) != (all[0].op, all[0].elems))
        {
            return Err(GpuError::Collective {
                op: op.name(),
                problem: format!(
                    "the ranks disagree: rank 0 ran {} of {} elements, rank {r} {} of {}",
                    all[0].op, all[0].elems, c.op, c.elems
                ),
            });
        }
        Ok(match *op {
            Collective::AllReduceSum { elems, .. } => {
                let mut sum = vec![0.0f32; elems];
                for c in all.iter() {
                    for (s, v) in sum.iter_mut().zip(&c.values) {
                        *s += v;
                    }
                }
                sum
            }
            Collective::AllGatherCols { rows, cols, .. } => {
                let n = all.len();
                let mut out = vec![0.0f32; rows * cols * n];
                for (r, c) in all.iter().enumerate() {
                    for row in 0..rows {
                        let dst = row * n * cols + r * cols;
                        out[dst..dst + cols]
                            .copy_from_slice(&c.values[row * cols..(row + 1) * cols]);
                    }
                }
                out
            }
        })
    }
}

/// Little-endian bytes of `dtype` (f32 or bf16) widened to f32.
pub(crate) fn widen(bytes: &[u8], dtype: DType) -> Vec<f32> {
    match dtype {
        DType::Bf16 => (bytes.chunks_exact(2))
            .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        _ => (bytes.chunks_exact(4))
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    }
}

/// f32 values as little-endian bytes of `dtype` (f32, or bf16 rounded to nearest even).
pub(crate) fn narrow(values: &[f32], dtype: DType) -> Vec<u8> {
    match dtype {
        DType::Bf16 => (values.iter())
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

#[cfg(test)]
mod tests;
