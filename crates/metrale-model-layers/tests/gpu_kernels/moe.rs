//! The MoE kernels (`kernels/moe.cu`) against their CPU twins: top-k routing with ties, the
//! expert projections (and their batch invariance on CUDA), and the weighted combine with the
//! gated shared expert.

use metrale_model_layers::ops_hybrid::{ExpertLinear, MoeCombine};

use super::F32_ELEMENTWISE;
use super::harness::{At, Buf, Pair, Rng, S, Tolerance};

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
    let p = Pair::new();
    let mut rng = Rng::new(201);
    for (experts, top_k, rows) in [(64u32, 8u32, 6u32), (512, 10, 5), (60, 4, 3), (128, 1, 4)] {
        for renormalize in [true, false] {
            let e = experts as usize;
            let mut logits = rng.f32s(rows as usize * e, -4.0, 4.0);
            // Row 1: a three-way tie at the top (5 < 40 < e - 1 must come out in that order);
            // row 2: a tie at the edge of the top-k.
            for i in [5, 40, e - 1] {
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
                    at(&ids),
                    at(&weights),
                    at(&lg),
                    rows,
                    experts,
                    top_k,
                    renormalize,
                )
            });
            let case = format!("E={experts} k={top_k} rows={rows} renorm={renormalize}");
            let got = check_u32(&p, "topk_route.ids", &case, &ids);
            if top_k >= 3 {
                let k = top_k as usize;
                assert_eq!(&got[k..k + 3], &[5, 40, experts - 1], "{case}: tie order");
            }
            p.check_f32("topk_route.weights", &case, &weights, F32_ELEMENTWISE);
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
        (1u32, 8u32, 64u32, 256u32, 512u32),
        (9, 4, 16, 130, 1003),
        (33, 4, 16, 256, 520),
        (3, 2, 8, 64, 2048),
    ];
    for (rows, top_k, experts, n, k) in shapes {
        for per in [top_k, 1] {
            // per = top_k: the gate|up projection (pairs share x rows); 1: the down projection.
            let ids = routing(&mut rng, rows, experts, top_k);
            let c = ExpertCase::new(&p, &mut rng, ids, (n, k, experts, per));
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
    let p = Pair::new();
    let mut rng = Rng::new(204);
    for (rows, hidden, top_k) in [(5u32, 2048u32, 8u32), (3, 1003, 4)] {
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
                            metrale_gpu_runtime::DevicePtr::NULL
                        },
                        shared_gate: if with_gate {
                            at(&gate)
                        } else {
                            metrale_gpu_runtime::DevicePtr::NULL
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
