//! The executor on synthetic bindings (no memory is touched: programs are only recorded): a
//! well-bound model compiles one program per width with the plan's launch count; each binding
//! problem is named, and all of a model's problems come in one error; a weight of the wrong
//! format is refused at compile; the recorder records launches and refuses everything else.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use metrale_circuit::{
    Architecture, Dims, FfnKind, GdnDims, Instance, KvFormat, LayerKind, LayerSpec, LinearRole,
    MoeDims, SharedExpertDims, WeightFormat, Width,
};
use metrale_gpu_runtime::{CpuBackend, DType, DevicePtr, GpuBackend, StreamHandle};

use super::*;
use crate::layer::{
    Activations, GdnBuffers, HeadBuffers, KvBinding, MoeBuffers, SsmBinding, StepBuffers, StepMeta,
};
use crate::layers::MoeShape;
use crate::ops_hybrid::GdnHeads;
use crate::weight_map::DenseWeight;

mod refusals;
mod speculative;

pub(super) const FA_MOE: LayerSpec = LayerSpec {
    kind: LayerKind::FullAttention,
    ffn: FfnKind::Moe,
};
pub(super) const LA_MOE: LayerSpec = LayerSpec {
    kind: LayerKind::LinearAttention,
    ffn: FfnKind::Moe,
};

/// Distinct fake addresses, so a launch that reads the wrong buffer shows in its arguments.
#[derive(Debug, Default)]
pub(super) struct Addr(pub(super) u64);

impl Addr {
    fn next(&mut self) -> DevicePtr {
        self.0 += 0x1000;
        DevicePtr(self.0)
    }

    pub(super) fn weight(&mut self, shape: &[usize], dtype: DType) -> BoundWeight {
        BoundWeight::Dense(DenseWeight {
            ptr: self.next(),
            shape: shape.to_vec(),
            dtype,
            scales: None,
        })
    }
}

/// A Qwen3-Next-like instance: GDN and gated attention, MoE FFNs with a gated shared expert.
/// Every dimension differs from the others.
pub(super) fn instance(layers: Vec<LayerSpec>) -> Instance {
    Instance {
        architecture: Architecture::HybridMoe,
        dims: Dims {
            hidden: 64,
            vocab: 256,
            ffn: 0,
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            blocks_per_seq: 8,
            gdn: Some(GdnDims {
                num_k_heads: 2,
                k_head_dim: 12,
                num_v_heads: 4,
                v_head_dim: 10,
                conv_kernel: 4,
            }),
            moe: Some(MoeDims {
                num_experts: 8,
                top_k: 3,
                expert_ffn: 24,
                shared: Some(SharedExpertDims {
                    ffn: 40,
                    gated: true,
                }),
            }),
        },
        layers,
        widths: vec![1, 2, 4],
        verify_rows: vec![2, 3, 4, 5],
        verify_batches: vec![Width::new(5, 2), Width::new(8, 2)],
        draft_rows: vec![1, 2, 3, 4, 5],
        draft_batches: vec![Width::new(4, 2)],
        draft_layer: Some(FA_MOE),
        argmax: false,
        weights: WeightFormat::Bf16,
        kv_cache: KvFormat::Bf16,
    }
}

pub(super) fn dims() -> ModelDims {
    ModelDims {
        hidden: 64,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        rotary_dim: 8,
        rope_attention_scaling: 1.25,
        attn_gated: true,
        ffn: 0,
        vocab: 256,
        eps: 1e-6,
        unit_offset: true,
        tp_size: 1,
    }
}

pub(super) fn heads() -> GdnHeads {
    GdnHeads {
        num_k_heads: 2,
        k_head_dim: 12,
        num_v_heads: 4,
        v_head_dim: 10,
    }
}

pub(super) fn moe_layer(a: &mut Addr, weights: &mut BTreeMap<WeightSlot, BoundWeight>) -> FfnFacts {
    use LinearRole::*;
    let b = DType::Bf16;
    weights.insert(WeightSlot::Linear(Router), a.weight(&[8, 64], b));
    weights.insert(WeightSlot::Linear(ExpertGateUp), a.weight(&[8, 48, 64], b));
    weights.insert(WeightSlot::Linear(ExpertDown), a.weight(&[8, 64, 24], b));
    weights.insert(WeightSlot::Linear(SharedGateUp), a.weight(&[80, 64], b));
    weights.insert(WeightSlot::Linear(SharedDown), a.weight(&[64, 40], b));
    weights.insert(WeightSlot::Linear(SharedGate), a.weight(&[1, 64], b));
    FfnFacts::Moe(MoeFacts {
        shape: MoeShape {
            num_experts: 8,
            top_k: 3,
            expert_ffn: 24,
            renormalize: true,
        },
        shared: Some(SharedFacts {
            ffn: 40,
            gated: true,
        }),
    })
}

pub(super) fn layer(a: &mut Addr, spec: LayerSpec) -> CircuitLayer {
    let b = DType::Bf16;
    let mut weights = BTreeMap::new();
    weights.insert(WeightSlot::InputNorm, a.weight(&[64], b));
    weights.insert(WeightSlot::PostNorm, a.weight(&[64], b));
    let mixer = match spec.kind {
        LayerKind::FullAttention => {
            let qkv = 4 * 2 * 16 + 2 * 2 * 16;
            weights.insert(WeightSlot::Linear(LinearRole::Qkv), a.weight(&[qkv, 64], b));
            weights.insert(WeightSlot::Linear(LinearRole::O), a.weight(&[64, 64], b));
            weights.insert(WeightSlot::QNorm, a.weight(&[16], b));
            weights.insert(WeightSlot::KNorm, a.weight(&[16], b));
            MixerFacts::Attention(AttnFacts {
                num_q_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                gated: true,
                qk_norm: true,
                rope: RopeFacts {
                    rotary_dim: 8,
                    attention_scaling: 1.25,
                },
                softmax_scale: 0.25,
            })
        }
        LayerKind::LinearAttention => {
            let h = heads();
            let proj = h.proj_width() as usize;
            let conv = h.conv_dim() as usize;
            let gdn = [
                (WeightSlot::Linear(LinearRole::GdnInProj), vec![proj, 64], b),
                (WeightSlot::Linear(LinearRole::GdnOut), vec![64, 40], b),
                (WeightSlot::GdnConv1d, vec![conv, 1, 4], b),
                (WeightSlot::GdnALog, vec![4], DType::F32),
                (WeightSlot::GdnDtBias, vec![4], DType::F32),
                (WeightSlot::GdnNorm, vec![10], b),
            ];
            for (slot, shape, dtype) in gdn {
                weights.insert(slot, a.weight(&shape, dtype));
            }
            MixerFacts::Gdn(GdnFacts {
                heads: h,
                conv_kernel: 4,
                eps: 1e-6,
                l2_eps: 1e-6,
                q_scale: 12f32.powf(-0.5),
            })
        }
    };
    let ffn = moe_layer(a, &mut weights);
    CircuitLayer {
        mixer,
        ffn,
        weights,
        unmodelled: Vec::new(),
    }
}

/// A full-attention layer's KV pools: 512 slots in blocks of 16.
fn attention_pools(a: &mut Addr) -> LayerPools {
    LayerPools {
        kv: Some(KvBinding {
            k: a.next(),
            v: a.next(),
            block_size: 16,
            num_slots: 512,
            dtype: metrale_cache::KvDtype::Bf16,
            scales: metrale_cache::KvScales::default(),
        }),
        ssm: None,
    }
}

pub(super) fn head(a: &mut Addr) -> HeadBinding {
    HeadBinding {
        embedding: a.weight(&[256, 64], DType::Bf16),
        final_norm: a.weight(&[64], DType::Bf16),
        lm_head: a.weight(&[256, 64], DType::Bf16),
        unmodelled: Vec::new(),
    }
}

pub(super) fn fixed(a: &mut Addr, specs: &[LayerSpec]) -> Fixed {
    let buffers = StepBuffers {
        acts: Activations {
            residual: a.next(),
            normed: a.next(),
            delta: a.next(),
            qkv: a.next(),
            attn_out: a.next(),
            gate_up: a.next(),
            act: a.next(),
            partial: DevicePtr::NULL,
        },
        meta: StepMeta {
            token_ids: a.next(),
            positions: a.next(),
            row_seq: a.next(),
            slot_mapping: a.next(),
            block_tables: a.next(),
            logit_rows: a.next(),
            seq_start: a.next(),
            seq_slot: a.next(),
            row_slot: a.next(),
            // The prefill attention's row groups; no program reads them.
            att_groups: a.next(),
        },
        head: HeadBuffers {
            logits_in: a.next(),
            logits: a.next(),
            logits_local: DevicePtr::NULL,
            sampled: a.next(),
        },
        inv_freq: a.next(),
        gdn: GdnBuffers {
            proj: a.next(),
            conv: a.next(),
            qk: a.next(),
            gates: a.next(),
            core: a.next(),
            normed: a.next(),
        },
        moe: MoeBuffers {
            router_logits: a.next(),
            topk_ids: a.next(),
            topk_weights: a.next(),
            expert_gate_up: a.next(),
            expert_act: a.next(),
            expert_out: a.next(),
            shared_gate_up: a.next(),
            shared_act: a.next(),
            shared_out: a.next(),
            shared_gate: a.next(),
        },
    };
    let pools = specs
        .iter()
        .map(|s| match s.kind {
            LayerKind::FullAttention => attention_pools(a),
            LayerKind::LinearAttention => LayerPools {
                kv: None,
                ssm: Some(SsmBinding {
                    conv: a.next(),
                    recurrent: a.next(),
                    conv_slot_stride: 3 * 88,
                    recurrent_slot_stride: 4 * 12 * 10,
                    num_slots: 4,
                }),
            },
        })
        .collect();
    let draft = DraftFixed {
        hidden: a.next(),
        cat_src: a.next(),
        cat_ids: a.next(),
        cat: a.next(),
        pools: vec![attention_pools(a)],
    };
    Fixed {
        buffers,
        pools,
        draft: Some(draft),
    }
}

/// The MTP draft head: its norms, `fc` and one full-attention MoE layer.
pub(super) fn draft(a: &mut Addr) -> DraftBinding {
    let b = DType::Bf16;
    DraftBinding {
        norm_embedding: a.weight(&[64], b),
        norm_hidden: a.weight(&[64], b),
        fc: a.weight(&[64, 128], b),
        norm: a.weight(&[64], b),
        layers: vec![Some(layer(a, FA_MOE))],
        unmodelled: Vec::new(),
    }
}

pub(super) struct Model {
    pub(super) ops: Ops,
    pub(super) instance: Instance,
    pub(super) layers: Vec<Option<CircuitLayer>>,
    pub(super) head: HeadBinding,
    pub(super) draft: Option<DraftBinding>,
    pub(super) fixed: Fixed,
}

pub(super) fn model(specs: &[LayerSpec]) -> Model {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let mut a = Addr::default();
    Model {
        ops: Ops::new(gpu).unwrap(),
        instance: instance(specs.to_vec()),
        layers: specs.iter().map(|&s| Some(layer(&mut a, s))).collect(),
        head: head(&mut a),
        draft: Some(draft(&mut a)),
        fixed: fixed(&mut a, specs),
    }
}

impl Model {
    pub(super) fn build(&self, fusions: Fusions) -> Result<CircuitExec, CircuitExecError> {
        CircuitExec::build(Boot {
            ops: &self.ops,
            stream: StreamHandle::DEFAULT,
            instance: self.instance.clone(),
            fusions,
            dims: dims(),
            layers: self.layers.clone(),
            head: self.head.clone(),
            draft: self.draft.clone(),
            fixed: self.fixed.clone(),
            unmodelled: Vec::new(),
        })
    }

    pub(super) fn problems(&self) -> Vec<BindingProblem> {
        match self.build(Fusions::ReferenceOnly) {
            Err(CircuitExecError::Bindings { problems }) => problems,
            Err(e) => panic!("not a binding error: {e}"),
            Ok(_) => Vec::new(),
        }
    }

    pub(super) fn layer(&mut self, i: usize) -> &mut CircuitLayer {
        self.layers[i].as_mut().unwrap()
    }
}

#[test]
fn a_bound_model_compiles_a_program_per_width_with_the_plans_launches() {
    let m = model(&[LA_MOE, FA_MOE]);
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    assert_eq!(exec.programs().len(), 3);
    for (plan, program) in exec.plans().iter().zip(exec.programs()) {
        assert_eq!(program.rows(), plan.rows());
        assert_eq!(program.launches().len(), plan.launches_per_step());
        assert_eq!(program.plan_digest(), plan.digest());
    }
    // embed; GDN layer: 2 norms, 7 mixer, 10 MoE; attention layer: 2 norms, 5 mixer, 10 MoE;
    // head: 3.
    assert_eq!(exec.launches_per_step(), 1 + 19 + 17 + 3);
    assert_eq!(exec.workspace_bytes(), 0);
    // `All` folds the attention layer's rotation and cache store into one launch, and at the
    // narrow widths each shared expert's gate/up projection and SwiGLU into another.
    let all = m.build(Fusions::All).unwrap();
    assert_ne!(all.plans_digest(), exec.plans_digest());
    assert_eq!(all.launches_per_step(), exec.launches_per_step() - 3);
    let count = |program: &Program, kernel| {
        program
            .launches()
            .iter()
            .filter(|l| l.kernel == kernel)
            .count()
    };
    let (rope, swiglu) = (m.ops.k.qk_norm_rope_kv_store, m.ops.k.linear_swiglu);
    for program in all.programs() {
        let swiglus = if program.rows() <= u64::from(crate::ops_fused::LINEAR_SWIGLU_M_MAX) {
            2
        } else {
            0
        };
        assert_eq!(count(program, rope), 1, "one per attention layer");
        assert_eq!(count(program, swiglu), swiglus, "{} rows", program.rows());
    }
}

#[test]
fn a_program_reads_the_bound_addresses_at_the_plans_extents() {
    let m = model(&[LA_MOE, FA_MOE]);
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    let program = exec.program(4).unwrap();
    let kv = m.fixed.pools[1].kv.unwrap();
    let attention = program
        .launches()
        .iter()
        .find(|l| l.kernel == m.ops.k.paged_attention)
        .unwrap();
    let p: metrale_kernel_abi::PagedAttentionParams = attention.params().unwrap();
    assert_eq!(
        (p.out, p.k_cache, p.v_cache),
        (m.fixed.buffers.acts.attn_out, kv.k, kv.v)
    );
    // rows, row stride (gated q), q head stride, heads, head dim, block size, blocks per
    // sequence, sequences, slots, scale, gated.
    let scalars = [
        p.rows,
        p.row_stride,
        p.q_head_stride,
        p.num_q_heads,
        p.num_kv_heads,
        p.head_dim,
        p.block_size,
        p.max_blocks,
        p.num_seqs,
        p.num_slots,
        p.gated,
    ];
    assert_eq!(scalars, [4, 192, 32, 4, 2, 16, 16, 8, 4, 512, 1]);
    assert_eq!({ p.scale }, 0.25);
    let rope = program
        .launches()
        .iter()
        .find(|l| l.kernel == m.ops.k.qk_norm_rope)
        .unwrap();
    let r: metrale_kernel_abi::QkNormRopeParams = rope.params().unwrap();
    assert_eq!(
        (r.qkv, r.inv_freq, r.positions),
        (
            m.fixed.buffers.acts.qkv,
            m.fixed.buffers.inv_freq,
            m.fixed.buffers.meta.positions
        )
    );
    assert_eq!(({ r.rotary_dim }, { r.attention_scaling }), (8, 1.25));
    let lm_head = program.launches().last().unwrap();
    let f32out: Vec<_> = ["linear_f32out", "linear_stream_f32out"]
        .iter()
        .filter_map(|n| m.ops.gpu().kernel("gemm", n).ok())
        .collect();
    assert!(f32out.contains(&lm_head.kernel));
    assert_eq!(
        lm_head.params(),
        Some(metrale_kernel_abi::LinearParams {
            out: m.fixed.buffers.head.logits,
            x: m.fixed.buffers.head.logits_in,
            w: m.head.lm_head.ptr(),
            m: 4,
            n: 256,
            k: 64,
        })
    );
}

#[test]
fn the_recorder_records_launches_and_refuses_memory() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let ops = Ops::new(gpu).unwrap();
    let (recorder, recording) = Recorder::over(&ops);
    let (out, x) = (DevicePtr(0x1000), DevicePtr(0x2000));
    recording
        .silu_mul(
            StreamHandle::DEFAULT,
            crate::ops::Matrix::bf16(out, 3, 5),
            crate::ops::Matrix::bf16(x, 3, 10),
        )
        .unwrap();
    assert_eq!(recorder.len(), 1);
    let launches = recorder.take();
    assert_eq!(launches[0].kernel, ops.k.silu_mul);
    assert!(recorder.is_empty());
    assert!(recording.gpu().alloc(16).is_err());
    let e = recording
        .gpu()
        .copy_h2d(out, &[0u8; 4], StreamHandle::DEFAULT)
        .unwrap_err();
    assert!(
        e.to_string().contains("host-to-device copy is refused"),
        "{e}"
    );
}
