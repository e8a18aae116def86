//! The sanitizer sets: every family's checks at small shapes, on one `Pair`, then a check that
//! they launched every kernel of the manifest. `run.sh` runs them alone under compute-sanitizer
//! (`gpu_kernels sanitizer_set` under memcheck, `gpu_kernels racecheck_set` under racecheck),
//! where the full shapes would take far longer than the sanitizers' budget; the small shapes
//! still reach each kernel's code paths: the GEMM family's decode and prefill kernels (narrow,
//! wide, tiled, `linear_tma`, `linear_stream_tma` from rows and from images), the cluster and
//! the block decode attention and the prefill attention (plain and staged, walked and split,
//! vector and scalar paths), the GDN rule's recurrent, streamed, chunked and verify kernels on
//! its fast and general paths, the MoE kernels, the staged producers and the fused kernels.
//!
//! The racecheck set leaves out `linear_stream_tma` (and its FP8 twin): its consumer warpgroups
//! publish partials in shared memory that other blocks of the cluster read, ordered by mbarriers
//! the blocks arrive on remotely (`pready` / `pfree`, with fences restricted to shared memory).
//! racecheck does not follow that handshake and reports each partial as a hazard (also with
//! releasing arrivals), and excluding the kernel by name makes racecheck fail on it; the kernel is
//! held by memcheck and by its bitwise tests against the CPU twin instead.

use std::collections::BTreeSet;

use metrale_kernel_abi::KERNELS;

use super::harness::Pair;

/// The kernels the racecheck set leaves out.
const NOT_RACECHECKED: [&str; 3] = [
    "gemm::linear_stream_tma",
    "gemm::linear_stream_tma_f32out",
    "gemm::linear_stream_tma_fp8",
];

/// Run every family's small checks on one pair; the kernels of the manifest it did not launch.
fn run_set(with_stream_tma: bool) -> BTreeSet<String> {
    let p = Pair::new();
    super::rows::small(&p);
    super::linear::small(&p, with_stream_tma);
    super::staged::small(&p);
    super::fp8::small(&p, with_stream_tma);
    super::attention::small(&p);
    super::hybrid::small(&p);
    super::moe::small(&p);
    super::fused::small(&p);
    super::sampling::small(&p);
    let launched = p.cuda.launched();
    KERNELS
        .iter()
        .map(|k| k.label())
        .filter(|k| !launched.contains(k))
        .collect()
}

#[test]
fn sanitizer_set_reaches_every_kernel() {
    let missing = run_set(true);
    assert!(
        missing.is_empty(),
        "the sanitizer set launched no {missing:?}"
    );
    println!(
        "kernel-check {:<18} {:<44} {} kernels launched ok",
        "sanitizer_set",
        "every kernel of the manifest",
        KERNELS.len()
    );
}

#[test]
fn racecheck_set_reaches_every_kernel_but_linear_stream_tma() {
    let missing = run_set(false);
    let expected: BTreeSet<String> = NOT_RACECHECKED.iter().map(|k| k.to_string()).collect();
    assert_eq!(missing, expected, "the racecheck set's unlaunched kernels");
    println!(
        "kernel-check {:<18} {:<44} {} kernels launched ok",
        "racecheck_set",
        "every kernel but linear_stream_tma",
        KERNELS.len() - NOT_RACECHECKED.len()
    );
}
