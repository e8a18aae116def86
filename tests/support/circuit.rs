//! Shared by the circuit executor's tests on the CPU (`tests/circuit.rs`) and on CUDA
//! (`tests/gpu_circuit.rs`): one workload of single and batched decode, run under two forwards
//! of the same checkpoint and compared bit for bit.

#![allow(dead_code)]

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, ensure};
use metrale_gpu_runtime::GpuBackend;
use metrale_model_engine::generate::{GenerateParams, Generation, SeqRequest, generate};
use metrale_model_engine::runner::{ForwardSelect, Fusions, ModelCircuit};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::{ModelOptions, Scheduler, factory};

/// Every family's fixtures (`reference.json` `model_type`s).
pub const FAMILIES: &[&str] = &[
    "qwen3",
    "llama",
    "qwen3_5_text",
    "qwen3_next",
    "qwen3_5_moe_text",
    "qwen3_5",
    "qwen3_5_moe",
];

/// Every fixture the circuit runs: those of [`FAMILIES`], bf16 and block-FP8 packs alike.
pub fn circuit_fixtures() -> Vec<std::path::PathBuf> {
    super::fixtures_of(FAMILIES)
}

/// `circuit-reference`.
pub const REFERENCE: ForwardSelect = ForwardSelect::Circuit {
    fusions: Fusions::ReferenceOnly,
};

/// `circuit`.
pub const ALL: ForwardSelect = ForwardSelect::Circuit {
    fusions: Fusions::All,
};

pub fn params(n: usize, temperature: f32, seed: u64) -> GenerateParams {
    GenerateParams {
        max_new_tokens: n,
        sampling: SamplingParams::default()
            .temperature(temperature)
            .seed(seed),
        stop_token_ids: Vec::new(),
        return_logits: true,
    }
}

/// Tokens and the bits of every logit.
pub fn bits(g: &Generation) -> (Vec<u32>, Vec<Vec<u32>>) {
    let logits = g.logits.as_deref().unwrap_or_default();
    (
        g.token_ids.clone(),
        logits
            .iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect(),
    )
}

/// Load `dir` on `gpu` and select `forward`.
pub fn load(
    dir: &Path,
    options: ModelOptions,
    gpu: Arc<dyn GpuBackend>,
    forward: ForwardSelect,
) -> Result<Scheduler> {
    let model = factory::load_quantized(dir, gpu, options.quantization)
        .with_context(|| format!("loading {}", dir.display()))?;
    let mut model = Scheduler::new(model, options)?;
    model
        .runner_mut()
        .set_forward(forward)
        .with_context(|| format!("{}: selecting {}", dir.display(), forward.name()))?;
    Ok(model)
}

/// One sequence alone (width 1), then three together (widths 4, then 2 and 1 as they
/// finish), greedy and sampled, every logit kept.
pub fn workload(model: &mut Scheduler) -> Result<Vec<Generation>> {
    let vocab = model.runner().model().config().tokens.vocab_size as u32;
    let prompt = |len: u32, salt: u32| -> Vec<u32> {
        (0..len)
            .map(|t| (t * 37 + salt * 11) % (vocab - 1) + 1)
            .collect()
    };
    let request = |prompt: Vec<u32>, params: GenerateParams| SeqRequest {
        prompt,
        params,
        ignore_eos: true,
    };
    let mut out = vec![generate(
        model,
        request(prompt(9, 1), params(6, 0.0, 0)),
        &mut |_| ControlFlow::Continue(()),
    )?];
    let requests = vec![
        request(prompt(5, 2), params(6, 0.0, 0)),
        request(prompt(11, 3), params(3, 0.8, 7)),
        request(prompt(17, 4), params(8, 0.0, 0)),
    ];
    out.extend(model.run(requests, &mut |_, _| ControlFlow::Continue(()))?);
    Ok(out)
}

/// The workload under `legacy` and under `circuit` (two models of `dir`) is bitwise the same;
/// with graphs on, both captured the same widths. Returns the circuit model.
pub fn bitwise_same(
    dir: &Path,
    options: &ModelOptions,
    gpu: &dyn Fn() -> Arc<dyn GpuBackend>,
    circuit: ForwardSelect,
) -> Result<Scheduler> {
    let mut legacy = load(dir, options.clone(), gpu(), ForwardSelect::Legacy)?;
    let mut compiled = load(dir, options.clone(), gpu(), circuit)?;
    let want = workload(&mut legacy)?;
    let got = workload(&mut compiled)?;
    ensure!(want.len() == got.len());
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        ensure!(
            bits(w) == bits(g),
            "{} sequence {i}: {} differs from legacy (tokens {:?} vs {:?})",
            dir.display(),
            circuit.name(),
            g.token_ids,
            w.token_ids
        );
        ensure!(!g.token_ids.is_empty(), "sequence {i} generated nothing");
    }
    ensure!(
        legacy.runner().graphs().decode_widths() == compiled.runner().graphs().decode_widths(),
        "{}: graphs of widths {:?} (legacy {:?})",
        dir.display(),
        compiled.runner().graphs().decode_widths(),
        legacy.runner().graphs().decode_widths()
    );
    if options.decode_graphs {
        ensure!(
            compiled.runner().graphs().decode_widths() == [1, 2, 4],
            "{}: decode ran from graphs of widths {:?}",
            dir.display(),
            compiled.runner().graphs().decode_widths()
        );
    }
    Ok(compiled)
}
