//! The prefix cache's host work per request, on the CPU: hashing a prompt into its `BlockHash`
//! chain, and looking up, taking, publishing and releasing a prefix of N blocks in an allocator
//! whose blocks are all in use or cached, directly and through the `CacheManager` the scheduler
//! calls.
//!
//! Sizes: blocks of 16 tokens (the default); prompts of 128, 512, 2048 and 8192 tokens (8 to
//! 512 blocks); an allocator of 32,768 blocks, about what a Qwen3-8B KV cache of 80 GiB holds
//! (36 layers, 8 KV heads of 128 in bf16: 144 KiB a token), every block published under a hash
//! and nobody holding it, as in a server whose prefix cache has filled the memory. So a hit
//! revives cached blocks, and a miss evicts the least recently used ones as a new prompt takes
//! its blocks. The `CacheManager` runs on the CPU backend over one layer of one 8-wide KV head
//! (its pools are never touched by these operations; only the bookkeeping is measured).
//!
//! Every measured iteration leaves the allocator as it found it (the same blocks cached, in a
//! possibly different order), so the figures are of a steady state.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use metrale_cache::{
    BlockAllocator, BlockHash, BlockTable, CacheLayout, CacheManager, KvCacheLayout, KvDtype,
    block_hashes,
};
use metrale_gpu_runtime::{CpuBackend, GpuBackend};

const BLOCK_SIZE: usize = 16;
const PROMPT_TOKENS: [usize; 4] = [128, 512, 2048, 8192];
/// Blocks of the allocator, the dummy block included.
const NUM_BLOCKS: usize = 32_768;
/// Tokens of the cached prompts that fill the allocator (512 blocks each).
const FILL_PROMPT_TOKENS: usize = 8192;

/// A prompt of `len` tokens that no other prompt of the bench starts with: token ids spread
/// over a Qwen3-sized vocabulary, `salt` making the prompts differ from their first token.
fn prompt(salt: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (salt.wrapping_mul(7919) ^ i.wrapping_mul(104_729)) % 151_936)
        .collect()
}

/// Fills `num_free()` blocks of `take` with the blocks of cached prompts (each published and
/// then released, so all are evictable) and returns the prompts' hash chains, oldest first.
fn fill_cache(mut take: impl FnMut(&[BlockHash])) -> Vec<Vec<BlockHash>> {
    let per_prompt = FILL_PROMPT_TOKENS / BLOCK_SIZE;
    (0..(NUM_BLOCKS - 1) / per_prompt)
        .map(|p| {
            let hashes = block_hashes(&prompt(1000 + p as u32, FILL_PROMPT_TOKENS), BLOCK_SIZE);
            take(&hashes);
            hashes
        })
        .collect()
}

/// A hash no prompt of the bench has: the counter's bytes (they need not be a SHA-256 digest
/// for the allocator, which only compares them).
fn fresh_hash(counter: &mut u64) -> BlockHash {
    *counter += 1;
    let mut h = [0xA5u8; 32];
    h[..8].copy_from_slice(&counter.to_le_bytes());
    BlockHash(h)
}

fn hashing(c: &mut Criterion) {
    let mut g = c.benchmark_group("block_hashes");
    for tokens in PROMPT_TOKENS {
        let p = prompt(1, tokens);
        g.throughput(Throughput::Elements(tokens as u64));
        g.bench_with_input(BenchmarkId::from_parameter(tokens), &p, |b, p| {
            b.iter(|| block_hashes(black_box(p), BLOCK_SIZE));
        });
    }
    g.finish();
}

/// An allocator of `NUM_BLOCKS` with every block published and evictable; the hash chains of
/// the prompts that fill it.
fn full_allocator() -> (BlockAllocator, Vec<Vec<BlockHash>>) {
    let mut a = BlockAllocator::new(NUM_BLOCKS);
    let prompts = fill_cache(|hashes| {
        let blocks: Vec<u32> = hashes.iter().map(|_| a.alloc().expect("room")).collect();
        for (&b, &h) in blocks.iter().zip(hashes) {
            a.publish(b, h).expect("held");
        }
        for &b in blocks.iter().rev() {
            a.release(b).expect("held");
        }
    });
    (a, prompts)
}

fn allocator(c: &mut Criterion) {
    let (mut a, prompts) = full_allocator();
    // A prefix of the most recently cached prompt: the hits. The misses run after every hit
    // measurement, since they evict the cached blocks, these among them.
    let hit = |n: usize| prompts[prompts.len() - 1][..n].to_vec();
    let mut g = c.benchmark_group("allocator");
    for tokens in PROMPT_TOKENS {
        let n = tokens / BLOCK_SIZE;
        let hit = hit(n);
        g.throughput(Throughput::Elements(n as u64));
        // The admission lookup: the longest cached run of the prompt's hashes.
        g.bench_function(BenchmarkId::new("lookup_hit", n), |b| {
            b.iter(|| {
                let found = (black_box(&hit).iter()).map_while(|h| a.lookup(h)).count();
                assert_eq!(found, n);
            });
        });
        // A hit taken and given back: every block revived from the LRU, then released deepest
        // first, as `BlockTable::release_all` does.
        g.bench_function(BenchmarkId::new("acquire_release", n), |b| {
            let mut taken = Vec::with_capacity(n);
            b.iter(|| {
                taken.extend(
                    black_box(&hit)
                        .iter()
                        .map(|h| a.acquire(h).expect("cached")),
                );
                for &blk in taken.iter().rev() {
                    a.release(blk).expect("held");
                }
                taken.clear();
            });
        });
    }
    for tokens in PROMPT_TOKENS {
        let n = tokens / BLOCK_SIZE;
        g.throughput(Throughput::Elements(n as u64));
        // A miss: N blocks allocated (each evicting the least recently used cached block),
        // published under new hashes once written, and released.
        g.bench_function(BenchmarkId::new("alloc_publish_release", n), |b| {
            let (mut counter, mut held) = (0u64, Vec::with_capacity(n));
            b.iter(|| {
                for _ in 0..n {
                    held.push(a.alloc().expect("evictable blocks"));
                }
                for &blk in &held {
                    let h = fresh_hash(&mut counter);
                    a.publish(blk, h).expect("held");
                }
                for &blk in held.iter().rev() {
                    a.release(blk).expect("held");
                }
                held.clear();
            });
        });
    }
    g.finish();
}

fn manager(c: &mut Criterion) {
    let gpu: Arc<dyn GpuBackend> = Arc::new(CpuBackend::default());
    let layout = CacheLayout {
        kv: KvCacheLayout {
            num_layers: 1,
            num_kv_heads: 1,
            head_dim: 8,
            block_size: BLOCK_SIZE,
            num_blocks: NUM_BLOCKS,
            dtype: KvDtype::Bf16,
        },
        ssm: None,
        snapshot_slots: 0,
    };
    let stream = gpu.default_stream();
    let mut m = CacheManager::new(gpu, layout, stream).expect("the cache fits the CPU backend");
    let prompts = fill_cache(|hashes| {
        let mut t = BlockTable::new();
        m.ensure(&mut t, hashes.len() * BLOCK_SIZE).expect("room");
        for (&b, &h) in t.blocks().to_vec().iter().zip(hashes) {
            m.publish(b, h).expect("held");
        }
        m.release(&mut t).expect("held");
    });
    let mut g = c.benchmark_group("cache_manager");
    for tokens in PROMPT_TOKENS {
        let n = tokens / BLOCK_SIZE;
        let hit: Vec<BlockHash> = prompts[prompts.len() - 1][..n].to_vec();
        g.throughput(Throughput::Elements(n as u64));
        // A request whose prompt hits N cached blocks: they join its table by reference, one
        // fresh block holds the rest of the prompt and the first generated token, and the
        // table is released when it finishes.
        g.bench_function(BenchmarkId::new("hit_then_release", n), |b| {
            b.iter_batched_ref(
                BlockTable::new,
                |t| {
                    for h in black_box(&hit) {
                        m.acquire_cached(t, h).expect("cached");
                    }
                    m.ensure(t, tokens + 1).expect("room");
                    m.release(t).expect("held");
                },
                BatchSize::SmallInput,
            );
        });
    }
    // After every hit measurement, since misses evict the cached blocks.
    for tokens in PROMPT_TOKENS {
        let n = tokens / BLOCK_SIZE;
        g.throughput(Throughput::Elements(n as u64));
        // A request that misses: N + 1 blocks taken (evicting cached ones), its N prompt
        // blocks published after prefill, the table released.
        g.bench_function(BenchmarkId::new("miss_publish_release", n), |b| {
            let mut counter = 0u64;
            b.iter_batched_ref(
                BlockTable::new,
                |t| {
                    m.ensure(t, tokens + 1).expect("evictable blocks");
                    for i in 0..n {
                        let h = fresh_hash(&mut counter);
                        m.publish(t.blocks()[i], h).expect("held");
                    }
                    m.release(t).expect("held");
                },
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    targets = hashing, allocator, manager
}
criterion_main!(benches);
