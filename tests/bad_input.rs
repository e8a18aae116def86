//! Bad checkpoints and bad requests get typed errors that name what is wrong and where; nothing
//! panics, and a refused request leaves the engine serving.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::path::Path;

use metrale::{
    Engine, EngineError, EngineOptions, GenerateRequest, ModelOptions, Prompt, RequestError,
    SamplingParams,
};
use support::fixtures_dir;

fn copy_fixture(dst: &Path) {
    for e in std::fs::read_dir(fixtures_dir().join("qwen3-tiny"))
        .unwrap()
        .flatten()
    {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
}

fn load_err(dir: &Path) -> String {
    match Engine::load(dir, EngineOptions::default()) {
        Ok(_) => panic!("{} loaded, expected an error", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

#[test]
fn a_truncated_safetensors_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(tmp.path());
    let p = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn a_corrupt_header_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(tmp.path());
    let p = tmp.path().join("model.safetensors");
    let mut bytes = std::fs::read(&p).unwrap();
    bytes[8..16].copy_from_slice(b"garbage!");
    std::fs::write(&p, &bytes).unwrap();
    let e = load_err(tmp.path());
    assert!(e.contains("model.safetensors"), "{e}");
}

#[test]
fn a_missing_tensor_and_a_wrong_shape_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(tmp.path());
    // A config claiming a bigger FFN than the weights have: a shape mismatch on the MLP.
    edit_config(tmp.path(), |c| {
        c["intermediate_size"] = serde_json::json!(c["intermediate_size"].as_u64().unwrap() + 8)
    });
    let e = load_err(tmp.path());
    assert!(e.contains("mlp") && e.contains("proj"), "{e}");
    // A config claiming one layer more than the checkpoint has: a missing tensor.
    copy_fixture(tmp.path());
    edit_config(tmp.path(), |c| {
        let n = c["num_hidden_layers"].as_u64().unwrap();
        c["num_hidden_layers"] = serde_json::json!(n + 1);
        if let Some(t) = c["layer_types"].as_array_mut() {
            t.push(serde_json::json!("full_attention"));
        }
    });
    let e = load_err(tmp.path());
    let n = read_layers(tmp.path()) - 1;
    assert!(e.contains(&format!("layers.{n}.")), "{e}");
}

#[test]
fn a_huge_size_in_the_config_is_a_shape_error() {
    // The expected shapes come from config.json: nothing is sized by them before the
    // checkpoint's headers agree, on one device or sharded over ranks.
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(tmp.path());
    edit_config(tmp.path(), |c| {
        c["intermediate_size"] = serde_json::json!(1u64 << 50)
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("mlp") && e.contains(&(1u64 << 50).to_string()),
        "{e}"
    );
    let sharded = EngineOptions::default().model(ModelOptions::default().tensor_parallel_size(2));
    match Engine::load(tmp.path(), sharded) {
        Ok(_) => panic!("a sharded load of a checkpoint of the wrong shapes succeeded"),
        Err(e) => assert!(e.to_string().contains("mlp"), "{e}"),
    }
}

#[test]
fn an_absurd_layer_or_expert_count_is_refused_by_name() {
    // Counts size the per-layer and per-expert records a load builds before reading weights:
    // a mistyped one is a config error naming the file and the field, not an abort.
    let tmp = tempfile::tempdir().unwrap();
    for (key, n) in [
        ("num_hidden_layers", 1u64 << 40),
        ("num_nextn_predict_layers", 1 << 40),
    ] {
        copy_fixture(tmp.path());
        edit_config(tmp.path(), |c| {
            c[key] = serde_json::json!(n);
            if let Some(map) = c.as_object_mut() {
                map.remove("layer_types");
            }
        });
        let e = load_err(tmp.path());
        assert!(
            e.contains("config.json") && e.contains(key) && e.contains(&n.to_string()),
            "{key}: {e}"
        );
    }
}

#[test]
fn an_absurd_context_length_is_a_typed_error() {
    // Past 32-bit positions: refused by name. Inside them, the default KV cache (every
    // sequence at full length) is sized first on the device, which refuses it, before any
    // host bookkeeping is sized by it.
    for (len, names) in [(usize::MAX, "max_seq_len"), (u32::MAX as usize, "KV cache")] {
        let options = EngineOptions::default().model(ModelOptions::default().max_seq_len(len));
        match Engine::load(fixtures_dir().join("qwen3-tiny"), options) {
            Ok(_) => panic!("a max_seq_len of {len} was accepted"),
            Err(e) => assert!(e.to_string().contains(names), "{len}: {e}"),
        }
    }
}

fn read_layers(dir: &Path) -> u64 {
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    v["num_hidden_layers"].as_u64().unwrap()
}

#[test]
fn an_eos_token_outside_the_vocabulary_is_named() {
    // The EOS ids reach llguidance's token trie (which asserts they are inside the vocabulary)
    // and the device sampler's rows under `min_tokens`: refused at load, naming the file.
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(tmp.path());
    edit_config(tmp.path(), |c| {
        c["eos_token_id"] = serde_json::json!([0, 512])
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains("config.json") && e.contains("eos_token_id") && e.contains("512"),
        "{e}"
    );
    copy_fixture(tmp.path());
    std::fs::write(
        tmp.path().join("generation_config.json"),
        r#"{"eos_token_id": 600}"#,
    )
    .unwrap();
    let e = load_err(tmp.path());
    assert!(
        e.contains("generation_config.json") && e.contains("eos_token_id") && e.contains("600"),
        "{e}"
    );
}

#[test]
fn an_unsupported_model_type_lists_the_supported_ones() {
    let tmp = tempfile::tempdir().unwrap();
    copy_fixture(tmp.path());
    edit_config(tmp.path(), |c| c["model_type"] = serde_json::json!("gpt2"));
    let e = load_err(tmp.path());
    assert!(
        e.contains("gpt2") && e.contains("qwen3") && e.contains("llama"),
        "{e}"
    );
}

#[test]
fn a_missing_checkpoint_dir_is_named() {
    let e = load_err(Path::new("/nonexistent/metrale-checkpoint"));
    assert!(e.contains("/nonexistent/metrale-checkpoint"), "{e}");
}

#[test]
fn bad_requests_are_refused_and_the_engine_keeps_serving() {
    let options = EngineOptions::default().model(ModelOptions::default().max_seq_len(64));
    let engine = Engine::load(fixtures_dir().join("qwen3-tiny"), options).unwrap();
    let vocab = engine.config().tokens.vocab_size as u32;
    let good = GenerateRequest::new(Prompt::TokenIds(vec![1, 2, 3]))
        .max_new_tokens(4)
        .ignore_eos(true);
    let before = engine.generate(&good).unwrap();

    let cases: Vec<(GenerateRequest, fn(&RequestError) -> bool)> = vec![
        (GenerateRequest::new(Prompt::TokenIds(vec![])), |e| {
            matches!(e, RequestError::EmptyPrompt)
        }),
        (GenerateRequest::new(Prompt::TokenIds(vec![1; 65])), |e| {
            matches!(e, RequestError::PromptTooLong { len: 65, max: 64 })
        }),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1, vocab])),
            |e| matches!(e, RequestError::TokenOutOfVocab { index: 1, .. }),
        ),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1]))
                .sampling(SamplingParams::default().temperature(-0.5)),
            |e| matches!(e, RequestError::Sampling(s) if s.field == "temperature"),
        ),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1]))
                .sampling(SamplingParams::default().top_p(1.5)),
            |e| matches!(e, RequestError::Sampling(s) if s.field == "top_p"),
        ),
        (
            GenerateRequest::new(Prompt::TokenIds(vec![1]))
                .stop_token_ids(vec![vocab])
                .sampling(SamplingParams::default().min_tokens(2)),
            |e| matches!(e, RequestError::Sampling(s) if s.field == "stop_token_ids"),
        ),
    ];
    for (req, want) in cases {
        match engine.generate(&req) {
            Err(EngineError::Request(e)) => assert!(want(&e), "unexpected error {e:?} for {req:?}"),
            other => panic!("{req:?} gave {other:?}"),
        }
    }
    assert_eq!(
        engine.generate(&good).unwrap(),
        before,
        "the engine serves as before"
    );
}

#[test]
fn generation_stops_at_max_seq_len() {
    let options = EngineOptions::default().model(ModelOptions::default().max_seq_len(20));
    let engine = Engine::load(fixtures_dir().join("qwen3-tiny"), options).unwrap();
    let out = engine
        .generate(
            &GenerateRequest::new(Prompt::TokenIds(vec![5; 16]))
                .max_new_tokens(50)
                .ignore_eos(true),
        )
        .unwrap();
    // Positions 0..20 hold 16 prompt tokens and 4 fed-back tokens; the 5th token is the last.
    assert_eq!(out.token_ids.len(), 5);
    assert_eq!(out.finish_reason, metrale::FinishReason::Length);
}

#[cfg(not(feature = "cuda"))]
#[test]
fn the_cuda_backend_without_cuda_says_so() {
    let options = EngineOptions::default().backend(metrale::Backend::cuda(0));
    match Engine::load(fixtures_dir().join("qwen3-tiny"), options) {
        Err(EngineError::BackendUnavailable {
            backend: "cuda",
            why,
        }) => assert!(why.contains("not built with CUDA"), "{why}"),
        other => panic!("{other:?}"),
    }
}

/// A copy of the FP8 pack `qwen3-fp8-tiny` whose tensors pass through `edit` (`None` drops one).
fn fp8_pack_with(
    dst: &Path,
    edit: impl Fn(&str, &[usize], &[u8]) -> Option<(Vec<usize>, Vec<u8>)>,
) {
    let src = fixtures_dir().join("qwen3-fp8-tiny");
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = (st.tensors().into_iter())
        .filter_map(|(name, v)| {
            let (shape, data) = edit(&name, v.shape(), v.data())?;
            Some((name, v.dtype(), shape, data))
        })
        .collect();
    let views = kept.iter().map(|(n, dtype, shape, data)| {
        let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), data).unwrap();
        (n.clone(), view)
    });
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
}

#[test]
fn an_fp8_pack_without_a_scale_or_with_a_misshapen_one_is_named() {
    let scale = "model.layers.1.mlp.down_proj.weight_scale_inv";
    let tmp = tempfile::tempdir().unwrap();
    fp8_pack_with(tmp.path(), |name, shape, data| {
        (name != scale).then(|| (shape.to_vec(), data.to_vec()))
    });
    let e = load_err(tmp.path());
    assert!(e.contains(scale) && e.contains("has no scale"), "{e}");

    // The scale grid of `[192, 320]` is [2, 3]; one with a column too few is refused.
    let tmp = tempfile::tempdir().unwrap();
    fp8_pack_with(tmp.path(), |name, shape, data| {
        if name != scale {
            return Some((shape.to_vec(), data.to_vec()));
        }
        assert_eq!(shape, [2, 3]);
        let cut: Vec<u8> = data
            .chunks_exact(12)
            .flat_map(|row| row[..8].to_vec())
            .collect();
        Some((vec![2, 2], cut))
    });
    let e = load_err(tmp.path());
    assert!(
        e.contains(scale) && e.contains("[2, 3]") && e.contains("[2, 2]"),
        "{e}"
    );
}

/// A malformed FP8 KV scale is refused at load, naming the tensor: not one value, negative,
/// NaN, or a K scale without its V scale.
#[test]
fn malformed_kv_scales_are_named() {
    let layers = metrale_config::ModelConfig::from_dir(&fixtures_dir().join("qwen3-tiny"))
        .unwrap()
        .num_hidden_layers;
    let cases: [(Vec<(String, Vec<usize>, Vec<f32>)>, &str, &str); 4] = [
        (
            support::kv_scale_tensors(layers, (0.5, 0.5), &[2]),
            "model.layers.0.self_attn.k_scale",
            "[2]",
        ),
        (
            support::kv_scale_tensors(layers, (0.5, -1.0), &[1]),
            "model.layers.0.self_attn.v_scale",
            "-1",
        ),
        (
            support::kv_scale_tensors(layers, (f32::NAN, 0.5), &[]),
            "model.layers.0.self_attn.k_scale",
            "NaN",
        ),
        (
            support::kv_scale_tensors(layers, (0.5, 0.5), &[])
                .into_iter()
                .filter(|t| !t.0.ends_with("v_scale"))
                .collect(),
            "model.layers.0.self_attn.v_scale",
            "not in the checkpoint",
        ),
    ];
    for (tensors, name, what) in cases {
        let tmp = tempfile::tempdir().unwrap();
        support::copy_with_tensors("qwen3-tiny", tmp.path(), &tensors, |_| {}).unwrap();
        let e = load_err(tmp.path());
        assert!(e.contains(name) && e.contains(what), "{e}");
    }
}
