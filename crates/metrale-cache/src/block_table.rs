//! `BlockTable`: the blocks one sequence's tokens live in, in order, and the slot of a position.

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

    /// Release every block to the allocator and empty the table.
    pub fn release_all(&mut self, alloc: &mut BlockAllocator) -> Result<(), CacheError> {
        for b in self.blocks.drain(..) {
            alloc.release(b)?;
        }
        Ok(())
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
