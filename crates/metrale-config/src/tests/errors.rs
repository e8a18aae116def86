//! One test per error case: the variant, and a message that names the file and the field.

use super::{PATH, parse, parse_value};
use crate::{ConfigError, ModelConfig};
use serde_json::{Value, json};
use std::path::Path;

/// A valid small Qwen3 config to break one field of.
fn qwen3() -> Value {
    json!({
        "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 96, "vocab_size": 100, "rope_theta": 1000000
    })
}

/// A valid small Qwen3.5 wrapper config.
fn qwen3_5() -> Value {
    json!({
        "model_type": "qwen3_5",
        "text_config": {
            "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 100,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8
        }
    })
}

fn with(mut base: Value, pointer: &str, value: Value) -> Value {
    let (parent, key) = pointer.rsplit_once('/').unwrap();
    base.pointer_mut(parent)
        .unwrap()
        .as_object_mut()
        .unwrap()
        .insert(key.to_string(), value);
    base
}

/// The error's message, after checking it names the file and every `needles` entry.
fn message(err: &ConfigError, needles: &[&str]) -> String {
    let msg = err.to_string();
    assert!(msg.contains(PATH), "no path in: {msg}");
    for needle in needles {
        assert!(msg.contains(needle), "`{needle}` not in: {msg}");
    }
    msg
}

fn field_of(err: &ConfigError) -> &str {
    match err {
        ConfigError::MissingField { field, .. }
        | ConfigError::InvalidField { field, .. }
        | ConfigError::Unsupported { field, .. } => field,
        other => panic!("no field in {other:?}"),
    }
}

#[test]
fn the_base_configs_are_valid() {
    parse_value(&qwen3()).unwrap();
    let c = parse_value(&qwen3_5()).unwrap();
    assert!(!c.checkpoint.has_vision, "no vision_config given");
}

#[test]
fn io_error_names_the_missing_file() {
    let dir = tempfile::tempdir().unwrap();
    let err = ModelConfig::from_dir(dir.path()).unwrap_err();
    assert!(matches!(err, ConfigError::Io { .. }));
    assert!(err.to_string().contains("config.json"), "{err}");
}

#[test]
fn json_error_gives_line_and_column() {
    let err = parse("{\n  \"model_type\": \"qwen3\",\n  oops\n}").unwrap_err();
    let ConfigError::Json { line, column, .. } = &err else {
        panic!("{err:?}")
    };
    assert_eq!((*line, *column), (3, 3));
    message(&err, &[":3:3", "invalid JSON"]);
}

#[test]
fn missing_model_type_and_missing_text_config() {
    let err = parse_value(&json!({"hidden_size": 64})).unwrap_err();
    assert!(matches!(err, ConfigError::MissingField { .. }));
    assert_eq!(field_of(&err), "model_type");
    message(&err, &["model_type"]);
    let err = parse_value(&json!({"model_type": "qwen3_5_moe"})).unwrap_err();
    assert_eq!(field_of(&err), "text_config");
}

#[test]
fn unsupported_model_type_lists_the_supported_ones() {
    let err = parse_value(&json!({"model_type": "mistral"})).unwrap_err();
    let ConfigError::UnsupportedModelType {
        found, supported, ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(found, "mistral");
    assert_eq!(supported.len(), 7);
    message(
        &err,
        &[
            "mistral",
            "qwen3, llama, qwen3_5_text, qwen3_5, qwen3_next",
            "qwen3_5_moe",
        ],
    );
}

#[test]
fn wrong_type_is_an_invalid_field_with_expected_and_found() {
    let err = parse_value(&with(qwen3(), "/hidden_size", json!("4096"))).unwrap_err();
    assert!(matches!(err, ConfigError::InvalidField { .. }));
    message(&err, &["hidden_size", "non-negative integer", "\"4096\""]);
    let err = parse_value(&with(qwen3_5(), "/text_config/vocab_size", json!(1.5))).unwrap_err();
    assert_eq!(field_of(&err), "text_config.vocab_size");
}

#[test]
fn zero_sizes_are_refused() {
    for field in [
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "vocab_size",
        "head_dim",
    ] {
        let err = parse_value(&with(qwen3(), &format!("/{field}"), json!(0))).unwrap_err();
        assert_eq!(field_of(&err), field);
        message(&err, &[field, "positive"]);
    }
}

#[test]
fn heads_must_divide_by_kv_heads() {
    let err = parse_value(&with(qwen3(), "/num_key_value_heads", json!(3))).unwrap_err();
    assert_eq!(field_of(&err), "num_key_value_heads");
    message(&err, &["divisor of num_attention_heads (4)", "found 3"]);
}

#[test]
fn llama_hidden_size_must_divide_by_heads() {
    let value = json!({"model_type": "llama", "hidden_size": 66, "num_attention_heads": 4,
                       "head_dim": 16});
    let err = parse_value(&value).unwrap_err();
    assert_eq!(field_of(&err), "hidden_size");
}

#[test]
fn layer_types_length_must_match_layer_count() {
    let types = json!(["linear_attention", "full_attention"]);
    let err = parse_value(&with(qwen3_5(), "/text_config/layer_types", types)).unwrap_err();
    assert_eq!(field_of(&err), "text_config.layer_types");
    message(&err, &["4 entries (num_hidden_layers)", "found 2 entries"]);
}

#[test]
fn unknown_layer_type_is_invalid() {
    let types = json!([
        "linear_attention",
        "mamba",
        "linear_attention",
        "full_attention"
    ]);
    let err = parse_value(&with(qwen3_5(), "/text_config/layer_types", types)).unwrap_err();
    assert!(matches!(err, ConfigError::InvalidField { .. }));
    message(&err, &["text_config.layer_types", "layer 1", "\"mamba\""]);
}

#[test]
fn non_silu_activation_is_unsupported() {
    let err = parse_value(&with(qwen3(), "/hidden_act", json!("gelu"))).unwrap_err();
    assert!(matches!(err, ConfigError::Unsupported { .. }));
    assert_eq!(field_of(&err), "hidden_act");
    message(&err, &["\"gelu\"", "silu"]);
}

#[test]
fn biases_are_unsupported() {
    for field in ["attention_bias", "mlp_bias"] {
        let err = parse_value(&with(qwen3(), &format!("/{field}"), json!(true))).unwrap_err();
        assert!(matches!(err, ConfigError::Unsupported { .. }), "{err}");
        assert_eq!(field_of(&err), field);
        message(&err, &[field, "biases"]);
    }
    parse_value(&with(qwen3(), "/attention_bias", json!(false))).unwrap();
}

#[test]
fn sliding_window_is_unsupported_only_when_enabled() {
    let windowed = with(qwen3(), "/sliding_window", json!(4096));
    parse_value(&windowed).unwrap();
    let err = parse_value(&with(windowed, "/use_sliding_window", json!(true))).unwrap_err();
    assert!(matches!(err, ConfigError::Unsupported { .. }));
    assert_eq!(field_of(&err), "sliding_window");
    message(&err, &["4096", "use_sliding_window"]);
    // Enabled but with a null window: transformers builds no sliding layer.
    let null_window = with(qwen3(), "/use_sliding_window", json!(true));
    parse_value(&with(null_window, "/sliding_window", Value::Null)).unwrap();
}

#[test]
fn unsupported_rope_type_is_refused() {
    let scaling = json!({"rope_type": "dynamic", "factor": 2.0});
    let err = parse_value(&with(qwen3(), "/rope_scaling", scaling)).unwrap_err();
    assert_eq!(field_of(&err), "rope_scaling.rope_type");
    message(&err, &["\"dynamic\"", "default, linear, llama3, yarn"]);
}

#[test]
fn ungated_attention_in_a_gated_family_is_unsupported() {
    let err = parse_value(&with(
        qwen3_5(),
        "/text_config/attn_output_gate",
        json!(false),
    ))
    .unwrap_err();
    assert_eq!(field_of(&err), "text_config.attn_output_gate");
}

#[test]
fn mismatched_inner_model_type_is_invalid() {
    let err = parse_value(&with(
        qwen3_5(),
        "/text_config/model_type",
        json!("qwen3_next"),
    ))
    .unwrap_err();
    assert_eq!(field_of(&err), "text_config.model_type");
    message(&err, &["qwen3_5_text", "qwen3_next"]);
}

#[test]
fn moe_top_k_must_not_exceed_experts() {
    let value = json!({"model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 5});
    let err = parse_value(&value).unwrap_err();
    assert_eq!(field_of(&err), "num_experts_per_tok");
    message(&err, &["1..=4", "found 5"]);
}

#[test]
fn eos_ids_past_the_vocabulary_are_refused() {
    let err = parse_value(&with(qwen3(), "/eos_token_id", json!([1, 100]))).unwrap_err();
    assert_eq!(field_of(&err), "eos_token_id");
    message(&err, &["vocab_size (100)", "found 100"]);
    let err = parse_value(&with(qwen3_5(), "/eos_token_id", json!(250))).unwrap_err();
    assert_eq!(field_of(&err), "eos_token_id");
    let err = parse_value(&with(qwen3_5(), "/text_config/eos_token_id", json!(100))).unwrap_err();
    assert_eq!(field_of(&err), "text_config.eos_token_id");
    let mut c = parse_value(&qwen3()).unwrap();
    let path = Path::new("/ckpt/generation_config.json");
    let err = c
        .apply_generation_config(r#"{"eos_token_id": [7, 4096]}"#, path)
        .unwrap_err();
    assert_eq!(field_of(&err), "eos_token_id");
    assert!(err.to_string().contains("generation_config.json"), "{err}");
    c.apply_generation_config(r#"{"eos_token_id": 99}"#, path)
        .unwrap();
    assert_eq!(c.tokens.eos_token_ids, vec![99]);
}

#[test]
fn bad_generation_config_names_its_own_file() {
    let mut c = parse_value(&qwen3()).unwrap();
    let path = Path::new("/ckpt/generation_config.json");
    let err = c
        .apply_generation_config(r#"{"eos_token_id": ["x"]}"#, path)
        .unwrap_err();
    assert_eq!(field_of(&err), "eos_token_id");
    assert!(err.to_string().contains("generation_config.json"), "{err}");
    let err = c.apply_generation_config("[1, 2", path).unwrap_err();
    assert!(matches!(err, ConfigError::Json { .. }));
    for (text, field) in [
        (r#"{"temperature": -0.5}"#, "temperature"),
        (r#"{"top_p": 0}"#, "top_p"),
        (r#"{"top_p": 1.5}"#, "top_p"),
        (r#"{"top_k": -1}"#, "top_k"),
        (r#"{"min_p": "0.1"}"#, "min_p"),
        (r#"{"repetition_penalty": 0}"#, "repetition_penalty"),
    ] {
        let err = c.apply_generation_config(text, path).unwrap_err();
        assert_eq!(field_of(&err), field, "{text}");
    }
    c.apply_generation_config(r#"{"temperature": null, "top_k": null}"#, path)
        .unwrap();
    assert!(c.checkpoint.generation.is_empty(), "null is unset");
}

#[test]
fn fp8_packs_are_read_and_other_quantizations_refused_naming_the_field() {
    use crate::WeightQuantization;
    let pack = json!({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128]});
    let c = parse_value(&with(qwen3(), "/quantization_config", pack.clone())).unwrap();
    assert_eq!(
        c.checkpoint.quantization,
        Some(WeightQuantization::Fp8 {
            method: "fp8".into()
        })
    );
    assert_eq!(parse_value(&qwen3()).unwrap().checkpoint.quantization, None);
    let compressed = json!({"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": true}}}});
    let c = parse_value(&with(qwen3(), "/quantization_config", compressed.clone())).unwrap();
    assert!(matches!(
        c.checkpoint.quantization,
        Some(WeightQuantization::Fp8 { .. })
    ));

    let refused = |q: Value, field: &str, needles: &[&str]| {
        let err = parse_value(&with(qwen3(), "/quantization_config", q)).unwrap_err();
        assert!(matches!(err, ConfigError::Unsupported { .. }), "{err:?}");
        assert!(field_of(&err).ends_with(field), "{err:?}");
        message(&err, needles);
    };
    refused(with(pack.clone(), "/fmt", json!("e5m2")), "fmt", &["e4m3"]);
    refused(
        with(pack.clone(), "/activation_scheme", json!("static")),
        "activation_scheme",
        &["dynamic"],
    );
    refused(
        with(pack.clone(), "/weight_block_size", json!([64, 64])),
        "weight_block_size",
        &["128"],
    );
    refused(
        json!({"quant_method": "awq", "bits": 4}),
        "quant_method",
        &["awq"],
    );
    let int8 = with(
        compressed.clone(),
        "/config_groups/group_0/weights/type",
        json!("int"),
    );
    refused(int8, "num_bits", &["8-bit float"]);
    let static_inputs = with(
        compressed,
        "/config_groups/group_0/input_activations/dynamic",
        json!(false),
    );
    refused(static_inputs, "dynamic", &["dynamic"]);
}

#[test]
fn an_fp8_kv_cache_scheme_is_read_and_other_kv_schemes_refused_naming_the_field() {
    let pack = json!({"quant_method": "fp8", "fmt": "e4m3"});
    assert!(!parse_value(&qwen3()).unwrap().checkpoint.kv_cache_fp8);
    let plain = parse_value(&with(qwen3(), "/quantization_config", pack.clone())).unwrap();
    assert!(!plain.checkpoint.kv_cache_fp8);
    let null = with(pack.clone(), "/kv_cache_scheme", Value::Null);
    let c = parse_value(&with(qwen3(), "/quantization_config", null)).unwrap();
    assert!(!c.checkpoint.kv_cache_fp8, "a null scheme is none");
    let scheme = json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false});
    let c = parse_value(&with(
        qwen3(),
        "/quantization_config",
        with(pack.clone(), "/kv_cache_scheme", scheme.clone()),
    ))
    .unwrap();
    assert!(c.checkpoint.kv_cache_fp8);
    let algo = with(pack.clone(), "/kv_cache_quant_algo", json!("FP8"));
    let c = parse_value(&with(qwen3(), "/quantization_config", algo)).unwrap();
    assert!(c.checkpoint.kv_cache_fp8);

    let refused = |q: Value, field: &str| {
        let err = parse_value(&with(qwen3(), "/quantization_config", q)).unwrap_err();
        assert!(matches!(err, ConfigError::Unsupported { .. }), "{err:?}");
        assert!(field_of(&err).ends_with(field), "{err:?}");
        message(&err, &["KV cache"]);
    };
    let int8 = with(scheme, "/type", json!("int"));
    refused(with(pack.clone(), "/kv_cache_scheme", int8), "num_bits");
    refused(
        with(pack, "/kv_cache_quant_algo", json!("INT8")),
        "kv_cache_quant_algo",
    );
}
