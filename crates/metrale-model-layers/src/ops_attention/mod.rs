//! The causal paged-attention launchers, a third `impl Ops` block beside `ops` and
//! `ops_hybrid`: `paged_attention` (one row per item: decode and verify steps, through the
//! cluster kernel or `paged_attention_flat`) and
//! `paged_attention_prefill` (row groups of a prefill chunk, a step's few long ones through the
//! split kernels), their parameters, and the geometry `kernels/attention.cu` expects (cluster
//! counts, shared memory, heads and rows per item). The prefill launches are in `prefill`,
//! `paged_attention_prompt` (prompt rows in their own arithmetic) in `prompt`, the host side of
//! their row groups (`attention_row_groups`, `attention_prefill_plan`, `attention_step_plan`) in
//! `groups`.

use metrale_cache::{KvDtype, KvScales};
use metrale_gpu_runtime::fp8::{MAX_SCALE, kv_scale_ok};
use metrale_gpu_runtime::{
    DevicePtr, GpuError, GpuResult, KernelHandle, LaunchConfig, Residency, StreamHandle,
};
use metrale_kernel_abi::attention::{
    decode_shared_bytes as att_dyn_bytes, heads_per_block, padded_dim,
};
use metrale_kernel_abi::{ATT_MAX_ITEMS, ATT_WARPS, PagedAttentionParams};

use crate::ops::{Ops, step_launch};

mod groups;
mod prefill;
mod prompt;

pub use groups::{
    RowGroups, StepPlan, attention_prefill_plan, attention_row_groups, attention_step_plan,
};

/// Blocks of `paged_attention` per (row, head group): the cluster size `ATT_SPLITS` compiled
/// into `kernels/attention.cu`. Fixed, so a row's result depends on its context alone.
pub const ATTENTION_SPLITS: u32 = metrale_kernel_abi::ATT_SPLITS;

/// Clusters of 8 resident at once on the H200 (inside a GPC) at two blocks per multiprocessor
/// and at one: what a backend without an occupancy query (the CPU) is given for
/// `paged_attention`. On CUDA the launchers ask the driver (`GpuBackend::max_resident`), which
/// reports these on the H200; a launch of one cluster more than fit waits for a whole cluster to
/// finish.
const ATTENTION_CLUSTERS: [u32; 2] = [30, 15];

/// Blocks of `paged_attention_flat` resident at once on the H200 at head_dim up to 128 (two a
/// multiprocessor) and at 256 (one): the fallback where the backend reports no occupancy (the
/// CPU).
const FLAT_BLOCKS: [u32; 2] = [264, 132];

/// Most dynamic shared memory a `paged_attention_flat` block may ask for: the H200's 227 KiB a
/// block, less its static shared memory (about 2 KiB) and some room. Shapes that need more run
/// `paged_attention`.
const FLAT_MAX_SHARED: u32 = 224 << 10;

/// Which decode attention kernel a launch of [`Ops::paged_attention`] runs. Both give every row
/// bitwise the same result (the same partials, combined in the same order); they differ in where
/// an item's splits run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeAttention {
    /// `paged_attention`: a cluster of `ATTENTION_SPLITS` blocks per item, one split each, the
    /// splits combined through the cluster's shared memory. Spreads few items over many
    /// multiprocessors.
    Clusters,
    /// `paged_attention_flat`: a block per item, its splits one after another, combined in the
    /// block. No cluster barrier per item: faster once every block has an item.
    Blocks,
}

/// The parameters of `paged_attention`.
#[derive(Debug, Clone, Copy)]
pub struct PagedAttention {
    /// Output `[rows, num_q_heads * head_dim]`.
    pub out: DevicePtr,
    /// Projection output rows holding the (rotated) queries.
    pub qkv: DevicePtr,
    /// K pool.
    pub k_cache: DevicePtr,
    /// V pool.
    pub v_cache: DevicePtr,
    /// `[num_seqs, max_blocks]` block ids.
    pub block_tables: DevicePtr,
    /// Block-table row of each row.
    pub row_seq: DevicePtr,
    /// Position of each row.
    pub positions: DevicePtr,
    /// Rows.
    pub rows: u32,
    /// Elements per row of `qkv`.
    pub row_stride: u32,
    /// Elements from one query head to the next.
    pub q_head_stride: u32,
    /// Query heads.
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Head dimension.
    pub head_dim: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Columns of `block_tables`.
    pub max_blocks: u32,
    /// Rows of `block_tables`.
    pub num_seqs: u32,
    /// Slots per pool.
    pub num_slots: u32,
    /// Softmax scale.
    pub scale: f32,
    /// Each query head is followed by its output gate; multiply by `sigmoid(gate)`.
    pub gated: bool,
    /// The pools' element format: bf16, or e4m3 bytes read as `bf16(e4m3 * scale')`.
    pub kv_dtype: KvDtype,
    /// The layer's FP8 scales (with `KvDtype::Fp8`).
    pub kv_scales: KvScales,
}

impl PagedAttention {
    /// The decode kernels' parameter struct.
    fn params(&self) -> PagedAttentionParams {
        PagedAttentionParams {
            out: self.out,
            qkv: self.qkv,
            k_cache: self.k_cache,
            v_cache: self.v_cache,
            block_tables: self.block_tables,
            row_seq: self.row_seq,
            positions: self.positions,
            rows: self.rows,
            row_stride: self.row_stride,
            q_head_stride: self.q_head_stride,
            num_q_heads: self.num_q_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks: self.max_blocks,
            num_seqs: self.num_seqs,
            num_slots: self.num_slots,
            scale: self.scale,
            gated: self.gated as u32,
            kv_fp8: (self.kv_dtype == KvDtype::Fp8) as u32,
            k_scale: self.kv_scales.k,
            v_scale: self.kv_scales.v,
        }
    }
}

impl Ops {
    /// Causal paged attention of decode and verify rows over (row, group of query heads sharing
    /// a key/value head) items, each row's context cut into `ATTENTION_SPLITS` ranges combined
    /// in order; through `paged_attention` (a cluster per item, block `s` taking range `s`) or
    /// `paged_attention_flat` (a block per item), as [`Ops::decode_attention_kind`] picks. Every
    /// row is bitwise the same either way.
    pub fn paged_attention(&self, s: StreamHandle, p: &PagedAttention) -> GpuResult<()> {
        let kind = self.decode_attention_kind(p)?;
        self.paged_attention_as(s, p, kind)
    }

    /// The kernel `paged_attention` runs for `p`: blocks (`paged_attention_flat`) when the
    /// items (rows x head groups) are at least half the resident blocks and its shared memory
    /// fits, clusters otherwise. With an item for every other block the flat kernel, which
    /// needs no cluster barrier per item, is faster; with fewer items the clusters are (an item
    /// in one block is a chain of eight splits where a cluster runs them side by side).
    pub fn decode_attention_kind(&self, p: &PagedAttention) -> GpuResult<DecodeAttention> {
        let hb = attention_heads_per_block(p.num_q_heads, p.num_kv_heads);
        let items = p.rows * (p.num_q_heads / hb);
        if !attention_blocks_fit(p.num_q_heads, p.num_kv_heads, p.head_dim) {
            return Ok(DecodeAttention::Clusters);
        }
        let (_, _, resident) = self.decode_kernel(DecodeAttention::Blocks, p.head_dim, hb)?;
        Ok(if 2 * items >= resident {
            DecodeAttention::Blocks
        } else {
            DecodeAttention::Clusters
        })
    }

    /// `paged_attention` through the chosen kernel (the tests run both). `Blocks` is refused
    /// for heads whose block would not fit in shared memory ([`attention_blocks_fit`]).
    pub fn paged_attention_as(
        &self,
        s: StreamHandle,
        p: &PagedAttention,
        kind: DecodeAttention,
    ) -> GpuResult<()> {
        let q = p.params();
        check_kv_format("attention::paged_attention", q.kv_fp8, q.k_scale, q.v_scale)?;
        let hb = attention_heads_per_block(p.num_q_heads, p.num_kv_heads);
        if kind == DecodeAttention::Blocks
            && !attention_blocks_fit(p.num_q_heads, p.num_kv_heads, p.head_dim)
        {
            return Err(GpuError::KernelFailed {
                kernel: "attention::paged_attention_flat".into(),
                problem: format!(
                    "{} query heads over {} key/value heads of {} dims need {} bytes of shared \
                     memory a block, over the {FLAT_MAX_SHARED} it may use",
                    p.num_q_heads,
                    p.num_kv_heads,
                    p.head_dim,
                    decode_shared_bytes(kind, p.head_dim, hb)
                ),
            });
        }
        let items = p.rows * (p.num_q_heads / hb);
        // Persistent: each cluster (each block of the flat kernel) loops over items. A
        // programmatic dependent at decode sizes, like the small kernels. The cache store ahead
        // of it triggers only when it ends (above two rows), so every cluster is placed on free
        // multiprocessors: started beside that kernel's blocks, a cluster that did not fit
        // would wait for another to finish.
        let (kernel, smem, resident) = self.decode_kernel(kind, p.head_dim, hb)?;
        let per_cluster = match kind {
            DecodeAttention::Clusters => ATTENTION_SPLITS,
            DecodeAttention::Blocks => 1,
        };
        let blocks = per_cluster * attention_clusters_of(items, resident);
        let config = LaunchConfig::grid2(blocks, 1, 32 * ATT_WARPS).with_shared(smem);
        self.go(kernel, step_launch(config, p.rows), &p.params(), s)
    }
}

/// Dynamic shared memory of a decode attention kernel (`att_dyn_bytes`): two combine buffers
/// (by item parity) for `paged_attention`, one per split for `paged_attention_flat`. At
/// head_dim 128 and 4 heads per block 99,328 and 111,616 bytes (two blocks per
/// multiprocessor), at 256 193,536 and 218,112.
fn decode_shared_bytes(kind: DecodeAttention, head_dim: u32, heads_per_block: u32) -> u32 {
    let partials = match kind {
        DecodeAttention::Clusters => 2,
        DecodeAttention::Blocks => ATTENTION_SPLITS,
    };
    att_dyn_bytes(padded_dim(head_dim), heads_per_block, partials)
}

/// Whether `paged_attention_flat` can run these heads: its block's shared memory (which grows
/// with the head dimension and the query heads a block computes) fits. Qwen3-8B's and
/// Qwen3.5-9B's heads do; 8 query heads a key/value head at head_dim 256 do not.
pub fn attention_blocks_fit(num_q_heads: u32, num_kv_heads: u32, head_dim: u32) -> bool {
    let hb = attention_heads_per_block(num_q_heads, num_kv_heads);
    decode_shared_bytes(DecodeAttention::Blocks, head_dim, hb) <= FLAT_MAX_SHARED
}

impl Ops {
    /// Clusters of `paged_attention` resident at once for these heads (the most its persistent
    /// launches use).
    pub fn attention_resident_clusters(
        &self,
        num_q_heads: u32,
        num_kv_heads: u32,
        head_dim: u32,
    ) -> GpuResult<u32> {
        let hb = attention_heads_per_block(num_q_heads, num_kv_heads);
        Ok(self
            .decode_kernel(DecodeAttention::Clusters, head_dim, hb)?
            .2)
    }

    /// A decode attention kernel for heads of `head_dim` with `heads_per_block` query heads an
    /// item: its handle, dynamic shared memory, and clusters resident at once (blocks for the
    /// flat kernel, whose clusters are of one block), or the H200's counts where the backend
    /// reports none.
    fn decode_kernel(
        &self,
        kind: DecodeAttention,
        head_dim: u32,
        heads_per_block: u32,
    ) -> GpuResult<(KernelHandle, u32, u32)> {
        let (kernel, fallback) = match kind {
            DecodeAttention::Clusters => (self.k.paged_attention, ATTENTION_CLUSTERS),
            DecodeAttention::Blocks => (self.k.paged_attention_flat, FLAT_BLOCKS),
        };
        let smem = decode_shared_bytes(kind, head_dim, heads_per_block);
        let wide = usize::from(padded_dim(head_dim) > 128);
        let resident = self.resident(
            kernel,
            32 * ATT_WARPS,
            smem,
            fallback[wide],
            Residency::Clusters,
        )?;
        Ok((kernel, smem, resident))
    }

    /// Clusters (or blocks, by `unit`) of `kernel` resident at once with `threads` threads and
    /// `smem` bytes of dynamic shared memory a block: the backend's answer, asked once per
    /// (kernel, threads, smem) and kept (a kernel is asked for one unit only), or `fallback`
    /// where the backend has no limit (CPU) or reports none.
    pub(crate) fn resident(
        &self,
        kernel: KernelHandle,
        threads: u32,
        smem: u32,
        fallback: u32,
        unit: Residency,
    ) -> GpuResult<u32> {
        let key = (kernel, threads, smem);
        if let Some(&n) = self.resident.lock().get(&key) {
            return Ok(n);
        }
        let config = LaunchConfig::grid2(ATTENTION_SPLITS, 1, threads).with_shared(smem);
        let n = match self.gpu.max_resident(kernel, &config, unit) {
            Some(n) => n?,
            None => fallback,
        };
        let n = if n == 0 { fallback } else { n };
        self.resident.lock().insert(key, n);
        Ok(n)
    }
}

/// Clusters of a persistent attention launch for `items` items with `resident` clusters
/// resident at once: as many as are resident (each loops over items cluster, cluster +
/// clusters, ...), or, when that would give a cluster over `ATT_MAX_ITEMS`, a whole number
/// of such waves (a prefill's thousands of items), so the last wave is as full as the others.
/// Which cluster computes an item never changes the item's result.
fn attention_clusters_of(items: u32, resident: u32) -> u32 {
    let waves = items.div_ceil(resident * ATT_MAX_ITEMS).max(1);
    items.min(resident * waves).max(1)
}

/// Refuse an FP8 KV format whose scales the kernels cannot use (see `fp8::kv_scale_ok`): the
/// CUDA kernels would divide by or multiply with them unchecked.
pub(crate) fn check_kv_format(kernel: &str, kv_fp8: u32, k: f32, v: f32) -> GpuResult<()> {
    let ok = match kv_fp8 {
        0 => true,
        1 => kv_scale_ok(k) && kv_scale_ok(v),
        _ => false,
    };
    if ok {
        return Ok(());
    }
    Err(GpuError::BadOperand {
        kernel: kernel.into(),
        operand: "kv_fp8 / k_scale / v_scale",
        problem: format!(
            "format {kv_fp8} with scales ({k}, {v}): 0 (bf16), or 1 (FP8) with scales in (0, {MAX_SCALE})"
        ),
    })
}

/// Query heads per `paged_attention` item, as `att_heads_per_block` computes it.
fn attention_heads_per_block(num_q_heads: u32, num_kv_heads: u32) -> u32 {
    heads_per_block(num_q_heads, num_kv_heads)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use metrale_gpu_runtime::{CpuBackend, DevicePtr, GpuBackend};

    use super::*;

    /// A decode step's attention over `rows` rows of these heads (addresses never read: the
    /// kernel choice depends on the shape only).
    fn step(rows: u32, hq: u32, hkv: u32, d: u32) -> PagedAttention {
        let none = DevicePtr(0);
        PagedAttention {
            out: none,
            qkv: none,
            k_cache: none,
            v_cache: none,
            block_tables: none,
            row_seq: none,
            positions: none,
            rows,
            row_stride: 0,
            q_head_stride: d,
            num_q_heads: hq,
            num_kv_heads: hkv,
            head_dim: d,
            block_size: 16,
            max_blocks: 1,
            num_seqs: rows,
            num_slots: 16,
            scale: 1.0,
            gated: false,
            kv_dtype: metrale_cache::KvDtype::Bf16,
            kv_scales: metrale_cache::KvScales::default(),
        }
    }

    /// FP8 scales the kernels cannot use are refused by the launchers, naming the kernel,
    /// before anything launches.
    #[test]
    fn fp8_scales_the_kernels_cannot_use_are_refused() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let s = gpu.default_stream();
        for (k, v) in [(0.0, 1.0), (1.0, -2.0), (f32::NAN, 1.0), (1.0, 256.0)] {
            let p = PagedAttention {
                kv_dtype: metrale_cache::KvDtype::Fp8,
                kv_scales: metrale_cache::KvScales { k, v },
                ..step(1, 4, 2, 64)
            };
            for e in [
                ops.paged_attention(s, &p).unwrap_err(),
                ops.paged_attention_prefill(s, &p, groups(1, 0), None)
                    .unwrap_err(),
                ops.paged_attention_prefill(s, &p, groups(1, 1), None)
                    .unwrap_err(),
            ] {
                assert!(
                    matches!(&e, GpuError::BadOperand { kernel, .. } if kernel.contains("paged_attention")),
                    "{e:?}"
                );
            }
        }
    }

    fn groups(count: u32, split: u32) -> RowGroups {
        RowGroups {
            at: DevicePtr(0),
            count,
            split,
        }
    }

    /// The block kernel serves steps with an item for every other resident block (the H200's
    /// counts on the CPU backend): Qwen3-8B's heads from 32 rows, Qwen3.5-9B's from 32; fewer
    /// rows, and heads whose block would not fit in shared memory, get the cluster kernel, and
    /// forcing the block kernel on those heads is refused with an error naming it.
    #[test]
    fn decode_attention_takes_blocks_once_every_other_block_has_an_item() {
        let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
        let ops = Ops::new(gpu.clone()).expect("kernels resolve");
        let kind = |rows, hq, hkv, d| {
            ops.decode_attention_kind(&step(rows, hq, hkv, d))
                .expect("kind")
        };
        use DecodeAttention::{Blocks, Clusters};
        assert_eq!(
            [1, 16, 32, 64, 128].map(|rows| kind(rows, 32, 8, 128)),
            [Clusters, Clusters, Blocks, Blocks, Blocks]
        );
        assert_eq!(
            [1, 16, 32, 64].map(|rows| kind(rows, 16, 4, 256)),
            [Clusters, Clusters, Blocks, Blocks]
        );
        assert!(!attention_blocks_fit(16, 2, 256));
        assert_eq!(kind(128, 16, 2, 256), Clusters);
        let refused = ops.paged_attention_as(gpu.default_stream(), &step(128, 16, 2, 256), Blocks);
        assert!(
            matches!(&refused, Err(GpuError::KernelFailed { kernel, .. }) if kernel.contains("paged_attention_flat")),
            "{refused:?}"
        );
    }
}
