//! The parameter struct of every kernel, by family (`kernels/<family>.cu`). Each field list is
//! the kernel's parameter list, in order; `kernels/abi.cuh` mirrors the structs in C and gives
//! each the macro its kernels' signatures are written with.

mod attention;
mod gdn;
mod gemm;
mod moe;
mod rows;

pub use attention::*;
pub use gdn::*;
pub use gemm::*;
pub use moe::*;
pub use rows::*;
