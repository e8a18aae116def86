//! Tests of the CPU backend: memory checking, parameter structs, capture and replay, and every
//! CPU kernel against a naive f64 reference (or, for layouts, the documented formula) written
//! independently of the kernel, on random inputs with poisoned outputs.

use half::bf16;
use metrale_kernel_abi::{
    AddRmsNormParams, AddRmsNormStagedParams, ArgmaxParams, EmbeddingGatherParams,
    GatherRowsParams, LinearParams, LinearTmaParams, PermuteK32TilesParams, RmsNormParams,
    RoundBf16Params, SiluMulParams, SiluMulStagedParams,
};
use metrale_testkit::Rng;

use super::test_support::{Rig, assert_close, image_byte, tof};
use super::*;
use crate::backend::GpuBackendExt;

mod attention;
mod manifest;

fn ref_rms(x: &[f64], w: &[f64], eps: f64, unit: bool) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, w)| v * inv * if unit { 1.0 + w } else { *w })
        .collect()
}

fn rms(out: DevicePtr, x: DevicePtr, w: DevicePtr, rows: u32, cols: u32) -> RmsNormParams {
    RmsNormParams {
        out,
        x,
        w,
        rows,
        cols,
        eps: 1e-6,
        unit_offset: 0,
    }
}

#[test]
fn out_of_bounds_aliasing_and_wrong_structs_are_caught() {
    let r = Rig::new();
    let x = r.put(&[1.0f32; 4]);
    let out = r.out(4 * 2);
    let w = r.put(&[bf16::ONE; 4]);
    // rows = 2 reads 8 floats from a 4-float buffer.
    let e = r.run("norm", "rms_norm", &rms(out, x, w, 2, 4));
    assert!(matches!(e, Err(GpuError::InvalidAccess { .. })), "{e:?}");
    let e = r.run(
        "gemm",
        "linear",
        &LinearParams {
            out: w,
            x: w,
            w,
            m: 1,
            n: 1,
            k: 4,
        },
    );
    assert!(
        matches!(&e, Err(GpuError::Aliasing { problem, .. }) if problem.contains("overlaps operand")),
        "{e:?}"
    );
    // A struct other than the kernel's, and a flat list, are refused before the twin runs.
    let k = r.gpu.kernel("norm", "rms_norm").unwrap();
    let cfg = LaunchConfig::linear(1, 32);
    let wrong = [KernelArg::params(&SiluMulParams {
        out,
        gate_up: w,
        rows: 1,
        ffn: 2,
    })];
    let e = r.gpu.launch(k, &cfg, &wrong, r.s);
    assert!(
        matches!(&e, Err(GpuError::BadArgument { problem, .. }) if problem.contains("RmsNormParams")),
        "{e:?}"
    );
    let e = r
        .gpu
        .launch(k, &cfg, &[out.into(), x.into(), w.into()], r.s);
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

/// The twins refuse the launches the CUDA kernels refuse (the device writes its fault word for
/// these): a block size the kernel is not written for, an offset past the row, a slot past the
/// pool.
#[test]
fn launches_the_cuda_kernels_refuse_fail_on_the_cpu_too() {
    let r = Rig::new();
    let mut d = Rng::new(4);
    let (m, n, k) = (2u32, 3u32, 16u32);
    let (x, w) = (
        r.put(&d.bf16s(32, -1.0, 1.0)),
        r.put(&d.bf16s(48, -1.0, 1.0)),
    );
    let out = r.out(12);
    let p = LinearParams { out, x, w, m, n, k };
    let e = r.run_with("gemm", "linear", LaunchConfig::linear(1, 256), &p);
    assert!(
        matches!(&e, Err(GpuError::KernelFailed { kernel, problem }) if kernel == "gemm::linear" && problem.contains("written for 512")),
        "{e:?}"
    );
    r.run("gemm", "linear", &p).unwrap();
    let e = r.run_with("gemm", "linear_stream", LaunchConfig::linear(1, 512), &p);
    assert!(matches!(e, Err(GpuError::KernelFailed { .. })), "{e:?}");

    let (kc, vc) = (r.out(8 * 4 * 2), r.out(8 * 4 * 2));
    let qkv = r.put(&d.bf16s(2 * 12, -1.0, 1.0));
    let store = |slot: u32, v_offset: u32| {
        r.run(
            "cache",
            "kv_store",
            &metrale_kernel_abi::KvStoreParams {
                k_cache: kc,
                v_cache: vc,
                qkv,
                slot_mapping: r.put(&[slot]),
                rows: 1,
                row_stride: 12,
                k_offset: 4,
                v_offset,
                num_kv_heads: 1,
                head_dim: 4,
                num_slots: 8,
                kv_fp8: 0,
                k_scale: 1.0,
                v_scale: 1.0,
            },
        )
    };
    store(3, 8).unwrap();
    let e = store(8, 8).unwrap_err();
    assert!(e.to_string().contains("past the 8 cache slots"), "{e}");
    let e = store(3, 9).unwrap_err();
    assert!(e.to_string().contains("do not fit a row of 12"), "{e}");
    store(u32::MAX, 8).unwrap();
}

#[test]
fn capture_records_and_replay_reads_current_inputs() {
    let r = Rig::new();
    let s = r.gpu.create_stream().unwrap();
    let mut d = Rng::new(3);
    let xv = d.f32s(8, -1.0, 1.0);
    let x = r.put(&xv);
    let w = r.put(&d.bf16s(8, -1.0, 1.0));
    let out = r.out(16);
    let args = [KernelArg::params(&rms(out, x, w, 1, 8))];
    let k = r.gpu.kernel("norm", "rms_norm").unwrap();
    let cfg = LaunchConfig::linear(1, 32);
    r.gpu.begin_capture(s).unwrap();
    r.gpu.launch(k, &cfg, &args, s).unwrap();
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
    r.gpu.launch(k, &cfg, &args, r.s).unwrap();
    assert_eq!(first, r.get_bf(out, 8), "replay equals eager");
    let x2: Vec<f32> = xv.iter().map(|v| v * -3.0 + 0.5).collect();
    r.gpu.upload(x, &x2, s).unwrap();
    r.gpu.launch_graph(g, s).unwrap();
    assert_ne!(first, r.get_bf(out, 8), "replay reads the new input");
    r.gpu.destroy_graph(g).unwrap();
    assert!(r.gpu.launch_graph(g, s).is_err());
    assert!(
        r.gpu.take_kernel_error().is_ok(),
        "the CPU has no fault word"
    );
}

#[test]
fn rms_norm_and_add_rms_norm_match_the_reference_in_both_conventions() {
    let r = Rig::new();
    let mut d = Rng::new(11);
    let (rows, cols) = (3usize, 40usize);
    for unit in [false, true] {
        let x = d.f32s(rows * cols, -2.0, 2.0);
        let delta = d.bf16s(rows * cols, -1.0, 1.0);
        let w = d.bf16s(cols, -1.5, 1.5);
        let (xp, dp, wp) = (r.put(&x), r.put(&delta), r.put(&w));
        let out = r.out(rows * cols * 2);
        let mut p = rms(out, xp, wp, rows as u32, cols as u32);
        (p.eps, p.unit_offset) = (1e-5, unit as u32);
        r.run("norm", "rms_norm", &p).unwrap();
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
        assert_close(&r.get_bf(out, rows * cols), &want, 8e-3, 1.0, "rms_norm");

        let p = AddRmsNormParams {
            residual: xp,
            delta: dp,
            w: wp,
            out,
            rows: rows as u32,
            cols: cols as u32,
            eps: 1e-5,
            unit_offset: unit as u32,
        };
        r.run("norm", "add_rms_norm", &p).unwrap();
        let summed: Vec<f64> = x
            .iter()
            .zip(&delta)
            .map(|(a, b)| *a as f64 + b.to_f64())
            .collect();
        let got_res: Vec<f64> = r.f32s(xp, rows * cols).iter().map(|&v| v as f64).collect();
        assert_close(&got_res, &summed, 1e-6, 1.0, "residual");
        let mut want = Vec::new();
        for row in summed.chunks(cols) {
            want.extend(ref_rms(row, &wf, 1e-5, unit));
        }
        assert_close(
            &r.get_bf(out, rows * cols),
            &want,
            8e-3,
            1.0,
            "add_rms_norm",
        );
    }
}

/// `x · wᵀ` of bf16 matrices in f64.
fn ref_matmul(x: &[bf16], w: &[bf16], (m, n, k): (usize, usize, usize)) -> Vec<f64> {
    let mut want = vec![0.0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            want[i * n + j] = (0..k)
                .map(|t| x[i * k + t].to_f64() * w[j * k + t].to_f64())
                .sum();
        }
    }
    want
}

#[test]
fn every_linear_kernel_matches_a_naive_matmul() {
    let r = Rig::new();
    let mut d = Rng::new(5);
    let (m, n, k) = (3usize, 7usize, 33usize);
    let x = d.bf16s(m * k, -1.0, 1.0);
    let w = d.bf16s(n * k, -0.5, 0.5);
    let (xp, wp) = (r.put(&x), r.put(&w));
    let want = ref_matmul(&x, &w, (m, n, k));
    for name in [
        "linear",
        "linear_stream",
        "linear_stream_b4",
        "linear_stream_wide",
    ] {
        for f32_out in [false, true] {
            let out = r.out(m * n * 4);
            let p = LinearParams {
                out,
                x: xp,
                w: wp,
                m: m as u32,
                n: n as u32,
                k: k as u32,
            };
            let name = if f32_out {
                format!("{name}_f32out")
            } else {
                name.to_string()
            };
            r.run("gemm", &name, &p).unwrap();
            if f32_out {
                let got: Vec<f64> = r.f32s(out, m * n).iter().map(|&v| v as f64).collect();
                assert_close(&got, &want, 1e-5, 1.0, &name);
            } else {
                assert_close(&r.get_bf(out, m * n), &want, 8e-3, 1.0, &name);
            }
        }
    }
}

#[test]
fn permute_writes_the_documented_images_and_linear_tma_reads_them() {
    let r = Rig::new();
    let mut d = Rng::new(6);
    // k = 200: seven chunks, the last partial and the last stage half empty; m = 130: a second
    // row tile of two rows.
    for (m, n, k) in [(130usize, 7usize, 200usize), (5, 9, 64)] {
        let x = d.bf16s(m * k, -1.0, 1.0);
        let w = d.bf16s(n * k, -0.5, 0.5);
        let (xp, wp) = (r.put(&x), r.put(&w));
        let img_bytes = m.div_ceil(128) * k.div_ceil(64) * 16384;
        let img = r.out(img_bytes);
        let p = PermuteK32TilesParams {
            out: img,
            x: xp,
            m: m as u32,
            k: k as u32,
        };
        r.run("gemm", "permute_k32_tiles", &p).unwrap();
        // Every element where the layout puts it, and zeros everywhere else (past k to the
        // stage, past m to the tile).
        let bytes = r.bytes(img, img_bytes);
        let mut want = vec![0u8; img_bytes];
        for row in 0..m {
            for col in 0..k {
                let at = image_byte(row, col, k);
                want[at..at + 2].copy_from_slice(&x[row * k + col].to_bits().to_le_bytes());
            }
        }
        assert!(bytes == want, "permute_k32_tiles at m={m} k={k}");
        let map = r.out(128);
        let reference = ref_matmul(&x, &w, (m, n, k));
        for (name, bytes) in [("linear_tma", 2), ("linear_tma_f32out", 4)] {
            let out = r.out(m * n * bytes);
            let p = LinearTmaParams {
                out,
                xt: img,
                w: wp,
                wmap: map,
                sched: DevicePtr::NULL,
                m: m as u32,
                n: n as u32,
                k: k as u32,
            };
            r.run("gemm", name, &p).unwrap();
            let got = if bytes == 2 {
                r.get_bf(out, m * n)
            } else {
                r.f32s(out, m * n).iter().map(|&v| v as f64).collect()
            };
            let rel = if bytes == 2 { 8e-3 } else { 1e-5 };
            assert_close(&got, &reference, rel, 1.0, name);
        }
    }
}

/// Stage images of `rows` (each `k` bf16) written where the documented layout puts them, over
/// `base`.
fn images_of(rows: &[bf16], k: usize, base: &[u8]) -> Vec<u8> {
    let mut img = base.to_vec();
    for (i, v) in rows.iter().enumerate() {
        let at = image_byte(i / k, i % k, k);
        img[at..at + 2].copy_from_slice(&v.to_bits().to_le_bytes());
    }
    img
}

#[test]
fn staged_producers_write_their_rows_where_the_layout_puts_them() {
    let r = Rig::new();
    let mut d = Rng::new(7);
    let (m, k) = (3usize, 128usize);
    let bytes = m.div_ceil(128) * k.div_ceil(64) * 16384;
    // Images over a pattern, so padding left alone shows.
    let pattern: Vec<u8> = (0..bytes).map(|i| (i * 7 % 251) as u8).collect();
    let patterned = || r.put(&pattern);
    let gate_up = d.bf16s(m * 2 * k, -3.0, 3.0);
    let gu = r.put(&gate_up);
    let act = r.out(m * k * 2);
    let silu = |p: &SiluMulStagedParams| r.run("activation", "silu_mul_staged", p);
    r.run(
        "activation",
        "silu_mul",
        &SiluMulParams {
            out: act,
            gate_up: gu,
            rows: m as u32,
            ffn: k as u32,
        },
    )
    .unwrap();
    let act_rows = r.bf(act, m * k);
    let mut want_act = Vec::new();
    for row in gate_up.chunks(2 * k) {
        for j in 0..k {
            let g = row[j].to_f64();
            want_act.push(g / (1.0 + (-g).exp()) * row[k + j].to_f64());
        }
    }
    assert_close(&tof(&act_rows), &want_act, 8e-3, 1.0, "silu_mul");
    // Images only, then images and rows.
    let (staged, rows) = (patterned(), r.out(m * k * 2));
    let mut p = SiluMulStagedParams {
        img: staged,
        act: DevicePtr::NULL,
        gate_up: gu,
        rows: m as u32,
        ffn: k as u32,
    };
    silu(&p).unwrap();
    assert!(r.bytes(staged, bytes) == images_of(&act_rows, k, &pattern));
    (p.img, p.act) = (patterned(), rows);
    silu(&p).unwrap();
    assert!(r.bytes(p.img, bytes) == images_of(&act_rows, k, &pattern));
    assert!(r.bf(rows, m * k) == act_rows, "silu_mul_staged's rows");
    p.ffn = 12;
    assert!(
        silu(&p).is_err(),
        "a row of 12 columns is not whole vectors of 8"
    );

    let residual: Vec<f32> = d.f32s(m * k, -2.0, 2.0);
    let (delta, w) = (
        r.put(&d.bf16s(m * k, -1.0, 1.0)),
        r.put(&d.bf16s(k, -1.0, 1.0)),
    );
    let out1 = r.out(m * k * 2);
    let plain = AddRmsNormParams {
        residual: r.put(&residual),
        delta,
        w,
        out: out1,
        rows: m as u32,
        cols: k as u32,
        eps: 1e-6,
        unit_offset: 1,
    };
    r.run("norm", "add_rms_norm", &plain).unwrap();
    let staged = AddRmsNormStagedParams {
        residual: r.put(&residual),
        delta,
        w,
        out: r.out(m * k * 2),
        img: patterned(),
        rows: m as u32,
        cols: k as u32,
        eps: 1e-6,
        unit_offset: 1,
    };
    r.run("norm", "add_rms_norm_staged", &staged).unwrap();
    let normed = r.bf(out1, m * k);
    assert!(r.bf(staged.out, m * k) == normed);
    assert!(r.bytes(staged.img, bytes) == images_of(&normed, k, &pattern));
}

#[test]
fn round_bf16_rounds_to_nearest_even() {
    let r = Rig::new();
    // (f32 bits, bf16 bits): exact, the two ties (down to even 0x3F80, up to even 0x3F82),
    // just past a tie, a negative value, f32::MAX overflowing to infinity, a subnormal.
    let cases = [
        (0x3F80_0000u32, 0x3F80u16),
        (0x3F80_8000, 0x3F80),
        (0x3F81_8000, 0x3F82),
        (0x3F80_8001, 0x3F81),
        (0xC020_0000, 0xC020),
        (0x7F7F_FFFF, 0x7F80),
        (0x0001_16C2, 0x0001),
    ];
    let x: Vec<f32> = cases.iter().map(|&(b, _)| f32::from_bits(b)).collect();
    let out = r.out(x.len() * 2);
    let p = RoundBf16Params {
        out,
        x: r.put(&x),
        n: x.len() as u32,
    };
    r.run("embed", "round_bf16", &p).unwrap();
    let got: Vec<u16> = r.bf(out, x.len()).iter().map(|v| v.to_bits()).collect();
    let want: Vec<u16> = cases.iter().map(|&(_, b)| b).collect();
    assert_eq!(got, want);
    // One element more than `x` holds is refused.
    let past = RoundBf16Params { n: 8, ..p };
    assert!(r.run("embed", "round_bf16", &past).is_err());
}

#[test]
fn embedding_gather_rows_and_argmax() {
    let r = Rig::new();
    let mut d = Rng::new(9);
    let (vocab, hidden) = (10usize, 6usize);
    let table = d.bf16s(vocab * hidden, -1.0, 1.0);
    let ids = [7u32, 0, 7, 3];
    let (tp, ip) = (r.put(&table), r.put(&ids));
    let out = r.out(ids.len() * hidden * 4);
    let mut p = EmbeddingGatherParams {
        out,
        table: tp,
        ids: ip,
        rows: 4,
        hidden: hidden as u32,
        vocab: vocab as u32,
        row_start: 0,
        table_rows: vocab as u32,
    };
    r.run("embed", "embedding_gather", &p).unwrap();
    let got = r.f32s(out, ids.len() * hidden);
    for (i, &id) in ids.iter().enumerate() {
        for j in 0..hidden {
            assert_eq!(
                got[i * hidden + j],
                table[id as usize * hidden + j].to_f32()
            );
        }
    }
    // A slice of the vocabulary, rows 3..8 (a tensor-parallel rank's): ids 7 and 3 read their
    // rows of it, id 0 reads zeros.
    let slice = r.put(&table[3 * hidden..8 * hidden]);
    let sliced = EmbeddingGatherParams {
        table: slice,
        row_start: 3,
        table_rows: 5,
        ..p
    };
    r.run("embed", "embedding_gather", &sliced).unwrap();
    let got_sliced = r.f32s(out, ids.len() * hidden);
    for (i, &id) in ids.iter().enumerate() {
        let want = if id == 0 {
            &[0.0; 6][..]
        } else {
            &got[i * hidden..(i + 1) * hidden]
        };
        assert_eq!(&got_sliced[i * hidden..(i + 1) * hidden], want, "id {id}");
    }
    (p.ids, p.rows) = (r.put(&[10u32]), 1);
    assert!(r.run("embed", "embedding_gather", &p).is_err());

    let rows_out = r.out(2 * hidden * 2);
    let mut p = GatherRowsParams {
        out: rows_out,
        x: tp,
        row_ids: r.put(&[2u32, 0]),
        n: 2,
        cols: hidden as u32,
        src_rows: vocab as u32,
    };
    r.run("embed", "gather_rows", &p).unwrap();
    let got = r.get_bf(rows_out, 2 * hidden);
    assert_eq!(got[..hidden], tof(&table[2 * hidden..3 * hidden]));
    assert_eq!(got[hidden..], tof(&table[..hidden]));
    p.row_ids = r.put(&[2u32, 10]);
    assert!(r.run("embed", "gather_rows", &p).is_err());

    let logits = [
        0.5f32,
        3.0,
        3.0,
        -1.0,
        f32::NAN,
        2.0,
        9.0,
        9.0,
        f32::NAN,
        f32::NAN,
        f32::NAN,
        f32::NAN,
    ];
    let am = r.out(12);
    let p = ArgmaxParams {
        out: am,
        logits: r.put(&logits),
        rows: 3,
        vocab: 4,
    };
    r.run("sampling", "argmax", &p).unwrap();
    assert_eq!(r.gpu.download::<u32>(am, 3, r.s).unwrap(), vec![1, 2, 0]);
}
