//! The launchers of the Gated DeltaNet kernels (`gdn::*`), an `impl Ops` block beside the dense
//! ones in `ops`; the decode step's delta rule (which of its two kernels runs) is in
//! `ops_gdn_decode`, and the sparse-MoE launchers (`moe::*`) in `ops_moe`, whose public types are
//! re-exported here. Each fills its kernel's parameter struct (`metrale-kernel-abi`) from the
//! typed parameters below and picks the launch geometry the CUDA source expects.
//!
//! Invariants:
//! - As in `ops`: one launcher per kernel, and launch geometry depends only on shapes, never on
//!   data.
//! - Every GDN kernel takes the head scalars `hk, dk, hv, dv` (`GdnHeads`), from which it
//!   derives every row width; the kernels that read the input projection also take where its
//!   rows lie (`GdnProjLayout`: one fused matrix, or q|k|v|z and b|a apart).

use metrale_gpu_runtime::{DevicePtr, GpuError, GpuResult, LaunchConfig, StreamHandle};
use metrale_kernel_abi::{
    CausalConv1dParams, ConvStateUpdateParams, ConvStateVerifyParams, GDN_RING, GDN_TOK_BYTES,
    GDN_WARP_COLS, GatedDeltaChunkedParams, GatedDeltaParams, GatedDeltaVerifyParams,
    GatedRmsNormParams, GdnPrepareParams,
};

use crate::ops::{Ops, step_launch};
pub use crate::ops_gdn_decode::DecodeRule;
pub use crate::ops_moe::{ExpertLinear, MoeCombine, TopkRoute};

/// Threads per block of the channel-parallel GDN kernels (conv, conv-state update).
const CHANNEL_THREADS: u32 = 256;
/// Most warps of a `gdn_prepare` block (a warp per q/k head of the row, up to a 1024-thread
/// block; past that a warp takes several heads in turn).
const PREPARE_MAX_WARPS: u32 = 32;
/// Columns of a value head per warp of the delta-rule kernels (`kernels/gdn.cu`).
pub(crate) const RULE_WARP_COLS: u32 = GDN_WARP_COLS;
/// Warps per block of the delta-rule kernels.
const RULE_WARPS_PER_BLOCK: u32 = 2;

/// Dynamic shared memory per warp of `gated_delta_chunked`: a ring of `GDN_RING` tokens of
/// `GDN_TOK_BYTES` (q̂ and k̂ of up to 128 f32 each, 16 v columns, β and g), the prefill's loads
/// several tokens ahead (`kernels/gdn.cu`). Without it the kernel loads each token when it
/// needs it, as the recurrent kernel does: same bits.
const RULE_RING_BYTES: u32 = GDN_RING * GDN_TOK_BYTES;

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
    /// `(hk, dk, hv, dv)`, the head scalars every GDN kernel takes.
    pub fn scalars(&self) -> (u32, u32, u32, u32) {
        (
            self.num_k_heads,
            self.k_head_dim,
            self.num_v_heads,
            self.v_head_dim,
        )
    }
}

/// Where the GDN kernels find each row's `[q | k | v | z]` and `[b | a]` in the input
/// projection's buffer: row `r`'s q|k|v|z at element `r * proj_stride`, its b|a at `ba_offset +
/// r * ba_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnProjLayout {
    /// Elements from one row's q|k|v|z to the next.
    pub proj_stride: u32,
    /// Element offset of row 0's b.
    pub ba_offset: u32,
    /// Elements from one row's b|a to the next.
    pub ba_stride: u32,
}

impl GdnProjLayout {
    /// One `[rows, proj_width]` matrix `[q | k | v | z | b | a]` (one fused GEMM).
    pub fn fused(h: &GdnHeads) -> GdnProjLayout {
        GdnProjLayout {
            proj_stride: h.proj_width(),
            ba_offset: h.conv_dim() + h.value_dim(),
            ba_stride: h.proj_width(),
        }
    }

    /// A `[rows, conv_dim + value_dim]` matrix `[q | k | v | z]` followed by a `[rows, 2 * Hv]`
    /// one `[b | a]` (two GEMMs into the same buffer, as an FP8 layer runs them); refused when
    /// the offset of the second does not fit in u32.
    pub fn split(h: &GdnHeads, rows: u32) -> GpuResult<GdnProjLayout> {
        let qkvz = h.conv_dim() + h.value_dim();
        let ba_offset = rows
            .checked_mul(qkvz)
            .ok_or_else(|| GpuError::KernelFailed {
                kernel: "gdn input projection".into(),
                problem: format!("{rows} rows of {qkvz} q|k|v|z elements overflow a u32 offset"),
            })?;
        Ok(GdnProjLayout {
            proj_stride: qkvz,
            ba_offset,
            ba_stride: 2 * h.num_v_heads,
        })
    }

    /// [`GdnProjLayout::split`] for a layer whose b and a rows are a weight of their own
    /// (`split`), else [`GdnProjLayout::fused`].
    pub fn of_step(h: &GdnHeads, rows: u32, split: bool) -> GpuResult<GdnProjLayout> {
        if split {
            GdnProjLayout::split(h, rows)
        } else {
            Ok(GdnProjLayout::fused(h))
        }
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
    /// bf16: the projection, conv channels first in each row (`layout`).
    pub proj: DevicePtr,
    /// Where `proj` holds each row's q|k|v.
    pub layout: GdnProjLayout,
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
    /// bf16: the projection (b and a, where `layout` says).
    pub proj: DevicePtr,
    /// Where `proj` holds each row's b and a.
    pub layout: GdnProjLayout,
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
    /// bf16: the projection (z, at `conv_dim` of each row's q|k|v|z).
    pub proj: DevicePtr,
    /// Where `proj` holds each row's z.
    pub layout: GdnProjLayout,
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
        let (hk, dk, hv, dv) = p.heads.scalars();
        let params = CausalConv1dParams {
            out: p.out,
            proj: p.proj,
            conv_state: p.conv_state.base,
            weight: p.weight,
            row_seq: q.row_seq,
            seq_start: q.seq_start,
            seq_slot: q.seq_slot,
            rows: q.rows,
            num_seqs: q.num_seqs,
            num_slots: p.conv_state.num_slots,
            slot_stride: p.conv_state.slot_stride,
            hk,
            dk,
            hv,
            dv,
            kernel_size: p.kernel_size,
            proj_stride: p.layout.proj_stride,
        };
        let blocks = p.heads.conv_dim().div_ceil(CHANNEL_THREADS);
        let cfg = LaunchConfig::grid2(q.rows, blocks, CHANNEL_THREADS);
        self.go(self.k.causal_conv1d, step_launch(cfg, q.rows), &params, s)
    }

    /// Move each sequence's conv window past its rows; after `causal_conv1d`. One thread per
    /// (sequence, channel).
    pub fn conv_state_update(&self, s: StreamHandle, p: &CausalConv1d) -> GpuResult<()> {
        let params = window_params(p);
        self.go(self.k.conv_state_update, window_geometry(p), &params, s)
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
        let w = window_params(p);
        let params = ConvStateVerifyParams {
            conv_state: w.conv_state,
            proj: w.proj,
            seq_start: w.seq_start,
            seq_slot: w.seq_slot,
            row_slot,
            rows: w.rows,
            num_seqs: w.num_seqs,
            num_slots: w.num_slots,
            slot_stride: w.slot_stride,
            hk: w.hk,
            dk: w.dk,
            hv: w.hv,
            dv: w.dv,
            kernel_size: w.kernel_size,
            proj_stride: w.proj_stride,
        };
        self.go(self.k.conv_state_verify, window_geometry(p), &params, s)
    }

    /// L2-normalised q and k, and the gates β and g. One block per row.
    pub fn gdn_prepare(&self, s: StreamHandle, p: &GdnPrepare) -> GpuResult<()> {
        let (hk, dk, hv, dv) = p.heads.scalars();
        let params = GdnPrepareParams {
            qk: p.qk,
            gates: p.gates,
            conv: p.conv,
            proj: p.proj,
            a_log: p.a_log,
            dt_bias: p.dt_bias,
            rows: p.rows,
            hk,
            dk,
            hv,
            dv,
            l2_eps: p.l2_eps,
            q_scale: p.q_scale,
            ba_offset: p.layout.ba_offset,
            ba_stride: p.layout.ba_stride,
        };
        let cfg = LaunchConfig::linear(p.rows, prepare_threads(&p.heads));
        self.go(self.k.gdn_prepare, step_launch(cfg, p.rows), &params, s)
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
        let r = rule_params(p);
        let params = GatedDeltaChunkedParams {
            out: r.out,
            state: r.state,
            qk: r.qk,
            conv: r.conv,
            gates: r.gates,
            seq_start: r.seq_start,
            seq_slot: r.seq_slot,
            positions: p.seqs.positions,
            rows: r.rows,
            num_seqs: r.num_seqs,
            num_slots: r.num_slots,
            slot_stride: r.slot_stride,
            hk: r.hk,
            dk: r.dk,
            hv: r.hv,
            dv: r.dv,
            chunk_size,
        };
        let cfg = rule_geometry(p);
        let warps = cfg.block.0 / 32;
        let cfg = cfg.with_shared(warps * RULE_RING_BYTES);
        self.go(self.k.gated_delta_chunked, cfg, &params, s)
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
        let r = rule_params(p);
        let params = GatedDeltaVerifyParams {
            out: r.out,
            state: r.state,
            qk: r.qk,
            conv: r.conv,
            gates: r.gates,
            seq_start: r.seq_start,
            seq_slot: r.seq_slot,
            row_slot,
            rows: r.rows,
            num_seqs: r.num_seqs,
            num_slots: r.num_slots,
            slot_stride: r.slot_stride,
            hk: r.hk,
            dk: r.dk,
            hv: r.hv,
            dv: r.dv,
        };
        self.go(self.k.gated_delta_verify, rule_geometry(p), &params, s)
    }

    /// Per-head RMSNorm (plain weight) times `silu(z)`. One warp per (row, value head).
    pub fn gated_rms_norm(&self, s: StreamHandle, p: &GatedRmsNorm) -> GpuResult<()> {
        let (hk, dk, hv, dv) = p.heads.scalars();
        let params = GatedRmsNormParams {
            out: p.out,
            core: p.core,
            proj: p.proj,
            weight: p.weight,
            rows: p.rows,
            hk,
            dk,
            hv,
            dv,
            eps: p.eps,
            proj_stride: p.layout.proj_stride,
        };
        let cfg = LaunchConfig::grid2(p.rows, hv, 32);
        self.go(self.k.gated_rms_norm, step_launch(cfg, p.rows), &params, s)
    }
}

/// `conv_state_update`'s parameters (`conv_state_verify`'s but for the row slots).
fn window_params(p: &CausalConv1d) -> ConvStateUpdateParams {
    let q = &p.seqs;
    let (hk, dk, hv, dv) = p.heads.scalars();
    ConvStateUpdateParams {
        conv_state: p.conv_state.base,
        proj: p.proj,
        seq_start: q.seq_start,
        seq_slot: q.seq_slot,
        rows: q.rows,
        num_seqs: q.num_seqs,
        num_slots: p.conv_state.num_slots,
        slot_stride: p.conv_state.slot_stride,
        hk,
        dk,
        hv,
        dv,
        kernel_size: p.kernel_size,
        proj_stride: p.layout.proj_stride,
    }
}

/// The conv-window kernels' grid: (sequences, blocks of `CHANNEL_THREADS` channels).
fn window_geometry(p: &CausalConv1d) -> LaunchConfig {
    let blocks = p.heads.conv_dim().div_ceil(CHANNEL_THREADS);
    let cfg = LaunchConfig::grid2(p.seqs.num_seqs, blocks, CHANNEL_THREADS);
    step_launch(cfg, p.seqs.rows)
}

/// The parameters `gated_delta_recurrent` and `gated_delta_streamed` take (and the other rule
/// kernels share).
pub(crate) fn rule_params(p: &GatedDelta) -> GatedDeltaParams {
    let q = &p.seqs;
    let (hk, dk, hv, dv) = p.heads.scalars();
    GatedDeltaParams {
        out: p.out,
        state: p.state.base,
        qk: p.qk,
        conv: p.conv,
        gates: p.gates,
        seq_start: q.seq_start,
        seq_slot: q.seq_slot,
        rows: q.rows,
        num_seqs: q.num_seqs,
        num_slots: p.state.num_slots,
        slot_stride: p.state.slot_stride,
        hk,
        dk,
        hv,
        dv,
    }
}

/// Threads of a `gdn_prepare` block: a warp per q and k head of the row, so each head's norm is
/// one warp's chain of loads and sum (which warp takes a head changes no bit), all heads in
/// flight at once rather than a few warps taking them in turn.
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
