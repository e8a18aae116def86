//! The prefill side of the attention launchers: `paged_attention_prefill` over a step's row
//! groups, the walk's launch and the split kernels' launch, and their geometry.

use metrale_gpu_runtime::{
    DevicePtr, GpuError, GpuResult, KernelHandle, LaunchConfig, Residency, StreamHandle,
};
use metrale_kernel_abi::attention::{
    PREFILL_SPLIT_THREADS, padded_dim, prefill_shared_bytes as atp_shared_bytes,
    prefill_split_shared_bytes,
};
use metrale_kernel_abi::{ATP_WARPS, PagedAttentionPrefillParams};

use super::{
    ATTENTION_SPLITS, PagedAttention, RowGroups, attention_clusters_of, attention_heads_per_block,
    check_kv_format,
};
use crate::ops::Ops;

/// Blocks of `paged_attention_prefill` resident at once on the H200 (two a multiprocessor at
/// every head dimension): the fallback where the backend reports no occupancy (the CPU).
pub(super) const PREFILL_BLOCKS: u32 = 264;

/// Blocks of the split kernels resident at once on the H200 (one a multiprocessor, in whole
/// clusters): the fallback where the backend reports no occupancy.
const PREFILL_SPLIT_BLOCKS: u32 = 128;

impl PagedAttention {
    /// The prefill kernels' parameter struct: rows (or, staged, the images) to `out`, and the
    /// `n_groups` row groups at `row_groups`.
    pub(super) fn prefill_params(
        &self,
        out: DevicePtr,
        row_groups: DevicePtr,
        n_groups: u32,
    ) -> PagedAttentionPrefillParams {
        let p = self.params();
        PagedAttentionPrefillParams {
            out,
            qkv: p.qkv,
            k_cache: p.k_cache,
            v_cache: p.v_cache,
            block_tables: p.block_tables,
            row_seq: p.row_seq,
            positions: p.positions,
            row_groups,
            rows: p.rows,
            row_stride: p.row_stride,
            q_head_stride: p.q_head_stride,
            num_q_heads: p.num_q_heads,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.head_dim,
            block_size: p.block_size,
            max_blocks: p.max_blocks,
            num_seqs: p.num_seqs,
            num_slots: p.num_slots,
            scale: p.scale,
            gated: p.gated,
            n_groups,
            kv_fp8: p.kv_fp8,
            k_scale: p.k_scale,
            v_scale: p.v_scale,
        }
    }
}

impl Ops {
    /// `paged_attention` on the rows of a step's row groups (`groups`), bitwise the same per
    /// row, each group's rows in one item so their keys and values are read once: the prefill
    /// path. The groups before the last `groups.split` run through persistent blocks of four
    /// warps, each block walking an item's units in order (`paged_attention_prefill`); the last
    /// `groups.split` through clusters of `ATTENTION_SPLITS` blocks of sixteen warps, each block
    /// taking one split of the cluster's item and its four groups of warps that split's chains,
    /// side by side (`paged_attention_prefill_split`), a second launch.
    /// `images`: the rows go there, as the o projection's stage images ([`Ops::linear_staging`]
    /// of `[rows, num_q_heads * head_dim]`), instead of to `p.out` (the `_staged` kernels).
    pub fn paged_attention_prefill(
        &self,
        s: StreamHandle,
        p: &PagedAttention,
        groups: RowGroups,
        images: Option<DevicePtr>,
    ) -> GpuResult<()> {
        let q = p.params();
        check_kv_format(
            "attention::paged_attention_prefill",
            q.kv_fp8,
            q.k_scale,
            q.v_scale,
        )?;
        if groups.split > groups.count {
            return Err(GpuError::KernelFailed {
                kernel: "attention::paged_attention_prefill".into(),
                problem: format!(
                    "{} of {} row groups asked for the split kernel",
                    groups.split, groups.count
                ),
            });
        }
        let walked = groups.count - groups.split;
        if walked > 0 || groups.split == 0 {
            self.prefill_launch(s, p, groups.at, walked, images, false)?;
        }
        if groups.split > 0 {
            // Each group is two u32.
            let at = groups.at.offset(8 * walked as usize);
            self.prefill_launch(s, p, at, groups.split, images, true)?;
        }
        Ok(())
    }

    /// Resident blocks of `paged_attention_prefill` for heads of `head_dim` (the most a launch
    /// uses at once; [`attention_prefill_plan`] weighs a step's row groups against them).
    pub fn attention_prefill_blocks(&self, head_dim: u32) -> GpuResult<u32> {
        self.prefill_resident(false, head_dim)
    }

    /// The walk's kernels (plain, staged) and block geometry, or with `split` the split
    /// kernels'.
    fn prefill_kernels(&self, split: bool) -> (KernelHandle, KernelHandle, PrefillBlocks) {
        match split {
            false => (
                self.k.paged_attention_prefill,
                self.k.paged_attention_prefill_staged,
                PrefillBlocks::WALK,
            ),
            true => (
                self.k.paged_attention_prefill_split,
                self.k.paged_attention_prefill_split_staged,
                PrefillBlocks::SPLIT,
            ),
        }
    }

    /// Clusters of the walk (`split`: of the split kernels) resident at once for heads of
    /// `head_dim`.
    fn prefill_resident(&self, split: bool, head_dim: u32) -> GpuResult<u32> {
        let (plain, _, b) = self.prefill_kernels(split);
        self.resident(
            plain,
            b.threads,
            (b.shared_bytes)(padded_dim(head_dim)),
            b.fallback / b.cluster,
            Residency::Clusters,
        )
    }

    /// One launch of the prefill kernels over `n_groups` row groups at `row_groups`: the walk
    /// (blocks take whole items) or, `split`, the cluster kernel; each block (each cluster)
    /// takes items from the longest contexts down.
    fn prefill_launch(
        &self,
        s: StreamHandle,
        p: &PagedAttention,
        row_groups: DevicePtr,
        n_groups: u32,
        images: Option<DevicePtr>,
        split: bool,
    ) -> GpuResult<()> {
        let hb = attention_heads_per_block(p.num_q_heads, p.num_kv_heads);
        let items = n_groups * (p.num_q_heads / hb);
        let (plain, staged, b) = self.prefill_kernels(split);
        let smem = (b.shared_bytes)(padded_dim(p.head_dim));
        let resident = self.prefill_resident(split, p.head_dim)?;
        let blocks = b.cluster * attention_clusters_of(items, resident);
        let (kernel, out) = match images {
            Some(images) => {
                if !(p.num_q_heads * p.head_dim).is_multiple_of(64) {
                    return Err(GpuError::KernelFailed {
                        kernel: "attention::paged_attention_prefill_staged".into(),
                        problem: format!(
                            "{} query heads of {} dims are not whole 64-wide stages",
                            p.num_q_heads, p.head_dim
                        ),
                    });
                }
                (staged, images)
            }
            None => (plain, p.out),
        };
        let config = LaunchConfig::grid2(blocks, 1, b.threads).with_shared(smem);
        self.go(
            kernel,
            config,
            &p.prefill_params(out, row_groups, n_groups),
            s,
        )
    }
}

/// A prefill kernel's blocks: threads, blocks a cluster, dynamic shared memory by padded head
/// dimension, and the blocks resident where the backend reports no occupancy.
struct PrefillBlocks {
    threads: u32,
    cluster: u32,
    shared_bytes: fn(u32) -> u32,
    fallback: u32,
}

impl PrefillBlocks {
    /// The walk: blocks of four warps, two a multiprocessor (76,288 bytes of shared memory at
    /// head_dim 128, 83,456 at 256).
    const WALK: Self = Self {
        threads: 32 * ATP_WARPS,
        cluster: 1,
        shared_bytes: atp_shared_bytes,
        fallback: PREFILL_BLOCKS,
    };

    /// The split kernels: clusters of `ATTENTION_SPLITS` blocks of sixteen warps (a group of
    /// four a chain), one a multiprocessor.
    const SPLIT: Self = Self {
        threads: PREFILL_SPLIT_THREADS,
        cluster: ATTENTION_SPLITS,
        shared_bytes: prefill_split_shared_bytes,
        fallback: PREFILL_SPLIT_BLOCKS,
    };
}
