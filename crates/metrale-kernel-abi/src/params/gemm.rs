//! Parameters of the `linear` family (`kernels/gemm.cu`): `out[m, n] = x[m, k] · w[n, k]ᵀ`,
//! bf16 operands, the output bf16 or f32 (`OutT`).

use crate::kernel_params;

kernel_params! {
    /// `gemm::linear` and its direct-load variants (`linear_stream`, `linear_stream_b4`,
    /// `linear_stream_wide`, each also `_f32out`), and `gemm::linear_swiglu` (w `[2 n, k]`: gate
    /// rows then up rows; out `silu(gate) * up`).
    pub struct LinearParams("LINEAR_PARAMS") {
        /// `[m, n]`, bf16 or f32.
        out: ptr "OutT* __restrict__",
        /// bf16 `[m, k]`.
        x: ptr "const bf16* __restrict__",
        /// bf16 `[n, k]`.
        w: ptr "const bf16* __restrict__",
        /// Rows.
        m: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
    }
}

kernel_params! {
    /// `gemm::permute_k32_tiles`: x written as the stage images `linear_tma` copies whole.
    pub struct PermuteK32TilesParams("PERMUTE_K32_TILES_PARAMS") {
        /// The stage images of `[m, k]`.
        out: ptr "bf16* __restrict__",
        /// bf16 `[m, k]`.
        x: ptr "const bf16* __restrict__",
        /// Rows.
        m: u32,
        /// Columns, a multiple of 8.
        k: u32,
    }
}

kernel_params! {
    /// `gemm::linear_tma` and `gemm::linear_tma_f32out`: `linear` of x's stage images, the
    /// weight read through its tensor map (prefill).
    pub struct LinearTmaParams("LINEAR_TMA_PARAMS") {
        /// `[m, n]`, bf16 or f32.
        out: ptr "OutT* __restrict__",
        /// The stage images of x `[m, k]`.
        xt: ptr "const bf16* __restrict__",
        /// bf16 `[n, k]`.
        w: ptr "const bf16* __restrict__",
        /// w's 128-byte tensor map, in device memory.
        wmap: ptr "const void* __restrict__",
        /// Rows.
        m: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
    }
}

kernel_params! {
    /// `gemm::linear_stream_tma` and `gemm::linear_stream_tma_f32out`: `linear` at decode sizes,
    /// the weight through its tensor map, x from its rows or its stage images.
    pub struct LinearStreamTmaParams("LINEAR_STREAM_TMA_PARAMS") {
        /// `[m, n]`, bf16 or f32.
        out: ptr "OutT* __restrict__",
        /// bf16 `[m, k]`.
        x: ptr "const bf16* __restrict__",
        /// x's stage images, or null.
        ximg: ptr "const bf16* __restrict__",
        /// bf16 `[n, k]`.
        w: ptr "const bf16* __restrict__",
        /// w's 128-byte tensor map, in device memory.
        wmap: ptr "const void* __restrict__",
        /// Rows.
        m: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
    }
}
