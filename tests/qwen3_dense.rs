//! Qwen3 and Llama checkpoints written by transformers reproduce its greedy tokens and float32
//! logits on the CPU backend, and deliberately broken checkpoints (wrong RoPE base, swapped
//! heads, the other norm convention) fail the same comparison. FP8 packs: the official block
//! layout, the FP8 KV cache, and llm-compressor's compressed-tensors layouts (block: the official
//! pack bit for bit; per channel: the bf16 model of its dequantized weights), and a sharded pack
//! whose scales sit in another shard than their weights.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use std::path::Path;

use metrale::{Engine, EngineOptions, KvCacheDtype, ModelOptions};
use support::*;

#[test]
fn dense_fixtures_match_transformers() {
    let worst = check_fixtures(&["qwen3", "llama"], 5, &EngineOptions::default());
    eprintln!("worst logits relative L2 error over all dense fixtures: {worst:.3e}");
}

/// With an FP8 KV cache (scales 1.0: the fixtures have none) every dense fixture passes the FP8
/// rule; the bf16 rule is the tighter one, so the cache must be what moved them.
#[test]
fn dense_fixtures_match_transformers_with_an_fp8_kv_cache() {
    let fp8 = ModelOptions::default().kv_cache_dtype(KvCacheDtype::Fp8);
    let options = EngineOptions::default().model(fp8);
    let worst = check_fixtures_by(&["qwen3", "llama"], 5, &options, Rule::FP8_KV);
    eprintln!("worst logits relative L2 error over the dense fixtures, FP8 KV: {worst:.3e}");
    let bf16 = check_fixtures(&["qwen3", "llama"], 5, &EngineOptions::default());
    assert!(
        worst > bf16,
        "the FP8 cache moves the logits: {worst:.3e} vs bf16 {bf16:.3e}"
    );
}

/// A checkpoint whose `quantization_config` asks for an FP8 KV cache and whose attention layers
/// carry `k_scale` / `v_scale`: `auto` picks FP8, the loader reads each layer's pair (K and V
/// apart), scales of 1.0 are bitwise no scales, other scales change the cache (and still pass
/// the FP8 rule), and a V scale that saturates the values fails it.
#[test]
fn checkpoint_kv_scales_are_read_and_auto_picks_the_fp8_cache() {
    let layers = metrale_config::ModelConfig::from_dir(&fixtures_dir().join("qwen3-tiny"))
        .unwrap()
        .num_hidden_layers;
    let prompts = read_reference(&fixtures_dir().join("qwen3-tiny")).unwrap();
    let scaled = |k: f32, v: f32| {
        let tmp = tempfile::tempdir().unwrap();
        let scales = kv_scale_tensors(layers, (k, v), &[]);
        copy_with_tensors("qwen3-tiny", tmp.path(), &scales, |c| {
            c["quantization_config"] = serde_json::json!({"quant_method": "fp8",
                "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}});
        })
        .unwrap();
        tmp
    };
    let dir = scaled(0.25, 2.0);
    let gpu = || -> std::sync::Arc<dyn metrale_gpu_runtime::GpuBackend> {
        std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default())
    };
    let model = metrale_model_engine::factory::load(dir.path(), gpu()).unwrap();
    for k in 0..layers {
        let s = model.kv_scales(k);
        assert_eq!((s.k, s.v), (0.25, 2.0), "layer {k}");
    }
    let run = |dir: &Path, options: EngineOptions| {
        let engine = Engine::load(dir, options).unwrap();
        (prompts.iter())
            .map(|p| compare_by(&engine, p, Rule::FP8_KV).unwrap())
            .collect::<Vec<_>>()
    };
    let fp8 =
        EngineOptions::default().model(ModelOptions::default().kv_cache_dtype(KvCacheDtype::Fp8));
    let unscaled: Vec<f64> = run(&fixtures_dir().join("qwen3-tiny"), fp8)
        .iter()
        .map(|o| o.worst_rel_l2)
        .collect();
    let ones: Vec<f64> = run(scaled(1.0, 1.0).path(), EngineOptions::default())
        .iter()
        .map(|o| o.worst_rel_l2)
        .collect();
    assert_eq!(ones, unscaled, "scales of 1.0 are no scales");
    let outcomes = run(dir.path(), EngineOptions::default());
    for o in &outcomes {
        assert!(o.failure.is_none(), "{}: {:?}", o.prompt, o.failure);
    }
    let got: Vec<f64> = outcomes.iter().map(|o| o.worst_rel_l2).collect();
    assert_ne!(got, unscaled, "the scales change the cache");
    // Values above 448 * 0.01 saturate: far past the rule.
    let saturated = run(scaled(1.0, 0.01).path(), EngineOptions::default());
    assert!(
        saturated.iter().any(|o| o.failure.is_some()),
        "a saturating V scale is caught"
    );
}

/// The same KV memory holds twice the tokens in FP8, and the engine's metrics say so.
#[test]
fn an_fp8_cache_holds_twice_the_tokens_in_the_same_memory() {
    let dir = fixtures_dir().join("qwen3-tiny");
    let capacity = |d| {
        let model = ModelOptions::default()
            .kv_cache_bytes(1 << 20)
            .kv_cache_dtype(d);
        let engine = Engine::load(&dir, EngineOptions::default().model(model)).unwrap();
        let c = engine.metrics().cache;
        (c.kv_blocks_total, c.kv_tokens_capacity)
    };
    let (bf16, fp8) = (capacity(KvCacheDtype::Bf16), capacity(KvCacheDtype::Fp8));
    // qwen3-tiny: 4 layers of 2 KV heads of 64 dims; a 16-token block is 32 KiB of bf16 over K
    // and V of every layer, so 1 MiB holds 32 blocks (31 past the dummy); FP8 holds 64.
    assert_eq!(bf16, (31, 31 * 16));
    assert_eq!(fp8, (63, 63 * 16));
}

#[test]
fn yarn_fixture_matches_transformers_past_its_original_context() {
    // `qwen3-yarn-tiny`: YaRN with factor 4 over an original context of 32 positions; one
    // prompt runs past it. Both the frequencies and the factor on cos and sin must match.
    let dir = fixtures_dir().join("qwen3-yarn-tiny");
    let config = metrale_config::ModelConfig::from_dir(&dir).unwrap();
    let rope = &config.attention.rope;
    let metrale_config::RopeScaling::Yarn {
        original_max_position_embeddings,
        ..
    } = rope.scaling
    else {
        panic!(
            "{}: not a YaRN checkpoint: {:?}",
            dir.display(),
            rope.scaling
        );
    };
    assert!(rope.attention_scaling() > 1.0);
    let prompts = read_reference(&dir).unwrap();
    assert!(
        prompts
            .iter()
            .any(|p| p.prompt_ids.len() > original_max_position_embeddings)
    );
    assert_fixture_passes(&dir);
}

#[test]
fn a_prompt_prefilled_whole_is_the_prompt_prefilled_in_chunks() {
    for name in ["qwen3-tiny", "qwen3-gqa4-hd128"] {
        check_staged_prefill(&fixtures_dir().join(name), || {
            std::sync::Arc::new(metrale_gpu_runtime::CpuBackend::default())
        });
    }
}

#[test]
fn chunked_prefill_gives_the_same_result() {
    // Prefill chunks of 5 tokens cut every prompt (and every block) in odd places.
    let options = EngineOptions::default().model(ModelOptions::default().max_batch_tokens(5));
    for dir in fixtures_of(&["qwen3"]).iter().take(2) {
        for o in check_fixture(dir, options.clone()) {
            assert!(
                o.failure.is_none(),
                "{}/{}: {:?}",
                dir.display(),
                o.prompt,
                o.failure
            );
        }
    }
}

#[test]
fn an_fp8_pack_matches_transformers_and_quantizing_its_source_at_load_gives_the_pack() {
    // `qwen3-fp8-tiny`: every projection in e4m3 with 128 x 128 block scales (partial blocks;
    // fused q/k/v and gate/up cut across blocks), the reference transformers in float32 on the
    // dequantized weights; `source/` holds the bf16 weights the pack was made from.
    let dir = fixtures_dir().join("qwen3-fp8-tiny");
    let config = metrale_config::ModelConfig::from_dir(&dir).unwrap();
    assert!(matches!(
        config.checkpoint.quantization,
        Some(metrale_config::WeightQuantization::Fp8 { .. })
    ));
    assert_fixture_passes(&dir);
    assert_source_quantized_at_load_is_the_pack(&dir);
}

#[test]
fn fp8_weights_read_with_wrong_scales_are_caught() {
    // Every block scale of the first layer's o projection doubled: the projection's output
    // doubles, as a kernel reading the wrong block's scale or none at all would get it wrong.
    let src = fixtures_dir().join("qwen3-fp8-tiny");
    let tmp = tempfile::tempdir().unwrap();
    let target = "model.layers.0.self_attn.o_proj.weight_scale_inv";
    let mut found = false;
    copy_fixture_with(&src, tmp.path(), |name, mut tensor| {
        if name == target {
            found = true;
            for c in tensor.data.chunks_exact_mut(4) {
                let v = 2.0 * f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        vec![(name.to_string(), tensor)]
    });
    assert!(found);
    let failed = check_fixture(tmp.path(), EngineOptions::default())
        .iter()
        .filter(|o| o.failure.is_some())
        .count();
    assert!(failed > 0, "doubled scales passed the comparison");
}

/// `config.json` of `dir` with its `quantization_config` replaced by `q` (removed for `None`).
fn set_quantization(dir: &Path, q: Option<serde_json::Value>) {
    let path = dir.join("config.json");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    match q {
        Some(q) => c["quantization_config"] = q,
        None => {
            c.as_object_mut().unwrap().remove("quantization_config");
        }
    }
    std::fs::write(path, c.to_string()).unwrap();
}

/// A compressed-tensors quantization config (llm-compressor's layout) with `weights`.
fn compressed_tensors(weights: serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                  "dynamic": true, "symmetric": true}
        }},
        "ignore": ["lm_head"]
    })
}

#[test]
fn a_compressed_tensors_block_pack_is_the_official_pack_bit_for_bit() {
    // The official pack's e4m3 bytes and block scales under llm-compressor's names
    // (`weight_scale` for `weight_scale_inv`) and config.
    let src = fixtures_dir().join("qwen3-fp8-tiny");
    let tmp = tempfile::tempdir().unwrap();
    let mut renamed = 0;
    copy_fixture_with(&src, tmp.path(), |name, tensor| {
        let name = match name.strip_suffix("_inv") {
            Some(stem) => {
                renamed += 1;
                stem.to_string()
            }
            None => name.to_string(),
        };
        vec![(name, tensor)]
    });
    assert!(renamed >= 7 * 2, "{renamed} scales renamed");
    set_quantization(
        tmp.path(),
        Some(compressed_tensors(serde_json::json!({
            "num_bits": 8, "type": "float", "strategy": "block",
            "block_structure": [128, 128], "dynamic": false, "symmetric": true
        }))),
    );
    let prompts = read_reference(&src).unwrap();
    let official = Engine::load(&src, EngineOptions::default()).unwrap();
    let compressed = Engine::load(tmp.path(), EngineOptions::default()).unwrap();
    assert!(greedy_bits(&compressed, &prompts) == greedy_bits(&official, &prompts));
}

#[test]
fn a_compressed_tensors_per_channel_pack_is_the_bf16_model_of_its_dequantized_weights() {
    // The pack's bf16 source quantized per output channel (scale = row amax / 448, elements
    // rounded to nearest even e4m3, `weight_scale` of shape [N, 1]); the same weights
    // dequantized as the engine defines them, bf16(e4m3 · scale'), in a bf16 checkpoint.
    use metrale_gpu_runtime::fp8::{E4M3_MAX, dequant_element, f32_to_e4m3};
    let dir = fixtures_dir().join("qwen3-fp8-tiny");
    let bytes = std::fs::read(dir.join("source/model.safetensors")).unwrap();
    let source = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let per_channel = |name: &str| {
        let view = source.tensor(name).unwrap();
        let (n, k) = (view.shape()[0], view.shape()[1]);
        let w: Vec<f32> = (view.data().chunks_exact(2))
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let scales: Vec<f32> = (w.chunks_exact(k))
            .map(|row| row.iter().fold(0f32, |m, x| m.max(x.abs())) / E4M3_MAX)
            .collect();
        let codes: Vec<u8> = (w.iter().enumerate())
            .map(|(i, x)| f32_to_e4m3(x / scales[i / k]))
            .collect();
        (n, k, codes, scales)
    };
    let (packed, plain) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut quantized = 0;
    for (dst, as_fp8) in [(packed.path(), true), (plain.path(), false)] {
        copy_fixture_with(&dir, dst, |name, tensor| {
            if name.ends_with("weight_scale_inv") {
                return Vec::new();
            }
            if tensor.dtype != safetensors::Dtype::F8_E4M3 {
                return vec![(name.to_string(), tensor)];
            }
            quantized += usize::from(as_fp8);
            let (n, k, codes, scales) = per_channel(name);
            if as_fp8 {
                let scale = TensorData {
                    dtype: safetensors::Dtype::F32,
                    shape: vec![n, 1],
                    data: scales.iter().flat_map(|s| s.to_le_bytes()).collect(),
                };
                let weight = TensorData {
                    dtype: safetensors::Dtype::F8_E4M3,
                    shape: vec![n, k],
                    data: codes,
                };
                vec![(name.to_string(), weight), (format!("{name}_scale"), scale)]
            } else {
                let data = (codes.iter().enumerate())
                    .flat_map(|(i, &c)| dequant_element(c, scales[i / k]).to_le_bytes())
                    .collect();
                let weight = TensorData {
                    dtype: safetensors::Dtype::BF16,
                    shape: vec![n, k],
                    data,
                };
                vec![(name.to_string(), weight)]
            }
        });
    }
    assert!(quantized >= 7 * 2, "{quantized} projections quantized");
    set_quantization(
        packed.path(),
        Some(compressed_tensors(serde_json::json!({
            "num_bits": 8, "type": "float", "strategy": "channel",
            "dynamic": false, "symmetric": true
        }))),
    );
    set_quantization(plain.path(), None);
    let prompts = read_reference(&dir).unwrap();
    let load = |d: &Path| Engine::load(d, EngineOptions::default()).unwrap();
    let channel_bits = greedy_bits(&load(packed.path()), &prompts);
    assert!(channel_bits == greedy_bits(&load(plain.path()), &prompts));
    // Per-channel scales are not the official pack's block scales: the comparison can fail.
    assert!(channel_bits != greedy_bits(&load(&dir), &prompts));
}

#[test]
fn a_sharded_fp8_pack_with_scales_apart_from_their_weights_is_the_whole_pack() {
    // The official pack's tensors over two shards named by an index, every FP8 weight in one
    // file and its scale in the other.
    let src = fixtures_dir().join("qwen3-fp8-tiny");
    let tmp = tempfile::tempdir().unwrap();
    for f in ["config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), tmp.path().join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let files = [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ];
    let (mut shards, mut map) = ([Vec::new(), Vec::new()], serde_json::Map::new());
    for (name, view) in st.tensors() {
        let shard = usize::from(name.ends_with("_scale_inv"));
        map.insert(name.clone(), files[shard].into());
        shards[shard].push((name, view));
    }
    assert!(shards.iter().all(|s| !s.is_empty()));
    for (file, views) in files.iter().zip(shards) {
        safetensors::serialize_to_file(views, None, &tmp.path().join(file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let prompts = read_reference(&src).unwrap();
    let whole = Engine::load(&src, EngineOptions::default()).unwrap();
    let sharded = Engine::load(tmp.path(), EngineOptions::default()).unwrap();
    assert!(greedy_bits(&sharded, &prompts) == greedy_bits(&whole, &prompts));
}
