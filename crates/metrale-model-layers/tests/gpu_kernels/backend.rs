//! The CUDA backend itself: copies, events, launches it refuses on the host (a kernel given
//! another struct, or a flat argument list, an unknown kernel), and launches a kernel refuses
//! on the device, which come back as `GpuError::KernelFault` naming the kernel and the reason,
//! as the CPU twin fails the same launch.

use metrale_gpu_runtime::{FaultReason, GpuBackend, GpuError, KernelArg, LaunchConfig};
use metrale_kernel_abi::{KvStoreParams, LinearParams, SiluMulParams};

use super::harness::{self, Buf, Pair, S};

#[test]
fn the_backend_copies_times_and_refuses_bad_launches() {
    let p = Pair::new();
    let raw = harness::cuda();
    let gpu: &dyn GpuBackend = raw.as_ref();
    let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + 3) as u8).collect();
    let a = p.upload(&data);
    let b = p.poisoned(1000);
    gpu.copy_d2d(b.gpu.offset(10), a.gpu, 500, S).expect("d2d");
    gpu.memset(b.gpu, 0x5A, 10, S).expect("memset");
    let got = p.download_gpu::<u8>(&b);
    assert!(got[..10].iter().all(|&x| x == 0x5A));
    assert_eq!(&got[10..510], &data[..500]);
    assert!(got[510..].iter().all(|&x| x == 0xFF));

    let (e0, e1) = (
        gpu.create_event().expect("event"),
        gpu.create_event().expect("event"),
    );
    gpu.record_event(e0, S).expect("record");
    p.run_gpu(|o, at| o.fill_uniform_bf16(S, at(&b), 500, 1, 0.0, 1.0));
    gpu.record_event(e1, S).expect("record");
    let ms = gpu.event_elapsed_ms(e0, e1).expect("elapsed");
    assert!((0.0..1000.0).contains(&ms), "elapsed {ms} ms");
    assert!(gpu.free_memory().expect("free memory") > 1 << 30);

    let linear = gpu.kernel("gemm", "linear").expect("linear resolves");
    let cfg = LaunchConfig::linear(1, 512);
    let flat = [
        KernelArg::Ptr(a.gpu),
        KernelArg::Ptr(a.gpu),
        KernelArg::Ptr(a.gpu),
        KernelArg::U32(1),
        KernelArg::U32(1),
        KernelArg::U32(1),
    ];
    assert!(matches!(
        gpu.launch(linear, &cfg, &flat, S),
        Err(GpuError::BadArgument { .. })
    ));
    // Another kernel's struct, even one of the same layout as far as the driver can tell.
    let other = SiluMulParams {
        out: a.gpu,
        gate_up: a.gpu,
        rows: 1,
        ffn: 1,
    };
    assert!(matches!(
        gpu.launch(linear, &cfg, &[KernelArg::params(&other)], S),
        Err(GpuError::BadArgument { index: 0, .. })
    ));
    assert!(matches!(
        gpu.kernel("gemm", "no_such_kernel"),
        Err(GpuError::UnknownKernel { .. })
    ));
    assert!(matches!(
        gpu.kernel("no_such_module", "x"),
        Err(GpuError::UnknownKernel { .. })
    ));
    assert!(matches!(
        gpu.free(a.gpu.offset(256)),
        Err(GpuError::InvalidFree(_))
    ));
    gpu.synchronize(S).expect("the device is still healthy");
    println!(
        "kernel-check {:<18} {:<44} ok (modules: {:?})",
        "backend",
        "copies, events, bad launches",
        raw.loaded_modules()
    );
}

/// Launch `module::name` with `params` and `cfg` on one backend and wait: the launch's error,
/// if any (the launch itself or the wait after it).
fn launch_and_wait(
    gpu: &dyn GpuBackend,
    (module, name): (&str, &str),
    cfg: &LaunchConfig,
    params: &[KernelArg],
) -> Result<(), GpuError> {
    let kernel = gpu.kernel(module, name).expect("the kernel resolves");
    gpu.launch(kernel, cfg, params, S)?;
    gpu.synchronize(S)
}

/// `kv_store` of one row whose k and v do not fit it (`v_offset` past the row), or whose slot
/// is past the pool.
fn bad_kv_store(
    at: &dyn Fn(&Buf) -> metrale_gpu_runtime::DevicePtr,
    b: &Buf,
    slot_past: bool,
) -> KvStoreParams {
    KvStoreParams {
        k_cache: at(b),
        v_cache: at(b),
        qkv: at(b),
        slot_mapping: at(b),
        rows: 1,
        row_stride: 64,
        k_offset: 0,
        v_offset: if slot_past { 32 } else { 48 },
        num_kv_heads: 1,
        head_dim: 32,
        num_slots: if slot_past { 0 } else { 4 },
        kv_fp8: 0,
        k_scale: 1.0,
        v_scale: 1.0,
    }
}

/// A launch a kernel refuses on the device is `GpuError::KernelFault` (kernel and reason) at the
/// next `synchronize` (the harness turns `check_kernel_errors` on) or from
/// `take_kernel_error`, and the fault word is clear again afterwards; the CPU twin fails the
/// same launch.
#[test]
fn a_launch_the_kernel_refuses_is_a_typed_error_on_both_backends() {
    let p = Pair::alone();
    // Zeros: slot 0 for kv_store, which its pool of 4 slots holds.
    let buf = p.upload(&[0u32; 64]);
    let cases: [(&str, (&str, &str), LaunchConfig, KernelArg, FaultReason); 3] = [
        (
            "linear on 256-thread blocks (written for 512)",
            ("gemm", "linear"),
            LaunchConfig::linear(1, 256),
            KernelArg::params(&LinearParams {
                out: buf.gpu,
                x: buf.gpu,
                w: buf.gpu,
                m: 1,
                n: 8,
                k: 8,
            }),
            FaultReason::Geometry,
        ),
        (
            "kv_store with v past the row",
            ("cache", "kv_store"),
            LaunchConfig::linear(1, 128),
            KernelArg::params(&bad_kv_store(&|b| b.gpu, &buf, false)),
            FaultReason::Shape,
        ),
        (
            "kv_store with a slot past the pool",
            ("cache", "kv_store"),
            LaunchConfig::linear(1, 128),
            KernelArg::params(&bad_kv_store(&|b| b.gpu, &buf, true)),
            FaultReason::Index,
        ),
    ];
    for (what, kernel, cfg, args, reason) in cases {
        let label = format!("{}::{}", kernel.0, kernel.1);
        let got = launch_and_wait(p.gpu.as_ref(), kernel, &cfg, std::slice::from_ref(&args));
        match got {
            Err(GpuError::KernelFault {
                kernel: k,
                reason: r,
            }) => {
                assert_eq!((k.as_str(), r), (label.as_str(), reason), "{what}");
            }
            other => panic!("{what}: CUDA gave {other:?}, not a KernelFault"),
        }
        p.gpu.synchronize(S).expect("the fault word is clear again");
        // The same through `take_kernel_error`, the explicit check.
        let k = p.gpu.kernel(kernel.0, kernel.1).expect("resolves");
        p.gpu
            .launch(k, &cfg, std::slice::from_ref(&args), S)
            .expect("queued");
        assert!(
            matches!(p.gpu.take_kernel_error(), Err(GpuError::KernelFault { reason: r, .. }) if r == reason),
            "{what}: take_kernel_error"
        );
        p.gpu.take_kernel_error().expect("read once");
        println!(
            "kernel-check {:<18} {:<44} KernelFault({reason:?}) ok",
            "fault", what
        );
    }
    // The CPU twins refuse the same launches.
    let cpu_cases: [(&str, (&str, &str), LaunchConfig, KernelArg); 3] = [
        (
            "linear",
            ("gemm", "linear"),
            LaunchConfig::linear(1, 256),
            KernelArg::params(&LinearParams {
                out: buf.cpu,
                x: buf.cpu,
                w: buf.cpu,
                m: 1,
                n: 8,
                k: 8,
            }),
        ),
        (
            "kv_store (shape)",
            ("cache", "kv_store"),
            LaunchConfig::linear(1, 128),
            KernelArg::params(&bad_kv_store(&|b| b.cpu, &buf, false)),
        ),
        (
            "kv_store (slot)",
            ("cache", "kv_store"),
            LaunchConfig::linear(1, 128),
            KernelArg::params(&bad_kv_store(&|b| b.cpu, &buf, true)),
        ),
    ];
    for (what, kernel, cfg, args) in cpu_cases {
        let got = launch_and_wait(p.cpu.as_ref(), kernel, &cfg, std::slice::from_ref(&args));
        assert!(
            matches!(got, Err(GpuError::KernelFailed { .. })),
            "{what}: the CPU twin gave {got:?}"
        );
    }
}
