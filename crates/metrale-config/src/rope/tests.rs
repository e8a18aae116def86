//! Tests of `RopeConfig::inv_freq` against values printed by torch 2.15 / transformers 5.24
//! (CPU, float32), and of the rope field parsing.

use super::*;
use serde_json::json;
use std::path::Path;

fn rope(theta: f64, rotary_dim: usize, scaling: RopeScaling) -> RopeConfig {
    RopeConfig {
        theta,
        partial_rotary_factor: 1.0,
        rotary_dim,
        scaling,
        mrope_section: None,
        mrope_interleaved: false,
    }
}

/// Distance in units in the last place between two positive finite floats.
fn ulps(a: f32, b: f32) -> u32 {
    a.to_bits().abs_diff(b.to_bits())
}

/// `expected` holds `(index, torch value)`; `inexact` the indices where torch's SLEEF pow is
/// 1 ulp off the correctly rounded power (found by comparing all entries in the venv).
fn check(actual: &[f32], len: usize, expected: &[(usize, f32)], inexact: &[usize]) {
    assert_eq!(actual.len(), len);
    for &(i, want) in expected {
        let allowed = if inexact.contains(&i) { 1 } else { 0 };
        let d = ulps(actual[i], want);
        assert!(
            d <= allowed,
            "entry {i}: got {:e}, torch {:e} ({d} ulp)",
            actual[i],
            want
        );
        if inexact.contains(&i) {
            assert_eq!(
                d, 1,
                "entry {i} was expected to differ from torch by exactly 1 ulp"
            );
        }
    }
}

#[test]
fn default_rope_matches_torch_for_qwen3_8b() {
    // Qwen3RotaryEmbedding.compute_default_rope_parameters, theta 1e6, head_dim 128.
    let inv = rope(1.0e6, 128, RopeScaling::None).inv_freq();
    let expected = [
        (0, 1.0),
        (1, 0.805_842_2),
        (2, 0.649_381_64),
        (10, 0.115_478_2),
        (37, 0.000_339_820_84),
        (50, 2.053_525e-5),
        (63, 1.240_937_8e-6),
    ];
    check(&inv, 64, &expected, &[37]);
}

#[test]
fn partial_rope_matches_torch_for_qwen3_5() {
    // Qwen3_5TextRotaryEmbedding, theta 1e7, head_dim 256 * 0.25 = 64 rotated channels.
    let inv = rope(1.0e7, 64, RopeScaling::None).inv_freq();
    let expected = [
        (0, 1.0),
        (1, 0.604_296_4),
        (7, 0.029_427_273),
        (15, 0.000_523_299_1),
        (31, 1.654_817_1e-7),
    ];
    check(&inv, 32, &expected, &[]);
}

#[test]
fn llama3_rope_matches_torch_including_the_smoothed_band() {
    // _compute_llama3_parameters for Llama 3.1 8B: theta 5e5, factor 8, low 1, high 4, 8192.
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let inv = rope(5.0e5, 128, scaling).inv_freq();
    // Entries 0..=28 are kept, 29..=34 smoothed, 35.. divided by 8.
    let expected = [
        (0, 1.0),
        (1, 0.814_617_2),
        (16, 0.037_606_03),
        (20, 0.016_560_44),
        (22, 0.010_989_529),
        (24, 0.007_292_665),
        (26, 0.004_839_421_2),
        (30, 0.001_371_893_7),
        (40, 3.428_102_4e-5),
        (63, 3.068_926e-7),
    ];
    check(&inv, 64, &expected, &[]);
    let plain = rope(5.0e5, 128, RopeScaling::None).inv_freq();
    assert_eq!(inv[10], plain[10], "high frequencies are kept");
    assert_eq!(
        inv[40],
        plain[40] / 8.0,
        "low frequencies are divided by the factor"
    );
    assert!(
        inv[31] < plain[31] && inv[31] > plain[31] / 8.0,
        "the band in between is smoothed"
    );
}

#[test]
fn linear_rope_matches_torch() {
    let inv = rope(1.0e4, 128, RopeScaling::Linear { factor: 4.0 }).inv_freq();
    let expected = [
        (0, 0.25),
        (1, 0.216_491_09),
        (10, 0.059_284_34),
        (33, 0.002_164_910_8),
        (63, 2.886_954_8e-5),
    ];
    check(&inv, 64, &expected, &[]);
}

/// Qwen3's YaRN recipe: `{"rope_type": "yarn", "factor": 4.0,
/// "original_max_position_embeddings": 32768}`.
fn qwen3_yarn() -> RopeScaling {
    RopeScaling::Yarn {
        factor: 4.0,
        original_max_position_embeddings: 32768,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: true,
        attention_factor: 0.1 * 4.0f64.ln() + 1.0,
    }
}

#[test]
fn yarn_rope_matches_torch_for_qwen3_long_context() {
    // _compute_yarn_parameters for Qwen3-8B with the model card's recipe: theta 1e6, head_dim
    // 128. The correction range is [23, 40]: entries up to 23 are kept, 40 on divided by 4.
    let config = rope(1.0e6, 128, qwen3_yarn());
    let inv = config.inv_freq();
    let expected = [
        (0, 1.0),
        (1, 0.805_842_2),
        (10, 0.115_478_2),
        (23, 0.006_978_306),
        (24, 0.005_375_321_5),
        (30, 0.001_064_361),
        (37, 1.299_314_9e-4),
        (39, 6.490_394e-5),
        (40, 4.445_698_5e-5),
        (63, 3.102_344_4e-7),
    ];
    check(&inv, 64, &expected, &[37]);
    let plain = rope(1.0e6, 128, RopeScaling::None).inv_freq();
    assert_eq!(inv[..24], plain[..24], "high frequencies are kept");
    for i in 40..64 {
        assert_eq!(inv[i], plain[i] / 4.0, "entry {i} is divided by the factor");
    }
    assert!(
        (24..40).all(|i| inv[i] < plain[i] && inv[i] > plain[i] / 4.0),
        "the correction range is blended"
    );
    // torch: `emb.cos() * attention_scaling` with the Python float 1.138629436111989.
    assert_eq!(config.attention_scaling(), 1.138_629_4);
}

#[test]
fn yarn_rope_matches_torch_without_truncation() {
    // DeepSeek-style settings, theta 1e4, 64 rotated dims, factor 40, original 4096,
    // truncate false: the correction range [10.47.., 22.50..] has fractional ends.
    let scaling = RopeScaling::Yarn {
        factor: 40.0,
        original_max_position_embeddings: 4096,
        beta_fast: 32.0,
        beta_slow: 1.0,
        truncate: false,
        attention_factor: 1.0,
    };
    let inv = rope(1.0e4, 64, scaling).inv_freq();
    let expected = [
        (0, 1.0),
        (10, 0.056_234_13),
        (11, 0.040_367_585),
        (16, 0.005_524_062_6),
        (22, 1.183_876_45e-4),
        (23, 3.333_803_4e-5),
        (31, 3.333_803_5e-6),
    ];
    check(&inv, 32, &expected, &[]);
}

#[test]
fn only_yarn_scales_cos_and_sin() {
    for scaling in [
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
    ] {
        assert_eq!(rope(1.0e4, 64, scaling).attention_scaling(), 1.0);
    }
}

fn parse(
    value: serde_json::Value,
    head_dim: usize,
    default_prf: f64,
) -> Result<RopeConfig, ConfigError> {
    parse_with_context(value, head_dim, default_prf, 4096)
}

fn parse_with_context(
    value: serde_json::Value,
    head_dim: usize,
    default_prf: f64,
    max_position_embeddings: usize,
) -> Result<RopeConfig, ConfigError> {
    let path = Path::new("/ckpt/config.json");
    let fields = Fields::root(&value, path)?;
    parse_rope(&fields, head_dim, max_position_embeddings, default_prf)
}

#[test]
fn old_layout_top_level_theta_and_rope_scaling() {
    let cfg = parse(
        json!({"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}}),
        128,
        1.0,
    )
    .unwrap();
    assert_eq!(cfg.theta, 500000.0);
    assert_eq!(cfg.rotary_dim, 128);
    assert_eq!(cfg.scaling, RopeScaling::Linear { factor: 2.0 });
}

#[test]
fn new_layout_dict_wins_over_top_level_and_family_default() {
    let cfg = parse(
        json!({
            "rope_theta": 1.0,
            "partial_rotary_factor": 0.5,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10], "mrope_interleaved": true
            }
        }),
        256,
        1.0,
    )
    .unwrap();
    assert_eq!(cfg.theta, 1.0e7);
    assert_eq!(cfg.rotary_dim, 64);
    assert_eq!(cfg.mrope_section, Some(vec![11, 11, 10]));
    assert!(cfg.mrope_interleaved);
    // Absent everywhere: the family default applies, theta defaults to 10000.
    let cfg = parse(json!({}), 256, 0.25).unwrap();
    assert_eq!((cfg.theta, cfg.rotary_dim), (10000.0, 64));
}

#[test]
fn llama3_original_context_defaults_to_max_position_embeddings() {
    let value = json!({"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0
    }});
    let cfg = parse(value, 64, 1.0).unwrap();
    assert!(matches!(
        cfg.scaling,
        RopeScaling::Llama3 {
            original_max_position_embeddings: 4096,
            ..
        }
    ));
}

#[test]
fn unsupported_rope_type_names_the_field_and_the_supported_ones() {
    let err = parse(
        json!({"rope_scaling": {"rope_type": "proportional", "factor": 4.0}}),
        128,
        1.0,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ConfigError::Unsupported { ref field, .. } if field == "rope_scaling.rope_type")
    );
    assert!(
        msg.contains("proportional") && msg.contains("default, linear, llama3, yarn"),
        "{msg}"
    );
}

#[test]
fn llama3_without_factor_is_a_missing_field() {
    let value = json!({"rope_parameters": {"rope_type": "llama3", "low_freq_factor": 1.0}});
    let err = parse(value, 128, 1.0).unwrap_err();
    assert!(
        matches!(err, ConfigError::MissingField { ref field, .. } if field == "rope_parameters.factor")
    );
}

#[test]
fn bad_partial_factor_and_mrope_sections_are_invalid_fields() {
    let err = parse(json!({"partial_rotary_factor": 0.001}), 128, 1.0).unwrap_err();
    assert!(err.to_string().contains("partial_rotary_factor"), "{err}");
    let value = json!({"rope_parameters": {"mrope_section": [8, 8, 8]}});
    let err = parse(value, 256, 0.25).unwrap_err();
    assert!(
        matches!(err, ConfigError::InvalidField { ref field, .. } if field == "rope_parameters.mrope_section")
    );
    assert!(err.to_string().contains("32"), "{err}");
}

#[test]
fn yarn_from_rope_scaling_as_the_qwen3_model_card_writes_it() {
    // Qwen3-8B's config.json (max_position_embeddings 40960) plus the card's rope_scaling.
    let value = json!({
        "rope_theta": 1000000,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    });
    let cfg = parse_with_context(value, 128, 1.0, 40960).unwrap();
    assert_eq!((cfg.theta, cfg.rotary_dim), (1.0e6, 128));
    assert_eq!(cfg.scaling, qwen3_yarn());
    // transformers' get_mscale(4.0), a Python float.
    assert!(matches!(
        cfg.scaling,
        RopeScaling::Yarn { attention_factor, .. } if attention_factor == 1.138_629_436_111_989
    ));
    assert_eq!(cfg.attention_scaling(), 1.138_629_4);
    assert_eq!(cfg.inv_freq(), rope(1.0e6, 128, qwen3_yarn()).inv_freq());
}

#[test]
fn yarn_from_rope_parameters_with_every_optional_field() {
    let value = json!({"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40,
        "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.707, "mscale_all_dim": 1.0, "truncate": false
    }});
    let cfg = parse_with_context(value, 64, 1.0, 163840).unwrap();
    let RopeScaling::Yarn {
        factor,
        original_max_position_embeddings,
        truncate,
        attention_factor,
        ..
    } = cfg.scaling
    else {
        panic!("not yarn: {:?}", cfg.scaling);
    };
    assert_eq!((factor, original_max_position_embeddings), (40.0, 4096));
    assert!(!truncate);
    // transformers: get_mscale(40, 0.707) / get_mscale(40, 1.0).
    assert_eq!(attention_factor, 0.921_042_355_316_339_9);
    assert_eq!(cfg.attention_scaling(), 0.921_042_4);
    // An explicit attention_factor wins over mscale.
    let value = json!({"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.707, "mscale_all_dim": 1.0, "attention_factor": 1.5
    }});
    assert_eq!(parse(value, 64, 1.0).unwrap().attention_scaling(), 1.5);
}

#[test]
fn yarn_null_factor_is_the_context_ratio_and_defaults_follow_transformers() {
    // factor null: max_position_embeddings / original (4); beta 16 and 2, theta 5e5.
    let value = json!({"rope_parameters": {
        "rope_type": "yarn", "rope_theta": 500000.0, "factor": null,
        "original_max_position_embeddings": 32768, "attention_factor": 1.25,
        "beta_fast": 16, "beta_slow": 2
    }});
    let cfg = parse_with_context(value, 128, 1.0, 131072).unwrap();
    assert!(matches!(cfg.scaling, RopeScaling::Yarn { factor: 4.0, .. }));
    let expected = [
        (0, 1.0),
        (5, 0.358_730_23),
        (13, 0.069_565_95),
        (20, 0.016_560_44),
        (29, 0.002_437_728_7),
        (35, 3.996_234_2e-4),
        (40, 6.856_205e-5),
        (63, 6.137_852e-7),
    ];
    check(&cfg.inv_freq(), 64, &expected, &[]);
    assert_eq!(cfg.attention_scaling(), 1.25);

    // Python's `or`: a zero beta takes the default; a null truncate is false.
    let value = json!({"rope_scaling": {
        "type": "yarn", "factor": 4.0, "beta_fast": 0, "beta_slow": 0, "truncate": null
    }});
    let cfg = parse_with_context(value, 128, 1.0, 32768).unwrap();
    let RopeScaling::Yarn {
        beta_fast,
        beta_slow,
        truncate,
        original_max_position_embeddings,
        ..
    } = cfg.scaling
    else {
        panic!("not yarn: {:?}", cfg.scaling);
    };
    assert_eq!((beta_fast, beta_slow, truncate), (32.0, 1.0, false));
    // Without an original context anywhere, max_position_embeddings is taken as it.
    assert_eq!(original_max_position_embeddings, 32768);
}

#[test]
fn yarn_original_context_at_top_level_wins() {
    let value = json!({
        "original_max_position_embeddings": 8192,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    });
    let cfg = parse_with_context(value, 128, 1.0, 131072).unwrap();
    assert!(matches!(
        cfg.scaling,
        RopeScaling::Yarn {
            original_max_position_embeddings: 8192,
            ..
        }
    ));
}

#[test]
fn yarn_without_factor_is_a_missing_field() {
    let value =
        json!({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32768}});
    let err = parse(value, 128, 1.0).unwrap_err();
    assert!(
        matches!(err, ConfigError::MissingField { ref field, .. } if field == "rope_scaling.factor"),
        "{err}"
    );
}

#[test]
fn bad_yarn_settings_are_invalid_fields() {
    for (key, value) in [
        ("factor", json!(-4.0)),
        ("attention_factor", json!(0.0)),
        ("beta_fast", json!(-1)),
        ("original_max_position_embeddings", json!(0)),
        ("truncate", json!("yes")),
    ] {
        let mut dict = json!({"rope_type": "yarn", "factor": 4.0});
        dict[key] = value;
        let err = parse(json!({ "rope_parameters": dict }), 128, 1.0).unwrap_err();
        let want = format!("rope_parameters.{key}");
        assert!(
            matches!(err, ConfigError::InvalidField { ref field, .. } if *field == want),
            "{key}: {err}"
        );
    }
}

#[test]
fn dynamic_and_longrope_are_refused_with_the_reason() {
    for (rope_type, reason) in [("dynamic", "dynamic NTK"), ("longrope", "short or long")] {
        let value = json!({"rope_scaling": {"rope_type": rope_type, "factor": 2.0}});
        let err = parse(value, 128, 1.0).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, ConfigError::Unsupported { ref field, .. } if field == "rope_scaling.rope_type"),
            "{msg}"
        );
        assert!(
            msg.contains(rope_type) && msg.contains(reason) && msg.contains("KV cache"),
            "{msg}"
        );
        assert!(msg.contains("default, linear, llama3, yarn"), "{msg}");
    }
}
