//! A checkpoint's MTP head (`mtp.*`) loads with the model and is kept; a checkpoint without one
//! loads as before; a broken MTP tensor is named in the error. transformers does not save MTP
//! weights, so the test writes a synthetic head into a copy of the Qwen3.5 fixture.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::PathBuf;
use std::sync::Arc;

use metrale_gpu_runtime::CpuBackend;
use metrale_model_engine::factory;

fn fixture() -> PathBuf {
    support::fixture("qwen3_5-tiny")
}

fn hidden() -> usize {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture().join("config.json")).unwrap())
            .unwrap();
    cfg["hidden_size"].as_u64().unwrap() as usize
}

#[test]
fn an_mtp_head_loads_and_a_checkpoint_without_one_loads_as_before() {
    let plain = factory::load(&fixture(), Arc::new(CpuBackend::default())).unwrap();
    assert!(plain.mtp_head().is_none());

    let tmp = tempfile::tempdir().unwrap();
    let h = hidden();
    support::write_with_mtp(&fixture(), tmp.path());
    let model = factory::load(tmp.path(), Arc::new(CpuBackend::default())).unwrap();
    let head = model.mtp_head().expect("the MTP head is kept");
    assert_eq!(head.layers.len(), 1);
    assert_eq!(head.fc.shape, vec![h, 2 * h]);
}

#[test]
fn a_misshapen_mtp_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let h = hidden();
    support::write_with_mtp_fc(&fixture(), tmp.path(), Some([h, h]));
    let err = factory::load(tmp.path(), Arc::new(CpuBackend::default()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("mtp.fc.weight"), "{err}");
}
