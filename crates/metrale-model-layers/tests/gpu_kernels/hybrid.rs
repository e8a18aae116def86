//! The hybrid families' kernels (`kernels/gdn.cu`) against their CPU twins, through the same
//! `Ops` launchers: random inputs (never zeros), outputs and states poisoned or randomised on
//! both sides first, a `Tolerance` per output, each case printing its worst error as a
//! `kernel-check` line.
//!
//! The GDN steps mix sequences of different lengths in one launch: lengths crossing the
//! 64-row chunk boundaries (63, 64, 65, 130, a sequence starting mid-chunk), a decode row at
//! position 63, a padding sequence (slot `u32::MAX`: zero state, nothing written), a sequence
//! with no rows (its state untouched), non-zero initial states, and value heads sharing key heads
//! (Hv = 2 Hk). The kernels reading the input projection run on both of its layouts: one fused
//! `[rows, proj_width]` matrix and, as a block-FP8 layer's two GEMMs write it, q|k|v|z rows then
//! b|a rows (`GdnProjLayout`). Head shapes cover the fast path of the delta rule (Dk <= 128, Dk and Dv multiples
//! of 4, with full, partial and masked warp tiles) and its general path (odd Dk, Dk > 128). The
//! delta rule's tests are in `rule.rs`, the verify kernels of speculative decoding in
//! `verify.rs`; each check takes its head shapes and steps, so `small` runs them all at the
//! sanitizer's sizes.

#[path = "rule.rs"]
mod rule;
#[path = "verify.rs"]
mod verify;

use half::bf16;
use metrale_gpu_runtime::GpuBackendExt;
use metrale_model_layers::ops_hybrid::{
    CausalConv1d, DecodeRule, GatedDelta, GatedRmsNorm, GdnHeads, GdnPrepare, GdnProjLayout,
    GdnSeqs, StatePool,
};

use super::harness::{At, Buf, Pair, Rng, S, Tolerance, compare};

/// The slot of a padding sequence.
const NO_SLOT: u32 = u32::MAX;
/// The chunk size of the hybrid families' prefill.
const CHUNK: u32 = 64;
/// State slots of every GDN case.
const NUM_SLOTS: u32 = 8;

/// The delta rule's outputs and states: f32 state carried over up to 130 rows, sums over Dk in
/// another order, and the CPU's chunked WY form against CUDA's recurrence.
const F32_RULE: Tolerance = Tolerance {
    rel: 1e-3,
    abs: 1e-4,
};

fn heads(hk: u32, dk: u32, hv: u32, dv: u32) -> GdnHeads {
    GdnHeads {
        num_k_heads: hk,
        k_head_dim: dk,
        num_v_heads: hv,
        v_head_dim: dv,
    }
}

/// The head shapes every GDN kernel runs on, with what each exercises.
pub(super) fn gdn_shapes() -> Vec<(GdnHeads, &'static str)> {
    vec![
        (heads(2, 128, 4, 128), "Qwen3.5-like, fast path, 8 tiles"),
        (heads(1, 64, 2, 48), "fast, 3 tiles, an idle warp"),
        (heads(2, 20, 4, 36), "fast, masked rows, partial tile"),
        (heads(1, 18, 2, 10), "general path (Dk % 4 != 0)"),
        (heads(1, 160, 1, 32), "general path (Dk > 128)"),
    ]
}

/// The sanitizer's head shapes: the fast path with a masked tile, the general path twice.
fn small_shapes() -> Vec<(GdnHeads, &'static str)> {
    vec![
        (heads(2, 20, 4, 36), "fast, masked rows, partial tile"),
        (heads(1, 18, 2, 10), "general path (Dk % 4 != 0)"),
        (heads(1, 160, 1, 32), "general path (Dk > 128)"),
    ]
}

/// Every check of the GDN kernels at small shapes (the sanitizer set).
pub(super) fn small(p: &Pair) {
    let rng = &mut Rng::new(1004);
    let shapes = small_shapes();
    let steps = [
        (4, StepSeqs::short(), "short"),
        (2, StepSeqs::decode(), "decode"),
    ];
    for split in [false, true] {
        conv(p, rng, &shapes, &steps, split);
        prepare(p, rng, &shapes, split);
        gated_norm(p, rng, &shapes, split);
    }
    rule::small(p, rng, &shapes);
    verify::small(p, rng, &shapes);
}

/// Where a step of `rows` rows holds the input projection: b|a apart (`split`) or fused.
fn proj_layout(h: &GdnHeads, rows: u32, split: bool) -> GdnProjLayout {
    GdnProjLayout::of_step(h, rows, split).expect("the test's rows fit")
}

/// A case's name for the layout.
fn layout_name(split: bool) -> &'static str {
    if split { ", b|a apart" } else { "" }
}

fn label(h: &GdnHeads, what: &str) -> String {
    format!(
        "Hk={} Dk={} Hv={} Dv={} {what}",
        h.num_k_heads, h.k_head_dim, h.num_v_heads, h.v_head_dim
    )
}

/// The sequences of one step: `(rows, slot, first position)` each, in row order.
#[derive(Debug, Clone)]
struct StepSeqs(Vec<(u32, u32, u32)>);

impl StepSeqs {
    /// Prefill and decode mixed: 130 rows from 0 (two full chunks and one row), 65 rows from 10
    /// (crossing 64), one decode row at 63, a padding sequence, 64 rows from 64 (one aligned
    /// chunk), a sequence with no rows, 63 rows from 1.
    fn mixed() -> StepSeqs {
        StepSeqs(vec![
            (130, 3, 0),
            (65, 0, 10),
            (1, 5, 63),
            (3, NO_SLOT, 0),
            (64, 1, 64),
            (0, 2, 7),
            (63, 6, 1),
        ])
    }

    /// Decode: one row per sequence (one of them padding, one with no rows).
    fn decode() -> StepSeqs {
        StepSeqs(vec![
            (1, 4, 99),
            (1, 0, 63),
            (1, NO_SLOT, 0),
            (0, 2, 5),
            (1, 7, 64),
            (1, 1, 0),
        ])
    }

    /// Prefill and decode at the sanitizer's sizes: 70 rows from 0 (one chunk and a part), a
    /// decode row at 63, a padding sequence, a sequence with no rows, 5 rows from 60 (crossing
    /// 64).
    fn short() -> StepSeqs {
        StepSeqs(vec![
            (70, 3, 0),
            (1, 5, 63),
            (3, NO_SLOT, 0),
            (0, 2, 7),
            (5, 6, 60),
        ])
    }

    fn rows(&self) -> u32 {
        self.0.iter().map(|s| s.0).sum()
    }

    fn upload(&self, p: &Pair) -> SeqBufs {
        let (mut row_seq, mut seq_start, mut positions) = (Vec::new(), vec![0u32], Vec::new());
        for (s, &(n, _, pos0)) in self.0.iter().enumerate() {
            row_seq.extend(std::iter::repeat_n(s as u32, n as usize));
            positions.extend(pos0..pos0 + n);
            seq_start.push(seq_start[s] + n);
        }
        let slots: Vec<u32> = self.0.iter().map(|s| s.1).collect();
        // Buffers must not be empty; a step always has at least one row here.
        SeqBufs {
            row_seq: p.upload(&row_seq),
            seq_start: p.upload(&seq_start),
            seq_slot: p.upload(&slots),
            positions: p.upload(&positions),
            rows: self.rows(),
            num_seqs: self.0.len() as u32,
        }
    }
}

/// A step's sequence buffers on both sides.
struct SeqBufs {
    row_seq: Buf,
    seq_start: Buf,
    seq_slot: Buf,
    positions: Buf,
    rows: u32,
    num_seqs: u32,
}

impl SeqBufs {
    fn at(&self, at: At<'_>) -> GdnSeqs {
        GdnSeqs {
            row_seq: at(&self.row_seq),
            seq_start: at(&self.seq_start),
            seq_slot: at(&self.seq_slot),
            positions: at(&self.positions),
            rows: self.rows,
            num_seqs: self.num_seqs,
        }
    }
}

/// Write `data` into `buf` on both sides (a state reset between runs).
fn reset<T: bytemuck::Pod>(p: &Pair, buf: &Buf, data: &[T]) {
    p.cpu.upload(buf.cpu, data, S).expect("cpu upload");
    p.gpu.upload(buf.gpu, data, S).expect("gpu upload");
}

/// Fill `buf` with 0xFF (NaN) on both sides.
fn poison(p: &Pair, buf: &Buf) {
    p.cpu
        .memset(buf.cpu, 0xFF, buf.bytes, S)
        .expect("cpu memset");
    p.gpu
        .memset(buf.gpu, 0xFF, buf.bytes, S)
        .expect("gpu memset");
}

/// `n` bf16 of a projection row layout, uniform in [-1, 1).
fn proj_values(rng: &mut Rng, rows: u32, h: &GdnHeads) -> Vec<bf16> {
    rng.bf16s((rows * h.proj_width()) as usize, -1.0, 1.0)
}

// ------------------------------------------------------------------------------------------------
// Causal conv and its window.

#[test]
fn causal_conv1d_and_conv_state_update_match_over_mixed_steps() {
    let steps = [
        (4, StepSeqs::mixed(), "mixed"),
        (4, StepSeqs::decode(), "decode"),
        (2, StepSeqs::mixed(), "mixed K=2"),
    ];
    conv(
        &Pair::new(),
        &mut Rng::new(101),
        &gdn_shapes(),
        &steps,
        false,
    );
}

#[test]
fn causal_conv1d_and_conv_state_update_match_with_the_b_and_a_rows_apart() {
    let steps = [
        (4, StepSeqs::mixed(), "mixed"),
        (4, StepSeqs::decode(), "decode"),
    ];
    conv(
        &Pair::new(),
        &mut Rng::new(111),
        &gdn_shapes(),
        &steps,
        true,
    );
}

/// `causal_conv1d` and `conv_state_update` on every head shape and `(taps, step)`, the
/// projection fused or with its b|a rows apart (`split`).
fn conv(
    p: &Pair,
    rng: &mut Rng,
    shapes: &[(GdnHeads, &str)],
    steps: &[(u32, StepSeqs, &str)],
    split: bool,
) {
    for &(h, what) in shapes {
        for (taps, seqs, step) in steps {
            let taps = *taps;
            let cd = h.conv_dim();
            let hist = taps - 1;
            // A slot stride past the window, so the padding between slots shows stray writes.
            let stride = hist * cd + 3;
            let rows = seqs.rows();
            let sq = seqs.upload(p);
            let proj = p.upload(&proj_values(rng, rows, &h));
            let weight = p.upload(&rng.bf16s((cd * taps) as usize, -0.6, 0.6));
            let state0 = rng.f32s((NUM_SLOTS * stride) as usize, -1.0, 1.0);
            let state = p.upload(&state0);
            let out = p.poisoned((rows * cd) as usize * 2);
            let params = |at: At<'_>| CausalConv1d {
                out: at(&out),
                proj: at(&proj),
                layout: proj_layout(&h, rows, split),
                conv_state: StatePool {
                    base: at(&state),
                    num_slots: NUM_SLOTS,
                    slot_stride: stride,
                },
                weight: at(&weight),
                seqs: sq.at(at),
                heads: h,
                kernel_size: taps,
            };
            let case = label(&h, &format!("{step} ({what}){}", layout_name(split)));
            p.run(|o, at| o.causal_conv1d(S, &params(at)));
            p.check_bf16("causal_conv1d", &case, &out, Tolerance::BF16);
            p.run(|o, at| o.conv_state_update(S, &params(at)));
            p.check_f32("conv_state_update", &case, &state, Tolerance::EXACT);
            let got = p.download_gpu::<f32>(&state);
            for (s, &(n, slot, _)) in seqs.0.iter().enumerate() {
                if slot != NO_SLOT && n == 0 {
                    let at = (slot * stride) as usize..((slot + 1) * stride) as usize;
                    assert!(
                        got[at.clone()] == state0[at],
                        "{case}: sequence {s} has no rows, yet its window changed"
                    );
                }
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// q̂, k̂ and the gates; the gated RMSNorm.

#[test]
fn gdn_prepare_normalises_q_and_k_and_computes_the_gates() {
    prepare(&Pair::new(), &mut Rng::new(102), &gdn_shapes(), false);
}

#[test]
fn gdn_prepare_reads_the_gates_with_the_b_and_a_rows_apart() {
    prepare(&Pair::new(), &mut Rng::new(112), &gdn_shapes(), true);
}

/// `gdn_prepare` of 7 rows on every head shape, the projection fused or with its b|a rows
/// apart (`split`).
fn prepare(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)], split: bool) {
    for &(h, what) in shapes {
        let rows = 7u32;
        let layout = proj_layout(&h, rows, split);
        let conv = p.upload(&rng.bf16s((rows * h.conv_dim()) as usize, -2.0, 2.0));
        let mut proj = proj_values(rng, rows, &h);
        // Row 2's `a` of head 0 past softplus' linear threshold (20).
        let a_at = layout.ba_offset + 2 * layout.ba_stride + h.num_v_heads;
        proj[a_at as usize] = bf16::from_f32(25.0);
        let proj = p.upload(&proj);
        let hv = h.num_v_heads as usize;
        let a_log = p.upload(&rng.f32s(hv, -1.0, 2.0));
        let dt_bias = p.upload(&rng.f32s(hv, -1.0, 1.0));
        let qk = p.poisoned((rows * 2 * h.key_dim()) as usize * 4);
        let gates = p.poisoned((rows * 2 * h.num_v_heads) as usize * 4);
        p.run(|o, at| {
            o.gdn_prepare(
                S,
                &GdnPrepare {
                    qk: at(&qk),
                    gates: at(&gates),
                    conv: at(&conv),
                    proj: at(&proj),
                    layout,
                    a_log: at(&a_log),
                    dt_bias: at(&dt_bias),
                    rows,
                    heads: h,
                    l2_eps: 1e-6,
                    q_scale: (h.k_head_dim as f32).powf(-0.5),
                },
            )
        });
        let case = label(&h, &format!("{what}{}", layout_name(split)));
        p.check_f32("gdn_prepare.qk", &case, &qk, Tolerance::F32_ELEMENTWISE);
        p.check_f32(
            "gdn_prepare.gates",
            &case,
            &gates,
            Tolerance::F32_ELEMENTWISE,
        );
    }
}

#[test]
fn gated_rms_norm_scales_each_head_and_gates_it_with_silu_z() {
    gated_norm(&Pair::new(), &mut Rng::new(103), &gdn_shapes(), false);
}

#[test]
fn gated_rms_norm_reads_z_with_the_b_and_a_rows_apart() {
    gated_norm(&Pair::new(), &mut Rng::new(113), &gdn_shapes(), true);
}

/// `gated_rms_norm` of 5 rows on every head shape, the projection fused or with its b|a rows
/// apart (`split`).
fn gated_norm(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)], split: bool) {
    for &(h, what) in shapes {
        let rows = 5u32;
        let core = p.upload(&rng.f32s((rows * h.value_dim()) as usize, -2.0, 2.0));
        let proj = p.upload(&rng.bf16s((rows * h.proj_width()) as usize, -4.0, 4.0));
        let weight = p.upload(&rng.bf16s(h.v_head_dim as usize, 0.5, 1.5));
        let out = p.poisoned((rows * h.value_dim()) as usize * 2);
        p.run(|o, at| {
            o.gated_rms_norm(
                S,
                &GatedRmsNorm {
                    out: at(&out),
                    core: at(&core),
                    proj: at(&proj),
                    layout: proj_layout(&h, rows, split),
                    weight: at(&weight),
                    rows,
                    heads: h,
                    eps: 1e-6,
                },
            )
        });
        let case = label(&h, &format!("{what}{}", layout_name(split)));
        p.check_bf16("gated_rms_norm", &case, &out, Tolerance::BF16);
    }
}
