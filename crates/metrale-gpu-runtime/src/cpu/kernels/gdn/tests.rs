//! Tests of the GDN kernels against naive f64 references written from transformers' formulas,
//! on seeded random inputs with poisoned outputs. Its helpers (`Rig`, `assert_close`) serve the
//! delta-rule tests too.

use half::bf16;
use metrale_kernel_abi::{
    CausalConv1dParams, ConvStateUpdateParams, GatedRmsNormParams, GdnPrepareParams,
};
use metrale_testkit::Rng;

use super::NO_SLOT;
use crate::cpu::test_support::{Rig, assert_close};
use crate::error::GpuError;

mod rule;
mod split;
mod verify;

/// `conv_state_update`'s parameters over the rows, state and shape of the `causal_conv1d`
/// launch `conv`.
fn state_update_of(conv: &CausalConv1dParams) -> ConvStateUpdateParams {
    ConvStateUpdateParams {
        conv_state: conv.conv_state,
        proj: conv.proj,
        seq_start: conv.seq_start,
        seq_slot: conv.seq_slot,
        rows: conv.rows,
        num_seqs: conv.num_seqs,
        num_slots: conv.num_slots,
        slot_stride: conv.slot_stride,
        hk: conv.hk,
        dk: conv.dk,
        hv: conv.hv,
        dv: conv.dv,
        kernel_size: conv.kernel_size,
        proj_stride: conv.proj_stride,
    }
}

fn f64s_bf(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// The head shape of these tests and its derived widths.
#[derive(Clone, Copy)]
pub(crate) struct H {
    pub hk: usize,
    pub dk: usize,
    pub hv: usize,
    pub dv: usize,
}

impl H {
    pub fn kd(&self) -> usize {
        self.hk * self.dk
    }
    pub fn vd(&self) -> usize {
        self.hv * self.dv
    }
    pub fn cd(&self) -> usize {
        2 * self.kd() + self.vd()
    }
    pub fn pw(&self) -> usize {
        self.cd() + self.vd() + 2 * self.hv
    }
    /// `(hk, dk, hv, dv)` as the parameter structs take them.
    pub fn u32s(&self) -> (u32, u32, u32, u32) {
        (
            self.hk as u32,
            self.dk as u32,
            self.hv as u32,
            self.dv as u32,
        )
    }
}

/// `seq_start` and `row_seq` of sequences of `lens` rows.
pub(crate) fn layout(lens: &[usize]) -> (Vec<u32>, Vec<u32>) {
    let mut start = vec![0u32];
    let mut row_seq = Vec::new();
    for (s, &n) in lens.iter().enumerate() {
        start.push(start[s] + n as u32);
        row_seq.extend(std::iter::repeat_n(s as u32, n));
    }
    (start, row_seq)
}

#[test]
fn causal_conv1d_reads_the_window_and_the_update_moves_it() {
    let r = Rig::new();
    let mut d = Rng::new(41);
    let h = H {
        hk: 2,
        dk: 4,
        hv: 4,
        dv: 3,
    };
    let (cd, pw, taps) = (h.cd(), h.pw(), 4usize);
    let hist = taps - 1;
    // A decode row, a prefill longer than the window, one shorter, an empty sequence, padding.
    let lens = [1usize, 5, 2, 0, 3];
    let slots = [3u32, 0, 5, 1, NO_SLOT];
    let (num_slots, stride) = (6usize, hist * cd + 7);
    let (start, row_seq) = layout(&lens);
    let rows = row_seq.len();
    let state0 = d.f32s(num_slots * stride, -1.0, 1.0);
    let proj = d.bf16s(rows * pw, -1.5, 1.5);
    let w = d.bf16s(cd * taps, -0.8, 0.8);
    let (pp, sp, wp) = (r.put(&proj), r.put(&state0), r.put(&w));
    let (rsp, ssp, slp) = (r.put(&row_seq), r.put(&start), r.put(&slots));
    let out = r.out(rows * cd * 2);
    let (hk, dk, hv, dv) = h.u32s();
    let conv = CausalConv1dParams {
        out,
        proj: pp,
        conv_state: sp,
        weight: wp,
        row_seq: rsp,
        seq_start: ssp,
        seq_slot: slp,
        rows: rows as u32,
        num_seqs: lens.len() as u32,
        num_slots: num_slots as u32,
        slot_stride: stride as u32,
        hk,
        dk,
        hv,
        dv,
        kernel_size: taps as u32,
        proj_stride: pw as u32,
    };
    r.run("gdn", "causal_conv1d", &conv).unwrap();

    // Reference: each sequence's inputs are its window (or zeros) followed by its rows.
    let mut want = vec![0.0f64; rows * cd];
    let mut new_state = state0.clone();
    for (s, &n) in lens.iter().enumerate() {
        let first = start[s] as usize;
        let slot = (slots[s] != NO_SLOT).then_some(slots[s] as usize);
        let x = |u: isize, c: usize| -> f64 {
            if u >= 0 {
                proj[(first + u as usize) * pw + c].to_f64()
            } else {
                slot.map_or(0.0, |sl| {
                    state0[sl * stride + (hist as isize + u) as usize * cd + c] as f64
                })
            }
        };
        for t in 0..n {
            for c in 0..cd {
                let acc: f64 = (0..taps)
                    .map(|i| {
                        w[c * taps + i].to_f64() * x(t as isize - hist as isize + i as isize, c)
                    })
                    .sum();
                want[(first + t) * cd + c] = silu(acc);
            }
        }
        if let Some(sl) = slot {
            for i in 0..hist {
                for c in 0..cd {
                    new_state[sl * stride + i * cd + c] =
                        x(n as isize - hist as isize + i as isize, c) as f32;
                }
            }
        }
    }
    assert_close(
        &f64s_bf(&r.bf(out, rows * cd)),
        &want,
        8e-3,
        1e-2,
        "causal_conv1d",
    );

    let update = state_update_of(&conv);
    r.run("gdn", "conv_state_update", &update).unwrap();
    let got = r.f32s(sp, num_slots * stride);
    let same = got
        .iter()
        .zip(&new_state)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same,
        "the window must hold exactly the last K-1 inputs; other slots untouched"
    );

    // Two sequences on one slot are refused by the state-writing kernel.
    let dup = ConvStateUpdateParams {
        seq_slot: r.put(&[3u32, 0, 3, 1, NO_SLOT]),
        ..update
    };
    assert!(matches!(
        r.run("gdn", "conv_state_update", &dup),
        Err(GpuError::KernelFailed { .. })
    ));
    // So are a slot past the pool (the CUDA kernels write their fault word for it) and a
    // sequence whose rows do not hold a row naming it.
    let past = ConvStateUpdateParams {
        seq_slot: r.put(&[3u32, 0, 6, 1, NO_SLOT]),
        ..update
    };
    assert!(r.run("gdn", "conv_state_update", &past).is_err());
    let stray = CausalConv1dParams {
        row_seq: r.put(&[1u32; 11]),
        ..conv
    };
    assert!(r.run("gdn", "causal_conv1d", &stray).is_err());
}

#[test]
fn gdn_prepare_normalises_q_k_and_computes_the_gates() {
    let r = Rig::new();
    let mut d = Rng::new(43);
    let h = H {
        hk: 2,
        dk: 8,
        hv: 4,
        dv: 4,
    };
    let (kd, cd, pw, hv, rows) = (h.kd(), h.cd(), h.pw(), h.hv, 3usize);
    let conv = d.bf16s(rows * cd, -2.0, 2.0);
    let mut proj = d.bf16s(rows * pw, -3.0, 3.0);
    // One `a` far into softplus's linear range.
    proj[pw + cd + h.vd() + hv + 1] = bf16::from_f32(30.0);
    let a_log = d.f32s(hv, -1.5, 1.5);
    let dt_bias = d.f32s(hv, -2.0, 2.0);
    let (eps, q_scale) = (1e-6f32, 1.0 / (h.dk as f32).sqrt());
    let qk = r.out(rows * 2 * kd * 4);
    let gates = r.out(rows * 2 * hv * 4);
    let (hk, dk, hv_, dv) = h.u32s();
    let p = GdnPrepareParams {
        qk,
        gates,
        conv: r.put(&conv),
        proj: r.put(&proj),
        a_log: r.put(&a_log),
        dt_bias: r.put(&dt_bias),
        rows: rows as u32,
        hk,
        dk,
        hv: hv_,
        dv,
        l2_eps: eps,
        q_scale,
        ba_offset: (cd + h.vd()) as u32,
        ba_stride: pw as u32,
    };
    r.run("gdn", "gdn_prepare", &p).unwrap();
    let mut want_qk = Vec::new();
    let mut want_g = Vec::new();
    for row in 0..rows {
        for head in 0..2 * h.hk {
            let x = &conv[row * cd + head * h.dk..row * cd + (head + 1) * h.dk];
            let ss: f64 = x.iter().map(|v| v.to_f64() * v.to_f64()).sum();
            let inv = 1.0 / (ss + eps as f64).sqrt();
            let sc = if head < h.hk { q_scale as f64 } else { 1.0 };
            want_qk.extend(x.iter().map(|v| v.to_f64() * inv * sc));
        }
        let p = &proj[row * pw..(row + 1) * pw];
        let (bs, as_) = (cd + h.vd(), cd + h.vd() + hv);
        for j in 0..hv {
            want_g.push(1.0 / (1.0 + (-p[bs + j].to_f64()).exp()));
        }
        for j in 0..hv {
            let x = p[as_ + j].to_f64() + dt_bias[j] as f64;
            let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
            want_g.push(-(a_log[j] as f64).exp() * sp);
        }
    }
    assert_close(
        &f64s(&r.f32s(qk, rows * 2 * kd)),
        &want_qk,
        1e-5,
        1e-3,
        "qk",
    );
    assert_close(
        &f64s(&r.f32s(gates, rows * 2 * hv)),
        &want_g,
        1e-5,
        1e-3,
        "gates",
    );
}

#[test]
fn gated_rms_norm_uses_the_plain_weight_and_silu_of_z() {
    let r = Rig::new();
    let mut d = Rng::new(47);
    let h = H {
        hk: 1,
        dk: 4,
        hv: 3,
        dv: 8,
    };
    let (vd, pw, rows, eps) = (h.vd(), h.pw(), 2usize, 1e-6f32);
    let core = d.f32s(rows * vd, -2.0, 2.0);
    let proj = d.bf16s(rows * pw, -2.0, 2.0);
    let w = d.bf16s(h.dv, -1.5, 1.5);
    let out = r.out(rows * vd * 2);
    let (hk, dk, hv, dv) = h.u32s();
    let p = GatedRmsNormParams {
        out,
        core: r.put(&core),
        proj: r.put(&proj),
        weight: r.put(&w),
        rows: rows as u32,
        hk,
        dk,
        hv,
        dv,
        eps,
        proj_stride: pw as u32,
    };
    r.run("gdn", "gated_rms_norm", &p).unwrap();
    let mut want = Vec::new();
    for row in 0..rows {
        for j in 0..h.hv {
            let o = &core[row * vd + j * h.dv..row * vd + (j + 1) * h.dv];
            let ms: f64 = o.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / h.dv as f64;
            let inv = 1.0 / (ms + eps as f64).sqrt();
            for i in 0..h.dv {
                let z = proj[row * pw + h.cd() + j * h.dv + i].to_f64();
                want.push(o[i] as f64 * inv * w[i].to_f64() * silu(z));
            }
        }
    }
    assert_close(
        &f64s_bf(&r.bf(out, rows * vd)),
        &want,
        8e-3,
        1e-2,
        "gated_rms_norm",
    );
}
