//! Which `linear` kernel serves a call and its launch geometry, from the constants the kernels
//! share with the launchers (`metrale-kernel-abi`): pure functions of the shape (and, for
//! `linear_stream_tma`, the resident clusters), which the launchers in the parent module and
//! the GPU tests share.

use metrale_gpu_runtime::LaunchConfig;
use metrale_kernel_abi::{
    LIN_BM, LIN_BN, LIN_DEC_COLS, LIN_DEC_MIN_STAGES, LIN_DEC_ROWS, LIN_DEC_SPACE, LIN_DEC_THREADS,
    LIN_KC, LIN_SEGS, LIN_STAGES, LIN_STREAM_WARPS, LIN_THREADS, LIN_TMA_STAGES, LIN_TMA_THREADS,
    LIN_TMA_TILE, LIN_W_NT, LIN_W_ROWS, LIN_W_STAGE_CH, LIN_W_STAGES, LIN_WF_STAGE_CH,
    LIN_WF_STAGES,
};

/// Dynamic shared memory of `linear_tma`: `LIN_TMA_STAGES` stages of (128 weight rows and 128
/// x rows of 128 bytes), 1 KiB to align them to the swizzle atoms and 1 KiB for the mbarriers.
pub(super) const LINEAR_TMA_SMEM: u32 = LIN_TMA_STAGES * 2 * LIN_TMA_TILE * 128 + 2048;

/// Largest `m` that `linear` serves with its decode kernels (`linear_stream` up to
/// `LINEAR_NARROW_M_MAX`, `linear_stream_wide` or `linear_stream_tma` above); above it the
/// prefill kernels run. All give bitwise the same rows.
pub const LINEAR_SMALL_M_MAX: u32 = 128;

/// Largest `m` that `linear_stream` (one row tile per unit) serves.
pub const LINEAR_NARROW_M_MAX: u32 = 16;

/// `linear_stream_b4` serves m <= 16 from this many output columns up (qkv, gate/up, the GDN
/// input, LM heads), `linear_stream` below (o, down). Both are persistent: on the wide
/// projections the smaller batches of three blocks a multiprocessor keep more weight loads in
/// flight, on the narrow ones the two larger blocks do (docs/BENCHMARKS.md has the whole-step
/// comparison).
const LINEAR_B4_MIN_N: u32 = 6144;

/// Blocks of the narrow kernels assumed resident where the backend reports none (the CPU, which
/// runs a launch's blocks in turn: any count gives the same rows): the H200's two a
/// multiprocessor.
pub(super) const LINEAR_NARROW_RESIDENT: u32 = 264;

/// The `linear` kernels: which one serves `m` rows is [`linear_path`]'s choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinearPath {
    /// `linear_stream` (persistent blocks taking units of 8 columns by 16 rows).
    Narrow,
    /// `linear_stream_b4`: `linear_stream` with smaller batches, three blocks per
    /// multiprocessor (m <= 16 on projections of 6144 columns or more).
    NarrowB4,
    /// `linear_stream_wide` (a cluster of 8 blocks per 128 columns by 64 rows).
    Wide,
    /// `linear` (the tiled prefill kernel: warp-specialized wgmma).
    Tiled,
}

/// The kernel the launchers run for `m` rows and `n` output columns.
pub fn linear_path(m: u32, n: u32) -> LinearPath {
    if m <= LINEAR_NARROW_M_MAX && n >= LINEAR_B4_MIN_N {
        LinearPath::NarrowB4
    } else if m <= LINEAR_NARROW_M_MAX {
        LinearPath::Narrow
    } else if m <= LINEAR_SMALL_M_MAX {
        LinearPath::Wide
    } else {
        LinearPath::Tiled
    }
}

/// Threads of a narrow or wide kernel's block.
pub const LINEAR_NARROW_THREADS: u32 = LIN_STREAM_WARPS * 32;

/// Dynamic shared memory of `linear_stream_wide`: `LIN_W_STAGES` stages of `LIN_W_STAGE_CH`
/// chunks of (128 weight + 64 x) rows of 64 bytes (the segment partials reuse the ring at the
/// end).
const LINEAR_WIDE_SMEM: u32 = LIN_W_STAGES * LIN_W_STAGE_CH * (64 * LIN_W_NT + LIN_W_ROWS) * 64;

/// Dynamic shared memory of `linear_stream_wide_fp8`: `LIN_WF_STAGES` stages of
/// `LIN_WF_STAGE_CH` chunks of 128 weight rows of 32 bytes and 64 x rows of 64 bytes (the
/// segment partials, 32 KiB, reuse the ring at the end).
const LINEAR_WIDE_FP8_SMEM: u32 =
    LIN_WF_STAGES * LIN_WF_STAGE_CH * (64 * LIN_W_NT * 32 + LIN_W_ROWS * 64);

/// Dynamic shared memory of `linear`: a ring of `LIN_STAGES` stages of (`LIN_BM` x + `LIN_BN`
/// weight) rows of 128 bytes (2 chunks), 1 KiB to align it to the swizzle atoms and 1 KiB for
/// its mbarriers.
const LINEAR_TILED_SMEM: u32 = LIN_STAGES * (LIN_BM + LIN_BN) * 128 + 2048;

/// `linear`'s geometry, mirroring `kernels/gemm.cu` (every path launched as programmatic
/// dependents: each kernel waits for the one before it in-kernel, and the decode kernels load
/// their first weight fragments before that wait):
/// - `linear_stream` and `linear_stream_b4` (m <= 16, n >= 6144): persistent blocks of 256
///   threads taking units of 8 columns by 16 rows in turn, as many as are resident
///   (`resident`: two and three a multiprocessor) or as there are units; no dynamic shared
///   memory. `resident` is ignored on the other paths.
/// - `linear_stream_wide` (m <= 128): tiles of 128 columns by 64 rows, a cluster of
///   `LIN_SEGS` blocks of 256 threads (one per k segment, compiled into the kernel) per tile.
/// - `linear`: `LIN_BM` x `LIN_BN` output tiles, grid (ceil(n / 128), ceil(m / 192)),
///   `LIN_THREADS` threads (a producer warpgroup filling the ring and three warpgroups of
///   wgmma), one block per multiprocessor.
///
/// Every kernel computes the whole function at any `m` with its own geometry (the tests run
/// each of them at every m, the narrow ones on 1, 3 and all resident blocks). `linear_tma`'s
/// geometry is [`linear_tma_geometry`].
pub fn linear_geometry(path: LinearPath, m: u32, n: u32, resident: u32) -> LaunchConfig {
    let config = match path {
        LinearPath::Narrow | LinearPath::NarrowB4 => {
            let units = n.div_ceil(8) * m.div_ceil(16);
            LaunchConfig::grid2(units.min(resident.max(1)), 1, LINEAR_NARROW_THREADS)
        }
        LinearPath::Wide => {
            let tiles = n.div_ceil(64 * LIN_W_NT) * m.div_ceil(LIN_W_ROWS);
            LaunchConfig::grid2(LIN_SEGS * tiles, 1, LINEAR_NARROW_THREADS)
                .with_shared(LINEAR_WIDE_SMEM)
        }
        LinearPath::Tiled => {
            LaunchConfig::grid2(n.div_ceil(LIN_BN), m.div_ceil(LIN_BM), LIN_THREADS)
                .with_shared(LINEAR_TILED_SMEM)
        }
    };
    config.with_programmatic()
}

/// `linear_stream_wide_fp8`'s geometry: `linear_stream_wide`'s grid and block, its own ring.
pub fn linear_wide_fp8_geometry(m: u32, n: u32) -> LaunchConfig {
    linear_geometry(LinearPath::Wide, m, n, 0).with_shared(LINEAR_WIDE_FP8_SMEM)
}

/// `linear_tma`'s geometry (after `permute_k32_tiles`): `resident` blocks (all a tile where
/// fewer are, or where `resident` is 0), block b taking the 128 x 128 tiles b, b + blocks, ...
/// with the row tiles innermost, so the blocks running together share a weight tile and a block
/// queues its next tile's stages while it stores the last one's outputs; `LIN_TMA_THREADS`
/// threads (a warpgroup whose first thread queues the copies, two of wgmma);
/// `LINEAR_TMA_SMEM` of dynamic shared memory; a programmatic dependent like `linear`.
pub fn linear_tma_geometry(m: u32, n: u32, resident: u32) -> LaunchConfig {
    let tiles = m.div_ceil(LIN_TMA_TILE) * n.div_ceil(LIN_TMA_TILE);
    let blocks = if resident == 0 {
        tiles
    } else {
        tiles.min(resident)
    };
    LaunchConfig::grid2(blocks, 1, LIN_TMA_THREADS)
        .with_shared(LINEAR_TMA_SMEM)
        .with_programmatic()
}

/// Dynamic shared memory of `linear_tma_swiglu`: `linear_tma`'s and the 32 KiB exchange of a
/// tile's gate and up values (bf16, 128 rows by 64 columns each).
pub(super) const LINEAR_TMA_SWIGLU_SMEM: u32 = LINEAR_TMA_SMEM + 2 * LIN_TMA_TILE * 128;

/// `linear_tma_swiglu`'s geometry for `m` rows and a SwiGLU of `ffn` (a multiple of 64)
/// columns: `linear_tma`'s over tiles of 128 rows by 64 gate and the same 64 up columns, with
/// `LINEAR_TMA_SWIGLU_SMEM`.
pub fn linear_tma_swiglu_geometry(m: u32, ffn: u32, resident: u32) -> LaunchConfig {
    linear_tma_geometry(m, 2 * ffn, resident).with_shared(LINEAR_TMA_SWIGLU_SMEM)
}

/// Rows `linear_stream_tma` serves from: at 8 rows and below the narrow kernels, which can start
/// on a multiprocessor beside the kernel ahead, are faster in a chain of projections ...
pub const LINEAR_STREAM_TMA_M_MIN: u32 = 9;

/// The most x rows one of its blocks holds (`LIN_DEC_ROWS`: the largest wgmma N it
/// instantiates); more rows go in row blocks ...
pub const LINEAR_STREAM_TMA_M_MAX: u32 = LIN_DEC_ROWS;

/// ... up to here (at 65..128 rows the wide kernel reaches a quarter of the read stream, which
/// row blocks of the weight-map kernel multiply from L2) ...
pub const LINEAR_STREAM_TMA_SERVE_MAX: u32 = 128;

/// ... in at most this many row blocks: every block after the first multiplies the weight from
/// L2 as the first brings it, each in its own clusters.
const LINEAR_STREAM_TMA_MAX_ROW_BLOCKS: u32 = 4;

/// Its dynamic shared memory: `LIN_DEC_SPACE`, 1 KiB to align it to the swizzle atoms and 1 KiB
/// for the mbarriers (one block a multiprocessor).
pub(super) const LINEAR_STREAM_TMA_SMEM: u32 = LIN_DEC_SPACE + 2048;

/// Threads of a `linear_stream_tma` block: a producer warpgroup and two consumers.
pub(super) const LINEAR_STREAM_TMA_THREADS: u32 = LIN_DEC_THREADS;

/// Clusters of `linear_stream_tma` assumed resident where the backend reports none (the CPU,
/// which runs a launch's blocks in turn: any count gives the same rows).
pub(super) const LINEAR_STREAM_TMA_CLUSTERS: u32 = 16;

/// Bytes of one of its weight stages: `LIN_DEC_COLS` weight rows by 64 k.
const LINEAR_STREAM_TMA_STAGE_BYTES: u64 = LIN_DEC_COLS as u64 * 128;

/// Whether `linear_stream_tma` serves `m` rows by `k` inputs: `m` in
/// [`LINEAR_STREAM_TMA_M_MIN`]..=[`LINEAR_STREAM_TMA_SERVE_MAX`], and x's rows in at most
/// `LINEAR_STREAM_TMA_MAX_ROW_BLOCKS` row blocks ([`linear_stream_tma_rows`]). Qwen3-8B: every
/// projection; the down projection's 12288 inputs in blocks of 32 rows, the others in blocks of
/// 64.
pub fn linear_stream_tma_fits(m: u32, k: u32) -> bool {
    linear_stream_tma_row_blocks(m, k).is_some()
}

/// The row blocks `linear_stream_tma` runs `m` rows by `k` inputs in, where it serves them
/// ([`linear_stream_tma_fits`]).
pub(super) fn linear_stream_tma_row_blocks(m: u32, k: u32) -> Option<u32> {
    let (_, blocks) = linear_stream_tma_rows(m, k)?;
    ((LINEAR_STREAM_TMA_M_MIN..=LINEAR_STREAM_TMA_SERVE_MAX).contains(&m)
        && blocks <= LINEAR_STREAM_TMA_MAX_ROW_BLOCKS)
        .then_some(blocks)
}

/// Rows from which decode projections take x from stage images its producer writes: below it
/// the producer's scattered image stores cost more than the bulk copies save.
pub const LINEAR_STREAM_TMA_IMAGES_M_MIN: u32 = 17;

/// Whether `linear_stream_tma` serves `m` rows by `k` inputs ([`linear_stream_tma_fits`]) and
/// takes x from stage images there: from [`LINEAR_STREAM_TMA_IMAGES_M_MIN`] rows, `k` a multiple
/// of 64 and every k segment (`LIN_SEGS` of ceil(k / 32 / 8) chunks of 32) whole stages of two
/// chunks, so a block's segment is its stages' images, each one bulk copy
/// (kernels/gemm_wgmma.cuh `linear_dec_body`). Qwen3-8B: every projection (4096 and 12288
/// inputs).
pub fn linear_stream_tma_takes_images(m: u32, k: u32) -> bool {
    m >= LINEAR_STREAM_TMA_IMAGES_M_MIN
        && linear_stream_tma_fits(m, k)
        && segments_are_whole_stages(k)
}

/// The kernel's own test for taking x from images at `k` inputs, whatever the rows: `k` a
/// multiple of 64 and every k segment an even number of 32-k chunks.
pub fn segments_are_whole_stages(k: u32) -> bool {
    k.is_multiple_of(2 * LIN_KC) && (k / LIN_KC).div_ceil(LIN_SEGS).is_multiple_of(2)
}

/// Whether the kernel itself can run `m` rows (1 ..= 128, the decode sizes) by `k` inputs at
/// all (in any number of row blocks).
pub fn linear_stream_tma_room(m: u32, k: u32) -> bool {
    (1..=LINEAR_STREAM_TMA_SERVE_MAX).contains(&m) && linear_stream_tma_rows(m, k).is_some()
}

/// The rows of x a `linear_stream_tma` block holds for `m` rows by `k` inputs (k a positive
/// multiple of 8), and the row blocks that makes, as the kernel works them out: the power of
/// two from 8 that covers `m` (at most `LIN_DEC_ROWS`), halved while its share of x's segment
/// (a segment's stages of 64 k), the two buffers of partials and `LIN_DEC_MIN_STAGES` weight
/// stages would not fit `LIN_DEC_SPACE`. `None` where not even 8 rows fit, or k is not a
/// positive multiple of 8.
pub fn linear_stream_tma_rows(m: u32, k: u32) -> Option<(u32, u32)> {
    if m == 0 || k == 0 || !k.is_multiple_of(8) {
        return None;
    }
    let seg_steps = u64::from(k.div_ceil(LIN_KC).div_ceil(LIN_SEGS).div_ceil(2));
    let room = |rows: u32| {
        let rows = u64::from(rows);
        seg_steps * rows * 128
            + rows * 1024
            + u64::from(LIN_DEC_MIN_STAGES) * LINEAR_STREAM_TMA_STAGE_BYTES
            <= u64::from(LIN_DEC_SPACE)
    };
    let mut rows = m.next_power_of_two().clamp(8, LINEAR_STREAM_TMA_M_MAX);
    while rows > 8 && !room(rows) {
        rows /= 2;
    }
    room(rows).then(|| (rows, m.div_ceil(rows)))
}

/// `linear_stream_tma`'s geometry for `n` output columns, x in `row_blocks` row blocks
/// ([`linear_stream_tma_rows`]) and `resident` clusters of `LIN_SEGS` blocks resident at once:
/// per row block a cluster per tile of 128 columns, at most as many as are resident (each takes
/// tiles cluster, cluster + clusters, ...; which cluster computes a tile never changes its
/// rows), the clusters a multiple of the row blocks; `LIN_DEC_THREADS` threads, one block a
/// multiprocessor; a programmatic dependent.
pub fn linear_stream_tma_geometry(n: u32, row_blocks: u32, resident: u32) -> LaunchConfig {
    let row_blocks = row_blocks.max(1);
    let clusters = n.div_ceil(LIN_DEC_COLS).min((resident / row_blocks).max(1)) * row_blocks;
    LaunchConfig::grid2(LIN_SEGS * clusters, 1, LINEAR_STREAM_TMA_THREADS)
        .with_shared(LINEAR_STREAM_TMA_SMEM)
        .with_programmatic()
}

/// `permute_k32_tiles`'s geometry: a thread per (row of the padded tiles, chunk of 32 k, two a
/// stage), 256 a block, grid-stride past 4096 blocks; a programmatic dependent.
pub fn permute_geometry(m: u32, k: u32) -> LaunchConfig {
    let threads = m.div_ceil(LIN_TMA_TILE) * LIN_TMA_TILE * 2 * k.div_ceil(2 * LIN_KC);
    LaunchConfig::linear(threads.div_ceil(256).clamp(1, 4096), 256).with_programmatic()
}
