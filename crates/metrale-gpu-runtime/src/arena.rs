//! `BufferArena`: the activation buffers of a model, allocated once at boot at fixed addresses.
//!
//! Invariants:
//! - Buffers are carved out of one allocation, each 256-byte aligned; after `BufferArena::build`
//!   no buffer moves or changes size until the arena is dropped, so captured graphs stay valid.
//! - A step allocates nothing: every buffer a kernel writes is named here.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::backend::GpuBackend;
use crate::error::{GpuError, GpuResult};
use crate::types::{DType, DevicePtr};

/// One buffer of the arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArenaBuffer {
    /// Its address.
    pub ptr: DevicePtr,
    /// Element type.
    pub dtype: DType,
    /// Elements.
    pub len: usize,
}

impl ArenaBuffer {
    /// Its size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.size()
    }
}

/// Requests collected before the one allocation.
#[derive(Debug, Default)]
pub struct ArenaLayout {
    entries: Vec<(String, DType, usize)>,
}

impl ArenaLayout {
    /// Ask for `len` elements of `dtype` under `name`.
    pub fn add(&mut self, name: &str, dtype: DType, len: usize) -> &mut Self {
        self.entries.push((name.to_string(), dtype, len));
        self
    }

    /// Total bytes the arena will take, alignment included.
    pub fn total_bytes(&self) -> usize {
        self.entries
            .iter()
            .map(|(_, d, l)| align(l * d.size()))
            .sum()
    }
}

fn align(bytes: usize) -> usize {
    bytes.max(1).div_ceil(256) * 256
}

/// The allocated arena; see the module header.
#[derive(Debug)]
pub struct BufferArena {
    gpu: Arc<dyn GpuBackend>,
    base: DevicePtr,
    total: usize,
    buffers: BTreeMap<String, ArenaBuffer>,
}

impl BufferArena {
    /// Allocate every buffer of `layout` in one allocation.
    pub fn build(gpu: Arc<dyn GpuBackend>, layout: &ArenaLayout) -> GpuResult<BufferArena> {
        let total = layout.total_bytes();
        let base = gpu.alloc(total)?;
        let mut buffers = BTreeMap::new();
        let mut at = 0usize;
        for (name, dtype, len) in &layout.entries {
            let buf = ArenaBuffer {
                ptr: base.offset(at),
                dtype: *dtype,
                len: *len,
            };
            if buffers.insert(name.clone(), buf).is_some() {
                gpu.free(base)?;
                return Err(GpuError::KernelFailed {
                    kernel: "BufferArena::build".into(),
                    problem: format!("buffer `{name}` requested twice"),
                });
            }
            at += align(len * dtype.size());
        }
        Ok(BufferArena {
            gpu,
            base,
            total,
            buffers,
        })
    }

    /// The buffer named `name`.
    ///
    /// # Panics
    /// When no such buffer was laid out: a programming error, not an input error.
    pub fn get(&self, name: &str) -> ArenaBuffer {
        match self.buffers.get(name) {
            Some(b) => *b,
            None => panic!("BufferArena has no buffer `{name}`"),
        }
    }

    /// Total bytes allocated.
    pub fn total_bytes(&self) -> usize {
        self.total
    }

    /// Every buffer by name.
    pub fn buffers(&self) -> impl Iterator<Item = (&str, &ArenaBuffer)> {
        self.buffers.iter().map(|(k, v)| (k.as_str(), v))
    }
}

impl Drop for BufferArena {
    fn drop(&mut self) {
        if let Err(e) = self.gpu.free(self.base) {
            tracing::warn!("BufferArena: freeing the arena failed: {e}");
        }
    }
}
