//! Logprobs in OpenAI's two shapes, from the engine's `TokenLogprobs` (the log_softmax of the
//! model's raw logits, before penalties, bias and temperature, as vLLM reports by default):
//! - completions (`logprobs: N`): the legacy `{tokens, token_logprobs, top_logprobs,
//!   text_offset}`, `top_logprobs` a map from token text to logprob per token, `text_offset`
//!   each token's character offset in the generated text;
//! - chat (`logprobs: true`, `top_logprobs: N`): `{content: [{token, logprob, bytes,
//!   top_logprobs: [{token, logprob, bytes}]}]}`.
//!
//! A token's text is its id decoded alone with special tokens kept (so a partial UTF-8
//! sequence shows as U+FFFD, as OpenAI's does, and `bytes` are that text's UTF-8 bytes).

use metrale::{Engine, TokenLogprobs};
use serde_json::{Map, Value, json};

/// The text of token `id` alone.
fn token_text(engine: &Engine, id: u32) -> String {
    engine.detokenize(&[id], false).unwrap_or_default()
}

/// A finite logprob as a JSON number (a NaN or infinity, which JSON cannot hold, as the most
/// negative f32, as vLLM sends `-9999.0`-style floors).
fn number(lp: f32) -> Value {
    let lp = if lp.is_finite() { lp } else { f32::MIN };
    json!(lp)
}

/// The completions shape of `entries`, the first at character `offset` of the text.
pub fn completion(engine: &Engine, entries: &[TokenLogprobs], mut offset: usize) -> Value {
    let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for e in entries {
        let text = token_text(engine, e.token);
        offsets.push(offset);
        offset += text.chars().count();
        tokens.push(Value::String(text));
        lps.push(number(e.logprob));
        let mut top = Map::new();
        for &(id, lp) in &e.top {
            top.insert(token_text(engine, id), number(lp));
        }
        tops.push(Value::Object(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}

/// Characters `entries`' tokens take in the completions shape (the next chunk's offset).
pub fn completion_chars(engine: &Engine, entries: &[TokenLogprobs]) -> usize {
    entries
        .iter()
        .map(|e| token_text(engine, e.token).chars().count())
        .sum()
}

/// The chat shape of `entries`.
pub fn chat(engine: &Engine, entries: &[TokenLogprobs]) -> Value {
    let item = |id: u32, lp: f32| {
        let text = token_text(engine, id);
        let bytes: Vec<u8> = text.as_bytes().to_vec();
        (text, bytes, number(lp))
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let (token, bytes, logprob) = item(e.token, e.logprob);
            let top: Vec<Value> = (e.top.iter())
                .map(|&(id, lp)| {
                    let (token, bytes, logprob) = item(id, lp);
                    json!({"token": token, "logprob": logprob, "bytes": bytes})
                })
                .collect();
            json!({"token": token, "logprob": logprob, "bytes": bytes, "top_logprobs": top})
        })
        .collect();
    json!({ "content": content })
}
