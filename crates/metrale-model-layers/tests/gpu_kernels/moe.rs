//! The MoE kernels (`kernels/moe.cu`) against their CPU twins: top-k routing with ties, the
//! expert projections (and their batch invariance on CUDA), the block-FP8 expert projections
//! (bitwise the bf16 ones on the dequantized weight), and the weighted combine with the gated
//! shared expert. Each check takes its shapes, so `small` runs them at the sanitizer's sizes.

use metrale_gpu_runtime::fp8::{self, FP8_BLOCK_ROW_SHIFT};
use metrale_gpu_runtime::{DType, DevicePtr};
use metrale_model_layers::ops::{BlockScales, Matrix};
use metrale_model_layers::ops_hybrid::{ExpertLinear, MoeCombine, TopkRoute};

use super::harness::{At, Buf, Pair, Rng, S, Tolerance};

/// Every check below at small shapes (the sanitizer set).
pub(super) fn small(p: &Pair) {
    let rng = &mut Rng::new(1005);
    topk_route(p, rng, &[(60, 4, 3), (16, 1, 3)]);
    expert_linear(p, rng, &[(2, 4, 8, 40, 96), (3, 2, 8, 24, 101)]);
    expert_linear_fp8(p, rng, &[(2, 4, 8, 128, 200), (3, 2, 4, 24, 101)]);
    moe_combine(p, rng, &[(3, 256, 4), (2, 101, 2)]);
}

/// Compare two u32 outputs exactly, printing a `kernel-check` line.
fn check_u32(p: &Pair, kernel: &str, case: &str, buf: &Buf) -> Vec<u32> {
    let (g, c) = p.download::<u32>(buf);
    let bad = g.iter().zip(&c).position(|(a, b)| a != b);
    println!(
        "kernel-check {kernel:<18} {case:<44} n={:<9} exact {}",
        g.len(),
        if bad.is_none() { "ok" } else { "FAIL" }
    );
    if let Some(i) = bad {
        panic!(
            "{kernel} {case}: element {i}: cuda {} vs cpu {}",
            g[i], c[i]
        );
    }
    g
}

#[test]
fn topk_route_picks_the_largest_probabilities_with_ties_to_the_lower_index() {
    let shapes = [(64, 8, 6), (512, 10, 5), (60, 4, 3), (128, 1, 4)];
    topk_route(&Pair::new(), &mut Rng::new(201), &shapes);
}

/// `(experts, top_k, rows)` each (rows >= 3), renormalised and not: row 1 a three-way tie at
/// the top, row 2 a tie at the edge of the top-k.
fn topk_route(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    for &(experts, top_k, rows) in shapes {
        for renormalize in [true, false] {
            let e = experts as usize;
            let mut logits = rng.f32s(rows as usize * e, -4.0, 4.0);
            // Row 1: a three-way tie at the top (three experts spread over the range must come
            // out in index order); row 2: a tie at the edge of the top-k.
            let tied = [e / 8, e / 2 + 1, e - 1];
            for i in tied {
                logits[e + i] = 9.0;
            }
            let mut sorted: Vec<f32> = logits[2 * e..3 * e].to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            let edge = sorted[top_k as usize - 1];
            let twin = logits[2 * e..3 * e]
                .iter()
                .position(|&v| v < edge)
                .expect("a logit below the edge");
            logits[2 * e + twin] = edge;
            let lg = p.upload(&logits);
            let ids = p.poisoned((rows * top_k) as usize * 4);
            let weights = p.poisoned((rows * top_k) as usize * 4);
            p.run(|o, at| {
                o.topk_route(
                    S,
                    &TopkRoute {
                        topk_ids: at(&ids),
                        topk_weights: at(&weights),
                        logits: at(&lg),
                        rows,
                        num_experts: experts,
                        top_k,
                        renormalize: renormalize as u32,
                    },
                )
            });
            let case = format!("E={experts} k={top_k} rows={rows} renorm={renormalize}");
            let got = check_u32(p, "topk_route.ids", &case, &ids);
            if top_k >= 3 {
                let k = top_k as usize;
                let tied = tied.map(|i| i as u32);
                assert_eq!(&got[k..k + 3], &tied, "{case}: tie order");
            }
            p.check_f32(
                "topk_route.weights",
                &case,
                &weights,
                Tolerance::F32_ELEMENTWISE,
            );
        }
    }
}

/// Each row's `top_k` distinct experts.
fn routing(rng: &mut Rng, rows: u32, experts: u32, top_k: u32) -> Vec<u32> {
    (0..rows)
        .flat_map(|_| rng.permutation(experts)[..top_k as usize].to_vec())
        .collect()
}

/// One expert-projection problem on both sides.
struct ExpertCase {
    x: Buf,
    w: Buf,
    ids: Buf,
    pairs: u32,
    n: u32,
    k: u32,
    experts: u32,
    per: u32,
}

impl ExpertCase {
    fn new(
        p: &Pair,
        rng: &mut Rng,
        ids: Vec<u32>,
        (n, k, experts, per): (u32, u32, u32, u32),
    ) -> ExpertCase {
        let pairs = ids.len() as u32;
        let s = (3.0 / k as f32).sqrt();
        ExpertCase {
            x: p.upload(&rng.bf16s((pairs / per * k) as usize, -1.0, 1.0)),
            w: p.upload(&rng.bf16s((experts * n * k) as usize, -s, s)),
            ids: p.upload(&ids),
            pairs,
            n,
            k,
            experts,
            per,
        }
    }

    fn params(&self, at: At<'_>, out: &Buf) -> ExpertLinear {
        ExpertLinear {
            out: at(out),
            x: at(&self.x),
            w: at(&self.w),
            expert_ids: at(&self.ids),
            pairs: self.pairs,
            n: self.n,
            k: self.k,
            num_experts: self.experts,
            pairs_per_x_row: self.per,
        }
    }
}

#[test]
fn expert_linear_projects_each_pair_through_its_expert() {
    let p = Pair::new();
    let mut rng = Rng::new(202);
    // (rows, top_k, experts, n, k): decode-like, odd k (scalar path), k not a multiple of 256.
    let shapes = [
        (1, 8, 64, 256, 512),
        (9, 4, 16, 130, 1003),
        (33, 4, 16, 256, 520),
        (3, 2, 8, 64, 2048),
    ];
    expert_linear(&p, &mut rng, &shapes);
    // One expert taking most of 600 pairs (more than a block collects at once), and an expert
    // index at the top of the range.
    let ids: Vec<u32> = (0..600u32)
        .map(|i| match i % 7 {
            0 => rng.below(16),
            1 => 15,
            _ => 3,
        })
        .collect();
    let c = ExpertCase::new(&p, &mut rng, ids, (96, 256, 16, 1));
    let case = "600 pairs, ~430 on expert 3";
    let out32 = p.poisoned((c.pairs * c.n) as usize * 4);
    p.run(|o, at| o.expert_linear_f32out(S, &c.params(at, &out32)));
    p.check_f32("expert_linear_f32out", case, &out32, Tolerance::F32_DOT);
}

/// `(rows, top_k, experts, n, k)` each, for the gate|up projection (`pairs_per_x_row` =
/// `top_k`: pairs share x rows) and the down projection (1): bf16 and f32 out against the CPU,
/// run to run.
fn expert_linear(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32, u32, u32)]) {
    for &(rows, top_k, experts, n, k) in shapes {
        for per in [top_k, 1] {
            let ids = routing(rng, rows, experts, top_k);
            let c = ExpertCase::new(p, rng, ids, (n, k, experts, per));
            let case = format!("rows={rows} k_top={top_k} E={experts} n={n} k={k} per={per}");
            let out = p.poisoned((c.pairs * n) as usize * 2);
            p.run(|o, at| o.expert_linear(S, &c.params(at, &out)));
            p.check_bf16("expert_linear", &case, &out, Tolerance::BF16);
            let out32 = p.poisoned((c.pairs * n) as usize * 4);
            p.run(|o, at| o.expert_linear_f32out(S, &c.params(at, &out32)));
            p.check_f32("expert_linear_f32out", &case, &out32, Tolerance::F32_DOT);
            let first = p.download_gpu::<u32>(&out32);
            p.run_gpu(|o, at| o.expert_linear_f32out(S, &c.params(at, &out32)));
            assert!(
                first == p.download_gpu::<u32>(&out32),
                "expert_linear_f32out {case}: a second run differs"
            );
        }
    }
}

#[test]
fn fp8_experts_are_the_bf16_experts_of_their_dequantized_weight() {
    let p = Pair::new();
    let mut rng = Rng::new(205);
    // (rows, top_k, experts, n, k): the 35B-A3B gate|up and down at decode, 128-row blocks with
    // partial column blocks, per-row scales, and the scalar path (odd k).
    let shapes = [
        (1, 8, 32, 1024, 2048),
        (4, 8, 32, 2048, 512),
        (9, 4, 16, 256, 1000),
        (5, 2, 8, 72, 520),
        (3, 2, 8, 64, 1003),
    ];
    expert_linear_fp8(&p, &mut rng, &shapes);
}

/// `(rows, top_k, experts, n, k)` each, as `expert_linear` takes them, with a block-FP8 stacked
/// weight (128-row scale blocks where `n` is a multiple of 128, else a scale row per weight row):
/// bf16 and f32 out close to the twin, and bitwise CUDA's bf16 kernels on the weight
/// `dequant` gives.
fn expert_linear_fp8(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32, u32, u32)]) {
    for &(rows, top_k, experts, n, k) in shapes {
        let (wrows, kk) = ((experts * n) as usize, k as usize);
        let s = 1.5 * (3.0 / k as f32).sqrt();
        let (q, grid) = fp8::quantize(&rng.bf16s(wrows * kk, -s, s), (wrows, kk));
        let (shift, scales) = if n % 128 == 0 {
            (FP8_BLOCK_ROW_SHIFT, grid)
        } else {
            let kb = fp8::scale_cols(kk);
            let per_row = (0..wrows)
                .flat_map(|r| grid[(r >> FP8_BLOCK_ROW_SHIFT) * kb..][..kb].to_vec())
                .collect();
            (0, per_row)
        };
        let deq = fp8::dequant(&q, &scales, (wrows, kk), shift);
        let (qb, sb, deqb) = (p.upload(&q), p.upload(&scales), p.upload(&deq));
        let fp8_w = |at: super::harness::At<'_>| Matrix {
            scales: Some(BlockScales {
                ptr: at(&sb),
                row_shift: shift,
            }),
            ..Matrix::new(at(&qb), DType::F8E4M3, experts * n, k)
        };
        let bf16_w = |at: super::harness::At<'_>| Matrix::bf16(at(&deqb), experts * n, k);
        for per in [top_k, 1] {
            let ids = routing(rng, rows, experts, top_k);
            let c = ExpertCase::new(p, rng, ids, (n, k, experts, per));
            let case = format!(
                "rows={rows} k_top={top_k} E={experts} n={n} k={k} per={per} shift={shift}"
            );
            for f32_out in [false, true] {
                let bytes = (c.pairs * n) as usize * if f32_out { 4 } else { 2 };
                let want = p.poisoned(bytes);
                p.run_gpu(|o, at| {
                    o.expert_projection(S, &c.params(at, &want), bf16_w(at), f32_out)
                });
                let out = p.poisoned(bytes);
                p.run(|o, at| o.expert_projection(S, &c.params(at, &out), fp8_w(at), f32_out));
                if f32_out {
                    p.check_f32("expert_linear_fp8_f32out", &case, &out, Tolerance::F32_DOT);
                } else {
                    p.check_bf16("expert_linear_fp8", &case, &out, Tolerance::BF16);
                }
                assert!(
                    p.download_gpu::<u16>(&out) == p.download_gpu::<u16>(&want),
                    "expert_linear_fp8 {case} f32 out {f32_out}: differs bitwise from the bf16 \
                     kernel on the dequantized weight"
                );
            }
        }
    }
}

#[test]
fn expert_linear_pairs_do_not_depend_on_the_other_pairs_of_the_launch() {
    let p = Pair::new();
    let mut rng = Rng::new(203);
    let (rows, top_k, experts, n, k) = (40u32, 8u32, 64u32, 256u32, 1024u32);
    let ids = routing(&mut rng, rows, experts, top_k);
    let c = ExpertCase::new(&p, &mut rng, ids, (n, k, experts, top_k));
    let full = p.poisoned((c.pairs * n) as usize * 4);
    p.run_gpu(|o, at| o.expert_linear_f32out(S, &c.params(at, &full)));
    let full = p.download_gpu::<u32>(&full);
    for (start, m) in [(0u32, 1u32), (7, 1), (13, 5), (20, 20), (39, 1)] {
        let out = p.poisoned((m * top_k * n) as usize * 4);
        p.run_gpu(|o, _| {
            o.expert_linear_f32out(
                S,
                &ExpertLinear {
                    out: out.gpu,
                    x: c.x.gpu.offset((start * k) as usize * 2),
                    w: c.w.gpu,
                    expert_ids: c.ids.gpu.offset((start * top_k) as usize * 4),
                    pairs: m * top_k,
                    n,
                    k,
                    num_experts: experts,
                    pairs_per_x_row: top_k,
                },
            )
        });
        let at = (start * top_k * n) as usize..((start + m) * top_k * n) as usize;
        assert!(
            p.download_gpu::<u32>(&out)[..] == full[at],
            "rows {start}..{} differ bitwise between {m} and {rows} rows",
            start + m
        );
    }
    println!(
        "kernel-check {:<18} {:<44} bitwise equal for rows in 1..=40 ok",
        "expert_linear(inv)",
        format!("E={experts} top_k={top_k} n={n} k={k}")
    );
}

#[test]
fn moe_combine_weighs_the_experts_and_gates_the_shared_expert() {
    moe_combine(
        &Pair::new(),
        &mut Rng::new(204),
        &[(5, 2048, 8), (3, 1003, 4)],
    );
}

/// `(rows, hidden, top_k)` each, with a gated, an ungated and no shared expert.
fn moe_combine(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    for &(rows, hidden, top_k) in shapes {
        let expert_out = p.upload(&rng.f32s((rows * top_k * hidden) as usize, -2.0, 2.0));
        let weights = p.upload(&rng.f32s((rows * top_k) as usize, 0.01, 0.3));
        let shared = p.upload(&rng.bf16s((rows * hidden) as usize, -2.0, 2.0));
        let gate = p.upload(&rng.f32s(rows as usize, -3.0, 3.0));
        for (with_shared, with_gate) in [(true, true), (true, false), (false, false)] {
            let out = p.poisoned((rows * hidden) as usize * 2);
            p.run(|o, at| {
                o.moe_combine(
                    S,
                    &MoeCombine {
                        out: at(&out),
                        expert_out: at(&expert_out),
                        topk_weights: at(&weights),
                        shared_out: if with_shared {
                            at(&shared)
                        } else {
                            DevicePtr::NULL
                        },
                        shared_gate: if with_gate {
                            at(&gate)
                        } else {
                            DevicePtr::NULL
                        },
                        rows,
                        hidden,
                        top_k,
                    },
                )
            });
            p.check_bf16(
                "moe_combine",
                &format!(
                    "rows={rows} hidden={hidden} k={top_k} shared={with_shared} gate={with_gate}"
                ),
                &out,
                Tolerance::BF16,
            );
        }
    }
}
