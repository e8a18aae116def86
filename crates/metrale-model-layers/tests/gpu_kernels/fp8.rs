//! Block FP8 against its CPU twins and against bf16: `quantize_fp8` gives the host recipe's
//! bytes and scales, `dequant_fp8` the host's bf16, and `linear` of an FP8 weight (every path:
//! `linear_stream_fp8`, with its swapped-operand path at m <= 16 where k is a multiple of 2048,
//! and `linear_stream_wide_fp8` at decode sizes, dequantize-then-bf16 at prefill sizes, and with
//! staging memory for the weight's tensor map `linear_stream_tma_fp8` at 17..128 rows and
//! `linear_tma_fp8` above, where k is a multiple of 16) is bitwise `linear` of the dequantized
//! bf16 weight, with 128-row scale blocks and with a scale row per weight row.

use metrale_gpu_runtime::DType;
use metrale_gpu_runtime::fp8::{self, FP8_BLOCK_ROW_SHIFT};
use metrale_model_layers::ops::{BlockScales, Matrix};
use metrale_model_layers::ops_gemm::{
    FP8_STREAM_M_MAX, FP8_STREAM_TMA_M_MIN, Fp8Scratch, fp8_scale_bytes,
};

use super::harness::{Buf, Pair, Rng, S, Tolerance};

/// Every check at small shapes (the sanitizer set): narrow decode calls (the swapped-operand
/// path at k = 2048 among them) and wide ones (with cp.async copies and with plain loads) and a
/// prefill-sized call, with partial blocks and both scale layouts. Without `with_stream_tma`
/// (the racecheck set) the staged paths at the rows `linear_stream_tma_fp8` serves are left out.
pub(super) fn small(p: &Pair, with_stream_tma: bool) {
    let rng = &mut Rng::new(1003);
    let shapes = [
        (3, 136, 200, false),
        (2, 40, 2048, true),
        (16, 40, 2048, false),
        (24, 136, 256, true),
        (40, 200, 200, false),
        (40, 200, 208, false),
        (140, 72, 96, true),
    ];
    fp8_paths(p, rng, &shapes, with_stream_tma);
}

#[test]
fn fp8_linear_is_the_bf16_linear_of_its_dequantized_weight_on_every_path() {
    let shapes = [
        (1u32, 4096u32, 4096u32, false),
        (5, 1000, 4096, true),
        (8, 2056, 2048, false),
        (12, 1000, 4096, true),
        (1, 1000, 1003, true),
        (8, 520, 256, false),
        (9, 6144, 4096, false),
        (16, 300, 1000, true),
        (17, 1024, 4096, false),
        (32, 4096, 4096, false),
        (64, 260, 520, true),
        (128, 1030, 1000, false),
        (129, 264, 1000, false),
        (300, 1024, 4096, false),
        (257, 136, 96, true),
        (40, 200, 208, true),
        (200, 130, 208, false),
    ];
    fp8_paths(&Pair::new(), &mut Rng::new(11), &shapes, true);
}

/// The FP8 view of `q` with `scales` (row shift `shift`) on one side.
pub(super) fn fp8_matrix(
    q: &Buf,
    scales: &Buf,
    shift: u32,
    (n, k): (u32, u32),
    at: super::harness::At<'_>,
) -> Matrix {
    Matrix {
        scales: Some(BlockScales {
            ptr: at(scales),
            row_shift: shift,
        }),
        ..Matrix::new(at(q), DType::F8E4M3, n, k)
    }
}

/// At `(m, n, k, per_row_scales)` each: `quantize_fp8` bitwise the host recipe on both sides,
/// `dequant_fp8` bitwise its twin, and `linear` of the FP8 weight close to its twin and bitwise
/// CUDA's `linear` of the dequantized weight: without the prefill scratch memory, with it, and
/// with staging memory (the tensor-map kernels; at decode rows only `with_stream_tma`).
fn fp8_paths(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32, bool)], with_stream_tma: bool) {
    for &(m, n, k, per_row) in shapes {
        let case = format!("m={m} n={n} k={k} per-row scales {per_row}");
        let s = 1.5 * (3.0 / k as f32).sqrt();
        let w = rng.bf16s((n * k) as usize, -s, s);
        let x = rng.bf16s((m * k) as usize, -1.0, 1.0);
        let (q_host, grid) = fp8::quantize(&w, (n as usize, k as usize));

        // quantize_fp8 on both sides: the host's bytes and scales exactly.
        let wb = p.upload(&w);
        let q = p.poisoned((n * k) as usize);
        let grid_buf = p.poisoned(fp8_scale_bytes(n, k, FP8_BLOCK_ROW_SHIFT));
        p.run(|o, at| {
            let out = fp8_matrix(&q, &grid_buf, FP8_BLOCK_ROW_SHIFT, (n, k), at);
            o.quantize_fp8(S, out, Matrix::bf16(at(&wb), n, k))
        });
        let (gq, cq) = p.download::<u8>(&q);
        assert!(
            gq == q_host && cq == q_host,
            "quantize_fp8 {case}: bytes differ from the host recipe"
        );
        let (gs, cs) = p.download::<u32>(&grid_buf);
        let host_bits: Vec<u32> = grid.iter().map(|v| v.to_bits()).collect();
        assert!(
            gs == host_bits && cs == host_bits,
            "quantize_fp8 {case}: scales differ"
        );

        // The scale layout under test: the grid, or a scale row per weight row.
        let (shift, scales) = if per_row {
            let kb = fp8::scale_cols(k as usize);
            let rows: Vec<f32> = (0..n as usize)
                .flat_map(|r| grid[(r >> FP8_BLOCK_ROW_SHIFT) * kb..][..kb].to_vec())
                .collect();
            (0, p.upload(&rows))
        } else {
            (FP8_BLOCK_ROW_SHIFT, grid_buf)
        };

        // dequant_fp8: bitwise its twin.
        let deq = p.poisoned((n * k) as usize * 2);
        p.run(|o, at| {
            o.dequant_fp8(
                S,
                Matrix::bf16(at(&deq), n, k),
                fp8_matrix(&q, &scales, shift, (n, k), at),
            )
        });
        let (gd, cd) = p.download::<u16>(&deq);
        assert!(gd == cd, "dequant_fp8 {case}: CUDA differs from its twin");

        // linear: close to the twin; bitwise CUDA's bf16 linear on the dequantized weight.
        let xb = p.upload(&x);
        let bf16_out = p.poisoned((m * n) as usize * 2);
        p.run_gpu(|o, at| {
            o.linear(
                S,
                Matrix::bf16(at(&bf16_out), m, n),
                Matrix::bf16(at(&xb), m, k),
                Matrix::bf16(at(&deq), n, k),
            )
        });
        let want = p.download_gpu::<u16>(&bf16_out);
        let scratch = p.poisoned((n * k) as usize * 2);
        for (with_scratch, staged) in [(false, false), (true, false), (false, true)] {
            let stream_tma = (FP8_STREAM_TMA_M_MIN..=FP8_STREAM_M_MAX).contains(&m);
            if staged && stream_tma && !with_stream_tma {
                continue;
            }
            let set = |on: bool| {
                for (ops, ptr) in [(&p.cpu_ops, scratch.cpu), (&p.gpu_ops, scratch.gpu)] {
                    ops.set_fp8_scratch(on.then_some(Fp8Scratch {
                        ptr,
                        bytes: scratch.bytes,
                    }));
                }
            };
            set(with_scratch);
            p.stage_linear(staged.then_some((m, k)));
            let out = p.poisoned((m * n) as usize * 2);
            p.run(|o, at| {
                let w = fp8_matrix(&q, &scales, shift, (n, k), at);
                o.linear(
                    S,
                    Matrix::bf16(at(&out), m, n),
                    Matrix::bf16(at(&xb), m, k),
                    w,
                )
            });
            let label = format!("{case} scratch {with_scratch} staged {staged}");
            p.check_bf16("linear(fp8)", &label, &out, Tolerance::BF16);
            assert!(
                p.download_gpu::<u16>(&out) == want,
                "linear(fp8) {label}: differs bitwise from linear of the dequantized weight"
            );
            set(false);
            p.stage_linear(None);
        }
    }
}
