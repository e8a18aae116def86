//! The comparison against transformers can fail: checkpoints broken the way a wrong layer would
//! break them (the wrong RoPE base, two query heads swapped, the other norm convention) are
//! each caught by the rule the fixture tests apply.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::path::Path;

use half::bf16;
use metrale::{Engine, EngineOptions};
use support::*;

fn copy_fixture(src: &Path, dst: &Path) {
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

/// Rewrite `model.safetensors`, passing each bf16 tensor through `edit(name, shape, values)`.
fn edit_weights(dir: &Path, edit: impl Fn(&str, &[usize], &mut Vec<bf16>)) {
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        assert_eq!(view.dtype(), safetensors::Dtype::BF16, "fixtures are bf16");
        let mut vals: Vec<bf16> = view
            .data()
            .chunks_exact(2)
            .map(|c| bf16::from_le_bytes([c[0], c[1]]))
            .collect();
        edit(&name, view.shape(), &mut vals);
        let data = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        tensors.push((name, view.shape().to_vec(), data));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, s.clone(), d)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn copy_of(name: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(&fixtures_dir().join(name), tmp.path());
    tmp
}

fn failures(dir: &Path) -> usize {
    let engine = Engine::load(dir, EngineOptions::default()).unwrap();
    read_reference(dir)
        .unwrap()
        .iter()
        .filter(|p| compare(&engine, p).unwrap().failure.is_some())
        .count()
}

fn fixture() -> std::path::PathBuf {
    fixtures_dir().join("qwen3-tiny")
}

#[test]
fn the_unmodified_copy_passes() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(&fixture(), tmp.path());
    edit_weights(tmp.path(), |_, _, _| {});
    assert_eq!(
        failures(tmp.path()),
        0,
        "a faithful rewrite must still pass"
    );
}

#[test]
fn a_wrong_rope_base_is_caught() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(&fixture(), tmp.path());
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let mut changed = false;
    if cfg["rope_theta"].is_number() {
        cfg["rope_theta"] = serde_json::json!(100.0);
        changed = true;
    }
    if cfg["rope_parameters"]["rope_theta"].is_number() {
        cfg["rope_parameters"]["rope_theta"] = serde_json::json!(100.0);
        changed = true;
    }
    assert!(changed, "the fixture config names its rope_theta");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    assert!(
        failures(tmp.path()) > 0,
        "RoPE base 100 instead of the checkpoint's must fail"
    );
}

#[test]
fn swapped_query_heads_are_caught() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(&fixture(), tmp.path());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    let head_dim = cfg["head_dim"].as_u64().unwrap() as usize;
    edit_weights(tmp.path(), |name, shape, v| {
        if name.ends_with("self_attn.q_proj.weight") {
            let row = shape[1];
            let (h0, h1) = v.split_at_mut(head_dim * row);
            h0.swap_with_slice(&mut h1[..head_dim * row]);
        }
    });
    assert!(
        failures(tmp.path()) > 0,
        "query heads 0 and 1 swapped must fail"
    );
}

#[test]
fn the_other_norm_convention_is_caught() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(&fixture(), tmp.path());
    // Reading w as (1 + w) is the same as running the right convention on w + 1.
    edit_weights(tmp.path(), |name, _, v| {
        if name.ends_with("norm.weight") {
            v.iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() + 1.0));
        }
    });
    assert!(
        failures(tmp.path()) > 0,
        "zero-centred norms on a standard checkpoint must fail"
    );
}

#[test]
fn plain_norms_on_a_zero_centred_family_are_caught() {
    // Qwen3.5's decoder, q/k and final norms are x * (1 + w): reading them as x * w is the same
    // as running the right convention on w - 1.
    let tmp = copy_of("qwen3_5-tiny");
    edit_weights(tmp.path(), |name, _, v| {
        if name.ends_with("norm.weight") && !name.contains("linear_attn") {
            v.iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() - 1.0));
        }
    });
    assert!(failures(tmp.path()) > 0, "plain norms on Qwen3.5 must fail");
}

#[test]
fn a_zero_centred_gdn_output_norm_is_caught() {
    // The GDN output norm is the exception, plain x * w: reading it as x * (1 + w) is the same
    // as running the right convention on w + 1.
    let tmp = copy_of("qwen3_5-tiny");
    edit_weights(tmp.path(), |name, _, v| {
        if name.ends_with("linear_attn.norm.weight") {
            v.iter_mut()
                .for_each(|x| *x = bf16::from_f32(x.to_f32() + 1.0));
        }
    });
    assert!(
        failures(tmp.path()) > 0,
        "a (1 + w) GDN output norm must fail"
    );
}

#[test]
fn swapped_gdn_value_heads_are_caught() {
    // Value heads 0 and 1 of every GDN layer's in_proj_qkv swapped: a wrong key-head to
    // value-head grouping reads them this way.
    let tmp = copy_of("qwen3_5-tiny");
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("config.json")).unwrap())
            .unwrap();
    let (hk, dk, dv) = (
        cfg["linear_num_key_heads"].as_u64().unwrap() as usize,
        cfg["linear_key_head_dim"].as_u64().unwrap() as usize,
        cfg["linear_value_head_dim"].as_u64().unwrap() as usize,
    );
    edit_weights(tmp.path(), |name, shape, v| {
        if name.ends_with("linear_attn.in_proj_qkv.weight") {
            let row = shape[1];
            let v0 = 2 * hk * dk * row;
            let (a, b) = v[v0..].split_at_mut(dv * row);
            a.swap_with_slice(&mut b[..dv * row]);
        }
    });
    assert!(
        failures(tmp.path()) > 0,
        "swapped GDN value heads must fail"
    );
}
