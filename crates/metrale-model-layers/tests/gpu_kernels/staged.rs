//! Stage images (the x operand `linear_tma` copies whole): the producers that write them beside
//! their rows (`silu_mul_staged`, `add_rms_norm_staged`) bitwise `permute_k32_tiles` of the
//! plain kernels' rows, and the helpers other checks read images with. Each check takes its
//! shapes, so `small` runs it at the sanitizer's sizes.

use metrale_kernel_abi::PermuteK32TilesParams;
use metrale_model_layers::ops::{Matrix, Norm};
use metrale_model_layers::ops_gemm::{LINEAR_SMALL_M_MAX, linear_staging_bytes, permute_geometry};

use super::harness::{self, Pair, Rng, S, Tolerance};

/// The staged producers at a decode and a prefill size (the sanitizer set).
pub(super) fn small(p: &Pair) {
    staged_producers(p, &mut Rng::new(1007), &[(130, 256), (5, 256)]);
}

/// The halfwords of rows `0..m` of stage images of `[m, k]` (the padding rows dropped).
pub(super) fn image_rows(img: &[u16], m: u32, k: u32) -> Vec<u16> {
    let steps = k.div_ceil(64) as usize;
    let mut rows = Vec::new();
    for row in 0..m as usize {
        for j in 0..steps {
            let at = ((row / 128) * steps + j) * 8192 + (row % 128) * 64;
            rows.extend_from_slice(&img[at..at + 64]);
        }
    }
    rows
}

#[test]
fn staged_producers_write_the_images_permute_would() {
    // Prefill sizes (images only), and a decode size (the rows too).
    let shapes = [(130, 1024), (300, 4096), (64, 4096)];
    staged_producers(&Pair::new(), &mut Rng::new(12), &shapes);
}

/// `silu_mul_staged` and `add_rms_norm_staged` at `(m, k)` each: against the CPU, their rows
/// bitwise the plain kernels', their images bitwise those rows permuted.
fn staged_producers(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32)]) {
    for &(m, k) in shapes {
        let images = linear_staging_bytes(m, k);
        let case = format!("m={m} k={k}");
        // silu_mul: the staged kernel against silu_mul then permute_k32_tiles.
        let gu = p.upload(&rng.bf16s((m * 2 * k) as usize, -4.0, 4.0));
        let act = p.poisoned((m * k) as usize * 2);
        let staged = p.poisoned(images);
        let rows = p.poisoned((m * k) as usize * 2);
        let gate_up = |at: harness::At<'_>| Matrix::bf16(at(&gu), m, 2 * k);
        p.run(|o, at| {
            o.silu_mul_staged(S, at(&staged), Matrix::bf16(at(&rows), m, k), gate_up(at))
        });
        p.check_bf16("silu_mul_staged", &case, &staged, Tolerance::BF16);
        p.run_gpu(|o, at| o.silu_mul(S, Matrix::bf16(at(&act), m, k), gate_up(at)));
        if m <= LINEAR_SMALL_M_MAX {
            let rows_case = format!("{case} rows");
            p.check_bf16("silu_mul_staged", &rows_case, &rows, Tolerance::BF16);
            assert!(
                p.download_gpu::<u16>(&rows) == p.download_gpu::<u16>(&act),
                "silu_mul_staged {case}: its rows differ from silu_mul's"
            );
        }
        let permuted = permuted_images(p, &act, m, k);
        assert!(
            image_rows(&p.download_gpu::<u16>(&staged), m, k) == image_rows(&permuted, m, k),
            "silu_mul_staged {case}: the images differ from silu_mul's rows permuted"
        );
        // add_rms_norm: the staged kernel's rows and images against the plain kernel's.
        let residual = rng.f32s((m * k) as usize, -2.0, 2.0);
        let (r1, r2) = (p.upload(&residual), p.upload(&residual));
        let delta = p.upload(&rng.bf16s((m * k) as usize, -1.0, 1.0));
        let w = p.upload(&rng.bf16s(k as usize, 0.5, 1.5));
        let (out1, out2) = (
            p.poisoned((m * k) as usize * 2),
            p.poisoned((m * k) as usize * 2),
        );
        let staged = p.poisoned(images);
        let norm = |at: harness::At<'_>| Norm {
            w: at(&w),
            eps: 1e-6,
            unit_offset: true,
        };
        let operands = |at: harness::At<'_>, r, out| {
            (
                Matrix::f32(at(r), m, k),
                Matrix::bf16(at(&delta), m, k),
                Matrix::bf16(at(out), m, k),
            )
        };
        p.run(|o, at| o.add_rms_norm_staged(S, operands(at, &r1, &out1), at(&staged), &norm(at)));
        p.check_bf16("add_rms_norm_staged", &case, &out1, Tolerance::BF16);
        p.check_bf16(
            "add_rms_norm_staged",
            &format!("{case} images"),
            &staged,
            Tolerance::BF16,
        );
        p.run_gpu(|o, at| {
            let (r, d, out) = operands(at, &r2, &out2);
            o.add_rms_norm(S, r, d, out, &norm(at))
        });
        assert!(
            p.download_gpu::<u16>(&out1) == p.download_gpu::<u16>(&out2),
            "add_rms_norm_staged {case}: rows differ from add_rms_norm's"
        );
        let permuted = permuted_images(p, &out2, m, k);
        assert!(
            image_rows(&p.download_gpu::<u16>(&staged), m, k) == image_rows(&permuted, m, k),
            "add_rms_norm_staged {case}: the images differ from add_rms_norm's rows permuted"
        );
    }
}

/// `permute_k32_tiles` of `x [m, k]` on the GPU: the images' halfwords.
pub(super) fn permuted_images(p: &Pair, x: &harness::Buf, m: u32, k: u32) -> Vec<u16> {
    permuted_pair(p, x, m, k).0
}

/// `permute_k32_tiles` of `x [m, k]` on both sides: the images' halfwords, `(cuda, cpu)`.
pub(super) fn permuted_pair(p: &Pair, x: &harness::Buf, m: u32, k: u32) -> (Vec<u16>, Vec<u16>) {
    let images = p.poisoned(linear_staging_bytes(m, k));
    p.launch(
        ("gemm", "permute_k32_tiles"),
        &permute_geometry(m, k),
        |at| PermuteK32TilesParams {
            out: at(&images),
            x: at(x),
            m,
            k,
        },
    );
    p.download::<u16>(&images)
}
