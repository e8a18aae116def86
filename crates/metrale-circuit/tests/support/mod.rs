//! Small instances of each architecture, shared by the integration tests. Every dimension is
//! distinct from the others, so a shape that reads the wrong one shows in its extents.

#![allow(dead_code)]

use std::sync::Arc;

use metrale_circuit::{
    Architecture, Circuit, Dims, FfnKind, Fusions, GdnDims, Instance, KernelSet, KvFormat,
    LayerKind, LayerSpec, Lowering, MoeDims, Numerics, Plan, RuleTable, SharedExpertDims, Step,
    WeightFormat,
};

pub const FA_DENSE: LayerSpec = LayerSpec {
    kind: LayerKind::FullAttention,
    ffn: FfnKind::Dense,
};
pub const LA_DENSE: LayerSpec = LayerSpec {
    kind: LayerKind::LinearAttention,
    ffn: FfnKind::Dense,
};
pub const FA_MOE: LayerSpec = LayerSpec {
    kind: LayerKind::FullAttention,
    ffn: FfnKind::Moe,
};
pub const LA_MOE: LayerSpec = LayerSpec {
    kind: LayerKind::LinearAttention,
    ffn: FfnKind::Moe,
};

pub fn dims() -> Dims {
    Dims {
        hidden: 64,
        vocab: 256,
        ffn: 96,
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        blocks_per_seq: 8,
        gdn: None,
        moe: None,
    }
}

pub fn gdn_dims() -> GdnDims {
    GdnDims {
        num_k_heads: 2,
        k_head_dim: 12,
        num_v_heads: 4,
        v_head_dim: 10,
        conv_kernel: 4,
    }
}

pub fn moe_dims() -> MoeDims {
    MoeDims {
        num_experts: 8,
        top_k: 3,
        expert_ffn: 24,
        shared: Some(SharedExpertDims {
            ffn: 40,
            gated: true,
        }),
    }
}

/// Qwen3 dense (`qk_norm`) or Llama, two layers.
pub fn dense(qk_norm: bool) -> Instance {
    Instance {
        architecture: Architecture::DenseGqa { qk_norm },
        dims: dims(),
        layers: vec![FA_DENSE; 2],
        widths: vec![1, 2, 4],
        verify_rows: vec![2, 3],
        verify_batches: Vec::new(),
        draft_rows: vec![1, 2, 3],
        draft_batches: Vec::new(),
        draft_layer: Some(FA_DENSE),
        argmax: true,
        weights: WeightFormat::Bf16,
        kv_cache: KvFormat::Bf16,
    }
}

/// Qwen3.5 dense: three GDN layers then one full attention layer.
pub fn hybrid(layers: Vec<LayerSpec>) -> Instance {
    Instance {
        architecture: Architecture::Hybrid,
        dims: Dims {
            gdn: Some(gdn_dims()),
            ..dims()
        },
        layers,
        widths: vec![1, 2, 4],
        verify_rows: vec![2, 3],
        verify_batches: Vec::new(),
        draft_rows: vec![1, 2, 3],
        draft_batches: Vec::new(),
        draft_layer: Some(FA_DENSE),
        argmax: true,
        weights: WeightFormat::Bf16,
        kv_cache: KvFormat::Bf16,
    }
}

/// Qwen3-Next / Qwen3.5-MoE, every FFN sparse (so `ffn` is unused and 0).
pub fn hybrid_moe() -> Instance {
    Instance {
        architecture: Architecture::HybridMoe,
        dims: Dims {
            ffn: 0,
            gdn: Some(gdn_dims()),
            moe: Some(moe_dims()),
            ..dims()
        },
        layers: vec![LA_MOE, LA_MOE, LA_MOE, FA_MOE],
        widths: vec![1, 2, 4],
        verify_rows: vec![2, 3],
        verify_batches: Vec::new(),
        draft_rows: vec![1, 2, 3],
        draft_batches: Vec::new(),
        draft_layer: Some(FA_MOE),
        argmax: true,
        weights: WeightFormat::Bf16,
        kv_cache: KvFormat::Bf16,
    }
}

/// One small instance per architecture, with a file-name stem.
pub fn every_architecture() -> Vec<(&'static str, Instance)> {
    vec![
        ("dense_gqa", dense(true)),
        ("dense_gqa_no_qk_norm", dense(false)),
        (
            "hybrid",
            hybrid(vec![LA_DENSE, LA_DENSE, LA_DENSE, FA_DENSE]),
        ),
        ("hybrid_moe", hybrid_moe()),
    ]
}

/// The reference kernels: every kernel the table's reference rules name (no fused kernel).
pub fn reference_kernels(table: &RuleTable) -> KernelSet {
    KernelSet::from_kernels(&table.kernels(Numerics::Reference))
}

/// `instance`'s decode plan at `rows` with its architecture's table.
pub fn plan(instance: &Instance, fusions: Fusions, kernels: &KernelSet, rows: u64) -> Plan {
    step_plan(instance, Step::Decode, fusions, kernels, rows)
}

/// `instance`'s plan of `step` at `rows` with its architecture's table.
pub fn step_plan(
    instance: &Instance,
    step: Step,
    fusions: Fusions,
    kernels: &KernelSet,
    rows: u64,
) -> Plan {
    let circuit = Arc::new(Circuit::for_step(instance, step).expect("the test instance is valid"));
    let rules = RuleTable::for_architecture(instance.architecture);
    let lowering = Lowering {
        rules: &rules,
        fusions,
        kernels,
    };
    Plan::compile(&circuit, &lowering, step.width(rows)).expect("the test instance lowers")
}
