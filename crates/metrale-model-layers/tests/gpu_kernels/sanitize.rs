//! The sanitizer set: every family's checks at small shapes, on one `Pair`, then a check that
//! they launched every kernel of the manifest. `run.sh` runs this test alone under
//! compute-sanitizer's memcheck and racecheck (`gpu_kernels sanitizer_set`), where the full
//! shapes would take far longer than the sanitizers' budget; the small shapes still reach each
//! kernel's code paths: the GEMM family's decode and prefill kernels (narrow, wide, tiled,
//! `linear_tma`, `linear_stream_tma` from rows and from images), the cluster and the block
//! decode attention and the prefill attention (plain and staged, vector and scalar paths), the
//! GDN rule's recurrent, streamed, chunked and verify kernels on its fast and general paths, the
//! MoE kernels, the staged producers and the fused kernels.

use metrale_kernel_abi::KERNELS;

use super::harness::Pair;

#[test]
fn sanitizer_set_reaches_every_kernel() {
    let p = Pair::new();
    super::rows::small(&p);
    super::linear::small(&p);
    super::attention::small(&p);
    super::hybrid::small(&p);
    super::moe::small(&p);
    super::fused::small(&p);
    let launched = p.cuda.launched();
    let missing: Vec<String> = KERNELS
        .iter()
        .map(|k| k.label())
        .filter(|k| !launched.contains(k))
        .collect();
    assert!(
        missing.is_empty(),
        "the sanitizer set launched no {missing:?}"
    );
    println!(
        "kernel-check {:<18} {:<44} {} kernels launched ok",
        "sanitizer_set",
        "every kernel of the manifest",
        launched.len()
    );
}
