//! The capture test: one decode step of a small attention + MLP layer and the LM head, launched
//! eagerly and as a captured CUDA graph, must give bitwise the same results, also after the
//! step's inputs (residual rows, positions, slots) change at the same addresses.

use std::sync::Arc;

use metrale_gpu_runtime::{DevicePtr, GpuBackend, GpuBackendExt, GpuResult};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::{KvStore, Matrix, Norm, PagedAttention, QkNormRope};

use super::harness::{self, Rng, S, TestCuda};

const ROWS: u32 = 4;
const HIDDEN: u32 = 512;
const HQ: u32 = 4;
const HKV: u32 = 2;
const D: u32 = 64;
const Q_STRIDE: u32 = 2 * D; // gated queries
const QKV: u32 = HQ * Q_STRIDE + 2 * HKV * D;
const FFN: u32 = 1000;
const VOCAB: u32 = 1003;
const BLOCK: u32 = 16;
const MAX_BLOCKS: u32 = 8;
const NUM_BLOCKS: u32 = 40;

/// Device buffers of the step, allocated once (fixed addresses, as in a captured decode).
struct Step {
    gpu: Arc<dyn GpuBackend>,
    ops: Ops,
    b: std::collections::HashMap<&'static str, DevicePtr>,
    _device: harness::DeviceTurn,
}

impl Step {
    fn new(rng: &mut Rng) -> Step {
        let gpu: Arc<dyn GpuBackend> = TestCuda::new();
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let mut step = Step {
            gpu,
            ops,
            b: Default::default(),
            _device: harness::device_shared(),
        };
        let w = |rng: &mut Rng, n: u32, k: u32| {
            let s = (3.0 / k as f32).sqrt();
            rng.bf16s((n * k) as usize, -s, s)
        };
        let near_one = |rng: &mut Rng, n: u32| rng.bf16s(n as usize, 0.8, 1.2);
        step.upload("w_norm1", &near_one(rng, HIDDEN));
        step.upload("w_qkv", &w(rng, QKV, HIDDEN));
        step.upload("q_norm", &near_one(rng, D));
        step.upload("k_norm", &near_one(rng, D));
        let freqs: Vec<f32> = (0..D / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / D as f32))
            .collect();
        step.upload("inv_freq", &freqs);
        step.upload("w_o", &w(rng, HIDDEN, HQ * D));
        step.upload("w_norm2", &near_one(rng, HIDDEN));
        step.upload("w_gate_up", &w(rng, 2 * FFN, HIDDEN));
        step.upload("w_down", &w(rng, HIDDEN, FFN));
        step.upload("w_norm3", &near_one(rng, HIDDEN));
        step.upload("w_lm", &w(rng, VOCAB, HIDDEN));
        let cache = (NUM_BLOCKS * BLOCK * HKV * D) as usize;
        step.upload("k_cache", &rng.bf16s(cache, -2.0, 2.0));
        step.upload("v_cache", &rng.bf16s(cache, -2.0, 2.0));
        // Sequence r owns blocks r, r + ROWS, r + 2 * ROWS, ... (interleaved, non-contiguous).
        let tables: Vec<u32> = (0..ROWS * MAX_BLOCKS)
            .map(|i| (i % MAX_BLOCKS) * ROWS + i / MAX_BLOCKS)
            .collect();
        step.upload("block_tables", &tables);
        step.upload("row_seq", &(0..ROWS).collect::<Vec<u32>>());
        for (name, bytes) in [
            ("input", ROWS * HIDDEN * 4),
            ("positions", ROWS * 4),
            ("slot_mapping", ROWS * 4),
            ("residual", ROWS * HIDDEN * 4),
            ("normed", ROWS * HIDDEN * 2),
            ("qkv", ROWS * QKV * 2),
            ("attn", ROWS * HQ * D * 2),
            ("o", ROWS * HIDDEN * 2),
            ("normed2", ROWS * HIDDEN * 2),
            ("gu", ROWS * 2 * FFN * 2),
            ("act", ROWS * FFN * 2),
            ("down", ROWS * HIDDEN * 2),
            ("normed3", ROWS * HIDDEN * 2),
            ("logits", ROWS * VOCAB * 4),
            ("tokens", ROWS * 4),
        ] {
            let p = step.gpu.alloc(bytes as usize).expect("alloc");
            step.gpu.memset(p, 0xFF, bytes as usize, S).expect("poison");
            step.b.insert(name, p);
        }
        step
    }

    fn upload<T: bytemuck::Pod>(&mut self, name: &'static str, data: &[T]) {
        let p = self.gpu.alloc_upload(data, S).expect("upload");
        self.b.insert(name, p);
    }

    fn at(&self, name: &str) -> DevicePtr {
        self.b[name]
    }

    /// New inputs: residual rows, and a position per sequence with the slot it maps to.
    fn set_inputs(&self, rng: &mut Rng) {
        self.gpu
            .upload(
                self.at("input"),
                &rng.f32s((ROWS * HIDDEN) as usize, -3.0, 3.0),
                S,
            )
            .expect("input");
        let positions: Vec<u32> = (0..ROWS).map(|_| rng.below(MAX_BLOCKS * BLOCK)).collect();
        let slots: Vec<u32> = positions
            .iter()
            .enumerate()
            .map(|(r, &pos)| ((pos / BLOCK) * ROWS + r as u32) * BLOCK + pos % BLOCK)
            .collect();
        self.gpu
            .upload(self.at("positions"), &positions, S)
            .expect("positions");
        self.gpu
            .upload(self.at("slot_mapping"), &slots, S)
            .expect("slots");
    }

    /// The step: every launch reads and writes fixed addresses only.
    fn launch(&self) -> GpuResult<()> {
        let (o, b) = (&self.ops, |n: &str| self.at(n));
        let rows = |n: &str, cols: u32| Matrix::bf16(b(n), ROWS, cols);
        let weight = |n: &str, out: u32, inputs: u32| Matrix::bf16(b(n), out, inputs);
        let residual = Matrix::f32(b("residual"), ROWS, HIDDEN);
        let norm = |n: &str| Norm {
            w: b(n),
            eps: 1e-6,
            unit_offset: false,
        };
        self.gpu
            .copy_d2d(b("residual"), b("input"), (ROWS * HIDDEN * 4) as usize, S)?;
        o.rms_norm(S, rows("normed", HIDDEN), residual, &norm("w_norm1"))?;
        let normed = rows("normed", HIDDEN);
        o.linear(S, rows("qkv", QKV), normed, weight("w_qkv", QKV, HIDDEN))?;
        let k_offset = HQ * Q_STRIDE;
        o.qk_norm_rope(
            S,
            &QkNormRope {
                qkv: b("qkv"),
                q_norm: b("q_norm"),
                k_norm: b("k_norm"),
                inv_freq: b("inv_freq"),
                positions: b("positions"),
                rows: ROWS,
                row_stride: QKV,
                num_q_heads: HQ,
                q_head_stride: Q_STRIDE,
                k_offset,
                num_kv_heads: HKV,
                head_dim: D,
                rotary_dim: D,
                attention_scaling: 1.0,
                eps: 1e-6,
                unit_offset: true,
            },
        )?;
        o.kv_store(
            S,
            &KvStore {
                k_cache: b("k_cache"),
                v_cache: b("v_cache"),
                qkv: b("qkv"),
                slot_mapping: b("slot_mapping"),
                rows: ROWS,
                row_stride: QKV,
                k_offset,
                v_offset: k_offset + HKV * D,
                num_kv_heads: HKV,
                head_dim: D,
                num_slots: NUM_BLOCKS * BLOCK,
                kv_fp8: 0,
                k_scale: 1.0,
                v_scale: 1.0,
            },
        )?;
        o.paged_attention(
            S,
            &PagedAttention {
                out: b("attn"),
                qkv: b("qkv"),
                k_cache: b("k_cache"),
                v_cache: b("v_cache"),
                block_tables: b("block_tables"),
                row_seq: b("row_seq"),
                positions: b("positions"),
                rows: ROWS,
                row_stride: QKV,
                q_head_stride: Q_STRIDE,
                num_q_heads: HQ,
                num_kv_heads: HKV,
                head_dim: D,
                block_size: BLOCK,
                max_blocks: MAX_BLOCKS,
                num_seqs: ROWS,
                num_slots: NUM_BLOCKS * BLOCK,
                scale: 1.0 / (D as f32).sqrt(),
                gated: true,
                kv_dtype: metrale_cache::KvDtype::Bf16,
                kv_scales: metrale_cache::KvScales::default(),
            },
        )?;
        let attn = rows("attn", HQ * D);
        o.linear(S, rows("o", HIDDEN), attn, weight("w_o", HIDDEN, HQ * D))?;
        let (o_rows, normed2) = (rows("o", HIDDEN), rows("normed2", HIDDEN));
        o.add_rms_norm(S, residual, o_rows, normed2, &norm("w_norm2"))?;
        let gate_up = weight("w_gate_up", 2 * FFN, HIDDEN);
        o.linear(S, rows("gu", 2 * FFN), normed2, gate_up)?;
        o.silu_mul(S, rows("act", FFN), rows("gu", 2 * FFN))?;
        let down = weight("w_down", HIDDEN, FFN);
        o.linear(S, rows("down", HIDDEN), rows("act", FFN), down)?;
        let (down_rows, normed3) = (rows("down", HIDDEN), rows("normed3", HIDDEN));
        o.add_rms_norm(S, residual, down_rows, normed3, &norm("w_norm3"))?;
        let logits = Matrix::f32(b("logits"), ROWS, VOCAB);
        o.linear_f32out(S, logits, normed3, weight("w_lm", VOCAB, HIDDEN))?;
        o.argmax(S, b("tokens"), logits)
    }

    /// Everything the step writes, as raw bits.
    fn outputs(&self) -> Vec<(&'static str, Vec<u32>)> {
        let names = ["residual", "qkv", "attn", "gu", "logits", "tokens"];
        let sizes = [
            ROWS * HIDDEN,
            ROWS * QKV / 2,
            ROWS * HQ * D / 2,
            ROWS * FFN,
            ROWS * VOCAB,
            ROWS,
        ];
        names
            .iter()
            .zip(sizes)
            .map(|(&n, len)| {
                (
                    n,
                    self.gpu
                        .download::<u32>(self.at(n), len as usize, S)
                        .expect("download"),
                )
            })
            .collect()
    }
}

#[test]
fn a_captured_step_replays_bitwise_like_eager_with_new_inputs() {
    let mut rng = Rng::new(11);
    let step = Step::new(&mut rng);
    step.gpu.begin_capture(S).expect("begin capture");
    step.launch().expect("launches record while capturing");
    let graph = step.gpu.end_capture(S).expect("end capture");
    let mut previous_tokens = None;
    for replay in 0..2 {
        let mut inputs = Rng::new(100 + replay);
        step.set_inputs(&mut inputs);
        step.launch().expect("eager step");
        let eager = step.outputs();
        assert!(eager.iter().all(|(_, v)| !v.is_empty()));
        let logits = &eager
            .iter()
            .find(|(n, _)| *n == "logits")
            .expect("logits")
            .1;
        assert!(
            logits.iter().all(|&b| !f32::from_bits(b).is_nan()),
            "eager logits hold NaN"
        );
        step.set_inputs(&mut Rng::new(100 + replay));
        step.gpu.launch_graph(graph, S).expect("graph launch");
        let graphed = step.outputs();
        for ((name, e), (_, g)) in eager.iter().zip(&graphed) {
            assert!(
                e == g,
                "replay {replay}: `{name}` differs between eager and graph"
            );
        }
        let tokens = eager.last().map(|(_, t)| t.clone());
        assert_ne!(tokens, previous_tokens, "new inputs should give new tokens");
        previous_tokens = tokens;
        println!(
            "kernel-check {:<18} {:<44} bitwise equal to eager (tokens {:?}) ok",
            "capture",
            format!("replay {replay} with new inputs"),
            previous_tokens.as_deref().unwrap_or(&[])
        );
    }
    step.gpu.destroy_graph(graph).expect("destroy graph");
}
