//! `StepRunner`: runs one step of rows through a `Model` — prefill chunks (`forward`), padded
//! decode steps (`decode`), verify steps of speculative decoding (`verify`) and MTP head steps
//! (`mtp_step`) — and leaves logits for the rows that asked for them. It owns what a step needs
//! besides the weights and the caches: the step buffers (one arena, allocated at load), the
//! captured graphs, and the forward choice (legacy launches or the circuit executor's programs,
//! `circuit.rs`). The caches belong to the `CacheManager` the caller passes in; the runner only
//! reads its pools' fixed addresses and checks the slots a step names.
//!
//! Invariants:
//! - Every buffer a step touches was allocated at load; a step allocates nothing on the device
//!   and only uploads its metadata to fixed addresses (`upload.rs`).
//! - A row's result depends only on its token, position and sequence cache, never on the other
//!   rows of the step.
//! - With `decode_graphs`, decode, verify and MTP steps replay a graph captured the first time
//!   their shape runs; their launches depend on the shape alone. A decode step has two graphs
//!   per width: with its sampler (`decode_sampled`) and without (`decode_forward`, for steps
//!   whose sampler waits for the host's token masks).
//! - A tensor-parallel model's ranks past rank 0 (`ranks.rs`) run every prefill and decode
//!   step beside rank 0 with the same input; rank 0 samples and holds the step's logits.

mod build;
pub(crate) mod circuit;
mod forward;
mod graphs;
mod mtp;
pub(crate) mod prefix;
mod ranks;
mod sample;
mod sizes;
mod upload;
mod verify;

use metrale_cache::{BlockTable, CacheManager, KvDtype};
use metrale_gpu_runtime::{BufferArena, GpuBackendExt};
use metrale_model_layers::circuit_exec::{Launch, LayerPools};
use metrale_model_layers::layer::SsmBinding;
use metrale_model_layers::ops::{Matrix, Ops};
use metrale_model_layers::{KvBinding, StepShape};

use crate::error::ModelError;
use crate::model::Model;
use crate::options::{ModelOptions, Speculative};
use crate::sampling::{SampleRow, SampledToken};

pub use circuit::{
    Digest, ForwardDisclosure, ForwardSelect, Fusions, ModelCircuit, checkpoint_plan,
    checkpoint_plans, draft_batches, draft_rows, plans_digest, verify_batches, verify_rows,
};
pub use graphs::GraphCache;
pub use mtp::MtpStep;
pub use prefix::{ChunkCuts, mixed_chunk, prefill_chunk, rows_within_attention};
pub use sizes::StepSizes;
pub use upload::{StepInput, StepRow};

use forward::Forward;
use graphs::GraphKey;
use upload::Io;

/// See the module header.
#[derive(Debug)]
pub struct StepRunner {
    /// Declared first: graphs replay the buffers and weights below, so they go first.
    graphs: GraphCache,
    forward: Forward,
    options: ModelOptions,
    sizes: StepSizes,
    /// Rows of the last step run (padding included): what `normed` holds for the MTP head.
    last_rows: usize,
    /// MTP steps that ran the circuit's draft program.
    draft_program_steps: u64,
    /// Verify steps that ran a circuit verify program.
    verify_program_steps: u64,
    /// The device sampler's buffers.
    sampler: build::SamplerBuffers,
    _arena: BufferArena,
    /// Tensor-parallel ranks `1..N` (`ranks.rs`); empty for a model that is not sharded.
    peers: Vec<ranks::RankRunner>,
}

impl StepRunner {
    /// Size `model`'s steps and caches for `options` and allocate both: the runner's buffers
    /// and the cache manager's pools.
    pub fn new(
        model: Model,
        options: ModelOptions,
    ) -> Result<(StepRunner, CacheManager), ModelError> {
        StepRunner::new_ranks(vec![model], options)
    }

    /// [`StepRunner::new`] for a model sharded over tensor-parallel ranks, `models[r]` rank
    /// `r`'s shard (`factory::load_ranks`): each rank's buffers and pools sized alike, on its
    /// own backend; one cache manager keeps the bookkeeping for all.
    pub fn new_ranks(
        models: Vec<Model>,
        options: ModelOptions,
    ) -> Result<(StepRunner, CacheManager), ModelError> {
        let mut models = models.into_iter();
        let model = models.next().ok_or_else(|| ModelError::Options {
            option: "tensor_parallel_size",
            problem: "no model shards".into(),
        })?;
        let peer_models: Vec<Model> = models.collect();
        let ranks = 1 + peer_models.len();
        if ranks != options.tensor_parallel_size.max(1) {
            return Err(ModelError::Options {
                option: "tensor_parallel_size",
                problem: format!(
                    "{} for a model loaded as {ranks} shard(s)",
                    options.tensor_parallel_size
                ),
            });
        }
        if let Some(m) = (peer_models.iter()).find(|m| m.dims() != model.dims()) {
            return Err(ModelError::Options {
                option: "tensor_parallel_size",
                problem: format!(
                    "rank {}'s shard has other dimensions than rank 0's",
                    m.gpu().tp_rank().rank
                ),
            });
        }
        let (sizes, layout) = sizes::size(&model, &options)?;
        let ranks: Vec<_> = std::iter::once(&model)
            .chain(&peer_models)
            .map(|m| (m.gpu().clone(), m.stream()))
            .collect();
        let cache = CacheManager::new_ranks(&ranks, layout)?;
        let kv = cache.kv_layout();
        tracing::info!(
            "KV cache: {} tokens fit ({} blocks of {} tokens, {} KV layers, {}, {} MiB a rank)",
            kv.token_capacity(),
            kv.num_blocks - 1,
            kv.block_size,
            kv.num_layers,
            kv.dtype.name(),
            kv.total_bytes() >> 20
        );
        let buffers = build::allocate(&model, &sizes)?;
        let (pools, head_pools) = pools(&model, &cache, 0);
        let mut peers = Vec::with_capacity(peer_models.len());
        for (i, m) in peer_models.into_iter().enumerate() {
            let b = build::allocate(&m, &sizes)?;
            let (rank_pools, rank_head_pools) = self::pools(&m, &cache, i + 1);
            peers.push(ranks::RankRunner {
                graphs: GraphCache::new(
                    m.gpu().clone(),
                    m.stream(),
                    options.max_speculative_graphs,
                    options.speculative_graph_after,
                ),
                forward: Forward {
                    circuit: None,
                    model: m,
                    buf: b.step,
                    mtp: b.mtp,
                    pools: rank_pools,
                    head_pools: if sizes.drafting {
                        rank_head_pools
                    } else {
                        Vec::new()
                    },
                },
                _arena: b.arena,
            });
        }
        let runner = StepRunner {
            graphs: GraphCache::new(
                model.gpu().clone(),
                model.stream(),
                options.max_speculative_graphs,
                options.speculative_graph_after,
            ),
            forward: Forward {
                circuit: None,
                model,
                buf: buffers.step,
                mtp: buffers.mtp,
                pools,
                head_pools: if sizes.drafting {
                    head_pools
                } else {
                    Vec::new()
                },
            },
            options,
            sizes,
            last_rows: 0,
            draft_program_steps: 0,
            verify_program_steps: 0,
            sampler: buffers.sampler,
            _arena: buffers.arena,
            peers,
        };
        Ok((runner, cache))
    }

    /// The model (weights and layers).
    pub fn model(&self) -> &Model {
        &self.forward.model
    }

    /// The options the runner was built with (`num_draft_tokens` as set since).
    pub fn options(&self) -> &ModelOptions {
        &self.options
    }

    /// The limits of a step.
    pub fn sizes(&self) -> &StepSizes {
        &self.sizes
    }

    /// The captured graphs.
    pub fn graphs(&self) -> &GraphCache {
        &self.graphs
    }

    /// Draft up to `k` tokens per verify step from now on (`speculative` on): at most what the
    /// runner was built for (`num_draft_tokens` at load sizes the buffers and slots).
    pub fn set_num_draft_tokens(&mut self, k: usize) -> Result<(), ModelError> {
        let built = self.sizes.drafts;
        if self.options.speculative == Speculative::Off || !(1..=built).contains(&k) {
            return Err(ModelError::Options {
                option: "num_draft_tokens",
                problem: format!(
                    "{k} drafts per step; this model was built for 1 to {built} (speculative on)"
                ),
            });
        }
        self.options.num_draft_tokens = k;
        Ok(())
    }

    /// Mix prefill chunks into decode steps (`true`, the default from
    /// `ModelOptions::mixed_steps`) or alternate them; the scheduler reads it at every step.
    pub fn set_mixed_steps(&mut self, on: bool) {
        self.options.mixed_steps = on;
    }

    /// Replay decode, verify and MTP steps from graphs (`true`, the default from
    /// `ModelOptions::decode_graphs`) or launch them eagerly.
    pub fn set_decode_graphs(&mut self, on: bool) {
        self.options.decode_graphs = on;
    }

    /// Destroy every captured graph, every rank's: the next step of each shape captures its
    /// graph again, within the bound on speculative graphs afresh (the serving ladder starts
    /// each rung so, as a fresh engine at that concurrency).
    pub(crate) fn clear_graphs(&mut self) -> Result<(), ModelError> {
        let mut result = self.graphs.clear();
        for peer in &mut self.peers {
            let cleared = peer.graphs.clear();
            result = result.and(cleared);
        }
        result
    }

    fn io(&self) -> Io<'_> {
        let model = &self.forward.model;
        Io {
            gpu: model.gpu().as_ref(),
            stream: model.stream(),
            buf: &self.forward.buf,
            sizes: &self.sizes,
            dims: model.dims(),
            ops: model.ops(),
        }
    }

    /// Run one step: embed, every layer, the final norm, and the LM head on the logit rows.
    /// Logits are left on the device; read them with [`StepRunner::logits`].
    pub fn forward(
        &mut self,
        cache: &CacheManager,
        input: &StepInput<'_>,
    ) -> Result<(), ModelError> {
        self.io().check(cache, input)?;
        let prompt = self.prompt_attention();
        let shape = self.io().upload_forward(input, prompt)?;
        self.last_rows = shape.rows as usize;
        self.on_ranks(
            |me| me.forward.legacy_step(me.forward.model.ops(), shape),
            |peer, sizes, _| peer.forward(sizes, input, prompt),
        )
    }

    /// Whether a forward step's prompt rows attend in the prompt arithmetic
    /// (`paged_attention_prompt`): `ModelOptions::prompt_attention` is on and the attention
    /// layers take it (head_dim 128, a bf16 KV cache).
    pub fn prompt_attention(&self) -> bool {
        let model = self.model();
        let fp8 = self.options.kv_cache_dtype.resolve(model.config()) == KvDtype::Fp8;
        self.options.prompt_attention
            && model.cache_layers().num_kv > 0
            && Ops::prompt_attention_fits(model.dims().head_dim, fp8 as u32)
    }

    /// Upload `input` as [`StepRunner::forward`] does and return the step's launches without
    /// running them (the legacy forward, as every prefill runs): for a launch-by-launch profile
    /// of a prefill.
    pub fn forward_launches(
        &mut self,
        cache: &CacheManager,
        input: &StepInput<'_>,
    ) -> Result<Vec<Launch>, ModelError> {
        self.single_rank("recorded prefill")?;
        self.io().check(cache, input)?;
        let shape = self.io().upload_forward(input, self.prompt_attention())?;
        self.last_rows = shape.rows as usize;
        self.forward.record_step(shape)
    }

    /// Run one decode step: row `i` is sequence `i`'s next token. The step is padded to the
    /// decode ladder width and, with `decode_graphs`, replayed from a graph captured the first
    /// time that width runs. Logit row `i` belongs to sequence `i`. The step ends with the
    /// device sampler over greedy rows; read its tokens with [`StepRunner::greedy`] (or run
    /// [`StepRunner::decode_sampled`] to sample).
    pub fn decode(
        &mut self,
        cache: &CacheManager,
        rows: &[StepRow],
        tables: &[&BlockTable],
        ssm_slots: &[u32],
    ) -> Result<(), ModelError> {
        self.decode_step(cache, rows, tables, ssm_slots, Some(&[]))
    }

    /// [`StepRunner::decode`], with row `i`'s token picked by the device sampler under
    /// `sampling[i]` inside the step (the decode graph ends with the sampler, its inputs
    /// uploaded to fixed addresses first). Returns what it picked, row by row.
    pub fn decode_sampled(
        &mut self,
        cache: &CacheManager,
        rows: &[StepRow],
        tables: &[&BlockTable],
        ssm_slots: &[u32],
        sampling: &[SampleRow],
    ) -> Result<Vec<SampledToken>, ModelError> {
        if sampling.len() != rows.len() {
            return Err(ModelError::Step(format!(
                "{} sampling rows for a decode step of {} rows",
                sampling.len(),
                rows.len()
            )));
        }
        self.decode_step(cache, rows, tables, ssm_slots, Some(sampling))?;
        self.sampled(sampling)
    }

    /// [`StepRunner::decode`] without the sampler: the step's forward is launched (replayed
    /// from a forward-only graph with `decode_graphs`) and left running, so the host can work
    /// out what the sampler needs (constrained rows' token masks) meanwhile; then
    /// [`StepRunner::sample_decoded`] uploads that and samples. A decode step without
    /// constrained rows runs [`StepRunner::decode_sampled`], one graph with its sampler.
    pub fn decode_forward(
        &mut self,
        cache: &CacheManager,
        rows: &[StepRow],
        tables: &[&BlockTable],
        ssm_slots: &[u32],
    ) -> Result<DecodeLaunched, ModelError> {
        self.decode_step(cache, rows, tables, ssm_slots, None)?;
        Ok(DecodeLaunched { rows: rows.len() })
    }

    /// The tokens of the decode step [`StepRunner::decode_forward`] launched, picked on the
    /// device by `sampling` (one row a sequence, masks included): the rows are uploaded behind
    /// the forward on the stream, then the sampler runs over the step's rows (not its padding).
    pub fn sample_decoded(
        &self,
        launched: DecodeLaunched,
        sampling: &[SampleRow],
    ) -> Result<Vec<SampledToken>, ModelError> {
        if sampling.len() != launched.rows {
            return Err(ModelError::Step(format!(
                "{} sampling rows for a decode step of {} rows",
                sampling.len(),
                launched.rows
            )));
        }
        self.sample(sampling)
    }

    /// A decode step ending with the sampler over `sampling` (uploaded before the step, inside
    /// the graph), or, with `None`, only its forward.
    fn decode_step(
        &mut self,
        cache: &CacheManager,
        rows: &[StepRow],
        tables: &[&BlockTable],
        ssm_slots: &[u32],
        sampling: Option<&[SampleRow]>,
    ) -> Result<(), ModelError> {
        if rows.iter().enumerate().any(|(i, r)| r.seq as usize != i) || rows.len() != tables.len() {
            return Err(ModelError::Step(
                "a decode step has one row per sequence, row i for sequence i".into(),
            ));
        }
        let logit_rows: Vec<u32> = (0..rows.len() as u32).collect();
        let input = StepInput {
            rows,
            tables,
            logit_rows: &logit_rows,
            ssm_slots,
            prompt_until: &[],
        };
        self.io().check(cache, &input)?;
        let width = self.options.decode_width(rows.len()).ok_or_else(|| {
            ModelError::Step(format!(
                "{} sequences exceed max_decode_seqs {}",
                rows.len(),
                self.options.max_decode_seqs
            ))
        })?;
        // Rank 0's uploads come first, so an input its checks refuse fails the step before any
        // rank launches (a failing launch would abort a sharded model's group for good).
        let shape = self.io().upload(&input, Some(width), None)?;
        if let Some(sampling) = sampling {
            self.upload_sampling(sampling, shape.logit_rows as usize)?;
        }
        self.last_rows = shape.rows as usize;
        let sampled = sampling.is_some();
        self.on_ranks(
            |me| me.decode_launch(shape, sampled),
            |peer, sizes, options| peer.decode(sizes, options, &input, width),
        )
    }

    /// Rank 0's launches of [`StepRunner::decode_step`] after its upload, with the sampler when
    /// `sampled`.
    fn decode_launch(&mut self, shape: StepShape, sampled: bool) -> Result<(), ModelError> {
        let sampler = self.sampler;
        let step = |forward: &Forward| {
            forward.decode(shape)?;
            if sampled {
                sample::launch_sample(forward, &sampler, shape.logit_rows)?;
            }
            Ok(())
        };
        if !self.options.decode_graphs {
            return step(&self.forward);
        }
        let key = if sampled {
            GraphKey::Decode(shape.rows)
        } else {
            GraphKey::DecodeForward(shape.rows)
        };
        if self.forward.circuit.is_none() {
            self.map_before_capture(key, shape)?;
        }
        let forward = &self.forward;
        self.graphs.replay(key, || step(forward))
    }

    /// Before the first capture under `key` of a step that runs the legacy launches: record
    /// them once (nothing runs), which uploads the tensor maps its projections read
    /// (`Ops::linear` makes a weight's map on first use, but not while a graph is captured, and
    /// runs a slower kernel with the same rows instead). A circuit program made its maps when
    /// it was compiled.
    fn map_before_capture(&self, key: GraphKey, shape: StepShape) -> Result<(), ModelError> {
        if !self.graphs.contains(key) {
            self.forward.record_step(shape)?;
        }
        Ok(())
    }

    /// The logits of the last step's first `n` logit rows, `[n][vocab]`.
    pub fn logits(&self, n: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        let model = &self.forward.model;
        let v = model.dims().vocab as usize;
        let flat: Vec<f32> =
            (model.gpu()).download(self.forward.buf.head.logits, n * v, model.stream())?;
        Ok(flat.chunks(v).map(<[f32]>::to_vec).collect())
    }

    /// Greedy tokens of the last step's first `n` logit rows, computed on the device.
    pub fn greedy(&self, n: usize) -> Result<Vec<u32>, ModelError> {
        let (model, buf) = (&self.forward.model, &self.forward.buf);
        let logits = Matrix::f32(buf.head.logits, n as u32, model.dims().vocab);
        model
            .ops()
            .argmax(model.stream(), buf.head.sampled, logits)?;
        Ok(model.gpu().download(buf.head.sampled, n, model.stream())?)
    }
}

/// A decode step whose forward [`StepRunner::decode_forward`] launched and whose sampling
/// [`StepRunner::sample_decoded`] has still to run.
#[derive(Debug)]
#[must_use = "the step's tokens come from `StepRunner::sample_decoded`"]
pub struct DecodeLaunched {
    /// The step's rows (one a sequence, padding left out).
    rows: usize,
}

/// Each layer's KV and SSM pools as its forward and the circuit see them, and the KV pools of
/// the MTP head's layers (after the model's attention layers).
fn pools(model: &Model, cache: &CacheManager, rank: usize) -> (Vec<LayerPools>, Vec<KvBinding>) {
    let layout = cache.kv_layout();
    let kv_binding = |k: usize| {
        let p = cache
            .rank_kv_layer(rank, k)
            .unwrap_or_else(|| cache.kv_layer(k));
        KvBinding {
            k: p.k,
            v: p.v,
            block_size: layout.block_size as u32,
            num_slots: (layout.num_blocks * layout.block_size) as u32,
            dtype: layout.dtype,
            scales: model.kv_scales(k),
        }
    };
    let (total, _) = cache.ssm_slots().unwrap_or((0, 0));
    let layers = model.cache_layers();
    let pools = (layers.kv.iter().zip(&layers.ssm))
        .map(|(kv, ssm)| LayerPools {
            kv: kv.map(kv_binding),
            ssm: ssm
                .and_then(|g| cache.rank_ssm_layer(rank, g))
                .map(|p| SsmBinding {
                    conv: p.conv,
                    recurrent: p.recurrent,
                    conv_slot_stride: (p.conv_slot_bytes / 4) as u32,
                    recurrent_slot_stride: (p.recurrent_slot_bytes / 4) as u32,
                    num_slots: total as u32,
                }),
        })
        .collect();
    let head = (layers.num_kv..layout.num_layers).map(kv_binding).collect();
    (pools, head)
}
