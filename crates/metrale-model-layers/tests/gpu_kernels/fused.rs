//! The fused kernels of the circuit's `bit_identical` rules on CUDA (GPU machine only):
//! `rope::qk_norm_rope_kv_store` leaves byte for byte what `qk_norm_rope` then `kv_store` leave
//! (the rotated rows and both cache pools), on CUDA and on the CPU twin, and CUDA against the CPU
//! within the bf16 tolerance. Random inputs (never zeros), poisoned caches, padding slots, the
//! scalar path (head_dim not a multiple of 8), partial rotary with gated queries, and no q/k
//! norms (Llama); `gemm::linear_swiglu` leaves byte for byte what `linear` then `silu_mul`
//! leave, on CUDA and on the CPU twin; `gemm::linear_tma_swiglu` (bf16 and block-FP8 weights)
//! writes byte for byte the stage images `linear` then `silu_mul_staged` write. Each check takes
//! its shapes, so `small` runs them at the sanitizer's sizes.

use metrale_gpu_runtime::DevicePtr;
use metrale_gpu_runtime::fp8::{self, FP8_BLOCK_ROW_SHIFT};
use metrale_model_layers::ops::{KvStore, Matrix, QkNormRope};
use metrale_model_layers::ops_gemm::linear_staging_bytes;

use super::fp8::fp8_matrix;
use super::harness::{Buf, Pair, Rng, S, Tolerance};
use super::rows::inv_freq;
use super::staged::{image_rows, permuted_pair};

/// Both checks at small shapes (the sanitizer set).
pub(super) fn small(p: &Pair) {
    let rng = &mut Rng::new(1006);
    rope_store(
        p,
        rng,
        &[
            (128, 64, 4, 1, true, true, true),
            (100, 64, 3, 1, false, false, false),
        ],
    );
    swiglu(p, rng, &[(2, 72, 96), (3, 41, 101)]);
    tma_swiglu(p, rng, &[(130, 64, 128, false), (130, 128, 256, true)]);
}

/// One set of buffers the chain or the fused kernel writes.
struct Set {
    qkv: Buf,
    kc: Buf,
    vc: Buf,
}

#[test]
fn qk_norm_rope_kv_store_is_the_two_launches_byte_for_byte() {
    let cases = [
        (128, 128, 8, 2, false, true, false),
        (256, 64, 4, 1, true, true, true),
        (100, 64, 3, 1, false, true, false),
        (64, 64, 4, 4, false, false, false),
    ];
    rope_store(&Pair::new(), &mut Rng::new(41), &cases);
}

/// `(head_dim, rotary_dim, q heads, kv heads, gated queries, q/k norms, zero-centred)` each,
/// into bf16 pools and into FP8 pools (e4m3 of the rounded key and of the value over their
/// scales: scales the kernels divide by, and powers of two they multiply by the reciprocal of).
fn rope_store(p: &Pair, rng: &mut Rng, cases: &[(u32, u32, u32, u32, bool, bool, bool)]) {
    let formats = [None, Some((0.02f32, 0.3f32)), Some((0.007_812_5, 1.0))];
    let runs = cases
        .iter()
        .flat_map(|c| formats.iter().map(move |f| (c, *f)));
    for (i, (&(d, rd, hq, hkv, gated, norms, unit), fp8)) in runs.enumerate() {
        let (k_scale, v_scale) = fp8.unwrap_or((1.0, 1.0));
        // YaRN's factor on cos and sin in every other case, exactly 1 in the others.
        let attention_scaling = if i % 2 == 0 { 1.138_629_4 } else { 1.0 };
        let (rows, num_slots) = (6u32, 48u32);
        let q_stride = if gated { 2 * d } else { d };
        let k_offset = hq * q_stride;
        let v_offset = k_offset + hkv * d;
        let stride = v_offset + hkv * d + 5;
        let input = rng.bf16s((rows * stride) as usize, -3.0, 3.0);
        let qn = p.upload(&rng.bf16s(d as usize, 0.5, 1.5));
        let kn = p.upload(&rng.bf16s(d as usize, 0.5, 1.5));
        let freqs = p.upload(&inv_freq(rd, 1_000_000.0));
        let positions: Vec<u32> = (0..rows).map(|_| rng.below(30_000)).collect();
        let positions = p.upload(&positions);
        let mut slots: Vec<u32> = rng.permutation(num_slots)[..rows as usize].to_vec();
        slots[1] = u32::MAX;
        slots[4] = u32::MAX;
        let slot_mapping = p.upload(&slots);
        let cache_bytes = (num_slots * hkv * d) as usize * if fp8.is_some() { 1 } else { 2 };
        let set = || Set {
            qkv: p.upload(&input),
            kc: p.poisoned(cache_bytes),
            vc: p.poisoned(cache_bytes),
        };
        let (chain, fused) = (set(), set());
        let rope = |s: &Set, at: &dyn Fn(&Buf) -> DevicePtr| QkNormRope {
            qkv: at(&s.qkv),
            q_norm: if norms { at(&qn) } else { DevicePtr::NULL },
            k_norm: if norms { at(&kn) } else { DevicePtr::NULL },
            inv_freq: at(&freqs),
            positions: at(&positions),
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
        let store = |s: &Set, at: &dyn Fn(&Buf) -> DevicePtr| KvStore {
            k_cache: at(&s.kc),
            v_cache: at(&s.vc),
            qkv: at(&s.qkv),
            slot_mapping: at(&slot_mapping),
            rows,
            row_stride: stride,
            k_offset,
            v_offset,
            num_kv_heads: hkv,
            head_dim: d,
            num_slots,
            kv_fp8: fp8.is_some() as u32,
            k_scale,
            v_scale,
        };
        p.run(|o, at| {
            o.qk_norm_rope(S, &rope(&chain, at))?;
            o.kv_store(S, &store(&chain, at))
        });
        p.run(|o, at| o.qk_norm_rope_kv_store(S, &rope(&fused, at), &store(&fused, at)));
        let case = format!(
            "d={d} rd={rd} hq={hq} hkv={hkv} gated={gated} norms={norms} \
             attention_scaling={attention_scaling} fp8={fp8:?}"
        );
        for (name, a, b) in [
            ("rows", &chain.qkv, &fused.qkv),
            ("k cache", &chain.kc, &fused.kc),
            ("v cache", &chain.vc, &fused.vc),
        ] {
            let (ga, ca) = p.download::<u16>(a);
            let (gb, cb) = p.download::<u16>(b);
            assert!(
                ga == gb,
                "{case}: CUDA {name} differs from the two launches"
            );
            assert!(ca == cb, "{case}: CPU {name} differs from the two launches");
        }
        let written = if fp8.is_some() {
            // e4m3 bytes: never the NaN code 0xFF from finite values.
            let (kc, _) = p.download::<u8>(&fused.kc);
            kc.iter().filter(|&&b| b != 0xFF).count()
        } else {
            let (kc, _) = p.download::<u16>(&fused.kc);
            kc.iter().filter(|&&b| b != 0xFFFF).count()
        };
        assert_eq!(
            written,
            4 * (hkv * d) as usize,
            "{case}: padding rows wrote"
        );
        p.check_bf16("qk_norm_rope_kv_store", &case, &fused.qkv, Tolerance::BF16);
        if fp8.is_some() {
            // The rounded rows agree within bf16; each cache byte is e4m3 of its row's value,
            // so CUDA and the twin agree wherever their rows do (the values bitwise).
            let (gv, cv) = p.download::<u8>(&fused.vc);
            assert!(gv == cv, "{case}: the FP8 v cache differs from the twin's");
        } else {
            p.check_bf16("qk_norm_rope_kv_store", &case, &fused.kc, Tolerance::BF16);
            p.check_bf16("qk_norm_rope_kv_store", &case, &fused.vc, Tolerance::EXACT);
        }
    }
}

#[test]
fn linear_swiglu_is_linear_then_silu_mul_byte_for_byte() {
    // (rows, ffn, hidden): a Qwen3-8B-shaped gate/up projection at one and eight rows, a row
    // tile of 16 (x rows g + 8), ffn not a multiple of 8 (a unit past the end), hidden not a
    // multiple of 8 (scalar loads), a short hidden (empty segments).
    let shapes = [
        (1, 12288, 4096),
        (8, 1000, 4096),
        (13, 136, 1000),
        (3, 41, 1003),
        (2, 72, 96),
    ];
    swiglu(&Pair::new(), &mut Rng::new(43), &shapes);
}

/// `linear_swiglu` against `linear` then `silu_mul` at `(rows, ffn, hidden)` each.
fn swiglu(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    for &(m, n, k) in shapes {
        let x = p.upload(&rng.bf16s((m * k) as usize, -4.0, 4.0));
        let s = (3.0 / k as f32).sqrt();
        let w = p.upload(&rng.bf16s((2 * n * k) as usize, -s, s));
        let gate_up = p.poisoned((m * 2 * n) as usize * 2);
        let chained = p.poisoned((m * n) as usize * 2);
        let fused = p.poisoned((m * n) as usize * 2);
        let gu = |at: super::harness::At<'_>| Matrix::bf16(at(&gate_up), m, 2 * n);
        let xw = |at: super::harness::At<'_>| {
            (Matrix::bf16(at(&x), m, k), Matrix::bf16(at(&w), 2 * n, k))
        };
        p.run(|o, at| {
            let (x, w) = xw(at);
            o.linear(S, gu(at), x, w)
        });
        p.run(|o, at| o.silu_mul(S, Matrix::bf16(at(&chained), m, n), gu(at)));
        p.run(|o, at| {
            let (x, w) = xw(at);
            o.linear_swiglu(S, Matrix::bf16(at(&fused), m, n), x, w)
        });
        let case = format!("m={m} n={n} k={k}");
        let (gf, cf) = p.download::<u16>(&fused);
        let (gc, cc) = p.download::<u16>(&chained);
        assert!(
            gf == gc,
            "{case}: CUDA linear_swiglu differs from linear + silu_mul"
        );
        assert!(
            cf == cc,
            "{case}: the CPU twin differs from linear + silu_mul"
        );
        p.check_bf16("linear_swiglu", &case, &fused, Tolerance::BF16);
    }
}

#[test]
fn linear_tma_swiglu_writes_the_images_of_linear_then_silu_mul_staged() {
    // (rows, ffn, hidden, FP8 weight): two row tiles, the second almost empty; three column
    // tiles; segments ending inside a stage (k = 2112: 66 chunks, 9 a segment); a Qwen3-8B-wide
    // input at 300 rows; and FP8 weights with 128-row scale blocks (a tile's gate and up rows in
    // different blocks).
    let shapes = [
        (130, 64, 1024, false),
        (257, 192, 512, false),
        (200, 128, 2112, false),
        (300, 256, 4096, false),
        (129, 192, 1024, true),
        (300, 320, 4096, true),
    ];
    tma_swiglu(&Pair::new(), &mut Rng::new(44), &shapes);
}

/// `linear_tma_swiglu` (through `Ops::linear_swiglu_staged`) against `linear` then
/// `silu_mul_staged` at `(rows, ffn, hidden, fp8)` each: the image rows bitwise on CUDA and on
/// the CPU twin, CUDA within bf16 of the twin. An FP8 weight's chain runs on its dequantized bf16
/// weight (bitwise what `linear` of the FP8 weight gives).
fn tma_swiglu(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32, bool)]) {
    for &(m, n, k, fp8_weight) in shapes {
        let case = format!("m={m} ffn={n} k={k} fp8 {fp8_weight}");
        p.stage_linear(Some((m, k)));
        let x = p.upload(&rng.bf16s((m * k) as usize, -1.0, 1.0));
        let s = 1.5 * (3.0 / k as f32).sqrt();
        let w = rng.bf16s((2 * n * k) as usize, -s, s);
        // The weight the chain multiplies (bf16), and the one the fused kernel reads.
        let (wb, fp8_parts) = if fp8_weight {
            let (q, grid) = fp8::quantize(&w, (2 * n as usize, k as usize));
            let (q, grid) = (p.upload(&q), p.upload(&grid));
            let deq = p.poisoned((2 * n * k) as usize * 2);
            p.run(|o, at| {
                o.dequant_fp8(
                    S,
                    Matrix::bf16(at(&deq), 2 * n, k),
                    fp8_matrix(&q, &grid, FP8_BLOCK_ROW_SHIFT, (2 * n, k), at),
                )
            });
            (deq, Some((q, grid)))
        } else {
            (p.upload(&w), None)
        };
        let weight = |at: super::harness::At<'_>| match &fp8_parts {
            Some((q, grid)) => fp8_matrix(q, grid, FP8_BLOCK_ROW_SHIFT, (2 * n, k), at),
            None => Matrix::bf16(at(&wb), 2 * n, k),
        };
        let (xi_gpu, _) = permuted_pair(p, &x, m, k);
        let xi = p.upload(&xi_gpu);
        // The images go into the memory of the [m, 2 ffn] projection the chain writes.
        let fused = p.poisoned((m * 2 * n) as usize * 2);
        p.run(|o, at| {
            let gu = Matrix::bf16(at(&fused), m, 2 * n);
            let ran =
                o.linear_swiglu_staged(S, (gu, Matrix::bf16(at(&x), m, k), weight(at)), at(&xi))?;
            assert!(ran, "{case}: linear_swiglu_staged declined the call");
            Ok(())
        });
        let gate_up = p.poisoned((m * 2 * n) as usize * 2);
        let chained = p.poisoned(linear_staging_bytes(m, n));
        let act = p.poisoned((m * n) as usize * 2);
        p.run(|o, at| {
            let gu = Matrix::bf16(at(&gate_up), m, 2 * n);
            o.linear(
                S,
                gu,
                Matrix::bf16(at(&x), m, k),
                Matrix::bf16(at(&wb), 2 * n, k),
            )?;
            o.silu_mul_staged(S, at(&chained), Matrix::bf16(at(&act), m, n), gu)
        });
        let (gf, cf) = p.download::<u16>(&fused);
        let (gc, cc) = p.download::<u16>(&chained);
        assert!(
            image_rows(&gf, m, n) == image_rows(&gc, m, n),
            "{case}: CUDA linear_tma_swiglu differs from linear + silu_mul_staged"
        );
        assert!(
            image_rows(&cf, m, n) == image_rows(&cc, m, n),
            "{case}: the CPU twin differs from linear + silu_mul_staged"
        );
        p.check_bf16("linear_tma_swiglu", &case, &fused, Tolerance::BF16);
        p.stage_linear(None);
    }
}
