//! The CPU backend's RoPE and attention kernels against f64 references written from the
//! definitions (part of `cpu/tests.rs`, whose generator, rig and comparison they use).

use half::bf16;
use metrale_kernel_abi::attention::{decode_shared_bytes, padded_dim, prefill_shared_bytes};
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
    };
    // Two heads per item at head_dim 8: 2 items a row; clusters of ATT_SPLITS blocks.
    let (dp, hb) = (padded_dim(dh as u32), 2);
    let clusters = LaunchConfig::grid2(ATT_SPLITS * 4, 1, 32 * ATT_WARPS)
        .with_shared(decode_shared_bytes(dp, hb, 2));
    r.run_with("attention", "paged_attention", clusters, &decode)
        .unwrap();
    let q = tof(&qkv);
    let mut want = vec![0.0f64; len * hq * dh];
    for t in 0..len {
        for h in 0..hq {
            let g = h / (hq / hkv);
            let qv = &q[t * stride + h * dh..t * stride + (h + 1) * dh];
            let key =
                |s: usize| &q[s * stride + hq * dh + g * dh..s * stride + hq * dh + (g + 1) * dh];
            let val = |s: usize| {
                &q[s * stride + (hq + hkv) * dh + g * dh
                    ..s * stride + (hq + hkv) * dh + (g + 1) * dh]
            };
            let sc: Vec<f64> = (0..=t)
                .map(|s| qv.iter().zip(key(s)).map(|(a, b)| a * b).sum::<f64>() * scale as f64)
                .collect();
            let m = sc.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = sc.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for i in 0..dh {
                want[(t * hq + h) * dh + i] = (0..=t).map(|s| e[s] / z * val(s)[i]).sum();
            }
        }
    }
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

    // The prefill twin over row groups (2 heads per block at head_dim 8: up to 16 rows of one
    // unit each) gives every grouped row the reference's and leaves the rows of no group (4..8)
    // as poisoned; a group of 17 rows is refused, naming the limit.
    let grouped = r.out(len * hq * dh * 2);
    let prefill_launch =
        LaunchConfig::grid2(ATT_SPLITS, 1, 32 * ATP_WARPS).with_shared(prefill_shared_bytes(dp));
    let prefill = |row_groups: &[u32]| PagedAttentionPrefillParams {
        out: grouped,
        qkv: qp,
        k_cache: kc,
        v_cache: vc,
        block_tables: tp,
        row_seq: seqp,
        positions: posp,
        row_groups: r.put(row_groups),
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
        n_groups: (row_groups.len() / 2) as u32,
    };
    r.run_with(
        "attention",
        "paged_attention_prefill",
        prefill_launch,
        &prefill(&[0, 4, 8, 2]),
    )
    .unwrap();
    let got = r.get_bf(grouped, len * hq * dh);
    let row = hq * dh;
    for t in 0..len {
        let g = &got[t * row..(t + 1) * row];
        if (4..8).contains(&t) {
            assert!(
                g.iter().all(|v| v.is_nan()),
                "row {t} of no group was written"
            );
        } else {
            let w = &want[t * row..(t + 1) * row];
            assert_close(g, w, 1e-2, 1.0, "paged_attention_prefill");
        }
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
