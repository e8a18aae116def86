//! The fused kernels of the circuit's `bit_identical` rules on the CPU backend (CI): the CPU twin
//! of `rope::qk_norm_rope_kv_store` leaves byte for byte what `qk_norm_rope` then `kv_store`
//! leave, on random inputs (never zeros) with poisoned caches and padding slots; and a fused
//! launch whose two halves describe different rows is refused; the CPU twin of
//! `gemm::linear_swiglu` leaves what `linear` then `silu_mul` leave. The CUDA kernels are held
//! to the same in `gpu_kernels/fused.rs` on the GPU machine.

#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use half::bf16;
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

#[test]
fn the_cpu_twin_of_qk_norm_rope_kv_store_is_the_two_launches_byte_for_byte() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let ops = Ops::new(gpu.clone()).unwrap();
    // (head_dim, rotary_dim, q heads, kv heads, gated queries, zero-centred norms)
    for (d, rd, hq, hkv, gated, unit) in [
        (32u32, 32u32, 4u32, 2u32, false, false),
        (24, 8, 2, 1, true, true),
    ] {
        let (rows, num_slots) = (5u32, 20u32);
        let q_stride = if gated { 2 * d } else { d };
        let k_offset = hq * q_stride;
        let v_offset = k_offset + hkv * d;
        let stride = v_offset + hkv * d;
        let input = values((rows * stride) as usize, u64::from(d));
        let up = |v: &[bf16]| upload(&gpu, v);
        let qn = up(&values(d as usize, 7));
        let kn = up(&values(d as usize, 8));
        let freqs: Vec<f32> = (0..rd / 2)
            .map(|i| 1.0 / 10_000f32.powf(2.0 * i as f32 / rd as f32))
            .collect();
        let freqs_buf = gpu.alloc(freqs.len() * 4).unwrap();
        gpu.upload(freqs_buf, &freqs, S).unwrap();
        let positions = gpu.alloc(rows as usize * 4).unwrap();
        gpu.upload(positions, &[3u32, 900, 17, 4000, 1], S).unwrap();
        let slots = gpu.alloc(rows as usize * 4).unwrap();
        gpu.upload(slots, &[7u32, u32::MAX, 0, 19, 11], S).unwrap();
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
        // The rows did change, and the four real rows (not the padding one) were stored.
        assert_ne!(
            bytes(sets[1].0, row_bytes),
            bytemuck::cast_slice::<bf16, u8>(&input).to_vec()
        );
        let written = bytes(sets[1].1, cache)
            .chunks(2)
            .filter(|b| b != &[0xFF, 0xFF])
            .count();
        assert_eq!(written, 4 * (hkv * d) as usize);
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
fn the_cpu_twin_of_linear_swiglu_is_linear_then_silu_mul_byte_for_byte() {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let ops = Ops::new(gpu.clone()).unwrap();
    let up = |v: &[bf16]| upload(&gpu, v);
    let poisoned = |halves: usize| poisoned(&gpu, halves);
    // (rows, ffn, hidden): one row, and rows, ffn and hidden none of them multiples of 8.
    for (m, n, k) in [(1u32, 24u32, 96u32), (5, 41, 1003)] {
        let x = up(&values((m * k) as usize, u64::from(k)));
        let w: Vec<bf16> = values((2 * n * k) as usize, 5)
            .into_iter()
            .map(|v| bf16::from_f32(v.to_f32() * 0.05))
            .collect();
        let w = up(&w);
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
    }
}
