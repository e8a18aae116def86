//! CPU twins of `kernels/gdn.cu`: the Gated DeltaNet token mixer of the Qwen3.5 / Qwen3-Next
//! families, as in transformers' `Qwen3_5GatedDeltaNet` / `Qwen3NextGatedDeltaNet`.
//!
//! A GDN layer runs, over the step's rows: the input projection (`gemm::linear`, one or two), then
//! `causal_conv1d` (depthwise causal conv over the q|k|v channels, SiLU), `conv_state_update`
//! (each sequence's conv window moves past its rows), `gdn_prepare` (L2-normalised q and k, the
//! gates β and g), `gated_delta_recurrent` (decode) or `gated_delta_chunked` (prefill), and
//! `gated_rms_norm` (per-head RMSNorm times `silu(z)`), then the output projection.
//!
//! A verify step of speculative decoding (a sequence's last token and its drafts, in rows)
//! replaces the window update and the rule with `conv_state_verify` and `gated_delta_verify`:
//! the rule runs token by token exactly as in decode, and the window and recurrent state after
//! every row are kept in that row's own slot (`row_slot`), so that accepting `j` drafts makes the
//! slot of row `j` the sequence's state with no recompute and no copy.
//!
//! Shapes, named by the four head scalars every kernel of the family takes in this order:
//! `num_k_heads` (Hk), `k_head_dim` (Dk), `num_v_heads` (Hv), `v_head_dim` (Dv); Hv is a multiple
//! of Hk and value head `j` reads key head `j / (Hv / Hk)`. Derived: `key_dim = Hk*Dk`,
//! `value_dim = Hv*Dv`, `conv_dim = 2*key_dim + value_dim`,
//! `proj_width = conv_dim + value_dim + 2*Hv`.
//!
//! Layouts:
//! - Projection, bf16: per row `[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv)]`, heads in order
//!   inside each part, row `r` at `r * proj_stride` (columns `0..conv_dim` are the conv channels,
//!   z starts at `conv_dim`), and `[b (Hv) | a (Hv)]` at `ba_offset + r * ba_stride`. One fused
//!   `[rows, proj_width]` matrix `[q | k | v | z | b | a]` has `proj_stride = ba_stride =
//!   proj_width` and `ba_offset = conv_dim + value_dim`; a `[rows, conv_dim + value_dim]` matrix
//!   followed by a `[rows, 2*Hv]` one (two GEMMs) has `proj_stride = conv_dim + value_dim`,
//!   `ba_offset = rows * proj_stride`, `ba_stride = 2*Hv`.
//! - Conv output, bf16 `[rows, conv_dim]`: the same channels, `[q | k | v]`.
//! - Conv state of one slot, f32 `[K - 1, conv_dim]`, time-major, oldest first: row `K - 2` is the
//!   sequence's last input before the step. Slot `s` starts at element `s * slot_stride`.
//! - Recurrent state of one slot, f32 `[Hv, Dk, Dv]` (`S[j][c][d]`), at `s * slot_stride`.
//! - `qk`, f32 `[rows, 2*key_dim]`: `[q̂ (Hk*Dk) | k̂ (Hk*Dk)]`, normalised, q̂ scaled.
//! - `gates`, f32 `[rows, 2*Hv]`: `[β (Hv) | g (Hv)]`.
//! - Core output, f32 `[rows, value_dim]`; normed output, bf16 `[rows, value_dim]`.
//!
//! The step's sequences: `seq_start`, u32 `[num_seqs + 1]`, the first row of each sequence and
//! then `rows`; `seq_slot`, u32 `[num_seqs]`, each sequence's state slot; `row_seq`, u32 `[rows]`,
//! each row's sequence.
//!
//! Invariants:
//! - Rows of one sequence are contiguous and in position order: sequence `s` owns rows
//!   `seq_start[s]..seq_start[s + 1]` and `row_seq` names `s` on exactly those rows.
//! - A slot of `u32::MAX` marks a padding sequence: it reads zero states and writes no state.
//!   Two sequences of a step never share a real slot (the state-writing kernels check).
//! - Each row and each sequence is computed from its own inputs and state only, in a fixed order,
//!   so its results do not depend on the other rows of the step (batch invariance).
//! - `causal_conv1d` reads the conv state as it was before the step; `conv_state_update` must run
//!   after it.

mod delta_rule;
#[cfg(test)]
mod tests;

use std::ops::Range;

use half::bf16;
use metrale_kernel_abi::{
    CausalConv1dParams, ConvStateUpdateParams, ConvStateVerifyParams, GDN_MAX_CONV_HIST,
    GDN_MAX_DK, GatedDeltaParams, GatedRmsNormParams, GdnPrepareParams,
};

use super::util::{b, f, rms_scale, sigmoid, silu};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;
use crate::types::DevicePtr;
pub use delta_rule::{gated_delta_chunked, gated_delta_recurrent, gated_delta_verify};

/// The slot value of a padding sequence.
pub const NO_SLOT: u32 = metrale_kernel_abi::GDN_NO_SLOT;

/// The head shape: the `num_k_heads, k_head_dim, num_v_heads, v_head_dim` scalars.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub hk: usize,
    pub dk: usize,
    pub hv: usize,
    pub dv: usize,
}

impl Heads {
    /// The four head scalars `(hk, dk, hv, dv)`, checked: all positive, Hv a multiple of Hk, and
    /// Dk at most `GDN_MAX_DK` (the CUDA rule's largest).
    pub fn new(ctx: &KernelCtx<'_>, (hk, dk, hv, dv): (u32, u32, u32, u32)) -> GpuResult<Heads> {
        let h = Heads {
            hk: hk as usize,
            dk: dk as usize,
            hv: hv as usize,
            dv: dv as usize,
        };
        if h.hk == 0 || h.dk == 0 || h.dv == 0 || h.hv == 0 || !h.hv.is_multiple_of(h.hk) {
            return Err(ctx.fail(format!(
                "heads Hk={} Dk={} Hv={} Dv={}: all must be positive and Hv a multiple of Hk",
                h.hk, h.dk, h.hv, h.dv
            )));
        }
        if h.dk > GDN_MAX_DK as usize {
            return Err(ctx.fail(format!("Dk={} is over {GDN_MAX_DK}", h.dk)));
        }
        Ok(h)
    }
    pub fn key_dim(&self) -> usize {
        self.hk * self.dk
    }
    pub fn value_dim(&self) -> usize {
        self.hv * self.dv
    }
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// The key head value head `j` reads.
    pub fn key_head(&self, j: usize) -> usize {
        j / (self.hv / self.hk)
    }
}

/// The step's sequences as the per-sequence kernels see them.
#[derive(Debug)]
pub(crate) struct Seqs<'a> {
    start: &'a [u32],
    slot: &'a [u32],
}

impl<'a> Seqs<'a> {
    /// Read and check `seq_start` and `seq_slot`. With `writes`, refuse two sequences on one
    /// slot.
    pub fn read(
        ctx: &'a KernelCtx<'a>,
        (seq_start, seq_slot): (DevicePtr, DevicePtr),
        rows: usize,
        num_seqs: usize,
        num_slots: usize,
        writes: bool,
    ) -> GpuResult<Seqs<'a>> {
        let start = ctx.slice::<u32>("seq_start", seq_start, num_seqs + 1)?;
        let slot = ctx.slice::<u32>("seq_slot", seq_slot, num_seqs)?;
        if start.first().copied().unwrap_or(0) != 0 || start[num_seqs] as usize != rows {
            return Err(ctx.fail(format!(
                "seq_start must run from 0 to rows ({rows}), found {:?}..{}",
                start.first(),
                start[num_seqs]
            )));
        }
        if let Some(s) = start.windows(2).position(|w| w[0] > w[1]) {
            return Err(ctx.fail(format!("seq_start decreases at sequence {s}")));
        }
        let mut seen = Vec::new();
        for (s, &sl) in slot.iter().enumerate() {
            if sl == NO_SLOT {
                continue;
            }
            if sl as usize >= num_slots {
                return Err(ctx.fail(format!(
                    "sequence {s}: slot {sl} is past the {num_slots} state slots"
                )));
            }
            if writes {
                seen.push(sl);
            }
        }
        seen.sort_unstable();
        if let Some(w) = seen.windows(2).find(|w| w[0] == w[1]) {
            return Err(ctx.fail(format!("two sequences of the step share slot {}", w[0])));
        }
        Ok(Seqs { start, slot })
    }

    pub fn len(&self) -> usize {
        self.slot.len()
    }

    /// The rows of sequence `s`.
    pub fn rows(&self, s: usize) -> Range<usize> {
        self.start[s] as usize..self.start[s + 1] as usize
    }

    /// The state slot of sequence `s`; `None` for a padding sequence.
    pub fn slot(&self, s: usize) -> Option<usize> {
        let sl = self.slot[s];
        (sl != NO_SLOT).then_some(sl as usize)
    }
}

/// Check that `slot_stride` fits a slot of `per_slot` elements.
pub(crate) fn check_stride(ctx: &KernelCtx<'_>, stride: usize, per_slot: usize) -> GpuResult<()> {
    if stride < per_slot {
        return Err(ctx.fail(format!(
            "slot_stride {stride} is smaller than one slot's {per_slot} elements"
        )));
    }
    Ok(())
}

/// Elements of a projection that `rows` rows of `width` elements, `stride` apart from element
/// `offset`, span; refused when `stride` is shorter than `width` (rows would overlap).
pub(crate) fn proj_span(
    ctx: &KernelCtx<'_>,
    (what, stride, width): (&str, usize, usize),
    offset: usize,
    rows: usize,
) -> GpuResult<usize> {
    if stride < width {
        return Err(ctx.fail(format!(
            "{what} {stride} is shorter than the {width} projection elements a row reads there"
        )));
    }
    Ok(match rows {
        0 => 0,
        _ => offset + (rows - 1) * stride + width,
    })
}

/// `causal_conv1d` ([`CausalConv1dParams`]).
///
/// For channel `c` of row `r`, `t` rows into its sequence:
/// `out[r][c] = silu(Σ_{i=0}^{K-1} weight[c][i] * x(t - (K-1) + i))`, summed in f32 in `i` order,
/// where `x(u) = proj[first + u][c]` for `u >= 0` and `conv_state[slot][K-1+u][c]` for `u < 0`
/// (zero for a padding sequence). `weight[c][K-1]` multiplies the row's own input, as
/// `nn.Conv1d` with `padding = K - 1` does. The conv state is only read.
pub fn causal_conv1d(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: CausalConv1dParams = ctx.params()?;
    let (rows, num_seqs, num_slots, stride) = (
        p.rows as usize,
        p.num_seqs as usize,
        p.num_slots as usize,
        p.slot_stride as usize,
    );
    let h = Heads::new(ctx, (p.hk, p.dk, p.hv, p.dv))?;
    let taps = p.kernel_size as usize;
    if taps == 0 {
        return Err(ctx.fail("kernel_size must be positive"));
    }
    let (cd, pw, hist) = (h.conv_dim(), p.proj_stride as usize, taps - 1);
    check_stride(ctx, stride, hist * cd)?;
    let out = ctx.slice_mut::<bf16>("out", p.out, rows * cd)?;
    let span = proj_span(ctx, ("proj_stride", pw, cd), 0, rows)?;
    let proj = ctx.slice::<bf16>("proj", p.proj, span)?;
    let state = ctx.slice::<f32>("conv_state", p.conv_state, num_slots * stride)?;
    let weight = ctx.slice::<bf16>("weight", p.weight, cd * taps)?;
    let row_seq = ctx.slice::<u32>("row_seq", p.row_seq, rows)?;
    let seqs = Seqs::read(
        ctx,
        (p.seq_start, p.seq_slot),
        rows,
        num_seqs,
        num_slots,
        false,
    )?;
    for r in 0..rows {
        let s = row_seq[r] as usize;
        if s >= num_seqs || !seqs.rows(s).contains(&r) {
            return Err(ctx.fail(format!(
                "row {r}: row_seq names sequence {s}, whose rows (seq_start) do not hold it"
            )));
        }
        let t = r - seqs.rows(s).start;
        let window = seqs
            .slot(s)
            .map(|sl| &state[sl * stride..sl * stride + hist * cd]);
        for c in 0..cd {
            let mut acc = 0.0f32;
            for i in 0..taps {
                let back = hist - i;
                let x = if back <= t {
                    f(proj[(r - back) * pw + c])
                } else {
                    window.map_or(0.0, |w| w[(hist + t - back) * cd + c])
                };
                acc += f(weight[c * taps + i]) * x;
            }
            out[r * cd + c] = b(silu(acc));
        }
    }
    Ok(())
}

/// What `conv_state_update` and `conv_state_verify` share.
struct Windows {
    conv_state: DevicePtr,
    proj: DevicePtr,
    seqs: (DevicePtr, DevicePtr),
    rows: usize,
    num_seqs: usize,
    num_slots: usize,
    stride: usize,
    heads: (u32, u32, u32, u32),
    kernel_size: u32,
    proj_stride: usize,
}

impl Windows {
    /// The heads and the window length `kernel_size - 1` (1 ..= `GDN_MAX_CONV_HIST` + 1 taps,
    /// as the CUDA kernels take them), checked against the slot stride.
    fn check(&self, ctx: &KernelCtx<'_>) -> GpuResult<(Heads, usize)> {
        let h = Heads::new(ctx, self.heads)?;
        let taps = self.kernel_size as usize;
        if taps == 0 || taps - 1 > GDN_MAX_CONV_HIST as usize {
            return Err(ctx.fail(format!(
                "kernel_size {taps} must be in 1..={}",
                GDN_MAX_CONV_HIST + 1
            )));
        }
        check_stride(ctx, self.stride, (taps - 1) * h.conv_dim())?;
        Ok((h, taps - 1))
    }
}

/// The [`Windows`] of a conv-window launch's parameters (the update and verify kernels name
/// these fields alike).
macro_rules! windows_of {
    ($p:expr) => {
        Windows {
            conv_state: $p.conv_state,
            proj: $p.proj,
            seqs: ($p.seq_start, $p.seq_slot),
            rows: $p.rows as usize,
            num_seqs: $p.num_seqs as usize,
            num_slots: $p.num_slots as usize,
            stride: $p.slot_stride as usize,
            heads: ($p.hk, $p.dk, $p.hv, $p.dv),
            kernel_size: $p.kernel_size,
            proj_stride: $p.proj_stride as usize,
        }
    };
}

/// `conv_state_update` ([`ConvStateUpdateParams`]).
///
/// Each real sequence with `n` rows keeps the last `K - 1` inputs of (old window ++ its rows'
/// conv channels): `new[i] = x(n - (K-1) + i)` with `x` as in `causal_conv1d`. A sequence with
/// no rows, or a padding one, is left alone. Run after `causal_conv1d`.
pub fn conv_state_update(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ConvStateUpdateParams = ctx.params()?;
    let w = windows_of!(p);
    let (h, hist) = w.check(ctx)?;
    let (cd, pw, stride) = (h.conv_dim(), w.proj_stride, w.stride);
    let state = ctx.slice_mut::<f32>("conv_state", w.conv_state, w.num_slots * stride)?;
    let span = proj_span(ctx, ("proj_stride", pw, cd), 0, w.rows)?;
    let proj = ctx.slice::<bf16>("proj", w.proj, span)?;
    let seqs = Seqs::read(ctx, w.seqs, w.rows, w.num_seqs, w.num_slots, true)?;
    for s in 0..seqs.len() {
        let (Some(sl), range) = (seqs.slot(s), seqs.rows(s)) else {
            continue;
        };
        let n = range.len();
        let window = &mut state[sl * stride..sl * stride + hist * cd];
        // Ascending `i` reads old row `i + n` before any write reaches it.
        for i in 0..hist {
            let u = (n + i) as isize - hist as isize;
            for c in 0..cd {
                window[i * cd + c] = if u >= 0 {
                    f(proj[(range.start + u as usize) * pw + c])
                } else {
                    window[(i + n) * cd + c]
                };
            }
        }
    }
    Ok(())
}

/// Read and check `row_slot`, u32 `[rows]`, of a verify step: each entry is
/// `NO_SLOT` (keep nothing) or a slot of the pool; no slot is written by two rows; and a row never
/// writes the slot another sequence of the step reads (its own sequence's slot is allowed: every
/// work unit reads its input state before it writes any row's).
pub(crate) fn read_row_slots<'a>(
    ctx: &'a KernelCtx<'a>,
    row_slot: DevicePtr,
    rows: usize,
    seqs: &Seqs<'_>,
    num_slots: usize,
) -> GpuResult<&'a [u32]> {
    let row_slot = ctx.slice::<u32>("row_slot", row_slot, rows)?;
    let mut written: Vec<(u32, usize)> = Vec::new();
    for s in 0..seqs.len() {
        for r in seqs.rows(s) {
            let sl = row_slot[r];
            if sl == NO_SLOT {
                continue;
            }
            if sl as usize >= num_slots {
                return Err(ctx.fail(format!(
                    "row {r}: row slot {sl} is past the {num_slots} state slots"
                )));
            }
            written.push((sl, s));
        }
    }
    written.sort_unstable();
    if let Some(w) = written.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(ctx.fail(format!(
            "two rows of the step keep their state in slot {}",
            w[0].0
        )));
    }
    for &(sl, s) in &written {
        if let Some(other) = (0..seqs.len()).find(|&o| o != s && seqs.slot(o) == Some(sl as usize))
        {
            return Err(ctx.fail(format!(
                "a row of sequence {s} keeps its state in slot {sl}, which sequence {other} reads"
            )));
        }
    }
    Ok(row_slot)
}

/// `conv_state_verify` ([`ConvStateVerifyParams`]).
///
/// The conv window after each row of a verify step (speculative decoding), kept for rollback:
/// for row `t` of a sequence with `row_slot[first + t] != NO_SLOT`, that slot's window becomes
/// the last `K - 1` inputs of (the window of `seq_slot` ++ the sequence's rows `0..=t`), i.e.
/// `new[i] = x(t + 1 - (K-1) + i)` with `x` as in `causal_conv1d` — what `conv_state_update`
/// leaves after a step of rows `0..=t`. The sequence's own slot is only read (unless a row names
/// it). Work unit: one (sequence, channel), reading the old window before writing any row's.
/// Run after `causal_conv1d`.
pub fn conv_state_verify(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: ConvStateVerifyParams = ctx.params()?;
    let w = windows_of!(p);
    let (h, hist) = w.check(ctx)?;
    let (cd, pw, stride, rows) = (h.conv_dim(), w.proj_stride, w.stride, w.rows);
    let state = ctx.slice_mut::<f32>("conv_state", w.conv_state, w.num_slots * stride)?;
    let span = proj_span(ctx, ("proj_stride", pw, cd), 0, rows)?;
    let proj = ctx.slice::<bf16>("proj", w.proj, span)?;
    let seqs = Seqs::read(ctx, w.seqs, rows, w.num_seqs, w.num_slots, false)?;
    let row_slot = read_row_slots(ctx, p.row_slot, rows, &seqs, w.num_slots)?;
    let mut old = vec![0.0f32; hist * cd];
    for s in 0..seqs.len() {
        let range = seqs.rows(s);
        match seqs.slot(s) {
            Some(sl) => old.copy_from_slice(&state[sl * stride..sl * stride + hist * cd]),
            None => old.fill(0.0),
        }
        for (t, r) in range.clone().enumerate() {
            let Some(dst) = (row_slot[r] != NO_SLOT).then_some(row_slot[r] as usize) else {
                continue;
            };
            let window = &mut state[dst * stride..dst * stride + hist * cd];
            for i in 0..hist {
                let u = (t + 1 + i) as isize - hist as isize;
                for c in 0..cd {
                    window[i * cd + c] = if u >= 0 {
                        f(proj[(range.start + u as usize) * pw + c])
                    } else {
                        old[(hist as isize + u) as usize * cd + c]
                    };
                }
            }
        }
    }
    Ok(())
}

/// `softplus(x) = ln(1 + e^x)`, linear above 20 as `torch.nn.functional.softplus`.
#[inline]
pub(crate) fn softplus(x: f32) -> f32 {
    if x > 20.0 { x } else { x.exp().ln_1p() }
}

/// `gdn_prepare` ([`GdnPrepareParams`]).
///
/// Per row and key head: `q̂ = q * rsqrt(Σq² + l2_eps) * q_scale`, `k̂ = k * rsqrt(Σk² + l2_eps)`
/// (transformers' `l2norm`, eps 1e-6; `q_scale = 1/√Dk`), from the conv output. Per row and
/// value head `j`: `β = sigmoid(b_j)`, `g = -exp(a_log[j]) * softplus(a_j + dt_bias[j])`, with
/// `b`, `a` read from the projection at `ba_offset + r * ba_stride`. All in f32.
pub fn gdn_prepare(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: GdnPrepareParams = ctx.params()?;
    let rows = p.rows as usize;
    let h = Heads::new(ctx, (p.hk, p.dk, p.hv, p.dv))?;
    let (eps, q_scale) = (p.l2_eps, p.q_scale);
    let (kd, cd, hv) = (h.key_dim(), h.conv_dim(), h.hv);
    let (ba_at, ba_stride) = (p.ba_offset as usize, p.ba_stride as usize);
    let qk = ctx.slice_mut::<f32>("qk", p.qk, rows * 2 * kd)?;
    let gates = ctx.slice_mut::<f32>("gates", p.gates, rows * 2 * hv)?;
    let conv = ctx.slice::<bf16>("conv", p.conv, rows * cd)?;
    let span = proj_span(ctx, ("ba_stride", ba_stride, 2 * hv), ba_at, rows)?;
    let proj = ctx.slice::<bf16>("proj", p.proj, span)?;
    let a_log = ctx.slice::<f32>("a_log", p.a_log, hv)?;
    let dt_bias = ctx.slice::<f32>("dt_bias", p.dt_bias, hv)?;
    for r in 0..rows {
        let src = &conv[r * cd..r * cd + 2 * kd];
        let dst = &mut qk[r * 2 * kd..(r + 1) * 2 * kd];
        for head in 0..2 * h.hk {
            let x = &src[head * h.dk..(head + 1) * h.dk];
            let mut sum = 0.0f32;
            for &e in x {
                sum += f(e) * f(e);
            }
            let inv = 1.0 / (sum + eps).sqrt();
            let scale = if head < h.hk { q_scale } else { 1.0 };
            for (o, &e) in dst[head * h.dk..(head + 1) * h.dk].iter_mut().zip(x) {
                *o = f(e) * inv * scale;
            }
        }
        let ba = &proj[ba_at + r * ba_stride..ba_at + r * ba_stride + 2 * hv];
        for j in 0..hv {
            let (bj, aj) = (f(ba[j]), f(ba[hv + j]));
            gates[r * 2 * hv + j] = sigmoid(bj);
            gates[r * 2 * hv + hv + j] = -a_log[j].exp() * softplus(aj + dt_bias[j]);
        }
    }
    Ok(())
}

/// `gated_rms_norm` ([`GatedRmsNormParams`]).
///
/// Per row and value head: `out = core * rsqrt(mean(core²) + eps) * weight * silu(z)`, with the
/// plain weight (not `1 + w`) and `z` read from the projection at `r * proj_stride + conv_dim +
/// j*Dv`; f32
/// throughout, bf16 out.
pub fn gated_rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: GatedRmsNormParams = ctx.params()?;
    let rows = p.rows as usize;
    let h = Heads::new(ctx, (p.hk, p.dk, p.hv, p.dv))?;
    let eps = p.eps;
    let (vd, pw, z_at, dv) = (h.value_dim(), p.proj_stride as usize, h.conv_dim(), h.dv);
    let out = ctx.slice_mut::<bf16>("out", p.out, rows * vd)?;
    let core = ctx.slice::<f32>("core", p.core, rows * vd)?;
    let span = proj_span(ctx, ("proj_stride", pw, z_at + vd), 0, rows)?;
    let proj = ctx.slice::<bf16>("proj", p.proj, span)?;
    let weight = ctx.slice::<bf16>("weight", p.weight, dv)?;
    for r in 0..rows {
        for j in 0..h.hv {
            let at = r * vd + j * dv;
            let o = &core[at..at + dv];
            let z = &proj[r * pw + z_at + j * dv..r * pw + z_at + (j + 1) * dv];
            let inv = rms_scale(o.iter().copied(), dv, eps);
            for i in 0..dv {
                out[at + i] = b(o[i] * inv * f(weight[i]) * silu(f(z[i])));
            }
        }
    }
    Ok(())
}

/// `gated_delta_streamed` ([`GatedDeltaParams`]): `gated_delta_recurrent`'s outputs and
/// states, bitwise (the CUDA kernel streams each head's state through shared memory in
/// persistent blocks; the arithmetic is the same).
pub fn gated_delta_streamed(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let _: GatedDeltaParams = ctx.params()?;
    gated_delta_recurrent(ctx)
}
