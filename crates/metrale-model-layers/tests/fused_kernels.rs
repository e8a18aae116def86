//! The fused kernels of the circuit's `bit_identical` rules on the CPU backend (CI): the CPU twin
//! of `rope::qk_norm_rope_kv_store` leaves rows and caches within a bf16 rounding of an f64
//! transcription of the definitions (each q and k head RMS-normalised, then rotated; the cache
//! slot of each real row holding its rotated k and its untouched v), and byte for byte what
//! `qk_norm_rope` then `kv_store` leave, on random inputs (never zeros) with poisoned caches and
//! padding slots, and likewise into FP8 pools (e4m3 of each value over its scale); a fused
//! launch whose two halves describe different rows is refused; the CPU
//! twin of `gemm::linear_swiglu` leaves `silu(x · w_gate) * (x · w_up)` computed in f64 within a
//! bf16 rounding, and what `linear` then `silu_mul` leave. The CUDA kernels are held to the same
//! in `gpu_kernels/fused.rs` on the GPU machine.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use half::bf16;
use metrale_gpu_runtime::fp8::kv_quantize;
use metrale_gpu_runtime::{CpuBackend, DevicePtr, GpuBackend, GpuBackendExt, StreamHandle};
use metrale_model_layers::Ops;
use metrale_model_layers::ops::{KvStore, Matrix, QkNormRope};
use metrale_testkit::Rng;

const S: StreamHandle = StreamHandle::DEFAULT;

/// `n` values uniform in `[-3, 3)`, from `seed`.
fn values(n: usize, seed: u64) -> Vec<bf16> {
    Rng::new(seed).bf16s(n, -3.0, 3.0)
}

/// `v` in a new buffer.
fn upload(gpu: &Arc<dyn GpuBackend>, v: &[bf16]) -> DevicePtr {
    let b = gpu.alloc(v.len() * 2).unwrap();
    gpu.upload(b, v, S).unwrap();
    b
}

/// A new buffer of `halves` bf16, every one 0xFFFF (a NaN no kernel writes).
fn poisoned(gpu: &Arc<dyn GpuBackend>, halves: usize) -> DevicePtr {
    let b = gpu.alloc(halves * 2).unwrap();
    gpu.memset(b, 0xFF, halves * 2, S).unwrap();
    b
}

/// `|got[i] - want[i]| <= tol(i)` for every element, and no poison left.
fn assert_near(got: &[bf16], want: &[f64], tol: impl Fn(usize) -> f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f64();
        assert!(
            (g - w).abs() <= tol(i),
            "{what}[{i}]: got {g}, want {w} (tolerance {})",
            tol(i)
        );
    }
}

/// One q or k head in f64, from the definitions: RMS-normalised (`eps`) with weight `w`
/// (`1 + w` when `unit`), then its first `rd` channels rotated half against half by
/// `pos * freqs[i]`, with cos and sin times `scale` (YaRN's attention factor; 1 otherwise).
fn ref_head(
    x: &[bf16],
    w: &[bf16],
    unit: bool,
    (freqs, scale): (&[f32], f64),
    pos: u32,
    rd: usize,
) -> Vec<f64> {
    let x: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    let mut y: Vec<f64> = x
        .iter()
        .zip(w)
        .map(|(v, w)| v * inv * if unit { 1.0 + w.to_f64() } else { w.to_f64() })
        .collect();
    let half = rd / 2;
    for i in 0..half {
        let angle = f64::from(pos) * f64::from(freqs[i]);
        let (cos, sin) = (angle.cos() * scale, angle.sin() * scale);
        let (a, b) = (y[i], y[i + half]);
        y[i] = a * cos - b * sin;
        y[i + half] = b * cos + a * sin;
    }
    y
}

#[test]
fn the_cpu_twin_of_qk_norm_rope_kv_store_is_the_definition_and_the_two_launches() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let ops = Ops::new(gpu.clone()).unwrap();
    // (head_dim, rotary_dim, q heads, kv heads, gated queries, zero-centred norms, the factor
    // on cos and sin: 1, or YaRN's)
    for (d, rd, hq, hkv, gated, unit, attention_scaling) in [
        (32u32, 32u32, 4u32, 2u32, false, false, 1.0f32),
        (24, 8, 2, 1, true, true, 1.138_629_4),
    ] {
        let (rows, num_slots) = (5u32, 20u32);
        let q_stride = if gated { 2 * d } else { d };
        let k_offset = hq * q_stride;
        let v_offset = k_offset + hkv * d;
        let stride = v_offset + hkv * d;
        let input = values((rows * stride) as usize, u64::from(d));
        let up = |v: &[bf16]| upload(&gpu, v);
        let (q_norm, k_norm) = (values(d as usize, 7), values(d as usize, 8));
        let (qn, kn) = (up(&q_norm), up(&k_norm));
        let freqs: Vec<f32> = (0..rd / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rd as f32))
            .collect();
        let freqs_buf = gpu.alloc(freqs.len() * 4).unwrap();
        gpu.upload(freqs_buf, &freqs, S).unwrap();
        let positions = gpu.alloc(rows as usize * 4).unwrap();
        let row_positions = [3u32, 900, 17, 4000, 1];
        gpu.upload(positions, &row_positions, S).unwrap();
        let slots = gpu.alloc(rows as usize * 4).unwrap();
        let row_slots = [7u32, u32::MAX, 0, 19, 11];
        gpu.upload(slots, &row_slots, S).unwrap();
        let cache = (num_slots * hkv * d) as usize * 2;
        let mut sets = Vec::new();
        for _ in 0..2 {
            let (kc, vc) = (gpu.alloc(cache).unwrap(), gpu.alloc(cache).unwrap());
            gpu.memset(kc, 0xFF, cache, S).unwrap();
            gpu.memset(vc, 0xFF, cache, S).unwrap();
            sets.push((up(&input), kc, vc));
        }
        let rope = |qkv: DevicePtr| QkNormRope {
            qkv,
            q_norm: qn,
            k_norm: kn,
            inv_freq: freqs_buf,
            positions,
            rows,
            row_stride: stride,
            num_q_heads: hq,
            q_head_stride: q_stride,
            k_offset,
            num_kv_heads: hkv,
            head_dim: d,
            rotary_dim: rd,
            attention_scaling,
            eps: 1e-6,
            unit_offset: unit,
        };
        let store = |(qkv, k_cache, v_cache): (DevicePtr, DevicePtr, DevicePtr)| KvStore {
            k_cache,
            v_cache,
            qkv,
            slot_mapping: slots,
            rows,
            row_stride: stride,
            k_offset,
            v_offset,
            num_kv_heads: hkv,
            head_dim: d,
            num_slots,
            kv_fp8: 0,
            k_scale: 1.0,
            v_scale: 1.0,
        };
        ops.qk_norm_rope(S, &rope(sets[0].0)).unwrap();
        ops.kv_store(S, &store(sets[0])).unwrap();
        ops.qk_norm_rope_kv_store(S, &rope(sets[1].0), &store(sets[1]))
            .unwrap();
        let bytes = |p: DevicePtr, n: usize| gpu.download::<u8>(p, n, S).unwrap();
        let row_bytes = (rows * stride) as usize * 2;
        assert_eq!(
            bytes(sets[0].0, row_bytes),
            bytes(sets[1].0, row_bytes),
            "rows (d={d})"
        );
        assert_eq!(
            bytes(sets[0].1, cache),
            bytes(sets[1].1, cache),
            "k cache (d={d})"
        );
        assert_eq!(
            bytes(sets[0].2, cache),
            bytes(sets[1].2, cache),
            "v cache (d={d})"
        );
        // The fused rows against the definition: every q and k head normalised and rotated,
        // gates and v untouched. One bf16 rounding of the result (2^-9 relative) plus the f32
        // arithmetic of the twin (the angle of position 4000 in f32 is off by up to 1.2e-4 rad)
        // stay within 2^-8 of the value and 2^-10 of the head's largest value.
        let (d_, stride_) = (d as usize, stride as usize);
        let got_rows: Vec<bf16> = gpu
            .download(sets[1].0, (rows * stride) as usize, S)
            .unwrap();
        let mut want_rows: Vec<f64> = input.iter().map(|v| v.to_f64()).collect();
        let mut head_max = vec![0.0f64; want_rows.len()];
        for (r, &pos) in row_positions.iter().enumerate() {
            let q_heads = (0..hq as usize).map(|h| (h * q_stride as usize, &q_norm));
            let k_heads = (0..hkv as usize).map(|h| (k_offset as usize + h * d_, &k_norm));
            for (at, w) in q_heads.chain(k_heads) {
                let at = r * stride_ + at;
                let rotation = (freqs.as_slice(), f64::from(attention_scaling));
                let y = ref_head(&input[at..at + d_], w, unit, rotation, pos, rd as usize);
                let max = y.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                want_rows[at..at + d_].copy_from_slice(&y);
                head_max[at..at + d_].fill(max);
            }
        }
        assert_near(
            &got_rows,
            &want_rows,
            |i| want_rows[i].abs() / 256.0 + head_max[i] / 1024.0,
            &format!("rows (d={d})"),
        );
        // The cache slot of every real row holds that row's rotated k and its v, bit for bit;
        // the padding row's and the unused slots stay poisoned.
        let (k_cache, v_cache): (Vec<u16>, Vec<u16>) = (
            gpu.download(sets[1].1, cache / 2, S).unwrap(),
            gpu.download(sets[1].2, cache / 2, S).unwrap(),
        );
        let width = (hkv * d) as usize;
        let mut want_k = vec![0xFFFFu16; cache / 2];
        let mut want_v = vec![0xFFFFu16; cache / 2];
        for (r, &slot) in row_slots.iter().enumerate() {
            if slot == u32::MAX {
                continue;
            }
            let (row, at) = (r * stride_, slot as usize * width);
            let k_at = row + k_offset as usize;
            let v_at = row + v_offset as usize;
            for c in 0..width {
                want_k[at + c] = got_rows[k_at + c].to_bits();
                want_v[at + c] = input[v_at + c].to_bits();
            }
        }
        assert!(k_cache == want_k, "k cache (d={d})");
        assert!(v_cache == want_v, "v cache (d={d})");
        // FP8 pools: the fused launch and the two launches store the same e4m3 bytes, each slot
        // e4m3 of its row's rotated (rounded) k and its v over their scales.
        let (k_scale, v_scale) = (0.02f32, 0.3f32);
        let fp8_cache = cache / 2;
        let mut fp8_sets = Vec::new();
        for _ in 0..2 {
            let (kc, vc) = (gpu.alloc(fp8_cache).unwrap(), gpu.alloc(fp8_cache).unwrap());
            gpu.memset(kc, 0xFF, fp8_cache, S).unwrap();
            gpu.memset(vc, 0xFF, fp8_cache, S).unwrap();
            fp8_sets.push((up(&input), kc, vc));
        }
        let fp8_store = |set| KvStore {
            kv_fp8: 1,
            k_scale,
            v_scale,
            ..store(set)
        };
        ops.qk_norm_rope(S, &rope(fp8_sets[0].0)).unwrap();
        ops.kv_store(S, &fp8_store(fp8_sets[0])).unwrap();
        ops.qk_norm_rope_kv_store(S, &rope(fp8_sets[1].0), &fp8_store(fp8_sets[1]))
            .unwrap();
        let (k8, v8) = (
            bytes(fp8_sets[1].1, fp8_cache),
            bytes(fp8_sets[1].2, fp8_cache),
        );
        assert!(k8 == bytes(fp8_sets[0].1, fp8_cache), "fp8 k cache (d={d})");
        assert!(v8 == bytes(fp8_sets[0].2, fp8_cache), "fp8 v cache (d={d})");
        let mut want_k8 = vec![0xFFu8; fp8_cache];
        let mut want_v8 = vec![0xFFu8; fp8_cache];
        for (r, &slot) in row_slots.iter().enumerate() {
            if slot == u32::MAX {
                continue;
            }
            let (row, at) = (r * stride_, slot as usize * width);
            for c in 0..width {
                want_k8[at + c] = kv_quantize(got_rows[row + k_offset as usize + c], k_scale);
                want_v8[at + c] = kv_quantize(input[row + v_offset as usize + c], v_scale);
            }
        }
        assert!(
            k8 == want_k8,
            "fp8 k cache against e4m3 of the rows (d={d})"
        );
        assert!(
            v8 == want_v8,
            "fp8 v cache against e4m3 of the values (d={d})"
        );
        // Halves that disagree about the rows are refused.
        let mut other = store(sets[1]);
        other.rows = rows - 1;
        assert!(
            ops.qk_norm_rope_kv_store(S, &rope(sets[1].0), &other)
                .is_err()
        );
    }
}

#[test]
fn the_cpu_twin_of_linear_swiglu_is_the_definition_and_linear_then_silu_mul() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let ops = Ops::new(gpu.clone()).unwrap();
    let up = |v: &[bf16]| upload(&gpu, v);
    let poisoned = |halves: usize| poisoned(&gpu, halves);
    // (rows, ffn, hidden): one row, and rows, ffn and hidden none of them multiples of 8.
    for (m, n, k) in [(1u32, 24u32, 96u32), (5, 41, 1003)] {
        let x_host = values((m * k) as usize, u64::from(k));
        let w_host: Vec<bf16> = values((2 * n * k) as usize, 5)
            .into_iter()
            .map(|v| bf16::from_f32(v.to_f32() * 0.05))
            .collect();
        let (x, w) = (up(&x_host), up(&w_host));
        let (gate_up, chained, fused) = (
            poisoned((m * 2 * n) as usize),
            poisoned((m * n) as usize),
            poisoned((m * n) as usize),
        );
        let (x, w) = (Matrix::bf16(x, m, k), Matrix::bf16(w, 2 * n, k));
        let gate_up = Matrix::bf16(gate_up, m, 2 * n);
        ops.linear(S, gate_up, x, w).unwrap();
        ops.silu_mul(S, Matrix::bf16(chained, m, n), gate_up)
            .unwrap();
        ops.linear_swiglu(S, Matrix::bf16(fused, m, n), x, w)
            .unwrap();
        let halves = (m * n) as usize;
        let chained: Vec<u16> = gpu.download(chained, halves, S).unwrap();
        let fused: Vec<u16> = gpu.download(fused, halves, S).unwrap();
        assert!(
            chained.iter().all(|&h| h != 0xFFFF),
            "m={m} n={n} k={k}: the chain left an output unwritten"
        );
        assert_eq!(fused, chained, "m={m} n={n} k={k}");
        // The definition in f64: `silu(g) * u`, g and u the dot products of the row with gate
        // row j and up row n + j. The twin sums them in f32 (off by at most k 2^-24 of the sum
        // of |x w|: under 2^-14 for k up to 1003), rounds them to bf16 as the unfused pair
        // stores gate_up (2^-9 relative) and rounds the result (2^-9 relative); each error is
        // carried through silu's slope and allowed twice.
        let (m, n, k) = (m as usize, n as usize, k as usize);
        let dot = |row: usize, wrow: usize| -> (f64, f64) {
            let (x, w) = (&x_host[row * k..][..k], &w_host[wrow * k..][..k]);
            x.iter().zip(w).fold((0.0, 0.0), |(s, a), (x, w)| {
                let p = x.to_f64() * w.to_f64();
                (s + p, a + p.abs())
            })
        };
        let (mut want, mut tol) = (Vec::new(), Vec::new());
        for row in 0..m {
            for j in 0..n {
                let ((g, ga), (u, ua)) = (dot(row, j), dot(row, n + j));
                let sigmoid = 1.0 / (1.0 + (-g).exp());
                let (silu, slope) = (g * sigmoid, sigmoid * (1.0 + g * (1.0 - sigmoid)));
                let (dg, du) = (g.abs() / 256.0 + ga / 8192.0, u.abs() / 256.0 + ua / 8192.0);
                want.push(silu * u);
                tol.push(slope.abs() * dg * u.abs() + silu.abs() * du + (silu * u).abs() / 256.0);
            }
        }
        let fused: Vec<bf16> = fused.into_iter().map(bf16::from_bits).collect();
        assert_near(&fused, &want, |i| tol[i], &format!("m={m} n={n} k={k}"));
    }
}
