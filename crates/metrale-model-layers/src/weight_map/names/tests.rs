//! Tests of `WeightNames` against the tensor names transformers 5.24 `save_pretrained` wrote for
//! a tiny model of each family (`weight_map/testdata/<model>.txt`, with the model's `config.json` beside
//! it): the names the table produces must be exactly the checkpoint's, no more, no less.

use std::collections::BTreeSet;
use std::path::Path;

use metrale_config::ModelConfig;

use crate::weight_map::test_support::{RawTensor, write_safetensors};
use crate::weight_map::{
    ExpertLayout, ExpertNames, FfnNames, GdnProjectionNames, MixerNames, ModelPrefix, SINGLE_FILE,
    SafetensorsSource, WeightError, WeightNames,
};

/// `(name, shape)` per line of a key list (`name DTYPE d0,d1,...`).
fn keys(list: &str) -> Vec<(String, Vec<usize>)> {
    list.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut parts = l.split_whitespace();
            let name = parts.next().unwrap().to_string();
            let shape = parts
                .nth(1)
                .unwrap()
                .split(',')
                .map(|d| d.parse().unwrap())
                .collect();
            (name, shape)
        })
        .collect()
}

/// A checkpoint directory holding `keys` (f32 zeros) and the config parsed from `config`.
fn checkpoint(config: &str, keys: &[(String, Vec<usize>)]) -> (tempfile::TempDir, ModelConfig) {
    let dir = tempfile::tempdir().unwrap();
    let tensors: Vec<RawTensor<'_>> = keys
        .iter()
        .map(|(name, shape)| RawTensor::f32(name, shape, &vec![0.0; shape.iter().product()]))
        .collect();
    write_safetensors(&dir.path().join(SINGLE_FILE), &tensors);
    let config = ModelConfig::from_json_str(config, Path::new("config.json")).unwrap();
    (dir, config)
}

/// Detect the names for a test model and check they are exactly its saved tensors.
fn check_model(config: &str, list: &str) -> (WeightNames, SafetensorsSource, ModelConfig) {
    let keys = keys(list);
    let (dir, config) = checkpoint(config, &keys);
    let source = SafetensorsSource::open(dir.path()).unwrap();
    let names = WeightNames::detect(&source, &config).unwrap();
    let ours: BTreeSet<String> = names.all().into_iter().collect();
    let theirs: BTreeSet<String> = keys.into_iter().map(|(n, _)| n).collect();
    let missing: Vec<_> = theirs.difference(&ours).collect();
    let extra: Vec<_> = ours.difference(&theirs).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "not named: {missing:?}; not saved: {extra:?}"
    );
    assert_eq!(names.all().len(), ours.len(), "a name listed twice");
    (names, source, config)
}

fn shape<'a>(source: &'a SafetensorsSource, name: &str) -> &'a [usize] {
    source.info(name).unwrap().1
}

macro_rules! model {
    ($name:literal) => {
        check_model(
            include_str!(concat!("../testdata/", $name, ".json")),
            include_str!(concat!("../testdata/", $name, ".txt")),
        )
    };
}

#[test]
fn qwen3_names_match_transformers() {
    let (names, source, c) = model!("qwen3");
    assert_eq!(names.layout().prefix, ModelPrefix::CausalLm);
    let a = names.layer(1).attention();
    assert_eq!(
        a.q_norm.as_deref(),
        Some("model.layers.1.self_attn.q_norm.weight")
    );
    assert_eq!(
        shape(&source, &a.q_proj),
        [
            c.attention.num_attention_heads * c.attention.head_dim,
            c.hidden_size
        ]
    );
    assert_eq!(names.lm_head(), "lm_head.weight");
}

#[test]
fn llama_names_have_no_qk_norm_and_tie_the_head() {
    let (names, _, c) = model!("llama_tied");
    assert!(c.tokens.tie_word_embeddings);
    assert_eq!(names.lm_head(), names.embed_tokens());
    assert_eq!(names.layer(0).attention().q_norm, None);
}

#[test]
fn qwen3_5_text_names_match_transformers() {
    let (names, source, c) = model!("qwen3_5_text");
    let l0 = names.layer(0);
    let MixerNames::Gdn(gdn) = l0.mixer() else {
        panic!("layer 0 is linear attention")
    };
    let GdnProjectionNames::Split {
        in_proj_qkv,
        in_proj_z,
        in_proj_b,
        ..
    } = &gdn.projections
    else {
        panic!("qwen3_5 splits the projections")
    };
    let lin = c.linear.clone().unwrap();
    assert_eq!(shape(&source, in_proj_qkv), [lin.conv_dim(), c.hidden_size]);
    assert_eq!(shape(&source, in_proj_z), [lin.value_dim(), c.hidden_size]);
    assert_eq!(
        shape(&source, in_proj_b),
        [lin.num_value_heads, c.hidden_size]
    );
    assert_eq!(
        shape(&source, &gdn.conv1d),
        [lin.conv_dim(), 1, lin.conv_kernel_dim]
    );
    assert_eq!(shape(&source, &gdn.norm), [lin.value_head_dim]);
    // Gated attention: q_proj holds [q | gate] per head.
    let q = names.layer(1).q_proj();
    assert_eq!(
        shape(&source, &q),
        [
            2 * c.attention.num_attention_heads * c.attention.head_dim,
            c.hidden_size
        ]
    );
}

#[test]
fn qwen3_5_wrapper_names_use_the_language_model_prefix() {
    let (names, _, c) = model!("qwen3_5");
    assert!(c.checkpoint.has_vision);
    assert_eq!(names.layout().prefix, ModelPrefix::Multimodal);
    assert_eq!(
        names.embed_tokens(),
        "model.language_model.embed_tokens.weight"
    );
    assert_eq!(names.final_norm(), "model.language_model.norm.weight");
    assert_eq!(names.lm_head(), "lm_head.weight");
}

#[test]
fn qwen3_next_names_match_transformers() {
    let (names, source, c) = model!("qwen3_next");
    assert_eq!(names.layout().experts, ExpertLayout::PerExpert);
    let MixerNames::Gdn(gdn) = names.layer(0).mixer() else {
        panic!("layer 0 is linear attention")
    };
    let GdnProjectionNames::Fused {
        in_proj_qkvz,
        in_proj_ba,
    } = &gdn.projections
    else {
        panic!("qwen3_next fuses the projections")
    };
    let lin = c.linear.clone().unwrap();
    assert_eq!(
        shape(&source, in_proj_qkvz),
        [2 * lin.key_dim() + 2 * lin.value_dim(), c.hidden_size]
    );
    assert_eq!(
        shape(&source, in_proj_ba),
        [2 * lin.num_value_heads, c.hidden_size]
    );
    assert!(
        matches!(names.layer(0).ffn(), FfnNames::Dense(_)),
        "mlp_only_layers [0]"
    );
    let FfnNames::Moe(moe) = names.layer(1).ffn() else {
        panic!("layer 1 is MoE")
    };
    let m = c.moe.clone().unwrap();
    assert_eq!(shape(&source, &moe.router), [m.num_experts, c.hidden_size]);
    let ExpertNames::PerExpert(experts) = &moe.experts else {
        panic!("save_pretrained writes per expert")
    };
    assert_eq!(experts.len(), m.num_experts);
    assert_eq!(
        shape(&source, &experts[1].gate_proj),
        [m.moe_intermediate_size, c.hidden_size]
    );
    assert_eq!(
        shape(&source, &moe.shared_expert.down_proj),
        [c.hidden_size, m.shared_expert_intermediate_size]
    );
    assert_eq!(shape(&source, &moe.shared_expert_gate), [1, c.hidden_size]);
}

#[test]
fn qwen3_5_moe_wrapper_names_match_transformers() {
    let (names, _, c) = model!("qwen3_5_moe");
    assert_eq!(names.layout().prefix, ModelPrefix::Multimodal);
    assert!((0..c.num_hidden_layers).all(|i| names.layer(i).is_moe()));
    assert!(names.mtp().is_none());
}

#[test]
fn fused_experts_and_an_mtp_head_are_detected() {
    // The qwen3_next test model with transformers' in-memory expert layout and an MTP head.
    let mut keys: Vec<(String, Vec<usize>)> = keys(include_str!("../testdata/qwen3_next.txt"))
        .into_iter()
        .filter(|(n, _)| !n.contains("mlp.experts."))
        .collect();
    keys.push((
        "model.layers.1.mlp.experts.gate_up_proj".into(),
        vec![2, 32, 32],
    ));
    keys.push((
        "model.layers.1.mlp.experts.down_proj".into(),
        vec![2, 32, 16],
    ));
    for (suffix, shape) in [
        ("fc.weight", vec![32, 64]),
        ("pre_fc_norm_embedding.weight", vec![32]),
        ("pre_fc_norm_hidden.weight", vec![32]),
        ("norm.weight", vec![32]),
    ] {
        keys.push((format!("mtp.{suffix}"), shape));
    }
    let layer1: Vec<(String, Vec<usize>)> = keys
        .iter()
        .filter_map(|(n, s)| {
            n.strip_prefix("model.layers.1.")
                .map(|rest| (format!("mtp.layers.0.{rest}"), s.clone()))
        })
        .collect();
    keys.extend(layer1);
    let (dir, config) = checkpoint(include_str!("../testdata/qwen3_next.json"), &keys);
    let source = SafetensorsSource::open(dir.path()).unwrap();
    let names = WeightNames::detect(&source, &config).unwrap();
    let layout = names.layout();
    assert_eq!(
        (layout.experts, layout.mtp_experts, layout.mtp_layers),
        (ExpertLayout::Fused, ExpertLayout::Fused, 1)
    );
    let ours: BTreeSet<String> = names.all().into_iter().collect();
    let theirs: BTreeSet<String> = keys.into_iter().map(|(n, _)| n).collect();
    assert_eq!(ours, theirs);
    let mtp = names.mtp().unwrap();
    assert_eq!(mtp.layers[0].prefix(), "mtp.layers.0.");
    assert!(matches!(mtp.layers[0].mixer(), MixerNames::Attention(_)));
}

#[test]
fn detect_reports_what_it_could_not_find() {
    let keys = vec![("embed".to_string(), vec![2])];
    let (dir, config) = checkpoint(include_str!("../testdata/qwen3.json"), &keys);
    let source = SafetensorsSource::open(dir.path()).unwrap();
    let err = WeightNames::detect(&source, &config).unwrap_err();
    assert!(
        matches!(&err, WeightError::Missing { tensor, .. } if tensor == "model.embed_tokens.weight"),
        "{err}"
    );
    // A MoE model whose first MoE layer has neither expert layout.
    let keys: Vec<(String, Vec<usize>)> = keys_without_experts();
    let (dir, config) = checkpoint(include_str!("../testdata/qwen3_next.json"), &keys);
    let source = SafetensorsSource::open(dir.path()).unwrap();
    let err = WeightNames::detect(&source, &config).unwrap_err();
    assert!(
        err.to_string()
            .contains("model.layers.1.mlp.experts.0.gate_proj.weight"),
        "{err}"
    );
}

fn keys_without_experts() -> Vec<(String, Vec<usize>)> {
    keys(include_str!("../testdata/qwen3_next.txt"))
        .into_iter()
        .filter(|(n, _)| !n.contains("experts"))
        .collect()
}

#[test]
fn names_past_the_last_layer_are_absent_not_a_panic() {
    let (names, source, _) = model!("qwen3");
    let extra = names.layer(99);
    assert!(!source.contains(&extra.q_proj()));
    assert!(matches!(
        source.load_bf16(&extra.q_proj(), &[1]),
        Err(WeightError::Missing { .. })
    ));
}
