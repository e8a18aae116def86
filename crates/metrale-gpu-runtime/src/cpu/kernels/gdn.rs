//! CPU twins of `kernels/gdn.cu`: the Gated DeltaNet token mixer of the Qwen3.5 / Qwen3-Next
//! families, as in transformers' `Qwen3_5GatedDeltaNet` / `Qwen3NextGatedDeltaNet`.
//!
//! A GDN layer runs, over the step's rows: the fused input projection (`gemm::linear`), then
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
//! - Projection row, bf16 `[rows, proj_width]`: `[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv) | z (Hv*Dv) |
//!   b (Hv) | a (Hv)]`, heads in order inside each part. Columns `0..conv_dim` are the conv
//!   channels; z starts at `conv_dim`, b at `conv_dim + value_dim`, a at `conv_dim + value_dim + Hv`.
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
mod rule_tests;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod verify_tests;

use std::ops::Range;

use half::bf16;

use super::util::{b, f, rms_scale, sigmoid, silu};
use crate::cpu::KernelCtx;
use crate::error::GpuResult;
pub use delta_rule::{gated_delta_chunked, gated_delta_recurrent, gated_delta_verify};

/// The slot value of a padding sequence.
pub const NO_SLOT: u32 = u32::MAX;

/// The head shape: the `num_k_heads, k_head_dim, num_v_heads, v_head_dim` scalars.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub hk: usize,
    pub dk: usize,
    pub hv: usize,
    pub dv: usize,
}

impl Heads {
    /// Read the four head scalars starting at argument `at`.
    pub fn read(ctx: &KernelCtx<'_>, at: usize) -> GpuResult<Heads> {
        let h = Heads {
            hk: ctx.usize(at)?,
            dk: ctx.usize(at + 1)?,
            hv: ctx.usize(at + 2)?,
            dv: ctx.usize(at + 3)?,
        };
        if h.hk == 0 || h.dk == 0 || h.dv == 0 || h.hv == 0 || !h.hv.is_multiple_of(h.hk) {
            return Err(ctx.fail(format!(
                "heads Hk={} Dk={} Hv={} Dv={}: all must be positive and Hv a multiple of Hk",
                h.hk, h.dk, h.hv, h.dv
            )));
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
    pub fn proj_width(&self) -> usize {
        self.conv_dim() + self.value_dim() + 2 * self.hv
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
    /// Read and check `seq_start` (argument `start_at`) and `seq_slot` (`slot_at`). With
    /// `writes`, refuse two sequences on one slot.
    pub fn read(
        ctx: &'a KernelCtx<'a>,
        (start_at, slot_at): (usize, usize),
        rows: usize,
        num_seqs: usize,
        num_slots: usize,
        writes: bool,
    ) -> GpuResult<Seqs<'a>> {
        let start = ctx.slice::<u32>(start_at, num_seqs + 1)?;
        let slot = ctx.slice::<u32>(slot_at, num_seqs)?;
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

/// `causal_conv1d(out: bf16 [rows, conv_dim], proj: bf16 [rows, proj_width], conv_state: f32
/// [num_slots * slot_stride], weight: bf16 [conv_dim, K], row_seq: u32 [rows], seq_start: u32
/// [num_seqs + 1], seq_slot: u32 [num_seqs], rows, num_seqs, num_slots, slot_stride, num_k_heads,
/// k_head_dim, num_v_heads, v_head_dim, kernel_size)`.
///
/// For channel `c` of row `r`, `t` rows into its sequence:
/// `out[r][c] = silu(Σ_{i=0}^{K-1} weight[c][i] * x(t - (K-1) + i))`, summed in f32 in `i` order,
/// where `x(u) = proj[first + u][c]` for `u >= 0` and `conv_state[slot][K-1+u][c]` for `u < 0`
/// (zero for a padding sequence). `weight[c][K-1]` multiplies the row's own input, as
/// `nn.Conv1d` with `padding = K - 1` does. The conv state is only read.
pub fn causal_conv1d(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(16)?;
    let (rows, num_seqs, num_slots, stride) =
        (ctx.usize(7)?, ctx.usize(8)?, ctx.usize(9)?, ctx.usize(10)?);
    let h = Heads::read(ctx, 11)?;
    let taps = ctx.usize(15)?;
    if taps == 0 {
        return Err(ctx.fail("kernel_size must be positive"));
    }
    let (cd, pw, hist) = (h.conv_dim(), h.proj_width(), taps - 1);
    check_stride(ctx, stride, hist * cd)?;
    let out = ctx.slice_mut::<bf16>(0, rows * cd)?;
    let proj = ctx.slice::<bf16>(1, rows * pw)?;
    let state = ctx.slice::<f32>(2, num_slots * stride)?;
    let weight = ctx.slice::<bf16>(3, cd * taps)?;
    let row_seq = ctx.slice::<u32>(4, rows)?;
    let seqs = Seqs::read(ctx, (5, 6), rows, num_seqs, num_slots, false)?;
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

/// The scalars `conv_state_update` and `conv_state_verify` share, from argument `at` on (`rows,
/// num_seqs, num_slots, slot_stride`, the four head scalars, `kernel_size`): those four, the
/// heads and the window length `kernel_size - 1`, checked against the slot stride.
fn window_args(
    ctx: &KernelCtx<'_>,
    at: usize,
) -> GpuResult<(usize, usize, usize, usize, Heads, usize)> {
    let (rows, num_seqs, num_slots, stride) = (
        ctx.usize(at)?,
        ctx.usize(at + 1)?,
        ctx.usize(at + 2)?,
        ctx.usize(at + 3)?,
    );
    let h = Heads::read(ctx, at + 4)?;
    let taps = ctx.usize(at + 8)?;
    if taps == 0 {
        return Err(ctx.fail("kernel_size must be positive"));
    }
    check_stride(ctx, stride, (taps - 1) * h.conv_dim())?;
    Ok((rows, num_seqs, num_slots, stride, h, taps - 1))
}

/// `conv_state_update(conv_state: f32 [num_slots * slot_stride] (in/out), proj: bf16 [rows,
/// proj_width], seq_start: u32 [num_seqs + 1], seq_slot: u32 [num_seqs], rows, num_seqs,
/// num_slots, slot_stride, num_k_heads, k_head_dim, num_v_heads, v_head_dim, kernel_size)`.
///
/// Each real sequence with `n` rows keeps the last `K - 1` inputs of (old window ++ its rows'
/// conv channels): `new[i] = x(n - (K-1) + i)` with `x` as in `causal_conv1d`. A sequence with
/// no rows, or a padding one, is left alone. Run after `causal_conv1d`.
pub fn conv_state_update(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(13)?;
    let (rows, num_seqs, num_slots, stride, h, hist) = window_args(ctx, 4)?;
    let (cd, pw) = (h.conv_dim(), h.proj_width());
    let state = ctx.slice_mut::<f32>(0, num_slots * stride)?;
    let proj = ctx.slice::<bf16>(1, rows * pw)?;
    let seqs = Seqs::read(ctx, (2, 3), rows, num_seqs, num_slots, true)?;
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

/// Read and check `row_slot`, u32 `[rows]` (argument `at`) of a verify step: each entry is
/// `NO_SLOT` (keep nothing) or a slot of the pool; no slot is written by two rows; and a row never
/// writes the slot another sequence of the step reads (its own sequence's slot is allowed: every
/// work unit reads its input state before it writes any row's).
pub(crate) fn read_row_slots<'a>(
    ctx: &'a KernelCtx<'a>,
    at: usize,
    rows: usize,
    seqs: &Seqs<'_>,
    num_slots: usize,
) -> GpuResult<&'a [u32]> {
    let row_slot = ctx.slice::<u32>(at, rows)?;
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

/// `conv_state_verify(conv_state: f32 [num_slots * slot_stride] (in/out), proj: bf16 [rows,
/// proj_width], seq_start: u32 [num_seqs + 1], seq_slot: u32 [num_seqs], row_slot: u32 [rows],
/// rows, num_seqs, num_slots, slot_stride, num_k_heads, k_head_dim, num_v_heads, v_head_dim,
/// kernel_size)`.
///
/// The conv window after each row of a verify step (speculative decoding), kept for rollback:
/// for row `t` of a sequence with `row_slot[first + t] != NO_SLOT`, that slot's window becomes
/// the last `K - 1` inputs of (the window of `seq_slot` ++ the sequence's rows `0..=t`), i.e.
/// `new[i] = x(t + 1 - (K-1) + i)` with `x` as in `causal_conv1d` — what `conv_state_update`
/// leaves after a step of rows `0..=t`. The sequence's own slot is only read (unless a row names
/// it). Work unit: one (sequence, channel), reading the old window before writing any row's.
/// Run after `causal_conv1d`.
pub fn conv_state_verify(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(14)?;
    let (rows, num_seqs, num_slots, stride, h, hist) = window_args(ctx, 5)?;
    let (cd, pw) = (h.conv_dim(), h.proj_width());
    let state = ctx.slice_mut::<f32>(0, num_slots * stride)?;
    let proj = ctx.slice::<bf16>(1, rows * pw)?;
    let seqs = Seqs::read(ctx, (2, 3), rows, num_seqs, num_slots, false)?;
    let row_slot = read_row_slots(ctx, 4, rows, &seqs, num_slots)?;
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

/// `gdn_prepare(qk: f32 [rows, 2*key_dim], gates: f32 [rows, 2*Hv], conv: bf16 [rows, conv_dim],
/// proj: bf16 [rows, proj_width], a_log: f32 [Hv], dt_bias: f32 [Hv], rows, num_k_heads,
/// k_head_dim, num_v_heads, v_head_dim, l2_eps, q_scale)`.
///
/// Per row and key head: `q̂ = q * rsqrt(Σq² + l2_eps) * q_scale`, `k̂ = k * rsqrt(Σk² + l2_eps)`
/// (transformers' `l2norm`, eps 1e-6; `q_scale = 1/√Dk`), from the conv output. Per row and
/// value head `j`: `β = sigmoid(b_j)`, `g = -exp(a_log[j]) * softplus(a_j + dt_bias[j])`, with
/// `b`, `a` read from the projection row. All in f32.
pub fn gdn_prepare(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(13)?;
    let rows = ctx.usize(6)?;
    let h = Heads::read(ctx, 7)?;
    let (eps, q_scale) = (ctx.f32(11)?, ctx.f32(12)?);
    let (kd, cd, pw, hv) = (h.key_dim(), h.conv_dim(), h.proj_width(), h.hv);
    let b_at = cd + h.value_dim();
    let qk = ctx.slice_mut::<f32>(0, rows * 2 * kd)?;
    let gates = ctx.slice_mut::<f32>(1, rows * 2 * hv)?;
    let conv = ctx.slice::<bf16>(2, rows * cd)?;
    let proj = ctx.slice::<bf16>(3, rows * pw)?;
    let a_log = ctx.slice::<f32>(4, hv)?;
    let dt_bias = ctx.slice::<f32>(5, hv)?;
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
        let row = &proj[r * pw..(r + 1) * pw];
        for j in 0..hv {
            let (bj, aj) = (f(row[b_at + j]), f(row[b_at + hv + j]));
            gates[r * 2 * hv + j] = sigmoid(bj);
            gates[r * 2 * hv + hv + j] = -a_log[j].exp() * softplus(aj + dt_bias[j]);
        }
    }
    Ok(())
}

/// `gated_rms_norm(out: bf16 [rows, value_dim], core: f32 [rows, value_dim], proj: bf16 [rows,
/// proj_width], weight: bf16 [Dv], rows, num_k_heads, k_head_dim, num_v_heads, v_head_dim, eps)`.
///
/// Per row and value head: `out = core * rsqrt(mean(core²) + eps) * weight * silu(z)`, with the
/// plain weight (not `1 + w`) and `z` read from the projection row at `conv_dim + j*Dv`; f32
/// throughout, bf16 out.
pub fn gated_rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(10)?;
    let rows = ctx.usize(4)?;
    let h = Heads::read(ctx, 5)?;
    let eps = ctx.f32(9)?;
    let (vd, pw, z_at, dv) = (h.value_dim(), h.proj_width(), h.conv_dim(), h.dv);
    let out = ctx.slice_mut::<bf16>(0, rows * vd)?;
    let core = ctx.slice::<f32>(1, rows * vd)?;
    let proj = ctx.slice::<bf16>(2, rows * pw)?;
    let weight = ctx.slice::<bf16>(3, dv)?;
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

/// `gated_delta_streamed(the arguments of gated_delta_recurrent)`: `gated_delta_recurrent`'s
/// outputs and states, bitwise (the CUDA kernel streams each head's state through shared memory
/// in persistent blocks; the arithmetic is the same).
pub fn gated_delta_streamed(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    gated_delta_recurrent(ctx)
}

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "gdn",
    kernels: &[
        ("causal_conv1d", causal_conv1d),
        ("conv_state_update", conv_state_update),
        ("conv_state_verify", conv_state_verify),
        ("gdn_prepare", gdn_prepare),
        ("gated_delta_recurrent", gated_delta_recurrent),
        ("gated_delta_streamed", gated_delta_streamed),
        ("gated_delta_chunked", gated_delta_chunked),
        ("gated_delta_verify", gated_delta_verify),
        ("gated_rms_norm", gated_rms_norm),
    ],
};
