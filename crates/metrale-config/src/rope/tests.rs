//! Tests of `RopeConfig::inv_freq` against values printed by torch 2.15 / transformers 5.24
//! (CPU, float32), and of the rope field parsing.

use super::*;
use serde_json::json;
use std::path::Path;

fn rope(theta: f32, rotary_dim: usize, scaling: RopeScaling) -> RopeConfig {
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

fn parse(
    value: serde_json::Value,
    head_dim: usize,
    default_prf: f64,
) -> Result<RopeConfig, ConfigError> {
    let path = Path::new("/ckpt/config.json");
    let fields = Fields::root(&value, path)?;
    parse_rope(&fields, head_dim, 4096, default_prf)
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
        json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
        128,
        1.0,
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ConfigError::Unsupported { ref field, .. } if field == "rope_scaling.rope_type")
    );
    assert!(msg.contains("yarn") && msg.contains("llama3"), "{msg}");
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
