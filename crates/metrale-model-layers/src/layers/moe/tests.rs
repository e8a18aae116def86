//! Layer-level tests of `MoeMlp` on the CPU backend: its output against an f64 transcription of
//! transformers' sparse MoE block (with and without the shared expert, renormalised or not), a
//! row's output is the same bits alone or in a batch, and block-FP8 experts give the bits of
//! the bf16 experts they stand for.

use half::bf16;
use metrale_gpu_runtime::fp8::{self, FP8_BLOCK_ROW_SHIFT};
use metrale_gpu_runtime::{DType, GpuBackendExt};
use metrale_testkit::Rng;

use super::{MoeMlp, MoeShape, SharedExpert};
use crate::layer::{Activations, LayerCtx, MoeBuffers, StepBuffers, StepShape};
use crate::layers::gdn::tests::Rig;
use crate::ops::BlockScales;
use crate::weight_map::DenseWeight;

const H: usize = 32;
const MAX_ROWS: usize = 8;

/// Host copies of the weights, for the reference.
struct HostWeights {
    router: Vec<bf16>,
    gate_up: Vec<bf16>,
    down: Vec<bf16>,
    shared_gate_up: Vec<bf16>,
    shared_down: Vec<bf16>,
    shared_gate: Vec<bf16>,
}

fn build(rig: &Rig, d: &mut Rng, shape: MoeShape, shared: bool) -> (MoeMlp, HostWeights) {
    let (e, f, fs) = (
        shape.num_experts as usize,
        shape.expert_ffn as usize,
        12usize,
    );
    let w = HostWeights {
        router: d.bf16s(e * H, -0.6, 0.6),
        gate_up: d.bf16s(e * 2 * f * H, -0.3, 0.3),
        down: d.bf16s(e * H * f, -0.3, 0.3),
        shared_gate_up: d.bf16s(2 * fs * H, -0.3, 0.3),
        shared_down: d.bf16s(H * fs, -0.3, 0.3),
        shared_gate: d.bf16s(H, -0.4, 0.4),
    };
    let mlp = MoeMlp {
        router: rig.bf16_weight(&[e, H], &w.router),
        experts_gate_up: rig.bf16_weight(&[e, 2 * f, H], &w.gate_up),
        experts_down: rig.bf16_weight(&[e, H, f], &w.down),
        shared: shared.then(|| SharedExpert {
            gate_up: rig.bf16_weight(&[2 * fs, H], &w.shared_gate_up),
            down: rig.bf16_weight(&[H, fs], &w.shared_down),
            gate: Some(rig.bf16_weight(&[1, H], &w.shared_gate)),
            ffn: fs as u32,
        }),
        shape,
    };
    (mlp, w)
}

fn buffers(rig: &Rig, shape: MoeShape) -> StepBuffers {
    let (r, e, k, f, fs) = (
        MAX_ROWS,
        shape.num_experts as usize,
        shape.top_k as usize,
        shape.expert_ffn as usize,
        12usize,
    );
    StepBuffers {
        acts: Activations {
            normed: rig.buf(r * H * 2),
            delta: rig.buf(r * H * 2),
            ..Default::default()
        },
        moe: MoeBuffers {
            router_logits: rig.buf(r * e * 4),
            topk_ids: rig.buf(r * k * 4),
            topk_weights: rig.buf(r * k * 4),
            expert_gate_up: rig.buf(r * k * 2 * f * 2),
            expert_act: rig.buf(r * k * f * 2),
            expert_out: rig.buf(r * k * H * 4),
            shared_gate_up: rig.buf(r * 2 * fs * 2),
            shared_act: rig.buf(r * fs * 2),
            shared_out: rig.buf(r * H * 2),
            shared_gate: rig.buf(r * 4),
        },
        ..StepBuffers::default()
    }
}

fn run(rig: &Rig, mlp: &MoeMlp, buf: &StepBuffers, x: &[bf16]) -> Vec<bf16> {
    let rows = x.len() / H;
    rig.gpu.upload(buf.acts.normed, x, rig.s).expect("upload");
    let dims = Rig::dims(H as u32);
    let cx = LayerCtx {
        ops: &rig.ops,
        stream: rig.s,
        buf,
        shape: StepShape {
            rows: rows as u32,
            num_seqs: 1,
            max_blocks: 1,
            logit_rows: 0,
            verify: false,
            att_groups: 0,
            att_split: 0,
            att_prompt: 0,
        },
        dims: &dims,
        kv: None,
        ssm: None,
        first: false,
    };
    mlp.forward(&cx).expect("forward");
    rig.gpu
        .download(buf.acts.delta, rows * H, rig.s)
        .expect("download")
}

fn dot(a: &[f64], b: &[bf16]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y.to_f64()).sum()
}

fn swiglu(x: &[f64], gate_up: &[bf16], down: &[bf16], f: usize) -> Vec<f64> {
    let act: Vec<f64> = (0..f)
        .map(|i| {
            let g = dot(x, &gate_up[i * H..(i + 1) * H]);
            g / (1.0 + (-g).exp()) * dot(x, &gate_up[(f + i) * H..(f + i + 1) * H])
        })
        .collect();
    (0..H)
        .map(|c| dot(&act, &down[c * f..(c + 1) * f]))
        .collect()
}

/// transformers' `Qwen3NextSparseMoeBlock` for one row, in f64.
fn reference(x: &[bf16], w: &HostWeights, shape: MoeShape, shared: bool) -> Vec<f64> {
    let (e, k, f) = (
        shape.num_experts as usize,
        shape.top_k as usize,
        shape.expert_ffn as usize,
    );
    let xr: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let logits: Vec<f64> = (0..e)
        .map(|i| dot(&xr, &w.router[i * H..(i + 1) * H]))
        .collect();
    let mx = logits.iter().cloned().fold(f64::MIN, f64::max);
    let z: f64 = logits.iter().map(|l| (l - mx).exp()).sum();
    let p: Vec<f64> = logits.iter().map(|l| (l - mx).exp() / z).collect();
    let mut order: Vec<usize> = (0..e).collect();
    order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
    assert!(
        p[order[k - 1]] - p[order[k]] > 1e-3,
        "test data near a routing tie"
    );
    let total: f64 = order[..k].iter().map(|&i| p[i]).sum();
    let mut out = vec![0.0f64; H];
    for &i in &order[..k] {
        let wt = if shape.renormalize {
            p[i] / total
        } else {
            p[i]
        };
        let y = swiglu(
            &xr,
            &w.gate_up[i * 2 * f * H..(i + 1) * 2 * f * H],
            &w.down[i * H * f..(i + 1) * H * f],
            f,
        );
        out.iter_mut().zip(&y).for_each(|(o, v)| *o += wt * v);
    }
    if shared {
        let s = swiglu(&xr, &w.shared_gate_up, &w.shared_down, 12);
        let g = 1.0 / (1.0 + (-dot(&xr, &w.shared_gate)).exp());
        out.iter_mut().zip(&s).for_each(|(o, v)| *o += g * v);
    }
    out
}

#[test]
fn the_moe_layer_matches_the_reference_and_is_batch_invariant() {
    let rig = Rig::new();
    let mut d = Rng::new(131);
    for (renormalize, shared) in [(true, true), (false, true), (true, false)] {
        let shape = MoeShape {
            num_experts: 6,
            top_k: 2,
            expert_ffn: 8,
            renormalize,
        };
        let (mlp, w) = build(&rig, &mut d, shape, shared);
        let buf = buffers(&rig, shape);
        let rows = 5;
        let x = d.bf16s(rows * H, -1.0, 1.0);
        let got = run(&rig, &mlp, &buf, &x);
        let mut want = Vec::new();
        for row in x.chunks(H) {
            want.extend(reference(row, &w, shape, shared));
        }
        let rms = (want.iter().map(|v| v * v).sum::<f64>() / want.len() as f64).sqrt();
        for (i, (g, wv)) in got.iter().zip(&want).enumerate() {
            let g = g.to_f64();
            assert!(
                (g - wv).abs() <= 2e-2 * wv.abs().max(rms),
                "renorm {renormalize} shared {shared} [{i}]: got {g}, want {wv}"
            );
        }
        let alone = run(&rig, &mlp, &buf, &x[2 * H..3 * H]);
        let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(&alone),
            bits(&got[2 * H..3 * H]),
            "row 2 alone vs in the batch"
        );
    }
}

/// `w` (`[rows, k]`, bf16) as block FP8 with the packs' recipe, as the layer stores it, and the
/// bf16 weight that stands for; `per_row` gives every weight row its own scale row.
fn fp8_pair(rig: &Rig, w: &[bf16], shape: &[usize], per_row: bool) -> (DenseWeight, DenseWeight) {
    let k = *shape.last().expect("a shape");
    let rows = w.len() / k;
    let (q, grid) = fp8::quantize(w, (rows, k));
    let (shift, scales) = if per_row {
        let kb = fp8::scale_cols(k);
        let s: Vec<f32> = (0..rows)
            .flat_map(|r| grid[(r >> FP8_BLOCK_ROW_SHIFT) * kb..][..kb].to_vec())
            .collect();
        (0, s)
    } else {
        (FP8_BLOCK_ROW_SHIFT, grid)
    };
    let deq = fp8::dequant(&q, &scales, (rows, k), shift);
    let quantized = DenseWeight {
        ptr: rig.put(&q),
        shape: shape.to_vec(),
        dtype: DType::F8E4M3,
        scales: Some(BlockScales {
            ptr: rig.put(&scales),
            row_shift: shift,
        }),
    };
    (quantized, rig.bf16_weight(shape, &deq))
}

#[test]
fn fp8_experts_give_the_bits_of_their_dequantized_bf16_experts() {
    let rig = Rig::new();
    let mut d = Rng::new(133);
    let shape = MoeShape {
        num_experts: 6,
        top_k: 2,
        expert_ffn: 8,
        renormalize: true,
    };
    let (f, e) = (shape.expert_ffn as usize, shape.num_experts as usize);
    let (mut mlp, w) = build(&rig, &mut d, shape, true);
    // gate|up with a scale row per weight row (8-row parts), down with 128-row blocks.
    let (gu_q, gu_deq) = fp8_pair(&rig, &w.gate_up, &[e, 2 * f, H], true);
    let (down_q, down_deq) = fp8_pair(&rig, &w.down, &[e, H, f], false);
    let buf = buffers(&rig, shape);
    let x = d.bf16s(5 * H, -1.0, 1.0);
    mlp.experts_gate_up = gu_deq;
    mlp.experts_down = down_deq;
    let want = run(&rig, &mlp, &buf, &x);
    mlp.experts_gate_up = gu_q;
    mlp.experts_down = down_q;
    let got = run(&rig, &mlp, &buf, &x);
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&got),
        bits(&want),
        "FP8 experts vs their dequantized bf16"
    );
    assert!(
        got.iter().all(|v| v.is_finite()),
        "the layer wrote every output"
    );
}
