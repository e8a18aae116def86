//! `BlockHash`: the key of a full KV block in the prefix cache, a hash chain over the tokens of
//! the block and of every block before it, so equal keys mean equal token prefixes.
//!
//! The hash of block `i` is SHA-256 of the hash of block `i - 1` (32 zero bytes for the first
//! block) followed by the block's token ids as little-endian `u32`s. The key is the whole
//! 256-bit digest: an accidental collision is out of reach, and so is a crafted one (a client
//! cannot forge a prompt that reads another prompt's cache), so a lookup compares keys only,
//! not tokens.
//!
//! Invariants:
//! - The function is fixed: the same tokens give the same keys in every process and build.
//! - Only full blocks have keys; a partial block is never cached.

use std::fmt;

use sha2::{Digest as _, Sha256};

/// See the module header.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The key of a block holding `tokens`, after the block keyed `parent` (`None` for the
    /// sequence's first block).
    pub fn chain(parent: Option<&BlockHash>, tokens: &[u32]) -> BlockHash {
        let mut h = Sha256::new();
        h.update(parent.map_or([0u8; 32], |p| p.0));
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        let mut out = [0u8; 32];
        out.copy_from_slice(&h.finalize());
        BlockHash(out)
    }
}

impl fmt::Debug for BlockHash {
    /// The first 8 bytes in hex: enough to tell keys apart in logs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "..)")
    }
}

/// The keys of every full block of `tokens` in blocks of `block_size`, in order (a trailing
/// partial block has none).
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut out: Vec<BlockHash> = Vec::with_capacity(tokens.len() / block_size);
    for block in tokens.chunks_exact(block_size) {
        let h = BlockHash::chain(out.last(), block);
        out.push(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(h: &BlockHash) -> String {
        h.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn the_chain_is_sha256_of_parent_and_little_endian_tokens() {
        // Python: sha256(b"\0" * 32 + struct.pack("<4I", 1, 2, 3, 4)), then chained.
        let hs = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 4_000_000_000, 9, 9], 4);
        assert_eq!(hs.len(), 2, "the partial block has no key");
        assert_eq!(
            hex(&hs[0]),
            "d8faa8ec8c0500567ca87b56e4bb666d69cb512e638103891defea24e88cbc92"
        );
        assert_eq!(
            hex(&hs[1]),
            "627517c41f497ea5f4918cfa43e44c26460ae89011b07a6a0138129b3168fbc4"
        );
    }

    #[test]
    fn a_key_depends_on_every_earlier_token() {
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[3] = 1000;
        let (ha, hb) = (block_hashes(&a, 16), block_hashes(&b, 16));
        assert!(
            ha.iter().zip(&hb).all(|(x, y)| x != y),
            "a change in block 0 reaches all"
        );
        let mut c = a.clone();
        c[40] = 7;
        let hc = block_hashes(&c, 16);
        assert_eq!(ha[..2], hc[..2]);
        assert_ne!(ha[2], hc[2]);
        // The same tokens after a different prefix are a different block.
        assert_ne!(
            BlockHash::chain(Some(&ha[0]), &a[16..32]),
            BlockHash::chain(None, &a[16..32])
        );
        assert!(block_hashes(&a, 0).is_empty());
    }
}
