//! The launchers of the Gated DeltaNet kernels (`gdn::*`), an `impl Ops` block beside the dense
//! ones in `ops`; the decode step's delta rule (which of its two kernels runs) is in
//! `ops_gdn_decode`, and the sparse-MoE launchers (`moe::*`) in `ops_moe`, whose public types are
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
pub use crate::ops_gdn_decode::DecodeRule;
pub use crate::ops_moe::{ExpertLinear, MoeCombine};

/// Threads per block of the channel-parallel GDN kernels (conv, conv-state update).
const CHANNEL_THREADS: u32 = 256;
/// Most warps of a `gdn_prepare` block (a warp per q/k head of the row, up to a 1024-thread
/// block; past that a warp takes several heads in turn).
const PREPARE_MAX_WARPS: u32 = 32;
/// Columns of a value head per warp of the delta-rule kernels (`kernels/gdn.cu`).
pub(crate) const RULE_WARP_COLS: u32 = 16;
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

    pub(crate) fn rule_args(p: &GatedDelta, positions: bool) -> Vec<KernelArg> {
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

/// The delta-rule kernels' grid (`kernels/gdn.cu`): a value head's Dv columns are cut into
/// `ceil(Dv / 16)` warp tiles, `RULE_WARPS_PER_BLOCK` per block, so the grid is (num_seqs,
/// Hv * ceil(tiles / warps per block)) of `32 * warps per block` threads. Every element is computed
/// the same way whichever block holds its tile, so the grouping changes no result.
pub(crate) fn rule_geometry(p: &GatedDelta) -> LaunchConfig {
    let tiles = p.heads.v_head_dim.div_ceil(RULE_WARP_COLS).max(1);
    let warps = tiles.min(RULE_WARPS_PER_BLOCK);
    let groups = tiles.div_ceil(warps);
    step_launch(
        LaunchConfig::grid2(p.seqs.num_seqs, p.heads.num_v_heads * groups, 32 * warps),
        p.seqs.rows,
    )
}
