//! Tests of the gated delta rule kernels: each against an f64 token-by-token recurrence
//! (sequences of one-row chunks among them), and the bitwise properties the engine relies on
//! (batch invariance, prefills split at chunk boundaries, padding sequences).

use half::bf16;
use metrale_kernel_abi::{GatedDeltaChunkedParams, GatedDeltaParams, GatedDeltaVerifyParams};
use metrale_testkit::Rng;

use super::{H, NO_SLOT, Rig, assert_close};
use crate::error::GpuResult;

const CHUNK: usize = 64;

/// One sequence's inputs to the rule.
pub(crate) struct Seq {
    pub slot: u32,
    pub pos0: u32,
    pub n: usize,
    /// f32 `[n, 2*kd]`: normalised q (scaled) and k.
    pub qk: Vec<f32>,
    /// bf16 `[n, vd]`.
    pub v: Vec<bf16>,
    /// f32 `[n, 2*hv]`: β then g.
    pub gates: Vec<f32>,
}

pub(crate) fn gen_seq(d: &mut Rng, h: H, n: usize, slot: u32, pos0: u32) -> Seq {
    let mut qk = Vec::with_capacity(n * 2 * h.kd());
    let mut gates = Vec::with_capacity(n * 2 * h.hv);
    for _ in 0..n {
        for head in 0..2 * h.hk {
            let x = d.f32s(h.dk, -1.0, 1.0);
            let norm = x.iter().map(|v| v * v).sum::<f32>().sqrt();
            let sc = if head < h.hk {
                1.0 / (h.dk as f32).sqrt()
            } else {
                1.0
            };
            qk.extend(x.iter().map(|v| v / norm * sc));
        }
        gates.extend((0..h.hv).map(|_| 1.0 / (1.0 + (-3.0 * d.uniform(-1.0, 1.0)).exp())));
        gates.extend((0..h.hv).map(|_| -(2.0 * d.uniform(-1.0, 1.0) - 1.5).exp()));
    }
    Seq {
        slot,
        pos0,
        n,
        qk,
        v: d.bf16s(n * h.vd(), -1.0, 1.0),
        gates,
    }
}

/// The pool geometry of a launch.
#[derive(Clone, Copy)]
pub(crate) struct Pool {
    pub num_slots: usize,
    pub stride: usize,
}

/// Run `kernel` over `seqs` as one step from `state`; returns the output and the new state.
pub(crate) fn launch(
    r: &Rig,
    h: H,
    kernel: &str,
    seqs: &[&Seq],
    state: &[f32],
    pool: Pool,
) -> GpuResult<(Vec<f32>, Vec<f32>)> {
    launch_with(r, h, kernel, seqs, state, pool, None)
}

/// `launch`, passing `row_slot` (`gated_delta_verify`) after `seq_slot`.
pub(crate) fn launch_with(
    r: &Rig,
    h: H,
    kernel: &str,
    seqs: &[&Seq],
    state: &[f32],
    pool: Pool,
    row_slot: Option<&[u32]>,
) -> GpuResult<(Vec<f32>, Vec<f32>)> {
    let rows: usize = seqs.iter().map(|s| s.n).sum();
    let (kd, cd, vd) = (h.kd(), h.cd(), h.vd());
    let mut qk = Vec::new();
    let mut conv = Vec::new();
    let mut gates = Vec::new();
    let mut start = vec![0u32];
    let mut slots = Vec::new();
    let mut positions = Vec::new();
    for s in seqs {
        qk.extend_from_slice(&s.qk);
        gates.extend_from_slice(&s.gates);
        for t in 0..s.n {
            conv.extend(std::iter::repeat_n(bf16::from_f32(0.5), 2 * kd));
            conv.extend_from_slice(&s.v[t * vd..(t + 1) * vd]);
            positions.push(s.pos0 + t as u32);
        }
        start.push(start[start.len() - 1] + s.n as u32);
        slots.push(s.slot);
    }
    let out = r.out(rows * vd * 4);
    let sp = r.put(state);
    let (hk, dk, hv, dv) = h.u32s();
    let p = GatedDeltaParams {
        out,
        state: sp,
        qk: r.put(&qk),
        conv: r.put(&conv),
        gates: r.put(&gates),
        seq_start: r.put(&start),
        seq_slot: r.put(&slots),
        rows: rows as u32,
        num_seqs: seqs.len() as u32,
        num_slots: pool.num_slots as u32,
        slot_stride: pool.stride as u32,
        hk,
        dk,
        hv,
        dv,
    };
    debug_assert_eq!(cd, 2 * kd + vd);
    match (kernel, row_slot) {
        ("gated_delta_chunked", _) => {
            let c = GatedDeltaChunkedParams {
                out: p.out,
                state: p.state,
                qk: p.qk,
                conv: p.conv,
                gates: p.gates,
                seq_start: p.seq_start,
                seq_slot: p.seq_slot,
                positions: r.put(&positions),
                rows: p.rows,
                num_seqs: p.num_seqs,
                num_slots: p.num_slots,
                slot_stride: p.slot_stride,
                hk,
                dk,
                hv,
                dv,
                chunk_size: CHUNK as u32,
            };
            r.run("gdn", kernel, &c)?;
        }
        (_, Some(rs)) => {
            let v = GatedDeltaVerifyParams {
                out: p.out,
                state: p.state,
                qk: p.qk,
                conv: p.conv,
                gates: p.gates,
                seq_start: p.seq_start,
                seq_slot: p.seq_slot,
                row_slot: r.put(rs),
                rows: p.rows,
                num_seqs: p.num_seqs,
                num_slots: p.num_slots,
                slot_stride: p.slot_stride,
                hk,
                dk,
                hv,
                dv,
            };
            r.run("gdn", kernel, &v)?;
        }
        _ => r.run("gdn", kernel, &p)?,
    }
    Ok((
        r.f32s(out, rows * vd),
        r.f32s(sp, pool.num_slots * pool.stride),
    ))
}

/// The f64 recurrence over one sequence from `state` (its slot's `[hv, dk, dv]`, or zeros).
pub(crate) fn reference(h: H, s: &Seq, state: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let (kd, vd, dk, dv) = (h.kd(), h.vd(), h.dk, h.dv);
    let mut st: Vec<f64> = state.iter().map(|&x| x as f64).collect();
    let mut out = vec![0.0f64; s.n * vd];
    for t in 0..s.n {
        for j in 0..h.hv {
            let kh = j / (h.hv / h.hk);
            let q = &s.qk[t * 2 * kd + kh * dk..][..dk];
            let k = &s.qk[t * 2 * kd + kd + kh * dk..][..dk];
            let v = &s.v[t * vd + j * dv..][..dv];
            let beta = s.gates[t * 2 * h.hv + j] as f64;
            let g = s.gates[t * 2 * h.hv + h.hv + j] as f64;
            let sj = &mut st[j * dk * dv..(j + 1) * dk * dv];
            sj.iter_mut().for_each(|e| *e *= g.exp());
            for d in 0..dv {
                let kv: f64 = (0..dk).map(|c| sj[c * dv + d] * k[c] as f64).sum();
                let delta = (v[d].to_f64() - kv) * beta;
                for c in 0..dk {
                    sj[c * dv + d] += k[c] as f64 * delta;
                }
            }
            for d in 0..dv {
                out[t * vd + j * dv + d] = (0..dk).map(|c| sj[c * dv + d] * q[c] as f64).sum();
            }
        }
    }
    (out, st)
}

fn slot_state(state: &[f32], pool: Pool, per_slot: usize, slot: u32) -> Vec<f32> {
    if slot == NO_SLOT {
        return vec![0.0; per_slot];
    }
    let at = slot as usize * pool.stride;
    state[at..at + per_slot].to_vec()
}

/// The root mean square of `v`: the scale relative errors are measured against.
pub(crate) fn rms(v: &[f64]) -> f64 {
    (v.iter().map(|x| x * x).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

pub(crate) const HEADS: H = H {
    hk: 2,
    dk: 16,
    hv: 4,
    dv: 8,
};

#[test]
fn chunked_and_recurrent_equal_the_f64_recurrence_over_many_lengths() {
    let r = Rig::new();
    let mut d = Rng::new(53);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: 10,
        stride: per_slot + 5,
    };
    // Lengths around the chunk size; starts aligned and not; two rows straddling a chunk
    // boundary and a row at one (one-row chunks); a padding sequence among them.
    let spec = [
        (1usize, 4u32, 17u32),
        (63, 0, 0),
        (64, 2, 64),
        (65, 5, 5),
        (130, 1, 0),
        (200, 3, 128),
        (2, 6, 63),
        (1, 7, 64),
        (7, NO_SLOT, 0),
    ];
    let seqs: Vec<Seq> = spec
        .iter()
        .map(|&(n, slot, pos)| gen_seq(&mut d, h, n, slot, pos))
        .collect();
    let refs: Vec<&Seq> = seqs.iter().collect();
    let state0 = d.f32s(pool.num_slots * pool.stride, -0.5, 0.5);
    for kernel in [
        "gated_delta_recurrent",
        "gated_delta_streamed",
        "gated_delta_chunked",
    ] {
        let (out, state) = launch(&r, h, kernel, &refs, &state0, pool).unwrap();
        let mut row = 0;
        for s in &seqs {
            let (want_o, want_s) = reference(h, s, &slot_state(&state0, pool, per_slot, s.slot));
            let got_o: Vec<f64> = out[row * h.vd()..(row + s.n) * h.vd()]
                .iter()
                .map(|&x| x as f64)
                .collect();
            let what = format!("{kernel} out, {} rows from position {}", s.n, s.pos0);
            assert_close(&got_o, &want_o, 1e-4, rms(&want_o), &what);
            if s.slot != NO_SLOT {
                let got_s: Vec<f64> = slot_state(&state, pool, per_slot, s.slot)
                    .iter()
                    .map(|&x| x as f64)
                    .collect();
                let what = format!("{kernel} state, {} rows", s.n);
                assert_close(&got_s, &want_s, 1e-4, rms(&want_s), &what);
            }
            row += s.n;
        }
        // Slots no sequence holds (8, 9) and slot padding past each state stay untouched.
        let untouched = (0..pool.num_slots).all(|sl| {
            let from = if sl >= 8 { 0 } else { per_slot };
            let at = sl * pool.stride;
            bits(&state[at + from..at + pool.stride]) == bits(&state0[at + from..at + pool.stride])
        });
        assert!(untouched, "{kernel} wrote outside the step's slots");
    }
}

#[test]
fn a_sequence_computes_the_same_bits_alone_or_in_a_batch() {
    let r = Rig::new();
    let mut d = Rng::new(59);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: 4,
        stride: per_slot,
    };
    let state0 = d.f32s(pool.num_slots * pool.stride, -0.5, 0.5);
    for (kernel, lens) in [
        ("gated_delta_recurrent", [1usize, 1, 1]),
        ("gated_delta_recurrent", [3, 1, 2]),
        ("gated_delta_chunked", [70, 1, 9]),
    ] {
        let seqs: Vec<Seq> = lens
            .iter()
            .enumerate()
            .map(|(i, &n)| gen_seq(&mut d, h, n, [2, 0, 3][i], [30, 63, 0][i]))
            .collect();
        let all: Vec<&Seq> = seqs.iter().collect();
        let (out, state) = launch(&r, h, kernel, &all, &state0, pool).unwrap();
        let mut row = 0;
        for s in &seqs {
            let (o1, s1) = launch(&r, h, kernel, &[s], &state0, pool).unwrap();
            let vd = h.vd();
            assert_eq!(
                bits(&out[row * vd..(row + s.n) * vd]),
                bits(&o1),
                "{kernel}: output of a {}-row sequence depends on its batch",
                s.n
            );
            let at = s.slot as usize * pool.stride;
            assert_eq!(
                bits(&state[at..at + per_slot]),
                bits(&s1[at..at + per_slot])
            );
            row += s.n;
        }
    }
}

#[test]
fn a_prefill_split_at_a_chunk_boundary_equals_the_unsplit_one_bitwise() {
    let r = Rig::new();
    let mut d = Rng::new(67);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: 1,
        stride: per_slot,
    };
    let state0 = d.f32s(per_slot, -0.5, 0.5);
    let whole = gen_seq(&mut d, h, 130, 0, 0);
    let (out, state) = launch(&r, h, "gated_delta_chunked", &[&whole], &state0, pool).unwrap();
    let part = |from: usize, to: usize| Seq {
        slot: 0,
        pos0: from as u32,
        n: to - from,
        qk: whole.qk[from * 2 * h.kd()..to * 2 * h.kd()].to_vec(),
        v: whole.v[from * h.vd()..to * h.vd()].to_vec(),
        gates: whole.gates[from * 2 * h.hv..to * 2 * h.hv].to_vec(),
    };
    let (o1, s1) = launch(&r, h, "gated_delta_chunked", &[&part(0, 64)], &state0, pool).unwrap();
    let (o2, s2) = launch(&r, h, "gated_delta_chunked", &[&part(64, 130)], &s1, pool).unwrap();
    let split: Vec<f32> = o1.into_iter().chain(o2).collect();
    assert_eq!(bits(&out), bits(&split));
    assert_eq!(bits(&state), bits(&s2));
}

#[test]
fn the_rule_kernels_refuse_inconsistent_steps() {
    let r = Rig::new();
    let mut d = Rng::new(71);
    let h = HEADS;
    let per_slot = h.hv * h.dk * h.dv;
    let pool = Pool {
        num_slots: 2,
        stride: per_slot,
    };
    let state0 = d.f32s(2 * per_slot, -0.5, 0.5);
    let (a, b) = (gen_seq(&mut d, h, 2, 1, 0), gen_seq(&mut d, h, 1, 1, 0));
    for kernel in ["gated_delta_recurrent", "gated_delta_chunked"] {
        assert!(
            launch(&r, h, kernel, &[&a, &b], &state0, pool).is_err(),
            "shared slot"
        );
        let far = gen_seq(&mut d, h, 1, 2, 0);
        assert!(
            launch(&r, h, kernel, &[&far], &state0, pool).is_err(),
            "slot past the pool"
        );
    }
    let small = Pool {
        num_slots: 2,
        stride: per_slot - 1,
    };
    assert!(launch(&r, h, "gated_delta_chunked", &[&a], &state0, small).is_err());
}
