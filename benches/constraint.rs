//! Structured output's cost per token on the CPU: the allowed-token bitmask llguidance computes
//! for one step of a JSON-schema answer over the real Qwen3 vocabulary (151,936 ids,
//! `tests/fixtures/qwen3-chat/tokenizer.json.gz`), and the token taken after it, as the
//! scheduler does for a constrained row once its step is launched.
//!
//! The schema has a bounded string, an integer range, an enum and an array of booleans; each
//! step takes the highest allowed token id (so strings grow to their bound and numbers to their
//! range before closing), and a finished answer starts over with a freshly compiled matcher
//! (compilation is outside the timed step; it is timed apart, over a compiler whose token trie
//! is already built, as the engine's is after its first constrained request).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use metrale::Constraint;
use metrale::bench_internals::MaskCompiler;
use metrale_testkit::checkpoint::{IM_END, QWEN3_VOCAB, qwen3_tokenizer_json};

fn schema() -> Constraint {
    Constraint::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "colour": {"enum": ["red", "green", "blue"]},
            "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 6}
        },
        "required": ["name", "age", "colour", "flags"],
        "additionalProperties": false
    }))
}

fn bench(c: &mut Criterion) {
    let json = qwen3_tokenizer_json().expect("the Qwen3 tokenizer fixture reads");
    let constraint = schema();
    // The first compile builds the token trie, which the engine builds once per model; every
    // compile after it costs what a request's does.
    let compiler = MaskCompiler::new(&json).expect("the Qwen3 tokenizer parses");
    let compile = || {
        compiler
            .compile(&constraint, QWEN3_VOCAB, IM_END)
            .expect("the schema compiles")
    };
    let mut m = compile();
    let mut g = c.benchmark_group("constraint");
    g.measurement_time(Duration::from_secs(5));
    g.bench_function("json_schema_mask_per_token", |b| {
        // Only the steps are timed: a finished answer's fresh matcher is compiled outside.
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let start = Instant::now();
                let token = black_box(m.step());
                timed += start.elapsed();
                if token.is_none() {
                    m = compile();
                }
            }
            timed
        })
    });
    g.bench_function("json_schema_compile", |b| b.iter(|| black_box(compile())));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
