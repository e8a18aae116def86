//! Tests of the verify kernels of speculative decoding (`conv_state_verify`,
//! `gated_delta_verify`): each row's output and the state kept in its row slot are bitwise what
//! decoding the sequence's rows one step at a time gives, slots no row names keep their bits, and
//! inconsistent row slots are refused.

use super::NO_SLOT;
use super::rule_tests::{HEADS, Pool, Seq, bits, gen_seq, launch, launch_with};
use super::tests::{Data, H, Rig, u};
use crate::types::KernelArg;

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
/// A slot no sequence of `mixed` uses: the decode reference runs padding sequences there, from
/// zeros.
const SCRATCH: u32 = 11;

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

/// Row `t` of `s` as a sequence of its own, on `slot`.
fn one_row(s: &Seq, h: H, t: usize, slot: u32) -> Seq {
    Seq {
        slot,
        pos0: s.pos0 + t as u32,
        n: 1,
        qk: s.qk[t * 2 * h.kd()..(t + 1) * 2 * h.kd()].to_vec(),
        v: s.v[t * h.vd()..(t + 1) * h.vd()].to_vec(),
        gates: s.gates[t * 2 * h.hv..(t + 1) * 2 * h.hv].to_vec(),
    }
}

#[test]
fn gated_delta_verify_rows_are_decode_steps_bitwise_and_each_keeps_its_state() {
    let r = Rig::new();
    let mut d = Data(83);
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
    let mut state0 = d.vec(NUM_SLOTS * pool.stride, 0.5);
    let scratch = SCRATCH as usize * pool.stride;
    state0[scratch..scratch + per_slot].fill(0.0);
    let rs = row_slots(&spec);
    let (out, state) =
        launch_with(&r, h, "gated_delta_verify", &all, &state0, pool, Some(&rs)).unwrap();

    let vd = h.vd();
    let mut row = 0;
    for (s, v) in seqs.iter().zip(&spec) {
        // Decode the sequence one row at a time from its slot (padding: zeros in SCRATCH).
        let slot = if v.slot == NO_SLOT { SCRATCH } else { v.slot };
        let mut st = state0.clone();
        for t in 0..s.n {
            let step = one_row(s, h, t, slot);
            let (o1, s1) = launch(&r, h, "gated_delta_recurrent", &[&step], &st, pool).unwrap();
            st = s1;
            assert_eq!(
                bits(&out[(row + t) * vd..(row + t + 1) * vd]),
                bits(&o1),
                "row {t} of a {}-row verify differs from its decode step",
                s.n
            );
            let keep = v.row_slots[t];
            if keep != NO_SLOT {
                let (a, b) = (keep as usize * pool.stride, slot as usize * pool.stride);
                assert_eq!(
                    bits(&state[a..a + per_slot]),
                    bits(&st[b..b + per_slot]),
                    "the state kept after row {t} of a {}-row verify is not decode's",
                    s.n
                );
            }
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

/// `conv_state_verify` (with `row_slot`) or `conv_state_update` (without) over a step of
/// sequences `(rows, slot)` with projection rows `proj`; returns the pool after it.
#[allow(clippy::too_many_arguments)]
fn run_conv(
    r: &Rig,
    h: H,
    taps: usize,
    lens: &[(usize, u32)],
    proj: &[half::bf16],
    state: &[f32],
    stride: usize,
    row_slot: Option<&[u32]>,
) -> crate::error::GpuResult<Vec<f32>> {
    let rows: usize = lens.iter().map(|l| l.0).sum();
    let mut start = vec![0u32];
    for (s, l) in lens.iter().enumerate() {
        start.push(start[s] + l.0 as u32);
    }
    let slots: Vec<u32> = lens.iter().map(|l| l.1).collect();
    let sp = r.put(state);
    let mut args: Vec<KernelArg> = vec![
        sp.into(),
        r.put(proj).into(),
        r.put(&start).into(),
        r.put(&slots).into(),
    ];
    let kernel = match row_slot {
        Some(rs) => {
            args.push(r.put(rs).into());
            "conv_state_verify"
        }
        None => "conv_state_update",
    };
    args.extend([u(rows), u(lens.len()), u(NUM_SLOTS), u(stride)]);
    args.extend(h.args());
    args.push(u(taps));
    r.run(kernel, &args)?;
    Ok(r.f32s(sp, NUM_SLOTS * stride))
}

#[test]
fn conv_state_verify_keeps_the_window_conv_state_update_leaves_after_each_row() {
    let r = Rig::new();
    let mut d = Data(89);
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
        let proj = d.bf(rows * pw, 1.5);
        let mut state0 = d.vec(NUM_SLOTS * stride, 1.0);
        let scratch = SCRATCH as usize * stride;
        state0[scratch..scratch + hist * cd].fill(0.0);
        let rs = row_slots(&spec);
        let state = run_conv(&r, h, taps, &lens, &proj, &state0, stride, Some(&rs)).unwrap();
        let mut first = 0;
        for v in &spec {
            let slot = if v.slot == NO_SLOT { SCRATCH } else { v.slot };
            for t in 0..v.n {
                let keep = v.row_slots[t];
                if keep == NO_SLOT {
                    continue;
                }
                // The window a step of rows 0..=t alone leaves.
                let prefix = &proj[first * pw..(first + t + 1) * pw];
                let want =
                    run_conv(&r, h, taps, &[(t + 1, slot)], prefix, &state0, stride, None).unwrap();
                let (a, b) = (keep as usize * stride, slot as usize * stride);
                assert_eq!(
                    bits(&state[a..a + hist * cd]),
                    bits(&want[b..b + hist * cd]),
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
    let mut d = Data(97);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: 4,
        stride: per_slot,
    };
    let state0 = d.vec(4 * per_slot, 0.5);
    let (a, b) = (gen_seq(&mut d, h, 2, 0, 5), gen_seq(&mut d, h, 1, 1, 9));
    let conv_h = H {
        hk: 1,
        dk: 4,
        hv: 1,
        dv: 4,
    };
    let conv_stride = 3 * conv_h.cd();
    let conv_state = d.vec(NUM_SLOTS * conv_stride, 1.0);
    let proj = d.bf(3 * conv_h.pw(), 1.0);
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
        let got = run_conv(
            &r,
            conv_h,
            4,
            &[(2, 0), (1, 1)],
            &proj,
            &conv_state,
            conv_stride,
            Some(&rs_conv),
        );
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
