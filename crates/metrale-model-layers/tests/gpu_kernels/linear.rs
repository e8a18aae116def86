//! The `linear` family against its CPU twins and itself: every kernel (narrow, wide, tiled,
//! `linear_tma`) bitwise the others at every m, and rows independent of the rows beside them.
//! Each check takes its shapes, so `small` runs the same checks at the sanitizer's sizes.

use half::bf16;
use metrale_gpu_runtime::{DType, DevicePtr, LaunchConfig, Residency};
use metrale_kernel_abi::{LinearParams, LinearStreamTmaParams, LinearTmaParams};
use metrale_model_layers::ops::Matrix;
use metrale_model_layers::ops_gemm::{
    LINEAR_NARROW_THREADS, LINEAR_SMALL_M_MAX, LinearPath, linear_geometry,
    linear_stream_tma_geometry, linear_stream_tma_room, linear_stream_tma_rows,
    linear_tma_geometry, segments_are_whole_stages,
};

use super::harness::{self, Pair, Rng, S, Tolerance};
use super::staged::permuted_images;

/// `x [m, k]`, `w [n, k]` scaled so outputs are of order one.
fn linear_inputs(rng: &mut Rng, m: u32, n: u32, k: u32) -> (Vec<bf16>, Vec<bf16>) {
    let s = (3.0 / k as f32).sqrt();
    (
        rng.bf16s((m * k) as usize, -1.0, 1.0),
        rng.bf16s((n * k) as usize, -s, s),
    )
}

/// Every check below at small shapes (the sanitizer set): the launchers' decode and prefill
/// paths, every kernel of the family directly (a k of whole stages, so `linear_stream_tma` also
/// reads stage images; only `with_stream_tma`, which the racecheck set leaves out).
pub(super) fn small(p: &Pair, with_stream_tma: bool) {
    let rng = &mut Rng::new(1002);
    launcher_paths(p, rng, &[(3, 136, 96), (130, 70, 128)]);
    kernels_agree(p, rng, &[(3, 136, 96), (20, 72, 2048)], with_stream_tma);
}

#[test]
fn linear_matches_on_both_paths_and_odd_shapes() {
    let shapes = [
        (1u32, 4096u32, 4096u32),
        (3, 1000, 1003),
        (16, 520, 256),
        (2, 512, 12288),
        (64, 300, 1000),
        (17, 1000, 4096),
        (33, 136, 520),
        (65, 260, 520),
        (48, 520, 1024),
        (200, 1030, 4096),
        (129, 70, 77),
        // `linear_tma` (with a staging buffer): segments ending with stages, a partial last
        // stage, an odd chunk count (segments ending inside stages).
        (140, 520, 4096),
        (300, 264, 1000),
        (257, 136, 96),
    ];
    launcher_paths(&Pair::new(), &mut Rng::new(7), &shapes);
}

/// `linear` and `linear_f32out` through the launchers at `(m, n, k)` each: against the CPU,
/// run to run, and (prefill sizes with k a multiple of 8) through `linear_tma` bitwise the
/// tiled kernel.
fn launcher_paths(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    for &(m, n, k) in shapes {
        let (x, w) = linear_inputs(rng, m, n, k);
        let (x, w) = (p.upload(&x), p.upload(&w));
        let out = p.poisoned((m * n) as usize * 2);
        let logits = p.poisoned((m * n) as usize * 4);
        let case = format!("m={m} n={n} k={k}");
        let views = |at: harness::At<'_>, out: &harness::Buf, f32out: bool| {
            let out = if f32out {
                Matrix::f32(at(out), m, n)
            } else {
                Matrix::bf16(at(out), m, n)
            };
            (out, Matrix::bf16(at(&x), m, k), Matrix::bf16(at(&w), n, k))
        };
        p.run(|o, at| {
            let (out, x, w) = views(at, &out, false);
            o.linear(S, out, x, w)
        });
        p.check_bf16("linear", &case, &out, Tolerance::BF16);
        let f32out = |o: &metrale_model_layers::Ops, at: harness::At<'_>, out: &harness::Buf| {
            let (out, x, w) = views(at, out, true);
            o.linear_f32out(S, out, x, w)
        };
        p.run(|o, at| f32out(o, at, &logits));
        p.check_f32("linear_f32out", &case, &logits, Tolerance::F32_DOT);
        let first = p.download_gpu::<u32>(&logits);
        p.run_gpu(|o, at| f32out(o, at, &logits));
        assert!(
            first == p.download_gpu::<u32>(&logits),
            "linear_f32out {case}: a second run differs"
        );
        if m > LINEAR_SMALL_M_MAX && k.is_multiple_of(8) {
            // The same call through `linear_tma` and its twin: close to the CPU, bitwise the
            // tiled kernel.
            p.stage_linear(Some((m, k)));
            let tma = p.poisoned((m * n) as usize * 4);
            p.run(|o, at| f32out(o, at, &tma));
            p.check_f32("linear_f32out(tma)", &case, &tma, Tolerance::F32_DOT);
            assert!(
                first == p.download_gpu::<u32>(&tma),
                "linear_f32out {case}: linear_tma differs bitwise from linear"
            );
            p.stage_linear(None);
        }
    }
}

#[test]
fn linear_rows_do_not_depend_on_how_many_rows_share_the_launch() {
    let p = Pair::new();
    let mut rng = Rng::new(8);
    let (n, k) = (264u32, 1000u32);
    let big_m = 200u32;
    let (x, w) = linear_inputs(&mut rng, big_m, n, k);
    let (xb, wb) = (p.upload(&x), p.upload(&w));
    // Prefill-sized launches run `linear_tma`, as in a model.
    p.stage_linear(Some((big_m, k)));
    let full = p.poisoned((big_m * n) as usize * 4);
    let f32out = |o: &metrale_model_layers::Ops, out: DevicePtr, x: DevicePtr, m: u32| {
        let w = Matrix::bf16(wb.gpu, n, k);
        o.linear_f32out(S, Matrix::f32(out, m, n), Matrix::bf16(x, m, k), w)
    };
    p.run_gpu(|o, at| f32out(o, at(&full), at(&xb), big_m));
    let full = p.download_gpu::<u32>(&full);
    // The same rows, launched in smaller batches (both paths), each starting at a row offset.
    for (start, m) in [
        (0u32, 1u32),
        (7, 1),
        (13, 5),
        (20, 16),
        (21, 17),
        (60, 33),
        (40, 64),
        (100, 65),
        (199, 1),
        (3, 130),
    ] {
        let xs = p.upload(&x[(start * k) as usize..((start + m) * k) as usize]);
        let out = p.poisoned((m * n) as usize * 4);
        p.run_gpu(|o, at| f32out(o, at(&out), at(&xs), m));
        let got = p.download_gpu::<u32>(&out);
        assert!(
            got[..] == full[(start * n) as usize..((start + m) * n) as usize],
            "rows {start}..{} differ bitwise between m={m} and m={big_m}",
            start + m
        );
    }
    println!(
        "kernel-check {:<18} {:<44} bitwise equal for m in 1..=200 ok",
        "linear(batch-inv)",
        format!("n={n} k={k}")
    );
}

/// Blocks of the narrow kernel `gemm::<name>` resident at once, as the launcher asks.
fn resident_blocks(p: &Pair, name: &str) -> u32 {
    let gpu = p.gpu.as_ref();
    let kernel = gpu.kernel("gemm", name).expect("gemm kernel resolves");
    let config = LaunchConfig::grid2(1, 1, LINEAR_NARROW_THREADS);
    gpu.max_resident(kernel, &config, Residency::Blocks)
        .expect("CUDA knows its occupancy")
        .expect("the occupancy query runs")
}

/// `gemm::<name>`'s path, as `launch_gemm` launches it.
fn gemm_path(name: &str) -> LinearPath {
    if name.starts_with("linear_stream_wide") {
        LinearPath::Wide
    } else if name.starts_with("linear_stream_b4") {
        LinearPath::NarrowB4
    } else if name.starts_with("linear_stream") {
        LinearPath::Narrow
    } else {
        LinearPath::Tiled
    }
}

/// Launch `gemm::<name>` directly (bypassing the launcher's choice of kernel by m), with the
/// geometry that kernel expects; a narrow kernel on `resident` persistent blocks (or as many as
/// there are units).
fn launch_gemm(
    p: &Pair,
    name: &str,
    out: &harness::Buf,
    x: &harness::Buf,
    w: &harness::Buf,
    mnk: (u32, u32, u32),
    resident: u32,
) {
    let (m, n, k) = mnk;
    let cfg = linear_geometry(gemm_path(name), m, n, resident);
    let params = LinearParams {
        out: out.gpu,
        x: x.gpu,
        w: w.gpu,
        m,
        n,
        k,
    };
    p.launch_gpu(("gemm", name), &cfg, &params);
}

/// Where `gemm::linear_tma` or `gemm::linear_stream_tma` reads x from.
#[derive(Clone, Copy)]
enum MappedX<'a> {
    /// `linear_tma`: x's stage images, and the tile counter its blocks claim tiles from (or
    /// none: each walks its share).
    Images(&'a harness::Buf, Option<&'a harness::Buf>),
    /// `linear_stream_tma`: x's rows, and its stage images or none.
    Rows(&'a harness::Buf, Option<&'a harness::Buf>),
}

/// `gemm::linear_tma` or `gemm::linear_stream_tma` (by `x`; `_f32out` appended for 4-byte
/// outputs) of x and `w`, with the weight's tensor map from the backend, launched with `cfg`.
/// The output's halfwords.
fn launch_mapped(
    p: &Pair,
    cfg: &LaunchConfig,
    bytes: usize,
    x: MappedX<'_>,
    w: &harness::Buf,
    (m, n, k): (u32, u32, u32),
) -> Vec<u16> {
    let map = p.upload(
        &p.gpu
            .tensor_map_2d(w.gpu, DType::Bf16, n, k, 128, 64)
            .expect("CUDA has tensor maps")
            .expect("the weight's map encodes"),
    );
    let out = p.poisoned((m * n) as usize * bytes);
    let suffix = if bytes == 4 { "_f32out" } else { "" };
    match x {
        MappedX::Images(xt, sched) => {
            let params = LinearTmaParams {
                out: out.gpu,
                xt: xt.gpu,
                w: w.gpu,
                wmap: map.gpu,
                sched: sched.map_or(DevicePtr::NULL, |b| b.gpu),
                m,
                n,
                k,
            };
            p.launch_gpu(("gemm", &format!("linear_tma{suffix}")), cfg, &params);
        }
        MappedX::Rows(rows, ximg) => {
            let params = LinearStreamTmaParams {
                out: out.gpu,
                x: rows.gpu,
                ximg: ximg.map_or(DevicePtr::NULL, |b| b.gpu),
                w: w.gpu,
                wmap: map.gpu,
                m,
                n,
                k,
            };
            let name = format!("linear_stream_tma{suffix}");
            p.launch_gpu(("gemm", &name), cfg, &params);
        }
    }
    p.download_gpu::<u16>(&out)
}

/// `permute_k32_tiles` then `gemm::linear_tma` (or `_f32out` for 4-byte outputs) directly, at
/// any m, on `blocks` blocks (0: a block a tile) walking their share of the tiles or, with
/// `claim`, claiming tiles from a counter, which the launch leaves at zero for the next (checked);
/// the output's halfwords.
fn linear_tma(
    p: &Pair,
    bytes: usize,
    x: &harness::Buf,
    w: &harness::Buf,
    (m, n, k): (u32, u32, u32),
    blocks: u32,
    claim: bool,
) -> Vec<u16> {
    let images = p.upload(&permuted_images(p, x, m, k));
    let cfg = linear_tma_geometry(m, n, blocks);
    let sched = claim.then(|| p.upload(&[0u32; 2]));
    let out = launch_mapped(
        p,
        &cfg,
        bytes,
        MappedX::Images(&images, sched.as_ref()),
        w,
        (m, n, k),
    );
    if let Some(sched) = &sched {
        assert_eq!(
            p.download_gpu::<u32>(sched),
            [0, 0],
            "m={m} n={n} k={k}: linear_tma on {blocks} blocks left its tile counter set"
        );
    }
    out
}

/// `gemm::linear_stream_tma` (or `_f32out` for 4-byte outputs) directly on `clusters`
/// persistent clusters (a few, so each takes many tiles, or as many as are resident), from x's
/// rows or also its stage images (`x`); the output's halfwords.
fn linear_stream_tma(
    p: &Pair,
    bytes: usize,
    x: MappedX<'_>,
    w: &harness::Buf,
    (m, n, k): (u32, u32, u32),
    clusters: Option<u32>,
) -> Vec<u16> {
    let gpu = p.gpu.as_ref();
    let clusters = clusters.unwrap_or_else(|| {
        let kernel = gpu.kernel("gemm", "linear_stream_tma").expect("resolves");
        let config = linear_stream_tma_geometry(n, 1, 1);
        gpu.max_resident(kernel, &config, Residency::Clusters)
            .expect("CUDA reports resident clusters")
            .expect("the query succeeds")
    });
    let (_, row_blocks) = linear_stream_tma_rows(m, k).expect("the kernel has room");
    let cfg = linear_stream_tma_geometry(n, row_blocks, clusters);
    launch_mapped(p, &cfg, bytes, x, w, (m, n, k))
}

/// The stage images of `x [m, k]` (m <= 128: one row tile), uploaded with NaN in every row past
/// m.
fn nan_padded_images(p: &Pair, x: &harness::Buf, m: u32, k: u32) -> harness::Buf {
    let mut img = permuted_images(p, x, m, k);
    let steps = k.div_ceil(64) as usize;
    for j in 0..steps {
        for row in m as usize..128 {
            let at = j * 8192 + row * 64;
            img[at..at + 64].fill(0xFFFF);
        }
    }
    p.upload(&img)
}

#[test]
fn the_stream_and_tiled_linear_kernels_agree_bitwise_at_every_m() {
    let shapes = [
        (1u32, 1000u32, 4096u32),
        (8, 264, 1000),
        (17, 136, 520),
        (64, 300, 1000),
        (100, 264, 1000),
        (130, 70, 77),
        // Vector loads on the decode paths: segments of unequal batch counts, empty segments,
        // partial column and row tiles, m on both sides of 8 (x rows g + 8).
        (3, 136, 96),
        (16, 520, 256),
        (40, 300, 1024),
        (64, 1000, 4096),
        (9, 4100, 12288),
        // The wide kernel's clusters: fewer segments than blocks (k = 64: two), unaligned
        // operands, a long k, a last tile of few columns.
        (33, 136, 64),
        (20, 136, 77),
        (48, 1000, 12288),
        // `linear_stream_tma`: an odd chunk count in a segment (k = 4104: 129 chunks, segments of
        // 17), N of 8, 16, 32 and 64 rows, 12288 inputs at 32 rows and at 64 (two row blocks of
        // 32; also 48 above: a second block of 16 real rows).
        (5, 1000, 4104),
        (32, 4100, 12288),
        (57, 520, 4096),
        (64, 1000, 12288),
        // `linear_tma` too: segments ending with stages (k = 4096, 12288), a partial last stage
        // (k = 1000), segments ending inside stages (k = 96: three chunks), partial row and
        // column tiles.
        (129, 1000, 4096),
        (300, 264, 1000),
        (257, 136, 96),
        (200, 4100, 12288),
    ];
    kernels_agree(&Pair::new(), &mut Rng::new(11), &shapes, true);
    println!(
        "kernel-check {:<18} {:<44} bitwise equal, m in 1..=130 ok",
        "linear(kernels)", "tiled = stream = b4 = wide = tma = stream_tma, every m"
    );
}

/// Every kernel of the family launched directly at `(m, n, k)` each, bitwise the tiled kernel:
/// the narrow ones on one, three and every resident block, `linear_tma` from x's images
/// (k a multiple of 8) on a block a tile, one block and three, `linear_stream_tma` from x's rows
/// and images on one, three and every resident cluster (where it has room).
fn kernels_agree(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)], with_stream_tma: bool) {
    for &(m, n, k) in shapes {
        let (x, w) = linear_inputs(rng, m, n, k);
        let (x, w) = (p.upload(&x), p.upload(&w));
        for (names, bytes) in [
            (
                [
                    "linear_f32out",
                    "linear_stream_f32out",
                    "linear_stream_b4_f32out",
                    "linear_stream_wide_f32out",
                ],
                4,
            ),
            (
                [
                    "linear",
                    "linear_stream",
                    "linear_stream_b4",
                    "linear_stream_wide",
                ],
                2,
            ),
        ] {
            let mut results: Vec<(String, Vec<u16>)> = Vec::new();
            for name in names {
                // The narrow kernels on one block (every unit in turn), three, and as many as
                // are resident.
                let narrow = matches!(gemm_path(name), LinearPath::Narrow | LinearPath::NarrowB4);
                let counts = if narrow {
                    vec![1, 3, resident_blocks(p, name)]
                } else {
                    vec![0]
                };
                for blocks in counts {
                    let out = p.poisoned((m * n) as usize * bytes);
                    launch_gemm(p, name, &out, &x, &w, (m, n, k), blocks);
                    let label = if narrow {
                        format!("{name} on {blocks} blocks")
                    } else {
                        name.to_string()
                    };
                    results.push((label, p.download_gpu::<u16>(&out)));
                }
            }
            for (label, got) in results.iter().skip(1) {
                assert!(
                    *got == results[0].1,
                    "m={m} n={n} k={k}: {label} differs bitwise from {}",
                    names[0]
                );
            }
            let reference = &results[0].1;
            if k.is_multiple_of(8) {
                // A block a tile (the engine's grid wherever the tiles fit at once, as at every
                // shape here), and one and three blocks taking many tiles each, walking their
                // share or claiming them from a counter.
                for blocks in [0, 1, 3] {
                    for claim in [false, true] {
                        let tma = linear_tma(p, bytes, &x, &w, (m, n, k), blocks, claim);
                        assert!(
                            tma == *reference,
                            "m={m} n={n} k={k}: linear_tma on {blocks:?} blocks (claiming: \
                             {claim}) differs bitwise from {}",
                            names[0]
                        );
                    }
                }
            }
            if with_stream_tma && linear_stream_tma_room(m, k) {
                // From x's rows, and (where every k segment is whole stages) from its stage
                // images, whose rows past m hold NaN: what a decode step finds there is stale.
                let images = segments_are_whole_stages(k).then(|| nan_padded_images(p, &x, m, k));
                for ximg in [None, images.as_ref()] {
                    for clusters in [Some(1), Some(3), None] {
                        let from = MappedX::Rows(&x, ximg);
                        let got = linear_stream_tma(p, bytes, from, &w, (m, n, k), clusters);
                        assert!(
                            got == *reference,
                            "m={m} n={n} k={k}: linear_stream_tma on {clusters:?} clusters \
                             (images: {}) differs bitwise from {}",
                            ximg.is_some(),
                            names[0]
                        );
                    }
                }
            }
            // Poison is all-ones: a NaN in either format, which no output of finite inputs is.
            assert!(
                reference
                    .chunks(bytes / 2)
                    .all(|e| e.iter().any(|&h| h != 0xFFFF)),
                "m={m} n={n} k={k}: an output of {} was not written",
                names[0]
            );
        }
    }
}
