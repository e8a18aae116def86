//! Detokenization and stop-string matching of a request's output, on the CPU: the
//! `TextStream` the engine's scheduler thread feeds each generated token through, decoding with
//! the checkpoint's tokenizer as the engine does, and for comparison the one decode of all the
//! tokens that gives a finished request its text.
//!
//! Sizes: 512 generated tokens, the encoding of English prose with a few accented letters and
//! dashes (each two or three bytes, so some tokens end inside a character and their text is
//! held back); the bundled tokenizer `tests/fixtures/qwen3-tiny/tokenizer.json`, a byte-level
//! BPE of 512 tokens with Qwen3's pre-tokenizer and decoder (a real Qwen3 tokenizer has
//! 151,643 tokens, so its tokens are longer, but decodes through the same pipeline); no stop
//! string, one, or four (the most OpenAI's API takes), none of which occurs, so every token is
//! pushed and every push searches.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use metrale::bench_internals::TextStream;
use tokenizers::Tokenizer;

const TOKENS: usize = 512;

const PROSE: &str = "The river holds its shape through the night, and the small model reads \
    again about the same block of tokens — sixteen at a time, in order. A woodchuck would chuck \
    wood if it could; the capital of France is Paris, where the café on the corner sells \
    shells by the sea shore. Testing, testing: does the weight of a token change its position? \
    No — only its neighbours do.\n\nGood night, and hello again over there.\n";

/// The first `TOKENS` ids of the prose, repeated as often as needed.
fn generated(tok: &Tokenizer) -> Vec<u32> {
    let text = PROSE.repeat(8);
    let ids = tok
        .encode(text.as_str(), false)
        .expect("the tokenizer encodes")
        .get_ids()
        .to_vec();
    assert!(ids.len() >= TOKENS, "{} tokens of prose", ids.len());
    ids[..TOKENS].to_vec()
}

fn text_stream(c: &mut Criterion) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/qwen3-tiny/tokenizer.json");
    let tok = Tokenizer::from_file(&path).expect("the bundled tokenizer loads");
    let ids = generated(&tok);
    let decode = |ids: &[u32]| tok.decode(ids, true).unwrap_or_default();
    let stop_sets: [(&str, &[&str]); 3] = [
        ("none", &[]),
        ("one", &["</answer>"]),
        ("four", &["</answer>", "\n\nUser:", "<|im_end|>", "###"]),
    ];
    let mut g = c.benchmark_group("text_stream");
    g.sample_size(50);
    g.throughput(Throughput::Elements(TOKENS as u64));
    for (name, stops) in stop_sets {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        g.bench_function(BenchmarkId::new("push", name), |b| {
            b.iter(|| {
                let mut s = TextStream::new(stops.clone());
                let mut bytes = 0;
                for (i, &t) in black_box(&ids).iter().enumerate() {
                    bytes += s.push(t, i + 1 == TOKENS, decode).len();
                }
                assert!(!s.stopped());
                bytes
            });
        });
    }
    g.bench_function(BenchmarkId::new("decode_all", TOKENS), |b| {
        b.iter(|| decode(black_box(&ids)));
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = text_stream
}
criterion_main!(benches);
