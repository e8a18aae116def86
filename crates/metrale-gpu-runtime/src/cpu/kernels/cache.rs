//! CPU twin of `kernels/cache.cu`: writing a step's keys and values into the paged KV cache.
//!
//! Cache layout per attention layer: `[num_slots, num_kv_heads, head_dim]` bf16, where slot
//! `block * block_size + offset` holds one token. A slot of `u32::MAX` marks a padding row, which
//! writes nothing.

use half::bf16;
use metrale_kernel_abi::KvStoreParams;

use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `kv_store` ([`KvStoreParams`]): each row's k and v to its slot; a slot past the pool, or k
/// or v past the row, fails the launch.
pub fn kv_store(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    let p: KvStoreParams = ctx.params()?;
    let (rows, stride, k_off, v_off) = (
        p.rows as usize,
        p.row_stride as usize,
        p.k_offset as usize,
        p.v_offset as usize,
    );
    let (width, slots) = (
        p.num_kv_heads as usize * p.head_dim as usize,
        p.num_slots as usize,
    );
    if k_off + width > stride || v_off + width > stride {
        return Err(ctx.fail(format!(
            "k/v ({k_off}, {v_off} + {width}) do not fit a row of {stride}"
        )));
    }
    let k_cache = ctx.slice_mut::<bf16>("k_cache", p.k_cache, slots * width)?;
    let v_cache = ctx.slice_mut::<bf16>("v_cache", p.v_cache, slots * width)?;
    let qkv = ctx.slice::<bf16>("qkv", p.qkv, rows * stride)?;
    let slot_mapping = ctx.slice::<u32>("slot_mapping", p.slot_mapping, rows)?;
    let g = StoreGeometry {
        stride,
        k_off,
        v_off,
        width,
        slots,
    };
    store_rows(ctx, (k_cache, v_cache), qkv, slot_mapping, g)
}

/// Where k and v sit in a row and in the pools (`width = num_kv_heads * head_dim`).
#[derive(Debug, Clone, Copy)]
pub(super) struct StoreGeometry {
    pub stride: usize,
    pub k_off: usize,
    pub v_off: usize,
    pub width: usize,
    pub slots: usize,
}

/// Copy each row's k and v to its slot (padding rows write nothing). Shared with the fused
/// `rope::qk_norm_rope_kv_store`.
pub(super) fn store_rows(
    ctx: &KernelCtx<'_>,
    (k_cache, v_cache): (&mut [bf16], &mut [bf16]),
    qkv: &[bf16],
    slot_mapping: &[u32],
    g: StoreGeometry,
) -> GpuResult<()> {
    let (stride, width, slots) = (g.stride, g.width, g.slots);
    for (r, &slot) in slot_mapping.iter().enumerate() {
        if slot == u32::MAX {
            continue;
        }
        let slot = slot as usize;
        if slot >= slots {
            return Err(ctx.fail(format!(
                "row {r}: slot {slot} is past the {slots} cache slots"
            )));
        }
        let row = &qkv[r * stride..(r + 1) * stride];
        k_cache[slot * width..(slot + 1) * width].copy_from_slice(&row[g.k_off..g.k_off + width]);
        v_cache[slot * width..(slot + 1) * width].copy_from_slice(&row[g.v_off..g.v_off + width]);
    }
    Ok(())
}
