//! Launchers of fused kernels that the circuit executor's `Fusions::All` programs launch, and
//! the legacy forward only at prefill sizes, which no circuit program covers (at decode sizes
//! it keeps one launch per op, so `circuit-reference` can reproduce it): a third `impl Ops`
//! block beside `ops` and `ops_hybrid`, under the same rules (one launcher per kernel, the CPU
//! twin's argument order, geometry from shapes alone).

use metrale_gpu_runtime::{GpuError, GpuResult, StreamHandle};

use crate::ops::{KvStore, Ops, QkNormRope, rope_launch};

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
}
