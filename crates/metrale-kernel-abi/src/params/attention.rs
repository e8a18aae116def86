//! Parameters of the paged-attention kernels (`kernels/attention.cu`).

use crate::kernel_params;

kernel_params! {
    /// `attention::paged_attention` and `attention::paged_attention_flat`: causal paged
    /// attention of decode and verify rows, one row per item.
    pub struct PagedAttentionParams("PAGED_ATTENTION_PARAMS") {
        /// bf16 `[rows, num_q_heads * head_dim]`.
        out: ptr "bf16* __restrict__",
        /// bf16 `[rows, row_stride]`: the rotated queries.
        qkv: ptr "const bf16* __restrict__",
        /// K pool `[num_slots, num_kv_heads, head_dim]`: bf16, or e4m3 bytes with `kv_fp8`.
        k_cache: ptr "const bf16* __restrict__",
        /// V pool, likewise.
        v_cache: ptr "const bf16* __restrict__",
        /// u32 `[num_seqs, max_blocks]`: block ids.
        block_tables: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`: each row's block-table row.
        row_seq: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`: each row's position.
        positions: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Elements per row of `qkv`.
        row_stride: u32,
        /// Elements from one query head to the next.
        q_head_stride: u32,
        /// Query heads.
        num_q_heads: u32,
        /// Key/value heads.
        num_kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks: u32,
        /// Rows of `block_tables`.
        num_seqs: u32,
        /// Slots per pool.
        num_slots: u32,
        /// Softmax scale.
        scale: f32,
        /// 1: each query head is followed by its output gate (`* sigmoid(gate)`).
        gated: u32,
        /// 1: the pools hold e4m3 bytes, each standing for `bf16(e4m3 * scale')`.
        kv_fp8: u32,
        /// The K pool's scale (with `kv_fp8`).
        k_scale: f32,
        /// The V pool's scale (with `kv_fp8`).
        v_scale: f32,
    }
}

kernel_params! {
    /// `attention::paged_attention_prefill` and `attention::paged_attention_prefill_staged`:
    /// `paged_attention` on the rows of row groups (a prefill chunk); the staged kernel writes
    /// the o projection's stage images at `out` instead of rows.
    pub struct PagedAttentionPrefillParams("PAGED_ATTENTION_PREFILL_PARAMS") {
        /// bf16 `[rows, num_q_heads * head_dim]`, or the stage images of it (staged).
        out: ptr "bf16* __restrict__",
        /// bf16 `[rows, row_stride]`: the rotated queries.
        qkv: ptr "const bf16* __restrict__",
        /// K pool `[num_slots, num_kv_heads, head_dim]`: bf16, or e4m3 bytes with `kv_fp8`.
        k_cache: ptr "const bf16* __restrict__",
        /// V pool, likewise.
        v_cache: ptr "const bf16* __restrict__",
        /// u32 `[num_seqs, max_blocks]`: block ids.
        block_tables: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`: each row's block-table row.
        row_seq: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`: each row's position.
        positions: ptr "const uint32_t* __restrict__",
        /// u32 `[n_groups, 2]`: (first row, rows) of each row group.
        row_groups: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Elements per row of `qkv`.
        row_stride: u32,
        /// Elements from one query head to the next.
        q_head_stride: u32,
        /// Query heads.
        num_q_heads: u32,
        /// Key/value heads.
        num_kv_heads: u32,
        /// Head dimension.
        head_dim: u32,
        /// Tokens per cache block.
        block_size: u32,
        /// Columns of `block_tables`.
        max_blocks: u32,
        /// Rows of `block_tables`.
        num_seqs: u32,
        /// Slots per pool.
        num_slots: u32,
        /// Softmax scale.
        scale: f32,
        /// 1: each query head is followed by its output gate.
        gated: u32,
        /// Row groups.
        n_groups: u32,
        /// 1: the pools hold e4m3 bytes, each standing for `bf16(e4m3 * scale')`.
        kv_fp8: u32,
        /// The K pool's scale (with `kv_fp8`).
        k_scale: f32,
        /// The V pool's scale (with `kv_fp8`).
        v_scale: f32,
    }
}
