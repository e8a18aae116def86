//! `BlockTable`: the blocks one sequence's tokens live in, in order, and the slot of a position.
//! With prefix caching its first blocks may be shared with other sequences (taken by
//! `BlockAllocator::acquire` and appended with `push`).

use crate::allocator::BlockAllocator;
use crate::error::CacheError;

/// See the module header.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<u32>,
}

impl BlockTable {
    /// An empty table.
    pub fn new() -> BlockTable {
        BlockTable::default()
    }

    /// The block ids, in token order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Tokens the table can hold now.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Blocks to add so that `tokens` tokens fit.
    pub fn blocks_needed(&self, tokens: usize, block_size: usize) -> usize {
        tokens
            .div_ceil(block_size)
            .saturating_sub(self.blocks.len())
    }

    /// Grow the table so `tokens` tokens fit. On failure nothing is allocated.
    pub fn ensure(
        &mut self,
        tokens: usize,
        block_size: usize,
        alloc: &mut BlockAllocator,
    ) -> Result<(), CacheError> {
        let need = self.blocks_needed(tokens, block_size);
        if need > alloc.num_free() {
            return Err(CacheError::OutOfBlocks {
                total: alloc.capacity(),
            });
        }
        for _ in 0..need {
            self.blocks.push(alloc.alloc()?);
        }
        Ok(())
    }

    /// Append an already-retained block (a shared prefix block).
    pub fn push(&mut self, block: u32) {
        self.blocks.push(block);
    }

    /// The cache slot of token `pos`; `None` past the table.
    pub fn slot(&self, pos: usize, block_size: usize) -> Option<u32> {
        let block = *self.blocks.get(pos / block_size)?;
        Some(block * block_size as u32 + (pos % block_size) as u32)
    }

    /// Release the blocks wholly past the first `tokens` tokens (the tokens a rejected
    /// speculation wrote there are dropped), keeping the rest.
    pub fn truncate(
        &mut self,
        tokens: usize,
        block_size: usize,
        alloc: &mut BlockAllocator,
    ) -> Result<(), CacheError> {
        let keep = tokens.div_ceil(block_size);
        while self.blocks.len() > keep {
            if let Some(b) = self.blocks.pop() {
                alloc.release(b)?;
            }
        }
        Ok(())
    }

    /// Release every block to the allocator and empty the table. Blocks go back last first,
    /// so of a cached prefix the deepest blocks are the least recently used and are evicted
    /// before the blocks they extend (a cached block is only reachable through its parents).
    /// Every block is released even when one fails; the first error is returned.
    pub fn release_all(&mut self, alloc: &mut BlockAllocator) -> Result<(), CacheError> {
        let mut result = Ok(());
        for b in self.blocks.drain(..).rev() {
            if let Err(e) = alloc.release(b) {
                result = result.and(Err(e));
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_blocks_and_release_returns_them() {
        let mut alloc = BlockAllocator::new(8);
        let mut t = BlockTable::new();
        t.ensure(17, 16, &mut alloc).unwrap();
        assert_eq!(t.blocks(), &[1, 2]);
        assert_eq!(t.slot(0, 16), Some(16));
        assert_eq!(t.slot(16, 16), Some(32));
        assert_eq!(t.slot(32, 16), None);
        assert!(t.ensure(200, 16, &mut alloc).is_err());
        assert_eq!(alloc.num_free(), 5, "a failed ensure allocates nothing");
        t.release_all(&mut alloc).unwrap();
        assert_eq!(alloc.num_free(), 7);
        assert!(t.blocks().is_empty());
    }

    #[test]
    fn a_released_prefix_is_evicted_deepest_block_first() {
        let mut alloc = BlockAllocator::new(4);
        let tokens: Vec<u32> = (0..48).collect();
        let hashes = crate::prefix::block_hashes(&tokens, 16);
        let mut t = BlockTable::new();
        t.ensure(48, 16, &mut alloc).unwrap();
        for (&b, &h) in t.blocks().iter().zip(&hashes) {
            assert!(alloc.publish(b, h).unwrap());
        }
        t.release_all(&mut alloc).unwrap();
        assert_eq!(alloc.alloc().unwrap(), 3, "the last block goes first");
        assert_eq!(alloc.lookup(&hashes[2]), None);
        assert_eq!(alloc.lookup(&hashes[0]), Some(1));
    }

    #[test]
    fn truncate_releases_only_the_blocks_wholly_past_the_kept_tokens() {
        let mut alloc = BlockAllocator::new(8);
        let mut t = BlockTable::new();
        t.ensure(40, 16, &mut alloc).unwrap();
        assert_eq!(t.blocks(), &[1, 2, 3]);
        t.truncate(33, 16, &mut alloc).unwrap();
        assert_eq!(t.blocks(), &[1, 2, 3], "token 32 still lives in block 3");
        t.truncate(32, 16, &mut alloc).unwrap();
        assert_eq!(t.blocks(), &[1, 2]);
        assert_eq!(alloc.num_free(), 5);
        t.truncate(0, 16, &mut alloc).unwrap();
        assert!(t.blocks().is_empty());
        assert_eq!(alloc.num_free(), 7);
    }
}
