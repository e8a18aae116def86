//! The launchers of the Gated DeltaNet kernels (`gdn::*`), an `impl Ops` block beside the dense
//! ones in `ops`; the sparse-MoE launchers (`moe::*`) are in `ops_moe`, whose parameter types are
//! re-exported here. Each builds its kernel's flat argument list in the order the CPU twin in
//! `metrale-gpu-runtime::cpu::kernels::gdn` documents (pointers, then scalars) and picks the
//! launch geometry the CUDA source expects.
//!
//! Invariants:
//! - As in `ops`: one launcher per kernel, argument order is the kernel's signature, and launch
//!   geometry depends only on shapes, never on data.
//! - The GDN kernels all end with the head scalars `num_k_heads, k_head_dim, num_v_heads,
//!   v_head_dim` (`GdnHeads::args`), from which they derive every row width.

use metrale_gpu_runtime::{
    DevicePtr, GpuResult, KernelArg, KernelHandle, LaunchConfig, StreamHandle,
};

use crate::ops::{Ops, step_launch};
pub use crate::ops_moe::{ExpertLinear, MoeCombine};

/// Threads per block of the channel-parallel GDN kernels (conv, conv-state update).
const CHANNEL_THREADS: u32 = 256;
/// Most warps of a `gdn_prepare` block (a warp per q/k head of the row, up to a 1024-thread
/// block; past that a warp takes several heads in turn).
const PREPARE_MAX_WARPS: u32 = 32;
/// Columns of a value head per warp of the delta-rule kernels (`kernels/gdn.cu`).
const RULE_WARP_COLS: u32 = 16;
/// Warps per block of the delta-rule kernels.
const RULE_WARPS_PER_BLOCK: u32 = 2;

/// Dynamic shared memory per warp of `gated_delta_chunked`: a ring of `GDN_RING` (8) tokens of
/// `GDN_TOK_BYTES` (q̂ and k̂ of up to 128 f32 each, 16 v columns, β and g: 1088 bytes), the
/// prefill's loads several tokens ahead (`kernels/gdn.cu`). Without it the kernel loads each
/// token when it needs it, as the recurrent kernel does: same bits.
const RULE_RING_BYTES: u32 = 8 * (2 * 128 * 4 + 64);

/// The head shape of a GDN layer: `Hk` key heads of `Dk`, `Hv` value heads of `Dv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnHeads {
    /// `Hk` (`linear_num_key_heads`).
    pub num_k_heads: u32,
    /// `Dk` (`linear_key_head_dim`).
    pub k_head_dim: u32,
    /// `Hv` (`linear_num_value_heads`), a multiple of `Hk`.
    pub num_v_heads: u32,
    /// `Dv` (`linear_value_head_dim`).
    pub v_head_dim: u32,
}

impl GdnHeads {
    /// `Hk * Dk`.
    pub fn key_dim(&self) -> u32 {
        self.num_k_heads * self.k_head_dim
    }
    /// `Hv * Dv`.
    pub fn value_dim(&self) -> u32 {
        self.num_v_heads * self.v_head_dim
    }
    /// The conv channels `[q | k | v]`: `2 * key_dim + value_dim`.
    pub fn conv_dim(&self) -> u32 {
        2 * self.key_dim() + self.value_dim()
    }
    /// A projection row `[q | k | v | z | b | a]`: `conv_dim + value_dim + 2 * Hv`.
    pub fn proj_width(&self) -> u32 {
        self.conv_dim() + self.value_dim() + 2 * self.num_v_heads
    }
    /// The four trailing head scalars of every GDN kernel.
    pub fn args(&self) -> [KernelArg; 4] {
        [
            self.num_k_heads.into(),
            self.k_head_dim.into(),
            self.num_v_heads.into(),
            self.v_head_dim.into(),
        ]
    }
}

/// The step's sequences, as the GDN kernels read them.
#[derive(Debug, Clone, Copy)]
pub struct GdnSeqs {
    /// u32 `[rows]`: each row's sequence.
    pub row_seq: DevicePtr,
    /// u32 `[num_seqs + 1]`: each sequence's first row, then `rows`.
    pub seq_start: DevicePtr,
    /// u32 `[num_seqs]`: each sequence's state slot (`u32::MAX`: padding).
    pub seq_slot: DevicePtr,
    /// u32 `[rows]`: positions (the chunked rule aligns its chunks to them).
    pub positions: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Sequences.
    pub num_seqs: u32,
}

/// One state pool of a GDN layer (conv windows or recurrent states).
#[derive(Debug, Clone, Copy)]
pub struct StatePool {
    /// Slot 0.
    pub base: DevicePtr,
    /// Slots.
    pub num_slots: u32,
    /// f32 elements from one slot to the next.
    pub slot_stride: u32,
}

/// The parameters of `causal_conv1d` and `conv_state_update`.
#[derive(Debug, Clone, Copy)]
pub struct CausalConv1d {
    /// bf16 `[rows, conv_dim]` (unused by the state update).
    pub out: DevicePtr,
    /// bf16 `[rows, proj_width]`: the projection, conv channels first.
    pub proj: DevicePtr,
    /// Conv windows, f32 `[K - 1, conv_dim]` per slot.
    pub conv_state: StatePool,
    /// bf16 `[conv_dim, K]` (unused by the state update).
    pub weight: DevicePtr,
    /// The step's sequences.
    pub seqs: GdnSeqs,
    /// Head shape.
    pub heads: GdnHeads,
    /// Conv taps `K`.
    pub kernel_size: u32,
}

/// The parameters of `gdn_prepare`.
#[derive(Debug, Clone, Copy)]
pub struct GdnPrepare {
    /// f32 `[rows, 2 * key_dim]`.
    pub qk: DevicePtr,
    /// f32 `[rows, 2 * Hv]`.
    pub gates: DevicePtr,
    /// bf16 `[rows, conv_dim]`.
    pub conv: DevicePtr,
    /// bf16 `[rows, proj_width]` (b and a).
    pub proj: DevicePtr,
    /// f32 `[Hv]`.
    pub a_log: DevicePtr,
    /// f32 `[Hv]`.
    pub dt_bias: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Head shape.
    pub heads: GdnHeads,
    /// L2-norm epsilon (1e-6 in transformers).
    pub l2_eps: f32,
    /// q's scale, `1/√Dk`.
    pub q_scale: f32,
}

/// The parameters of `gated_delta_recurrent` and `gated_delta_chunked`.
#[derive(Debug, Clone, Copy)]
pub struct GatedDelta {
    /// f32 `[rows, value_dim]`.
    pub out: DevicePtr,
    /// Recurrent states, f32 `[Hv, Dk, Dv]` per slot, updated in place.
    pub state: StatePool,
    /// f32 `[rows, 2 * key_dim]`.
    pub qk: DevicePtr,
    /// bf16 `[rows, conv_dim]` (v).
    pub conv: DevicePtr,
    /// f32 `[rows, 2 * Hv]`.
    pub gates: DevicePtr,
    /// The step's sequences.
    pub seqs: GdnSeqs,
    /// Head shape.
    pub heads: GdnHeads,
}

/// The parameters of `gated_rms_norm`.
#[derive(Debug, Clone, Copy)]
pub struct GatedRmsNorm {
    /// bf16 `[rows, value_dim]`.
    pub out: DevicePtr,
    /// f32 `[rows, value_dim]`.
    pub core: DevicePtr,
    /// bf16 `[rows, proj_width]` (z).
    pub proj: DevicePtr,
    /// bf16 `[Dv]`, applied as `x * w`.
    pub weight: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Head shape.
    pub heads: GdnHeads,
    /// Epsilon.
    pub eps: f32,
}

impl Ops {
    /// Causal depthwise conv + SiLU of each row's conv channels, reading earlier inputs from the
    /// step or the slot's window. One thread per (row, channel).
    pub fn causal_conv1d(&self, s: StreamHandle, p: &CausalConv1d) -> GpuResult<()> {
        let q = &p.seqs;
        let mut args: Vec<KernelArg> = vec![
            p.out.into(),
            p.proj.into(),
            p.conv_state.base.into(),
            p.weight.into(),
            q.row_seq.into(),
            q.seq_start.into(),
            q.seq_slot.into(),
            q.rows.into(),
            q.num_seqs.into(),
            p.conv_state.num_slots.into(),
            p.conv_state.slot_stride.into(),
        ];
        args.extend(p.heads.args());
        args.push(p.kernel_size.into());
        let blocks = p.heads.conv_dim().div_ceil(CHANNEL_THREADS);
        self.go(
            self.k.causal_conv1d,
            step_launch(LaunchConfig::grid2(q.rows, blocks, CHANNEL_THREADS), q.rows),
            &args,
            s,
        )
    }

    /// Move each sequence's conv window past its rows; after `causal_conv1d`. One thread per
    /// (sequence, channel).
    pub fn conv_state_update(&self, s: StreamHandle, p: &CausalConv1d) -> GpuResult<()> {
        self.conv_window(s, p, self.k.conv_state_update, None)
    }

    /// A verify step's conv windows: the window after each row goes to `row_slot[row]` (u32
    /// `[rows]`, `u32::MAX` for none), the sequences' own slots are only read. After
    /// `causal_conv1d`, in place of `conv_state_update`. The geometry of `conv_state_update`.
    pub fn conv_state_verify(
        &self,
        s: StreamHandle,
        p: &CausalConv1d,
        row_slot: DevicePtr,
    ) -> GpuResult<()> {
        self.conv_window(s, p, self.k.conv_state_verify, Some(row_slot))
    }

    /// `conv_state_update` or, with `row_slot`, `conv_state_verify`: the same arguments but
    /// for the row-slot map after the sequences' slots.
    fn conv_window(
        &self,
        s: StreamHandle,
        p: &CausalConv1d,
        kernel: KernelHandle,
        row_slot: Option<DevicePtr>,
    ) -> GpuResult<()> {
        let q = &p.seqs;
        let mut args: Vec<KernelArg> = vec![
            p.conv_state.base.into(),
            p.proj.into(),
            q.seq_start.into(),
            q.seq_slot.into(),
        ];
        args.extend(row_slot.map(KernelArg::from));
        args.extend::<[KernelArg; 4]>([
            q.rows.into(),
            q.num_seqs.into(),
            p.conv_state.num_slots.into(),
            p.conv_state.slot_stride.into(),
        ]);
        args.extend(p.heads.args());
        args.push(p.kernel_size.into());
        let blocks = p.heads.conv_dim().div_ceil(CHANNEL_THREADS);
        self.go(
            kernel,
            step_launch(
                LaunchConfig::grid2(q.num_seqs, blocks, CHANNEL_THREADS),
                q.rows,
            ),
            &args,
            s,
        )
    }

    /// L2-normalised q and k, and the gates β and g. One block per row.
    pub fn gdn_prepare(&self, s: StreamHandle, p: &GdnPrepare) -> GpuResult<()> {
        let mut args: Vec<KernelArg> = vec![
            p.qk.into(),
            p.gates.into(),
            p.conv.into(),
            p.proj.into(),
            p.a_log.into(),
            p.dt_bias.into(),
            p.rows.into(),
        ];
        args.extend(p.heads.args());
        args.extend([KernelArg::F32(p.l2_eps), KernelArg::F32(p.q_scale)]);
        self.go(
            self.k.gdn_prepare,
            step_launch(
                LaunchConfig::linear(p.rows, prepare_threads(&p.heads)),
                p.rows,
            ),
            &args,
            s,
        )
    }

    fn rule_args(p: &GatedDelta, positions: bool) -> Vec<KernelArg> {
        let q = &p.seqs;
        let mut args: Vec<KernelArg> = vec![
            p.out.into(),
            p.state.base.into(),
            p.qk.into(),
            p.conv.into(),
            p.gates.into(),
            q.seq_start.into(),
            q.seq_slot.into(),
        ];
        if positions {
            args.push(q.positions.into());
        }
        args.extend::<[KernelArg; 4]>([
            q.rows.into(),
            q.num_seqs.into(),
            p.state.num_slots.into(),
            p.state.slot_stride.into(),
        ]);
        args.extend(p.heads.args());
        args
    }

    /// The gated delta rule token by token (decode), through the kernel
    /// [`Ops::decode_rule_kind`] picks; both give every output and state bitwise the same.
    pub fn gated_delta_recurrent(&self, s: StreamHandle, p: &GatedDelta) -> GpuResult<()> {
        let stream = self.rule_stream(p)?;
        self.decode_rule(s, p, stream.kind(p), &stream)
    }

    /// The decode rule kernel for `p`: `gated_delta_streamed` when its shapes take the streamed
    /// path and the (sequence, value head) items are at least `RULE_STREAM_ITEMS_PER_BLOCK`
    /// times its resident blocks, `gated_delta_recurrent` otherwise. On the H200 (lab/gdn_lab.cu,
    /// Qwen3.5-9B's 32 value heads of 128, one row a sequence): 32 sequences 43.3 -> 40.6 us,
    /// 64 82.9 -> 75.7, 128 162.6 -> 145.8; 16 about even (23.2 / 23.3); at 8 and fewer the
    /// recurrent kernel's many small blocks are faster (12.5 / 13.2 at 8, 3.8 / 5.7 at one).
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
        let resident = self.resident_clusters(
            self.k.gated_delta_streamed,
            threads,
            smem.unwrap_or(0),
            RULE_STREAM_BLOCKS,
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
        let args = Self::rule_args(p, false);
        match kind {
            DecodeRule::Blocks => self.go(self.k.gated_delta_recurrent, rule_geometry(p), &args, s),
            DecodeRule::Streamed => {
                let items = rule_items(p);
                let cfg = LaunchConfig::grid2(items.min(stream.resident).max(1), 1, stream.threads)
                    .with_shared(stream.smem.unwrap_or(0));
                self.go(
                    self.k.gated_delta_streamed,
                    step_launch(cfg, p.seqs.rows),
                    &args,
                    s,
                )
            }
        }
    }

    /// The gated delta rule in position-aligned chunks of `chunk_size` (prefill). The grid of
    /// `gated_delta_recurrent`, plus each warp's ring of prefetched tokens in dynamic shared
    /// memory (`RULE_RING_BYTES`).
    pub fn gated_delta_chunked(
        &self,
        s: StreamHandle,
        p: &GatedDelta,
        chunk_size: u32,
    ) -> GpuResult<()> {
        let mut args = Self::rule_args(p, true);
        args.push(chunk_size.into());
        let cfg = rule_geometry(p);
        let warps = cfg.block.0 / 32;
        self.go(
            self.k.gated_delta_chunked,
            cfg.with_shared(warps * RULE_RING_BYTES),
            &args,
            s,
        )
    }

    /// The gated delta rule of a verify step: each sequence's rows token by token, bitwise as
    /// `gated_delta_recurrent`, the state after each row written to `row_slot[row]` (u32
    /// `[rows]`, `u32::MAX` for none); the sequences' own slots are only read. The geometry of
    /// `gated_delta_recurrent`.
    pub fn gated_delta_verify(
        &self,
        s: StreamHandle,
        p: &GatedDelta,
        row_slot: DevicePtr,
    ) -> GpuResult<()> {
        let mut args = Self::rule_args(p, false);
        args.insert(7, row_slot.into());
        self.go(self.k.gated_delta_verify, rule_geometry(p), &args, s)
    }

    /// Per-head RMSNorm (plain weight) times `silu(z)`. One warp per (row, value head).
    pub fn gated_rms_norm(&self, s: StreamHandle, p: &GatedRmsNorm) -> GpuResult<()> {
        let mut args: Vec<KernelArg> = vec![
            p.out.into(),
            p.core.into(),
            p.proj.into(),
            p.weight.into(),
            p.rows.into(),
        ];
        args.extend(p.heads.args());
        args.push(KernelArg::F32(p.eps));
        self.go(
            self.k.gated_rms_norm,
            step_launch(LaunchConfig::grid2(p.rows, p.heads.num_v_heads, 32), p.rows),
            &args,
            s,
        )
    }
}

/// Threads of a `gdn_prepare` block: a warp per q and k head of the row, so each head's norm is
/// one warp's chain of loads and sum (which warp takes a head changes no bit). Four warps taking
/// Qwen3.5-9B's 32 heads eight at a time in turn, one block per row, ran 9.9 us at 64 rows
/// (eager, H200).
fn prepare_threads(h: &GdnHeads) -> u32 {
    32 * (2 * h.num_k_heads).clamp(1, PREPARE_MAX_WARPS)
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
/// two, the state of the item after the one computing in flight. Three were no faster on the
/// H200 (64 sequences: 76.6 against 75.7 us), and one a block (three blocks a multiprocessor)
/// slower (78.0).
const RULE_STREAM_BUFS: u32 = 2;
/// The barriers' bytes ahead of the buffers (`GDN_STREAM_BARS`).
const RULE_STREAM_BARS: u32 = 64;

/// Most dynamic shared memory a `gated_delta_streamed` block may ask for (the H200's 227 KiB a
/// block, less some room).
const RULE_STREAM_MAX_SHARED: u32 = 224 << 10;

/// The streamed rule needs this many items a resident block (`Ops::decode_rule_kind`): 16
/// sequences of Qwen3.5-9B heads (512 items, 3.9 a block) are even, 32 (7.8) faster.
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
    let fast = h.k_head_dim <= 128
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

/// The delta-rule kernels' grid (`kernels/gdn.cu`): a value head's Dv columns are cut into
/// `ceil(Dv / 16)` warp tiles, `RULE_WARPS_PER_BLOCK` per block, so the grid is (num_seqs,
/// Hv * ceil(tiles / warps per block)) of `32 * warps per block` threads. Every element is computed
/// the same way whichever block holds its tile, so the grouping changes no result.
fn rule_geometry(p: &GatedDelta) -> LaunchConfig {
    let tiles = p.heads.v_head_dim.div_ceil(RULE_WARP_COLS).max(1);
    let warps = tiles.min(RULE_WARPS_PER_BLOCK);
    let groups = tiles.div_ceil(warps);
    step_launch(
        LaunchConfig::grid2(p.seqs.num_seqs, p.heads.num_v_heads * groups, 32 * warps),
        p.seqs.rows,
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use metrale_gpu_runtime::{CpuBackend, DevicePtr, GpuBackend};

    use super::*;

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
