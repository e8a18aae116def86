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
    /// Chunks per stage of `linear_stream_wide_fp8`'s ring.
    LIN_WF_STAGE_CH = 2;
    /// Stages of `linear_stream_wide_fp8`'s ring (16 KiB each: the weight's bytes take half a
    /// bf16 stage's; three blocks a multiprocessor).
    LIN_WF_STAGES = 4;
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
    /// Warps of a decode attention block (the chains of a split, one a warp).
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
    /// Warps of a prefill attention block: one 16-row tile each (half a tile's output
    /// dimensions each at head dimension 256).
    ATP_WARPS = 4;
    /// Elements of a prefill attention thread's folded numerators in shared memory (its share
    /// of a tile's output fragment, at most 64).
    ATP_FOLD = 64;
    /// Most rows of a prefill attention row group (a 16-token unit).
    ATP_ROWS = 16;
    /// Threads of a `paged_attention_prompt` block: a copying warpgroup and two computing.
    APR_THREADS = 384;
    /// Keys of a `paged_attention_prompt` softmax step (a tile).
    APR_TILE = 64;
    /// Tiles of keys and values in a `paged_attention_prompt` block's ring.
    APR_STAGES = 6;
    /// Most rows of a prompt row group (one tile of positions).
    APR_ROWS = 64;
    /// The head dimension `paged_attention_prompt` takes.
    APR_D = 128;
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
    /// Threads of a `sample` block.
    SAMPLE_THREADS = 512;
    /// Blocks of a `sample` row: the row's cluster, each block a contiguous slice of the
    /// vocabulary.
    SAMPLE_SPLITS = 8;
    /// Most top logprobs a row of `sample` reports.
    SAMPLE_TOP_MAX = 20;
    /// u32 words of a row's parameters in `sample`'s `rowp` (the `SAMPLE_R_*` offsets).
    SAMPLE_ROW_WORDS = 16;
    /// `rowp` word: the flags (`SAMPLE_F_*`).
    SAMPLE_R_FLAGS = 0;
    /// `rowp` word: the temperature (f32 bits, > 0 unless the row is greedy).
    SAMPLE_R_TEMPERATURE = 1;
    /// `rowp` word: top-k (u32; 0 keeps every token).
    SAMPLE_R_TOP_K = 2;
    /// `rowp` word: top-p (f32 bits, in (0, 1]; 1 keeps every token).
    SAMPLE_R_TOP_P = 3;
    /// `rowp` word: min-p (f32 bits, in [0, 1]; 0 keeps every token).
    SAMPLE_R_MIN_P = 4;
    /// `rowp` word: the repetition penalty (f32 bits, > 0; 1 is none).
    SAMPLE_R_REPETITION = 5;
    /// `rowp` word: the presence penalty (f32 bits; 0 is none).
    SAMPLE_R_PRESENCE = 6;
    /// `rowp` word: the frequency penalty (f32 bits; 0 is none).
    SAMPLE_R_FREQUENCY = 7;
    /// `rowp` word: how many top logprobs to report (u32, at most `SAMPLE_TOP_MAX`).
    SAMPLE_R_NUM_TOP = 8;
    /// `rowp` word: the low half of the row's seed.
    SAMPLE_R_SEED_LO = 9;
    /// `rowp` word: the high half of the row's seed.
    SAMPLE_R_SEED_HI = 10;
    /// `rowp` word: the row's draw counter (the index of the token it samples).
    SAMPLE_R_COUNTER = 11;
    /// `rowp` word: the row's first entry in `entries`.
    SAMPLE_R_ENTRY_START = 12;
    /// `rowp` word: the row's entries (sorted by token id, each token at most once).
    SAMPLE_R_ENTRY_COUNT = 13;
    /// Row flag: pick the most likely token after the penalties, bias and mask (temperature 0
    /// or top-k 1).
    SAMPLE_F_GREEDY = 1;
    /// Row flag: only the tokens the row's allowed-token bitmask sets may be picked.
    SAMPLE_F_MASK = 2;
    /// u32 words of one entry of `sample`'s `entries`: token id, count and flags, bias bits.
    SAMPLE_ENTRY_WORDS = 3;
    /// Entry flag: the token is in the prompt (the repetition penalty applies).
    SAMPLE_E_PROMPT = 0x8000_0000;
    /// Entry flag: the token may not be picked (`min_tokens` holding back EOS and stop ids).
    SAMPLE_E_BAN = 0x4000_0000;
    /// The bits of an entry's second word that count the token in the output.
    SAMPLE_E_COUNT_MASK = 0x3FFF_FFFF;
    /// u32 words of a row of `sample`'s output: the token, its logprob (f32 bits), then
    /// `SAMPLE_TOP_MAX` top token ids and `SAMPLE_TOP_MAX` their logprobs.
    SAMPLE_OUT_WORDS = 2 + 2 * SAMPLE_TOP_MAX;
    /// Fraction bits of the fixed-point probability masses top-p sums (integer sums: exact and
    /// order-free).
    SAMPLE_MASS_BITS = 40;
}
