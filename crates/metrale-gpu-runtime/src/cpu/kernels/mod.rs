//! The CPU twins of the CUDA kernels in `kernels/`, one Rust module per `.cu` family, each
//! registering its functions under the same `(module, name)` as the CUDA source.
//!
//! Every kernel computes in f32 with straightforward loops; it is the reference the CUDA kernels
//! are tested against, so clarity beats speed, except where the tests would become too slow.

pub mod activation;
pub mod attention;
pub mod cache;
pub mod embed;
pub mod gdn;
pub mod gemm;
pub mod init;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod sampling;
mod util;

use super::CpuKernelFn;

/// One kernel family: a module name (the `.cu` file's stem) and its kernels.
#[derive(Debug)]
pub struct Family {
    /// The module name, e.g. `"norm"`.
    pub module: &'static str,
    /// Function name and implementation.
    pub kernels: &'static [(&'static str, CpuKernelFn)],
}

/// Every family the CPU backend registers.
pub const FAMILIES: &[Family] = &[
    activation::FAMILY,
    attention::FAMILY,
    cache::FAMILY,
    embed::FAMILY,
    gdn::FAMILY,
    gemm::FAMILY,
    init::FAMILY,
    moe::FAMILY,
    norm::FAMILY,
    rope::FAMILY,
    sampling::FAMILY,
];
