//! CPU twin of `kernels/cache.cu`: writing a step's keys and values into the paged KV cache.
//!
//! Cache layout per attention layer: `[num_slots, num_kv_heads, head_dim]` bf16, where slot
//! `block * block_size + offset` holds one token. A slot of `u32::MAX` marks a padding row, which
//! writes nothing.

use half::bf16;

use crate::cpu::KernelCtx;
use crate::error::GpuResult;

/// `kv_store(k_cache, v_cache: bf16 [num_slots, num_kv_heads, head_dim], qkv: bf16 [rows,
/// row_stride], slot_mapping: u32 [rows], rows, row_stride, k_offset, v_offset, num_kv_heads,
/// head_dim, num_slots)`.
pub fn kv_store(ctx: &KernelCtx<'_>) -> GpuResult<()> {
    ctx.expect_args(11)?;
    let (rows, stride, k_off, v_off, hkv, d, slots) = (
        ctx.usize(4)?,
        ctx.usize(5)?,
        ctx.usize(6)?,
        ctx.usize(7)?,
        ctx.usize(8)?,
        ctx.usize(9)?,
        ctx.usize(10)?,
    );
    let width = hkv * d;
    if k_off + width > stride || v_off + width > stride {
        return Err(ctx.fail(format!(
            "k/v ({k_off}, {v_off} + {width}) do not fit a row of {stride}"
        )));
    }
    let k_cache = ctx.slice_mut::<bf16>(0, slots * width)?;
    let v_cache = ctx.slice_mut::<bf16>(1, slots * width)?;
    let qkv = ctx.slice::<bf16>(2, rows * stride)?;
    let slot_mapping = ctx.slice::<u32>(3, rows)?;
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

/// The family table.
pub const FAMILY: super::Family = super::Family {
    module: "cache",
    kernels: &[("kv_store", kv_store)],
};
