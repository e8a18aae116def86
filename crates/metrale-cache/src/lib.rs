//! KV-cache memory: `PagedKvCache` (K and V pools per attention layer, in blocks of `block_size`
//! tokens), its refcounting `BlockAllocator`, `BlockTable`, a sequence's list of blocks, and
//! `SsmStatePool`, the per-sequence conv and recurrent state slots of the GDN layers.
//!
//! Architecture invariant: metrale-cache launches no kernel; it owns memory and bookkeeping only.

mod allocator;
mod block_table;
mod error;
mod kv_cache;
mod ssm_pool;

pub use allocator::BlockAllocator;
pub use block_table::BlockTable;
pub use error::CacheError;
pub use kv_cache::{KvCacheLayout, KvLayerPools, PagedKvCache};
pub use ssm_pool::{SsmLayerPools, SsmLayout, SsmStatePool};
