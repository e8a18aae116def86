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
        /// Null, or the launch's tile counter and finished-block count (two u32, zero before
        /// the launch and after it): blocks claim tiles from it instead of walking their share.
        sched: ptr "uint32_t* __restrict__",
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

kernel_params! {
    /// `gemm::linear_stream_fp8`: `linear_stream` of a block-FP8 weight, each weight element
    /// taken as bf16(fp8 · its block's scale), so a row's output is bitwise `linear`'s on the
    /// dequantized weight (`gemm::dequant_fp8`'s).
    pub struct LinearFp8Params("LINEAR_FP8_PARAMS") {
        /// bf16 `[m, n]`.
        out: ptr "bf16* __restrict__",
        /// bf16 `[m, k]`.
        x: ptr "const bf16* __restrict__",
        /// fp8 e4m3 `[n, k]`.
        w: ptr "const uint8_t* __restrict__",
        /// f32 `[ceil(n / 2^scale_row_shift), ceil(k / FP8_BLOCK)]`: the scale of each block.
        scales: ptr "const float* __restrict__",
        /// Rows.
        m: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
        /// log2 of the weight rows one scale row covers: `FP8_BLOCK_ROW_SHIFT` (128-row blocks,
        /// the checkpoints' layout) or 0 (a scale row per weight row).
        scale_row_shift: u32,
    }
}

kernel_params! {
    /// `gemm::linear_tma_fp8`: `linear_tma` of a block-FP8 weight (prefill), each element taken
    /// as `LinearFp8Params` takes it.
    pub struct LinearTmaFp8Params("LINEAR_TMA_FP8_PARAMS") {
        /// bf16 `[m, n]`.
        out: ptr "bf16* __restrict__",
        /// The stage images of x `[m, k]`.
        xt: ptr "const bf16* __restrict__",
        /// fp8 e4m3 `[n, k]`.
        w: ptr "const uint8_t* __restrict__",
        /// f32 block scales, as `LinearFp8Params::scales`.
        scales: ptr "const float* __restrict__",
        /// w's 128-byte tensor map (bytes, 64-byte swizzle), in device memory.
        wmap: ptr "const void* __restrict__",
        /// As `LinearTmaParams::sched`.
        sched: ptr "uint32_t* __restrict__",
        /// Rows.
        m: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
        /// As `LinearFp8Params::scale_row_shift`.
        scale_row_shift: u32,
    }
}

kernel_params! {
    /// `gemm::linear_tma_swiglu`: the gate/up projection of a prefill (`linear_tma` of x's
    /// stage images by w `[2 n, k]`, gate rows then up rows, read through a tensor map of
    /// 64-row boxes) and `silu_mul_staged` after it, in one launch: the SwiGLU written only as
    /// the down projection's stage images.
    pub struct LinearTmaSwigluParams("LINEAR_TMA_SWIGLU_PARAMS") {
        /// The stage images of the SwiGLU `[m, n]`.
        img: ptr "unsigned char* __restrict__",
        /// The stage images of x `[m, k]`.
        xt: ptr "const bf16* __restrict__",
        /// bf16 `[2 n, k]`.
        w: ptr "const bf16* __restrict__",
        /// w's 128-byte tensor map (boxes of 64 k by 64 rows), in device memory.
        wmap: ptr "const void* __restrict__",
        /// As `LinearTmaParams::sched`.
        sched: ptr "uint32_t* __restrict__",
        /// Rows.
        m: u32,
        /// The SwiGLU's columns (the FFN width), a multiple of 64.
        n: u32,
        /// Inputs.
        k: u32,
    }
}

kernel_params! {
    /// `gemm::linear_tma_swiglu_fp8`: `linear_tma_swiglu` of a block-FP8 weight, each element
    /// taken as `LinearFp8Params` takes it.
    pub struct LinearTmaSwigluFp8Params("LINEAR_TMA_SWIGLU_FP8_PARAMS") {
        /// The stage images of the SwiGLU `[m, n]`.
        img: ptr "unsigned char* __restrict__",
        /// The stage images of x `[m, k]`.
        xt: ptr "const bf16* __restrict__",
        /// fp8 e4m3 `[2 n, k]`.
        w: ptr "const uint8_t* __restrict__",
        /// f32 block scales of w, as `LinearFp8Params::scales`.
        scales: ptr "const float* __restrict__",
        /// w's 128-byte tensor map (bytes, boxes of 64 k by 64 rows, 64-byte swizzle), in device
        /// memory.
        wmap: ptr "const void* __restrict__",
        /// As `LinearTmaParams::sched`.
        sched: ptr "uint32_t* __restrict__",
        /// Rows.
        m: u32,
        /// The SwiGLU's columns (the FFN width), a multiple of 64.
        n: u32,
        /// Inputs.
        k: u32,
        /// As `LinearFp8Params::scale_row_shift`.
        scale_row_shift: u32,
    }
}

kernel_params! {
    /// `gemm::linear_stream_tma_fp8`: `linear_stream_tma` of a block-FP8 weight (decode), each
    /// element taken as `LinearFp8Params` takes it.
    pub struct LinearStreamTmaFp8Params("LINEAR_STREAM_TMA_FP8_PARAMS") {
        /// bf16 `[m, n]`.
        out: ptr "bf16* __restrict__",
        /// bf16 `[m, k]`.
        x: ptr "const bf16* __restrict__",
        /// x's stage images, or null.
        ximg: ptr "const bf16* __restrict__",
        /// fp8 e4m3 `[n, k]`.
        w: ptr "const uint8_t* __restrict__",
        /// f32 block scales, as `LinearFp8Params::scales`.
        scales: ptr "const float* __restrict__",
        /// w's 128-byte tensor map (bytes, 64-byte swizzle), in device memory.
        wmap: ptr "const void* __restrict__",
        /// Rows.
        m: u32,
        /// Output columns.
        n: u32,
        /// Inputs.
        k: u32,
        /// As `LinearFp8Params::scale_row_shift`.
        scale_row_shift: u32,
    }
}

kernel_params! {
    /// `gemm::dequant_fp8`: a block-FP8 weight as bf16, bf16(fp8 · its block's scale).
    pub struct DequantFp8Params("DEQUANT_FP8_PARAMS") {
        /// bf16 `[n, k]`.
        out: ptr "bf16* __restrict__",
        /// fp8 e4m3 `[n, k]`.
        w: ptr "const uint8_t* __restrict__",
        /// f32 block scales, as `LinearFp8Params::scales`.
        scales: ptr "const float* __restrict__",
        /// Rows.
        n: u32,
        /// Columns.
        k: u32,
        /// As `LinearFp8Params::scale_row_shift`.
        scale_row_shift: u32,
    }
}

kernel_params! {
    /// `gemm::quantize_fp8`: a bf16 weight to block FP8 (blocks of `FP8_BLOCK` rows by
    /// `FP8_BLOCK` columns; scale = block amax / 448, 1 for an all-zero block; each element
    /// fp8(w / scale), rounded to nearest even, saturating at ±448).
    pub struct QuantizeFp8Params("QUANTIZE_FP8_PARAMS") {
        /// fp8 e4m3 `[n, k]`.
        out: ptr "uint8_t* __restrict__",
        /// f32 `[ceil(n / FP8_BLOCK), ceil(k / FP8_BLOCK)]`.
        scales: ptr "float* __restrict__",
        /// bf16 `[n, k]`.
        w: ptr "const bf16* __restrict__",
        /// Rows.
        n: u32,
        /// Columns.
        k: u32,
    }
}
