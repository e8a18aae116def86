//! The decode step's delta rule (`gdn::gated_delta_recurrent` and `gdn::gated_delta_streamed`,
//! the same rows and states bit for bit): which kernel runs it for a step's shape, and that
//! kernel's launch; an `impl Ops` block beside `ops_hybrid`, whose argument list and geometry
//! of the rule kernels it shares. `DecodeRule` is re-exported from `ops_hybrid`.

use metrale_gpu_runtime::{GpuResult, LaunchConfig, Residency, StreamHandle};

use crate::ops::{Ops, step_launch};
use crate::ops_hybrid::{GatedDelta, RULE_WARP_COLS, rule_geometry, rule_params};

impl Ops {
    /// The gated delta rule token by token (decode), through the kernel
    /// [`Ops::decode_rule_kind`] picks; both give every output and state bitwise the same.
    pub fn gated_delta_recurrent(&self, s: StreamHandle, p: &GatedDelta) -> GpuResult<()> {
        let stream = self.rule_stream(p)?;
        self.decode_rule(s, p, stream.kind(p), &stream)
    }

    /// The decode rule kernel for `p`: `gated_delta_streamed` when its shapes take the streamed
    /// path and the (sequence, value head) items are at least `RULE_STREAM_ITEMS_PER_BLOCK`
    /// times its resident blocks, `gated_delta_recurrent` otherwise: streaming the states pays
    /// once every block has several heads to overlap; with fewer items the recurrent kernel's
    /// many small blocks are faster.
    pub fn decode_rule_kind(&self, p: &GatedDelta) -> GpuResult<DecodeRule> {
        Ok(self.rule_stream(p)?.kind(p))
    }

    /// `gated_delta_recurrent` through the chosen kernel (the tests run both). `Streamed` on
    /// shapes off its path runs each item as the recurrent kernel's blocks would, in its
    /// persistent blocks: the same bits, without the streaming.
    pub fn gated_delta_recurrent_as(
        &self,
        s: StreamHandle,
        p: &GatedDelta,
        kind: DecodeRule,
    ) -> GpuResult<()> {
        let stream = self.rule_stream(p)?;
        self.decode_rule(s, p, kind, &stream)
    }

    /// `gated_delta_streamed`'s launch for `p`, its resident blocks asked once.
    fn rule_stream(&self, p: &GatedDelta) -> GpuResult<RuleStream> {
        let threads = rule_stream_threads(p);
        let smem = rule_stream_shared_bytes(p);
        let resident = self.resident(
            self.k.gated_delta_streamed,
            threads,
            smem.unwrap_or(0),
            RULE_STREAM_BLOCKS,
            Residency::Clusters,
        )?;
        Ok(RuleStream {
            threads,
            smem,
            resident,
        })
    }

    /// The decode rule through `kind`'s kernel (`stream`: the streamed kernel's launch).
    fn decode_rule(
        &self,
        s: StreamHandle,
        p: &GatedDelta,
        kind: DecodeRule,
        stream: &RuleStream,
    ) -> GpuResult<()> {
        let params = rule_params(p);
        match kind {
            DecodeRule::Blocks => {
                self.go(self.k.gated_delta_recurrent, rule_geometry(p), &params, s)
            }
            DecodeRule::Streamed => {
                let items = rule_items(p);
                let cfg = LaunchConfig::grid2(items.min(stream.resident).max(1), 1, stream.threads)
                    .with_shared(stream.smem.unwrap_or(0));
                let cfg = step_launch(cfg, p.seqs.rows);
                self.go(self.k.gated_delta_streamed, cfg, &params, s)
            }
        }
    }
}

/// Which kernel runs a decode step's delta rule ([`Ops::gated_delta_recurrent`]). Both compute
/// every column with the same lanes in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeRule {
    /// `gated_delta_recurrent`: a block per (sequence, value head, two warp tiles), each warp
    /// loading its tile of the state itself. Spreads a few sequences over many blocks.
    Blocks,
    /// `gated_delta_streamed`: persistent blocks of a whole value head each, the heads' states
    /// brought into shared memory by bulk copies an item ahead. Faster once every block has
    /// several items.
    Streamed,
}

/// Head buffers of `gated_delta_streamed` (`GDN_STREAM_BARS` bytes of barriers come first):
/// two, the state of the item after the one computing in flight (a third buffer gains no
/// more overlap; one buffer a block does not hide the copy).
const RULE_STREAM_BUFS: u32 = 2;
/// The barriers' bytes ahead of the buffers.
const RULE_STREAM_BARS: u32 = metrale_kernel_abi::GDN_STREAM_BARS;

/// Most dynamic shared memory a `gated_delta_streamed` block may ask for (the H200's 227 KiB a
/// block, less some room).
const RULE_STREAM_MAX_SHARED: u32 = 224 << 10;

/// The streamed rule needs this many items a resident block (`Ops::decode_rule_kind`).
const RULE_STREAM_ITEMS_PER_BLOCK: u32 = 4;

/// Resident `gated_delta_streamed` blocks where the backend reports none (the CPU): the H200's
/// one a multiprocessor at Qwen3.5 heads.
const RULE_STREAM_BLOCKS: u32 = 132;

/// `gated_delta_streamed`'s launch: threads, dynamic shared memory (`None`: shapes off its
/// streamed path, which it runs from no shared memory) and blocks resident at once.
struct RuleStream {
    threads: u32,
    smem: Option<u32>,
    resident: u32,
}

impl RuleStream {
    /// The kernel [`Ops::decode_rule_kind`] picks for `p`.
    fn kind(&self, p: &GatedDelta) -> DecodeRule {
        if self.smem.is_some() && rule_items(p) >= RULE_STREAM_ITEMS_PER_BLOCK * self.resident {
            DecodeRule::Streamed
        } else {
            DecodeRule::Blocks
        }
    }
}

/// The decode rule's (sequence, value head) items.
fn rule_items(p: &GatedDelta) -> u32 {
    p.seqs.num_seqs * p.heads.num_v_heads
}

/// Threads of a `gated_delta_streamed` block: a warp per 16 value columns of a head.
fn rule_stream_threads(p: &GatedDelta) -> u32 {
    32 * p.heads.v_head_dim.div_ceil(RULE_WARP_COLS).max(1)
}

/// The dynamic shared memory of `gated_delta_streamed` for `p`, or `None` where the kernel would
/// not stream: heads off the fast path (`Dk` over 128, `Dk`, `Dv` or the slot stride not a
/// multiple of 4) or too large for one buffer, or more than 32 warps a head.
fn rule_stream_shared_bytes(p: &GatedDelta) -> Option<u32> {
    let h = &p.heads;
    let fast = h.k_head_dim <= metrale_kernel_abi::GDN_FAST_MAX_DK
        && h.k_head_dim.is_multiple_of(4)
        && h.v_head_dim.is_multiple_of(4)
        && p.state.slot_stride.is_multiple_of(4)
        && rule_stream_threads(p) <= 1024;
    let head = h.k_head_dim.checked_mul(h.v_head_dim)?.checked_mul(4)?;
    let fits = |bufs: u32| {
        let bytes = RULE_STREAM_BARS + bufs * head;
        (bytes <= RULE_STREAM_MAX_SHARED).then_some(bytes)
    };
    if !fast {
        return None;
    }
    fits(RULE_STREAM_BUFS).or_else(|| fits(1))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use metrale_gpu_runtime::{CpuBackend, DevicePtr, GpuBackend};

    use super::*;
    use crate::ops_hybrid::{GdnHeads, GdnSeqs, StatePool};

    /// A decode step's delta rule over `seqs` sequences of heads `(Hk, Dk, Hv, Dv)` (addresses
    /// never read: the kernel choice depends on the shape only).
    fn step(seqs: u32, (hk, dk, hv, dv): (u32, u32, u32, u32)) -> GatedDelta {
        let none = DevicePtr(0);
        GatedDelta {
            out: none,
            state: StatePool {
                base: none,
                num_slots: seqs,
                slot_stride: hv * dk * dv,
            },
            qk: none,
            conv: none,
            gates: none,
            seqs: GdnSeqs {
                row_seq: none,
                seq_start: none,
                seq_slot: none,
                positions: none,
                rows: seqs,
                num_seqs: seqs,
            },
            heads: GdnHeads {
                num_k_heads: hk,
                k_head_dim: dk,
                num_v_heads: hv,
                v_head_dim: dv,
            },
        }
    }

    /// The streamed kernel serves decode steps with four items a resident block (the H200's 132
    /// on the CPU backend): Qwen3.5-9B's heads from 17 sequences. Heads off its fast path (Dk
    /// over 128, or not a multiple of 4) always get the recurrent kernel.
    #[test]
    fn decode_rule_streams_once_every_block_has_four_heads() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu).expect("kernels resolve");
        let kind = |seqs, heads| ops.decode_rule_kind(&step(seqs, heads)).expect("kind");
        use DecodeRule::{Blocks, Streamed};
        let qwen35 = (16, 128, 32, 128);
        assert_eq!(
            [1, 8, 16, 17, 32, 64, 128].map(|n| kind(n, qwen35)),
            [
                Blocks, Blocks, Blocks, Streamed, Streamed, Streamed, Streamed
            ]
        );
        assert_eq!(kind(128, (1, 160, 1, 32)), Blocks);
        assert_eq!(kind(1024, (1, 18, 2, 12)), Blocks);
        assert_eq!(
            rule_stream_shared_bytes(&step(64, qwen35)),
            Some(64 + 2 * 65536)
        );
    }
}
