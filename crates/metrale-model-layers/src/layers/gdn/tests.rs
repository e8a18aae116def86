//! Layer-level tests of `GatedDeltaNet` on the CPU backend: a prefill followed by decode steps
//! continues the state exactly as token-by-token steps do, a sequence's output and state do not
//! depend on the other sequences (or padding rows) of its step, and a verify step is decode
//! steps bitwise, keeping each row's state. Its `Rig` serves the MoE layer tests too.

use std::sync::Arc;

use half::bf16;
use metrale_cache::{SsmLayout, SsmStatePool};
use metrale_gpu_runtime::{CpuBackend, DType, DevicePtr, GpuBackend, GpuBackendExt, StreamHandle};
use metrale_testkit::Rng;

use super::{GatedDeltaNet, GdnShape, InProjSource};
use crate::layer::{
    Activations, GdnBuffers, LayerCtx, ModelDims, SsmBinding, StepBuffers, StepMeta, StepShape,
};
use crate::ops::Ops;
use crate::ops_hybrid::GdnHeads;
use crate::weight_map::DenseWeight;

mod split;

/// The CPU backend, its launchers and a stream.
pub(crate) struct Rig {
    pub gpu: Arc<dyn GpuBackend>,
    pub ops: Ops,
    pub s: StreamHandle,
}

impl Rig {
    pub fn new() -> Rig {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        Rig {
            ops: Ops::new(gpu.clone()).expect("every kernel resolves on the CPU"),
            s: gpu.default_stream(),
            gpu,
        }
    }
    pub fn put<T: bytemuck::Pod>(&self, v: &[T]) -> DevicePtr {
        self.gpu.alloc_upload(v, self.s).expect("upload")
    }
    /// A buffer of `bytes`, left as the CPU backend allocates it (0xFF: NaN).
    pub fn buf(&self, bytes: usize) -> DevicePtr {
        self.gpu.alloc(bytes).expect("alloc")
    }
    pub fn bf16_weight(&self, shape: &[usize], values: &[bf16]) -> DenseWeight {
        DenseWeight {
            ptr: self.put(values),
            shape: shape.to_vec(),
            dtype: DType::Bf16,
            scales: None,
        }
    }
    pub fn f32_weight(&self, values: &[f32]) -> DenseWeight {
        DenseWeight {
            ptr: self.put(values),
            shape: vec![values.len()],
            dtype: DType::F32,
            scales: None,
        }
    }
    pub fn dims(hidden: u32) -> ModelDims {
        ModelDims {
            hidden,
            num_q_heads: 1,
            num_kv_heads: 1,
            head_dim: 1,
            rotary_dim: 0,
            rope_attention_scaling: 1.0,
            attn_gated: false,
            ffn: 1,
            vocab: 1,
            eps: 1e-6,
            unit_offset: true,
            tp_size: 1,
        }
    }
}

const HIDDEN: usize = 32;
const MAX_ROWS: usize = 128;
const MAX_SEQS: usize = 4;
const SLOTS: usize = 8;

/// One sequence's rows in a step: its slot, first position and inputs (`[n, HIDDEN]`).
struct SeqRows<'a> {
    slot: u32,
    pos0: u32,
    x: &'a [bf16],
}

/// A GDN layer, its SSM pool and step buffers on the CPU backend.
struct Harness {
    rig: Rig,
    layer: GatedDeltaNet,
    pool: SsmStatePool,
    buf: StepBuffers,
}

impl Harness {
    fn new(seed: u64) -> Harness {
        Harness::with_layout(seed, false)
    }

    /// The layer of seed `seed`; `split`: its input projection's b|a rows a weight of their own
    /// (`in_proj_ba`, as a block-FP8 layer holds them), the same values.
    fn with_layout(seed: u64, split: bool) -> Harness {
        let rig = Rig::new();
        let mut d = Rng::new(seed);
        let shape = GdnShape {
            heads: GdnHeads {
                num_k_heads: 2,
                k_head_dim: 16,
                num_v_heads: 4,
                v_head_dim: 8,
            },
            conv_kernel: 4,
            eps: 1e-6,
        };
        let h = shape.heads;
        let (pw, cd, vd, hv) = (
            h.proj_width() as usize,
            h.conv_dim() as usize,
            h.value_dim() as usize,
            h.num_v_heads as usize,
        );
        let k = shape.conv_kernel as usize;
        let in_proj = d.bf16s(pw * HIDDEN, -0.4, 0.4);
        let (in_proj, in_proj_ba) = if split {
            let qkvz = pw - 2 * hv;
            (
                rig.bf16_weight(&[qkvz, HIDDEN], &in_proj[..qkvz * HIDDEN]),
                Some(rig.bf16_weight(&[2 * hv, HIDDEN], &in_proj[qkvz * HIDDEN..])),
            )
        } else {
            (rig.bf16_weight(&[pw, HIDDEN], &in_proj), None)
        };
        let layer = GatedDeltaNet {
            in_proj,
            in_proj_ba,
            conv1d: rig.bf16_weight(&[cd, k], &d.bf16s(cd * k, -0.6, 0.6)),
            a_log: rig.f32_weight(
                &d.f32s(hv, -1.2, 1.2)
                    .iter()
                    .map(|v| v - 0.8)
                    .collect::<Vec<_>>(),
            ),
            dt_bias: rig.f32_weight(&d.f32s(hv, -1.0, 1.0)),
            norm: rig.bf16_weight(
                &[h.v_head_dim as usize],
                &d.bf16s(h.v_head_dim as usize, -0.3, 0.3)
                    .iter()
                    .map(|w| bf16::from_f32(1.0 + w.to_f32()))
                    .collect::<Vec<_>>(),
            ),
            out_proj: rig.bf16_weight(&[HIDDEN, vd], &d.bf16s(HIDDEN * vd, -0.3, 0.3)),
            shape,
        };
        let pool = SsmStatePool::new(
            rig.gpu.clone(),
            SsmLayout {
                num_gdn_layers: 1,
                slots: SLOTS,
                conv_dim: cd,
                conv_kernel: k,
                num_v_heads: hv,
                k_head_dim: h.k_head_dim as usize,
                v_head_dim: h.v_head_dim as usize,
            },
        )
        .expect("pool");
        let r = MAX_ROWS;
        let buf = StepBuffers {
            acts: Activations {
                normed: rig.buf(r * HIDDEN * 2),
                delta: rig.buf(r * HIDDEN * 2),
                ..Default::default()
            },
            meta: StepMeta {
                positions: rig.buf(r * 4),
                row_seq: rig.buf(r * 4),
                seq_start: rig.buf((MAX_SEQS + 1) * 4),
                seq_slot: rig.buf(MAX_SEQS * 4),
                row_slot: rig.buf(r * 4),
                ..Default::default()
            },
            gdn: GdnBuffers {
                proj: rig.buf(r * pw * 2),
                conv: rig.buf(r * cd * 2),
                qk: rig.buf(r * 2 * h.key_dim() as usize * 4),
                gates: rig.buf(r * 2 * hv * 4),
                core: rig.buf(r * vd * 4),
                normed: rig.buf(r * vd * 2),
            },
            ..StepBuffers::default()
        };
        let mut hs = Harness {
            rig,
            layer,
            pool,
            buf,
        };
        for _ in 0..SLOTS {
            let slot = hs.pool.alloc_slot().expect("slot");
            hs.pool.zero_slot(slot, hs.rig.s).expect("zero");
        }
        hs
    }

    /// Run one step over `seqs`; returns the layer's output rows.
    fn step(&self, seqs: &[SeqRows<'_>]) -> Vec<bf16> {
        self.run(seqs, None)
    }

    /// Run one step over `seqs`, a verify step keeping each row's state in `row_slots` when
    /// given; returns the layer's output rows.
    fn run(&self, seqs: &[SeqRows<'_>], row_slots: Option<&[u32]>) -> Vec<bf16> {
        let (r, b) = (&self.rig, &self.buf);
        let (mut x, mut row_seq, mut start, mut slots, mut pos) =
            (Vec::new(), Vec::new(), vec![0u32], Vec::new(), Vec::new());
        for (i, q) in seqs.iter().enumerate() {
            let n = q.x.len() / HIDDEN;
            x.extend_from_slice(q.x);
            row_seq.extend(std::iter::repeat_n(i as u32, n));
            pos.extend((0..n as u32).map(|t| q.pos0 + t));
            start.push(start[i] + n as u32);
            slots.push(q.slot);
        }
        let rows = row_seq.len() as u32;
        r.gpu.upload(b.acts.normed, &x, r.s).expect("upload");
        r.gpu.upload(b.meta.row_seq, &row_seq, r.s).expect("upload");
        r.gpu.upload(b.meta.positions, &pos, r.s).expect("upload");
        r.gpu.upload(b.meta.seq_start, &start, r.s).expect("upload");
        r.gpu.upload(b.meta.seq_slot, &slots, r.s).expect("upload");
        if let Some(rs) = row_slots {
            r.gpu.upload(b.meta.row_slot, rs, r.s).expect("upload");
        }
        let p = self.pool.layer(0).expect("layer 0");
        let dims = Rig::dims(HIDDEN as u32);
        let cx = LayerCtx {
            ops: &r.ops,
            stream: r.s,
            buf: b,
            shape: StepShape {
                rows,
                num_seqs: seqs.len() as u32,
                max_blocks: 1,
                logit_rows: 0,
                verify: row_slots.is_some(),
                att_groups: 0,
                att_split: 0,
                att_prompt: 0,
            },
            dims: &dims,
            kv: None,
            ssm: Some(SsmBinding {
                conv: p.conv,
                recurrent: p.recurrent,
                conv_slot_stride: (p.conv_slot_bytes / 4) as u32,
                recurrent_slot_stride: (p.recurrent_slot_bytes / 4) as u32,
                num_slots: SLOTS as u32,
            }),
            first: false,
        };
        self.layer.forward(&cx, None).expect("forward");
        r.gpu
            .download(b.acts.delta, rows as usize * HIDDEN, r.s)
            .expect("download")
    }

    /// Slot `slot`'s conv window and recurrent state.
    fn state(&self, slot: u32) -> (Vec<f32>, Vec<f32>) {
        let (p, l) = (self.pool.layer(0).expect("layer 0"), self.pool.layout());
        let (nc, nr) = (l.conv_slot_elems(), l.recurrent_slot_elems());
        let conv = self
            .rig
            .gpu
            .download::<f32>(p.conv, SLOTS * nc, self.rig.s)
            .expect("conv");
        let rec = self
            .rig
            .gpu
            .download::<f32>(p.recurrent, SLOTS * nr, self.rig.s)
            .expect("rec");
        let s = slot as usize;
        (
            conv[s * nc..(s + 1) * nc].to_vec(),
            rec[s * nr..(s + 1) * nr].to_vec(),
        )
    }
}

fn bits16(v: &[bf16]) -> Vec<u16> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn bits32(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rms(v: &[f64]) -> f64 {
    (v.iter().map(|x| x * x).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

/// `|got - want| <= rel * max(|want|, rms(want))`, no NaN.
fn assert_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    let floor = rms(want);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g}");
        assert!(
            (g - w).abs() <= rel * w.abs().max(floor),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn to64(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

#[test]
fn prefill_then_decode_continues_the_state_of_token_by_token_steps() {
    let hs = Harness::new(101);
    let mut d = Rng::new(103);
    let (n, m) = (70usize, 3usize);
    let x = d.bf16s((n + m) * HIDDEN, -1.0, 1.0);
    // Slot 0: a 70-row prefill (two chunks), then three decode steps.
    let mut chunked = hs.step(&[SeqRows {
        slot: 0,
        pos0: 0,
        x: &x[..n * HIDDEN],
    }]);
    for t in n..n + m {
        chunked.extend(hs.step(&[SeqRows {
            slot: 0,
            pos0: t as u32,
            x: &x[t * HIDDEN..(t + 1) * HIDDEN],
        }]));
    }
    // Slot 1: every token alone.
    let mut single = Vec::new();
    for t in 0..n + m {
        single.extend(hs.step(&[SeqRows {
            slot: 1,
            pos0: t as u32,
            x: &x[t * HIDDEN..(t + 1) * HIDDEN],
        }]));
    }
    assert_close(
        &to64(&chunked),
        &to64(&single),
        2e-2,
        "prefill+decode vs token by token",
    );
    let ((c0, r0), (c1, r1)) = (hs.state(0), hs.state(1));
    assert_eq!(
        bits32(&c0),
        bits32(&c1),
        "the conv window holds the same inputs"
    );
    let f = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert_close(&f(&r0), &f(&r1), 1e-4, "recurrent state");
    assert!(r0.iter().any(|&v| v != 0.0), "the state moved");
}

#[test]
fn a_sequence_computes_the_same_bits_alone_or_beside_others() {
    let mut d = Rng::new(107);
    let (a, b) = (
        d.bf16s(38 * HIDDEN, -1.0, 1.0),
        d.bf16s(80 * HIDDEN, -1.0, 1.0),
    );
    let pad = d.bf16s(HIDDEN, -1.0, 1.0);
    let (a_pre, a_dec) = (&a[..37 * HIDDEN], &a[37 * HIDDEN..]);
    let (b_pre, b_more) = (&b[..70 * HIDDEN], &b[70 * HIDDEN..]);

    // Together: prefill A (37) and B (70) beside a padding row; then A's decode beside B's
    // next 10 prefill rows (a chunked step, where A's row is a one-row chunk).
    let together = Harness::new(109);
    let t1 = together.step(&[
        SeqRows {
            slot: 0,
            pos0: 0,
            x: a_pre,
        },
        SeqRows {
            slot: u32::MAX,
            pos0: 0,
            x: &pad,
        },
        SeqRows {
            slot: 2,
            pos0: 0,
            x: b_pre,
        },
    ]);
    let t2 = together.step(&[
        SeqRows {
            slot: 2,
            pos0: 70,
            x: b_more,
        },
        SeqRows {
            slot: 0,
            pos0: 37,
            x: a_dec,
        },
    ]);

    // Alone: A's prefill, then A's decode (a recurrent step); B's prefill, then B's 10 rows.
    let alone = Harness::new(109);
    let a1 = alone.step(&[SeqRows {
        slot: 0,
        pos0: 0,
        x: a_pre,
    }]);
    let a2 = alone.step(&[SeqRows {
        slot: 0,
        pos0: 37,
        x: a_dec,
    }]);
    let b1 = alone.step(&[SeqRows {
        slot: 2,
        pos0: 0,
        x: b_pre,
    }]);
    let b2 = alone.step(&[SeqRows {
        slot: 2,
        pos0: 70,
        x: b_more,
    }]);

    let h = HIDDEN;
    assert_eq!(bits16(&t1[..37 * h]), bits16(&a1), "A's prefill");
    assert_eq!(bits16(&t1[38 * h..]), bits16(&b1), "B's prefill");
    assert_eq!(bits16(&t2[..10 * h]), bits16(&b2), "B's continuation");
    assert_eq!(bits16(&t2[10 * h..]), bits16(&a2), "A's decode");
    for slot in [0, 2] {
        let (ct, rt) = together.state(slot);
        let (ca, ra) = alone.state(slot);
        assert_eq!(bits32(&ct), bits32(&ca), "conv window of slot {slot}");
        assert_eq!(bits32(&rt), bits32(&ra), "recurrent state of slot {slot}");
    }
    let (c1, r1) = together.state(1);
    assert!(
        c1.iter().chain(&r1).all(|&v| v == 0.0),
        "the padding sequence wrote no state"
    );
}

#[test]
fn a_gdn_layer_without_an_ssm_binding_is_refused() {
    let hs = Harness::new(113);
    let dims = Rig::dims(HIDDEN as u32);
    let cx = LayerCtx {
        ops: &hs.rig.ops,
        stream: hs.rig.s,
        buf: &hs.buf,
        shape: StepShape {
            rows: 1,
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
    assert!(hs.layer.forward(&cx, None).is_err());
}

#[test]
fn qwen3_next_rows_regroup_per_key_head_projections() {
    // Hk = 2, Dk = 2, Hv = 4 (r = 2), Dv = 1: qkvz groups of G = 2*2 + 2*2*1 = 8 rows.
    let shape = GdnShape {
        heads: GdnHeads {
            num_k_heads: 2,
            k_head_dim: 2,
            num_v_heads: 4,
            v_head_dim: 1,
        },
        conv_kernel: 4,
        eps: 1e-6,
    };
    use InProjSource::{Ba, Qkvz};
    let want = [
        // q: heads 0, 1
        Qkvz(0),
        Qkvz(1),
        Qkvz(8),
        Qkvz(9),
        // k
        Qkvz(2),
        Qkvz(3),
        Qkvz(10),
        Qkvz(11),
        // v: value heads 0, 1 (key head 0), 2, 3 (key head 1)
        Qkvz(4),
        Qkvz(5),
        Qkvz(12),
        Qkvz(13),
        // z
        Qkvz(6),
        Qkvz(7),
        Qkvz(14),
        Qkvz(15),
        // b, then a
        Ba(0),
        Ba(1),
        Ba(4),
        Ba(5),
        Ba(2),
        Ba(3),
        Ba(6),
        Ba(7),
    ];
    let got = shape.qwen3_next_in_proj_rows();
    assert_eq!(got.len(), shape.heads.proj_width() as usize);
    assert_eq!(got, want);
}

#[test]
fn a_verify_step_is_decode_steps_bitwise_and_keeps_the_state_after_each_row() {
    let mut d = Rng::new(127);
    let (n, k) = (20usize, 4usize);
    let x = d.bf16s((n + k) * HIDDEN, -1.0, 1.0);
    let other = d.bf16s(2 * HIDDEN, -1.0, 1.0);
    let prefill = |hs: &Harness| {
        hs.step(&[SeqRows {
            slot: 0,
            pos0: 0,
            x: &x[..n * HIDDEN],
        }])
    };
    // Verify: the four rows at once beside another sequence's two-row verify; rows 0..3 keep
    // their state in slots 4..6 and the sequence's own slot 0 (so slot 0 ends as decode's).
    let verify = Harness::new(131);
    prefill(&verify);
    let got = verify.run(
        &[
            SeqRows {
                slot: 0,
                pos0: n as u32,
                x: &x[n * HIDDEN..],
            },
            SeqRows {
                slot: 1,
                pos0: 3,
                x: &other,
            },
        ],
        Some(&[4, 5, 6, 0, 7, u32::MAX]),
    );
    // Decode: one row per step, the state after each read from slot 0.
    let decode = Harness::new(131);
    prefill(&decode);
    for t in 0..k {
        let want = decode.step(&[SeqRows {
            slot: 0,
            pos0: (n + t) as u32,
            x: &x[(n + t) * HIDDEN..(n + t + 1) * HIDDEN],
        }]);
        assert_eq!(
            bits16(&got[t * HIDDEN..(t + 1) * HIDDEN]),
            bits16(&want),
            "row {t}: the verify output is not the decode step's"
        );
        let kept = [4, 5, 6, 0][t];
        let ((cv, rv), (cd, rd)) = (verify.state(kept), decode.state(0));
        assert_eq!(bits32(&cv), bits32(&cd), "conv window after row {t}");
        assert_eq!(bits32(&rv), bits32(&rd), "recurrent state after row {t}");
    }
    // The other sequence's own slot was only read.
    let ((c1, r1), (c1d, r1d)) = (verify.state(1), decode.state(1));
    assert_eq!((bits32(&c1), bits32(&r1)), (bits32(&c1d), bits32(&r1d)));
}
