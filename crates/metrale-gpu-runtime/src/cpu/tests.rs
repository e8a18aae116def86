//! Tests of the CPU backend: memory checking, capture and replay, and every CPU kernel against a
//! naive f64 reference written independently of the kernel, on random inputs with poisoned
//! outputs.

use half::bf16;

use super::*;
use crate::backend::GpuBackendExt;

mod attention;

/// A seeded generator for test data (never zeros, distinct per element).
struct Data(u64);

impl Data {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.next() * scale).collect()
    }
    fn bf(&mut self, n: usize, scale: f32) -> Vec<bf16> {
        self.vec(n, scale).into_iter().map(bf16::from_f32).collect()
    }
}

fn tof(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

struct Rig {
    gpu: CpuBackend,
    s: StreamHandle,
}

impl Rig {
    fn new() -> Rig {
        Rig {
            gpu: CpuBackend::default(),
            s: StreamHandle::DEFAULT,
        }
    }
    fn put<T: bytemuck::Pod>(&self, v: &[T]) -> DevicePtr {
        self.gpu.alloc_upload(v, self.s).unwrap()
    }
    /// An output buffer, poisoned with 0xFF.
    fn out(&self, bytes: usize) -> DevicePtr {
        let p = self.gpu.alloc(bytes).unwrap();
        self.gpu.memset(p, 0xFF, bytes, self.s).unwrap();
        p
    }
    fn run(&self, module: &str, name: &str, args: &[KernelArg]) -> GpuResult<()> {
        let k = self.gpu.kernel(module, name)?;
        self.gpu
            .launch(k, &LaunchConfig::linear(1, 1), args, self.s)
    }
    fn get_bf(&self, p: DevicePtr, n: usize) -> Vec<f64> {
        tof(&self.gpu.download::<bf16>(p, n, self.s).unwrap())
    }
    fn get_f32(&self, p: DevicePtr, n: usize) -> Vec<f32> {
        self.gpu.download::<f32>(p, n, self.s).unwrap()
    }
}

fn assert_close(got: &[f64], want: &[f64], rel: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} (poison left?)");
        let tol = rel * w.abs().max(1.0);
        assert!((g - w).abs() <= tol, "{what}[{i}]: got {g}, want {w}");
    }
}

#[test]
fn out_of_bounds_and_aliasing_are_caught() {
    let r = Rig::new();
    let x = r.put(&[1.0f32; 4]);
    let out = r.out(4 * 2);
    let w = r.put(&[bf16::ONE; 4]);
    // rows = 2 reads 8 floats from a 4-float buffer.
    let e = r.run(
        "norm",
        "rms_norm",
        &[
            out.into(),
            x.into(),
            w.into(),
            2u32.into(),
            4u32.into(),
            1e-6f32.into(),
            0u32.into(),
        ],
    );
    assert!(matches!(e, Err(GpuError::InvalidAccess { .. })), "{e:?}");
    let e = r.run(
        "gemm",
        "linear",
        &[
            w.into(),
            w.into(),
            w.into(),
            1u32.into(),
            1u32.into(),
            4u32.into(),
        ],
    );
    assert!(matches!(e, Err(GpuError::Aliasing { .. })), "{e:?}");
    let e = r.run(
        "norm",
        "rms_norm",
        &[
            out.into(),
            x.into(),
            w.into(),
            1u32.into(),
            4u32.into(),
            1e-6f32.into(),
        ],
    );
    assert!(matches!(e, Err(GpuError::BadArgument { .. })), "{e:?}");
    assert!(matches!(
        r.gpu.kernel("norm", "nope"),
        Err(GpuError::UnknownKernel { .. })
    ));
    assert!(matches!(
        r.gpu.free(x.offset(4)),
        Err(GpuError::InvalidFree(_))
    ));
}

#[test]
fn capture_records_and_replay_reads_current_inputs() {
    let r = Rig::new();
    let s = r.gpu.create_stream().unwrap();
    let mut d = Data(3);
    let xv = d.vec(8, 1.0);
    let x = r.put(&xv);
    let w = r.put(&d.bf(8, 1.0));
    let out = r.out(16);
    let args: [KernelArg; 7] = [
        out.into(),
        x.into(),
        w.into(),
        1u32.into(),
        8u32.into(),
        1e-6f32.into(),
        0u32.into(),
    ];
    r.gpu.begin_capture(s).unwrap();
    r.gpu
        .launch(
            r.gpu.kernel("norm", "rms_norm").unwrap(),
            &LaunchConfig::linear(1, 1),
            &args,
            s,
        )
        .unwrap();
    assert!(
        r.gpu.synchronize(s).is_err(),
        "a sync is refused while capturing, as on CUDA"
    );
    assert!(
        r.gpu.copy_h2d(x, &[0u8; 4], s).is_err(),
        "host copies are refused while capturing"
    );
    let g = r.gpu.end_capture(s).unwrap();
    assert!(
        r.get_bf(out, 8).iter().all(|v| v.is_nan()),
        "capture must not run the launch"
    );
    r.gpu.launch_graph(g, s).unwrap();
    let first = r.get_bf(out, 8);
    r.run("norm", "rms_norm", &args).unwrap();
    assert_eq!(first, r.get_bf(out, 8), "replay equals eager");
    let x2: Vec<f32> = xv.iter().map(|v| v * -3.0 + 0.5).collect();
    r.gpu.upload(x, &x2, s).unwrap();
    r.gpu.launch_graph(g, s).unwrap();
    assert_ne!(first, r.get_bf(out, 8), "replay reads the new input");
    r.gpu.destroy_graph(g).unwrap();
    assert!(r.gpu.launch_graph(g, s).is_err());
}

fn ref_rms(x: &[f64], w: &[f64], eps: f64, unit: bool) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| v * inv * if unit { 1.0 + w } else { *w })
        .collect()
}

#[test]
fn rms_norm_and_add_rms_norm_match_the_reference_in_both_conventions() {
    let r = Rig::new();
    let mut d = Data(11);
    let (rows, cols) = (3usize, 40usize);
    for unit in [false, true] {
        let x = d.vec(rows * cols, 2.0);
        let delta = d.bf(rows * cols, 1.0);
        let w = d.bf(cols, 1.5);
        let (xp, dp, wp) = (r.put(&x), r.put(&delta), r.put(&w));
        let out = r.out(rows * cols * 2);
        let sc = [rows as u32, cols as u32];
        r.run(
            "norm",
            "rms_norm",
            &[
                out.into(),
                xp.into(),
                wp.into(),
                sc[0].into(),
                sc[1].into(),
                1e-5f32.into(),
                (unit as u32).into(),
            ],
        )
        .unwrap();
        let wf = tof(&w);
        let mut want = Vec::new();
        for row in x.chunks(cols) {
            want.extend(ref_rms(
                &row.iter().map(|&v| v as f64).collect::<Vec<_>>(),
                &wf,
                1e-5,
                unit,
            ));
        }
        assert_close(&r.get_bf(out, rows * cols), &want, 8e-3, "rms_norm");

        r.run(
            "norm",
            "add_rms_norm",
            &[
                xp.into(),
                dp.into(),
                wp.into(),
                out.into(),
                sc[0].into(),
                sc[1].into(),
                1e-5f32.into(),
                (unit as u32).into(),
            ],
        )
        .unwrap();
        let summed: Vec<f64> = x
            .iter()
            .zip(&delta)
            .map(|(a, b)| *a as f64 + b.to_f64())
            .collect();
        let got_res: Vec<f64> = r
            .get_f32(xp, rows * cols)
            .iter()
            .map(|&v| v as f64)
            .collect();
        assert_close(&got_res, &summed, 1e-6, "residual");
        let mut want = Vec::new();
        for row in summed.chunks(cols) {
            want.extend(ref_rms(row, &wf, 1e-5, unit));
        }
        assert_close(&r.get_bf(out, rows * cols), &want, 8e-3, "add_rms_norm");
    }
}

#[test]
fn linear_matches_a_naive_matmul() {
    let r = Rig::new();
    let mut d = Data(5);
    let (m, n, k) = (3usize, 7usize, 33usize);
    let x = d.bf(m * k, 1.0);
    let w = d.bf(n * k, 0.5);
    let (xp, wp) = (r.put(&x), r.put(&w));
    let out = r.out(m * n * 2);
    let out32 = r.out(m * n * 4);
    let sc: [KernelArg; 3] = [(m as u32).into(), (n as u32).into(), (k as u32).into()];
    r.run(
        "gemm",
        "linear",
        &[out.into(), xp.into(), wp.into(), sc[0], sc[1], sc[2]],
    )
    .unwrap();
    r.run(
        "gemm",
        "linear_f32out",
        &[out32.into(), xp.into(), wp.into(), sc[0], sc[1], sc[2]],
    )
    .unwrap();
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..k)
                .map(|t| x[i * k + t].to_f64() * w[j * k + t].to_f64())
                .sum();
        }
    }
    assert_close(&r.get_bf(out, m * n), &want, 8e-3, "linear");
    let got32: Vec<f64> = r.get_f32(out32, m * n).iter().map(|&v| v as f64).collect();
    assert_close(&got32, &want, 1e-5, "linear_f32out");
}

#[test]
fn linear_tma_on_stage_images_is_linear() {
    let r = Rig::new();
    let mut d = Data(6);
    // k = 200: seven chunks, the last partial and the last stage half empty; m = 130: a second
    // row tile of two rows.
    for (m, n, k) in [(130usize, 7usize, 200usize), (5, 9, 64)] {
        let x = d.bf(m * k, 1.0);
        let w = d.bf(n * k, 0.5);
        let (xp, wp) = (r.put(&x), r.put(&w));
        let img_bytes = super::kernels::gemm::stage_image_bytes(m, k);
        let img = r.out(img_bytes);
        let sc: [KernelArg; 3] = [(m as u32).into(), (n as u32).into(), (k as u32).into()];
        r.run(
            "gemm",
            "permute_k32_tiles",
            &[img.into(), xp.into(), sc[0], sc[2]],
        )
        .unwrap();
        // Layout: in row 0, pair 1 (k 2, 3) is the first 4 bytes of unit 1; pair 4 (k 8, 9) the
        // second of unit 0; row 1 swaps units 0 and 1 (the swizzle).
        let words = r.gpu.download::<u32>(img, img_bytes / 4, r.s).unwrap();
        let pair = |row: usize, p: usize| {
            x[row * k + 2 * p].to_bits() as u32 | (x[row * k + 2 * p + 1].to_bits() as u32) << 16
        };
        assert_eq!(words[4], pair(0, 1));
        assert_eq!(words[1], pair(0, 4));
        assert_eq!(words[32], pair(1, 1));
        // Past k (row 0, stage 3: chunk 6 holds pairs 96..99, position 0 of its units; chunk 7
        // is empty) and past m (rows 130..256) the images are zero.
        if k == 200 {
            let stage3 = &words[3 * 4096..3 * 4096 + 32];
            assert!(
                stage3
                    .iter()
                    .enumerate()
                    .all(|(i, &v)| (v == 0) == (i >= 16 || i % 4 != 0))
            );
        }
        assert!((m..m.div_ceil(128) * 128).all(|row| {
            let base = (row / 128) * k.div_ceil(64) * 4096 + (row % 128) * 32;
            words[base..base + 32].iter().all(|&v| v == 0)
        }));
        let map = r.out(128);
        for (name, via, bytes) in [
            ("linear", "linear_tma", 2),
            ("linear_f32out", "linear_tma_f32out", 4),
        ] {
            let (want, got) = (r.out(m * n * bytes), r.out(m * n * bytes));
            r.run(
                "gemm",
                name,
                &[want.into(), xp.into(), wp.into(), sc[0], sc[1], sc[2]],
            )
            .unwrap();
            r.run(
                "gemm",
                via,
                &[
                    got.into(),
                    img.into(),
                    wp.into(),
                    map.into(),
                    sc[0],
                    sc[1],
                    sc[2],
                ],
            )
            .unwrap();
            let want = r.gpu.download::<u8>(want, m * n * bytes, r.s).unwrap();
            let got = r.gpu.download::<u8>(got, m * n * bytes, r.s).unwrap();
            assert!(
                want == got,
                "{via} differs from {name} at m={m} n={n} k={k}"
            );
        }
    }
}

#[test]
fn staged_producers_write_what_permute_writes() {
    let r = Rig::new();
    let mut d = Data(7);
    let (m, k) = (3usize, 128usize);
    let bytes = super::kernels::gemm::stage_image_bytes(m, k);
    let sc: [KernelArg; 2] = [(m as u32).into(), (k as u32).into()];
    // The permuted natural rows, over zeros; the staged images over zeros too (the producers
    // leave padding alone, and here the padding is zero on both sides).
    let images_of = |x: DevicePtr| {
        let img = r.out(bytes);
        r.run(
            "gemm",
            "permute_k32_tiles",
            &[img.into(), x.into(), sc[0], sc[1]],
        )
        .unwrap();
        r.gpu.download::<u8>(img, bytes, r.s).unwrap()
    };
    let zeroed = || {
        let img = r.out(bytes);
        r.gpu.memset(img, 0, bytes, r.s).unwrap();
        img
    };
    let gu = r.put(&d.bf(m * 2 * k, 3.0));
    let act = r.out(m * k * 2);
    r.run(
        "activation",
        "silu_mul",
        &[act.into(), gu.into(), sc[0], sc[1]],
    )
    .unwrap();
    // Images only, then images and rows.
    let staged = zeroed();
    r.run(
        "activation",
        "silu_mul_staged",
        &[
            staged.into(),
            DevicePtr::NULL.into(),
            gu.into(),
            sc[0],
            sc[1],
        ],
    )
    .unwrap();
    assert!(r.gpu.download::<u8>(staged, bytes, r.s).unwrap() == images_of(act));
    let (staged, rows) = (zeroed(), r.out(m * k * 2));
    r.run(
        "activation",
        "silu_mul_staged",
        &[staged.into(), rows.into(), gu.into(), sc[0], sc[1]],
    )
    .unwrap();
    assert!(r.gpu.download::<u8>(staged, bytes, r.s).unwrap() == images_of(act));
    let rows_of = |p| r.gpu.download::<u8>(p, m * k * 2, r.s).unwrap();
    assert!(rows_of(rows) == rows_of(act), "silu_mul_staged's rows");

    let residual: Vec<f32> = d.vec(m * k, 2.0);
    let (res1, res2) = (r.put(&residual), r.put(&residual));
    let (delta, w) = (r.put(&d.bf(m * k, 1.0)), r.put(&d.bf(k, 1.0)));
    let (out1, out2) = (r.out(m * k * 2), r.out(m * k * 2));
    let tail: [KernelArg; 4] = [sc[0], sc[1], 1e-6f32.into(), 1u32.into()];
    r.run(
        "norm",
        "add_rms_norm",
        &[
            res1.into(),
            delta.into(),
            w.into(),
            out1.into(),
            tail[0],
            tail[1],
            tail[2],
            tail[3],
        ],
    )
    .unwrap();
    let staged = zeroed();
    r.run(
        "norm",
        "add_rms_norm_staged",
        &[
            res2.into(),
            delta.into(),
            w.into(),
            out2.into(),
            staged.into(),
            tail[0],
            tail[1],
            tail[2],
            tail[3],
        ],
    )
    .unwrap();
    assert_eq!(r.get_bf(out1, m * k), r.get_bf(out2, m * k));
    assert!(r.gpu.download::<u8>(staged, bytes, r.s).unwrap() == images_of(out1));
}

#[test]
fn embedding_gather_rows_silu_and_argmax() {
    let r = Rig::new();
    let mut d = Data(9);
    let (vocab, hidden) = (10usize, 6usize);
    let table = d.bf(vocab * hidden, 1.0);
    let ids = [7u32, 0, 7, 3];
    let (tp, ip) = (r.put(&table), r.put(&ids));
    let out = r.out(ids.len() * hidden * 4);
    r.run(
        "embed",
        "embedding_gather",
        &[
            out.into(),
            tp.into(),
            ip.into(),
            4u32.into(),
            (hidden as u32).into(),
            (vocab as u32).into(),
        ],
    )
    .unwrap();
    let got = r.get_f32(out, ids.len() * hidden);
    for (i, &id) in ids.iter().enumerate() {
        for j in 0..hidden {
            assert_eq!(
                got[i * hidden + j],
                table[id as usize * hidden + j].to_f32()
            );
        }
    }
    let bad = r.put(&[10u32]);
    assert!(
        r.run(
            "embed",
            "embedding_gather",
            &[
                out.into(),
                tp.into(),
                bad.into(),
                1u32.into(),
                (hidden as u32).into(),
                (vocab as u32).into()
            ]
        )
        .is_err()
    );

    let rows_out = r.out(2 * hidden * 2);
    let sel = r.put(&[2u32, 0]);
    r.run(
        "embed",
        "gather_rows",
        &[
            rows_out.into(),
            tp.into(),
            sel.into(),
            2u32.into(),
            (hidden as u32).into(),
            (vocab as u32).into(),
        ],
    )
    .unwrap();
    let got = r.get_bf(rows_out, 2 * hidden);
    assert_eq!(got[..hidden], tof(&table[2 * hidden..3 * hidden]));
    assert_eq!(got[hidden..], tof(&table[..hidden]));

    let ffn = 5usize;
    let gu = d.bf(2 * 2 * ffn, 3.0);
    let gup = r.put(&gu);
    let act = r.out(2 * ffn * 2);
    r.run(
        "activation",
        "silu_mul",
        &[act.into(), gup.into(), 2u32.into(), (ffn as u32).into()],
    )
    .unwrap();
    let mut want = Vec::new();
    for row in gu.chunks(2 * ffn) {
        for j in 0..ffn {
            let g = row[j].to_f64();
            want.push(g / (1.0 + (-g).exp()) * row[ffn + j].to_f64());
        }
    }
    assert_close(&r.get_bf(act, 2 * ffn), &want, 8e-3, "silu_mul");

    let logits = [0.5f32, 3.0, 3.0, -1.0, f32::NAN, 2.0, 9.0, 9.0];
    let lp = r.put(&logits);
    let am = r.out(8);
    r.run(
        "sampling",
        "argmax",
        &[am.into(), lp.into(), 2u32.into(), 4u32.into()],
    )
    .unwrap();
    assert_eq!(r.gpu.download::<u32>(am, 2, r.s).unwrap(), vec![1, 2]);
}
