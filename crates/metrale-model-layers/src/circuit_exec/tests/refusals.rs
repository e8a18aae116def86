//! The executor's refusals on synthetic bindings: each binding problem named (an unbound layer,
//! a kind or fact the circuit disagrees with, a missing pool, an unmodelled feature), every
//! problem of a model in one error, the bound layers returned in order, a weight in another
//! format than its kernel reads, and a KV pool in another format than the instance's.

#![allow(clippy::unwrap_used)]

use metrale_circuit::{Block, LayerSpec, LinearRole};
use metrale_gpu_runtime::DType;

use super::*;

#[test]
fn each_binding_problem_is_named() {
    type Case = (&'static str, fn(&mut Model), BindingProblem);
    let cases: [Case; 8] = [
        (
            "unbound",
            |m| m.layers[0] = None,
            BindingProblem::Unbound {
                part: Part::Layer(0),
            },
        ),
        (
            "unmodelled",
            |m| m.layer(1).unmodelled.push("hyper-connections".into()),
            BindingProblem::Unmodelled {
                part: Part::Layer(1),
                feature: "hyper-connections".into(),
            },
        ),
        (
            "kind",
            |m| {
                let mut a = Addr(0x90_0000);
                m.layers[1] = Some(layer(&mut a, LA_MOE));
            },
            BindingProblem::KindDisagrees {
                part: Part::Layer(1),
                model: LA_MOE,
                circuit: FA_MOE,
            },
        ),
        (
            "fact",
            |m| {
                if let MixerFacts::Attention(a) = &mut m.layer(1).mixer {
                    a.gated = false;
                }
            },
            BindingProblem::FactDisagrees {
                part: Part::Layer(1),
                fact: "the attention output gate",
                model: "false".into(),
                circuit: "true".into(),
            },
        ),
        (
            "missing weight",
            |m| {
                m.layer(0).weights.remove(&WeightSlot::GdnNorm);
            },
            BindingProblem::MissingWeight {
                block: Block::Layer(0),
                slot: WeightSlot::GdnNorm,
            },
        ),
        (
            "shape",
            |m| {
                let slot = WeightSlot::Linear(LinearRole::O);
                let mut a = Addr(0x80_0000);
                m.layer(1)
                    .weights
                    .insert(slot, a.weight(&[64, 32], DType::Bf16));
            },
            BindingProblem::WeightShape {
                block: Block::Layer(1),
                slot: WeightSlot::Linear(LinearRole::O),
                expected: 64 * 64,
                last: Some(64),
                found: vec![64, 32],
            },
        ),
        (
            "unread",
            |m| {
                let mut a = Addr(0x70_0000);
                let w = a.weight(&[16], DType::Bf16);
                m.layer(0).weights.insert(WeightSlot::QNorm, w);
            },
            BindingProblem::UnreadWeight {
                block: Block::Layer(0),
                slot: WeightSlot::QNorm,
            },
        ),
        (
            "count",
            |m| {
                let mut a = Addr(0x60_0000);
                m.layers.push(Some(layer(&mut a, FA_MOE)));
            },
            BindingProblem::LayerCount {
                model: 3,
                circuit: 2,
            },
        ),
    ];
    for (name, break_it, want) in cases {
        let mut m = model(&[LA_MOE, FA_MOE]);
        break_it(&mut m);
        assert_eq!(m.problems(), [want], "{name}");
    }
}

#[test]
fn every_problem_of_a_model_comes_in_one_error() {
    let mut m = model(&[LA_MOE, FA_MOE, LA_MOE, FA_MOE]);
    m.layers[0] = None;
    m.layer(1).unmodelled.push("LoRA adapters".into());
    let mut a = Addr(0x90_0000);
    m.layers[2] = Some(layer(&mut a, FA_MOE));
    m.layers.push(Some(layer(&mut a, LA_MOE)));
    m.head.unmodelled.push("logit softcapping".into());
    m.fixed.pools[3].kv = None;
    let err = m.build(Fusions::ReferenceOnly).err().unwrap();
    let text = err.to_string();
    let CircuitExecError::Bindings { problems } = err else {
        panic!("{text}");
    };
    assert_eq!(
        problems,
        [
            BindingProblem::Unbound {
                part: Part::Layer(0)
            },
            BindingProblem::Unmodelled {
                part: Part::Layer(1),
                feature: "LoRA adapters".into()
            },
            BindingProblem::KindDisagrees {
                part: Part::Layer(2),
                model: FA_MOE,
                circuit: LA_MOE
            },
            BindingProblem::MissingPool {
                part: Part::Layer(3),
                pool: "KV cache"
            },
            BindingProblem::Unmodelled {
                part: Part::Head,
                feature: "logit softcapping".into()
            },
            BindingProblem::LayerCount {
                model: 5,
                circuit: 4
            },
        ]
    );
    assert!(
        text.starts_with("the circuit does not model this model (6 problems):\n  - layer 0 has"),
        "{text}"
    );
    assert!(
        text.contains(
            "\n  - layer 2: the model has full_attention/moe, the circuit linear_attention/moe"
        ),
        "{text}"
    );
    assert!(
        text.contains("\n  - head: logit softcapping is not modelled by the circuit"),
        "{text}"
    );
}

#[test]
fn check_bindings_returns_the_bound_layers_in_order() {
    let m = model(&[LA_MOE, FA_MOE]);
    let circuit = metrale_circuit::Circuit::new(&m.instance).unwrap();
    let bound = check_bindings(&circuit, &m.layers, &m.head).unwrap();
    let specs: Vec<LayerSpec> = bound.iter().map(CircuitLayer::spec).collect();
    assert_eq!(specs, [LA_MOE, FA_MOE]);
}

#[test]
fn a_weight_in_another_format_than_its_kernel_reads_is_refused() {
    let mut m = model(&[LA_MOE, FA_MOE]);
    let mut a = Addr(0x50_0000);
    let bf16 = a.weight(&[4], DType::Bf16);
    m.layer(0).weights.insert(WeightSlot::GdnALog, bf16);
    let err = m.build(Fusions::ReferenceOnly).err().unwrap();
    assert!(
        matches!(
            err,
            CircuitExecError::WeightFormat {
                block: Block::Layer(0),
                slot: WeightSlot::GdnALog,
                bound: "bf16",
                expected: "f32",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "layer 0: weight gdn.a_log is bf16, but gdn::gdn_prepare reads f32"
    );
}

#[test]
fn a_kv_pool_stored_otherwise_than_the_instance_says_is_refused() {
    let fp8 = |m: &mut Model| {
        for pools in
            (m.fixed.pools.iter_mut()).chain(m.fixed.draft.iter_mut().flat_map(|d| &mut d.pools))
        {
            if let Some(kv) = pools.kv.as_mut() {
                kv.dtype = metrale_cache::KvDtype::Fp8;
            }
        }
    };
    // An e4m3 pool under a bf16 instance: the attention layer and the draft head's layer.
    let mut m = model(&[LA_MOE, FA_MOE]);
    fp8(&mut m);
    let problems = m.problems();
    let want = |part| BindingProblem::KvStorage {
        part,
        expected: "bf16",
        found: "e4m3",
    };
    assert_eq!(
        problems,
        [want(Part::Layer(1)), want(Part::DraftLayer(0))],
        "{problems:?}"
    );
    assert_eq!(
        problems[0].to_string(),
        "layer 1: its KV cache is e4m3; the circuit's instance says bf16"
    );
    // The instance saying e4m3 binds it, and the plans say so.
    m.instance.kv_cache = KvFormat::Fp8E4m3;
    let exec = m.build(Fusions::ReferenceOnly).unwrap();
    assert!(exec.plans()[0].text().contains("\nkv_cache e4m3\n"));
}
