//! Tests of the verify kernels of speculative decoding (`conv_state_verify`,
//! `gated_delta_verify`): each row's output and the state kept in its row slot are, within f32
//! rounding, what the f64 recurrence (the window formula) gives after that row, slots no row
//! names keep their bits, and inconsistent row slots are refused. (That a verify row is the
//! decode step bitwise is the CUDA kernels' property, checked on the GPU.)

use metrale_kernel_abi::{ConvStateUpdateParams, ConvStateVerifyParams};
use metrale_testkit::Rng;

use super::rule::{HEADS, Pool, Seq, bits, gen_seq, launch_with, reference, rms};
use super::{H, NO_SLOT, Rig, assert_close};

/// One sequence of a verify step: its rows, its slot, the slot each row keeps its state in.
struct VerifySeq {
    n: usize,
    slot: u32,
    row_slots: Vec<u32>,
}

/// A step mixing a four-row verify (its last row kept in the sequence's own slot), a one-row
/// one, a padding sequence that keeps two of its rows, a sequence without rows and a two-row
/// verify that keeps only its last row. Slots 2 (no rows), 11 (nobody's) and the input slots
/// 1 and 3 (not named by their rows) must keep their bits.
fn mixed() -> Vec<VerifySeq> {
    vec![
        VerifySeq {
            n: 4,
            slot: 0,
            row_slots: vec![4, 5, 6, 0],
        },
        VerifySeq {
            n: 1,
            slot: 1,
            row_slots: vec![7],
        },
        VerifySeq {
            n: 3,
            slot: NO_SLOT,
            row_slots: vec![8, NO_SLOT, 9],
        },
        VerifySeq {
            n: 0,
            slot: 2,
            row_slots: vec![],
        },
        VerifySeq {
            n: 2,
            slot: 3,
            row_slots: vec![NO_SLOT, 10],
        },
    ]
}

const NUM_SLOTS: usize = 12;

fn row_slots(seqs: &[VerifySeq]) -> Vec<u32> {
    seqs.iter().flat_map(|s| s.row_slots.clone()).collect()
}

/// The slots a verify step of `seqs` may write.
fn written(seqs: &[VerifySeq]) -> Vec<u32> {
    row_slots(seqs)
        .into_iter()
        .filter(|&s| s != NO_SLOT)
        .collect()
}

/// Rows `0..=t` of `s` as a sequence of their own.
fn prefix(s: &Seq, h: H, t: usize) -> Seq {
    Seq {
        slot: s.slot,
        pos0: s.pos0,
        n: t + 1,
        qk: s.qk[..(t + 1) * 2 * h.kd()].to_vec(),
        v: s.v[..(t + 1) * h.vd()].to_vec(),
        gates: s.gates[..(t + 1) * 2 * h.hv].to_vec(),
    }
}

#[test]
fn gated_delta_verify_rows_and_kept_states_are_the_recurrence_after_each_row() {
    let r = Rig::new();
    let mut d = Rng::new(83);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: NUM_SLOTS,
        stride: per_slot + 3,
    };
    let spec = mixed();
    let seqs: Vec<Seq> = spec
        .iter()
        .enumerate()
        .map(|(i, v)| gen_seq(&mut d, h, v.n, v.slot, 20 + 7 * i as u32))
        .collect();
    let all: Vec<&Seq> = seqs.iter().collect();
    let state0 = d.f32s(NUM_SLOTS * pool.stride, -0.5, 0.5);
    let rs = row_slots(&spec);
    let (out, state) =
        launch_with(&r, h, "gated_delta_verify", &all, &state0, pool, Some(&rs)).unwrap();

    let vd = h.vd();
    let mut row = 0;
    for (s, v) in seqs.iter().zip(&spec) {
        let from: Vec<f32> = match v.slot {
            NO_SLOT => vec![0.0; per_slot],
            sl => state0[sl as usize * pool.stride..][..per_slot].to_vec(),
        };
        let (want_out, _) = reference(h, s, &from);
        let got: Vec<f64> = out[row * vd..(row + s.n) * vd]
            .iter()
            .map(|&x| x as f64)
            .collect();
        let what = format!("the outputs of a {}-row verify", s.n);
        assert_close(&got, &want_out, 1e-4, rms(&want_out), &what);
        for t in 0..s.n {
            let keep = v.row_slots[t];
            if keep == NO_SLOT {
                continue;
            }
            let (_, want_state) = reference(h, &prefix(s, h, t), &from);
            let got: Vec<f64> = state[keep as usize * pool.stride..][..per_slot]
                .iter()
                .map(|&x| x as f64)
                .collect();
            let what = format!("the state kept after row {t} of a {}-row verify", s.n);
            assert_close(&got, &want_state, 1e-4, rms(&want_state), &what);
        }
        row += s.n;
    }
    let kept = written(&spec);
    for sl in 0..NUM_SLOTS as u32 {
        let at = sl as usize * pool.stride;
        let from = if kept.contains(&sl) { per_slot } else { 0 };
        assert_eq!(
            bits(&state[at + from..at + pool.stride]),
            bits(&state0[at + from..at + pool.stride]),
            "slot {sl}: bits outside the kept states changed"
        );
    }
}

/// A conv-window step: sequences `(rows, slot)` with projection rows `proj`, from the pool
/// `state` of slots of `stride` elements.
struct ConvStep<'a> {
    h: H,
    taps: usize,
    lens: &'a [(usize, u32)],
    proj: &'a [half::bf16],
    state: &'a [f32],
    stride: usize,
}

/// `conv_state_verify` (with `row_slot`) or `conv_state_update` (without) over `c`; returns the
/// pool after it.
fn run_conv(
    r: &Rig,
    c: &ConvStep<'_>,
    row_slot: Option<&[u32]>,
) -> crate::error::GpuResult<Vec<f32>> {
    let ConvStep {
        h,
        taps,
        lens,
        proj,
        state,
        stride,
    } = *c;
    let rows: usize = lens.iter().map(|l| l.0).sum();
    let mut start = vec![0u32];
    for (s, l) in lens.iter().enumerate() {
        start.push(start[s] + l.0 as u32);
    }
    let slots: Vec<u32> = lens.iter().map(|l| l.1).collect();
    let sp = r.put(state);
    let (hk, dk, hv, dv) = h.u32s();
    let update = ConvStateUpdateParams {
        conv_state: sp,
        proj: r.put(proj),
        seq_start: r.put(&start),
        seq_slot: r.put(&slots),
        rows: rows as u32,
        num_seqs: lens.len() as u32,
        num_slots: NUM_SLOTS as u32,
        slot_stride: stride as u32,
        hk,
        dk,
        hv,
        dv,
        kernel_size: taps as u32,
        proj_stride: h.pw() as u32,
    };
    match row_slot {
        Some(rs) => {
            let p = ConvStateVerifyParams {
                conv_state: update.conv_state,
                proj: update.proj,
                seq_start: update.seq_start,
                seq_slot: update.seq_slot,
                row_slot: r.put(rs),
                rows: update.rows,
                num_seqs: update.num_seqs,
                num_slots: update.num_slots,
                slot_stride: update.slot_stride,
                hk,
                dk,
                hv,
                dv,
                kernel_size: update.kernel_size,
                proj_stride: update.proj_stride,
            };
            r.run("gdn", "conv_state_verify", &p)?;
        }
        None => r.run("gdn", "conv_state_update", &update)?,
    }
    Ok(r.f32s(sp, NUM_SLOTS * stride))
}

#[test]
fn conv_state_verify_keeps_the_last_inputs_after_each_row() {
    let r = Rig::new();
    let mut d = Rng::new(89);
    let h = H {
        hk: 2,
        dk: 4,
        hv: 4,
        dv: 3,
    };
    let (cd, pw) = (h.cd(), h.pw());
    for taps in [4usize, 2] {
        let hist = taps - 1;
        let stride = hist * cd + 5;
        let spec = mixed();
        let lens: Vec<(usize, u32)> = spec.iter().map(|v| (v.n, v.slot)).collect();
        let rows: usize = lens.iter().map(|l| l.0).sum();
        let proj = d.bf16s(rows * pw, -1.5, 1.5);
        let state0 = d.f32s(NUM_SLOTS * stride, -1.0, 1.0);
        let rs = row_slots(&spec);
        let step = ConvStep {
            h,
            taps,
            lens: &lens,
            proj: &proj,
            state: &state0,
            stride,
        };
        let state = run_conv(&r, &step, Some(&rs)).unwrap();
        let mut first = 0;
        for v in &spec {
            // The inputs of the sequence: its window (zeros for padding), then its rows.
            let input = |u: usize, c: usize| -> f32 {
                if u < hist {
                    match v.slot {
                        NO_SLOT => 0.0,
                        sl => state0[sl as usize * stride + u * cd + c],
                    }
                } else {
                    proj[(first + u - hist) * pw + c].to_f32()
                }
            };
            for t in 0..v.n {
                let keep = v.row_slots[t];
                if keep == NO_SLOT {
                    continue;
                }
                // After row t: inputs t + 1 .. t + hist of the sequence.
                let want: Vec<u32> = (0..hist)
                    .flat_map(|i| (0..cd).map(move |c| (i, c)))
                    .map(|(i, c)| input(t + 1 + i, c).to_bits())
                    .collect();
                let a = keep as usize * stride;
                assert_eq!(
                    bits(&state[a..a + hist * cd]),
                    want,
                    "K={taps}: the window kept after row {t} of a {}-row verify",
                    v.n
                );
            }
            first += v.n;
        }
        let kept = written(&spec);
        for sl in 0..NUM_SLOTS as u32 {
            let at = sl as usize * stride;
            let from = if kept.contains(&sl) { hist * cd } else { 0 };
            assert_eq!(
                bits(&state[at + from..at + stride]),
                bits(&state0[at + from..at + stride]),
                "K={taps}, slot {sl}: bits outside the kept windows changed"
            );
        }
    }
}

#[test]
fn the_verify_kernels_refuse_row_slots_that_collide() {
    let r = Rig::new();
    let mut d = Rng::new(97);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: 4,
        stride: per_slot,
    };
    let state0 = d.f32s(4 * per_slot, -0.5, 0.5);
    let (a, b) = (gen_seq(&mut d, h, 2, 0, 5), gen_seq(&mut d, h, 1, 1, 9));
    let conv_h = H {
        hk: 1,
        dk: 4,
        hv: 1,
        dv: 4,
    };
    let conv_stride = 3 * conv_h.cd();
    let conv_state = d.f32s(NUM_SLOTS * conv_stride, -1.0, 1.0);
    let proj = d.bf16s(3 * conv_h.pw(), -1.0, 1.0);
    for (rs, why) in [
        ([2u32, 2, 3], "two rows keep their state in one slot"),
        ([2, 1, 3], "a row writes the slot another sequence reads"),
        ([2, 3, 4], "a row slot past the pool"),
    ] {
        let got = launch_with(
            &r,
            h,
            "gated_delta_verify",
            &[&a, &b],
            &state0,
            pool,
            Some(&rs),
        );
        assert!(got.is_err(), "gated_delta_verify: {why}");
        let rs_conv = rs.map(|s| if s == 4 { NUM_SLOTS as u32 } else { s });
        let step = ConvStep {
            h: conv_h,
            taps: 4,
            lens: &[(2, 0), (1, 1)],
            proj: &proj,
            state: &conv_state,
            stride: conv_stride,
        };
        let got = run_conv(&r, &step, Some(&rs_conv));
        assert!(got.is_err(), "conv_state_verify: {why}");
    }
    // A row keeping its state in its own sequence's slot is allowed.
    let ok = launch_with(
        &r,
        h,
        "gated_delta_verify",
        &[&a, &b],
        &state0,
        pool,
        Some(&[2, 0, 1]),
    );
    assert!(ok.is_ok(), "{ok:?}");
}
