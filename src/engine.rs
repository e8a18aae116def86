//! `Engine`: a loaded checkpoint on a backend, with its tokenizer, serving generation requests
//! through continuous batching.
//!
//! `Engine::load` moves the model's scheduler into a thread of its own (see `worker`); `submit`
//! checks a request on the caller's thread (`Frontend::prepare`) and hands it over, returning a
//! `RequestHandle` for its events. `generate` and `generate_stream` are thin wrappers over
//! `submit`.
//!
//! Invariants:
//! - A request is validated completely before it reaches the scheduler; a refused request
//!   leaves the engine exactly as it was, and a request never disturbs the others' output.
//! - `Engine` is `Send + Sync`; any number of threads submit concurrently.

use std::ops::ControlFlow;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use metrale_config::ModelConfig;
use metrale_gpu_runtime::{CpuBackend, GpuBackend};
use metrale_model_engine::options::Speculative;
use metrale_model_engine::runner::{ForwardDisclosure, ModelCircuit};
use metrale_model_engine::sampling::SamplingParams;
use metrale_model_engine::{ModelError, Scheduler, factory};

use crate::chat::{
    AnswerReader, ChatHandle, ChatMessage, ChatOptions, ChatOutput, ChatRequest, ChatTemplate,
    ChatTemplateError, Tool, ToolCallFormat, ToolChoice, tool_call_grammar, tool_format,
};
use crate::constraint::Constraint;
use crate::error::{EngineError, RequestError};
use crate::frontend::{Follow, Frontend, load_tokenizer};
use crate::handle::{EventChannel, RequestHandle, RequestId, Sink};
use crate::metrics::{EngineMetrics, MetricsState};
use crate::options::{Backend, EngineOptions};
use crate::request::{GenerateOutput, GenerateRequest, Prompt};
use crate::worker::{Shared, Submission, Worker};

/// See the module header.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    front: Frontend,
    chat: Option<ChatTemplate>,
    config: ModelConfig,
    max_queued_requests: usize,
    next_request: AtomicU64,
    #[cfg_attr(not(feature = "unstable"), allow(dead_code))]
    forward: ForwardDisclosure,
}

/// The device for `backend`. Development tooling (the raw backend): public only with the
/// `unstable` feature.
pub fn make_backend(backend: Backend) -> Result<Arc<dyn GpuBackend>, EngineError> {
    match backend {
        Backend::Cpu => Ok(Arc::new(CpuBackend::default())),
        #[cfg(feature = "cuda")]
        Backend::Cuda { device } => metrale_gpu_runtime::cuda::CudaBackend::new(device)
            .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
            .map_err(|e| EngineError::BackendUnavailable {
                backend: "cuda",
                why: e.to_string(),
            }),
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda { .. } => Err(EngineError::BackendUnavailable {
            backend: "cuda",
            why: "this build of metrale was not built with CUDA (rebuild with `--features cuda`)"
                .into(),
        }),
    }
}

/// The backends of a tensor-parallel group of `size` ranks on `backend` (one backend when
/// `size` is 1): on the CPU, backends sharing one communicator (ranks as threads); on CUDA, rank
/// `r` on GPU `device + r`, the ranks sharing NCCL communicators. Development tooling (the raw
/// backends): public only with the `unstable` feature.
pub fn make_backends(
    backend: Backend,
    size: usize,
) -> Result<Vec<Arc<dyn GpuBackend>>, EngineError> {
    factory::RankShard::check_size(size)?;
    if size == 1 {
        return Ok(vec![make_backend(backend)?]);
    }
    match backend {
        Backend::Cpu => Ok(CpuBackend::tensor_parallel_group(size, Default::default())
            .into_iter()
            .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
            .collect()),
        #[cfg(feature = "cuda")]
        Backend::Cuda { device } => {
            use metrale_gpu_runtime::cuda::CudaBackend;
            let devices: Vec<usize> = (device..device + size).collect();
            CudaBackend::tensor_parallel_group(&devices, Default::default())
                .map(|group| {
                    (group.into_iter())
                        .map(|b| Arc::new(b) as Arc<dyn GpuBackend>)
                        .collect()
                })
                .map_err(|e| EngineError::BackendUnavailable {
                    backend: "cuda",
                    why: format!("tensor_parallel_size {size} on GPUs {devices:?}: {e}"),
                })
        }
        #[cfg(not(feature = "cuda"))]
        Backend::Cuda { .. } => make_backend(backend).map(|b| vec![b]),
    }
}

/// The scheduler of the checkpoint in `dir` loaded with `options` (its forward and gate set),
/// and its tokenizer: what both the engine's thread and `generate_direct` drive.
pub(crate) fn load_scheduler(
    dir: &Path,
    options: &EngineOptions,
) -> Result<(Scheduler, Option<Arc<tokenizers::Tokenizer>>), EngineError> {
    if options.model.speculative == Speculative::External {
        return Err(EngineError::Model(ModelError::Options {
            option: "speculative",
            problem: "the engine drafts with the MTP head (`Mtp`); `External` drafts come from \
                      a caller's drafter through `generate_speculative`"
                .into(),
        }));
    }
    let gpus = make_backends(options.backend, options.model.tensor_parallel_size)?;
    let models = factory::load_ranks(dir, &gpus, options.model.quantization)?;
    let mut scheduler = Scheduler::new_ranks(models, options.model.clone())?;
    scheduler.runner_mut().set_forward(options.forward)?;
    if let Some(spec) = scheduler.speculation() {
        spec.set_gate(options.speculation_gate);
    }
    Ok((scheduler, load_tokenizer(dir)?))
}

impl Engine {
    /// Load the checkpoint in `dir` (its chat template too, when it has one: one that does not
    /// compile fails the load) and start the engine's scheduler thread. With
    /// `options.model.speculative = Mtp` the checkpoint's MTP head drafts and decode steps
    /// verify, behind `options.speculation_gate`; `External` (a drafter the caller supplies)
    /// is for `generate_speculative` only, and the engine refuses it.
    pub fn load(dir: impl AsRef<Path>, options: EngineOptions) -> Result<Engine, EngineError> {
        let chat = ChatTemplate::load(dir.as_ref())?;
        let (scheduler, tokenizer) = load_scheduler(dir.as_ref(), &options)?;
        let mut engine = Engine::start(scheduler, tokenizer, &options)?;
        engine.chat = chat;
        Ok(engine)
    }

    /// Start the scheduler thread over a loaded scheduler.
    pub(crate) fn start(
        scheduler: Scheduler,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: &EngineOptions,
    ) -> Result<Engine, EngineError> {
        let forward = scheduler.runner().forward_disclosure()?;
        let config = scheduler.runner().model().config().clone();
        let front = Frontend::new(tokenizer.clone(), &scheduler);
        let shared = Arc::new(Shared::new(MetricsState::new(
            options.metrics_window,
            scheduler.stats(),
        )));
        let worker = Worker::new(shared.clone(), scheduler, tokenizer);
        let handle = std::thread::Builder::new()
            .name("metrale-scheduler".into())
            .spawn(move || worker.run())
            .map_err(EngineError::Thread)?;
        Ok(Engine {
            shared,
            worker: Some(handle),
            front,
            chat: None,
            config,
            max_queued_requests: options.max_queued_requests,
            next_request: AtomicU64::new(0),
            forward,
        })
    }

    /// The model's config.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Which forward runs decode steps, its plan digest and launches per step. Development
    /// tooling: only with the `unstable` feature.
    #[cfg(feature = "unstable")]
    pub fn forward_disclosure(&self) -> &ForwardDisclosure {
        &self.forward
    }

    /// Sampling as the checkpoint's `generation_config.json` recommends it (temperature, top-p,
    /// top-k, min-p and repetition penalty where the file sets them; otherwise
    /// `SamplingParams::default()`, greedy), with a fresh seed per request. A request that should follow the model card starts from it.
    pub fn sampling_defaults(&self) -> SamplingParams {
        SamplingParams::default().with_checkpoint_defaults(&self.config.checkpoint.generation)
    }

    /// The longest context a request may have (prompt plus output): the smaller of
    /// `max_seq_len` and the tokens the KV cache holds.
    pub fn max_context(&self) -> usize {
        self.front.limits.max_context
    }

    /// Whether text prompts and outputs work.
    pub fn has_tokenizer(&self) -> bool {
        self.front.tokenizer.is_some()
    }

    /// The checkpoint's chat template (`tokenizer_config.json` or `chat_template.jinja`), when
    /// it has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat.as_ref()
    }

    /// The prompt the checkpoint's chat template makes of `messages` (text, special tokens
    /// included: `Prompt::Text` of it encodes them as the model's). See [`crate::chat`].
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        options: &ChatOptions,
    ) -> Result<String, ChatTemplateError> {
        self.chat
            .as_ref()
            .ok_or(ChatTemplateError::NoTemplate)?
            .render(messages, options)
    }

    /// Submit a chat request: its messages and tools rendered by the checkpoint's chat template,
    /// its answer read apart into reasoning, content and tool calls as it streams (see
    /// [`crate::chat::ChatRequest`]). A required or named tool choice constrains the answer to
    /// calls of the declared functions, in the template's tool-call format.
    pub fn submit_chat(&self, req: ChatRequest) -> Result<ChatHandle, EngineError> {
        let template = self.chat.as_ref().ok_or(ChatTemplateError::NoTemplate)?;
        let forced: Vec<&Tool> = match &req.tool_choice {
            ToolChoice::Required if req.tools.is_empty() => {
                return Err(tool_choice("`required` needs `tools`"));
            }
            ToolChoice::Required => req.tools.iter().collect(),
            ToolChoice::Function(name) => {
                let tool = req.tools.iter().find(|t| &t.name == name);
                vec![tool.ok_or_else(|| {
                    tool_choice(&format!("the function `{name}` is not among `tools`"))
                })?]
            }
            _ => Vec::new(),
        };
        if !forced.is_empty() && req.generation.constraint.is_some() {
            return Err(tool_choice(
                "a required or named call cannot be combined with a response format",
            ));
        }
        let mut options = req.options.clone();
        if !req.tools.is_empty() && req.tool_choice != ToolChoice::None {
            let tools = req.tools.iter().map(Tool::to_template_value).collect();
            options = options.kwarg("tools", serde_json::Value::Array(tools));
        }
        let prompt = template.render(&req.messages, &options)?;
        let reader = AnswerReader::new(&req, template.source(), &prompt);
        let mut generation = req.generation.clone();
        if !forced.is_empty() {
            let format = tool_format(&req, template.source()).unwrap_or(ToolCallFormat::Json);
            let several = req.parallel_tool_calls && req.tool_choice == ToolChoice::Required;
            let grammar = tool_call_grammar(&forced, format, several, reader.in_reasoning());
            generation.constraint = Some(Constraint::Lark(grammar));
        }
        generation.prompt = Prompt::Text(prompt);
        let handle = self.submit(generation)?;
        Ok(ChatHandle::new(handle, reader))
    }

    /// Run a chat request to its end; see [`Engine::submit_chat`].
    pub fn chat(&self, req: &ChatRequest) -> Result<ChatOutput, EngineError> {
        self.submit_chat(req.clone())?.wait()
    }

    /// Encode text with the checkpoint's tokenizer.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        self.front.encode(text)
    }

    /// Encode text with the checkpoint's tokenizer, adding its special tokens or not
    /// (`encode` and text prompts add none).
    pub fn tokenize(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, RequestError> {
        self.front.tokenize(text, add_special_tokens)
    }

    /// Each id's token as the tokenizer's vocabulary spells it (byte-level pieces as stored,
    /// an empty string for an id it lacks); `None` without a tokenizer.
    pub fn token_strs(&self, ids: &[u32]) -> Option<Vec<String>> {
        self.front.token_strs(ids)
    }

    /// Decode token ids to text with the checkpoint's tokenizer, keeping special tokens (the
    /// chat template's markers) or skipping them. An id outside the tokenizer's vocabulary is a
    /// `TokenOutOfVocab` naming its index.
    pub fn detokenize(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, RequestError> {
        self.front.detokenize(ids, skip_special_tokens)
    }

    /// Decode token ids to text; `None` without a tokenizer.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        self.front.decode(ids)
    }

    /// Submit a request. It is checked first (a bad one gets its `RequestError` and changes
    /// nothing), then joins the running batch at a step boundary. The handle yields its tokens
    /// as they come and then its output; dropping the handle cancels the request.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle, EngineError> {
        let prepared = self.front.prepare(req)?;
        let id = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let channel = Arc::new(EventChannel::default());
        let sub = Submission {
            id,
            req: prepared.seq,
            stop_strings: prepared.stop_strings,
            constraints: prepared.constraints,
            sink: Sink::new(channel.clone()),
        };
        self.shared.submit(sub, self.max_queued_requests)?;
        Ok(RequestHandle::new(id, channel, self.shared.clone()))
    }

    /// Counters and resource use now.
    pub fn metrics(&self) -> EngineMetrics {
        self.shared.metrics()
    }

    /// Generate for one request (`submit`, then wait for the output).
    pub fn generate(&self, req: &GenerateRequest) -> Result<GenerateOutput, EngineError> {
        self.submit(req.clone())?.wait()
    }

    /// Generate for one request, calling `on_token(token_id, text_so_far)` as each token is
    /// chosen; returning `ControlFlow::Break` stops generation after that token (finish reason
    /// `cancelled`). With several choices the callback sees choice 0's tokens, and breaking
    /// stops every choice.
    pub fn generate_stream(
        &self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(u32, Option<&str>) -> ControlFlow<()>,
    ) -> Result<GenerateOutput, EngineError> {
        let mut handle = self.submit(req.clone())?;
        let mut follow = Follow::new(self.has_tokenizer());
        let canceller = handle.canceller();
        for ev in &mut handle {
            if let Some(out) = follow.event(ev?, &self.front, &mut on_token, &|| canceller.cancel())
            {
                return Ok(out);
            }
        }
        Err(EngineError::ShutDown)
    }
}

impl Drop for Engine {
    /// Stop the scheduler thread; requests still running end with `EngineError::ShutDown`.
    fn drop(&mut self) {
        self.shared.shutdown();
        if let Some(h) = self.worker.take()
            && h.join().is_err()
        {
            tracing::error!("the engine's scheduler thread panicked");
        }
    }
}

/// A request's tool choice refused, as the engine's error.
fn tool_choice(reason: &str) -> EngineError {
    EngineError::from(RequestError::ToolChoice {
        reason: reason.to_string(),
    })
}
