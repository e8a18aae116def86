//! A checkpoint's MTP head (`mtp.*`) loads with the model and is kept; a checkpoint without one
//! loads as before; a broken MTP tensor is named in the error. transformers does not save MTP
//! weights, so the test writes a synthetic head into a copy of the Qwen3.5 fixture.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use metrale_gpu_runtime::CpuBackend;
use metrale_model_engine::{ModelOptions, factory};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5-tiny")
}

/// Copy the fixture into `dst`, adding `mtp.*`: the fc projection, its two norms, the final
/// norm, and one decoder layer copied from the model's first full-attention layer.
fn with_mtp(dst: &Path, fc_shape: [usize; 2]) {
    for e in std::fs::read_dir(fixture()).unwrap().flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    let full = cfg["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .position(|t| t == "full_attention")
        .unwrap();
    let h = cfg["hidden_size"].as_u64().unwrap() as usize;
    let path = dst.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let prefix = format!("model.layers.{full}.");
    for (name, view) in st.tensors() {
        out.push((name.clone(), view.shape().to_vec(), view.data().to_vec()));
        if let Some(rest) = name.strip_prefix(&prefix) {
            out.push((
                format!("mtp.layers.0.{rest}"),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
        }
    }
    let bf16 = |n: usize, v: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|i| half_bits(v + (i % 7) as f32 * 0.01))
            .collect()
    };
    out.push((
        "mtp.fc.weight".into(),
        fc_shape.to_vec(),
        bf16(fc_shape[0] * fc_shape[1], 0.02),
    ));
    for n in [
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ] {
        out.push((n.into(), vec![h], bf16(h, 0.1)));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = out
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

/// bf16 bytes of `v` (truncation is fine for synthetic weights).
fn half_bits(v: f32) -> [u8; 2] {
    ((v.to_bits() >> 16) as u16).to_le_bytes()
}

fn hidden() -> usize {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    cfg["hidden_size"].as_u64().unwrap() as usize
}

#[test]
fn an_mtp_head_loads_and_a_checkpoint_without_one_loads_as_before() {
    let plain = factory::load(
        &fixture(),
        ModelOptions::default(),
        Arc::new(CpuBackend::default()),
    )
    .unwrap();
    assert!(plain.mtp_head().is_none());

    let tmp = tempfile::tempdir().unwrap();
    let h = hidden();
    with_mtp(tmp.path(), [h, 2 * h]);
    let model = factory::load(
        tmp.path(),
        ModelOptions::default(),
        Arc::new(CpuBackend::default()),
    )
    .unwrap();
    let head = model.mtp_head().expect("the MTP head is kept");
    assert_eq!(head.layers.len(), 1);
    assert_eq!(head.fc.shape, vec![h, 2 * h]);
}

#[test]
fn a_misshapen_mtp_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let h = hidden();
    with_mtp(tmp.path(), [h, h]);
    let err = factory::load(
        tmp.path(),
        ModelOptions::default(),
        Arc::new(CpuBackend::default()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("mtp.fc.weight"), "{err}");
}
