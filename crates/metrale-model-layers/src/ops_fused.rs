//! Launchers of fused kernels that the circuit executor's `Fusions::All` programs launch, and
//! the legacy forward only at prefill sizes, which no circuit program covers (at decode sizes
//! it keeps one launch per op, so `circuit-reference` can reproduce it): a third `impl Ops`
//! block beside `ops` and `ops_hybrid`, under the same rules (one launcher per kernel, the CPU
//! twin's argument order, geometry from shapes alone).

use metrale_gpu_runtime::{DevicePtr, GpuError, GpuResult, StreamHandle};

use crate::ops::{KvStore, Ops, QkNormRope, rope_launch};
use crate::ops_gemm::LinearPath;

impl Ops {
    /// `rope::qk_norm_rope_kv_store`: `qk_norm_rope(rope)` then `kv_store(store)` in one launch,
    /// byte for byte the same results. The two must describe the same rows of the same
    /// projection output (`qkv`, `rows`, `row_stride`, `k_offset`, `num_kv_heads`,
    /// `head_dim`); anything else is refused before launching.
    pub fn qk_norm_rope_kv_store(
        &self,
        s: StreamHandle,
        rope: &QkNormRope,
        store: &KvStore,
    ) -> GpuResult<()> {
        let same = rope.qkv == store.qkv
            && rope.rows == store.rows
            && rope.row_stride == store.row_stride
            && rope.k_offset == store.k_offset
            && rope.num_kv_heads == store.num_kv_heads
            && rope.head_dim == store.head_dim;
        if !same {
            return Err(GpuError::KernelFailed {
                kernel: "rope::qk_norm_rope_kv_store".into(),
                problem: format!(
                    "the rotation ({rope:?}) and the store ({store:?}) describe different rows"
                ),
            });
        }
        self.go(
            self.k.qk_norm_rope_kv_store,
            rope_launch(rope, rope.num_q_heads + 2 * rope.num_kv_heads),
            &[
                rope.qkv.into(),
                rope.q_norm.into(),
                rope.k_norm.into(),
                rope.inv_freq.into(),
                rope.positions.into(),
                store.k_cache.into(),
                store.v_cache.into(),
                store.slot_mapping.into(),
                rope.rows.into(),
                rope.row_stride.into(),
                rope.num_q_heads.into(),
                rope.q_head_stride.into(),
                rope.k_offset.into(),
                store.v_offset.into(),
                rope.num_kv_heads.into(),
                rope.head_dim.into(),
                rope.rotary_dim.into(),
                rope.eps.into(),
                (rope.unit_offset as u32).into(),
                store.num_slots.into(),
            ],
            s,
        )
    }

    /// `gemm::linear_swiglu`: `linear(x, w)` into `[gate | up]` (`w` is `[2 n, k]`, gate rows
    /// then up rows) then `silu_mul` into `out` (`[m, n]`), in one launch, byte for byte the two
    /// launches' rows; the gate/up rows are never written. The narrow decode kernel, its blocks
    /// taking pairs of units (8 gate columns, then the same 8 up columns), meant for the widths
    /// it serves ([`LINEAR_SWIGLU_M_MAX`] rows); any `m` gives the same rows. Same grid as
    /// `linear` of `n` columns on the narrow path.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_swiglu(
        &self,
        s: StreamHandle,
        out: DevicePtr,
        x: DevicePtr,
        w: DevicePtr,
        m: u32,
        n: u32,
        k: u32,
    ) -> GpuResult<()> {
        let kernel = self.k.linear_swiglu;
        self.linear_direct_launch(s, kernel, LinearPath::Narrow, out, x, w, (m, n, k))
    }
}

/// The most rows `linear_swiglu` should serve: the narrow kernel's widths in a model (from 9
/// rows `linear_stream_tma` reads the gate/up weight, and `silu_mul_staged` writes the down
/// projection's input images).
pub const LINEAR_SWIGLU_M_MAX: u32 = 8;
