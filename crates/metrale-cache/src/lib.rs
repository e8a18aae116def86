//! The paged KV cache: block pools per attention layer, a refcounting block allocator, block tables.
