//! `BlockAllocator`: hands out block ids with a refcount each, so blocks can be shared between
//! sequences (prefix caching) and are freed when the last holder releases them.
//!
//! Invariants:
//! - Block 0 is reserved (the always-zero dummy block) and never handed out.
//! - A block is free exactly when its refcount is 0; free blocks are reused lowest-id first, so
//!   allocation order is deterministic.

use std::collections::BTreeSet;

use crate::error::CacheError;

/// See the module header.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    refcounts: Vec<u32>,
    free: BTreeSet<u32>,
}

impl BlockAllocator {
    /// An allocator over blocks `1..num_blocks` (block 0 is the reserved dummy).
    pub fn new(num_blocks: usize) -> BlockAllocator {
        BlockAllocator {
            refcounts: vec![0; num_blocks],
            free: (1..num_blocks as u32).collect(),
        }
    }

    /// A free block, with refcount 1.
    pub fn alloc(&mut self) -> Result<u32, CacheError> {
        let block = self.free.pop_first().ok_or(CacheError::OutOfBlocks {
            total: self.capacity(),
        })?;
        self.refcounts[block as usize] = 1;
        Ok(block)
    }

    /// Add a holder to an allocated block.
    pub fn retain(&mut self, block: u32) -> Result<(), CacheError> {
        match self.refcounts.get_mut(block as usize) {
            Some(rc) if *rc > 0 && block != 0 => {
                *rc += 1;
                Ok(())
            }
            _ => Err(CacheError::NotAllocated { block }),
        }
    }

    /// Drop a holder; returns whether the block became free.
    pub fn release(&mut self, block: u32) -> Result<bool, CacheError> {
        match self.refcounts.get_mut(block as usize) {
            Some(rc) if *rc > 0 && block != 0 => {
                *rc -= 1;
                if *rc == 0 {
                    self.free.insert(block);
                    return Ok(true);
                }
                Ok(false)
            }
            _ => Err(CacheError::NotAllocated { block }),
        }
    }

    /// Holders of `block` (0 when free).
    pub fn refcount(&self, block: u32) -> u32 {
        self.refcounts.get(block as usize).copied().unwrap_or(0)
    }

    /// Free blocks now.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks that can ever be handed out (the dummy excluded).
    pub fn capacity(&self) -> usize {
        self.refcounts.len().saturating_sub(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
