//! The row-wise kernels against their CPU twins: embedding and row gathers, the RMSNorms, rotary
//! embedding with the q/k norms, the cache store, the SwiGLU gate, argmax, the random fill and
//! the f32-to-bf16 rounding of the all-reduce.
//! Each check takes its shapes, so `small` runs the same checks at the sanitizer's sizes.

use metrale_gpu_runtime::DevicePtr;
use metrale_model_layers::ops::{KvStore, Matrix, Norm, QkNormRope, VocabRows};

use super::harness::{Pair, Rng, S, Tolerance};

/// Every check below at small shapes (the sanitizer set).
pub(super) fn small(p: &Pair) {
    let rng = &mut Rng::new(1001);
    embedding_gather(p, rng, &[(256, 30, 3), (101, 7, 2)]);
    gather_rows(p, rng, &[(256, 9, 3), (101, 5, 2)]);
    norms(p, rng, &[(256, 2), (101, 2)]);
    qk_norm_rope(p, rng, &ROPE_SMALL, &[(false, 2), (true, 130)]);
    kv_store(p, rng, &[(4, 2, 64), (3, 1, 100)]);
    silu_mul(p, rng, &[(256, 2), (101, 1)]);
    argmax(p, rng, &[1001]);
    fill_uniform(p, &[(1003, 3, 0.0, 1.0)]);
    round_bf16(p, rng, &[(3, 101)]);
}

#[test]
fn embedding_gather_widens_the_rows_of_the_ids() {
    embedding_gather(
        &Pair::new(),
        &mut Rng::new(1),
        &[(4096, 300, 5), (1003, 77, 3)],
    );
}

/// `(hidden, vocab, rows)` each, with the whole table, then with the table of a
/// vocabulary-parallel rank (the second quarter of the rows; other ids read zeros).
fn embedding_gather(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    for &(hidden, vocab, rows) in shapes {
        let mut ids: Vec<u32> = (0..rows).map(|_| rng.below(vocab)).collect();
        ids[0] = vocab - 1;
        let (start, quarter) = (vocab / 4, vocab / 4);
        ids[1] = start;
        let ids = p.upload(&ids);
        for (table_rows, first) in [(vocab, 0), (quarter, start)] {
            let table = p.upload(&rng.bf16s((table_rows * hidden) as usize, -2.0, 2.0));
            let out = p.poisoned((rows * hidden) as usize * 4);
            p.run(|o, at| {
                o.embedding_gather(
                    S,
                    Matrix::f32(at(&out), rows, hidden),
                    Matrix::bf16(at(&table), table_rows, hidden),
                    at(&ids),
                    VocabRows {
                        start: first,
                        vocab,
                    },
                )
            });
            p.check_f32(
                "embedding_gather",
                &format!("hidden={hidden} rows={rows} table rows {first}+{table_rows}"),
                &out,
                Tolerance::EXACT,
            );
        }
    }
}

#[test]
fn gather_rows_copies_the_named_rows() {
    gather_rows(
        &Pair::new(),
        &mut Rng::new(2),
        &[(4096, 20, 7), (1003, 9, 4)],
    );
}

/// `(cols, source rows, rows gathered)` each.
fn gather_rows(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    for &(cols, src_rows, n) in shapes {
        let x = p.upload(&rng.bf16s((src_rows * cols) as usize, -3.0, 3.0));
        let ids: Vec<u32> = (0..n)
            .map(|i| if i == 1 { 0 } else { rng.below(src_rows) })
            .collect();
        let ids = p.upload(&ids);
        let out = p.poisoned((n * cols) as usize * 2);
        p.run(|o, at| {
            o.gather_rows(
                S,
                Matrix::bf16(at(&out), n, cols),
                Matrix::bf16(at(&x), src_rows, cols),
                at(&ids),
            )
        });
        p.check_bf16(
            "gather_rows",
            &format!("cols={cols} n={n}"),
            &out,
            Tolerance::EXACT,
        );
    }
}

#[test]
fn rms_norm_and_add_rms_norm_match_in_both_conventions() {
    norms(
        &Pair::new(),
        &mut Rng::new(3),
        &[(4096, 3), (1003, 2), (2048, 5)],
    );
}

/// `rms_norm` and `add_rms_norm` over `(cols, rows)` each, in both weight conventions.
fn norms(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32)]) {
    for &(cols, rows) in shapes {
        for unit in [false, true] {
            let n = (rows * cols) as usize;
            let (lo, hi) = if unit { (-0.3, 0.3) } else { (0.5, 1.5) };
            let w = p.upload(&rng.bf16s(cols as usize, lo, hi));
            let x = p.upload(&rng.f32s(n, -4.0, 4.0));
            let out = p.poisoned(n * 2);
            let case = format!("rows={rows} cols={cols} unit_offset={unit}");
            let norm = |w| Norm {
                w,
                eps: 1e-6,
                unit_offset: unit,
            };
            p.run(|o, at| {
                o.rms_norm(
                    S,
                    Matrix::bf16(at(&out), rows, cols),
                    Matrix::f32(at(&x), rows, cols),
                    &norm(at(&w)),
                )
            });
            p.check_bf16("rms_norm", &case, &out, Tolerance::BF16);

            let residual = p.upload(&rng.f32s(n, -4.0, 4.0));
            let delta = p.upload(&rng.bf16s(n, -2.0, 2.0));
            let out2 = p.poisoned(n * 2);
            p.run(|o, at| {
                o.add_rms_norm(
                    S,
                    Matrix::f32(at(&residual), rows, cols),
                    Matrix::bf16(at(&delta), rows, cols),
                    Matrix::bf16(at(&out2), rows, cols),
                    &norm(at(&w)),
                )
            });
            p.check_f32("add_rms_norm.res", &case, &residual, Tolerance::EXACT);
            p.check_bf16("add_rms_norm", &case, &out2, Tolerance::BF16);
        }
    }
}

/// `rotary_dim / 2` inverse frequencies for base `theta`.
pub(super) fn inv_freq(rotary_dim: u32, theta: f32) -> Vec<f32> {
    (0..rotary_dim / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f32 / rotary_dim as f32))
        .collect()
}

/// `(head_dim, rotary_dim, q heads, kv heads, gated, norms)` of the rotary cases.
type RopeShape = (u32, u32, u32, u32, bool, bool);

/// The sanitizer's rotary shapes: the vector path with gated queries and partial rotary, the
/// scalar path without norms.
const ROPE_SMALL: [RopeShape; 2] = [(128, 64, 4, 1, true, true), (100, 64, 3, 1, false, false)];

#[test]
fn qk_norm_rope_rotates_queries_and_keys_in_place() {
    let cases = [
        (128, 128, 8, 2, false, true),
        (128, 64, 4, 1, true, true),
        (100, 64, 3, 1, false, true),
        (64, 64, 4, 4, false, false),
        (256, 64, 2, 1, true, true),
    ];
    // 130 rows: the prefill launch (8 heads a block, the last block part empty).
    let rows = [(false, 4), (true, 4), (false, 130), (true, 130)];
    qk_norm_rope(&Pair::new(), &mut Rng::new(4), &cases, &rows);
}

/// Every rotary shape at every `(unit_offset, rows)`.
fn qk_norm_rope(p: &Pair, rng: &mut Rng, cases: &[RopeShape], rows_cases: &[(bool, u32)]) {
    for &(d, rd, hq, hkv, gated, norms) in cases {
        for &(unit, rows) in rows_cases {
            let q_stride = if gated { 2 * d } else { d };
            let k_offset = hq * q_stride;
            let stride = k_offset + 2 * hkv * d + 3; // k, v, and a few columns nothing reads
            let qkv = p.upload(&rng.bf16s((rows * stride) as usize, -3.0, 3.0));
            let qn = p.upload(&rng.bf16s(d as usize, 0.5, 1.5));
            let kn = p.upload(&rng.bf16s(d as usize, 0.5, 1.5));
            let freqs = p.upload(&inv_freq(rd, 1_000_000.0));
            let positions: Vec<u32> = (0..rows)
                .map(|r| if r == 0 { 0 } else { rng.below(40_000) })
                .collect();
            let positions = p.upload(&positions);
            // YaRN's factor on cos and sin (Qwen3's 0.1 ln 4 + 1) in half the launches,
            // exactly 1 in the others.
            let attention_scaling = if unit { 1.138_629_4 } else { 1.0 };
            p.run(|o, at| {
                o.qk_norm_rope(
                    S,
                    &QkNormRope {
                        qkv: at(&qkv),
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
                    },
                )
            });
            let case = format!(
                "rows={rows} d={d} rd={rd} hq={hq} hkv={hkv} gated={gated} norms={norms} unit={unit} \
                 attention_scaling={attention_scaling}"
            );
            p.check_bf16("qk_norm_rope", &case, &qkv, Tolerance::BF16);
        }
    }
}

#[test]
fn kv_store_writes_each_row_at_its_slot_and_skips_padding() {
    kv_store(&Pair::new(), &mut Rng::new(5), &[(8, 2, 128), (3, 1, 100)]);
}

/// `(q heads, kv heads, head_dim)` each, into bf16 pools and into FP8 pools (e4m3 bytes; the
/// key scales small enough that some keys saturate at 448; scales the kernel divides by, and
/// powers of two it multiplies by the reciprocal of).
fn kv_store(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32, u32)]) {
    let formats = [None, Some((0.004f32, 0.3f32)), Some((0.003_906_25, 1.0))];
    for (&(hq, hkv, d), fp8) in shapes
        .iter()
        .flat_map(|s| formats.iter().map(move |f| (s, *f)))
    {
        let (rows, num_slots) = (6u32, 64u32);
        let k_offset = hq * d;
        let v_offset = k_offset + hkv * d;
        let stride = v_offset + hkv * d;
        let qkv = p.upload(&rng.bf16s((rows * stride) as usize, -2.0, 2.0));
        let mut slots: Vec<u32> = rng.permutation(num_slots)[..rows as usize].to_vec();
        slots[2] = u32::MAX;
        slots[5] = u32::MAX;
        let slot_mapping = p.upload(&slots);
        let elem = if fp8.is_some() { 1 } else { 2 };
        let (k_scale, v_scale) = fp8.unwrap_or((1.0, 1.0));
        let cache_bytes = (num_slots * hkv * d) as usize * elem;
        let (kc, vc) = (p.poisoned(cache_bytes), p.poisoned(cache_bytes));
        p.run(|o, at| {
            o.kv_store(
                S,
                &KvStore {
                    k_cache: at(&kc),
                    v_cache: at(&vc),
                    qkv: at(&qkv),
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
                },
            )
        });
        for (name, buf) in [("k", &kc), ("v", &vc)] {
            // Written elements: bf16 never 0xFFFF here, e4m3 never the NaN code 0xFF.
            let (written, same) = if fp8.is_some() {
                let (g, c) = p.download::<u8>(buf);
                (g.iter().filter(|&&b| b != 0xFF).count(), g == c)
            } else {
                let (g, c) = p.download::<u16>(buf);
                (g.iter().filter(|&&b| b != 0xFFFF).count(), g == c)
            };
            assert!(
                same,
                "kv_store {name} cache (hkv={hkv}, d={d}, fp8 {fp8:?}) differs bitwise"
            );
            assert_eq!(
                written,
                4 * (hkv * d) as usize,
                "exactly the 4 non-padding rows are written"
            );
        }
        println!(
            "kernel-check {:<18} {:<44} exact (bitwise, padding untouched) ok",
            "kv_store",
            format!("hkv={hkv} d={d} fp8 {fp8:?}")
        );
    }
}

#[test]
fn silu_mul_gates_the_up_projection() {
    silu_mul(
        &Pair::new(),
        &mut Rng::new(9),
        &[(4096, 3), (1003, 2), (12288, 2), (3001, 1)],
    );
}

/// `(ffn, rows)` each.
fn silu_mul(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32)]) {
    for &(ffn, rows) in shapes {
        let gu = p.upload(&rng.bf16s((rows * 2 * ffn) as usize, -6.0, 6.0));
        let out = p.poisoned((rows * ffn) as usize * 2);
        p.run(|o, at| {
            o.silu_mul(
                S,
                Matrix::bf16(at(&out), rows, ffn),
                Matrix::bf16(at(&gu), rows, 2 * ffn),
            )
        });
        p.check_bf16(
            "silu_mul",
            &format!("rows={rows} ffn={ffn}"),
            &out,
            Tolerance::BF16,
        );
    }
}

#[test]
fn argmax_takes_the_lowest_index_of_the_maximum_and_skips_nan() {
    argmax(&Pair::new(), &mut Rng::new(10), &[151_936, 1001]);
}

/// Five rows of each vocabulary size: a tie, NaNs, all NaN, the maximum last.
fn argmax(p: &Pair, rng: &mut Rng, vocabs: &[u32]) {
    for &vocab in vocabs {
        let rows = 5u32;
        let mut logits = rng.f32s((rows * vocab) as usize, -20.0, 20.0);
        let v = vocab as usize;
        // Row 1: a tie (the lower index must win); row 2: NaNs, one at the front; row 3: all NaN;
        // row 4: the maximum is the last element.
        logits[v + 17] = 50.0;
        logits[v + v / 2] = 50.0;
        logits[2 * v] = f32::NAN;
        logits[2 * v + 9] = f32::NAN;
        logits[2 * v + 11] = 60.0;
        logits[3 * v..4 * v].fill(f32::NAN);
        logits[5 * v - 1] = 70.0;
        let lg = p.upload(&logits);
        let out = p.poisoned(rows as usize * 4);
        p.run(|o, at| o.argmax(S, at(&out), Matrix::f32(at(&lg), rows, vocab)));
        let (g, c) = p.download::<u32>(&out);
        assert_eq!(g, c, "argmax vocab={vocab}");
        assert_eq!(&g[1..], &[17, 11, 0, vocab - 1]);
        println!(
            "kernel-check {:<18} {:<44} exact {:?} ok",
            "argmax",
            format!("vocab={vocab}"),
            g
        );
    }
}

#[test]
fn fill_uniform_bf16_is_bit_identical() {
    fill_uniform(
        &Pair::new(),
        &[
            (100_003, 42, 0.0, 0.02),
            (4096, 7, 1.0, 0.1),
            (13, 1, -0.5, 3.0),
        ],
    );
}

/// `(n, seed, offset, scale)` each.
fn fill_uniform(p: &Pair, cases: &[(u64, u64, f32, f32)]) {
    for &(n, seed, offset, scale) in cases {
        let out = p.poisoned(n as usize * 2);
        p.run(|o, at| o.fill_uniform_bf16(S, at(&out), n, seed, offset, scale));
        p.check_bf16(
            "fill_uniform_bf16",
            &format!("n={n} seed={seed}"),
            &out,
            Tolerance::EXACT,
        );
    }
}

#[test]
fn round_bf16_is_bit_identical() {
    round_bf16(
        &Pair::new(),
        &mut Rng::new(17),
        &[(1, 5120), (32, 5120), (7, 1003), (300, 4096)],
    );
}

/// `(rows, cols)` each: random f32 values of several magnitudes, the first row opening with
/// exact ties (rounded to the even neighbour) and values just past them.
fn round_bf16(p: &Pair, rng: &mut Rng, shapes: &[(u32, u32)]) {
    for &(rows, cols) in shapes {
        let n = (rows * cols) as usize;
        let mut x: Vec<f32> = (0..n)
            .map(|i| rng.uniform(-4.0, 4.0) * [1e-3, 1.0, 300.0][i % 3])
            .collect();
        let ties = [
            0x3F80_8000u32,
            0x3F81_8000,
            0xC0A0_8000,
            0x3F80_8001,
            0xBF81_7FFF,
        ];
        for (v, &b) in x.iter_mut().zip(&ties) {
            *v = f32::from_bits(b);
        }
        let x = p.upload(&x);
        let out = p.poisoned(n * 2);
        p.run(|o, at| {
            o.round_bf16(
                S,
                Matrix::bf16(at(&out), rows, cols),
                Matrix::f32(at(&x), rows, cols),
            )
        });
        p.check_bf16(
            "round_bf16",
            &format!("rows={rows} cols={cols}"),
            &out,
            Tolerance::EXACT,
        );
    }
}
