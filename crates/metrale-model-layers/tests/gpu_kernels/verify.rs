//! The verify kernels of speculative decoding (`conv_state_verify`, `gated_delta_verify`),
//! part of `hybrid.rs`: CUDA against the CPU twin on a step that mixes a multi-row
//! verify keeping its last row in its own slot, a one-row verify, a padding sequence keeping
//! some rows, a sequence without rows and one keeping only its last row (outputs poisoned,
//! states random first); and on CUDA alone, bitwise, every row's output and kept state equal
//! decoding the sequence one row per launch with the decode kernels.

use metrale_gpu_runtime::DevicePtr;

use super::rule::RuleCase;
use super::*;

/// Rows, own slot, first position and the slot each row keeps its state in.
type VerifySeq = (u32, u32, u32, Vec<u32>);

/// Slot 2 belongs to a sequence without rows and no row names it: it must keep its bits.
fn verify_seqs() -> Vec<VerifySeq> {
    vec![
        (3, 0, 40, vec![4, 5, 0]),
        (1, 1, 63, vec![6]),
        (2, NO_SLOT, 0, vec![7, NO_SLOT]),
        (0, 2, 9, vec![]),
        (2, 3, 17, vec![NO_SLOT, 3]),
    ]
}

fn step_of(v: &[VerifySeq]) -> StepSeqs {
    StepSeqs(v.iter().map(|s| (s.0, s.1, s.2)).collect())
}

fn row_slots(v: &[VerifySeq]) -> Vec<u32> {
    v.iter().flat_map(|s| s.3.clone()).collect()
}

/// The slot the decode reference runs sequence `s` on: its own, or (padding) slot 2 zeroed.
fn reference_slot(s: &VerifySeq) -> u32 {
    if s.1 == NO_SLOT { 2 } else { s.1 }
}

/// Both verify kernels at the sanitizer's head shapes.
pub(super) fn small(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)]) {
    conv_verify(p, rng, shapes, false);
    conv_verify(p, rng, shapes, true);
    rule_verify(p, rng, shapes);
}

#[test]
fn conv_state_verify_matches_and_keeps_the_window_decode_leaves_after_each_row() {
    conv_verify(&Pair::new(), &mut Rng::new(301), &gdn_shapes(), false);
}

#[test]
fn conv_state_verify_matches_with_the_b_and_a_rows_apart() {
    conv_verify(&Pair::new(), &mut Rng::new(311), &gdn_shapes(), true);
}

/// `conv_state_verify` on every head shape, 4 and 2 taps, the projection fused or with its b|a
/// rows apart (`split`).
fn conv_verify(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)], split: bool) {
    let spec = verify_seqs();
    let seqs = step_of(&spec);
    let rs = p.upload(&row_slots(&spec));
    for &(h, what) in shapes {
        for taps in [4u32, 2] {
            let (cd, hist) = (h.conv_dim(), taps - 1);
            let stride = hist * cd + 3;
            let rows = seqs.rows();
            let layout = proj_layout(&h, rows, split);
            let pw = layout.proj_stride;
            let sq = seqs.upload(p);
            let proj_v = proj_values(rng, rows, &h);
            let proj = p.upload(&proj_v);
            let weight = p.upload(&rng.bf16s((cd * taps) as usize, -0.6, 0.6));
            let state0 = rng.f32s((NUM_SLOTS * stride) as usize, -1.0, 1.0);
            let state = p.upload(&state0);
            // `out` is not read by the window kernels.
            let params = |at: At<'_>, seqs: GdnSeqs, proj: DevicePtr| CausalConv1d {
                out: at(&weight),
                proj,
                layout,
                conv_state: StatePool {
                    base: at(&state),
                    num_slots: NUM_SLOTS,
                    slot_stride: stride,
                },
                weight: at(&weight),
                seqs,
                heads: h,
                kernel_size: taps,
            };
            let case = label(&h, &format!("K={taps} ({what}){}", layout_name(split)));
            p.run(|o, at| o.conv_state_verify(S, &params(at, sq.at(at), at(&proj)), at(&rs)));
            p.check_f32("conv_state_verify", &case, &state, Tolerance::EXACT);
            let kept = p.download_gpu::<u32>(&state);

            // Decode: one row per launch of conv_state_update, from the initial windows.
            let mut first = 0u32;
            for s in &spec {
                let slot = reference_slot(s);
                let mut init = state0.clone();
                if s.1 == NO_SLOT {
                    let at = (slot * stride) as usize;
                    init[at..at + (hist * cd) as usize].fill(0.0);
                }
                reset(p, &state, &init);
                let one = StepSeqs(vec![(1, slot, 0)]).upload(p);
                for t in 0..s.0 {
                    let r = first + t;
                    p.run_gpu(|o, at| {
                        let row = at(&proj).offset((r * 2 * pw) as usize);
                        o.conv_state_update(S, &params(at, one.at(at), row))
                    });
                    let keep = s.3[t as usize];
                    if keep == NO_SLOT {
                        continue;
                    }
                    let got = p.download_gpu::<u32>(&state);
                    let (a, b) = ((keep * stride) as usize, (slot * stride) as usize);
                    let n = (hist * cd) as usize;
                    assert!(
                        kept[a..a + n] == got[b..b + n],
                        "{case}: the window kept after row {t} is not decode's"
                    );
                }
                first += s.0;
            }
            for slot in 0..NUM_SLOTS {
                let written = spec.iter().any(|s| s.3.contains(&slot));
                let at = (slot * stride) as usize;
                let from = if written { (hist * cd) as usize } else { 0 };
                let bits0: Vec<u32> = state0[at + from..at + stride as usize]
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                assert!(
                    kept[at + from..at + stride as usize] == bits0[..],
                    "{case}: slot {slot} changed outside the kept windows"
                );
            }
            println!(
                "kernel-check {:<18} {:<44} bitwise: each kept window = decode's",
                "conv_state_verify", case
            );
        }
    }
}

#[test]
fn gated_delta_verify_matches_and_its_rows_are_decode_steps_bitwise() {
    rule_verify(&Pair::new(), &mut Rng::new(302), &gdn_shapes());
}

/// `gated_delta_verify` on every head shape.
fn rule_verify(p: &Pair, rng: &mut Rng, shapes: &[(GdnHeads, &str)]) {
    let spec = verify_seqs();
    let rs = p.upload(&row_slots(&spec));
    for &(h, what) in shapes {
        let case = label(&h, what);
        let c = RuleCase::new(p, rng, h, step_of(&spec));
        c.reset(p);
        p.run(|o, at| o.gated_delta_verify(S, &c.params(at), at(&rs)));
        p.check_f32("gated_delta_verify.out", &case, &c.out, F32_RULE);
        p.check_f32("gated_delta_verify.state", &case, &c.state, F32_RULE);
        let (out, kept) = (
            p.download_gpu::<u32>(&c.out),
            p.download_gpu::<u32>(&c.state),
        );
        let (vd, per_slot) = (h.value_dim() as usize, c.stride as usize);
        let mut first = 0u32;
        for s in &spec {
            let slot = reference_slot(s);
            let mut init = c.state0.clone();
            if s.1 == NO_SLOT {
                let at = slot as usize * per_slot;
                init[at..at + per_slot].fill(0.0);
            }
            reset(p, &c.state, &init);
            poison(p, &c.out);
            let one = StepSeqs(vec![(1, slot, 0)]).upload(p);
            for t in 0..s.0 {
                let r = first + t;
                p.run_gpu(|o, at| o.gated_delta_recurrent(S, &c.params_from(at, &one, r)));
                let (o1, s1) = (
                    p.download_gpu::<u32>(&c.out),
                    p.download_gpu::<u32>(&c.state),
                );
                let at = r as usize * vd;
                assert!(
                    out[at..at + vd] == o1[at..at + vd],
                    "{case}: verify row {t} of a {}-row sequence differs from its decode step",
                    s.0
                );
                let keep = s.3[t as usize];
                if keep != NO_SLOT {
                    let (a, b) = (keep as usize * per_slot, slot as usize * per_slot);
                    let n = (h.num_v_heads * h.k_head_dim * h.v_head_dim) as usize;
                    assert!(
                        kept[a..a + n] == s1[b..b + n],
                        "{case}: the state kept after row {t} is not decode's"
                    );
                }
            }
            first += s.0;
        }
        for slot in 0..NUM_SLOTS {
            let written = spec.iter().any(|s| s.3.contains(&slot));
            let at = slot as usize * per_slot;
            let from = if written {
                (h.num_v_heads * h.k_head_dim * h.v_head_dim) as usize
            } else {
                0
            };
            let bits0: Vec<u32> = c.state0[at + from..at + per_slot]
                .iter()
                .map(|x| x.to_bits())
                .collect();
            assert!(
                kept[at + from..at + per_slot] == bits0[..],
                "{case}: slot {slot} changed outside the kept states"
            );
        }
        println!(
            "kernel-check {:<18} {:<44} bitwise: rows = decode steps, kept states = decode's",
            "gated_delta_verify", case
        );
    }
}
