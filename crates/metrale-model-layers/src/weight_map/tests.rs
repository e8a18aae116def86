//! Tests of `SafetensorsSource`, the dtype conversions and `WeightLoader` on small files written
//! into a temporary directory: every supported source dtype, sharded checkpoints, and every
//! error case (each must be the right variant, name the tensor or file, and never panic).

use std::path::Path;

use half::bf16;
use metrale_gpu_runtime::{CpuBackend, CpuBackendOptions, DType, GpuBackend, GpuBackendExt};

use super::test_support::{RawTensor, f16_exact_values, write_index, write_safetensors};
use super::*;

fn dir_with(tensors: &[RawTensor<'_>]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(&dir.path().join(SINGLE_FILE), tensors);
    dir
}

fn open(dir: &Path) -> SafetensorsSource {
    SafetensorsSource::open(dir).unwrap()
}

/// The error's message, after checking it contains every needle.
fn message(err: &WeightError, needles: &[&str]) -> String {
    let msg = err.to_string();
    for needle in needles {
        assert!(msg.contains(needle), "`{needle}` not in: {msg}");
    }
    msg
}

#[test]
fn bf16_f16_and_f32_sources_load_to_the_same_bf16() {
    let values = f16_exact_values(24);
    let dir = dir_with(&[
        RawTensor::f32("w.f32", &[4, 6], &values),
        RawTensor::f16("w.f16", &[4, 6], &values),
        RawTensor::bf16("w.bf16", &[4, 6], &values),
    ]);
    let source = open(dir.path());
    let from_f32 = source.load_bf16("w.f32", &[4, 6]).unwrap();
    let expected: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(from_f32, expected);
    assert_eq!(source.load_bf16("w.f16", &[4, 6]).unwrap(), expected);
    assert_eq!(source.load_bf16("w.bf16", &[4, 6]).unwrap(), expected);
    assert!(
        expected.iter().zip(&values).any(|(b, v)| b.to_f32() != *v),
        "some values must round"
    );
}

#[test]
fn f32_to_bf16_rounds_to_nearest_even() {
    let one = 1.0f32;
    let ulp = 2f32.powi(-7); // bf16 spacing at 1.0
    // Exactly halfway cases go to the even mantissa; just above halfway rounds up.
    let values = [
        one + ulp / 2.0,
        one + 1.5 * ulp,
        one + ulp / 2.0 + 2f32.powi(-20),
        -(one + 1.5 * ulp),
    ];
    let dir = dir_with(&[RawTensor::f32("r", &[4], &values)]);
    let got = open(dir.path()).load_bf16("r", &[4]).unwrap();
    let want = [one, one + 2.0 * ulp, one + ulp, -(one + 2.0 * ulp)];
    assert_eq!(got.iter().map(|b| b.to_f32()).collect::<Vec<_>>(), want);
}

#[test]
fn load_f32_widens_every_source_dtype_exactly() {
    let values = f16_exact_values(5);
    let dir = dir_with(&[
        RawTensor::f32("a", &[5], &values),
        RawTensor::f16("b", &[5], &values),
        RawTensor::bf16("c", &[5], &values),
    ]);
    let source = open(dir.path());
    assert_eq!(source.load_f32("a", &[5]).unwrap(), values);
    assert_eq!(source.load_f32("b", &[5]).unwrap(), values);
    let rounded: Vec<f32> = values.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(source.load_f32("c", &[5]).unwrap(), rounded);
}

#[test]
fn names_info_and_contains_describe_the_file() {
    let dir = dir_with(&[
        RawTensor::f32("b", &[2, 3], &[0.5; 6]),
        RawTensor::bf16("a", &[3], &[1.0; 3]),
    ]);
    let source = open(dir.path());
    assert_eq!(source.names().collect::<Vec<_>>(), vec!["a", "b"]);
    assert_eq!(source.len(), 2);
    assert!(source.contains("a") && !source.contains("c"));
    let (dtype, shape) = source.info("b").unwrap();
    assert_eq!((dtype, shape), (SourceDtype::F32, &[2usize, 3][..]));
    assert_eq!(source.file_of("a").unwrap(), dir.path().join(SINGLE_FILE));
}

#[test]
fn concat_stacks_rows_in_order_across_dtypes() {
    let q = f16_exact_values(8);
    let k: Vec<f32> = q.iter().map(|v| v * -2.0).collect();
    let dir = dir_with(&[
        RawTensor::f32("q", &[2, 4], &q),
        RawTensor::f16("k", &[2, 4], &k),
    ]);
    let source = open(dir.path());
    let parts: [(&str, &[usize]); 2] = [("q", &[2, 4]), ("k", &[2, 4])];
    let fused = source.load_bf16_concat(&parts).unwrap();
    let expected: Vec<bf16> = q.iter().chain(&k).map(|&v| bf16::from_f32(v)).collect();
    assert_eq!(fused, expected);
    assert_eq!(concat_shape(&parts).unwrap(), vec![4, 4]);
}

#[test]
fn concat_refuses_mismatched_trailing_dims() {
    let dir = dir_with(&[
        RawTensor::f32("q", &[2, 4], &[1.0; 8]),
        RawTensor::f32("k", &[4, 2], &[1.0; 8]),
    ]);
    let err = open(dir.path())
        .load_bf16_concat(&[("q", &[2, 4]), ("k", &[4, 2])])
        .unwrap_err();
    assert!(matches!(err, WeightError::Concat { .. }), "{err:?}");
    message(&err, &["`k`", "`q`", "[2]", "[4]"]);
    assert!(matches!(concat_shape(&[]), Err(WeightError::Concat { .. })));
}

#[test]
fn a_concat_the_file_does_not_hold_is_a_shape_error_whatever_its_expected_size() {
    // The expected shapes come from config.json: a huge or overflowing size there is refused
    // by the tensor's shape, before anything is sized by it.
    let dir = dir_with(&[
        RawTensor::f32("q", &[2, 4], &[1.0; 8]),
        RawTensor::f32("k", &[2, 4], &[1.0; 8]),
    ]);
    let source = open(dir.path());
    for rows in [1usize << 50, 1 << 62] {
        let err = (source.load_bf16_concat(&[("q", &[2, 4]), ("k", &[rows, 4])])).unwrap_err();
        assert!(matches!(err, WeightError::Shape { .. }), "{err:?}");
        message(&err, &["`k`", &rows.to_string()]);
    }
    let gpu = CpuBackend::default();
    let loader = WeightLoader::new(&source, &gpu, gpu.default_stream());
    let half = TensorSlice::row_span(&[1 << 50, 4], 0..1 << 49);
    let err = loader
        .upload_bf16_slices(&[("q", &[1 << 50, 4], half)], vec![1 << 49, 4])
        .unwrap_err();
    assert!(matches!(err, WeightError::Shape { .. }), "{err:?}");
    assert_eq!(gpu.used_bytes(), 0);
}

#[test]
fn sharded_checkpoint_loads_from_the_shard_the_index_names() {
    let dir = tempfile::tempdir().unwrap();
    let a = f16_exact_values(6);
    let b: Vec<f32> = a.iter().map(|v| v + 3.0).collect();
    let (shard1, shard2) = (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    );
    write_safetensors(&dir.path().join(shard1), &[RawTensor::f32("x", &[6], &a)]);
    write_safetensors(
        &dir.path().join(shard2),
        &[RawTensor::bf16("y", &[2, 3], &b)],
    );
    write_index(dir.path(), &[("x", shard1), ("y", shard2)]);
    let source = open(dir.path());
    assert_eq!(source.names().collect::<Vec<_>>(), vec!["x", "y"]);
    assert_eq!(source.load_f32("x", &[6]).unwrap(), a);
    let y: Vec<f32> = b.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_eq!(source.load_f32("y", &[2, 3]).unwrap(), y);
    assert_eq!(source.file_of("y").unwrap(), dir.path().join(shard2));
}

#[test]
fn missing_tensor_names_the_tensor_and_the_directory() {
    let dir = dir_with(&[RawTensor::f32("present", &[1], &[1.0])]);
    let err = open(dir.path())
        .load_bf16("model.norm.weight", &[1])
        .unwrap_err();
    assert!(matches!(err, WeightError::Missing { .. }), "{err:?}");
    message(
        &err,
        &["model.norm.weight", &dir.path().display().to_string()],
    );
}

#[test]
fn wrong_shape_gives_expected_and_found() {
    let dir = dir_with(&[RawTensor::f32("w", &[2, 3], &[1.0; 6])]);
    let err = open(dir.path()).load_bf16("w", &[3, 2]).unwrap_err();
    assert!(matches!(err, WeightError::Shape { .. }), "{err:?}");
    message(&err, &["`w`", "expected shape [3, 2]", "found [2, 3]"]);
}

#[test]
fn integer_dtype_is_refused_with_the_accepted_ones() {
    let dir = dir_with(&[RawTensor::i64("ids", &[3], &[1, 2, 3])]);
    let source = open(dir.path());
    for err in [
        source.load_bf16("ids", &[3]).unwrap_err(),
        source.load_f32("ids", &[3]).unwrap_err(),
    ] {
        assert!(matches!(err, WeightError::Dtype { .. }), "{err:?}");
        message(&err, &["`ids`", "I64", "bf16, f16 or f32"]);
    }
}

#[test]
fn truncated_file_reports_expected_and_found_bytes() {
    let dir = dir_with(&[RawTensor::f32("w", &[4], &[1.0, 2.0, 3.0, 4.0])]);
    let path = dir.path().join(SINGLE_FILE);
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() - 5]).unwrap();
    let err = SafetensorsSource::open(dir.path()).unwrap_err();
    let WeightError::Truncated {
        expected_bytes,
        found_bytes,
        ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(
        (*expected_bytes, *found_bytes),
        (full.len() as u64, full.len() as u64 - 5)
    );
    message(
        &err,
        &["model.safetensors", "truncated", &full.len().to_string()],
    );
    // Shorter than the header itself, and shorter than the 8-byte length prefix.
    std::fs::write(&path, &full[..20]).unwrap();
    assert!(matches!(
        SafetensorsSource::open(dir.path()),
        Err(WeightError::Truncated { .. })
    ));
    std::fs::write(&path, &full[..3]).unwrap();
    let err = SafetensorsSource::open(dir.path()).unwrap_err();
    assert!(
        matches!(
            err,
            WeightError::Truncated {
                expected_bytes: 8,
                found_bytes: 3,
                ..
            }
        ),
        "{err:?}"
    );
    std::fs::write(&path, b"").unwrap();
    assert!(matches!(
        SafetensorsSource::open(dir.path()),
        Err(WeightError::Truncated { .. })
    ));
}

#[test]
fn corrupt_headers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(SINGLE_FILE);
    let with_header = |header: &str| {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(&[0u8; 16]);
        bytes
    };
    let cases: Vec<Vec<u8>> = vec![
        with_header("{not json"),
        with_header(r#"{"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}}"#),
        with_header(r#"{"w": {"dtype": "Q9", "shape": [4], "data_offsets": [0, 16]}}"#),
        u64::MAX.to_le_bytes().to_vec(),
    ];
    for bytes in cases {
        std::fs::write(&path, &bytes).unwrap();
        let err = SafetensorsSource::open(dir.path()).unwrap_err();
        assert!(matches!(err, WeightError::Corrupt { .. }), "{err:?}");
        message(&err, &["model.safetensors", "corrupt"]);
    }
}

#[test]
fn index_naming_a_missing_shard_names_both_files() {
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(
        &dir.path().join("a.safetensors"),
        &[RawTensor::f32("x", &[1], &[1.0])],
    );
    write_index(
        dir.path(),
        &[("x", "a.safetensors"), ("y", "gone.safetensors")],
    );
    let err = SafetensorsSource::open(dir.path()).unwrap_err();
    assert!(matches!(err, WeightError::MissingShard { .. }), "{err:?}");
    message(&err, &[INDEX_FILE, "gone.safetensors", "`y`"]);
}

#[test]
fn bad_indexes_are_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    write_safetensors(
        &dir.path().join("a.safetensors"),
        &[RawTensor::f32("x", &[1], &[1.0])],
    );
    let index = dir.path().join(INDEX_FILE);
    let cases: [(&str, &str); 4] = [
        ("{", "invalid JSON"),
        (r#"{"metadata": {}}"#, "weight_map"),
        (r#"{"weight_map": {"z": "a.safetensors"}}"#, "`z`"),
        (
            r#"{"weight_map": {"x": "../a.safetensors"}}"#,
            "not a plain path",
        ),
    ];
    for (text, needle) in cases {
        std::fs::write(&index, text).unwrap();
        let err = SafetensorsSource::open(dir.path()).unwrap_err();
        assert!(
            matches!(err, WeightError::Corrupt { .. }),
            "{text}: {err:?}"
        );
        message(&err, &[INDEX_FILE, needle]);
    }
}

#[test]
fn empty_directory_has_no_weights() {
    let dir = tempfile::tempdir().unwrap();
    let err = SafetensorsSource::open(dir.path()).unwrap_err();
    assert!(matches!(err, WeightError::NoWeights { .. }));
    message(&err, &["model.safetensors"]);
}

#[test]
fn uploads_land_on_the_device_with_shape_and_dtype() {
    let values = f16_exact_values(12);
    let tail: Vec<f32> = values.iter().map(|v| v * 0.5).collect();
    let dir = dir_with(&[
        RawTensor::f32("w", &[3, 4], &values),
        RawTensor::f16("t", &[3, 4], &tail),
    ]);
    let source = open(dir.path());
    let gpu = CpuBackend::default();
    let stream = gpu.default_stream();
    let loader = WeightLoader::new(&source, &gpu, stream);

    let w = loader.upload_bf16("w", &[3, 4]).unwrap();
    assert_eq!(
        (w.shape.clone(), w.dtype, w.numel(), w.bytes()),
        (vec![3, 4], DType::Bf16, 12, 24)
    );
    let back: Vec<bf16> = gpu.download(w.ptr, 12, stream).unwrap();
    assert_eq!(back, source.load_bf16("w", &[3, 4]).unwrap());

    let f = loader.upload_f32("w", &[3, 4]).unwrap();
    assert_eq!(f.dtype, DType::F32);
    assert_eq!(gpu.download::<f32>(f.ptr, 12, stream).unwrap(), values);

    let fused = loader
        .upload_bf16_concat(&[("w", &[3, 4]), ("t", &[3, 4])])
        .unwrap();
    assert_eq!(fused.shape, vec![6, 4]);
    let back: Vec<bf16> = gpu.download(fused.ptr, 24, stream).unwrap();
    let expected: Vec<bf16> = values
        .iter()
        .chain(&tail)
        .map(|&v| bf16::from_f32(v))
        .collect();
    assert_eq!(back, expected);
    assert_ne!(w.ptr, fused.ptr);
}

#[test]
fn device_failure_names_the_tensor_and_leaks_nothing() {
    let dir = dir_with(&[RawTensor::f32("big", &[64], &[1.0; 64])]);
    let source = open(dir.path());
    let gpu = CpuBackend::new(CpuBackendOptions {
        memory_limit_bytes: 32,
    });
    let loader = WeightLoader::new(&source, &gpu, gpu.default_stream());
    let err = loader.upload_bf16("big", &[64]).unwrap_err();
    assert!(matches!(err, WeightError::Device { .. }), "{err:?}");
    message(&err, &["`big`", "device error"]);
    assert_eq!(gpu.used_bytes(), 0);
    let err = loader
        .upload_bf16_concat(&[("big", &[64]), ("big", &[64])])
        .unwrap_err();
    message(&err, &["`big + big`"]);
}

#[test]
fn load_errors_come_before_any_allocation() {
    let dir = dir_with(&[RawTensor::f32("w", &[2], &[1.0, 2.0])]);
    let source = open(dir.path());
    let gpu = CpuBackend::default();
    let loader = WeightLoader::new(&source, &gpu, gpu.default_stream());
    assert!(matches!(
        loader.upload_bf16("w", &[3]),
        Err(WeightError::Shape { .. })
    ));
    assert!(matches!(
        loader.upload_f32("nope", &[2]),
        Err(WeightError::Missing { .. })
    ));
    assert_eq!(gpu.used_bytes(), 0);
}

#[test]
fn fp8_scales_per_block_per_channel_and_per_tensor_give_each_element_its_scale() {
    use metrale_gpu_runtime::fp8::{FP8_BLOCK_ROW_SHIFT, dequant_element};
    // A [130, 136] weight: two row blocks and two column blocks, both partial.
    let (n, k) = (130usize, 136usize);
    let mut rng = metrale_testkit::Rng::new(5);
    let bytes: Vec<u8> = (0..n * k)
        .map(|_| {
            let b = rng.below(256) as u8;
            if b & 0x7F == 0x7F { b & 0xF0 } else { b }
        })
        .collect();
    let grid = [0.5f32, 0.25, 2.0, 0.125];
    let channel: Vec<f32> = (0..n).map(|r| 0.01 * (r + 1) as f32).collect();
    let dir = dir_with(&[
        RawTensor::fp8("a.weight", &[n, k], &bytes),
        RawTensor::f32("a.weight_scale_inv", &[2, 2], &grid),
        RawTensor::fp8("b.weight", &[n, k], &bytes),
        RawTensor::bf16("b.weight_scale", &[n, 1], &channel),
        RawTensor::fp8("c.weight", &[n, k], &bytes),
        RawTensor::f32("c.weight_scale", &[], &[3.0]),
        RawTensor::fp8("d.weight", &[n, k], &bytes),
        RawTensor::f32("d.weight_scale_inv", &[2, 3], &[1.0; 6]),
        RawTensor::fp8("e.weight", &[n, k], &bytes),
        RawTensor::f32("e.weight_scale_inv", &[2, 2], &[0.5, 0.5, 300.0, 0.5]),
    ]);
    let source = open(dir.path());
    let expect = |name: &str, scale: &dyn Fn(usize, usize) -> f32| {
        let w = source.load_fp8(name, &[n, k]).unwrap();
        let want: Vec<bf16> = (0..n * k)
            .map(|i| dequant_element(bytes[i], scale(i / k, i % k)))
            .collect();
        assert_eq!(w.dequantized(), want, "{name}");
        w
    };
    let a = expect("a.weight", &|r, c| grid[(r / 128) * 2 + c / 128]);
    assert_eq!(a.row_shift, FP8_BLOCK_ROW_SHIFT);
    let b = expect("b.weight", &|r, _| bf16::from_f32(channel[r]).to_f32());
    assert_eq!(b.row_shift, 0);
    expect("c.weight", &|_, _| 3.0);
    // A grid of the wrong shape, and a scale the kernels cannot use, are refused by name.
    let e = source.load_fp8("d.weight", &[n, k]).unwrap_err();
    message(&e, &["d.weight_scale_inv", "[2, 2]", "[2, 3]"]);
    let e = source.load_fp8("e.weight", &[n, k]).unwrap_err();
    message(&e, &["e.weight_scale_inv", "300"]);
    // Bytes loaded as bf16 are the dequantized weight.
    assert_eq!(
        source.load_bf16("a.weight", &[n, k]).unwrap(),
        a.dequantized()
    );
}

#[test]
fn a_slice_reads_the_rows_and_columns_it_names_and_refuses_one_past_the_tensor() {
    // A [3, 2, 5] tensor seen as [6, 5]: element (r, c) = 10 r + c, exact in bf16 and f16.
    let values: Vec<f32> = (0..30).map(|i| (10 * (i / 5) + i % 5) as f32).collect();
    let dir = dir_with(&[
        RawTensor::f16("w", &[3, 2, 5], &values),
        RawTensor::f32("v", &[6], &[0.5, 1.5, 2.5, 3.5, 4.5, 5.5]),
    ]);
    let source = open(dir.path());
    let rows = TensorSlice::rows(&[3, 2, 5], vec![4..6, 1..2]);
    let got: Vec<f32> = (source.load_bf16_slice("w", &[3, 2, 5], &rows).unwrap())
        .iter()
        .map(|b| b.to_f32())
        .collect();
    let want: Vec<f32> = [4, 5, 1]
        .iter()
        .flat_map(|&r| (0..5).map(move |c| (10 * r + c) as f32))
        .collect();
    assert_eq!(got, want);
    let cols = TensorSlice::cols(&[3, 2, 5], 1..3);
    let got: Vec<f32> = (source.load_bf16_slice("w", &[3, 2, 5], &cols).unwrap())
        .iter()
        .map(|b| b.to_f32())
        .collect();
    let want: Vec<f32> = (0..6)
        .flat_map(|r| (1..3).map(move |c| (10 * r + c) as f32))
        .collect();
    assert_eq!(got, want);
    let v = TensorSlice::row_span(&[6], 2..4);
    assert_eq!(
        source.load_f32_slice("v", &[6], &v).unwrap(),
        vec![2.5, 3.5]
    );
    let past = TensorSlice::row_span(&[3, 2, 5], 5..7);
    let err = source.load_bf16_slice("w", &[3, 2, 5], &past).unwrap_err();
    message(&err, &["`w`", "5..7", "of 6"]);
    let err = (source.load_bf16_slice("w", &[3, 10], &cols)).unwrap_err();
    assert!(matches!(err, WeightError::Shape { .. }), "{err}");
}
