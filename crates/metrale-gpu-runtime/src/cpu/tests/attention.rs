//! The CPU backend's RoPE and attention kernels against f64 references written from the
//! definitions (part of `cpu/tests.rs`, whose generator, rig and comparison they use).

use half::bf16;
use metrale_kernel_abi::attention::{
    PREFILL_SPLIT_THREADS, decode_shared_bytes, padded_dim, prefill_shared_bytes,
    prefill_split_shared_bytes,
};
use metrale_kernel_abi::{
    ATP_WARPS, ATT_SPLITS, ATT_WARPS, KvStoreParams, PagedAttentionParams,
    PagedAttentionPrefillParams, QkNormRopeParams,
};

use super::*;

/// Rotate-half RoPE of one head, in f64, from the definition, cos and sin times `scale`.
fn ref_rope(x: &mut [f64], pos: f64, inv_freq: &[f32], rd: usize, scale: f64) {
    let h = rd / 2;
    for i in 0..h {
        let a = pos * inv_freq[i] as f64;
        let (cos, sin) = (a.cos() * scale, a.sin() * scale);
        let (x1, x2) = (x[i], x[i + h]);
        x[i] = x1 * cos - x2 * sin;
        x[i + h] = x2 * cos + x1 * sin;
    }
}

#[test]
fn qk_norm_rope_normalises_and_rotates_q_and_k_only() {
    let r = Rig::new();
    let mut d = Rng::new(21);
    // Gated layout: q head stride 2*dh, partial rotary, YaRN-scaled cos and sin.
    let (rows, hq, hkv, dh, rd) = (2usize, 2usize, 1usize, 8usize, 4usize);
    let qs = 2 * dh;
    let stride = hq * qs + 2 * hkv * dh;
    let x = d.bf16s(rows * stride, -2.0, 2.0);
    let (qw, kw) = (d.bf16s(dh, -0.5, 0.5), d.bf16s(dh, -0.5, 0.5));
    let inv_freq: Vec<f32> = (0..rd / 2)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / rd as f32))
        .collect();
    let pos = [3u32, 17];
    let scale = 1.138_629_4f32;
    let (xp, qp, kp, fp, pp) = (
        r.put(&x),
        r.put(&qw),
        r.put(&kw),
        r.put(&inv_freq),
        r.put(&pos),
    );
    let p = QkNormRopeParams {
        qkv: xp,
        q_norm_w: qp,
        k_norm_w: kp,
        inv_freq: fp,
        positions: pp,
        rows: rows as u32,
        row_stride: stride as u32,
        num_q_heads: hq as u32,
        q_head_stride: qs as u32,
        k_offset: (hq * qs) as u32,
        num_kv_heads: hkv as u32,
        head_dim: dh as u32,
        rotary_dim: rd as u32,
        attention_scaling: scale,
        eps: 1e-6,
        unit_offset: 1,
    };
    r.run("rope", "qk_norm_rope", &p).unwrap();
    let got = r.get_bf(xp, rows * stride);
    let mut want = tof(&x);
    for (row, &p) in pos.iter().enumerate() {
        let base = row * stride;
        let mut heads: Vec<(usize, &[bf16])> = (0..hq).map(|h| (base + h * qs, &qw[..])).collect();
        heads.extend((0..hkv).map(|h| (base + hq * qs + h * dh, &kw[..])));
        for (at, w) in heads {
            let mut v = ref_rms(&want[at..at + dh], &tof(w), 1e-6, true);
            ref_rope(&mut v, p as f64, &inv_freq, rd, f64::from(scale));
            want[at..at + dh].copy_from_slice(&v);
        }
    }
    assert_close(&got, &want, 1e-2, 1.0, "qk_norm_rope");
    // Gates and values are untouched.
    assert_eq!(got[dh..2 * dh], tof(&x[dh..2 * dh]));
    let v_at = hq * qs + hkv * dh;
    assert_eq!(got[v_at..v_at + dh], tof(&x[v_at..v_at + dh]));
    // Heads past the row, and blocks of other than whole warps, are refused (the CUDA kernel
    // writes its fault word for them).
    let bad = QkNormRopeParams {
        row_stride: (hq * qs) as u32,
        ..p
    };
    assert!(r.run("rope", "qk_norm_rope", &bad).is_err());
    assert!(
        r.run_with("rope", "qk_norm_rope", LaunchConfig::linear(1, 48), &p)
            .is_err()
    );
}

#[test]
fn paged_attention_matches_dense_causal_attention_through_a_scattered_block_table() {
    let r = Rig::new();
    let mut d = Rng::new(31);
    let (hq, hkv, dh, bs) = (4usize, 2usize, 8usize, 4usize);
    let stride = (hq + 2 * hkv) * dh;
    let len = 10usize; // three blocks, the last partly filled
    let num_blocks = 6usize;
    let slots = num_blocks * bs;
    let qkv = d.bf16s(len * stride, -1.5, 1.5);
    let table = [4u32, 1, 3, 0, 0];
    let max_blocks = table.len();
    let slot_of = |t: usize| table[t / bs] as usize * bs + t % bs;
    let slot_map: Vec<u32> = (0..len).map(|t| slot_of(t) as u32).collect();
    let (qp, tp, sp) = (r.put(&qkv), r.put(&table), r.put(&slot_map));
    let kc = r.out(slots * hkv * dh * 2);
    let vc = r.out(slots * hkv * dh * 2);
    // The first `rows` rows' keys and values into the caches at `slot_mapping`.
    let kv_store = |slot_mapping: DevicePtr, rows: usize| {
        let p = KvStoreParams {
            k_cache: kc,
            v_cache: vc,
            qkv: qp,
            slot_mapping,
            rows: rows as u32,
            row_stride: stride as u32,
            k_offset: (hq * dh) as u32,
            v_offset: ((hq + hkv) * dh) as u32,
            num_kv_heads: hkv as u32,
            head_dim: dh as u32,
            num_slots: slots as u32,
            kv_fp8: 0,
            k_scale: 1.0,
            v_scale: 1.0,
        };
        r.run("cache", "kv_store", &p).unwrap()
    };
    kv_store(sp, len);
    let out = r.out(len * hq * dh * 2);
    let seq = vec![0u32; len];
    let pos: Vec<u32> = (0..len as u32).collect();
    let (seqp, posp) = (r.put(&seq), r.put(&pos));
    let scale = 1.0 / (dh as f32).sqrt();
    let decode = PagedAttentionParams {
        out,
        qkv: qp,
        k_cache: kc,
        v_cache: vc,
        block_tables: tp,
        row_seq: seqp,
        positions: posp,
        rows: len as u32,
        row_stride: stride as u32,
        q_head_stride: dh as u32,
        num_q_heads: hq as u32,
        num_kv_heads: hkv as u32,
        head_dim: dh as u32,
        block_size: bs as u32,
        max_blocks: max_blocks as u32,
        num_seqs: 1,
        num_slots: slots as u32,
        scale,
        gated: 0,
        kv_fp8: 0,
        k_scale: 1.0,
        v_scale: 1.0,
    };
    // Two heads per item at head_dim 8: 2 items a row; clusters of ATT_SPLITS blocks.
    let (dp, hb) = (padded_dim(dh as u32), 2);
    let clusters = LaunchConfig::grid2(ATT_SPLITS * 4, 1, 32 * ATT_WARPS)
        .with_shared(decode_shared_bytes(dp, hb, 2));
    r.run_with("attention", "paged_attention", clusters, &decode)
        .unwrap();
    let q = tof(&qkv);
    let want = ref_causal(&q, (len, stride, hq, hkv, dh), &|s, g, i| {
        let at = s * stride + hq * dh + g * dh + i;
        (q[at], q[at + hkv * dh])
    });
    assert_close(
        &r.get_bf(out, len * hq * dh),
        &want,
        1e-2,
        1.0,
        "paged_attention",
    );
    // The flat kernel: a block per item, one partial per split.
    let flat_out = r.out(len * hq * dh * 2);
    let blocks = LaunchConfig::grid2(8, 1, 32 * ATT_WARPS)
        .with_shared(decode_shared_bytes(dp, hb, ATT_SPLITS));
    let flat = PagedAttentionParams {
        out: flat_out,
        ..decode
    };
    r.run_with("attention", "paged_attention_flat", blocks, &flat)
        .unwrap();
    assert_close(
        &r.get_bf(flat_out, len * hq * dh),
        &want,
        1e-2,
        1.0,
        "paged_attention_flat",
    );
    // Too little shared memory, a block of other than the kernel's threads, or more than
    // ATT_MAX_ITEMS items a cluster are refused (the CUDA kernel writes its fault word).
    for bad in [
        clusters.with_shared(decode_shared_bytes(dp, hb, 2) - 16),
        LaunchConfig::grid2(ATT_SPLITS * 4, 1, 64).with_shared(decode_shared_bytes(dp, hb, 2)),
    ] {
        assert!(
            r.run_with("attention", "paged_attention", bad, &decode)
                .is_err()
        );
    }
    let one_cluster = LaunchConfig::grid2(ATT_SPLITS, 1, 32 * ATT_WARPS)
        .with_shared(decode_shared_bytes(dp, hb, 2));
    let many_rows = PagedAttentionParams { rows: 33, ..decode };
    let e = r.run_with("attention", "paged_attention", one_cluster, &many_rows);
    assert!(e.is_err(), "66 items on one cluster");

    // The prefill twins over row groups (2 heads per block at head_dim 8: up to 16 rows of one
    // unit each), the walk's and the split kernels' (clusters of ATT_SPLITS blocks), give every
    // grouped row the reference's and leave the rows of no group (4..8) as poisoned; a group of
    // 17 rows is refused, naming the limit, and a split grid that is not whole clusters too.
    let grouped = r.out(len * hq * dh * 2);
    let prefill_launch =
        LaunchConfig::grid2(ATT_SPLITS, 1, 32 * ATP_WARPS).with_shared(prefill_shared_bytes(dp));
    let split_launch = LaunchConfig::grid2(ATT_SPLITS, 1, PREFILL_SPLIT_THREADS)
        .with_shared(prefill_split_shared_bytes(dp));
    let prefill =
        |row_groups: &[u32]| prefill_params(&decode, grouped, (r.put(row_groups), row_groups));
    for (kernel, launch) in [
        ("paged_attention_prefill", prefill_launch),
        ("paged_attention_prefill_split", split_launch),
    ] {
        let params = PagedAttentionPrefillParams {
            out: r.out(len * hq * dh * 2),
            ..prefill(&[0, 4, 8, 2])
        };
        r.run_with("attention", kernel, launch, &params).unwrap();
        let got = r.get_bf(params.out, len * hq * dh);
        let row = hq * dh;
        for t in 0..len {
            let g = &got[t * row..(t + 1) * row];
            if (4..8).contains(&t) {
                assert!(
                    g.iter().all(|v| v.is_nan()),
                    "{kernel}: row {t} of no group was written"
                );
            } else {
                let w = &want[t * row..(t + 1) * row];
                assert_close(g, w, 1e-2, 1.0, kernel);
            }
        }
    }
    // The split kernels take whole clusters of their own blocks: a ragged grid, or the walk's
    // blocks, are refused.
    let ragged = LaunchConfig::grid2(ATT_SPLITS + 1, 1, PREFILL_SPLIT_THREADS)
        .with_shared(prefill_split_shared_bytes(dp));
    let split = prefill(&[0, 4, 8, 2]);
    for bad in [ragged, prefill_launch] {
        assert!(
            r.run_with("attention", "paged_attention_prefill_split", bad, &split)
                .is_err()
        );
    }
    let err = r
        .run_with(
            "attention",
            "paged_attention_prefill",
            prefill_launch,
            &prefill(&[0, 17]),
        )
        .unwrap_err();
    // The refusal names the kernel's limit: 16 rows (one unit) at 2 heads per block.
    let msg = err.to_string();
    assert!(
        msg.contains("row group 0") && msg.contains("at most 16"),
        "{msg}"
    );
    // A padding slot writes nothing.
    let pad = r.put(&[u32::MAX]);
    let before = r.get_bf(kc, slots * hkv * dh);
    kv_store(pad, 1);
    let after = r.get_bf(kc, slots * hkv * dh);
    let same = before
        .iter()
        .zip(&after)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(same, "a padding row must not write the cache");
}

/// The prefill kernels' parameters for the rows `decode` names, into `out`, over the row groups
/// `groups` (pairs of first row and rows) uploaded at `at`.
fn prefill_params(
    decode: &PagedAttentionParams,
    out: DevicePtr,
    (at, groups): (DevicePtr, &[u32]),
) -> PagedAttentionPrefillParams {
    let d = decode;
    PagedAttentionPrefillParams {
        out,
        qkv: d.qkv,
        k_cache: d.k_cache,
        v_cache: d.v_cache,
        block_tables: d.block_tables,
        row_seq: d.row_seq,
        positions: d.positions,
        row_groups: at,
        rows: d.rows,
        row_stride: d.row_stride,
        q_head_stride: d.q_head_stride,
        num_q_heads: d.num_q_heads,
        num_kv_heads: d.num_kv_heads,
        head_dim: d.head_dim,
        block_size: d.block_size,
        max_blocks: d.max_blocks,
        num_seqs: d.num_seqs,
        num_slots: d.num_slots,
        scale: d.scale,
        gated: d.gated,
        n_groups: (groups.len() / 2) as u32,
        kv_fp8: d.kv_fp8,
        k_scale: d.k_scale,
        v_scale: d.v_scale,
    }
}

/// Causal attention of `len` rows in f64, from the definition: row t's query heads over the
/// keys and values `kv(token, kv_head, dim) -> (k, v)` of tokens 0..=t.
fn ref_causal(
    q: &[f64],
    (len, stride, hq, hkv, dh): (usize, usize, usize, usize, usize),
    kv: &dyn Fn(usize, usize, usize) -> (f64, f64),
) -> Vec<f64> {
    let scale = 1.0 / (dh as f64).sqrt();
    let mut want = vec![0.0f64; len * hq * dh];
    for t in 0..len {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qv = &q[t * stride + h * dh..t * stride + (h + 1) * dh];
            let sc: Vec<f64> = (0..=t)
                .map(|s| (0..dh).map(|i| qv[i] * kv(s, g, i).0).sum::<f64>() * scale)
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..dh {
                want[(t * hq + h) * dh + i] = (0..=t).map(|s| e[s] / z * kv(s, g, i).1).sum();
            }
        }
    }
    want
}

#[test]
fn fp8_pools_store_e4m3_of_value_over_scale_and_every_attention_kernel_reads_them_back() {
    use crate::fp8::{kv_dequant, kv_quantize};
    let r = Rig::new();
    let mut d = Rng::new(37);
    let (hq, hkv, dh, bs) = (4usize, 2usize, 16usize, 4usize);
    let stride = (hq + 2 * hkv) * dh;
    let len = 10usize;
    let slots = 6 * bs;
    let width = hkv * dh;
    let mut qkv = d.bf16s(len * stride, -3.0, 3.0);
    // One value far past what its scale maps into e4m3: it saturates at 448 * scale.
    let (k_scale, v_scale) = (0.03f32, 0.25f32);
    let big = 5 * stride + (hq + hkv) * dh + 3;
    qkv[big] = bf16::from_f32(300.0);
    let table = [4u32, 1, 3, 0, 0];
    let slot_of = |t: usize| table[t / bs] as usize * bs + t % bs;
    let slot_map: Vec<u32> = (0..len).map(|t| slot_of(t) as u32).collect();
    let (qp, tp, sp) = (r.put(&qkv), r.put(&table), r.put(&slot_map));
    let (kc, vc) = (r.out(slots * width), r.out(slots * width));
    let store = KvStoreParams {
        k_cache: kc,
        v_cache: vc,
        qkv: qp,
        slot_mapping: sp,
        rows: len as u32,
        row_stride: stride as u32,
        k_offset: (hq * dh) as u32,
        v_offset: ((hq + hkv) * dh) as u32,
        num_kv_heads: hkv as u32,
        head_dim: dh as u32,
        num_slots: slots as u32,
        kv_fp8: 1,
        k_scale,
        v_scale,
    };
    r.run("cache", "kv_store", &store).unwrap();
    let (kb, vb) = (r.bytes(kc, slots * width), r.bytes(vc, slots * width));
    for t in 0..len {
        for i in 0..width {
            let (k, v) = (
                qkv[t * stride + hq * dh + i],
                qkv[t * stride + (hq + hkv) * dh + i],
            );
            let at = slot_of(t) * width + i;
            assert_eq!(
                kb[at],
                kv_quantize(k, k_scale),
                "k of token {t}, element {i}"
            );
            assert_eq!(
                vb[at],
                kv_quantize(v, v_scale),
                "v of token {t}, element {i}"
            );
        }
    }
    let sat = slot_of(5) * width + 3;
    assert_eq!(vb[sat], 0x7E, "300 / 0.25 saturates at 448");
    assert_eq!(kv_dequant(vb[sat], v_scale).to_f32(), 112.0);

    // The reference over the dequantized cache: what the kernels must compute; and the
    // reference over the bf16 values, which the FP8 cache approximates.
    let q = tof(&qkv);
    let deq = |s: usize, g: usize, i: usize| {
        let at = slot_of(s) * width + g * dh + i;
        (
            f64::from(kv_dequant(kb[at], k_scale).to_f32()),
            f64::from(kv_dequant(vb[at], v_scale).to_f32()),
        )
    };
    let shape = (len, stride, hq, hkv, dh);
    let want = ref_causal(&q, shape, &deq);
    let out = r.out(len * hq * dh * 2);
    let (seqp, posp) = (
        r.put(&vec![0u32; len]),
        r.put(&(0..len as u32).collect::<Vec<_>>()),
    );
    let decode = PagedAttentionParams {
        out,
        qkv: qp,
        k_cache: kc,
        v_cache: vc,
        block_tables: tp,
        row_seq: seqp,
        positions: posp,
        rows: len as u32,
        row_stride: stride as u32,
        q_head_stride: dh as u32,
        num_q_heads: hq as u32,
        num_kv_heads: hkv as u32,
        head_dim: dh as u32,
        block_size: bs as u32,
        max_blocks: table.len() as u32,
        num_seqs: 1,
        num_slots: slots as u32,
        scale: 1.0 / (dh as f32).sqrt(),
        gated: 0,
        kv_fp8: 1,
        k_scale,
        v_scale,
    };
    let (dp, hb) = (padded_dim(dh as u32), 2);
    let clusters = LaunchConfig::grid2(ATT_SPLITS * 4, 1, 32 * ATT_WARPS)
        .with_shared(decode_shared_bytes(dp, hb, 2));
    r.run_with("attention", "paged_attention", clusters, &decode)
        .unwrap();
    let got = r.get_bf(out, len * hq * dh);
    assert_close(&got, &want, 1e-2, 1.0, "fp8 paged_attention");
    // Against the bf16 values the cache approximates: close, not equal, on the rows before
    // the saturated token (which changes every row after it).
    let exact = ref_causal(&q, shape, &|s, g, i| {
        let at = s * stride + hq * dh + g * dh + i;
        (q[at], q[at + hkv * dh])
    });
    let early = 5 * hq * dh;
    let far = (got[..early].iter().zip(&exact[..early]))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        far > 0.0 && far < 1.0,
        "FP8 is close to, not equal to, bf16: {far}"
    );
    let late = (got[early..].iter().zip(&exact[early..]))
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    assert!(
        late > 10.0,
        "the saturated value reads as 112, not 300: {late}"
    );

    // The flat and prefill kernels read the same cache alike.
    let flat_out = r.out(len * hq * dh * 2);
    let blocks = LaunchConfig::grid2(8, 1, 32 * ATT_WARPS)
        .with_shared(decode_shared_bytes(dp, hb, ATT_SPLITS));
    let flat = PagedAttentionParams {
        out: flat_out,
        ..decode
    };
    r.run_with("attention", "paged_attention_flat", blocks, &flat)
        .unwrap();
    assert_eq!(
        r.bytes(flat_out, len * hq * dh * 2),
        r.bytes(out, len * hq * dh * 2)
    );
    let grouped = r.out(len * hq * dh * 2);
    let groups = [0u32, 4, 4, 4, 8, 2];
    let prefill = prefill_params(&decode, grouped, (r.put(&groups), &groups));
    let prefill_launch =
        LaunchConfig::grid2(ATT_SPLITS, 1, 32 * ATP_WARPS).with_shared(prefill_shared_bytes(dp));
    r.run_with(
        "attention",
        "paged_attention_prefill",
        prefill_launch,
        &prefill,
    )
    .unwrap();
    assert_eq!(
        r.bytes(grouped, len * hq * dh * 2),
        r.bytes(out, len * hq * dh * 2)
    );

    // Scales the kernels cannot use, and formats other than 0 and 1, are refused.
    for (fp8, ks, vs) in [
        (1, 0.0, 1.0),
        (1, 1.0, f32::NAN),
        (1, 256.0, 1.0),
        (2, 1.0, 1.0),
    ] {
        let bad = KvStoreParams {
            kv_fp8: fp8,
            k_scale: ks,
            v_scale: vs,
            ..store
        };
        let e = r.run("cache", "kv_store", &bad).unwrap_err();
        assert!(e.to_string().contains("kv_fp8"), "{e}");
        let bad = PagedAttentionParams {
            kv_fp8: fp8,
            k_scale: ks,
            v_scale: vs,
            ..decode
        };
        assert!(
            r.run_with("attention", "paged_attention", clusters, &bad)
                .is_err()
        );
    }
}
