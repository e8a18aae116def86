//! The CPU twins of the CUDA kernels in `kernels/`, one Rust module per `.cu` family, each
//! kernel's twin a function of the kernel's name that reads the kernel's parameter struct
//! (`metrale-kernel-abi`); [`TWINS`] registers them under the manifest's `(module, name)`.
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

/// Every kernel of the manifest (`metrale_kernel_abi::for_each_kernel!`) with its twin:
/// `(module, name, twin)`, the twin being the function `<module>::<name>` here. A manifest
/// kernel without its twin does not compile; a twin function the manifest does not list fails
/// `every_twin_function_is_in_the_manifest` (cpu/tests.rs).
macro_rules! twin_table {
    ($( $(#[$meta:meta])* $module:ident :: $name:ident => $konst:ident($params:ty) ),* $(,)?) => {
        /// See the macro.
        pub const TWINS: &[(&str, &str, CpuKernelFn)] = &[
            $((stringify!($module), stringify!($name), $module::$name as CpuKernelFn),)*
        ];
    };
}

metrale_kernel_abi::for_each_kernel!(twin_table);
