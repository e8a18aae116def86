//! The launchers of the row-wise kernels, an `impl Ops` block under `ops`'s rules: embedding and
//! row gathers, f32 rounded to bf16, the RMSNorms (plain, fused with the residual add, staged),
//! rotary embedding and the cache store, the SwiGLU gate (plain and staged), argmax, the sampler
//! and the random fill.

use metrale_gpu_runtime::{DType, DevicePtr, GpuError, GpuResult, LaunchConfig, StreamHandle};
use metrale_kernel_abi::{
    AddRmsNormParams, AddRmsNormStagedParams, ArgmaxParams, EmbeddingGatherParams,
    FillUniformBf16Params, GatherRowsParams, KvStoreParams, QkNormRopeParams, RmsNormParams,
    RoundBf16Params, SAMPLE_SPLITS, SAMPLE_THREADS, SampleParams, SiluMulParams,
    SiluMulStagedParams,
};

use crate::ops::{Ops, STEP_PROGRAMMATIC_ROWS, step_launch};
use crate::ops_view::{Matrix, Operands};

/// Threads per block of the row-wise kernels (embedding, gathers).
const ROW_THREADS: u32 = 256;

/// Threads per block of the RMSNorm kernels: one 8-wide vector per thread for a 4096-wide row,
/// so a decode row is one round of loads. (The reduction order follows the block size, the same
/// for every row whatever the batch.)
const NORM_THREADS: u32 = 512;

/// Threads per block of `silu_mul`; a row is cut over `ceil(ffn / (8 * SILU_THREADS))` blocks.
const SILU_THREADS: u32 = 128;

/// Most dynamic shared memory a `sample` block takes for its entry bitmap and key cache: two
/// blocks (of the row clusters) still fit one multiprocessor's 228 KiB. A vocabulary of 151,936
/// takes 94,960 bytes; a larger one than fits goes without the cache.
const SAMPLE_CACHE_MAX_BYTES: u32 = 100 << 10;

/// The operands of [`Ops::sample`] besides the logits (`kernels/sampling.cu` says what each
/// row computes).
#[derive(Debug, Clone, Copy)]
pub struct SampleOperands {
    /// u32 `[rows, SAMPLE_OUT_WORDS]`: each row's token, its logprob and the top logprobs.
    pub out: DevicePtr,
    /// u32 `[rows, SAMPLE_ROW_WORDS]`: each row's parameters (`SAMPLE_R_*`).
    pub rowp: DevicePtr,
    /// u32 `[num_entries, SAMPLE_ENTRY_WORDS]`: every row's penalised, biased or banned tokens.
    pub entries: DevicePtr,
    /// Entries in `entries`.
    pub num_entries: u32,
    /// u32 `[rows, words]` allowed-token bitmasks and `words` (at least `ceil(vocab / 32)`), or
    /// `None` when no row has a mask.
    pub mask: Option<(DevicePtr, u32)>,
}

/// An RMSNorm's weight and settings.
#[derive(Debug, Clone, Copy)]
pub struct Norm {
    /// bf16 `[cols]`.
    pub w: DevicePtr,
    /// Epsilon.
    pub eps: f32,
    /// Zero-centred weights: `x * (1 + w)` (Qwen3.5 / Qwen3-Next) instead of `x * w`.
    pub unit_offset: bool,
}

/// The parameters of `qk_norm_rope`.
#[derive(Debug, Clone, Copy)]
pub struct QkNormRope {
    /// Projection output rows, normalised and rotated in place.
    pub qkv: DevicePtr,
    /// Per-head q norm weight, or NULL for none (Llama).
    pub q_norm: DevicePtr,
    /// Per-head k norm weight, or NULL.
    pub k_norm: DevicePtr,
    /// `rotary_dim / 2` inverse frequencies, f32.
    pub inv_freq: DevicePtr,
    /// Position of each row.
    pub positions: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Elements per row of `qkv`.
    pub row_stride: u32,
    /// Query heads.
    pub num_q_heads: u32,
    /// Elements from one query head to the next.
    pub q_head_stride: u32,
    /// Element offset of the first key head.
    pub k_offset: u32,
    /// Key heads.
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Rotated dimensions per head.
    pub rotary_dim: u32,
    /// Factor on every cos and sin (`RopeConfig::attention_scaling`: YaRN's attention factor,
    /// exactly 1 otherwise).
    pub attention_scaling: f32,
    /// Norm epsilon.
    pub eps: f32,
    /// Zero-centred norm weights (`1 + w`).
    pub unit_offset: bool,
}

impl QkNormRope {
    /// The kernel's parameter struct.
    pub(crate) fn params(&self) -> QkNormRopeParams {
        QkNormRopeParams {
            qkv: self.qkv,
            q_norm_w: self.q_norm,
            k_norm_w: self.k_norm,
            inv_freq: self.inv_freq,
            positions: self.positions,
            rows: self.rows,
            row_stride: self.row_stride,
            num_q_heads: self.num_q_heads,
            q_head_stride: self.q_head_stride,
            k_offset: self.k_offset,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            rotary_dim: self.rotary_dim,
            attention_scaling: self.attention_scaling,
            eps: self.eps,
            unit_offset: self.unit_offset as u32,
        }
    }
}

/// The parameters of `kv_store`: the kernel's own struct.
pub type KvStore = KvStoreParams;

/// The launch of `qk_norm_rope` and `qk_norm_rope_kv_store` over `heads` warps a row: one warp
/// per head, 8 in a block at prefill sizes (one-warp blocks there leave the launch bound by
/// block scheduling) and 1 at decode sizes; shared memory for the row's rotation table and each
/// warp's head.
pub(crate) fn rope_launch(p: &QkNormRope, heads: u32) -> LaunchConfig {
    let warps = if p.rows > STEP_PROGRAMMATIC_ROWS {
        8
    } else {
        1
    };
    step_launch(
        LaunchConfig::grid2(p.rows, heads.div_ceil(warps), 32 * warps)
            .with_shared((warps + 1) * p.head_dim * 4),
        p.rows,
    )
}

/// Which rows of the vocabulary an embedding table holds: rows `start ..` of `vocab` (a
/// vocabulary-parallel rank's slice), or all of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabRows {
    /// The vocabulary row the table's first row is.
    pub start: u32,
    /// The whole vocabulary.
    pub vocab: u32,
}

impl VocabRows {
    /// A whole table of `vocab` rows.
    pub fn whole(vocab: u32) -> VocabRows {
        VocabRows { start: 0, vocab }
    }
}

impl Ops {
    /// `out[r] = table[ids[r] - vocab.start]` widened to f32, zeros for ids outside the rows
    /// `table` holds: `out` f32 `[rows, hidden]`, `table` bf16 `[table_rows, hidden]` (vocabulary
    /// rows `vocab.start ..`; the whole table with [`VocabRows::whole`]), `ids` u32 `[rows]`
    /// below `vocab.vocab`.
    pub fn embedding_gather(
        &self,
        s: StreamHandle,
        out: Matrix,
        table: Matrix,
        ids: DevicePtr,
        vocab: VocabRows,
    ) -> GpuResult<()> {
        let check = Operands {
            kernel: "embed::embedding_gather",
        };
        check.dtype("out", &out, DType::F32)?;
        check.exactly("table", &table, DType::Bf16, (table.rows, out.cols), "out")?;
        if vocab
            .start
            .checked_add(table.rows)
            .is_none_or(|end| end > vocab.vocab)
        {
            return Err(check.bad(
                "table",
                format!(
                    "{} rows from vocabulary row {}, past a vocabulary of {}",
                    table.rows, vocab.start, vocab.vocab
                ),
            ));
        }
        let p = EmbeddingGatherParams {
            out: out.ptr,
            table: table.ptr,
            ids,
            rows: out.rows,
            hidden: out.cols,
            vocab: vocab.vocab,
            row_start: vocab.start,
            table_rows: table.rows,
        };
        let cfg = step_launch(LaunchConfig::linear(out.rows, ROW_THREADS), out.rows);
        self.go(self.k.embedding_gather, cfg, &p, s)
    }

    /// `out[i] = x[row_ids[i]]`: `out` bf16 `[n, cols]`, `x` bf16 `[src_rows, cols]`, `row_ids`
    /// u32 `[n]`.
    pub fn gather_rows(
        &self,
        s: StreamHandle,
        out: Matrix,
        x: Matrix,
        row_ids: DevicePtr,
    ) -> GpuResult<()> {
        let check = Operands {
            kernel: "embed::gather_rows",
        };
        check.dtype("out", &out, DType::Bf16)?;
        check.exactly("x", &x, DType::Bf16, (x.rows, out.cols), "out")?;
        let p = GatherRowsParams {
            out: out.ptr,
            x: x.ptr,
            row_ids,
            n: out.rows,
            cols: out.cols,
            src_rows: x.rows,
        };
        let cfg = step_launch(LaunchConfig::linear(out.rows, ROW_THREADS), out.rows);
        self.go(self.k.gather_rows, cfg, &p, s)
    }

    /// `out = bf16(x)`, rounded to nearest even: `x` f32, `out` bf16, the same shape (the
    /// all-reduce's f32 sums written as a bf16 activation). A plain launch, not a programmatic
    /// dependent: the collective ahead of it does not trigger early.
    pub fn round_bf16(&self, s: StreamHandle, out: Matrix, x: Matrix) -> GpuResult<()> {
        let check = Operands {
            kernel: "embed::round_bf16",
        };
        check.dtype("x", &x, DType::F32)?;
        check.exactly("out", &out, DType::Bf16, x.shape(), "x")?;
        let n = x.rows as u64 * x.cols as u64;
        let n = u32::try_from(n).map_err(|_| {
            check.bad(
                "x",
                format!("{n} elements (at most {} in one launch)", u32::MAX),
            )
        })?;
        let p = RoundBf16Params {
            out: out.ptr,
            x: x.ptr,
            n,
        };
        let blocks = n.div_ceil(ROW_THREADS).clamp(1, 1024);
        self.go(
            self.k.round_bf16,
            LaunchConfig::linear(blocks, ROW_THREADS),
            &p,
            s,
        )
    }

    /// `out = rms_norm(x) * w` (or `* (1 + w)`): `x` f32, `out` bf16, both `[rows, cols]`.
    pub fn rms_norm(&self, s: StreamHandle, out: Matrix, x: Matrix, norm: &Norm) -> GpuResult<()> {
        let check = Operands {
            kernel: "norm::rms_norm",
        };
        check.dtype("x", &x, DType::F32)?;
        check.exactly("out", &out, DType::Bf16, x.shape(), "x")?;
        let p = RmsNormParams {
            out: out.ptr,
            x: x.ptr,
            w: norm.w,
            rows: x.rows,
            cols: x.cols,
            eps: norm.eps,
            unit_offset: norm.unit_offset as u32,
        };
        self.go(self.k.rms_norm, norm_geometry(x.rows), &p, s)
    }

    /// `residual += delta; out = rms_norm(residual) * w`: `residual` f32, `delta` and `out`
    /// bf16, all `[rows, cols]`.
    pub fn add_rms_norm(
        &self,
        s: StreamHandle,
        residual: Matrix,
        delta: Matrix,
        out: Matrix,
        norm: &Norm,
    ) -> GpuResult<()> {
        let p = add_norm_params("norm::add_rms_norm", residual, delta, out, norm)?;
        self.go(self.k.add_rms_norm, norm_geometry(residual.rows), &p, s)
    }

    /// `add_rms_norm` that also writes `out`'s rows as stage images at `images`, for the
    /// projection after it (`add_rms_norm_staged`; see `Ops::linear_staging`). The kernel stages
    /// on its vector path only, so unaligned operands or `cols % 8 != 0` are an error here
    /// rather than rows left unwritten.
    pub fn add_rms_norm_staged(
        &self,
        s: StreamHandle,
        (residual, delta, out): (Matrix, Matrix, Matrix),
        images: DevicePtr,
        norm: &Norm,
    ) -> GpuResult<()> {
        let kernel = "norm::add_rms_norm_staged";
        let p = add_norm_params(kernel, residual, delta, out, norm)?;
        let operands = [
            ("residual", p.residual),
            ("delta", p.delta),
            ("w", p.w),
            ("out", p.out),
            ("images", images),
        ];
        check_staged(kernel, &operands, p.cols)?;
        let p = AddRmsNormStagedParams {
            residual: p.residual,
            delta: p.delta,
            w: p.w,
            out: p.out,
            img: images,
            rows: p.rows,
            cols: p.cols,
            eps: p.eps,
            unit_offset: p.unit_offset,
        };
        self.go(self.k.add_rms_norm_staged, norm_geometry(p.rows), &p, s)
    }

    /// Per-head q/k RMSNorm and rotary embedding, in place. One warp per head, a block's warps
    /// on one row (`rope_launch`).
    pub fn qk_norm_rope(&self, s: StreamHandle, p: &QkNormRope) -> GpuResult<()> {
        let cfg = rope_launch(p, p.num_q_heads + p.num_kv_heads);
        self.go(self.k.qk_norm_rope, cfg, &p.params(), s)
    }

    /// Store each row's k and v at its slot (bf16, or with `kv_fp8` e4m3 of each over its
    /// pool's scale; scales the kernels cannot use are refused).
    pub fn kv_store(&self, s: StreamHandle, p: &KvStore) -> GpuResult<()> {
        let q = *p;
        let (fp8, k, v) = (q.kv_fp8, q.k_scale, q.v_scale);
        crate::ops_attention::check_kv_format("cache::kv_store", fp8, k, v)?;
        let cfg = step_launch(LaunchConfig::linear(p.rows, 128), p.rows);
        self.go(self.k.kv_store, cfg, p, s)
    }

    /// `out = silu(gate) * up` over rows of `[gate | up]`: `out` bf16 `[rows, ffn]`, `gate_up`
    /// bf16 `[rows, 2 * ffn]`.
    pub fn silu_mul(&self, s: StreamHandle, out: Matrix, gate_up: Matrix) -> GpuResult<()> {
        let (rows, ffn) = silu_shape("activation::silu_mul", &out, &gate_up)?;
        let p = SiluMulParams {
            out: out.ptr,
            gate_up: gate_up.ptr,
            rows,
            ffn,
        };
        self.go(self.k.silu_mul, silu_geometry(rows, ffn), &p, s)
    }

    /// `silu_mul` written as stage images at `images` for the down projection (`silu_mul_staged`;
    /// see `Ops::linear_staging`), and at decode sizes (up to `LINEAR_SMALL_M_MAX` rows) as rows
    /// at `act` too, which `linear_stream_tma` reads where it cannot take the images; prefill
    /// sizes (`linear_tma`, images only) leave `act` alone. The kernel has only a vector path, so
    /// an unaligned `gate_up` or `act` or `ffn % 8 != 0` is an error here rather than rows left
    /// unwritten.
    pub fn silu_mul_staged(
        &self,
        s: StreamHandle,
        images: DevicePtr,
        act: Matrix,
        gate_up: Matrix,
    ) -> GpuResult<()> {
        let kernel = "activation::silu_mul_staged";
        let (rows, ffn) = silu_shape(kernel, &act, &gate_up)?;
        let act = if rows <= crate::ops_gemm::LINEAR_SMALL_M_MAX {
            act.ptr
        } else {
            DevicePtr::NULL
        };
        let operands = [("images", images), ("act", act), ("gate_up", gate_up.ptr)];
        check_staged(kernel, &operands, ffn)?;
        let p = SiluMulStagedParams {
            img: images,
            act,
            gate_up: gate_up.ptr,
            rows,
            ffn,
        };
        self.go(self.k.silu_mul_staged, silu_geometry(rows, ffn), &p, s)
    }

    /// Greedy token of each row of `logits` (f32 `[rows, vocab]`) into `out` (u32 `[rows]`).
    pub fn argmax(&self, s: StreamHandle, out: DevicePtr, logits: Matrix) -> GpuResult<()> {
        let check = Operands {
            kernel: "sampling::argmax",
        };
        check.dtype("logits", &logits, DType::F32)?;
        let p = ArgmaxParams {
            out,
            logits: logits.ptr,
            rows: logits.rows,
            vocab: logits.cols,
        };
        let cfg = step_launch(LaunchConfig::linear(logits.rows, 1024), logits.rows);
        self.go(self.k.argmax, cfg, &p, s)
    }

    /// Each row of `logits` (f32 `[rows, vocab]`) through the sampler: its token (greedy or
    /// drawn), that token's logprob and the top logprobs, after the row's penalties, bias, mask,
    /// temperature, top-k, top-p and min-p (`kernels/sampling.cu`).
    pub fn sample(&self, s: StreamHandle, logits: Matrix, op: &SampleOperands) -> GpuResult<()> {
        let kernel = "sampling::sample";
        let check = Operands { kernel };
        check.dtype("logits", &logits, DType::F32)?;
        let words = logits.cols.div_ceil(32);
        let (mask, mask_words) = op.mask.unwrap_or((DevicePtr::NULL, 0));
        if op.mask.is_some() && mask_words < words {
            return Err(GpuError::BadOperand {
                kernel: kernel.to_string(),
                operand: "mask",
                problem: format!(
                    "{mask_words} words a row, a vocabulary of {} needs {words}",
                    logits.cols
                ),
            });
        }
        let p = SampleParams {
            out: op.out,
            logits: logits.ptr,
            rowp: op.rowp,
            entries: op.entries,
            mask,
            rows: logits.rows,
            vocab: logits.cols,
            num_entries: op.num_entries,
            mask_words,
        };
        // A cluster of SAMPLE_SPLITS blocks a row. Beyond the entry bitmap, room for the
        // slice's order keys where two blocks still fit a multiprocessor.
        let cached = (words + logits.cols.div_ceil(SAMPLE_SPLITS)) * 4;
        let shared = if cached <= SAMPLE_CACHE_MAX_BYTES {
            cached
        } else {
            words * 4
        };
        let cfg =
            LaunchConfig::linear(logits.rows * SAMPLE_SPLITS, SAMPLE_THREADS).with_shared(shared);
        self.go(self.k.sample, step_launch(cfg, logits.rows), &p, s)
    }

    /// `out[i] = offset + uniform(i, seed) * scale` over `n` bf16 values (benchmark weights).
    pub fn fill_uniform_bf16(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        n: u64,
        seed: u64,
        offset: f32,
        scale: f32,
    ) -> GpuResult<()> {
        let blocks = n.div_ceil(256 * 8).min(65_535 * 8) as u32;
        let p = FillUniformBf16Params {
            out,
            n,
            seed,
            offset,
            scale,
        };
        self.go(
            self.k.fill_uniform_bf16,
            LaunchConfig::linear(blocks, 256),
            &p,
            s,
        )
    }
}

/// The RMSNorm kernels' geometry: a block of `NORM_THREADS` per row; a programmatic dependent.
fn norm_geometry(rows: u32) -> LaunchConfig {
    LaunchConfig::linear(rows, NORM_THREADS).with_programmatic()
}

/// `add_rms_norm`'s parameters from checked operands.
fn add_norm_params(
    kernel: &'static str,
    residual: Matrix,
    delta: Matrix,
    out: Matrix,
    norm: &Norm,
) -> GpuResult<AddRmsNormParams> {
    let check = Operands { kernel };
    check.dtype("residual", &residual, DType::F32)?;
    check.exactly("delta", &delta, DType::Bf16, residual.shape(), "residual")?;
    check.exactly("out", &out, DType::Bf16, residual.shape(), "residual")?;
    Ok(AddRmsNormParams {
        residual: residual.ptr,
        delta: delta.ptr,
        w: norm.w,
        out: out.ptr,
        rows: residual.rows,
        cols: residual.cols,
        eps: norm.eps,
        unit_offset: norm.unit_offset as u32,
    })
}

/// `(rows, ffn)` of a SwiGLU gate from its checked operands: `out` bf16 `[rows, ffn]`,
/// `gate_up` bf16 `[rows, 2 * ffn]`.
fn silu_shape(kernel: &'static str, out: &Matrix, gate_up: &Matrix) -> GpuResult<(u32, u32)> {
    let check = Operands { kernel };
    check.dtype("out", out, DType::Bf16)?;
    let want = (out.rows, 2 * out.cols);
    check.exactly("gate_up", gate_up, DType::Bf16, want, "out")?;
    Ok(out.shape())
}

/// `silu_mul`'s (and `silu_mul_staged`'s) geometry: a row per grid row, 8-column vectors split
/// over blocks of `SILU_THREADS`; a programmatic dependent.
fn silu_geometry(rows: u32, ffn: u32) -> LaunchConfig {
    LaunchConfig::grid2(rows, ffn.div_ceil(8 * SILU_THREADS), SILU_THREADS).with_programmatic()
}

/// A staged producer's operands (`_staged` kernels stage on their 16-byte vector path only):
/// each 16-byte aligned, rows of a multiple of 8 columns; else an error naming the first that
/// is not.
fn check_staged(kernel: &str, operands: &[(&str, DevicePtr)], cols: u32) -> GpuResult<()> {
    let problem = if let Some((name, p)) = operands.iter().find(|(_, p)| !p.0.is_multiple_of(16)) {
        format!("{name} at {:#x} is not 16-byte aligned", p.0)
    } else if !cols.is_multiple_of(8) {
        format!("rows of {cols} columns are not a multiple of 8")
    } else {
        return Ok(());
    };
    Err(GpuError::KernelFailed {
        kernel: kernel.into(),
        problem,
    })
}
