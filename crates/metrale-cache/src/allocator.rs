//! `BlockAllocator`: hands out block ids with a refcount each, so blocks can be shared between
//! sequences, and keeps the prefix index: full, written blocks published under their
//! [`BlockHash`], which stay cached after their last holder lets go until the space is needed.
//!
//! A block is in one of four states:
//! - *free*: refcount 0, nothing cached; handed out first, lowest id first;
//! - *held*: refcount > 0, private to its holder;
//! - *held and published*: refcount > 0 and in the index; a new sequence whose prompt starts
//!   with the same tokens takes a reference on it instead of computing it again;
//! - *evictable*: refcount 0 and still in the index; a hit revives it, and `alloc` evicts the
//!   least recently released one when no free block is left.
//!
//! Invariants:
//! - Block 0 is reserved (the always-zero dummy block): never handed out, never published.
//! - A block is in the index under at most one hash, and a hash names at most one block.
//! - The index only holds blocks whose contents are complete: the caller publishes a block
//!   after the step that wrote its last token, and nobody writes a published block again (new
//!   sharers only read it; the allocator unpublishes a block before handing it out again).
//! - `num_free` counts free and evictable blocks: both can be handed out.

use std::collections::{BTreeSet, HashMap};

use crate::error::CacheError;
use crate::lru::Lru;
use crate::prefix::BlockHash;

/// See the module header.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    refcounts: Vec<u32>,
    free: BTreeSet<u32>,
    /// Unreferenced published blocks, least recently released first.
    evictable: Lru,
    /// The hash each published block is indexed under.
    hash_of: Vec<Option<BlockHash>>,
    index: HashMap<BlockHash, u32>,
    evictions: u64,
}

impl BlockAllocator {
    /// An allocator over blocks `1..num_blocks` (block 0 is the reserved dummy).
    pub fn new(num_blocks: usize) -> BlockAllocator {
        BlockAllocator {
            refcounts: vec![0; num_blocks],
            free: (1..num_blocks as u32).collect(),
            evictable: Lru::new(num_blocks),
            hash_of: vec![None; num_blocks],
            index: HashMap::new(),
            evictions: 0,
        }
    }

    /// A block with refcount 1: the lowest free one, else the least recently used evictable
    /// one, which leaves the index.
    pub fn alloc(&mut self) -> Result<u32, CacheError> {
        let block = match self.free.pop_first() {
            Some(b) => b,
            None => {
                let b = self.evictable.pop_oldest().ok_or(CacheError::OutOfBlocks {
                    total: self.capacity(),
                })?;
                self.unpublish(b);
                self.evictions += 1;
                b
            }
        };
        self.refcounts[block as usize] = 1;
        Ok(block)
    }

    /// Add a holder to a held block.
    pub fn retain(&mut self, block: u32) -> Result<(), CacheError> {
        match self.refcounts.get_mut(block as usize) {
            Some(rc) if *rc > 0 && block != 0 => {
                *rc += 1;
                Ok(())
            }
            _ => Err(CacheError::NotAllocated { block }),
        }
    }

    /// Drop a holder; returns whether the block is unreferenced now. An unreferenced published
    /// block stays cached (evictable, as the most recently used); any other becomes free.
    pub fn release(&mut self, block: u32) -> Result<bool, CacheError> {
        match self.refcounts.get_mut(block as usize) {
            Some(rc) if *rc > 0 && block != 0 => {
                *rc -= 1;
                if *rc > 0 {
                    return Ok(false);
                }
                if self.hash_of[block as usize].is_some() {
                    self.evictable.touch(block);
                } else {
                    self.free.insert(block);
                }
                Ok(true)
            }
            _ => Err(CacheError::NotAllocated { block }),
        }
    }

    /// Publish a held block whose tokens are all written under `hash`. Returns false, changing
    /// nothing, when another block is indexed under `hash` already (this one stays private) or
    /// this one is published already.
    pub fn publish(&mut self, block: u32, hash: BlockHash) -> Result<bool, CacheError> {
        if block == 0 || self.refcount(block) == 0 {
            return Err(CacheError::NotAllocated { block });
        }
        if self.hash_of[block as usize].is_some() || self.index.contains_key(&hash) {
            return Ok(false);
        }
        self.hash_of[block as usize] = Some(hash);
        self.index.insert(hash, block);
        Ok(true)
    }

    /// The block published under `hash`, if any (held or evictable).
    pub fn lookup(&self, hash: &BlockHash) -> Option<u32> {
        self.index.get(hash).copied()
    }

    /// Take a reference on the block published under `hash`, reviving it if it was evictable.
    pub fn acquire(&mut self, hash: &BlockHash) -> Option<u32> {
        let block = self.lookup(hash)?;
        self.evictable.remove(block);
        self.refcounts[block as usize] += 1;
        Some(block)
    }

    /// Evict every evictable block (they become free); held published blocks stay indexed.
    /// Returns how many were evicted.
    pub fn evict_all(&mut self) -> usize {
        let mut n = 0;
        while let Some(b) = self.evictable.pop_oldest() {
            self.unpublish(b);
            self.free.insert(b);
            n += 1;
        }
        self.evictions += n as u64;
        n
    }

    fn unpublish(&mut self, block: u32) {
        if let Some(h) = self.hash_of[block as usize].take() {
            self.index.remove(&h);
        }
    }

    /// Holders of `block` (0 when free or evictable).
    pub fn refcount(&self, block: u32) -> u32 {
        self.refcounts.get(block as usize).copied().unwrap_or(0)
    }

    /// Blocks that can be handed out now: free and evictable ones.
    pub fn num_free(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// Unreferenced published blocks (a subset of `num_free`).
    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Published blocks, held or evictable.
    pub fn num_cached(&self) -> usize {
        self.index.len()
    }

    /// Published blocks evicted so far (by `alloc` or `evict_all`).
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Blocks that can ever be handed out (the dummy excluded).
    pub fn capacity(&self) -> usize {
        self.refcounts.len().saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(i: u32) -> BlockHash {
        BlockHash::chain(None, &[i])
    }

    #[test]
    fn blocks_are_refcounted_and_reused_lowest_first() {
        let mut a = BlockAllocator::new(4);
        assert_eq!(a.capacity(), 3);
        let (x, y, z) = (a.alloc().unwrap(), a.alloc().unwrap(), a.alloc().unwrap());
        assert_eq!((x, y, z), (1, 2, 3));
        assert!(matches!(
            a.alloc(),
            Err(CacheError::OutOfBlocks { total: 3 })
        ));
        a.retain(y).unwrap();
        assert!(!a.release(y).unwrap(), "a shared block stays allocated");
        assert!(a.release(y).unwrap());
        assert!(a.release(x).unwrap());
        assert_eq!(a.alloc().unwrap(), 1, "lowest free id first");
        assert!(
            matches!(a.release(y), Err(CacheError::NotAllocated { block: 2 })),
            "double free refused"
        );
        assert!(a.retain(0).is_err(), "the dummy block is never handed out");
    }

    #[test]
    fn published_blocks_are_shared_cached_after_release_and_revived_by_a_hit() {
        let mut a = BlockAllocator::new(5);
        let b = a.alloc().unwrap();
        assert!(a.publish(b, h(1)).unwrap());
        assert!(!a.publish(b, h(2)).unwrap(), "published once");
        let dup = a.alloc().unwrap();
        assert!(
            !a.publish(dup, h(1)).unwrap(),
            "a second block for a hash stays private"
        );
        assert_eq!(a.acquire(&h(1)), Some(b));
        assert_eq!(a.refcount(b), 2);
        assert!(!a.release(b).unwrap());
        assert!(a.release(b).unwrap());
        assert!(a.release(dup).unwrap());
        // b is cached and evictable; dup (never published) is plainly free.
        assert_eq!((a.num_free(), a.num_evictable(), a.num_cached()), (4, 1, 1));
        assert_eq!(
            a.acquire(&h(1)),
            Some(b),
            "a hit revives an evictable block"
        );
        assert_eq!((a.num_free(), a.num_evictable(), a.refcount(b)), (3, 0, 1));
        assert_eq!(a.acquire(&h(9)), None);
        assert!(
            a.publish(0, h(3)).is_err(),
            "the dummy block is never published"
        );
        assert!(
            a.publish(4, h(3)).is_err(),
            "a free block cannot be published"
        );
    }

    #[test]
    fn the_least_recently_released_cached_block_is_evicted_when_nothing_is_free() {
        let mut a = BlockAllocator::new(5);
        let blocks: Vec<u32> = (0..4).map(|_| a.alloc().unwrap()).collect();
        for (i, &b) in blocks.iter().enumerate() {
            assert!(a.publish(b, h(i as u32)).unwrap());
        }
        // Released in the order 3, 1, 4, 2: block 3 is the least recently used.
        for b in [3, 1, 4, 2] {
            assert!(a.release(b).unwrap());
        }
        assert_eq!(a.num_free(), 4, "cached blocks can still be handed out");
        // A hit on block 1 refreshes it: after its release it is the most recent.
        assert_eq!(a.acquire(&h(0)), Some(1));
        a.release(1).unwrap();
        assert_eq!(a.alloc().unwrap(), 3);
        assert_eq!(a.lookup(&h(2)), None, "an evicted block leaves the index");
        assert_eq!(a.alloc().unwrap(), 4);
        assert_eq!(a.alloc().unwrap(), 2);
        assert_eq!(a.evictions(), 3);
        assert_eq!(a.lookup(&h(0)), Some(1), "the refreshed block survives");
        assert_eq!(a.evict_all(), 1);
        assert_eq!((a.num_cached(), a.num_free()), (0, 1));
        assert_eq!(a.alloc().unwrap(), 1);
        assert!(matches!(a.alloc(), Err(CacheError::OutOfBlocks { .. })));
    }
}
