//! Launchers of fused kernels that the circuit executor's `Fusions::All` programs launch, and
//! the legacy forward only at prefill sizes, which no circuit program covers (at decode sizes
//! it keeps one launch per op, so `circuit-reference` can reproduce it): a third `impl Ops`
//! block beside `ops_rows` and `ops_hybrid`, under the same rules (one launcher per kernel, its
//! parameter struct, geometry from shapes alone).

use metrale_gpu_runtime::{DType, GpuError, GpuResult, StreamHandle};
use metrale_kernel_abi::{LinearParams, QkNormRopeKvStoreParams};

use crate::ops::{KvStore, Ops, QkNormRope};
use crate::ops_gemm::LinearPath;
use crate::ops_rows::rope_launch;
use crate::ops_view::{Matrix, Operands};

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
        let st = *store;
        let same = rope.qkv == { st.qkv }
            && rope.rows == st.rows
            && rope.row_stride == st.row_stride
            && rope.k_offset == st.k_offset
            && rope.num_kv_heads == st.num_kv_heads
            && rope.head_dim == st.head_dim;
        if !same {
            return Err(GpuError::KernelFailed {
                kernel: "rope::qk_norm_rope_kv_store".into(),
                problem: format!(
                    "the rotation ({rope:?}) and the store ({store:?}) describe different rows"
                ),
            });
        }
        let (fp8, k, v) = (st.kv_fp8, st.k_scale, st.v_scale);
        crate::ops_attention::check_kv_format("rope::qk_norm_rope_kv_store", fp8, k, v)?;
        let r = rope.params();
        let p = QkNormRopeKvStoreParams {
            qkv: r.qkv,
            q_norm_w: r.q_norm_w,
            k_norm_w: r.k_norm_w,
            inv_freq: r.inv_freq,
            positions: r.positions,
            k_cache: store.k_cache,
            v_cache: store.v_cache,
            slot_mapping: store.slot_mapping,
            rows: r.rows,
            row_stride: r.row_stride,
            num_q_heads: r.num_q_heads,
            q_head_stride: r.q_head_stride,
            k_offset: r.k_offset,
            v_offset: store.v_offset,
            num_kv_heads: r.num_kv_heads,
            head_dim: r.head_dim,
            rotary_dim: r.rotary_dim,
            attention_scaling: r.attention_scaling,
            eps: r.eps,
            unit_offset: r.unit_offset,
            num_slots: store.num_slots,
            kv_fp8: store.kv_fp8,
            k_scale: store.k_scale,
            v_scale: store.v_scale,
        };
        let cfg = rope_launch(rope, rope.num_q_heads + 2 * rope.num_kv_heads);
        self.go(self.k.qk_norm_rope_kv_store, cfg, &p, s)
    }

    /// `gemm::linear_swiglu`: `linear(x, w)` into `[gate | up]` (`w` is `[2 n, k]`, gate rows
    /// then up rows) then `silu_mul` into `out` (`[m, n]`), in one launch, byte for byte the two
    /// launches' rows; the gate/up rows are never written. The narrow decode kernel, its blocks
    /// taking pairs of units (8 gate columns, then the same 8 up columns), meant for the widths
    /// it serves ([`LINEAR_SWIGLU_M_MAX`] rows); any `m` gives the same rows. Same grid as
    /// `linear` of `n` columns on the narrow path. `out` bf16 `[m, n]`, `x` bf16 `[m, k]`, `w`
    /// bf16 `[2 n, k]`.
    pub fn linear_swiglu(
        &self,
        s: StreamHandle,
        out: Matrix,
        x: Matrix,
        w: Matrix,
    ) -> GpuResult<()> {
        let check = Operands {
            kernel: "gemm::linear_swiglu",
        };
        check.dtype("x", &x, DType::Bf16)?;
        check.exactly("w", &w, DType::Bf16, (w.rows, x.cols), "x")?;
        check.exactly("out", &out, DType::Bf16, (x.rows, w.rows / 2), "x and w")?;
        if !w.rows.is_multiple_of(2) {
            return Err(GpuError::BadOperand {
                kernel: check.kernel.into(),
                operand: "w",
                problem: format!("has {} rows, not gate and up rows of one width", w.rows),
            });
        }
        let p = LinearParams {
            out: out.ptr,
            x: x.ptr,
            w: w.ptr,
            m: x.rows,
            n: out.cols,
            k: x.cols,
        };
        self.linear_direct_launch(s, self.k.linear_swiglu, LinearPath::Narrow, &p)
    }
}

/// The most rows `linear_swiglu` should serve: the narrow kernel's widths in a model (from 9
/// rows `linear_stream_tma` reads the gate/up weight, and `silu_mul_staged` writes the down
/// projection's input images).
pub const LINEAR_SWIGLU_M_MAX: u32 = 8;
