use super::*;
use metrale_cache::KvDtype;
use metrale_gpu_runtime::CpuBackend;

#[test]
fn the_benchmark_runs_end_to_end_on_the_cpu_backend() {
    let report = smoke(Arc::new(CpuBackend::default()), tiny_for_cpu().unwrap()).unwrap();
    // Two batches under each of the two default forwards; the circuit's fused launch makes
    // its step shorter.
    assert_eq!(report.decode.len(), 4);
    let launches = |f: &str| {
        report
            .decode
            .iter()
            .find(|d| d.forward == f)
            .unwrap()
            .launches
    };
    assert!(launches("circuit") < launches("legacy"));
    assert!(report.copy_gb_s > 0.0 && report.gemm_tflop_s > 0.0);
    assert!(
        report.fp8_gemm.is_none(),
        "a bf16 run measures no FP8 rates"
    );
    assert!(
        report
            .decode
            .iter()
            .all(|d| d.ms >= 0.0 && d.floor_ms > 0.0)
    );
    let table = report.table();
    assert!(
        table.contains("x floor") && table.contains("prefill 32 tokens"),
        "{table}"
    );
    let b = &report.breakdowns[0];
    assert!(b.parts.len() >= 10 && b.total_ms() > 0.0, "{table}");
    assert!(table.contains("paged_attention ctx 21"), "{table}");
}

#[test]
fn the_benchmark_runs_a_hybrid_shape_and_counts_its_state_traffic() {
    let config = tiny_hybrid_for_cpu().unwrap();
    let report = smoke(Arc::new(CpuBackend::default()), config.clone()).unwrap();
    let (one, three) = (&report.decode[0], &report.decode[1]);
    // Each extra sequence adds its KV cache and its SSM state to the floor.
    let per_seq = (three.bytes - one.bytes) / 2.0;
    assert!(ssm_bytes_per_seq(&config) > 0.0);
    assert!(per_seq > ssm_bytes_per_seq(&config));
    // The launch-by-launch profile of the real step covers the hybrid's own kernels, at the
    // one breakdown batch that is also a decode batch, once for every launch of the step.
    assert_eq!(report.profiles.len(), 1);
    let p = &report.profiles[0];
    assert!(
        p.parts
            .iter()
            .any(|x| x.name.starts_with("gated_delta_recurrent"))
    );
    let launches: u32 = p.parts.iter().map(|x| x.per_step).sum();
    let legacy = report
        .decode
        .iter()
        .find(|d| d.forward == "legacy")
        .unwrap();
    assert_eq!(launches as usize, legacy.launches);
}

#[test]
fn the_benchmark_streams_an_fp8_hybrids_gdn_input_projection_in_fp8() {
    let config = tiny_hybrid_for_cpu().unwrap();
    let mut o = smoke_options(config.clone());
    o.quantization = Quantization::Fp8;
    let report = run(Arc::new(CpuBackend::default()), &o).unwrap();
    // The run measures our FP8 GEMM rate beside the bf16 one (the CPU has no vendor library).
    let fp8 = report.fp8_gemm.as_ref().expect("FP8 rates in an FP8 run");
    assert!(fp8.ours_tflop_s > 0.0 && fp8.vendor_tflop_s.is_none());
    assert!(report.table().contains("our linear of a block-FP8 weight"));
    let names: Vec<&str> = (report.profiles[0].parts.iter())
        .map(|x| x.name.as_str())
        .collect();
    // The GDN input projection of hidden 64: its 96 q|k|v|z rows stream as FP8, its 8 b|a
    // rows are a bf16 GEMM; no launch reads the whole 104-row projection.
    let fp8 = |n: &&str| n.starts_with("linear_stream_fp8") || n.starts_with("dequant_fp8");
    assert!(
        names.iter().any(|n| fp8(n) && n.contains(", 96, 64)")),
        "{names:?}"
    );
    assert!(
        names.iter().any(|n| !fp8(n) && n.contains(", 8, 64)")),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n.contains(", 104, 64)")), "{names:?}");
    // The floor counts the q|k|v|z rows at about a byte an element.
    let bf16 = decode_weight_bytes(&config, Quantization::AsStored, 1);
    let gdn_qkvz = 3.0 * 96.0 * 64.0;
    assert!(
        report.weight_bytes < bf16 - gdn_qkvz,
        "{}",
        report.weight_bytes
    );
}

#[test]
fn the_benchmark_runs_a_moe_shape_in_fp8_and_counts_the_experts_it_reads() {
    let config = tiny_moe_for_cpu().unwrap();
    let mut o = smoke_options(config.clone());
    o.quantization = Quantization::Fp8;
    let report = run(Arc::new(CpuBackend::default()), &o).unwrap();
    // The step streams the FP8 experts (no bf16 copy of them is made).
    let p = &report.profiles[0];
    assert!(
        p.parts
            .iter()
            .any(|x| x.name.starts_with("expert_linear_fp8")),
        "{:?}",
        p.parts.iter().map(|x| &x.name).collect::<Vec<_>>()
    );
    assert!(!p.parts.iter().any(|x| x.name == "expert_linear"));
    // Three rows choose more of the 8 experts than one row's 2: the floor grows by more
    // than the two extra sequences' caches.
    assert_eq!(experts_read(&config, 1), 2.0);
    assert!(experts_read(&config, 3) > 4.0 && experts_read(&config, 3) < 8.0);
    let (one, three) = (&report.decode[0], &report.decode[1]);
    let per_seq = 21.0 * kv_bytes_per_token(&config, KvDtype::Bf16) + ssm_bytes_per_seq(&config);
    assert!(three.bytes - one.bytes > 2.0 * per_seq);
    // FP8 experts and projections are about half the bf16 bytes; routers and the head stay.
    let bf16 = decode_weight_bytes(&config, Quantization::AsStored, 1);
    assert!(report.weight_bytes < 0.75 * bf16 && report.weight_bytes > 0.5 * bf16);
}
