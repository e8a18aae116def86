//! The CPU twin table against the kernel manifest: every kernel of the manifest resolves to its
//! twin (a missing twin does not compile, see `cpu/kernels/mod.rs`), and every twin function in
//! the kernel modules is a kernel of the manifest.

use super::*;

/// The twin modules' sources, as compiled into this test.
const SOURCES: &[(&str, &str)] = &[
    ("activation", include_str!("../kernels/activation.rs")),
    ("attention", include_str!("../kernels/attention.rs")),
    ("cache", include_str!("../kernels/cache.rs")),
    ("embed", include_str!("../kernels/embed.rs")),
    ("gdn", include_str!("../kernels/gdn.rs")),
    ("gdn", include_str!("../kernels/gdn/delta_rule.rs")),
    ("gemm", include_str!("../kernels/gemm.rs")),
    ("init", include_str!("../kernels/init.rs")),
    ("moe", include_str!("../kernels/moe.rs")),
    ("norm", include_str!("../kernels/norm.rs")),
    ("rope", include_str!("../kernels/rope.rs")),
    ("sampling", include_str!("../kernels/sampling.rs")),
];

/// The public functions of a source taking a `KernelCtx`: its twins.
fn twin_functions(source: &str) -> Vec<String> {
    source
        .lines()
        .filter_map(|l| l.trim().strip_prefix("pub fn "))
        .filter(|rest| rest.contains("(ctx: &KernelCtx<'_>) -> GpuResult<()>"))
        .filter_map(|rest| rest.split('(').next().map(str::to_string))
        .collect()
}

#[test]
fn every_twin_function_is_in_the_manifest() {
    let mut found = 0;
    for (module, source) in SOURCES {
        for name in twin_functions(source) {
            found += 1;
            assert!(
                metrale_kernel_abi::kernel_index(module, &name).is_some(),
                "cpu/kernels/{module}: `{name}` takes a KernelCtx but the manifest lists no \
                 `{module}::{name}`"
            );
        }
    }
    assert_eq!(
        found,
        metrale_kernel_abi::KERNELS.len(),
        "one twin per kernel"
    );
    assert_eq!(
        twin_functions("pub fn rms_norm(ctx: &KernelCtx<'_>) -> GpuResult<()> {"),
        ["rms_norm"]
    );
}

#[test]
fn every_manifest_kernel_resolves_to_its_twin() {
    let gpu = CpuBackend::default();
    for k in metrale_kernel_abi::KERNELS {
        gpu.kernel(k.module, k.name)
            .unwrap_or_else(|e| panic!("{}: {e}", k.label()));
    }
    assert_eq!(gpu.kernel_names().len(), metrale_kernel_abi::KERNELS.len());
}
