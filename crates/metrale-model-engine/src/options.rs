//! `ModelOptions`: the sizes a model is built for, and whether it decodes speculatively. Every
//! buffer is allocated from these once, at load.

/// See the module header. Every field has a documented default.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ModelOptions {
    /// Most tokens one step processes (prefill chunks are cut to this). Default 512.
    pub max_batch_tokens: usize,
    /// Mixed steps: while a prompt prefills and other sequences decode, each step holds one
    /// row of every decoding sequence and a chunk of the prompt sized to the rest of
    /// `max_batch_tokens`, so a long prompt never stalls the other streams' next token for a
    /// whole chunk. Off: prefill chunks and decode steps alternate under the budget. Mixing
    /// does not apply to verify steps of speculative decoding, nor under circuit programs
    /// holding a fusion that rounds differently from the legacy launches (`Numerics::Differs`;
    /// the fusions the kernels have now are byte-identical); there they alternate either way. A sequence's tokens and logits are the same with it on or off.
    /// Default true.
    pub mixed_steps: bool,
    /// With mixed steps, the most attention work a mixed step's chunk may carry, in query-row
    /// by key pairs: a chunk of `r` rows from prompt position `p` reads `r * p + r * (r + 1) / 2`
    /// keys, so late in a long prompt the chunk is cut shorter (at least one row; on hybrid
    /// models still only where a cut is allowed, so possibly longer). It bounds a mixed step's
    /// time, and with it the other streams' inter-token gap, where prefill attention dominates
    /// the step; the prompt then takes more steps. A sequence's tokens and logits do not depend
    /// on it. `None`: only the token budget bounds the chunk. Default `None`.
    pub mixed_chunk_attention: Option<usize>,
    /// With mixed steps, the token budget of a mixed step (its decode rows and its chunk),
    /// below `max_batch_tokens`: a mixed step's projections cost about as many rows as it
    /// holds, so a smaller budget bounds the other streams' inter-token gap where the chunk's
    /// rows dominate the step, while a prompt prefilling with no decode beside it still gets
    /// chunks of `max_batch_tokens`. A sequence's tokens and logits do not depend on it.
    /// `None`: `max_batch_tokens`. Default `None`.
    pub mixed_step_tokens: Option<usize>,
    /// With mixed steps, the wall time a mixed step aims at, in percent of a plain decode step
    /// of as many decode rows (more than 100): the engine times its decode steps and sizes
    /// each mixed step's chunk from the last mixed steps' times, so the decoding streams'
    /// inter-token gap stays near this multiple of a plain step's while a prompt prefills
    /// beside them (a row's cost grows along a long prompt; the chunks follow it). The prompt
    /// then takes more steps. Until a decode width has two plain steps timed, its steps run
    /// plain; the first paced chunk has 16 rows and a chunk at most doubles from one step to
    /// the next. `mixed_step_tokens` and `mixed_chunk_attention` still bound the chunk. A
    /// sequence's tokens and logits do not depend on it. `None`: chunks are not paced. Default
    /// `None`.
    pub mixed_step_slowdown_pct: Option<u32>,
    /// Longest sequence (prompt plus output). Default: the config's
    /// `max_position_embeddings`, capped at 4096.
    pub max_seq_len: Option<usize>,
    /// Tokens per KV-cache block. Default 16.
    pub block_size: usize,
    /// KV-cache blocks. Default: as many as fit in `kv_cache_bytes` when that is set, else
    /// enough for `max_decode_seqs` sequences of `max_seq_len`, plus the dummy block.
    pub num_kv_blocks: Option<usize>,
    /// Device memory for the KV cache's pools (every attention layer's K and V, the dummy
    /// block included), in bytes: unless `num_kv_blocks` is set, the cache gets as many blocks
    /// as fit, so an FP8 cache (`kv_cache_dtype`) holds twice the tokens of a bf16 one. Default
    /// `None` (sized by `num_kv_blocks`'s default).
    pub kv_cache_bytes: Option<usize>,
    /// How the KV cache stores keys and values. Default [`KvCacheDtype::Auto`].
    pub kv_cache_dtype: KvCacheDtype,
    /// Most sequences in one step; decode batches are padded up the ladder 1, 2, 4, ... to at
    /// most this. Default 8.
    pub max_decode_seqs: usize,
    /// Capture each decode width's step once as a graph and replay it. Default true.
    pub decode_graphs: bool,
    /// With `decode_graphs`, most graphs kept for speculative steps, verify and MTP together
    /// (one per step shape met: rows, sequences, logit rows), so the graphs' device memory stays
    /// bounded under any mix of drafts. At the bound a step of a new shape runs eagerly until
    /// its shape has been met three times, then replaces the graph replayed longest ago: shapes
    /// met in passing (a ramp-up) never displace those that keep coming. Default 64.
    pub max_speculative_graphs: usize,
    /// Below `max_speculative_graphs`, times a verify or MTP step shape is met before its step
    /// is captured as a graph: the meetings before run eagerly. A capture costs milliseconds,
    /// so shapes met once (while requests start or end) should not pay one. Default 2; 1
    /// captures every shape the first time.
    pub speculative_graph_after: u32,
    /// Under the circuit forward with speculation on, verify steps and MTP draft steps of 2 to
    /// this many sequences (at most `max_decode_seqs`) run from circuit programs, compiled when
    /// the forward is selected and graphed like any speculative step: a verify program per
    /// shape of `s` sequences and `s + 1..=s * (1 + K)` rows (`K * s` per `s`), and, with MTP
    /// drafting, a draft program per shape of `s..=s * (1 + K)` rows with a logit row per
    /// sequence. Steps of more sequences run the legacy launches. 0 or 1: single-sequence
    /// programs only. Default 4.
    pub circuit_speculative_seqs: usize,
    /// Prefix caching: the full KV blocks of prompts stay cached, keyed by a hash chain over
    /// their tokens, and a later request whose prompt starts with the same blocks shares them
    /// instead of computing them (on hybrid models, from a position where an SSM snapshot was
    /// kept, see `ssm_snapshot_slots`). On models whose decode steps compute what prefill steps
    /// compute (no GDN layers, the legacy or reference forward) the blocks that generated
    /// tokens fill are cached too, so a follow-up turn whose prompt repeats the conversation so
    /// far shares all of it. Cached blocks nobody holds are evicted least recently used first
    /// when blocks run out. A cached run's tokens and logits are bitwise those of an uncached
    /// one. Default true.
    pub prefix_caching: bool,
    /// SSM state snapshots kept for prefix caching on hybrid models, each the size of one
    /// sequence's SSM state (every GDN layer's conv window and recurrent state), allocated at
    /// load. Default (`None`): `2 * max_decode_seqs`. With 0, or prefix caching off, none are
    /// allocated and hybrid prompts never hit; models without GDN layers allocate none.
    pub ssm_snapshot_slots: Option<usize>,
    /// Hybrid models: prefill chunks also end at every multiple of this many tokens, so that
    /// (with prefix caching) an SSM snapshot is kept at least that often along a prompt and a
    /// prompt sharing only part of a cached one resumes at most this many tokens before the
    /// shared part ends. A positive multiple of the snapshot interval `lcm(block_size, 64)`
    /// (64 with the default blocks). Smaller strides give denser resume points for shorter
    /// prefill steps and more snapshot entries per prompt; cuts there never change a result.
    /// Default `None`: chunks end only every `max_batch_tokens` tokens and at the prompt's last
    /// multiple of the interval, with a snapshot at each of those.
    pub ssm_snapshot_stride: Option<usize>,
    /// With `prefix_caching`, on models whose decode steps do not compute what prefill steps
    /// compute (hybrid models, whose decode runs the delta rule token by token; circuit
    /// programs holding a fusion that rounds differently), so that the blocks decode steps fill are not published: a sequence that ends
    /// by its stop rule (a stop token, `max_new_tokens`, a full context) has its conversation,
    /// prompt and every generated token, prefilled again inside the scheduler up to the last
    /// position where a follow-up turn can resume (on hybrid models the last multiple of the
    /// snapshot interval), with no request waiting for it. Its blocks and SSM snapshots are
    /// published as a cold prefill writes them, so a follow-up turn repeating the conversation
    /// shares the answer too and computes only what is new (plus less than one snapshot
    /// interval). It runs only while no request waits or runs (on time the device would spend
    /// idle), gives way to one that arrives, and is
    /// skipped when the cache has no room; the scheduler's stats count its steps apart from
    /// requests' prefill. No effect on models where decode-filled blocks are published, nor
    /// with prefix caching off. Default true.
    pub reprefill_answers: bool,
    /// Prompt rows attend in an arithmetic of their own (`paged_attention_prompt`: one softmax
    /// chain a row over 64-key tiles) where the attention layers take it (head_dim 128, bf16
    /// KV cache): a prefill step's rows at positions a request brought (its prompt; a
    /// re-prefill's whole conversation), while generated positions (decode, verify, and their
    /// recompute after preemption) keep the decode arithmetic. A row's tokens and logits still
    /// depend on nothing but its sequence (chunks, batches, mixed steps, preemption and prompt
    /// prefix hits change no bit); decode-filled blocks are then not published for prefix
    /// caching (a follow-up turn's cold prefill computes the answer as prompt), so
    /// `reprefill_answers` caches finished conversations instead, as on hybrid models.
    /// Default false.
    pub prompt_attention: bool,
    /// Speculative decoding (`generate` and the scheduler run it; the engine accepts `Off` and
    /// `Mtp`). Default `Off`.
    pub speculative: Speculative,
    /// Tokens drafted per sequence for each verify step when `speculative` is on, 1 to
    /// [`MAX_DRAFT_TOKENS`]. It sizes the logits (`max_decode_seqs * (1 + this)` rows), the SSM
    /// state pool (each sequence holds `1 + this` slots) and the MTP head's buffers. Unused when
    /// `speculative` is `Off`. Default 2.
    pub num_draft_tokens: usize,
    /// How projection weights are stored on the device. Default [`Quantization::AsStored`].
    pub quantization: Quantization,
    /// Tensor-parallel ranks (1, 2, 4 or 8): the model is split Megatron-style over that many
    /// backends of one group, one thread each (`factory::load_ranks` and `factory::RankShard`
    /// say how), each reading only its shard of the checkpoint; its heads, widths and
    /// vocabulary must split over the ranks. Above 1: bf16 (or f16, f32) checkpoints only and
    /// the legacy forward. Default 1.
    pub tensor_parallel_size: usize,
}

/// How a model's projection weights (attention, MLP, Gated DeltaNet in/out, shared experts)
/// are stored on the device; embeddings, norms, the LM head, routers and MoE experts stay bf16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Quantization {
    /// As the checkpoint stores them: block FP8 with their scales where it is an FP8 pack,
    /// else bf16. The default.
    #[default]
    AsStored,
    /// Block FP8 (e4m3, 128 x 128 blocks): bf16 weights quantized at load with the FP8 packs'
    /// recipe (scale = block amax / 448, elements rounded to nearest even), so a model
    /// quantized here has the weights of the pack made from the same bf16 weights.
    Fp8,
}

impl Quantization {
    /// `none` (as stored) or `fp8`, as the CLI spells them.
    pub fn name(self) -> &'static str {
        match self {
            Quantization::AsStored => "none",
            Quantization::Fp8 => "fp8",
        }
    }
}

/// How the KV cache stores keys and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KvCacheDtype {
    /// FP8 when the checkpoint's `quantization_config` asks for an FP8 KV cache
    /// (`kv_cache_scheme`, `kv_cache_quant_algo`), else bf16. The default.
    #[default]
    Auto,
    /// bf16, two bytes an element.
    Bf16,
    /// e4m3, one byte an element (half the bytes a token): stored as `e4m3(value / scale)`
    /// (round to nearest even, saturated at ±448), read as `bf16(e4m3 · scale')`, with
    /// each attention layer's `k_scale` / `v_scale` from the checkpoint where it has them, else
    /// 1.0.
    Fp8,
}

impl KvCacheDtype {
    /// `auto`, `bf16` or `fp8`, as the CLI spells them.
    pub fn name(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "auto",
            KvCacheDtype::Bf16 => "bf16",
            KvCacheDtype::Fp8 => "fp8",
        }
    }

    /// The pools' format for a checkpoint of `config`.
    pub fn resolve(self, config: &metrale_config::ModelConfig) -> metrale_cache::KvDtype {
        match self {
            KvCacheDtype::Auto if config.checkpoint.kv_cache_fp8 => metrale_cache::KvDtype::Fp8,
            KvCacheDtype::Auto | KvCacheDtype::Bf16 => metrale_cache::KvDtype::Bf16,
            KvCacheDtype::Fp8 => metrale_cache::KvDtype::Fp8,
        }
    }
}

/// The most tokens a sequence drafts for one verify step.
pub const MAX_DRAFT_TOKENS: usize = 8;

/// How tokens are proposed ahead of the target model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Speculative {
    /// Plain decode: one token per sequence and step. The default.
    #[default]
    Off,
    /// The checkpoint's multi-token-prediction head (`mtp.*`) drafts `num_draft_tokens` tokens,
    /// reusing itself for each; the model verifies them in one step per sequence.
    Mtp,
    /// Sized for `num_draft_tokens` drafts that the caller's own drafter supplies through
    /// `generate::generate_speculative` (the oracle drafter of the tests, acceptance studies);
    /// `generate` alone decodes plainly.
    External,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            max_batch_tokens: 512,
            mixed_steps: true,
            mixed_chunk_attention: None,
            mixed_step_tokens: None,
            mixed_step_slowdown_pct: None,
            max_seq_len: None,
            block_size: 16,
            num_kv_blocks: None,
            kv_cache_bytes: None,
            kv_cache_dtype: KvCacheDtype::Auto,
            max_decode_seqs: 8,
            decode_graphs: true,
            max_speculative_graphs: 64,
            speculative_graph_after: 2,
            circuit_speculative_seqs: 4,
            prefix_caching: true,
            ssm_snapshot_slots: None,
            ssm_snapshot_stride: None,
            reprefill_answers: true,
            prompt_attention: false,
            speculative: Speculative::Off,
            num_draft_tokens: 2,
            quantization: Quantization::AsStored,
            tensor_parallel_size: 1,
        }
    }
}

impl ModelOptions {
    /// Set `max_batch_tokens`.
    pub fn max_batch_tokens(mut self, n: usize) -> Self {
        self.max_batch_tokens = n;
        self
    }

    /// Set `mixed_steps`.
    pub fn mixed_steps(mut self, on: bool) -> Self {
        self.mixed_steps = on;
        self
    }

    /// Set `mixed_chunk_attention`.
    pub fn mixed_chunk_attention(mut self, pairs: Option<usize>) -> Self {
        self.mixed_chunk_attention = pairs;
        self
    }

    /// Set `mixed_step_tokens`.
    pub fn mixed_step_tokens(mut self, tokens: Option<usize>) -> Self {
        self.mixed_step_tokens = tokens;
        self
    }

    /// Set `mixed_step_slowdown_pct`.
    pub fn mixed_step_slowdown_pct(mut self, percent: Option<u32>) -> Self {
        self.mixed_step_slowdown_pct = percent;
        self
    }

    /// Set `max_seq_len` (`None`: the config's, capped at 4096).
    pub fn max_seq_len(mut self, n: impl Into<Option<usize>>) -> Self {
        self.max_seq_len = n.into();
        self
    }

    /// Set `block_size`.
    pub fn block_size(mut self, n: usize) -> Self {
        self.block_size = n;
        self
    }

    /// Set `num_kv_blocks` (`None`: enough for `max_decode_seqs` sequences of `max_seq_len`).
    pub fn num_kv_blocks(mut self, n: impl Into<Option<usize>>) -> Self {
        self.num_kv_blocks = n.into();
        self
    }

    /// Set `kv_cache_bytes` (`None`: sized by `num_kv_blocks`'s default).
    pub fn kv_cache_bytes(mut self, n: impl Into<Option<usize>>) -> Self {
        self.kv_cache_bytes = n.into();
        self
    }

    /// Set `kv_cache_dtype`.
    pub fn kv_cache_dtype(mut self, d: KvCacheDtype) -> Self {
        self.kv_cache_dtype = d;
        self
    }

    /// Set `max_decode_seqs`.
    pub fn max_decode_seqs(mut self, n: usize) -> Self {
        self.max_decode_seqs = n;
        self
    }

    /// Set `decode_graphs`.
    pub fn decode_graphs(mut self, on: bool) -> Self {
        self.decode_graphs = on;
        self
    }

    /// Set `circuit_speculative_seqs`.
    pub fn circuit_speculative_seqs(mut self, n: usize) -> Self {
        self.circuit_speculative_seqs = n;
        self
    }

    /// Set `max_speculative_graphs`.
    pub fn max_speculative_graphs(mut self, n: usize) -> Self {
        self.max_speculative_graphs = n;
        self
    }

    /// Set `speculative_graph_after`.
    pub fn speculative_graph_after(mut self, n: u32) -> Self {
        self.speculative_graph_after = n;
        self
    }

    /// Set `prefix_caching`.
    pub fn prefix_caching(mut self, on: bool) -> Self {
        self.prefix_caching = on;
        self
    }

    /// Set `ssm_snapshot_slots` (`None`: `2 * max_decode_seqs`).
    pub fn ssm_snapshot_slots(mut self, n: impl Into<Option<usize>>) -> Self {
        self.ssm_snapshot_slots = n.into();
        self
    }

    /// Set `ssm_snapshot_stride` (`None`: chunks end only every `max_batch_tokens`).
    pub fn ssm_snapshot_stride(mut self, n: impl Into<Option<usize>>) -> Self {
        self.ssm_snapshot_stride = n.into();
        self
    }

    /// Set `reprefill_answers`.
    pub fn reprefill_answers(mut self, on: bool) -> Self {
        self.reprefill_answers = on;
        self
    }

    /// Set `prompt_attention`.
    pub fn prompt_attention(mut self, on: bool) -> Self {
        self.prompt_attention = on;
        self
    }

    /// Set `speculative`.
    pub fn speculative(mut self, s: Speculative) -> Self {
        self.speculative = s;
        self
    }

    /// Set `quantization`.
    pub fn quantization(mut self, q: Quantization) -> Self {
        self.quantization = q;
        self
    }

    /// Set `tensor_parallel_size`.
    pub fn tensor_parallel_size(mut self, n: usize) -> Self {
        self.tensor_parallel_size = n;
        self
    }

    /// Set `num_draft_tokens`.
    pub fn num_draft_tokens(mut self, n: usize) -> Self {
        self.num_draft_tokens = n;
        self
    }

    /// Tokens drafted per sequence and verify step: `num_draft_tokens` with speculation on, 0
    /// without.
    pub fn draft_tokens(&self) -> usize {
        match self.speculative {
            Speculative::Off => 0,
            Speculative::Mtp | Speculative::External => self.num_draft_tokens,
        }
    }

    /// The padded decode widths: powers of two below `max_decode_seqs`, then `max_decode_seqs`.
    pub fn decode_ladder(&self) -> Vec<usize> {
        let mut out = Vec::new();
        let mut w = 1;
        while w < self.max_decode_seqs {
            out.push(w);
            w *= 2;
        }
        out.push(self.max_decode_seqs.max(1));
        out
    }

    /// SSM snapshot entries to allocate for a hybrid model (see `ssm_snapshot_slots`).
    pub fn snapshot_slots(&self) -> usize {
        if !self.prefix_caching {
            return 0;
        }
        self.ssm_snapshot_slots.unwrap_or(2 * self.max_decode_seqs)
    }

    /// The ladder width a decode of `n` sequences is padded to.
    pub fn decode_width(&self, n: usize) -> Option<usize> {
        self.decode_ladder().into_iter().find(|&w| w >= n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_setters_set_their_field_and_keep_the_others_at_their_defaults() {
        let o = ModelOptions::default()
            .max_batch_tokens(32)
            .mixed_steps(false)
            .mixed_step_slowdown_pct(Some(175))
            .max_seq_len(256)
            .num_kv_blocks(Some(40))
            .kv_cache_bytes(1 << 20)
            .kv_cache_dtype(KvCacheDtype::Fp8)
            .max_decode_seqs(4)
            .prefix_caching(false)
            .ssm_snapshot_stride(128)
            .reprefill_answers(false)
            .prompt_attention(true)
            .speculative(Speculative::Mtp)
            .num_draft_tokens(3);
        assert_eq!(
            o,
            ModelOptions {
                max_batch_tokens: 32,
                mixed_steps: false,
                mixed_step_slowdown_pct: Some(175),
                max_seq_len: Some(256),
                num_kv_blocks: Some(40),
                kv_cache_bytes: Some(1 << 20),
                kv_cache_dtype: KvCacheDtype::Fp8,
                max_decode_seqs: 4,
                prefix_caching: false,
                ssm_snapshot_stride: Some(128),
                reprefill_answers: false,
                prompt_attention: true,
                speculative: Speculative::Mtp,
                num_draft_tokens: 3,
                ..ModelOptions::default()
            }
        );
        assert_eq!(o.clone().max_seq_len(None).max_seq_len, None);
    }

    #[test]
    fn the_ladder_doubles_up_to_the_maximum() {
        let o = ModelOptions {
            max_decode_seqs: 24,
            ..Default::default()
        };
        assert_eq!(o.decode_ladder(), vec![1, 2, 4, 8, 16, 24]);
        assert_eq!(o.decode_width(3), Some(4));
        assert_eq!(o.decode_width(17), Some(24));
        assert_eq!(o.decode_width(25), None);
        assert_eq!(
            ModelOptions {
                max_decode_seqs: 1,
                ..Default::default()
            }
            .decode_ladder(),
            vec![1]
        );
    }
}
