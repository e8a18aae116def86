//! Parameters of the Gated DeltaNet kernels (`kernels/gdn.cu`). Head scalars as every kernel
//! takes them: `hk`, `dk`, `hv`, `dv`; `conv_dim = 2 hk dk + hv dv`, `proj_width = conv_dim +
//! hv dv + 2 hv`. The projection the kernels read holds per row q|k|v|z (`proj_stride` apart)
//! and b|a (`ba_stride` apart from `ba_offset`): one fused `[rows, proj_width]` matrix, or a
//! `[rows, conv_dim + value_dim]` matrix followed by a `[rows, 2 hv]` one.

use crate::kernel_params;

kernel_params! {
    /// `gdn::causal_conv1d`: the causal conv and SiLU over each sequence's window and rows.
    pub struct CausalConv1dParams("CAUSAL_CONV1D_PARAMS") {
        /// bf16 `[rows, conv_dim]`.
        out: ptr "bf16* __restrict__",
        /// bf16: row r's q|k|v at `r * proj_stride`.
        proj: ptr "const bf16* __restrict__",
        /// f32 `[num_slots * slot_stride]`: the conv windows.
        conv_state: ptr "const float* __restrict__",
        /// bf16 `[conv_dim, kernel_size]`.
        weight: ptr "const bf16* __restrict__",
        /// u32 `[rows]`: each row's sequence.
        row_seq: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs + 1]`: each sequence's first row.
        seq_start: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs]`: each sequence's state slot (`u32::MAX`: padding).
        seq_slot: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Sequences.
        num_seqs: u32,
        /// State slots.
        num_slots: u32,
        /// f32 elements per slot.
        slot_stride: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
        /// Conv taps.
        kernel_size: u32,
        /// Elements from one projection row's q|k|v|z to the next: `proj_width` when b and a
        /// share the row (one fused GEMM), `conv_dim + value_dim` when they lie apart.
        proj_stride: u32,
    }
}

kernel_params! {
    /// `gdn::conv_state_update`: each sequence's conv window advanced over its rows.
    pub struct ConvStateUpdateParams("CONV_STATE_UPDATE_PARAMS") {
        /// f32 `[num_slots * slot_stride]`, read and written.
        conv_state: ptr "float* __restrict__",
        /// bf16: row r's q|k|v at `r * proj_stride`.
        proj: ptr "const bf16* __restrict__",
        /// u32 `[num_seqs + 1]`.
        seq_start: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs]`.
        seq_slot: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Sequences.
        num_seqs: u32,
        /// State slots.
        num_slots: u32,
        /// f32 elements per slot.
        slot_stride: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
        /// Conv taps.
        kernel_size: u32,
        /// Elements from one projection row's q|k|v|z to the next: `proj_width` when b and a
        /// share the row (one fused GEMM), `conv_dim + value_dim` when they lie apart.
        proj_stride: u32,
    }
}

kernel_params! {
    /// `gdn::conv_state_verify`: a verify step's conv windows, the window after each row kept in
    /// that row's slot.
    pub struct ConvStateVerifyParams("CONV_STATE_VERIFY_PARAMS") {
        /// f32 `[num_slots * slot_stride]`, read and written.
        conv_state: ptr "float* __restrict__",
        /// bf16: row r's q|k|v at `r * proj_stride`.
        proj: ptr "const bf16* __restrict__",
        /// u32 `[num_seqs + 1]`.
        seq_start: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs]`.
        seq_slot: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`: where each row's window goes (`u32::MAX`: nowhere).
        row_slot: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Sequences.
        num_seqs: u32,
        /// State slots.
        num_slots: u32,
        /// f32 elements per slot.
        slot_stride: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
        /// Conv taps.
        kernel_size: u32,
        /// Elements from one projection row's q|k|v|z to the next: `proj_width` when b and a
        /// share the row (one fused GEMM), `conv_dim + value_dim` when they lie apart.
        proj_stride: u32,
    }
}

kernel_params! {
    /// `gdn::gdn_prepare`: L2-normalised q and k, and the gates β and g.
    pub struct GdnPrepareParams("GDN_PREPARE_PARAMS") {
        /// f32 `[rows, 2 hk dk]`: q̂ then k̂.
        qk: ptr "float* __restrict__",
        /// f32 `[rows, 2 hv]`: β then g.
        gates: ptr "float* __restrict__",
        /// bf16 `[rows, conv_dim]`: the conv output.
        conv: ptr "const bf16* __restrict__",
        /// bf16: row r's b at `ba_offset + r * ba_stride`, its a `hv` further.
        proj: ptr "const bf16* __restrict__",
        /// f32 `[hv]`.
        a_log: ptr "const float* __restrict__",
        /// f32 `[hv]`.
        dt_bias: ptr "const float* __restrict__",
        /// Rows.
        rows: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
        /// Epsilon of the L2 norms.
        l2_eps: f32,
        /// Scale of q̂.
        q_scale: f32,
        /// Element offset of row 0's b in `proj`: `conv_dim + value_dim` (fused) or
        /// `rows * (conv_dim + value_dim)` (b and a after the q|k|v|z rows).
        ba_offset: u32,
        /// Elements from one row's b to the next (a follows b by `hv`): `proj_width` (fused)
        /// or `2 hv`.
        ba_stride: u32,
    }
}

kernel_params! {
    /// `gdn::gated_delta_recurrent` and `gdn::gated_delta_streamed`: the delta rule over each
    /// sequence's rows, one token at a time.
    pub struct GatedDeltaParams("GATED_DELTA_PARAMS") {
        /// f32 `[rows, hv dv]`.
        out: ptr "float* __restrict__",
        /// f32 `[num_slots * slot_stride]`: the recurrent states, read and written.
        state: ptr "float* __restrict__",
        /// f32 `[rows, 2 hk dk]`.
        qk: ptr "const float* __restrict__",
        /// bf16 `[rows, conv_dim]`: v at `2 hk dk`.
        conv: ptr "const bf16* __restrict__",
        /// f32 `[rows, 2 hv]`.
        gates: ptr "const float* __restrict__",
        /// u32 `[num_seqs + 1]`.
        seq_start: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs]`.
        seq_slot: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Sequences.
        num_seqs: u32,
        /// State slots.
        num_slots: u32,
        /// f32 elements per slot.
        slot_stride: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
    }
}

kernel_params! {
    /// `gdn::gated_delta_chunked`: the delta rule of a prefill chunk, bitwise the recurrent
    /// kernel's rows (`positions` and `chunk_size` describe the chunking, which changes no bit).
    pub struct GatedDeltaChunkedParams("GATED_DELTA_CHUNKED_PARAMS") {
        /// f32 `[rows, hv dv]`.
        out: ptr "float* __restrict__",
        /// f32 `[num_slots * slot_stride]`, read and written.
        state: ptr "float* __restrict__",
        /// f32 `[rows, 2 hk dk]`.
        qk: ptr "const float* __restrict__",
        /// bf16 `[rows, conv_dim]`.
        conv: ptr "const bf16* __restrict__",
        /// f32 `[rows, 2 hv]`.
        gates: ptr "const float* __restrict__",
        /// u32 `[num_seqs + 1]`.
        seq_start: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs]`.
        seq_slot: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`.
        positions: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Sequences.
        num_seqs: u32,
        /// State slots.
        num_slots: u32,
        /// f32 elements per slot.
        slot_stride: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
        /// Chunk length of the prefill (aligned to absolute positions).
        chunk_size: u32,
    }
}

kernel_params! {
    /// `gdn::gated_delta_verify`: the delta rule of a verify step, the state after each row
    /// kept in that row's slot.
    pub struct GatedDeltaVerifyParams("GATED_DELTA_VERIFY_PARAMS") {
        /// f32 `[rows, hv dv]`.
        out: ptr "float* __restrict__",
        /// f32 `[num_slots * slot_stride]`, read and written.
        state: ptr "float* __restrict__",
        /// f32 `[rows, 2 hk dk]`.
        qk: ptr "const float* __restrict__",
        /// bf16 `[rows, conv_dim]`.
        conv: ptr "const bf16* __restrict__",
        /// f32 `[rows, 2 hv]`.
        gates: ptr "const float* __restrict__",
        /// u32 `[num_seqs + 1]`.
        seq_start: ptr "const uint32_t* __restrict__",
        /// u32 `[num_seqs]`.
        seq_slot: ptr "const uint32_t* __restrict__",
        /// u32 `[rows]`: where each row's state goes (`u32::MAX`: nowhere).
        row_slot: ptr "const uint32_t* __restrict__",
        /// Rows.
        rows: u32,
        /// Sequences.
        num_seqs: u32,
        /// State slots.
        num_slots: u32,
        /// f32 elements per slot.
        slot_stride: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
    }
}

kernel_params! {
    /// `gdn::gated_rms_norm`: the gated output norm, per (row, value head).
    pub struct GatedRmsNormParams("GATED_RMS_NORM_PARAMS") {
        /// bf16 `[rows, hv dv]`.
        out: ptr "bf16* __restrict__",
        /// f32 `[rows, hv dv]`: the delta rule's output.
        core: ptr "const float* __restrict__",
        /// bf16: row r's z at `r * proj_stride + conv_dim`.
        proj: ptr "const bf16* __restrict__",
        /// bf16 `[dv]`.
        weight: ptr "const bf16* __restrict__",
        /// Rows.
        rows: u32,
        /// Key heads.
        hk: u32,
        /// Key head dimension.
        dk: u32,
        /// Value heads.
        hv: u32,
        /// Value head dimension.
        dv: u32,
        /// Epsilon.
        eps: f32,
        /// Elements from one projection row's q|k|v|z to the next: `proj_width` when b and a
        /// share the row (one fused GEMM), `conv_dim + value_dim` when they lie apart.
        proj_stride: u32,
    }
}
