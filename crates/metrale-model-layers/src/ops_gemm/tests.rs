//! The `linear` launchers' choices and refusals, on the CPU backend.

use std::sync::Arc;

use metrale_gpu_runtime::{CpuBackend, GpuBackend, KernelHandle};

use super::*;
use crate::circuit_exec::Recorder;
use crate::ops::Norm;

/// A CPU backend, launchers over it and its stream.
fn cpu() -> (Arc<dyn GpuBackend>, Ops, StreamHandle) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let ops = Ops::new(gpu.clone()).expect("kernels resolve");
    let s = gpu.default_stream();
    (gpu, ops, s)
}

/// The kernels `f` launches through launchers recording over `ops`.
fn kernels_of(ops: &Ops, f: impl Fn(&Ops) -> GpuResult<()>) -> Vec<KernelHandle> {
    let (recorder, recording) = Recorder::over(ops);
    f(&recording).expect("the launches record");
    recorder.take().into_iter().map(|l| l.kernel).collect()
}

#[test]
fn linear_tma_runs_where_its_map_can_be_made_and_the_tiled_kernel_elsewhere() {
    let (gpu, ops, s) = cpu();
    let (m, n, k) = (130u32, 8u32, 64u32);
    let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
    let (x, out) = (alloc((m * k * 2) as usize), alloc((m * n * 2) as usize));
    let (w1, w2) = (alloc((n * k * 2) as usize), alloc((n * k * 2) as usize));
    let images = linear_staging_bytes(m, k);
    let base = alloc(LinearStaging::bytes(images, 4));
    let tma = vec![ops.k.permute_k32_tiles, ops.k.linear_tma];
    let tiled = vec![ops.k.linear];
    let linear = |w: DevicePtr| {
        move |o: &Ops| {
            let w = Matrix::bf16(w, n, k);
            o.linear(s, Matrix::bf16(out, m, n), Matrix::bf16(x, m, k), w)
        }
    };

    // Without staging memory, and with it while the weight's map has no slot left.
    assert_eq!(kernels_of(&ops, linear(w1)), tiled);
    ops.set_linear_staging(Some(LinearStaging::at(base, images, 1)));
    assert_eq!(kernels_of(&ops, linear(w1)), tma);
    assert_eq!(kernels_of(&ops, linear(w2)), tiled, "the one slot is w1's");
    assert_eq!(kernels_of(&ops, linear(w1)), tma, "w1's map stays");

    // While the stream captures a graph no map can be uploaded: the tiled kernel serves, and
    // the launch does not fail. Afterwards the map is made.
    ops.set_linear_staging(Some(LinearStaging::at(base, images, 4)));
    gpu.begin_capture(s).expect("capture");
    assert_eq!(kernels_of(&ops, linear(w2)), tiled);
    let graph = gpu.end_capture(s).expect("capture ends");
    gpu.destroy_graph(graph).expect("destroy");
    assert_eq!(kernels_of(&ops, linear(w2)), tma);

    // A producer stages prefill-sized calls with k a multiple of 64 (and decode sizes whose
    // segments are whole stages: not k = 64, two chunks for eight segments).
    let staging = |m: u32, k: u32| {
        ops.linear_staging(s, Matrix::bf16(w1, n, k), m)
            .expect("no error")
    };
    assert_eq!(staging(m, k), Some(base));
    assert_eq!(staging(LINEAR_SMALL_M_MAX, k), None);
    assert_eq!(staging(m, 32), None);
    assert_eq!(staging(4 * m, k), None, "the images would not fit");
    // Without a map (here, no slots), a staged projection is refused, not run unmapped.
    ops.set_linear_staging(Some(LinearStaging::at(base, images, 0)));
    let operands = (
        Matrix::bf16(out, m, n),
        Matrix::bf16(x, m, k),
        Matrix::bf16(w1, n, k),
    );
    let refused = ops.linear_staged(s, operands, base);
    assert!(
        matches!(&refused, Err(GpuError::KernelFailed { problem, .. }) if problem.contains("no tensor map")),
        "{refused:?}"
    );
}

#[test]
fn linear_stream_tma_serves_9_to_128_rows_in_four_row_blocks_at_most_where_a_map_exists() {
    let (gpu, ops, s) = cpu();
    let n = 8u32;
    let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
    let (x, out) = (alloc(64 * 12288 * 2), alloc(64 * 8 * 4));
    let w = alloc(8 * 12288 * 2);
    let tma = vec![ops.k.linear_stream_tma];
    let wide = vec![ops.k.linear_stream_wide];
    let linear = |m: u32, k: u32| {
        move |o: &Ops| {
            let w = Matrix::bf16(w, n, k);
            o.linear(s, Matrix::bf16(out, m, n), Matrix::bf16(x, m, k), w)
        }
    };

    // No staging memory, so no map: the wide kernel.
    assert_eq!(kernels_of(&ops, linear(32, 4096)), wide);
    let base = alloc(LinearStaging::bytes(0, 4));
    ops.set_linear_staging(Some(LinearStaging::at(base, 0, 4)));
    assert_eq!(kernels_of(&ops, linear(17, 4096)), tma);
    assert_eq!(kernels_of(&ops, linear(64, 4096)), tma);
    let f32out = kernels_of(&ops, |o: &Ops| {
        let (x, w) = (Matrix::bf16(x, 40, 4096), Matrix::bf16(w, n, 4096));
        o.linear_f32out(s, Matrix::f32(out, 40, n), x, w)
    });
    assert_eq!(f32out, vec![ops.k.linear_stream_tma_f32out]);
    // 12288 inputs: 32 rows fit, 64 go in two row blocks of 32 (x's whole segment would
    // take 192 KiB); a k whose 8 rows do not fit runs the wide kernel.
    assert_eq!(kernels_of(&ops, linear(32, 12288)), tma);
    assert_eq!(kernels_of(&ops, linear(64, 12288)), tma);
    assert_eq!(linear_stream_tma_rows(64, 12288), Some((32, 2)));
    assert_eq!(linear_stream_tma_rows(64, 4096), Some((64, 1)));
    assert_eq!(linear_stream_tma_rows(5, 4096), Some((8, 1)));
    assert_eq!(linear_stream_tma_rows(64, 40960), Some((8, 8)));
    assert!(
        !linear_stream_tma_fits(64, 40960),
        "eight row blocks: eight weight reads"
    );
    assert!(!linear_stream_tma_fits(129, 4096), "past the decode sizes");
    assert_eq!(linear_stream_tma_rows(1, 1 << 20), None);
    // Outside its rows, and k off the tensor map's 16-byte strides.
    assert_eq!(kernels_of(&ops, linear(9, 4096)), tma);
    assert_eq!(kernels_of(&ops, linear(8, 4096)), vec![ops.k.linear_stream]);
    assert_eq!(kernels_of(&ops, linear(65, 4096)), tma);
    assert_eq!(kernels_of(&ops, linear(128, 4096)), tma);
    assert_eq!(linear_stream_tma_rows(128, 4096), Some((64, 2)));
    // 128 rows of 12288 inputs: four row blocks of 32.
    assert_eq!(kernels_of(&ops, linear(128, 12288)), tma);
    assert_eq!(linear_stream_tma_rows(128, 12288), Some((32, 4)));
    assert_eq!(kernels_of(&ops, linear(32, 4092)), wide);
    assert!(linear_stream_tma_fits(64, 4096) && linear_stream_tma_fits(64, 12288));
    assert!(!linear_stream_tma_fits(64, 0) && !linear_stream_tma_fits(8, 4096));
    // Which clusters run a tile never changes its rows; at most one a tile of 128 columns
    // and row block, a multiple of the row blocks.
    assert_eq!(linear_stream_tma_geometry(4096, 1, 15).grid.0, 8 * 15);
    assert_eq!(linear_stream_tma_geometry(200, 1, 15).grid.0, 8 * 2);
    assert_eq!(linear_stream_tma_geometry(4096, 2, 15).grid.0, 8 * 14);
    assert_eq!(linear_stream_tma_geometry(4096, 2, 1).grid.0, 8 * 2);
}

#[test]
fn decode_projections_take_x_from_images_where_every_segment_is_whole_stages() {
    let (gpu, ops, s) = cpu();
    let (m, n, k) = (64u32, 8u32, 1024u32);
    let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
    let (x, out, w) = (
        alloc((m * k * 2) as usize),
        alloc((m * n * 2) as usize),
        alloc((n * k * 2) as usize),
    );
    let images = linear_staging_bytes(LINEAR_SMALL_M_MAX, k);
    let base = alloc(LinearStaging::bytes(images, 4));
    ops.set_linear_staging(Some(LinearStaging::at(base, images, 4)));
    let staging = |m: u32, k: u32| {
        ops.linear_staging(s, Matrix::bf16(w, n, k), m)
            .expect("no error")
    };
    // 17..128 rows of k = 1024 (32 chunks: segments of 4) stage; 16 rows, k = 1000 and
    // k = 256 (segments of one chunk) do not.
    for rows in [LINEAR_STREAM_TMA_IMAGES_M_MIN, 64, LINEAR_SMALL_M_MAX] {
        assert_eq!(staging(rows, k), Some(base), "{rows} rows");
    }
    assert_eq!(staging(16, k), None);
    assert_eq!(staging(m, 1000), None);
    assert_eq!(staging(m, 256), None);
    // The projection is `linear_stream_tma` given both x's rows and the images; where the
    // shape takes none, `linear_staged` refuses.
    let (recorder, recording) = Recorder::over(&ops);
    let operands = |m: u32| {
        (
            Matrix::bf16(out, m, n),
            Matrix::bf16(x, m, k),
            Matrix::bf16(w, n, k),
        )
    };
    recording
        .linear_staged(s, operands(m), base)
        .expect("staged");
    let launches = recorder.take();
    assert_eq!(launches.len(), 1);
    assert_eq!(launches[0].kernel, ops.k.linear_stream_tma);
    assert!(
        ops.linear_staged(s, operands(16), base).is_err(),
        "16 rows are not read from images"
    );
}

#[test]
fn staged_producers_refuse_operands_off_their_vector_path() {
    let (gpu, ops, s) = cpu();
    let (rows, cols) = (2u32, 64u32);
    let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
    let images = alloc(linear_staging_bytes(rows, cols));
    let gate_up = alloc((rows * 2 * cols * 2) as usize);
    gpu.memset(gate_up, 0x3c, (rows * 2 * cols * 2) as usize, s)
        .expect("fill");
    let problem = |r: GpuResult<()>| match r {
        Err(GpuError::KernelFailed { problem, .. }) => problem,
        other => panic!("expected a refusal, got {other:?}"),
    };
    let act = alloc((rows * cols * 2) as usize);
    let silu = |act: DevicePtr, gate_up: DevicePtr, cols: u32| {
        let act = Matrix::bf16(act, rows, cols);
        ops.silu_mul_staged(s, images, act, Matrix::bf16(gate_up, rows, 2 * cols))
    };
    silu(act, gate_up, cols).expect("aligned operands stage");
    let shifted = DevicePtr(gate_up.0 + 2);
    assert!(problem(silu(act, shifted, cols)).contains("gate_up"));
    assert!(problem(silu(DevicePtr(act.0 + 2), gate_up, cols)).contains("act"));
    assert!(problem(silu(act, gate_up, 60)).contains("60 columns"));

    let residual = alloc((rows * cols * 4) as usize);
    let (delta, out) = (
        alloc((rows * cols * 2) as usize),
        alloc((rows * cols * 2) as usize),
    );
    let w = alloc(cols as usize * 2);
    for (p, bytes) in [
        (residual, rows * cols * 4),
        (delta, rows * cols * 2),
        (w, cols * 2),
    ] {
        gpu.memset(p, 0x3c, bytes as usize, s).expect("fill");
    }
    let norm = |out: DevicePtr| {
        let operands = (
            Matrix::f32(residual, rows, cols),
            Matrix::bf16(delta, rows, cols),
            Matrix::bf16(out, rows, cols),
        );
        let norm = Norm {
            w,
            eps: 1e-6,
            unit_offset: false,
        };
        ops.add_rms_norm_staged(s, operands, images, &norm)
    };
    norm(out).expect("aligned operands stage");
    assert!(problem(norm(DevicePtr(out.0 + 8))).contains("out at"));
}

#[test]
fn fp8_linear_reads_its_weight_through_a_map_where_one_exists_and_dequantizes_elsewhere() {
    let (gpu, ops, s) = cpu();
    let n = 8u32;
    let alloc = |bytes: usize| gpu.alloc(bytes).expect("alloc");
    let (x, out) = (alloc(160 * 4096 * 2), alloc(160 * 8 * 2));
    let (w, scales) = (alloc(8 * 4096), alloc(fp8_scale_bytes(8, 4096, 7)));
    let scratch = alloc(8 * 4096 * 2);
    ops.set_fp8_scratch(Some(Fp8Scratch {
        ptr: scratch,
        bytes: 8 * 4096 * 2,
    }));
    let linear = |m: u32, k: u32| {
        move |o: &Ops| {
            let w = Matrix {
                scales: Some(crate::ops_view::BlockScales {
                    ptr: scales,
                    row_shift: 7,
                }),
                ..Matrix::new(w, DType::F8E4M3, n, k)
            };
            o.linear(s, Matrix::bf16(out, m, n), Matrix::bf16(x, m, k), w)
        }
    };
    let k = &ops.k;

    // No staging memory, so no map: the streaming decode kernels, and the bf16 kernel on the
    // dequantized weight at prefill sizes.
    assert_eq!(kernels_of(&ops, linear(4, 4096)), [k.linear_stream_fp8]);
    assert_eq!(
        kernels_of(&ops, linear(32, 4096)),
        [k.linear_stream_wide_fp8]
    );
    assert_eq!(
        kernels_of(&ops, linear(130, 4096)),
        [k.dequant_fp8, k.linear]
    );
    // With a slot for the map: the tensor-map kernels from 17 rows (x permuted into images at
    // prefill sizes); up to 16 rows stay on the narrow kernel, which is faster there.
    let images = linear_staging_bytes(160, 4096);
    let base = alloc(LinearStaging::bytes(images, 4));
    ops.set_linear_staging(Some(LinearStaging::at(base, images, 4)));
    for m in [8, 9, 16] {
        assert_eq!(
            kernels_of(&ops, linear(m, 4096)),
            [k.linear_stream_fp8],
            "{m} rows"
        );
    }
    for m in [17, 32, 128] {
        assert_eq!(
            kernels_of(&ops, linear(m, 4096)),
            [k.linear_stream_tma_fp8],
            "{m} rows"
        );
    }
    let mapped = [k.permute_k32_tiles, k.linear_tma_fp8];
    assert_eq!(kernels_of(&ops, linear(130, 4096)), mapped);
    // A k whose byte rows are off the map's 16-byte strides dequantizes (or streams).
    assert_eq!(
        kernels_of(&ops, linear(130, 4088)),
        [k.dequant_fp8, k.permute_k32_tiles, k.linear_tma]
    );
    assert_eq!(
        kernels_of(&ops, linear(32, 4088)),
        [k.linear_stream_wide_fp8]
    );

    // A producer stages x for the FP8 projection as for a bf16 one; the projection then reads
    // the images (no permute at prefill sizes), and refuses a shape that takes none.
    let fp8_w = |k: u32| Matrix {
        scales: Some(crate::ops_view::BlockScales {
            ptr: scales,
            row_shift: 7,
        }),
        ..Matrix::new(w, DType::F8E4M3, n, k)
    };
    let staging = |m: u32| ops.linear_staging(s, fp8_w(4096), m).expect("no error");
    assert_eq!(staging(130), Some(base));
    assert_eq!(staging(32), Some(base));
    assert_eq!(staging(16), None);
    let unscaled = Matrix::new(w, DType::F8E4M3, n, 4096);
    assert_eq!(
        ops.linear_staging(s, unscaled, 130).expect("no error"),
        None
    );
    let staged = |m: u32| {
        move |o: &Ops| {
            let operands = (
                Matrix::bf16(out, m, n),
                Matrix::bf16(x, m, 4096),
                fp8_w(4096),
            );
            o.linear_staged(s, operands, base)
        }
    };
    assert_eq!(kernels_of(&ops, staged(130)), [k.linear_tma_fp8]);
    assert_eq!(kernels_of(&ops, staged(32)), [k.linear_stream_tma_fp8]);
    assert!(
        staged(16)(&ops).is_err(),
        "16 rows are not read from images"
    );
}
