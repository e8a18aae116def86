//! `Engine`: a loaded checkpoint on a backend, with its tokenizer, serving generation requests
//! through continuous batching.
//!
//! `Engine::load` moves the model into a scheduler thread (see `worker`); `submit` checks a
//! request on the caller's thread and hands it over, returning a `RequestHandle` for its events.
//! `generate` and `generate_stream` are thin wrappers over `submit`.
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
use metrale_model_engine::ModelError;
use metrale_model_engine::factory;
use metrale_model_engine::generate::{FinishReason, GenerateParams};
use metrale_model_engine::model::TransformerModel;
use metrale_model_engine::model_circuit::{ForwardDisclosure, ModelCircuit};
use metrale_model_engine::options::Speculative;
use metrale_model_engine::scheduler::{RequestLimits, Scheduler, SeqRequest};

use crate::chat::{ChatMessage, ChatOptions, ChatTemplate, ChatTemplateError};
use crate::error::{EngineError, RequestError};
use crate::handle::{EventChannel, RequestHandle, RequestId, Sink};
use crate::metrics::{EngineMetrics, MetricsState};
use crate::options::{Backend, EngineOptions};
use crate::request::{GenerateEvent, GenerateOutput, GenerateRequest, Prompt};
use crate::worker::{Shared, Submission, Worker};

/// See the module header.
#[derive(Debug)]
pub struct Engine {
    shared: Arc<Shared>,
    worker: Option<JoinHandle<()>>,
    tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    chat: Option<ChatTemplate>,
    config: ModelConfig,
    limits: RequestLimits,
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

/// The checkpoint's `tokenizer.json`, when it has one.
pub(crate) fn load_tokenizer(
    dir: &Path,
) -> Result<Option<Arc<tokenizers::Tokenizer>>, EngineError> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Ok(None);
    }
    let t = tokenizers::Tokenizer::from_file(&path).map_err(|e| EngineError::Tokenizer {
        path: path.clone(),
        message: e.to_string(),
    })?;
    Ok(Some(Arc::new(t)))
}

impl Engine {
    /// Load the checkpoint in `dir` (its chat template too, when it has one: one that does not
    /// compile fails the load) and start the engine's scheduler thread. With
    /// `options.model.speculative = Mtp` the checkpoint's MTP head drafts and decode steps
    /// verify, behind `options.speculation_gate`; `External` (a drafter the caller supplies)
    /// is for `generate_speculative` only, and the engine refuses it.
    pub fn load(dir: impl AsRef<Path>, options: EngineOptions) -> Result<Engine, EngineError> {
        let dir = dir.as_ref();
        if options.model.speculative == Speculative::External {
            return Err(EngineError::Model(ModelError::Options {
                option: "speculative",
                problem: "the engine drafts with the MTP head (`Mtp`); `External` drafts come \
                          from a caller's drafter through `generate_speculative`"
                    .into(),
            }));
        }
        let chat = ChatTemplate::load(dir)?;
        let gpu = make_backend(options.backend)?;
        let mut model = factory::load(dir, options.model.clone(), gpu)?;
        model.set_forward(options.forward)?;
        let tokenizer = load_tokenizer(dir)?;
        let mut scheduler = Scheduler::new(&mut model);
        scheduler.set_speculation_gate(options.speculation_gate);
        let mut engine = Engine::start(model, scheduler, tokenizer, &options)?;
        engine.chat = chat;
        Ok(engine)
    }

    /// Start the scheduler thread over a loaded model and its scheduler.
    pub(crate) fn start(
        mut model: TransformerModel,
        scheduler: Scheduler,
        tokenizer: Option<Arc<tokenizers::Tokenizer>>,
        options: &EngineOptions,
    ) -> Result<Engine, EngineError> {
        let forward = model.forward_disclosure()?;
        let config = model.config().clone();
        let limits = scheduler.limits();
        let shared = Arc::new(Shared::new(MetricsState::new(
            options.metrics_window,
            scheduler.stats(&mut model),
        )));
        let worker = Worker::new(shared.clone(), model, scheduler, tokenizer.clone());
        let handle = std::thread::Builder::new()
            .name("metrale-scheduler".into())
            .spawn(move || worker.run())
            .map_err(EngineError::Thread)?;
        Ok(Engine {
            shared,
            worker: Some(handle),
            tokenizer,
            chat: None,
            config,
            limits,
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

    /// The longest context a request may have (prompt plus output): the smaller of
    /// `max_seq_len` and the tokens the KV cache holds.
    pub fn max_context(&self) -> usize {
        self.limits.max_context
    }

    /// Whether text prompts and outputs work.
    pub fn has_tokenizer(&self) -> bool {
        self.tokenizer.is_some()
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

    /// Encode text with the checkpoint's tokenizer.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, RequestError> {
        let tok = self.tokenizer.as_ref().ok_or(RequestError::NoTokenizer)?;
        let enc = tok
            .encode(text, false)
            .map_err(|e| RequestError::Tokenize(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode token ids to text; `None` without a tokenizer.
    pub fn decode(&self, ids: &[u32]) -> Option<String> {
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(ids, true).ok())
    }

    /// Check a request completely and turn it into the scheduler's form.
    fn prepare(&self, req: GenerateRequest) -> Result<(SeqRequest, Vec<String>), RequestError> {
        let ids = match req.prompt {
            Prompt::Text(t) => self.encode(&t)?,
            Prompt::TokenIds(ids) => ids,
        };
        if !req.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(RequestError::NoTokenizer);
        }
        if let Some(index) = req.stop_strings.iter().position(String::is_empty) {
            return Err(RequestError::EmptyStopString { index });
        }
        let seq = SeqRequest {
            prompt: ids,
            params: GenerateParams {
                max_new_tokens: req.max_new_tokens,
                sampling: req.sampling,
                stop_token_ids: req.stop_token_ids,
                return_logits: req.return_logits,
            },
            ignore_eos: req.ignore_eos,
        };
        self.limits.check(&seq)?;
        Ok((seq, req.stop_strings))
    }

    /// Submit a request. It is checked first (a bad one gets its `RequestError` and changes
    /// nothing), then joins the running batch at a step boundary. The handle yields its tokens
    /// as they come and then its output; dropping the handle cancels the request.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle, EngineError> {
        let (seq, stop_strings) = self.prepare(req)?;
        let id = RequestId(self.next_request.fetch_add(1, Ordering::Relaxed));
        let channel = Arc::new(EventChannel::default());
        let sub = Submission {
            id,
            req: seq,
            stop_strings,
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
    /// `cancelled`).
    pub fn generate_stream(
        &self,
        req: &GenerateRequest,
        mut on_token: impl FnMut(u32, Option<&str>) -> ControlFlow<()>,
    ) -> Result<GenerateOutput, EngineError> {
        let mut handle = self.submit(req.clone())?;
        let mut text = self.tokenizer.as_ref().map(|_| String::new());
        let (mut seen, mut broke_at) = (0usize, None);
        while let Some(ev) = handle.next() {
            match ev? {
                GenerateEvent::Token(t) => {
                    if broke_at.is_some() {
                        continue;
                    }
                    seen += 1;
                    if let (Some(text), Some(delta)) = (text.as_mut(), t.text_delta.as_deref()) {
                        text.push_str(delta);
                    }
                    if on_token(t.token_id, text.as_deref()).is_break() {
                        broke_at = Some(seen);
                        handle.cancel();
                    }
                }
                GenerateEvent::Finished { mut output } => {
                    // The cancellation lands at the next step boundary; the caller asked to stop
                    // right after the token it broke on.
                    if let Some(n) = broke_at {
                        output.token_ids.truncate(n);
                        if let Some(l) = output.logits.as_mut() {
                            l.truncate(n);
                        }
                        output.text = self.decode(&output.token_ids);
                        output.finish_reason = FinishReason::Cancelled;
                    }
                    return Ok(output);
                }
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
