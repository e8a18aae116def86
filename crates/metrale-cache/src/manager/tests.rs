//! The cache manager on the CPU backend: forks share full blocks and copy the partial one and
//! the SSM state, on every rank of a sharded cache.

use metrale_gpu_runtime::CpuBackend;

use super::*;
use crate::kv_cache::KvDtype;

#[test]
fn a_fork_shares_full_blocks_and_copies_the_partial_one_and_the_ssm_state() {
    // FP8 pools are half the bytes a block: the copy moves that block's bytes.
    for dtype in [KvDtype::Bf16, KvDtype::Fp8] {
        fork_copies(dtype);
    }
}

fn fork_copies(dtype: KvDtype) {
    let cpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let kv = KvCacheLayout {
        num_layers: 2,
        num_kv_heads: 1,
        head_dim: 4,
        block_size: 4,
        num_blocks: 8,
        dtype,
    };
    let ssm = SsmLayout {
        num_gdn_layers: 1,
        slots: 3,
        conv_dim: 4,
        conv_kernel: 2,
        num_v_heads: 1,
        k_head_dim: 2,
        v_head_dim: 2,
    };
    let layout = CacheLayout {
        kv,
        ssm: Some(ssm),
        snapshot_slots: 0,
    };
    let s = StreamHandle::DEFAULT;
    let mut c = CacheManager::new(cpu.clone(), layout, s).unwrap();
    // A sequence of 10 tokens: blocks of 4, 4 and 2 tokens; its pools and slot filled.
    let mut table = BlockTable::new();
    c.ensure(&mut table, 10).unwrap();
    let pool_elems = kv.pool_bytes() / 2;
    assert_eq!(kv.pool_bytes(), 8 * 4 * 4 * dtype.bytes());
    for i in 0..2 {
        let p = c.kv_layer(i);
        let k: Vec<u16> = (0..pool_elems).map(|x| (x * 7 + i) as u16).collect();
        let v: Vec<u16> = (0..pool_elems).map(|x| (x * 5 + 3 * i) as u16).collect();
        cpu.upload(p.k, &k, s).unwrap();
        cpu.upload(p.v, &v, s).unwrap();
    }
    let slot = c.alloc_ssm_slot(None).unwrap().unwrap();
    let l = c.ssm_layer(0).unwrap();
    let state: Vec<f32> = (0..l.recurrent_slot_bytes / 4)
        .map(|x| x as f32 + 0.5)
        .collect();
    cpu.upload(
        l.recurrent.offset(slot as usize * l.recurrent_slot_bytes),
        &state,
        s,
    )
    .unwrap();
    let free = c.blocks().num_free();
    let (child, child_slot) = c.fork(&table, 10, Some(slot)).unwrap();
    let (b, cb) = (table.blocks(), child.blocks());
    assert_eq!(&cb[..2], &b[..2], "full blocks shared");
    assert_ne!(cb[2], b[2], "the partial block is the child's own");
    assert_eq!(
        (c.blocks().refcount(b[0]), c.blocks().refcount(b[2])),
        (2, 1)
    );
    assert_eq!(c.blocks().num_free(), free - 1);
    let block_bytes = 4 * 4 * dtype.bytes();
    for i in 0..2 {
        let p = c.kv_layer(i);
        for pool in [p.k, p.v] {
            let read = |blk: u32| -> Vec<u8> {
                cpu.download(pool.offset(blk as usize * block_bytes), block_bytes, s)
                    .unwrap()
            };
            assert_eq!(
                read(cb[2]),
                read(b[2]),
                "layer {i}: the partial block copied"
            );
            assert_ne!(read(cb[2]), read(b[1]));
        }
    }
    let child_slot = child_slot.unwrap();
    assert_ne!(child_slot, slot);
    assert_eq!(
        c.ssm_slot_bytes(child_slot).unwrap(),
        c.ssm_slot_bytes(slot).unwrap()
    );
    // Both release independently; everything comes back.
    let mut child = child;
    c.release(&mut child).unwrap();
    c.free_ssm_slot(child_slot).unwrap();
    assert_eq!(c.blocks().refcount(b[0]), 1);
    c.release(&mut table).unwrap();
    c.free_ssm_slot(slot).unwrap();
    assert_eq!(c.blocks().num_free(), free + 3);
    // A fork past the table is refused and holds nothing.
    let mut short = BlockTable::new();
    c.ensure(&mut short, 4).unwrap();
    assert!(c.fork(&short, 6, None).is_err());
    assert_eq!(c.blocks().refcount(short.blocks()[0]), 1);
}

#[test]
fn a_fork_of_a_sharded_cache_copies_on_every_rank() {
    let ranks: Vec<(Arc<dyn GpuBackend>, StreamHandle)> = (0..2)
        .map(|_| {
            let b: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
            (b, StreamHandle::DEFAULT)
        })
        .collect();
    let layout = CacheLayout {
        kv: KvCacheLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 4,
            block_size: 4,
            num_blocks: 6,
            dtype: KvDtype::Bf16,
        },
        ssm: Some(SsmLayout {
            num_gdn_layers: 1,
            slots: 3,
            conv_dim: 4,
            conv_kernel: 2,
            num_v_heads: 1,
            k_head_dim: 2,
            v_head_dim: 2,
        }),
        snapshot_slots: 0,
    };
    let s = StreamHandle::DEFAULT;
    let mut c = CacheManager::new_ranks(&ranks, layout).unwrap();
    assert_eq!(c.num_ranks(), 2);
    let mut table = BlockTable::new();
    c.ensure(&mut table, 6).unwrap();
    let slot = c.alloc_ssm_slot(None).unwrap().unwrap();
    // Each rank's pools hold its own values.
    let elems = layout.kv.pool_bytes() / 2;
    for (r, (gpu, _)) in ranks.iter().enumerate() {
        let p = c.rank_kv_layer(r, 0).unwrap();
        let k: Vec<u16> = (0..elems).map(|x| (x * 3 + 100 * r) as u16).collect();
        gpu.upload(p.k, &k, s).unwrap();
        let l = c.rank_ssm_layer(r, 0).unwrap();
        let state: Vec<f32> = (0..l.recurrent_slot_bytes / 4)
            .map(|x| x as f32 + 10.0 * r as f32)
            .collect();
        let at = l.recurrent.offset(slot as usize * l.recurrent_slot_bytes);
        gpu.upload(at, &state, s).unwrap();
    }
    let (child, child_slot) = c.fork(&table, 6, Some(slot)).unwrap();
    let child_slot = child_slot.unwrap();
    let block_bytes = 4 * 4 * 2;
    for (r, (gpu, _)) in ranks.iter().enumerate() {
        let p = c.rank_kv_layer(r, 0).unwrap();
        let read = |b: u32| -> Vec<u8> {
            gpu.download(p.k.offset(b as usize * block_bytes), block_bytes, s)
                .unwrap()
        };
        assert_eq!(read(child.blocks()[1]), read(table.blocks()[1]), "rank {r}");
        let l = c.rank_ssm_layer(r, 0).unwrap();
        let read = |slot: u32| -> Vec<u8> {
            let at = l.recurrent.offset(slot as usize * l.recurrent_slot_bytes);
            gpu.download(at, l.recurrent_slot_bytes, s).unwrap()
        };
        assert_eq!(read(child_slot), read(slot), "rank {r}");
    }
    // The ranks' pools are their own: rank 1 copied its values, not rank 0's.
    let (p0, p1) = (
        c.rank_kv_layer(0, 0).unwrap(),
        c.rank_kv_layer(1, 0).unwrap(),
    );
    let b = child.blocks()[1] as usize * block_bytes;
    let k0: Vec<u8> = ranks[0].0.download(p0.k.offset(b), block_bytes, s).unwrap();
    let k1: Vec<u8> = ranks[1].0.download(p1.k.offset(b), block_bytes, s).unwrap();
    assert_ne!(k0, k1);
    assert!(c.rank_kv_layer(2, 0).is_none());
    // Freeing a slot frees it on every rank: the ranks agree on the next one handed out
    // (a disagreement is an error).
    c.free_ssm_slot(child_slot).unwrap();
    c.free_ssm_slot(slot).unwrap();
    for _ in 0..3 {
        assert!(c.alloc_ssm_slot(None).unwrap().is_some());
    }
}
