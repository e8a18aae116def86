//! Host-side sampling of one row of logits, as the scheduler does for every row that samples
//! with a temperature (greedy rows take the device's argmax instead; the host `argmax` is
//! measured for comparison).
//!
//! Sizes: one row of Qwen3's vocabulary, 151,936 logits, shaped like a language model's: most
//! tokens spread over [-4, 4], 64 likely ones at 8 to 12. Settings: greedy; temperature 0.6 over
//! the whole vocabulary; Qwen3's recommended temperature 0.6, top-k 20, top-p 0.95; and
//! temperature 0.6 with top-p 0.95 alone (the nucleus found without a top-k).

use std::hint::black_box;

use std::time::Duration;

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use metrale_model_engine::sampling::{Sampler, SamplingParams};
use metrale_testkit::Rng;

const VOCAB: usize = 151_936;
const LIKELY: usize = 64;

/// Logits of `VOCAB` tokens: uniform noise, and `LIKELY` tokens spread over the vocabulary far
/// above it.
fn logits() -> Vec<f32> {
    let mut rng = Rng::new(42);
    let mut out = rng.f32s(VOCAB, -4.0, 4.0);
    for k in 0..LIKELY {
        let i = rng.below(VOCAB as u32) as usize;
        out[i] = 8.0 + 4.0 * k as f32 / LIKELY as f32;
    }
    out
}

fn sampling(c: &mut Criterion) {
    let logits = logits();
    let mut g = c.benchmark_group("sample_row");
    // A sampled row takes milliseconds: every sample the same number of rows.
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(VOCAB as u64));
    g.bench_function("host_argmax", |b| {
        b.iter(|| metrale_model_engine::sampling::argmax(black_box(&logits)));
    });
    let settings = [
        ("temperature", 0.6, 0, 1.0),
        ("temperature_top_k_top_p", 0.6, 20, 0.95),
        ("temperature_top_p", 0.6, 0, 0.95),
    ];
    for (name, temperature, top_k, top_p) in settings {
        let mut s = Sampler::new(
            SamplingParams::default()
                .temperature(temperature)
                .top_k(top_k)
                .top_p(top_p)
                .seed(1),
        );
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| s.sample(black_box(&logits)));
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = sampling
}
criterion_main!(benches);
