//! The constants the CUDA sources and the Rust launchers both depend on, defined once here:
//! `kernels/abi.cuh` has each as a `#define` of the same name, and the launchers compute their
//! grids and shared-memory sizes from these. A constant only one side uses stays on that side.

/// One shared constant, as `kernels/abi.cuh` writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedConst {
    /// Its name on both sides.
    pub name: &'static str,
    /// Its value.
    pub value: u32,
    /// Its documentation, line by line.
    pub doc: &'static [&'static str],
}

macro_rules! shared_consts {
    ($(
        #[doc = $doc:literal]
        $(#[doc = $more:literal])*
        $name:ident = $value:expr;
    )*) => {
        $(
            #[doc = $doc]
            $(#[doc = $more])*
            pub const $name: u32 = $value;
        )*

        /// Every shared constant, in the order `kernels/abi.cuh` defines them.
        pub const SHARED: &[SharedConst] = &[
            $(SharedConst { name: stringify!($name), value: $name, doc: &[$doc $(, $more)*] },)*
        ];
    };
}

shared_consts! {
    /// k per chunk of the `linear` family's reduction (one 32-wide chunk: two m16n8k16 steps).
    LIN_KC = 32;
    /// Segments k is cut into (each a chain of MMAs, summed in order); the cluster size of the
    /// cluster GEMM kernels.
    LIN_SEGS = 8;
    /// Warps of a narrow or wide decode GEMM block.
    LIN_STREAM_WARPS = 8;
    /// Columns (and, in the checkpoints' layout, rows) of one block of a block-FP8 weight,
    /// which shares one f32 scale.
    FP8_BLOCK = 128;
    /// log2 of `FP8_BLOCK`: the `scale_row_shift` of 128-row scale blocks.
    FP8_BLOCK_ROW_SHIFT = 7;
    /// Threads of a `quantize_fp8` block (one block of the weight each) and of `dequant_fp8`.
    FP8_CONVERT_THREADS = 256;
    /// Rows of the tiled prefill kernel's block tile (three consumer warpgroups of 64).
    LIN_BM = 192;
    /// Columns of the tiled prefill kernel's block tile.
    LIN_BN = 128;
    /// Threads of a tiled prefill block: a producer warpgroup and three consumers.
    LIN_THREADS = 512;
    /// Stages of the tiled prefill kernel's ring, each (LIN_BM + LIN_BN) rows of 128 bytes.
    LIN_STAGES = 5;
    /// Rows of a `linear_stream_wide` tile (four row tiles of 16).
    LIN_W_ROWS = 64;
    /// Column tiles of 8 per warp of `linear_stream_wide` (tiles of 64 LIN_W_NT columns).
    LIN_W_NT = 2;
    /// Chunks per stage of `linear_stream_wide`'s ring.
    LIN_W_STAGE_CH = 2;
    /// Stages of `linear_stream_wide`'s ring (three blocks a multiprocessor).
    LIN_W_STAGES = 3;
    /// The output tile of `linear_tma` (weight rows and x rows), and the rows of a stage image.
    LIN_TMA_TILE = 128;
    /// Stages of `linear_tma`'s ring, 32 KiB each.
    LIN_TMA_STAGES = 6;
    /// Bytes of one stage image: 128 rows by two 32-k chunks.
    LIN_TMA_IMG_BYTES = 16384;
    /// Threads of a `linear_tma` block: a warpgroup whose first thread queues the copies, two of
    /// wgmma.
    LIN_TMA_THREADS = 384;
    /// Weight rows of a `linear_stream_tma` tile (two consumer warpgroups of 64).
    LIN_DEC_COLS = 128;
    /// Most x rows a `linear_stream_tma` block holds (the largest wgmma N it instantiates).
    LIN_DEC_ROWS = 64;
    /// Shared memory `linear_stream_tma` shares out: x's segment, two buffers of partials and
    /// the ring of weight stages.
    LIN_DEC_SPACE = 229_376;
    /// Threads of a `linear_stream_tma` block: a producer warpgroup and two consumers.
    LIN_DEC_THREADS = 384;
    /// Weight stages `linear_stream_tma` needs room for; the launcher runs it only where they
    /// fit.
    LIN_DEC_MIN_STAGES = 4;
    /// Blocks of a decode attention cluster: the splits an item's context is cut into (fixed,
    /// so a row's result depends on its context alone).
    ATT_SPLITS = 8;
    /// Warps of a decode attention block (the partitions of a split).
    ATT_WARPS = 4;
    /// Units each warp of decode attention keeps in flight.
    ATT_STAGES = 2;
    /// Query slots of each decode attention warp: an item's query rows stay while its units are
    /// computed, and the ring of `ATT_STAGES` units holds units of at most two items.
    ATT_QSLOTS = 2;
    /// Most items one persistent attention cluster takes in a launch.
    ATT_MAX_ITEMS = 64;
    /// Tokens of an attention unit (the MMA tile of keys).
    ATT_UNIT = 16;
    /// Most query heads one attention item computes.
    ATT_HB = 8;
    /// Largest head dimension of the attention kernels.
    ATT_MAX_D = 256;
    /// Warps of a prefill attention block: four partitions of four.
    ATP_WARPS = 16;
    /// Most rows of a prefill attention row group (a 16-token unit).
    ATP_ROWS = 16;
    /// The slot of a padding sequence: zero state read, nothing written.
    GDN_NO_SLOT = u32::MAX;
    /// Largest Dk of the general delta-rule path.
    GDN_MAX_DK = 256;
    /// Largest Dk of the fast delta-rule path.
    GDN_FAST_MAX_DK = 128;
    /// Columns of a value head per warp of the delta-rule kernels.
    GDN_WARP_COLS = 16;
    /// Most conv taps less one that `conv_state_verify` takes: its thread keeps the old window
    /// in registers.
    GDN_MAX_CONV_HIST = 15;
    /// Tokens of each warp's prefetch ring in `gated_delta_chunked`.
    GDN_RING = 8;
    /// Bytes of `gated_delta_streamed`'s mbarriers at the start of its dynamic shared memory.
    GDN_STREAM_BARS = 64;
    /// Most head states `gated_delta_streamed` holds in shared memory at once.
    GDN_STREAM_MAX_BUFS = 4;
    /// Bytes of one token in `gated_delta_chunked`'s ring: q̂ and k̂ of up to GDN_FAST_MAX_DK
    /// f32 each, 16 v columns, β and g, padded.
    GDN_TOK_BYTES = 2 * GDN_FAST_MAX_DK * 4 + 64;
}
