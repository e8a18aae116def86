//! A measurement, not a check: `linear`'s speed at decode and prefill shapes beside its ceilings
//! (device-to-device copy bandwidth measured in the same run, and the H200's dense bf16 rate).
//! Run by `run.sh` as the ignored test `measure_linear_against_rooflines`; timed with device
//! events after a warm-up, median of several runs, weights rotated so L2 cannot serve repeats.

use std::sync::Arc;

use metrale_gpu_runtime::{DevicePtr, GpuBackend, GpuBackendExt};
use metrale_model_layers::Ops;

use super::harness::{Rng, S, TestCuda};

/// Dense bf16 tensor-core rate of an H200 (measured about 790 TFLOP/s through cuBLAS).
const BF16_TFLOPS: f64 = 790.0;

/// Median milliseconds of `reps` timed calls of `f(i)`, after 3 warm-up calls.
fn time_ms(gpu: &dyn GpuBackend, reps: usize, mut f: impl FnMut(usize)) -> f64 {
    let (a, b) = (
        gpu.create_event().expect("event"),
        gpu.create_event().expect("event"),
    );
    for i in 0..3 {
        f(i);
    }
    let mut times: Vec<f64> = (0..reps)
        .map(|i| {
            gpu.record_event(a, S).expect("record");
            f(i);
            gpu.record_event(b, S).expect("record");
            f64::from(gpu.event_elapsed_ms(a, b).expect("elapsed"))
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

pub fn measure_linear() {
    let gpu: Arc<dyn GpuBackend> = TestCuda::new();
    let ops = Ops::new(gpu.clone()).expect("kernels resolve");
    let g = gpu.as_ref();

    let copy_bytes = 1usize << 30;
    let (src, dst) = (
        g.alloc(copy_bytes).expect("alloc"),
        g.alloc(copy_bytes).expect("alloc"),
    );
    g.memset(src, 0x3C, copy_bytes, S).expect("memset");
    let ms = time_ms(g, 10, |_| {
        g.copy_d2d(dst, src, copy_bytes, S).expect("copy")
    });
    let copy_gbs = 2.0 * copy_bytes as f64 / ms / 1e6;
    println!(
        "bench copy d2d 1 GiB: {ms:.3} ms, {copy_gbs:.0} GB/s (read + write) = the bandwidth ceiling"
    );
    g.free(src).expect("free");
    g.free(dst).expect("free");

    let mut rng = Rng::new(12);
    for (m, n, k) in [
        (1u32, 12288u32, 4096u32),
        (1, 4096, 12288),
        (1, 6144, 4096),
        (1, 151_936, 4096),
        (8, 12288, 4096),
        (32, 12288, 4096),
        (64, 12288, 4096),
        (128, 12288, 4096),
        (2048, 4096, 4096),
        (4096, 12288, 4096),
    ] {
        let w_bytes = n as usize * k as usize * 2;
        let copies = (256usize << 20).div_ceil(w_bytes).clamp(1, 8);
        let weights: Vec<DevicePtr> = (0..copies)
            .map(|c| {
                let w = g.alloc(w_bytes).expect("alloc");
                ops.fill_uniform_bf16(S, w, (n * k) as u64, c as u64, 0.0, 0.03)
                    .expect("fill");
                w
            })
            .collect();
        let x = g
            .alloc_upload(&rng.bf16s((m * k) as usize, -1.0, 1.0), S)
            .expect("x");
        let out = g.alloc(m as usize * n as usize * 2).expect("out");
        let ms = time_ms(g, 20, |i| {
            ops.linear(S, out, x, weights[i % copies], m, n, k)
                .expect("linear")
        });
        let bytes = (w_bytes + (m * k) as usize * 2 + (m * n) as usize * 2) as f64;
        let gbs = bytes / ms / 1e6;
        let tflops = 2.0 * f64::from(m) * f64::from(n) * f64::from(k) / ms / 1e9;
        let floor_ms = (bytes / (copy_gbs * 1e6))
            .max(2.0 * f64::from(m) * f64::from(n) * f64::from(k) / (BF16_TFLOPS * 1e9));
        println!(
            "bench linear m={m:<5} n={n:<6} k={k:<5}: {:8.1} us  {gbs:6.0} GB/s ({:5.1} % of copy)  {tflops:6.1} TFLOP/s ({:5.1} % of {BF16_TFLOPS})  roofline {:6.1} us ({:5.1} %)",
            ms * 1e3,
            100.0 * gbs / copy_gbs,
            100.0 * tflops / BF16_TFLOPS,
            floor_ms * 1e3,
            100.0 * floor_ms / ms
        );
        for w in weights {
            g.free(w).expect("free");
        }
        g.free(x).expect("free");
        g.free(out).expect("free");
    }
}
