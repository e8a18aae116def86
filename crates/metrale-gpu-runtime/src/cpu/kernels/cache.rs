//! CPU twin of `kernels/cache.cu`: writing a step's keys and values into the paged KV cache.
//!
//! Cache layout per attention layer: `[num_slots, num_kv_heads, head_dim]` of bf16, or of e4m3
//! bytes (`kv_fp8`: each element `fp8::kv_quantize(value, scale)`, read back as
//! `fp8::kv_dequant`), where slot `block * block_size + offset` holds one token. A slot of
//! `u32::MAX` marks a padding row, which writes nothing.

use half::bf16;
use metrale_kernel_abi::KvStoreParams;

use crate::cpu::KernelCtx;
use crate::error::GpuResult;
use crate::fp8::{self, kv_quantize};
use crate::types::DevicePtr;

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
    let format = KvFormat::new(ctx, p.kv_fp8, p.k_scale, p.v_scale)?;
    let mut pools = format.pools_mut(ctx, (p.k_cache, p.v_cache), slots * width)?;
    let qkv = ctx.slice::<bf16>("qkv", p.qkv, rows * stride)?;
    let slot_mapping = ctx.slice::<u32>("slot_mapping", p.slot_mapping, rows)?;
    let g = StoreGeometry {
        stride,
        k_off,
        v_off,
        width,
        slots,
    };
    store_rows(ctx, &mut pools, qkv, slot_mapping, g)
}

/// The element format of a launch's KV pools: bf16, or e4m3 bytes with the pools' scales.
#[derive(Debug, Clone, Copy)]
pub(super) struct KvFormat {
    /// `(k_scale, v_scale)` of FP8 pools; `None`: bf16.
    pub fp8: Option<(f32, f32)>,
}

impl KvFormat {
    /// The format of a launch's `kv_fp8`, `k_scale` and `v_scale` (0 or 1; FP8 scales that
    /// `fp8::kv_scale_ok` takes: the CUDA kernels would compute garbage from others).
    pub fn new(ctx: &KernelCtx<'_>, kv_fp8: u32, k_scale: f32, v_scale: f32) -> GpuResult<Self> {
        match kv_fp8 {
            0 => Ok(KvFormat { fp8: None }),
            1 if crate::fp8::kv_scale_ok(k_scale) && crate::fp8::kv_scale_ok(v_scale) => {
                Ok(KvFormat {
                    fp8: Some((k_scale, v_scale)),
                })
            }
            _ => Err(ctx.fail(format!(
                "kv_fp8 {kv_fp8} with scales ({k_scale}, {v_scale}): 0, or 1 with scales in \
                 (0, {})",
                crate::fp8::MAX_SCALE
            ))),
        }
    }

    /// Bytes of one element.
    fn elem_bytes(self) -> usize {
        if self.fp8.is_some() { 1 } else { 2 }
    }

    /// The pools at `(k, v)` of `elems` elements each, to write.
    pub fn pools_mut<'a>(
        self,
        ctx: &'a KernelCtx<'_>,
        (k, v): (DevicePtr, DevicePtr),
        elems: usize,
    ) -> GpuResult<PoolsMut<'a>> {
        Ok(PoolsMut {
            format: self,
            k: ctx.slice_mut::<u8>("k_cache", k, elems * self.elem_bytes())?,
            v: ctx.slice_mut::<u8>("v_cache", v, elems * self.elem_bytes())?,
        })
    }

    /// The pools at `(k, v)` of `elems` elements each, to read.
    pub fn pools<'a>(
        self,
        ctx: &'a KernelCtx<'_>,
        (k, v): (DevicePtr, DevicePtr),
        elems: usize,
    ) -> GpuResult<Pools<'a>> {
        Ok(Pools {
            tables: self
                .fp8
                .map(|(ks, vs)| Box::new((fp8::dequant_table(ks), fp8::dequant_table(vs)))),
            k: ctx.slice::<u8>("k_cache", k, elems * self.elem_bytes())?,
            v: ctx.slice::<u8>("v_cache", v, elems * self.elem_bytes())?,
        })
    }
}

/// A launch's K and V pools, to write.
pub(super) struct PoolsMut<'a> {
    format: KvFormat,
    k: &'a mut [u8],
    v: &'a mut [u8],
}

impl PoolsMut<'_> {
    /// Store `k` and `v` (each `width` elements) at element `at` of the pools.
    fn store(&mut self, at: usize, k: &[bf16], v: &[bf16]) {
        match self.format.fp8 {
            Some((ks, vs)) => {
                let n = k.len();
                for (dst, &e) in self.k[at..at + n].iter_mut().zip(k) {
                    *dst = kv_quantize(e, ks);
                }
                for (dst, &e) in self.v[at..at + n].iter_mut().zip(v) {
                    *dst = kv_quantize(e, vs);
                }
            }
            None => {
                let n = 2 * k.len();
                self.k[2 * at..2 * at + n].copy_from_slice(bytemuck::cast_slice(k));
                self.v[2 * at..2 * at + n].copy_from_slice(bytemuck::cast_slice(v));
            }
        }
    }
}

/// A launch's K and V pools, to read as the attention kernels do.
pub(super) struct Pools<'a> {
    /// An FP8 pool's elements by byte (`fp8::kv_dequant` under the K and the V scale).
    tables: Option<Box<([bf16; 256], [bf16; 256])>>,
    k: &'a [u8],
    v: &'a [u8],
}

impl Pools<'_> {
    /// The key element `at`, as bf16 (an FP8 pool's `fp8::kv_dequant`).
    #[inline]
    pub fn key(&self, at: usize) -> bf16 {
        Self::read(self.k, at, self.tables.as_ref().map(|t| &t.0))
    }

    /// The value element `at`, as bf16.
    #[inline]
    pub fn value(&self, at: usize) -> bf16 {
        Self::read(self.v, at, self.tables.as_ref().map(|t| &t.1))
    }

    #[inline]
    fn read(pool: &[u8], at: usize, table: Option<&[bf16; 256]>) -> bf16 {
        match table {
            Some(t) => t[usize::from(pool[at])],
            None => bf16::from_bits(u16::from_le_bytes([pool[2 * at], pool[2 * at + 1]])),
        }
    }
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

/// Store each row's k and v at its slot (padding rows write nothing). Shared with the fused
/// `rope::qk_norm_rope_kv_store`.
pub(super) fn store_rows(
    ctx: &KernelCtx<'_>,
    pools: &mut PoolsMut<'_>,
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
        pools.store(
            slot * width,
            &row[g.k_off..g.k_off + width],
            &row[g.v_off..g.v_off + width],
        );
    }
    Ok(())
}
