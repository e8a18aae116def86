//! A tiny random-weight Qwen3 checkpoint with the real Qwen3 vocabulary (151,936 ids), tokenizer
//! and chat template, for the tests of chat, tool calls and structured output: one layer, a
//! hidden size of 32, so a token costs little on the CPU backend while the vocabulary, the
//! tokenizer and the template are the real ones.
//!
//! The tokenizer is `tests/fixtures/qwen3-chat/tokenizer.json.gz` (gzip: the real
//! `tokenizer.json` is 11 MB), the template that directory's `tokenizer_config.json`; the
//! weights come from [`Rng`](crate::Rng) with a seed, so the same seed writes the same model.

use std::io::Read;
use std::path::{Path, PathBuf};

use half::bf16;

use crate::Rng;

/// The Qwen3 vocabulary size (the embedding's rows; the tokenizer has 151,669 tokens).
pub const QWEN3_VOCAB: usize = 151_936;
/// `<|im_end|>`, the chat models' EOS.
pub const IM_END: u32 = 151_645;

/// The repository's `tests/fixtures/qwen3-chat`: under the working directory when it is the
/// tree's root (the GPU bundle runs its test binaries from there), else under the workspace the
/// crate was built in.
pub fn qwen3_chat_fixture() -> PathBuf {
    let here = PathBuf::from("tests/fixtures/qwen3-chat");
    if here.is_dir() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-chat")
}

/// The real Qwen3 `tokenizer.json`'s text (decompressed from the fixture).
pub fn qwen3_tokenizer_json() -> std::io::Result<String> {
    let gz = std::fs::File::open(qwen3_chat_fixture().join("tokenizer.json.gz"))?;
    let mut text = String::new();
    flate2::read::GzDecoder::new(gz).read_to_string(&mut text)?;
    Ok(text)
}

/// Write the checkpoint into `dir` (which must exist): config.json, model.safetensors (weights
/// from `seed`), tokenizer.json, tokenizer_config.json.
pub fn write_qwen3_chat(dir: &Path, seed: u64) -> std::io::Result<()> {
    let (hidden, head_dim, inter) = (32usize, 32usize, 64usize);
    let config = serde_json::json!({
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "attention_bias": false,
        "eos_token_id": IM_END,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": 4096,
        "num_attention_heads": 1,
        "num_hidden_layers": 1,
        "num_key_value_heads": 1,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": true,
        "torch_dtype": "bfloat16",
        "vocab_size": QWEN3_VOCAB,
    });
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let mut rng = Rng::new(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, shape: Vec<usize>, lo: f32, hi: f32| {
        let n = shape.iter().product();
        let data: Vec<u8> = (rng.bf16s(n, lo, hi).iter())
            .flat_map(|v: &bf16| v.to_le_bytes())
            .collect();
        tensors.push((name.to_string(), shape, data));
    };
    add(
        "model.embed_tokens.weight",
        vec![QWEN3_VOCAB, hidden],
        -1.0,
        1.0,
    );
    add("model.norm.weight", vec![hidden], 0.8, 1.2);
    let l = "model.layers.0";
    add(
        &format!("{l}.input_layernorm.weight"),
        vec![hidden],
        0.8,
        1.2,
    );
    add(
        &format!("{l}.post_attention_layernorm.weight"),
        vec![hidden],
        0.8,
        1.2,
    );
    add(
        &format!("{l}.self_attn.q_norm.weight"),
        vec![head_dim],
        0.8,
        1.2,
    );
    add(
        &format!("{l}.self_attn.k_norm.weight"),
        vec![head_dim],
        0.8,
        1.2,
    );
    for p in ["q_proj", "k_proj", "v_proj"] {
        add(
            &format!("{l}.self_attn.{p}.weight"),
            vec![head_dim, hidden],
            -0.2,
            0.2,
        );
    }
    add(
        &format!("{l}.self_attn.o_proj.weight"),
        vec![hidden, head_dim],
        -0.2,
        0.2,
    );
    add(
        &format!("{l}.mlp.gate_proj.weight"),
        vec![inter, hidden],
        -0.2,
        0.2,
    );
    add(
        &format!("{l}.mlp.up_proj.weight"),
        vec![inter, hidden],
        -0.2,
        0.2,
    );
    add(
        &format!("{l}.mlp.down_proj.weight"),
        vec![hidden, inter],
        -0.2,
        0.2,
    );
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = (tensors.iter())
        .map(|(name, shape, data)| {
            let view =
                safetensors::tensor::TensorView::new(safetensors::Dtype::BF16, shape.clone(), data)
                    .map_err(std::io::Error::other)?;
            Ok((name.clone(), view))
        })
        .collect::<std::io::Result<_>>()?;
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors"))
        .map_err(std::io::Error::other)?;
    std::fs::write(dir.join("tokenizer.json"), qwen3_tokenizer_json()?)?;
    std::fs::copy(
        qwen3_chat_fixture().join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )?;
    Ok(())
}

/// The lowest index of the maximum of `logits` over the tokens `mask` allows (bit `t % 32` of
/// word `t / 32`; every token without a mask): a constrained greedy row's token, as the device
/// sampler must pick it, every disallowed token at `-inf`.
pub fn masked_argmax(logits: &[f32], mask: Option<&[u32]>) -> u32 {
    let allowed = |t: usize| mask.is_none_or(|m| (m[t / 32] >> (t % 32)) & 1 == 1);
    let mut best = (f32::NEG_INFINITY, 0u32);
    for (t, &v) in logits.iter().enumerate() {
        let v = if allowed(t) { v } else { f32::NEG_INFINITY };
        if v > best.0 {
            best = (v, t as u32);
        }
    }
    best.1
}
