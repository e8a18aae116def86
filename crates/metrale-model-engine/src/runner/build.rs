//! The step runner's memory: every buffer a step touches, allocated once in one arena from the
//! model's dimensions and the step sizes (`sizes.rs`), with `linear_tma`'s staging memory, and
//! the MTP head's input buffers when it drafts.

use metrale_gpu_runtime::arena::ArenaLayout;
use metrale_gpu_runtime::{BufferArena, DType, DevicePtr, GpuBackendExt};
use metrale_kernel_abi::{SAMPLE_ENTRY_WORDS, SAMPLE_OUT_WORDS, SAMPLE_ROW_WORDS};
use metrale_model_layers::StepBuffers;
use metrale_model_layers::layer::{Activations, GdnBuffers, HeadBuffers, MoeBuffers, StepMeta};
use metrale_model_layers::layers::{GdnShape, MoeShape};
use metrale_model_layers::ops_gemm::{self, Fp8Scratch, LinearStaging};

use super::sizes::StepSizes;
use crate::error::ModelError;
use crate::model::{Model, MtpBuffers};

/// A runner's buffers and the arena that owns them.
#[derive(Debug)]
pub(crate) struct Buffers {
    pub step: StepBuffers,
    pub mtp: Option<MtpBuffers>,
    pub sampler: SamplerBuffers,
    pub arena: BufferArena,
}

/// The device sampler's inputs and output (`sampling::sample`), at fixed addresses: one row per
/// logit row, and the entries of up to `max_seqs` rows of a whole context each.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SamplerBuffers {
    /// u32 `[max_logit_rows, SAMPLE_ROW_WORDS]`.
    pub rowp: DevicePtr,
    /// u32 `[entry_capacity, SAMPLE_ENTRY_WORDS]`.
    pub entries: DevicePtr,
    /// Entries `entries` holds.
    pub entry_capacity: usize,
    /// u32 `[max_logit_rows, ceil(vocab / 32)]`.
    pub mask: DevicePtr,
    /// u32 `[max_logit_rows, SAMPLE_OUT_WORDS]`.
    pub out: DevicePtr,
}

/// Entries one sequence's row may need: each distinct token of its context, its logit bias and
/// its banned ids, never more than the vocabulary.
pub(crate) fn entries_per_row(sizes: &StepSizes, vocab: usize) -> usize {
    (sizes.max_seq_len + crate::sampling::MAX_LOGIT_BIAS + crate::sampling::MAX_BANNED).min(vocab)
}

/// The arena's layout: the step buffers, the GDN and MoE layers' when the model has them, the
/// MTP head's when it drafts, and the staging memory.
fn layout(model: &Model, sizes: &StepSizes) -> (ArenaLayout, LinearStagingSize) {
    let (dims, config) = (model.dims(), model.config());
    let (h, r, s) = (dims.hidden as usize, sizes.max_rows, sizes.max_seqs);
    let logit_rows = sizes.max_logit_rows;
    let mut layout = ArenaLayout::default();
    layout
        .add("residual", DType::F32, r * h)
        .add("normed", DType::Bf16, r * h)
        .add("delta", DType::Bf16, r * h)
        .add("qkv", DType::Bf16, r * dims.qkv_width() as usize)
        .add("attn_out", DType::Bf16, r * dims.attn_out_width() as usize)
        .add("gate_up", DType::Bf16, r * 2 * dims.ffn as usize)
        .add("act", DType::Bf16, r * dims.ffn as usize)
        .add("token_ids", DType::U32, r)
        .add("positions", DType::U32, r)
        .add("row_seq", DType::U32, r)
        .add("att_groups", DType::U32, 2 * r)
        .add("slot_mapping", DType::U32, r)
        .add("block_tables", DType::U32, s * sizes.max_blocks)
        .add("logit_rows", DType::U32, logit_rows)
        .add("logits_in", DType::Bf16, logit_rows * h)
        .add("logits", DType::F32, logit_rows * dims.vocab as usize)
        .add("sampled", DType::U32, logit_rows)
        .add(
            "sample.rowp",
            DType::U32,
            logit_rows * SAMPLE_ROW_WORDS as usize,
        )
        .add(
            "sample.entries",
            DType::U32,
            s * entries_per_row(sizes, dims.vocab as usize) * SAMPLE_ENTRY_WORDS as usize,
        )
        .add(
            "sample.mask",
            DType::U32,
            logit_rows * (dims.vocab as usize).div_ceil(32),
        )
        .add(
            "sample.out",
            DType::U32,
            logit_rows * SAMPLE_OUT_WORDS as usize,
        )
        .add(
            "inv_freq",
            DType::F32,
            (dims.rotary_dim as usize / 2).max(1),
        )
        .add("seq_start", DType::U32, s + 1)
        .add("seq_slot", DType::U32, s)
        .add("row_slot", DType::U32, r);
    if dims.tp_size > 1 {
        let local_vocab = model.weights().lm_head.shape.first().copied().unwrap_or(0);
        layout.add("partial", DType::F32, r * h).add(
            "logits_local",
            DType::F32,
            logit_rows * local_vocab,
        );
    }
    let gdn = GdnShape::from_config(config).filter(|_| model.cache_layers().num_ssm > 0);
    if let Some(g) = gdn {
        let hd = g.heads;
        let (key_dim, value_dim) = (
            (hd.num_k_heads * hd.k_head_dim) as usize,
            (hd.num_v_heads * hd.v_head_dim) as usize,
        );
        layout
            .add("gdn.proj", DType::Bf16, r * hd.proj_width() as usize)
            .add("gdn.conv", DType::Bf16, r * hd.conv_dim() as usize)
            .add("gdn.qk", DType::F32, r * 2 * key_dim)
            .add("gdn.gates", DType::F32, r * 2 * hd.num_v_heads as usize)
            .add("gdn.core", DType::F32, r * value_dim)
            .add("gdn.normed", DType::Bf16, r * value_dim);
    }
    let shared_ffn = config
        .moe
        .as_ref()
        .map_or(0, |m| m.shared_expert_intermediate_size);
    if let Some(m) = MoeShape::from_config(config) {
        let (e, k, f) = (
            m.num_experts as usize,
            m.top_k as usize,
            m.expert_ffn as usize,
        );
        layout
            .add("moe.router_logits", DType::F32, r * e)
            .add("moe.topk_ids", DType::U32, r * k)
            .add("moe.topk_weights", DType::F32, r * k)
            .add("moe.expert_gate_up", DType::Bf16, r * k * 2 * f)
            .add("moe.expert_act", DType::Bf16, r * k * f)
            .add("moe.expert_out", DType::F32, r * k * h)
            .add("moe.shared_gate_up", DType::Bf16, r * 2 * shared_ffn.max(1))
            .add("moe.shared_act", DType::Bf16, r * shared_ffn.max(1))
            .add("moe.shared_out", DType::Bf16, r * h)
            .add("moe.shared_gate", DType::F32, r);
    }
    if sizes.drafting {
        layout
            .add("mtp.hidden_rows", DType::U32, r)
            .add("mtp.hidden", DType::F32, r * h)
            .add("mtp.cat_src", DType::Bf16, 2 * r * h)
            .add("mtp.cat_ids", DType::U32, 2 * r)
            .add("mtp.cat", DType::Bf16, r * 2 * h)
            .add("mtp.archive", DType::Bf16, 2 * r * h);
    }
    // `linear`'s prefill kernel stages x here (`Ops::set_linear_staging`): rows up to the
    // step's, k up to the widest input of any projection.
    let value_dim = gdn.map_or(0, |g| g.heads.num_v_heads * g.heads.v_head_dim);
    let widest_input = [
        dims.hidden * if sizes.drafting { 2 } else { 1 },
        dims.ffn,
        dims.attn_out_width(),
        value_dim,
        u32::try_from(shared_ffn).unwrap_or(u32::MAX),
    ]
    .into_iter()
    .max()
    .unwrap_or(0);
    // A map slot per projection: at most eight a layer (MoE: router, shared expert's three;
    // GDN: its input projections and output; a dense MLP's gate/up has a second map, of the
    // 64-row boxes `linear_tma_swiglu` reads), the MTP head's layers and the LM head. The slots
    // and the images come whatever the step's rows: decode projections of 9..128 rows read
    // their weights through the maps too (`linear_stream_tma`), and most of them their x from
    // images their producer writes.
    let head_layers = model
        .mtp_head()
        .filter(|_| sizes.drafting)
        .map_or(0, |m| m.layers.len());
    let staging = LinearStagingSize {
        image_bytes: ops_gemm::linear_staging_bytes(r as u32, widest_input),
        map_slots: 8 * (model.layers().len() + head_layers + 1),
    };
    let total = LinearStaging::bytes(staging.image_bytes, staging.map_slots);
    layout.add("linear_staging", DType::U32, total.div_ceil(4));
    // Prefill-sized projections of block-FP8 weights the tensor-map kernels cannot read
    // dequantize into this and run the bf16 kernels (`ops_gemm::fp8`); steps of at most
    // `FP8_STREAM_M_MAX` rows never need it.
    let fp8 = model.largest_unmapped_fp8_weight();
    if fp8 > 0 && r > ops_gemm::FP8_STREAM_M_MAX as usize {
        layout.add("fp8_scratch", DType::Bf16, fp8);
    }
    (layout, staging)
}

/// The staging memory's parts.
#[derive(Debug, Clone, Copy)]
struct LinearStagingSize {
    image_bytes: usize,
    map_slots: usize,
}

/// Allocate the runner's buffers for `model` at `sizes`, give the model's launchers their
/// staging memory, and upload the rotary table.
pub(crate) fn allocate(model: &Model, sizes: &StepSizes) -> Result<Buffers, ModelError> {
    let gpu = model.gpu();
    let (layout, staging) = layout(model, sizes);
    let arena = BufferArena::build(gpu.clone(), &layout)?;
    let p = |n: &str| arena.get(n).ptr;
    model.ops().set_linear_staging(Some(LinearStaging::at(
        p("linear_staging"),
        staging.image_bytes,
        staging.map_slots,
    )));
    let has = |n: &str| arena.buffers().any(|(m, _)| m == n);
    let opt = |n: &str| if has(n) { p(n) } else { DevicePtr::NULL };
    model.ops().set_fp8_scratch(has("fp8_scratch").then(|| {
        let b = arena.get("fp8_scratch");
        Fp8Scratch {
            ptr: b.ptr,
            bytes: b.bytes(),
        }
    }));
    let step = StepBuffers {
        acts: Activations {
            residual: p("residual"),
            normed: p("normed"),
            delta: p("delta"),
            qkv: p("qkv"),
            attn_out: p("attn_out"),
            gate_up: p("gate_up"),
            act: p("act"),
            partial: opt("partial"),
        },
        meta: StepMeta {
            token_ids: p("token_ids"),
            positions: p("positions"),
            row_seq: p("row_seq"),
            att_groups: p("att_groups"),
            slot_mapping: p("slot_mapping"),
            block_tables: p("block_tables"),
            logit_rows: p("logit_rows"),
            seq_start: p("seq_start"),
            seq_slot: p("seq_slot"),
            row_slot: p("row_slot"),
        },
        head: HeadBuffers {
            logits_in: p("logits_in"),
            logits: p("logits"),
            logits_local: opt("logits_local"),
            sampled: p("sampled"),
        },
        inv_freq: p("inv_freq"),
        gdn: if has("gdn.proj") {
            GdnBuffers {
                proj: p("gdn.proj"),
                conv: p("gdn.conv"),
                qk: p("gdn.qk"),
                gates: p("gdn.gates"),
                core: p("gdn.core"),
                normed: p("gdn.normed"),
            }
        } else {
            GdnBuffers::default()
        },
        moe: if has("moe.router_logits") {
            MoeBuffers {
                router_logits: p("moe.router_logits"),
                topk_ids: p("moe.topk_ids"),
                topk_weights: p("moe.topk_weights"),
                expert_gate_up: p("moe.expert_gate_up"),
                expert_act: p("moe.expert_act"),
                expert_out: p("moe.expert_out"),
                shared_gate_up: p("moe.shared_gate_up"),
                shared_act: p("moe.shared_act"),
                shared_out: p("moe.shared_out"),
                shared_gate: p("moe.shared_gate"),
            }
        } else {
            MoeBuffers::default()
        },
    };
    let mtp = sizes.drafting.then(|| MtpBuffers {
        hidden_rows: p("mtp.hidden_rows"),
        hidden: p("mtp.hidden"),
        cat_src: p("mtp.cat_src"),
        cat_ids: p("mtp.cat_ids"),
        cat: p("mtp.cat"),
        archive: p("mtp.archive"),
        archive_rows: 2 * sizes.max_rows,
    });
    let sampler = SamplerBuffers {
        rowp: p("sample.rowp"),
        entries: p("sample.entries"),
        entry_capacity: sizes.max_seqs * entries_per_row(sizes, model.dims().vocab as usize),
        mask: p("sample.mask"),
        out: p("sample.out"),
    };
    let stream = model.stream();
    gpu.upload(
        step.inv_freq,
        &model.config().attention.rope.inv_freq(),
        stream,
    )?;
    gpu.synchronize(stream)?;
    Ok(Buffers {
        step,
        mtp,
        sampler,
        arena,
    })
}
