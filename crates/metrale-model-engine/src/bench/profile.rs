//! A real step, launch by launch: the launches the model's selected forward makes for a decode
//! width ([`ModelCircuit::decode_launches`]), or those of a prefill
//! ([`StepRunner::forward_launches`]), replayed one at a time on the model's own buffers
//! with a device event between every two, so each launch's time is what it took inside that
//! step (its real weights, caches, SSM states and metadata, with the L2 cache as the step leaves
//! it). It works for every family (dense, hybrid, MoE), where the synthetic
//! [`breakdown`](super::breakdown) covers dense decode shapes.
//!
//! Invariants:
//! - The step's metadata (positions, block tables, slot mapping) is on the device when the
//!   launches replay: the caller has just run that decode step, or `forward_launches` uploaded
//!   it; replaying the launches runs that step again.
//! - Launches run eagerly: a kernel shorter than the host's launch interval (a few µs) shows the
//!   interval instead of its own time. The sum is therefore at least the graphed step's time.

use std::collections::HashMap;

use metrale_gpu_runtime::{GpuBackend, KernelArg, KernelHandle};
use metrale_model_layers::circuit_exec::Launch;
use metrale_model_layers::ops::Kernels;

use super::StepPart;
use super::median;
use crate::error::ModelError;
use crate::runner::{ModelCircuit, StepRunner};

/// Parts of one step at `width`, grouped by kernel and its first three integer arguments, in order of first
/// launch; each part's `us` is the median over `iters` replays of one launch, averaged over
/// the launches in its group.
pub fn step_profile(
    runner: &StepRunner,
    width: usize,
    iters: usize,
) -> Result<Vec<StepPart>, ModelError> {
    let gpu = runner.model().gpu();
    launch_profile(gpu.as_ref(), &runner.decode_launches(width)?, iters)
}

/// Parts of `launches`, replayed eagerly on `gpu`'s default stream, grouped as
/// [`step_profile`]'s.
pub fn launch_profile(
    gpu: &dyn GpuBackend,
    launches: &[Launch],
    iters: usize,
) -> Result<Vec<StepPart>, ModelError> {
    let s = gpu.default_stream();
    let names: HashMap<KernelHandle, &str> = Kernels::NAMES
        .iter()
        .filter_map(|&(module, name)| Some((gpu.kernel(module, name).ok()?, name)))
        .collect();
    let events = (0..=launches.len())
        .map(|_| gpu.create_event())
        .collect::<Result<Vec<_>, _>>()?;
    let mut times = vec![Vec::with_capacity(iters); launches.len()];
    for _ in 0..iters.max(1) {
        for (l, &e) in launches.iter().zip(&events) {
            gpu.record_event(e, s)?;
            l.run(gpu, s)?;
        }
        gpu.record_event(events[launches.len()], s)?;
        gpu.synchronize(s)?;
        for (i, t) in times.iter_mut().enumerate() {
            t.push(f64::from(gpu.event_elapsed_ms(events[i], events[i + 1])?) * 1e3);
        }
    }
    // Group by kernel and shape, keeping the order of first appearance.
    let mut parts: Vec<(String, u32, f64)> = Vec::new();
    for (l, t) in launches.iter().zip(times) {
        let name = names.get(&l.kernel).copied().unwrap_or("(unnamed kernel)");
        // The first three integer arguments: the shape for most kernels (m, n, k of a GEMM).
        let dims: Vec<String> = l
            .args
            .iter()
            .flat_map(|a| match a {
                KernelArg::U32(v) => vec![v.to_string()],
                KernelArg::Params(p) => p.u32_fields().map(|(_, v)| v.to_string()).collect(),
                _ => Vec::new(),
            })
            .take(3)
            .collect();
        let key = format!("{name} ({})", dims.join(", "));
        let us = median(t);
        match parts.iter_mut().find(|p| p.0 == key) {
            Some(p) => {
                p.1 += 1;
                p.2 += us;
            }
            None => parts.push((key, 1, us)),
        }
    }
    Ok(parts
        .into_iter()
        .map(|(name, n, total)| StepPart {
            name,
            per_step: n,
            us: total / f64::from(n),
        })
        .collect())
}
