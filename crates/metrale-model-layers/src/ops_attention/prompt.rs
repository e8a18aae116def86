//! The launcher of `paged_attention_prompt`: prompt rows' attention in an arithmetic of their own
//! (one softmax chain a row over 64-key tiles; `kernels/attention_prompt.cuh`), over row groups
//! as `paged_attention_prefill` takes them.

use metrale_gpu_runtime::{DevicePtr, GpuError, GpuResult, LaunchConfig, StreamHandle};
use metrale_kernel_abi::attention::prompt_shared_bytes;
use metrale_kernel_abi::{APR_D, APR_THREADS};

use super::{PagedAttention, attention_heads_per_block};
use crate::ops::Ops;

impl Ops {
    /// Whether `paged_attention_prompt` takes heads of `head_dim` over a cache of `kv_fp8`
    /// (1: e4m3 pools): head_dim `APR_D` and bf16 pools.
    pub fn prompt_attention_fits(head_dim: u32, kv_fp8: u32) -> bool {
        head_dim == APR_D && kv_fp8 == 0
    }

    /// The rows of `n_groups` row groups at `row_groups` (`attention_row_groups`'s) in the
    /// prompt arithmetic, to `p.out`: an item (a group by a block of query heads sharing a
    /// key/value head) a block of three warpgroups, the longest contexts first. The groups are
    /// [`attention_step_plan`](super::attention_step_plan)'s prompt groups. Refused where
    /// [`Ops::prompt_attention_fits`] is false.
    pub fn paged_attention_prompt(
        &self,
        s: StreamHandle,
        p: &PagedAttention,
        row_groups: DevicePtr,
        n_groups: u32,
    ) -> GpuResult<()> {
        if n_groups == 0 {
            return Ok(());
        }
        let q = p.params();
        if !Self::prompt_attention_fits(q.head_dim, q.kv_fp8) {
            return Err(GpuError::KernelFailed {
                kernel: "attention::paged_attention_prompt".into(),
                problem: format!(
                    "head_dim {} with kv_fp8 {}: the kernel takes head_dim {APR_D} and bf16 pools",
                    q.head_dim, q.kv_fp8
                ),
            });
        }
        let hb = attention_heads_per_block(p.num_q_heads, p.num_kv_heads);
        let items = n_groups * (p.num_q_heads / hb);
        let config = LaunchConfig::grid2(items, 1, APR_THREADS).with_shared(prompt_shared_bytes());
        self.go(
            self.k.paged_attention_prompt,
            config,
            &p.prefill_params(p.out, row_groups, n_groups),
            s,
        )
    }
}
