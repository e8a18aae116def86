//! `CpuBackend`: the reference backend. Device memory is host memory; each kernel of the manifest
//! is a Rust function registered under the `(module, name)` of its CUDA twin and reads the same
//! parameter struct. Work runs synchronously on the calling thread, so streams and events only keep
//! their bookkeeping; capture records launches, copies and memsets, and replay runs them in order.
//!
//! Invariants:
//! - Kernels run one at a time under the memory lock, so a kernel sees no concurrent writer.
//! - A recorded graph holds addresses, not data: replay reads what those addresses hold then.

pub mod kernels;
mod memory;

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::backend::GpuBackend;
use crate::collective::{Collective, CpuCommunicator, TpRank, narrow, widen};
use crate::error::{GpuError, GpuResult};
use crate::types::{
    DType, DevicePtr, EventHandle, GraphHandle, KernelArg, KernelHandle, LaunchConfig, StreamHandle,
};
pub use memory::{ALLOC_ALIGN, KernelCtx};

/// A CPU kernel: reads its arguments and buffers through the context.
pub type CpuKernelFn = fn(&KernelCtx<'_>) -> GpuResult<()>;

/// Settings of the CPU backend.
#[derive(Debug, Clone)]
pub struct CpuBackendOptions {
    /// Bytes the backend may allocate in all; `alloc` past it fails with `OutOfMemory`.
    /// Default: 16 GiB.
    pub memory_limit_bytes: usize,
}

impl Default for CpuBackendOptions {
    fn default() -> Self {
        CpuBackendOptions {
            memory_limit_bytes: 16 << 30,
        }
    }
}

#[derive(Debug, Clone)]
enum Op {
    Launch {
        kernel: KernelHandle,
        config: LaunchConfig,
        args: Vec<KernelArg>,
    },
    Copy {
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
    },
    Fill {
        dst: DevicePtr,
        value: u8,
        bytes: usize,
    },
    Collective(Collective),
}

#[derive(Debug, Default)]
struct Bookkeeping {
    next_stream: u64,
    streams: Vec<u64>,
    next_event: u64,
    events: HashMap<u64, std::time::Instant>,
    capturing: HashMap<u64, Vec<Op>>,
    next_graph: u64,
    graphs: HashMap<u64, Vec<Op>>,
}

/// The reference backend; see the module header.
#[derive(Debug)]
pub struct CpuBackend {
    options: CpuBackendOptions,
    memory: Mutex<memory::HostMemory>,
    table: Vec<Registered>,
    index: HashMap<(String, String), u32>,
    book: Mutex<Bookkeeping>,
    /// This backend's rank and its group's communicator, in a tensor-parallel group.
    group: Option<(usize, Arc<CpuCommunicator>)>,
}

/// A registered kernel: its `module::name`, its function, and the parameter struct the manifest
/// gives it (none for a kernel the manifest does not list).
#[derive(Debug)]
struct Registered {
    label: String,
    f: CpuKernelFn,
    params: Option<&'static metrale_kernel_abi::ParamsLayout>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new(CpuBackendOptions::default())
    }
}

impl CpuBackend {
    /// A backend with every built-in kernel registered.
    pub fn new(options: CpuBackendOptions) -> CpuBackend {
        let mut backend = CpuBackend {
            options,
            memory: Mutex::new(memory::HostMemory::default()),
            table: Vec::new(),
            index: HashMap::new(),
            book: Mutex::new(Bookkeeping {
                next_stream: 1,
                next_event: 1,
                next_graph: 1,
                ..Default::default()
            }),
            group: None,
        };
        for &(module, name, f) in kernels::TWINS {
            backend.register(module, name, f);
        }
        backend
    }

    /// The `size` backends of one tensor-parallel group, rank `r` at index `r`, sharing one
    /// communicator (each with `options`). Each is driven by its own thread: a collective
    /// returns once every rank has issued it.
    pub fn tensor_parallel_group(size: usize, options: CpuBackendOptions) -> Vec<CpuBackend> {
        let comm = CpuCommunicator::new(size);
        (0..size)
            .map(|rank| CpuBackend {
                group: Some((rank, comm.clone())),
                ..CpuBackend::new(options.clone())
            })
            .collect()
    }

    /// Register (or replace) a kernel under `module::name`. A kernel of the manifest is launched
    /// with its parameter struct only.
    pub fn register(&mut self, module: &str, name: &str, f: CpuKernelFn) {
        let key = (module.to_string(), name.to_string());
        let entry = Registered {
            label: format!("{module}::{name}"),
            f,
            params: metrale_kernel_abi::kernel_info(module, name).map(|k| k.params),
        };
        match self.index.get(&key) {
            Some(&i) => self.table[i as usize] = entry,
            None => {
                self.index.insert(key, self.table.len() as u32);
                self.table.push(entry);
            }
        }
    }

    /// Every registered kernel as `(module, name)`, sorted.
    pub fn kernel_names(&self) -> Vec<(String, String)> {
        let mut names: Vec<_> = self.index.keys().cloned().collect();
        names.sort();
        names
    }

    /// Bytes allocated now.
    pub fn used_bytes(&self) -> usize {
        self.memory.lock().used
    }

    fn capture_op(&self, stream: StreamHandle, op: &Op) -> bool {
        let mut book = self.book.lock();
        match book.capturing.get_mut(&stream.0) {
            Some(ops) => {
                ops.push(op.clone());
                true
            }
            None => false,
        }
    }

    fn refuse_in_capture(&self, stream: StreamHandle, what: &str) -> GpuResult<()> {
        if self.book.lock().capturing.contains_key(&stream.0) {
            return Err(GpuError::Capture(format!(
                "{what} is not allowed while stream {} is capturing",
                stream.0
            )));
        }
        Ok(())
    }

    fn check_stream(&self, stream: StreamHandle) -> GpuResult<()> {
        if stream.0 == 0 || self.book.lock().streams.contains(&stream.0) {
            Ok(())
        } else {
            Err(GpuError::UnknownHandle {
                kind: "stream",
                id: stream.0,
            })
        }
    }

    fn run(&self, op: &Op) -> GpuResult<()> {
        let mem = self.memory.lock();
        match op {
            Op::Launch {
                kernel,
                config,
                args,
            } => {
                let k = self
                    .table
                    .get(kernel.0 as usize)
                    .ok_or(GpuError::BadKernelHandle(kernel.0))?;
                let ctx = KernelCtx::new(&k.label, args, config, &mem);
                (k.f)(&ctx)
            }
            Op::Copy { dst, src, bytes } => mem.copy(*dst, *src, *bytes),
            Op::Fill { dst, value, bytes } => mem.fill(*dst, *value, *bytes),
            Op::Collective(c) => {
                drop(mem);
                self.run_collective(c)
            }
        }
    }

    /// Exchange `op`'s input with the group's other ranks and write its result. The memory
    /// lock is not held while the ranks meet.
    fn run_collective(&self, op: &Collective) -> GpuResult<()> {
        let Some((rank, comm)) = &self.group else {
            return Err(GpuError::Collective {
                op: op.name(),
                problem: "this CPU backend is not in a tensor-parallel group".into(),
            });
        };
        op.check(comm.size())?;
        let (input, dtype) = op.input();
        let mut bytes = vec![0u8; op.input_elems() * dtype.size()];
        self.memory.lock().read_to_host(&mut bytes, input)?;
        let result = comm.run(*rank, op, widen(&bytes, dtype))?;
        let (out, out_dtype) = match *op {
            Collective::AllReduceSum { out, out_dtype, .. } => (out, out_dtype),
            Collective::AllGatherCols { out, .. } => (out, DType::F32),
        };
        self.memory
            .lock()
            .write_from_host(out, &narrow(&result, out_dtype))
    }

    fn submit(&self, op: Op, stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        if self.capture_op(stream, &op) {
            return Ok(());
        }
        self.run(&op)
    }
}

impl GpuBackend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, bytes: usize) -> GpuResult<DevicePtr> {
        let mut mem = self.memory.lock();
        if mem.used.saturating_add(bytes) > self.options.memory_limit_bytes {
            return Err(GpuError::OutOfMemory {
                requested: bytes,
                context: format!(
                    "CPU backend limit {} bytes, {} in use",
                    self.options.memory_limit_bytes, mem.used
                ),
            });
        }
        mem.alloc(bytes)
    }

    fn free(&self, ptr: DevicePtr) -> GpuResult<()> {
        self.memory.lock().free(ptr)
    }

    fn copy_h2d(&self, dst: DevicePtr, src: &[u8], stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        self.refuse_in_capture(stream, "a host-to-device copy")?;
        self.memory.lock().write_from_host(dst, src)
    }

    fn copy_d2h(&self, dst: &mut [u8], src: DevicePtr, stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        self.refuse_in_capture(stream, "a device-to-host copy")?;
        self.memory.lock().read_to_host(dst, src)
    }

    fn copy_d2d(
        &self,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: usize,
        stream: StreamHandle,
    ) -> GpuResult<()> {
        self.submit(Op::Copy { dst, src, bytes }, stream)
    }

    fn memset(
        &self,
        dst: DevicePtr,
        value: u8,
        bytes: usize,
        stream: StreamHandle,
    ) -> GpuResult<()> {
        self.submit(Op::Fill { dst, value, bytes }, stream)
    }

    fn kernel(&self, module: &str, name: &str) -> GpuResult<KernelHandle> {
        self.index
            .get(&(module.to_string(), name.to_string()))
            .map(|&i| KernelHandle(i))
            .ok_or_else(|| GpuError::UnknownKernel {
                module: module.to_string(),
                name: name.to_string(),
                hint: String::new(),
            })
    }

    fn launch(
        &self,
        kernel: KernelHandle,
        config: &LaunchConfig,
        args: &[KernelArg],
        stream: StreamHandle,
    ) -> GpuResult<()> {
        let k = self
            .table
            .get(kernel.0 as usize)
            .ok_or(GpuError::BadKernelHandle(kernel.0))?;
        if let (Some(want), [KernelArg::Params(block)]) = (k.params, args)
            && block.layout().name != want.name
        {
            return Err(GpuError::BadArgument {
                kernel: k.label.clone(),
                index: 0,
                problem: format!(
                    "the kernel takes {}, the launch passed {}",
                    want.name,
                    block.layout().name
                ),
            });
        }
        self.submit(
            Op::Launch {
                kernel,
                config: *config,
                args: args.to_vec(),
            },
            stream,
        )
    }

    fn create_stream(&self) -> GpuResult<StreamHandle> {
        let mut book = self.book.lock();
        let id = book.next_stream;
        book.next_stream += 1;
        book.streams.push(id);
        Ok(StreamHandle(id))
    }

    fn synchronize(&self, stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        // As on CUDA, where a sync would invalidate the capture.
        self.refuse_in_capture(stream, "synchronize")
    }

    fn create_event(&self) -> GpuResult<EventHandle> {
        let mut book = self.book.lock();
        let id = book.next_event;
        book.next_event += 1;
        book.events.insert(id, std::time::Instant::now());
        Ok(EventHandle(id))
    }

    fn record_event(&self, event: EventHandle, stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        let mut book = self.book.lock();
        let slot = book
            .events
            .get_mut(&event.0)
            .ok_or(GpuError::UnknownHandle {
                kind: "event",
                id: event.0,
            })?;
        *slot = std::time::Instant::now();
        Ok(())
    }

    fn event_elapsed_ms(&self, start: EventHandle, end: EventHandle) -> GpuResult<f32> {
        let book = self.book.lock();
        let get = |e: EventHandle| {
            book.events
                .get(&e.0)
                .copied()
                .ok_or(GpuError::UnknownHandle {
                    kind: "event",
                    id: e.0,
                })
        };
        let (s, e) = (get(start)?, get(end)?);
        Ok(e.saturating_duration_since(s).as_secs_f32() * 1e3)
    }

    fn begin_capture(&self, stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        let mut book = self.book.lock();
        if book.capturing.contains_key(&stream.0) {
            return Err(GpuError::Capture(format!(
                "stream {} is already capturing",
                stream.0
            )));
        }
        book.capturing.insert(stream.0, Vec::new());
        Ok(())
    }

    fn end_capture(&self, stream: StreamHandle) -> GpuResult<GraphHandle> {
        let mut book = self.book.lock();
        let ops = book
            .capturing
            .remove(&stream.0)
            .ok_or_else(|| GpuError::Capture(format!("stream {} is not capturing", stream.0)))?;
        let id = book.next_graph;
        book.next_graph += 1;
        book.graphs.insert(id, ops);
        Ok(GraphHandle(id))
    }

    fn launch_graph(&self, graph: GraphHandle, stream: StreamHandle) -> GpuResult<()> {
        self.check_stream(stream)?;
        let ops =
            self.book
                .lock()
                .graphs
                .get(&graph.0)
                .cloned()
                .ok_or(GpuError::UnknownHandle {
                    kind: "graph",
                    id: graph.0,
                })?;
        for op in &ops {
            self.submit(op.clone(), stream)?;
        }
        Ok(())
    }

    fn destroy_graph(&self, graph: GraphHandle) -> GpuResult<()> {
        self.book
            .lock()
            .graphs
            .remove(&graph.0)
            .map(|_| ())
            .ok_or(GpuError::UnknownHandle {
                kind: "graph",
                id: graph.0,
            })
    }

    fn tp_rank(&self) -> TpRank {
        self.group
            .as_ref()
            .map_or(TpRank::SINGLE, |(rank, comm)| TpRank {
                rank: *rank,
                size: comm.size(),
            })
    }

    fn collective(&self, op: &Collective, stream: StreamHandle) -> GpuResult<()> {
        op.check(self.tp_rank().size)?;
        self.submit(Op::Collective(*op), stream)
    }

    fn abort_collectives(&self) {
        if let Some((_, comm)) = &self.group {
            comm.abort();
        }
    }

    fn free_memory(&self) -> GpuResult<usize> {
        Ok(self
            .options
            .memory_limit_bytes
            .saturating_sub(self.memory.lock().used))
    }
}

#[cfg(test)]
pub(crate) mod test_support;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_sampling;
