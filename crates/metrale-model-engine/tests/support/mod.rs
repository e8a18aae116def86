//! Shared by the speculative-decoding tests: the hybrid fixtures with a synthetic MTP head
//! (transformers does not save `mtp.*`), loading, and plain greedy references.

#![allow(dead_code, clippy::unwrap_used)]

pub mod cache;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use metrale_gpu_runtime::CpuBackend;
use metrale_model_engine::generate::{GenerateParams, Generation, SeqRequest, generate};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::speculative::Clock;
use metrale_model_engine::{CacheManager, ModelOptions, Scheduler, StepRunner, factory};
use metrale_testkit::Rng;

/// A clock a test moves, for the scheduler's timed decisions (the speculation gate, paced
/// mixed steps): every reading advances it by half the cost of the steps to come, so a step
/// (timed by two readings) lasts that cost.
#[derive(Debug, Clone, Default)]
pub struct StepClock(Arc<Mutex<(Duration, Duration)>>);

impl StepClock {
    /// Steps from now on last `cost`.
    pub fn set_step_cost(&self, cost: Duration) {
        self.0.lock().unwrap().1 = cost / 2;
    }
}

impl Clock for StepClock {
    fn now(&self) -> Duration {
        let mut g = self.0.lock().unwrap();
        let tick = g.1;
        g.0 += tick;
        g.0
    }
}

/// A step runner and its cache, driven by hand (no scheduler).
pub struct Rig {
    pub runner: StepRunner,
    pub cache: CacheManager,
}

impl Rig {
    /// The checkpoint in `dir` on the CPU backend, sized by `options`.
    pub fn load(dir: &Path, options: ModelOptions) -> Rig {
        Rig::load_on(dir, options, Arc::new(CpuBackend::default()))
    }

    /// The checkpoint in `dir` on `gpu`, sized by `options`.
    pub fn load_on(
        dir: &Path,
        options: ModelOptions,
        gpu: Arc<dyn metrale_gpu_runtime::GpuBackend>,
    ) -> Rig {
        let model = factory::load(dir, gpu).unwrap();
        let (runner, cache) = StepRunner::new(model, options).unwrap();
        Rig { runner, cache }
    }
}

/// The hybrid fixtures: Qwen3.5 (dense FFN), Qwen3-Next and Qwen3.5-MoE (MoE FFNs, so the head's
/// layer is MoE too).
pub const HYBRID: &[&str] = &["qwen3_5-tiny", "qwen3_next-tiny", "qwen3_5_moe-tiny"];

/// A fixture of the workspace's `tests/fixtures`: under the working directory when there is one
/// (the GPU bundle runs its tests from the tree's root), else found up from the manifest
/// directory of whichever package includes this module.
pub fn fixture(name: &str) -> PathBuf {
    let here = PathBuf::from("tests/fixtures");
    if here.is_dir() {
        return here.join(name);
    }
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .map(|d| d.join("tests/fixtures"))
        .find(|d| d.is_dir())
        .unwrap_or_else(|| manifest.join("../../tests/fixtures"))
        .join(name)
}

/// A fixture copied into a temporary directory with a deterministic synthetic MTP head.
pub struct MtpFixture {
    dir: tempfile::TempDir,
}

impl MtpFixture {
    /// `name` (a hybrid fixture) with `mtp.*` added.
    pub fn new(name: &str) -> MtpFixture {
        let dir = tempfile::tempdir().unwrap();
        write_with_mtp(&fixture(name), dir.path());
        MtpFixture { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The fixture's prompts (`reference.json`).
    pub fn prompts(&self) -> Vec<Vec<u32>> {
        let text = std::fs::read_to_string(self.path().join("reference.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                p["prompt_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect()
            })
            .collect()
    }

    pub fn load(&self, options: ModelOptions) -> Scheduler {
        let model = factory::load(self.path(), Arc::new(CpuBackend::default())).unwrap();
        Scheduler::new(model, options).unwrap()
    }
}

/// Copy `src` into `dst`, adding the MTP head's tensors: `fc` `[H, 2H]` with uniform values of
/// scale `1/sqrt(2H)`, the three norms near zero (weights near one in the zero-centred
/// convention), and one decoder layer copied from the model's first full-attention layer (MoE
/// in the MoE families).
pub fn write_with_mtp(src: &Path, dst: &Path) {
    write_with_mtp_fc(src, dst, None);
}

/// `write_with_mtp` with `fc` of shape `fc_shape` (`None`: the right `[H, 2H]`), to write a
/// misshapen head.
pub fn write_with_mtp_fc(src: &Path, dst: &Path, fc_shape: Option<[usize; 2]>) {
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    let full = cfg["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .position(|t| t == "full_attention")
        .unwrap();
    let h = cfg["hidden_size"].as_u64().unwrap() as usize;
    let path = dst.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    let prefix = format!("model.layers.{full}.");
    for (name, view) in st.tensors() {
        let (dtype, shape, data) = (view.dtype(), view.shape().to_vec(), view.data().to_vec());
        if let Some(rest) = name.strip_prefix(&prefix) {
            out.push((
                format!("mtp.layers.0.{rest}"),
                dtype,
                shape.clone(),
                data.clone(),
            ));
        }
        out.push((name, dtype, shape, data));
    }
    let mut rng = Rng::new(0x5eed);
    let mut bf16 = |n: usize, scale: f32| -> Vec<u8> {
        rng.bf16s(n, -scale, scale)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect()
    };
    let [rows, cols] = fc_shape.unwrap_or([h, 2 * h]);
    let fc = bf16(rows * cols, 1.0 / ((2 * h) as f32).sqrt());
    out.push((
        "mtp.fc.weight".into(),
        safetensors::Dtype::BF16,
        vec![rows, cols],
        fc,
    ));
    for n in [
        "mtp.pre_fc_norm_embedding.weight",
        "mtp.pre_fc_norm_hidden.weight",
        "mtp.norm.weight",
    ] {
        out.push((n.into(), safetensors::Dtype::BF16, vec![h], bf16(h, 0.1)));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = out
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

/// A fixture as it is (no MTP head) on the CPU backend.
pub fn load_plain(name: &str, options: ModelOptions) -> Scheduler {
    let model = factory::load(&fixture(name), Arc::new(CpuBackend::default())).unwrap();
    Scheduler::new(model, options).unwrap()
}

/// A request for `prompt` with `p`, stopping only at `p`'s stop tokens (not the model's EOS).
pub fn request(prompt: &[u32], p: &GenerateParams) -> SeqRequest {
    SeqRequest {
        prompt: prompt.to_vec(),
        params: p.clone(),
        ignore_eos: true,
    }
}

/// Generation parameters: `n` tokens, no stop tokens, logits kept.
pub fn params(n: usize, sampling: SamplingParams) -> GenerateParams {
    GenerateParams {
        max_new_tokens: n,
        sampling,
        stop_token_ids: Vec::new(),
        return_logits: true,
    }
}

pub fn greedy(n: usize) -> GenerateParams {
    params(n, SamplingParams::default())
}

pub fn run(sched: &mut Scheduler, prompt: &[u32], p: &GenerateParams) -> Generation {
    generate(sched, request(prompt, p), &mut |_| {
        std::ops::ControlFlow::Continue(())
    })
    .unwrap()
}

/// Bits of every logit of a generation (for bitwise comparisons).
pub fn logit_bits(g: &Generation) -> Vec<Vec<u32>> {
    g.logits
        .as_ref()
        .unwrap()
        .iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}
