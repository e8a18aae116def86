//! Qwen3 and Llama checkpoints written by transformers reproduce its greedy tokens and float32
//! logits on the CPU backend, and deliberately broken checkpoints (wrong RoPE base, swapped
//! heads, the other norm convention) fail the same comparison.

#![allow(clippy::unwrap_used, clippy::type_complexity)]

mod support;

use metrale::{EngineOptions, ModelOptions};
use support::*;

#[test]
fn dense_fixtures_match_transformers() {
    let worst = check_fixtures(&["qwen3", "llama"], 5, &EngineOptions::default());
    eprintln!("worst logits relative L2 error over all dense fixtures: {worst:.3e}");
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
