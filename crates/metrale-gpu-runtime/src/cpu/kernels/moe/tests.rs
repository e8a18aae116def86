//! Tests of the MoE kernels: the router against an f64 softmax/top-k, and the whole sparse MoE
//! block (router, experts, shared expert, combine) against an f64 transcription of transformers'
//! `Qwen3NextSparseMoeBlock`, plus batch invariance of a row's result.

use half::bf16;
use metrale_kernel_abi::{
    ExpertLinearParams, LinearParams, MoeCombineParams, SiluMulParams, TopkRouteParams,
};
use metrale_testkit::Rng;

use crate::backend::GpuBackendExt;
use crate::cpu::test_support::{Rig, assert_close};
use crate::error::GpuError;
use crate::types::DevicePtr;

fn softmax(row: &[f64]) -> Vec<f64> {
    let m = row.iter().cloned().fold(f64::MIN, f64::max);
    let e: Vec<f64> = row.iter().map(|v| (v - m).exp()).collect();
    let z: f64 = e.iter().sum();
    e.iter().map(|v| v / z).collect()
}

/// Top-k by descending probability, ties to the lower index; weights renormalised or not.
fn ref_topk(p: &[f64], k: usize, renorm: bool) -> (Vec<u32>, Vec<f64>) {
    let mut order: Vec<usize> = (0..p.len()).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let ids: Vec<u32> = order[..k].iter().map(|&i| i as u32).collect();
    let mut w: Vec<f64> = order[..k].iter().map(|&i| p[i]).collect();
    if renorm {
        let s: f64 = w.iter().sum();
        w.iter_mut().for_each(|x| *x /= s);
    }
    (ids, w)
}

#[test]
fn topk_route_picks_the_largest_probabilities_and_renormalises() {
    let r = Rig::new();
    let mut d = Rng::new(73);
    let (rows, e) = (4usize, 7usize);
    let mut logits = d.f32s(rows * e, -3.0, 3.0);
    // A tie between experts 2 and 5 of row 1 must go to expert 2 first.
    logits[e + 2] = 9.0;
    logits[e + 5] = 9.0;
    let lp = r.put(&logits);
    for (k, renorm) in [(2usize, true), (3, false), (1, true)] {
        let (ids, ws) = (r.out(rows * k * 4), r.out(rows * k * 4));
        let p = TopkRouteParams {
            topk_ids: ids,
            topk_weights: ws,
            logits: lp,
            rows: rows as u32,
            num_experts: e as u32,
            top_k: k as u32,
            renormalize: renorm as u32,
        };
        r.run("moe", "topk_route", &p).unwrap();
        let got_ids = r.gpu.download::<u32>(ids, rows * k, r.s).unwrap();
        let got_w: Vec<f64> = r.f32s(ws, rows * k).iter().map(|&x| x as f64).collect();
        let (mut want_ids, mut want_w) = (Vec::new(), Vec::new());
        for row in logits.chunks(e) {
            let p = softmax(&row.iter().map(|&x| x as f64).collect::<Vec<_>>());
            let (i, w) = ref_topk(&p, k, renorm);
            want_ids.extend(i);
            want_w.extend(w);
        }
        assert_eq!(got_ids, want_ids, "top-{k} experts");
        assert_close(&got_w, &want_w, 1e-5, 1e-3, "top-k weights");
    }
    let bad = TopkRouteParams {
        topk_ids: r.out(4 * (e + 1)),
        topk_weights: r.out(4 * (e + 1)),
        logits: lp,
        rows: 1,
        num_experts: e as u32,
        top_k: e as u32 + 1,
        renormalize: 1,
    };
    assert!(
        r.run("moe", "topk_route", &bad).is_err(),
        "top_k past the experts"
    );
}

/// The weights of one MoE block, host and device.
struct Block {
    hidden: usize,
    experts: usize,
    top_k: usize,
    ffn: usize,
    shared_ffn: usize,
    router: Vec<bf16>,
    gate_up: Vec<bf16>,
    down: Vec<bf16>,
    shared_gate_up: Vec<bf16>,
    shared_down: Vec<bf16>,
    shared_gate: Vec<bf16>,
    dev: [DevicePtr; 6],
}

fn block(r: &Rig, d: &mut Rng) -> Block {
    let (hidden, experts, top_k, ffn, shared_ffn) = (24usize, 6usize, 2usize, 8usize, 12usize);
    let router = d.bf16s(experts * hidden, -0.8, 0.8);
    let gate_up = d.bf16s(experts * 2 * ffn * hidden, -0.4, 0.4);
    let down = d.bf16s(experts * hidden * ffn, -0.4, 0.4);
    let shared_gate_up = d.bf16s(2 * shared_ffn * hidden, -0.4, 0.4);
    let shared_down = d.bf16s(hidden * shared_ffn, -0.4, 0.4);
    let shared_gate = d.bf16s(hidden, -0.5, 0.5);
    let dev = [
        r.put(&router),
        r.put(&gate_up),
        r.put(&down),
        r.put(&shared_gate_up),
        r.put(&shared_down),
        r.put(&shared_gate),
    ];
    Block {
        hidden,
        experts,
        top_k,
        ffn,
        shared_ffn,
        router,
        gate_up,
        down,
        shared_gate_up,
        shared_down,
        shared_gate,
        dev,
    }
}

/// Run the whole block through the kernels on `x` (`rows` rows); returns the bf16 output.
fn run_block(r: &Rig, w: &Block, x: &[bf16], rows: usize) -> Result<Vec<bf16>, GpuError> {
    let (h, e, k, f, fs) = (w.hidden, w.experts, w.top_k, w.ffn, w.shared_ffn);
    let [router, gate_up, down, s_gate_up, s_down, s_gate] = w.dev;
    let pairs = rows * k;
    let xp = r.put(x);
    let logits = r.out(rows * e * 4);
    let (ids, weights) = (r.out(pairs * 4), r.out(pairs * 4));
    let (egu, eact, eout) = (
        r.out(pairs * 2 * f * 2),
        r.out(pairs * f * 2),
        r.out(pairs * h * 4),
    );
    let (sgu, sact, sout, sg) = (
        r.out(rows * 2 * fs * 2),
        r.out(rows * fs * 2),
        r.out(rows * h * 2),
        r.out(rows * 4),
    );
    let out = r.out(rows * h * 2);
    let gemm = |name: &str, o: DevicePtr, i: DevicePtr, wt: DevicePtr, n: usize, kk: usize| {
        let p = LinearParams {
            out: o,
            x: i,
            w: wt,
            m: rows as u32,
            n: n as u32,
            k: kk as u32,
        };
        r.run("gemm", name, &p)
    };
    gemm("linear_f32out", logits, xp, router, e, h)?;
    let route = TopkRouteParams {
        topk_ids: ids,
        topk_weights: weights,
        logits,
        rows: rows as u32,
        num_experts: e as u32,
        top_k: k as u32,
        renormalize: 1,
    };
    r.run("moe", "topk_route", &route)?;
    let expert =
        |name: &str, o: DevicePtr, i: DevicePtr, wt: DevicePtr, n: usize, kk: usize, per: usize| {
            let p = ExpertLinearParams {
                out: o,
                x: i,
                w: wt,
                expert_ids: ids,
                pairs: pairs as u32,
                n: n as u32,
                k: kk as u32,
                num_experts: e as u32,
                pairs_per_x_row: per as u32,
            };
            r.run("moe", name, &p)
        };
    let silu = |out: DevicePtr, gate_up: DevicePtr, rows: usize, ffn: usize| {
        let p = SiluMulParams {
            out,
            gate_up,
            rows: rows as u32,
            ffn: ffn as u32,
        };
        r.run("activation", "silu_mul", &p)
    };
    expert("expert_linear", egu, xp, gate_up, 2 * f, h, k)?;
    silu(eact, egu, pairs, f)?;
    expert("expert_linear_f32out", eout, eact, down, h, f, 1)?;
    gemm("linear", sgu, xp, s_gate_up, 2 * fs, h)?;
    silu(sact, sgu, rows, fs)?;
    gemm("linear", sout, sact, s_down, h, fs)?;
    gemm("linear_f32out", sg, xp, s_gate, 1, h)?;
    let combine = MoeCombineParams {
        out,
        expert_out: eout,
        topk_weights: weights,
        shared_out: sout,
        shared_gate: sg,
        rows: rows as u32,
        hidden: h as u32,
        top_k: k as u32,
    };
    r.run("moe", "moe_combine", &combine)?;
    Ok(r.bf(out, rows * h))
}

fn dot(a: &[f64], b: &[bf16]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y.to_f64()).sum()
}

/// `down(silu(gate(x)) * up(x))` with the `[2F, H]` gate|up and `[H, F]` down weights.
fn ref_swiglu(x: &[f64], gate_up: &[bf16], down: &[bf16], f: usize) -> Vec<f64> {
    let h = x.len();
    let act: Vec<f64> = (0..f)
        .map(|i| {
            let g = dot(x, &gate_up[i * h..(i + 1) * h]);
            let up = dot(x, &gate_up[(f + i) * h..(f + i + 1) * h]);
            g / (1.0 + (-g).exp()) * up
        })
        .collect();
    (0..h)
        .map(|c| dot(&act, &down[c * f..(c + 1) * f]))
        .collect()
}

#[test]
fn the_moe_block_matches_the_transformers_formula_and_is_batch_invariant() {
    let r = Rig::new();
    let mut d = Rng::new(79);
    let w = block(&r, &mut d);
    let (h, e, k, f) = (w.hidden, w.experts, w.top_k, w.ffn);
    let rows = 5usize;
    let x = d.bf16s(rows * h, -1.0, 1.0);
    let got = run_block(&r, &w, &x, rows).unwrap();
    let mut want = Vec::new();
    for row in x.chunks(h) {
        let xr: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
        let logits: Vec<f64> = (0..e)
            .map(|i| dot(&xr, &w.router[i * h..(i + 1) * h]))
            .collect();
        let p = softmax(&logits);
        let (ids, ws) = ref_topk(&p, k, true);
        let mut sorted = p.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!(
            sorted[k - 1] - sorted[k] > 1e-3,
            "test data must not be near a routing tie"
        );
        let mut acc = vec![0.0f64; h];
        for (&id, &wt) in ids.iter().zip(&ws) {
            let id = id as usize;
            let y = ref_swiglu(
                &xr,
                &w.gate_up[id * 2 * f * h..(id + 1) * 2 * f * h],
                &w.down[id * h * f..(id + 1) * h * f],
                f,
            );
            acc.iter_mut().zip(&y).for_each(|(a, v)| *a += wt * v);
        }
        let shared = ref_swiglu(&xr, &w.shared_gate_up, &w.shared_down, w.shared_ffn);
        let g = 1.0 / (1.0 + (-dot(&xr, &w.shared_gate)).exp());
        want.extend(acc.iter().zip(&shared).map(|(a, s)| a + g * s));
    }
    let got64: Vec<f64> = got.iter().map(|v| v.to_f64()).collect();
    assert_close(&got64, &want, 2e-2, 0.1, "moe block");

    // Row 3 alone computes the same bits as within the batch.
    let alone = run_block(&r, &w, &x[3 * h..4 * h], 1).unwrap();
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&alone), bits(&got[3 * h..4 * h]));
}

#[test]
fn moe_combine_without_a_shared_expert_and_bad_expert_ids() {
    let r = Rig::new();
    let mut d = Rng::new(83);
    let (rows, h, k) = (3usize, 5usize, 2usize);
    let eo = d.f32s(rows * k * h, -2.0, 2.0);
    let wts = d.f32s(rows * k, -1.0, 1.0);
    let out = r.out(rows * h * 2);
    let p = MoeCombineParams {
        out,
        expert_out: r.put(&eo),
        topk_weights: r.put(&wts),
        shared_out: DevicePtr::NULL,
        shared_gate: DevicePtr::NULL,
        rows: rows as u32,
        hidden: h as u32,
        top_k: k as u32,
    };
    r.run("moe", "moe_combine", &p).unwrap();
    let want: Vec<f64> = (0..rows * h)
        .map(|i| {
            let (row, c) = (i / h, i % h);
            (0..k)
                .map(|j| wts[row * k + j] as f64 * eo[(row * k + j) * h + c] as f64)
                .sum()
        })
        .collect();
    let got: Vec<f64> = r.bf(out, rows * h).iter().map(|v| v.to_f64()).collect();
    assert_close(&got, &want, 8e-3, 1e-2, "moe_combine");

    let x = r.put(&d.bf16s(2 * 4, -1.0, 1.0));
    let wt = r.put(&d.bf16s(3 * 2 * 4, -1.0, 1.0));
    let ids = r.put(&[0u32, 3]);
    let o = r.out(2 * 2 * 2);
    let p = ExpertLinearParams {
        out: o,
        x,
        w: wt,
        expert_ids: ids,
        pairs: 2,
        n: 2,
        k: 4,
        num_experts: 3,
        pairs_per_x_row: 1,
    };
    assert!(matches!(
        r.run("moe", "expert_linear", &p),
        Err(GpuError::KernelFailed { .. })
    ));
}
