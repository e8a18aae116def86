//! `cargo xtask`: kernels, fixtures, gpu-bundle, bench.

fn main() {}
