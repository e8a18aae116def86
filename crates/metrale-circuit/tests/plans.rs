//! Plans and the fuser: the reference lowering is the legacy forward's launch sequence, every
//! node is covered once, an uncovered node is named, digests are deterministic and tell
//! instances apart, fused rules cut launches only when their kernels exist.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

#[path = "plans/speculative.rs"]
mod speculative;

use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use metrale_circuit::{
    Architecture, Block, Circuit, CircuitError, Fusions, Instance, KernelSet, KvFormat, LinearRole,
    Lowering, Numerics, Op, Plan, RuleTable, Step, Tensor, TensorKind, ValueId, Width, fuse,
    kernels, plans_digest,
};
use support::{FA_DENSE, LA_DENSE, LA_MOE};

fn names(plan: &Plan) -> Vec<String> {
    plan.launches().map(|(_, k)| k.to_string()).collect()
}

fn reference_plan(instance: &Instance) -> Plan {
    let table = RuleTable::for_architecture(instance.architecture);
    support::plan(
        instance,
        Fusions::ReferenceOnly,
        &support::reference_kernels(&table),
        1,
    )
}

#[test]
fn the_dense_reference_plan_launches_what_the_legacy_step_launches() {
    let plan = reference_plan(&support::dense(true));
    let layer = |first: bool| {
        [
            if first {
                "norm::rms_norm"
            } else {
                "norm::add_rms_norm"
            },
            "gemm::linear",
            "rope::qk_norm_rope",
            "cache::kv_store",
            "attention::paged_attention",
            "gemm::linear",
            "norm::add_rms_norm",
            "gemm::linear",
            "activation::silu_mul",
            "gemm::linear",
        ]
    };
    let mut want = vec!["embed::embedding_gather"];
    want.extend(layer(true));
    want.extend(layer(false));
    want.extend([
        "norm::add_rms_norm",
        "embed::gather_rows",
        "gemm::linear_f32out",
        "sampling::argmax",
    ]);
    assert_eq!(names(&plan), want);
    assert_eq!(plan.launches_per_step(), want.len());
    assert_eq!(plan.numerics(), Numerics::Reference);
}

#[test]
fn the_hybrid_reference_plans_launch_what_the_gdn_and_moe_layers_launch() {
    let plan = reference_plan(&support::hybrid_moe());
    let launches = names(&plan);
    let gdn_layer0: Vec<&str> = launches[2..9].iter().map(String::as_str).collect();
    assert_eq!(
        gdn_layer0,
        [
            "gemm::linear",
            "gdn::causal_conv1d",
            "gdn::conv_state_update",
            "gdn::gdn_prepare",
            "gdn::gated_delta_recurrent",
            "gdn::gated_rms_norm",
            "gemm::linear",
        ]
    );
    let moe_layer0: Vec<&str> = launches[10..20].iter().map(String::as_str).collect();
    assert_eq!(
        moe_layer0,
        [
            "gemm::linear_f32out",
            "moe::topk_route",
            "moe::expert_linear",
            "activation::silu_mul",
            "moe::expert_linear_f32out",
            "gemm::linear",
            "activation::silu_mul",
            "gemm::linear",
            "gemm::linear_f32out",
            "moe::moe_combine",
        ]
    );
}

#[test]
fn llama_runs_rope_through_the_qk_norm_kernel_without_a_norm_op() {
    let plan = reference_plan(&support::dense(false));
    let ops: Vec<Op> = plan.circuit().nodes().iter().map(|n| n.op).collect();
    assert!(ops.contains(&Op::Rope));
    assert!(!ops.iter().any(|op| matches!(op, Op::QkNormRope(_))));
    assert_eq!(names(&plan)[3], "rope::qk_norm_rope");
}

#[test]
fn every_node_is_in_exactly_one_group_in_launch_order() {
    for (stem, instance) in support::every_architecture() {
        for fusions in [Fusions::ReferenceOnly, Fusions::All] {
            let plan = support::plan(&instance, fusions, &KernelSet::all(), 2);
            let mut next = 0;
            for g in plan.groups() {
                assert_eq!(g.nodes.start, next, "{stem}: a gap or overlap before {g:?}");
                let ops: Vec<Op> = plan.group_nodes(g).iter().map(|n| n.op).collect();
                assert_eq!(ops, g.ops, "{stem}: a group's ops are its nodes' ops");
                assert!(plan.group_nodes(g).iter().all(|n| n.block == g.block));
                next = g.nodes.end;
            }
            assert_eq!(
                next,
                plan.circuit().nodes().len(),
                "{stem}: nodes left over"
            );
            assert_eq!(plan.launches().count(), plan.launches_per_step());
            let footer = format!("launches {}\n", plan.launches_per_step());
            assert!(plan.text().ends_with(&footer), "{stem}: {}", plan.text());
        }
    }
}

#[test]
fn an_uncovered_node_is_named_with_the_rules_that_could_not_be_used() {
    let instance = support::dense(true);
    let table = RuleTable::for_architecture(instance.architecture);
    let mut have = table.kernels(Numerics::Reference);
    have.remove(&kernels::KV_STORE);
    let have = KernelSet::from_kernels(&have);
    let circuit = Circuit::new(&instance).expect("valid");
    let lowering = Lowering {
        rules: &table,
        fusions: Fusions::ReferenceOnly,
        kernels: &have,
    };
    let err = fuse(&circuit, &lowering).expect_err("kv_store has no kernel");
    let CircuitError::Uncovered {
        node, block, op, ..
    } = &err
    else {
        panic!("not an uncovered-node error: {err}");
    };
    assert_eq!((node.0, *block, *op), (4, Block::Layer(0), Op::KvStore));
    assert_eq!(
        err.to_string(),
        "no rule covers node n4 (layer 0, `kv_store`); rules that match there but cannot be \
         used: `kv_store` (missing kernel cache::kv_store)"
    );
}

#[test]
fn an_op_no_rule_lowers_is_named() {
    let instance = support::hybrid_moe();
    let full = RuleTable::for_architecture(instance.architecture);
    let rules = full
        .rules()
        .iter()
        .filter(|r| r.chain != [Op::MoeRoute])
        .cloned()
        .collect();
    let table = RuleTable::new(rules).expect("well formed");
    let circuit = Circuit::new(&instance).expect("valid");
    let lowering = Lowering {
        rules: &table,
        fusions: Fusions::All,
        kernels: &KernelSet::all(),
    };
    let err = fuse(&circuit, &lowering).expect_err("moe_route has no rule");
    let msg = err.to_string();
    assert!(
        msg.starts_with("no rule covers node n10 (layer 0, `moe_route`)") && !msg.contains(';'),
        "{msg}"
    );
}

#[test]
fn the_same_instance_gives_the_same_digest() {
    for (stem, instance) in support::every_architecture() {
        let a = support::plan(&instance, Fusions::All, &KernelSet::all(), 4);
        let b = support::plan(&instance.clone(), Fusions::All, &KernelSet::all(), 4);
        assert_eq!(a.text(), b.text(), "{stem}");
        assert_eq!(a.digest(), b.digest(), "{stem}");
        assert_eq!(a.digest().to_string().len(), 64);
    }
}

#[test]
fn a_different_layer_pattern_width_or_dim_gives_a_different_digest() {
    let all = KernelSet::all();
    let base = support::plan(
        &support::hybrid(vec![LA_DENSE, LA_DENSE, LA_DENSE, FA_DENSE]),
        Fusions::All,
        &all,
        1,
    );
    let moved = support::plan(
        &support::hybrid(vec![LA_DENSE, LA_DENSE, FA_DENSE, LA_DENSE]),
        Fusions::All,
        &all,
        1,
    );
    assert_ne!(base.digest(), moved.digest());
    assert_eq!(base.launches_per_step(), moved.launches_per_step());
    let wider = support::plan(
        &support::hybrid(vec![LA_DENSE, LA_DENSE, LA_DENSE, FA_DENSE]),
        Fusions::All,
        &all,
        2,
    );
    assert_ne!(base.digest(), wider.digest());
    let mut bigger = support::hybrid(vec![LA_DENSE, LA_DENSE, LA_DENSE, FA_DENSE]);
    bigger.dims.vocab += 1;
    assert_ne!(
        base.digest(),
        support::plan(&bigger, Fusions::All, &all, 1).digest()
    );
    // An FP8 KV cache: the same launches, a header that says so, another digest.
    let mut fp8_kv = support::hybrid(vec![LA_DENSE, LA_DENSE, LA_DENSE, FA_DENSE]);
    fp8_kv.kv_cache = KvFormat::Fp8E4m3;
    let fp8_kv = support::plan(&fp8_kv, Fusions::All, &all, 1);
    assert_ne!(base.digest(), fp8_kv.digest());
    assert!(fp8_kv.text().contains("\nkv_cache e4m3\n") && !base.text().contains("kv_cache"));
    assert_eq!(
        fp8_kv.launches().collect::<Vec<_>>(),
        base.launches().collect::<Vec<_>>()
    );
}

#[test]
fn all_fusions_launch_fewer_kernels_only_when_fused_kernels_exist() {
    for (stem, instance) in support::every_architecture() {
        let table = RuleTable::for_architecture(instance.architecture);
        let today = support::reference_kernels(&table);
        let reference = support::plan(&instance, Fusions::ReferenceOnly, &today, 1);
        let all_today = support::plan(&instance, Fusions::All, &today, 1);
        // Without fused kernels `All` is the reference plan, digest included.
        assert_eq!(all_today.digest(), reference.digest(), "{stem}");
        let fused = support::plan(&instance, Fusions::All, &KernelSet::all(), 1);
        assert!(
            fused.launches_per_step() < reference.launches_per_step(),
            "{stem}: {} launches fused, {} reference",
            fused.launches_per_step(),
            reference.launches_per_step()
        );
        // The dense tables' fused kernels are all bit-identical (the rotation with the cache
        // store, the gate/up projection with the SwiGLU); the hybrids' fused GDN step differs.
        let expected = if matches!(instance.architecture, Architecture::DenseGqa { .. }) {
            Numerics::BitIdentical
        } else {
            Numerics::Differs
        };
        assert_eq!(fused.numerics(), expected, "{stem}");
    }
}

#[test]
fn one_fused_kernel_fuses_exactly_its_chains() {
    let instance = support::dense(true);
    let table = RuleTable::for_architecture(instance.architecture);
    let mut have = table.kernels(Numerics::Reference);
    have.insert(kernels::QK_NORM_ROPE_KV_STORE);
    let plan = support::plan(&instance, Fusions::All, &KernelSet::from_kernels(&have), 1);
    let reference = reference_plan(&instance);
    assert_eq!(plan.launches_per_step() + 2, reference.launches_per_step());
    assert_eq!(plan.numerics(), Numerics::BitIdentical);
    let fused: Vec<_> = plan
        .groups()
        .iter()
        .filter(|g| g.numerics != Numerics::Reference)
        .map(|g| (g.block, g.ops.clone()))
        .collect();
    let chain = vec![
        Op::QkNormRope(metrale_circuit::NormWeight::Plain),
        Op::KvStore,
    ];
    assert_eq!(
        fused,
        [(Block::Layer(0), chain.clone()), (Block::Layer(1), chain)]
    );
}

#[test]
fn plans_at_every_width_share_groups_and_differ_in_extents() -> Result<()> {
    let instance = support::hybrid_moe();
    let circuit = Arc::new(Circuit::new(&instance)?);
    let table = RuleTable::for_architecture(instance.architecture);
    let lowering = Lowering {
        rules: &table,
        fusions: Fusions::All,
        kernels: &KernelSet::all(),
    };
    let plans = Plan::compile_widths(&circuit, &lowering)?;
    ensure!(plans.iter().map(Plan::rows).eq([1, 2, 4]));
    ensure!(plans.iter().all(|p| p.groups() == plans[0].groups()));
    // The routed experts' activations are [rows * top_k, expert_ffn].
    let act = circuit
        .values()
        .iter()
        .position(|v| v.tensor == metrale_circuit::Tensor::MoeExpertAct)
        .context("the MoE circuit has expert activations")?;
    let extents: Vec<&[u64]> = plans.iter().map(|p| p.extents(ValueId(act))).collect();
    ensure!(
        extents == [&[3, 24][..], &[6, 24], &[12, 24]],
        "{extents:?}"
    );
    ensure!(plans_digest(&plans) != plans_digest(&plans[..2]));
    Ok(())
}

#[test]
fn edges_carry_the_formats_and_extents_of_their_buffers() -> Result<()> {
    let instance = support::hybrid(vec![LA_DENSE, FA_DENSE]);
    let circuit = Circuit::new(&instance)?;
    let extents = circuit.extents(Step::Decode.width(2))?;
    for (i, node) in circuit.nodes().iter().enumerate() {
        for &v in &node.inputs {
            let value = circuit.value(v).context("an input value exists")?;
            match value.producer {
                Some(p) => ensure!(p.0 < i, "node {i} reads a value written later"),
                None => ensure!(
                    value.tensor.spec().kind != TensorKind::Activation,
                    "node {i} reads {} before anything writes it",
                    value.tensor
                ),
            }
        }
    }
    let extent_of = |op: Op| -> Result<(metrale_circuit::Format, Vec<u64>)> {
        let node = circuit
            .nodes()
            .iter()
            .find(|n| n.op == op)
            .with_context(|| format!("no {op} node"))?;
        let out = node.outputs[0];
        let value = circuit.value(out).context("output exists")?;
        Ok((value.tensor.spec().format, extents[out.0].clone()))
    };
    use metrale_circuit::Format::{Bf16, F32};
    // Gated attention: q heads carry a gate, 4*2*16 + 2*2*16.
    ensure!(extent_of(Op::Linear(LinearRole::Qkv))? == (Bf16, vec![2, 192]));
    // [q | k | v | z | b | a] = 2*2*12 + 2*4*10 + 2*4.
    ensure!(extent_of(Op::Linear(LinearRole::GdnInProj))? == (Bf16, vec![2, 136]));
    ensure!(extent_of(Op::Embedding)? == (F32, vec![2, 64]));
    ensure!(extent_of(Op::Linear(LinearRole::LmHead))? == (F32, vec![2, 256]));
    Ok(())
}

#[test]
fn instances_that_break_an_invariant_are_refused_by_name() {
    let err = |i: &Instance| Circuit::new(i).err().map(|e| e.to_string());
    let mut no_layers = support::dense(true);
    no_layers.layers.clear();
    assert_eq!(
        err(&no_layers),
        Some("the instance has no decoder layer".into())
    );
    let mut widths = support::dense(true);
    widths.widths = vec![1, 4, 2];
    assert!(matches!(
        Circuit::new(&widths),
        Err(CircuitError::BadWidths { .. })
    ));
    widths.widths = vec![0, 1];
    assert!(matches!(
        Circuit::new(&widths),
        Err(CircuitError::BadWidths { .. })
    ));
    let mut gdn_in_dense = support::dense(true);
    gdn_in_dense.layers[1] = LA_DENSE;
    assert_eq!(
        err(&gdn_in_dense),
        Some("layer 1 is linear_attention/dense, which the dense_gqa circuit does not have".into())
    );
    let mut moe_in_hybrid = support::hybrid(vec![LA_DENSE, FA_DENSE]);
    moe_in_hybrid.layers[0] = LA_MOE;
    assert!(matches!(
        Circuit::new(&moe_in_hybrid),
        Err(CircuitError::LayerNotInArchitecture { layer: 0, .. })
    ));
    let mut no_gdn = support::hybrid(vec![LA_DENSE, FA_DENSE]);
    no_gdn.dims.gdn = None;
    assert_eq!(
        err(&no_gdn),
        Some("the circuit uses `gdn_proj_width`, but the instance has no gdn dims".into())
    );
    // The MoE instance has ffn = 0, which is fine until a layer is dense.
    let mut dense_layer = support::hybrid_moe();
    dense_layer.layers[0] = LA_DENSE;
    assert_eq!(
        err(&dense_layer),
        Some("`2*ffn` of gate_up resolves to 0: every extent must be >= 1 and fit in u64".into())
    );
    let mut unshared = support::hybrid_moe();
    if let Some(m) = unshared.dims.moe.as_mut() {
        m.shared = None;
    }
    let circuit = Circuit::new(&unshared).expect("an MoE without a shared expert is valid");
    assert!(!circuit.nodes().iter().any(|n| matches!(
        n.op,
        Op::Linear(LinearRole::SharedGateUp | LinearRole::SharedGate)
    )));
    assert_eq!(
        Circuit::new(&support::dense(true))
            .map(|c| c.extents(Step::Decode.width(0)).err())
            .ok()
            .flatten(),
        Some(CircuitError::ZeroRows)
    );
}

#[test]
fn the_circuit_states_each_layers_kinds() -> Result<()> {
    let instance = support::hybrid(vec![LA_DENSE, LA_DENSE, FA_DENSE]);
    let circuit = Circuit::new(&instance)?;
    use metrale_circuit::{FfnKind, LayerKind};
    ensure!(
        circuit.layer_kinds()
            == [
                LayerKind::LinearAttention,
                LayerKind::LinearAttention,
                LayerKind::FullAttention
            ]
    );
    ensure!(circuit.ffn_kinds() == [FfnKind::Dense; 3]);
    ensure!(circuit.instance().architecture == Architecture::Hybrid);
    Ok(())
}

#[test]
fn tables_are_well_formed() {
    for (stem, instance) in support::every_architecture() {
        let table = RuleTable::for_architecture(instance.architecture);
        assert_eq!(
            RuleTable::new(table.rules().to_vec()).as_ref(),
            Ok(&table),
            "{stem}"
        );
        // A reference rule covers one op: a chain is a fusion, and fusions are not reference.
        for r in table.rules() {
            assert!(
                r.numerics != Numerics::Reference || r.chain.len() == 1,
                "{stem}: {}",
                r.chain_text()
            );
        }
    }
}

#[test]
fn block_fp8_weights_lower_their_projections_to_the_fp8_kernels_and_drop_bf16_fusions() -> Result<()>
{
    let bf16 = support::hybrid_moe();
    let fp8 = Instance {
        weights: metrale_circuit::WeightFormat::BlockFp8,
        ..bf16.clone()
    };
    let table = RuleTable::for_instance(&fp8, &[kernels::LINEAR_STREAM_FP8]);
    let lowering = |t: &RuleTable, i: &Instance| -> Result<Plan> {
        let circuit = Arc::new(Circuit::new(i)?);
        let every = KernelSet::from_kernels(
            &t.rules()
                .iter()
                .flat_map(|r| r.kernels.clone())
                .collect::<std::collections::BTreeSet<_>>(),
        );
        let lowering = Lowering {
            rules: t,
            fusions: Fusions::All,
            kernels: &every,
        };
        Ok(Plan::compile(&circuit, &lowering, Step::Decode.width(1))?)
    };
    let plan = lowering(&table, &fp8)?;
    let launched = names(&plan);
    let count = |k: &str| launched.iter().filter(|n| *n == k).count();
    // Per MoE layer: qkv/o or the GDN's input (its q|k|v|z rows) and out projections, the
    // shared expert's two, and the two expert projections in FP8; the GDN input projection's
    // b|a rows, the routers, the shared gate and the LM head stay bf16.
    ensure!(count("moe::expert_linear_fp8") == 4 && count("moe::expert_linear_fp8_f32out") == 4);
    ensure!(count("moe::expert_linear") == 0 && count("gemm::linear_swiglu") == 0);
    ensure!(
        count("gemm::linear") == 3,
        "the GDN input projections' b|a rows: {launched:?}"
    );
    let gdn_in = (plan.groups().iter())
        .filter(|g| g.ops == [Op::Linear(LinearRole::GdnInProj)])
        .map(|g| g.kernels.clone())
        .collect::<Vec<_>>();
    ensure!(
        gdn_in.len() == 3
            && gdn_in
                .iter()
                .all(|k| *k == [kernels::LINEAR_STREAM_FP8, kernels::LINEAR]),
        "{gdn_in:?}"
    );
    ensure!(count("gemm::linear_stream_fp8") > 0);
    ensure!(!table.rules().iter().any(|r| {
        r.chain
            .iter()
            .any(|op| matches!(op, Op::Linear(role) if role.block_fp8_in_packs()))
            && r.numerics != Numerics::Reference
    }));
    // The format is in the plan's text, so digests tell the two apart.
    let plain = lowering(
        &RuleTable::for_instance(&bf16, &[kernels::LINEAR_STREAM_FP8]),
        &bf16,
    )?;
    ensure!(plan.text().contains("weights block_fp8") && !plain.text().contains("weights"));
    ensure!(plan.digest() != plain.digest());
    ensure!(names(&plain).iter().any(|n| n == "gemm::linear_swiglu"));
    Ok(())
}
