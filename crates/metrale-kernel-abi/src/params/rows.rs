//! Parameters of the row-wise kernels: embedding and row gathers, the norms, rotary embedding,
//! the cache store, the SwiGLU gate, argmax and the random fill.

use crate::kernel_params;

kernel_params! {
    /// `embed::embedding_gather`: `out[r] = table[ids[r] - row_start]` widened to f32 where
    /// the table holds that id's row, zeros where it does not (a vocabulary-parallel rank's
    /// slice of the embedding).
    pub struct EmbeddingGatherParams("EMBEDDING_GATHER_PARAMS") {
        /// f32 `[rows, hidden]`.
        out: ptr "float* __restrict__",
        /// bf16 `[table_rows, hidden]`: vocabulary rows `row_start ..`.
        table: ptr "const bf16* __restrict__",
        /// u32 `[rows]`, each below `vocab`.
        ids: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns.
        hidden: u32,
        /// The whole vocabulary: an id past it is a fault.
        vocab: u32,
        /// The vocabulary row `table`'s first row is (0 for a whole table).
        row_start: u32,
        /// Rows of `table` (`vocab` for a whole table).
        table_rows: u32,
    }
}

kernel_params! {
    /// `embed::gather_rows`: `out[i] = x[row_ids[i]]`.
    pub struct GatherRowsParams("GATHER_ROWS_PARAMS") {
        /// bf16 `[n, cols]`.
        out: ptr "bf16* __restrict__",
        /// bf16 `[src_rows, cols]`.
        x: ptr "const bf16* __restrict__",
        /// u32 `[n]`, each below `src_rows`.
        row_ids: ptr "const uint32_t* __restrict__",
        /// Rows gathered.
        n: u32,
        /// Columns.
        cols: u32,
        /// Rows of `x`.
        src_rows: u32,
    }
}

kernel_params! {
    /// `embed::round_bf16`: `out[i] = bf16(x[i])`, rounded to nearest even (an all-reduce's
    /// f32 sums written as the bf16 activation).
    pub struct RoundBf16Params("ROUND_BF16_PARAMS") {
        /// bf16 `[n]`.
        out: ptr "bf16* __restrict__",
        /// f32 `[n]`.
        x: ptr "const float* __restrict__",
        /// Elements.
        n: u32,
    }
}

kernel_params! {
    /// `norm::rms_norm`: `out = rms_norm(x) * w` (or `* (1 + w)` with `unit_offset`).
    pub struct RmsNormParams("RMS_NORM_PARAMS") {
        /// bf16 `[rows, cols]`.
        out: ptr "bf16* __restrict__",
        /// f32 `[rows, cols]`.
        x: ptr "const float* __restrict__",
        /// bf16 `[cols]`.
        w: ptr "const bf16* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns.
        cols: u32,
        /// Epsilon.
        eps: f32,
        /// 1: the zero-centred weight `1 + w`.
        unit_offset: u32,
    }
}

kernel_params! {
    /// `norm::add_rms_norm`: `residual += delta`, then `out = rms_norm(residual) * w`.
    pub struct AddRmsNormParams("ADD_RMS_NORM_PARAMS") {
        /// f32 `[rows, cols]`, read and written.
        residual: ptr "float* __restrict__",
        /// bf16 `[rows, cols]`.
        delta: ptr "const bf16* __restrict__",
        /// bf16 `[cols]`.
        w: ptr "const bf16* __restrict__",
        /// bf16 `[rows, cols]`.
        out: ptr "bf16* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns.
        cols: u32,
        /// Epsilon.
        eps: f32,
        /// 1: the zero-centred weight `1 + w`.
        unit_offset: u32,
    }
}

kernel_params! {
    /// `norm::add_rms_norm_staged`: `add_rms_norm`, its output rows also written as the next
    /// projection's stage images.
    pub struct AddRmsNormStagedParams("ADD_RMS_NORM_STAGED_PARAMS") {
        /// f32 `[rows, cols]`, read and written.
        residual: ptr "float* __restrict__",
        /// bf16 `[rows, cols]`.
        delta: ptr "const bf16* __restrict__",
        /// bf16 `[cols]`.
        w: ptr "const bf16* __restrict__",
        /// bf16 `[rows, cols]`.
        out: ptr "bf16* __restrict__",
        /// The stage images of `[rows, cols]`.
        img: ptr "bf16* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns, a multiple of 8.
        cols: u32,
        /// Epsilon.
        eps: f32,
        /// 1: the zero-centred weight `1 + w`.
        unit_offset: u32,
    }
}

kernel_params! {
    /// `rope::qk_norm_rope`: per-head q/k RMSNorm (none with null weights) and rotary
    /// embedding, in place.
    pub struct QkNormRopeParams("QK_NORM_ROPE_PARAMS") {
        /// bf16 `[rows, row_stride]`: q heads, then k heads at `k_offset`.
        qkv: ptr "bf16* __restrict__",
        /// bf16 `[head_dim]` or null.
        q_norm_w: ptr "const bf16* __restrict__",
        /// bf16 `[head_dim]` or null.
        k_norm_w: ptr "const bf16* __restrict__",
        /// f32 `[rotary_dim / 2]`.
        inv_freq: ptr "const float* __restrict__",
        /// u32 `[rows]`.
        positions: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Elements per row of `qkv`.
        row_stride: u32,
        /// Query heads.
        num_q_heads: u32,
        /// Elements from one query head to the next.
        q_head_stride: u32,
        /// Element offset of the first key head.
        k_offset: u32,
        /// Key heads.
        num_kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
        /// Rotated dimensions per head.
        rotary_dim: u32,
        /// Factor on every cos and sin (YaRN's attention factor; exactly 1 otherwise).
        attention_scaling: f32,
        /// Norm epsilon.
        eps: f32,
        /// 1: zero-centred norm weights.
        unit_offset: u32,
    }
}

kernel_params! {
    /// `rope::qk_norm_rope_kv_store`: `qk_norm_rope`, then `kv_store` of the rotated keys and the
    /// values, in one launch.
    pub struct QkNormRopeKvStoreParams("QK_NORM_ROPE_KV_STORE_PARAMS") {
        /// bf16 `[rows, row_stride]`.
        qkv: ptr "bf16* __restrict__",
        /// bf16 `[head_dim]` or null.
        q_norm_w: ptr "const bf16* __restrict__",
        /// bf16 `[head_dim]` or null.
        k_norm_w: ptr "const bf16* __restrict__",
        /// f32 `[rotary_dim / 2]`.
        inv_freq: ptr "const float* __restrict__",
        /// u32 `[rows]`.
        positions: ptr "const uint32_t* __restrict__",
        /// K pool `[num_slots, num_kv_heads, head_dim]`: bf16, or e4m3 bytes with `kv_fp8`.
        k_cache: ptr "bf16* __restrict__",
        /// V pool, likewise.
        v_cache: ptr "bf16* __restrict__",
        /// u32 `[rows]`: each row's slot (`u32::MAX`: none).
        slot_mapping: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Elements per row of `qkv`.
        row_stride: u32,
        /// Query heads.
        num_q_heads: u32,
        /// Elements from one query head to the next.
        q_head_stride: u32,
        /// Element offset of the first key head.
        k_offset: u32,
        /// Element offset of the first value head.
        v_offset: u32,
        /// Key/value heads.
        num_kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
        /// Rotated dimensions per head.
        rotary_dim: u32,
        /// Factor on every cos and sin (YaRN's attention factor; exactly 1 otherwise).
        attention_scaling: f32,
        /// Norm epsilon.
        eps: f32,
        /// 1: zero-centred norm weights.
        unit_offset: u32,
        /// Slots per pool.
        num_slots: u32,
        /// 1: store e4m3 bytes, `e4m3(value / scale)` (round to nearest even, saturated at
        /// ±448).
        kv_fp8: u32,
        /// The K pool's scale (with `kv_fp8`).
        k_scale: f32,
        /// The V pool's scale (with `kv_fp8`).
        v_scale: f32,
    }
}

kernel_params! {
    /// `cache::kv_store`: each row's k and v copied to its cache slot.
    pub struct KvStoreParams("KV_STORE_PARAMS") {
        /// K pool `[num_slots, num_kv_heads, head_dim]`: bf16, or e4m3 bytes with `kv_fp8`.
        k_cache: ptr "bf16* __restrict__",
        /// V pool, likewise.
        v_cache: ptr "bf16* __restrict__",
        /// bf16 `[rows, row_stride]`.
        qkv: ptr "const bf16* __restrict__",
        /// u32 `[rows]`: each row's slot (`u32::MAX`: a padding row, nothing written).
        slot_mapping: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Elements per row of `qkv`.
        row_stride: u32,
        /// Element offset of k in a row.
        k_offset: u32,
        /// Element offset of v in a row.
        v_offset: u32,
        /// Key/value heads.
        num_kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
        /// Slots per pool.
        num_slots: u32,
        /// 1: store e4m3 bytes, `e4m3(value / scale)` (round to nearest even, saturated at
        /// ±448).
        kv_fp8: u32,
        /// The K pool's scale (with `kv_fp8`).
        k_scale: f32,
        /// The V pool's scale (with `kv_fp8`).
        v_scale: f32,
    }
}

kernel_params! {
    /// `activation::silu_mul`: `out = silu(gate) * up` over rows of `[gate | up]`.
    pub struct SiluMulParams("SILU_MUL_PARAMS") {
        /// bf16 `[rows, ffn]`.
        out: ptr "bf16* __restrict__",
        /// bf16 `[rows, 2 * ffn]`.
        gate_up: ptr "const bf16* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns of `out`.
        ffn: u32,
    }
}

kernel_params! {
    /// `activation::silu_mul_staged`: `silu_mul` written as the down projection's stage images,
    /// and as rows where `act` is given.
    pub struct SiluMulStagedParams("SILU_MUL_STAGED_PARAMS") {
        /// The stage images of `[rows, ffn]`.
        img: ptr "bf16* __restrict__",
        /// bf16 `[rows, ffn]` or null.
        act: ptr "bf16* __restrict__",
        /// bf16 `[rows, 2 * ffn]`.
        gate_up: ptr "const bf16* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns of the output, a multiple of 8.
        ffn: u32,
    }
}

kernel_params! {
    /// `sampling::argmax`: the lowest index of each row's maximum (NaN never wins).
    pub struct ArgmaxParams("ARGMAX_PARAMS") {
        /// u32 `[rows]`.
        out: ptr "uint32_t* __restrict__",
        /// f32 `[rows, vocab]`.
        logits: ptr "const float* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns.
        vocab: u32,
    }
}

kernel_params! {
    /// `sampling::sample`: each row's token (greedy or drawn), its logprob and the top logprobs,
    /// after penalties, logit bias, an allowed-token mask, temperature, top-k, top-p and min-p.
    pub struct SampleParams("SAMPLE_PARAMS") {
        /// u32 `[rows, SAMPLE_OUT_WORDS]`.
        out: ptr "uint32_t* __restrict__",
        /// f32 `[rows, vocab]`: the model's logits (read only).
        logits: ptr "const float* __restrict__",
        /// u32 `[rows, SAMPLE_ROW_WORDS]`: each row's parameters (`SAMPLE_R_*`).
        rowp: ptr "const uint32_t* __restrict__",
        /// u32 `[entries, SAMPLE_ENTRY_WORDS]`: penalised, biased or banned tokens of every row.
        entries: ptr "const uint32_t* __restrict__",
        /// u32 `[rows, mask_words]` allowed-token bitmasks, or null when no row has one.
        mask: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Columns.
        vocab: u32,
        /// Entries in `entries` (every row's range must lie inside).
        num_entries: u32,
        /// u32 words of one row of `mask`: at least `ceil(vocab / 32)`.
        mask_words: u32,
    }
}

kernel_params! {
    /// `init::fill_uniform_bf16`: `out[i] = offset + uniform(i, seed) * scale`.
    pub struct FillUniformBf16Params("FILL_UNIFORM_BF16_PARAMS") {
        /// bf16 `[n]`.
        out: ptr "bf16* __restrict__",
        /// Elements.
        n: u64,
        /// Seed of the counter-based hash.
        seed: u64,
        /// Centre of the range.
        offset: f32,
        /// Half-width of the range.
        scale: f32,
    }
}
