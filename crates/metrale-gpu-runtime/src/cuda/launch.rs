//! One kernel launch on the driver: the kernel's parameter struct (or a flat argument list)
//! checked against the kernel's compiled parameters (offsets and sizes, where the driver reports
//! them), and launched with `cuLaunchKernel`, or `cuLaunchKernelEx` with programmatic stream
//! serialization when the launch asks for it (`LaunchConfig::programmatic`).

use std::ffi::c_void;

use cudarc::driver::sys;

use super::driver::check;
use super::modules::KernelEntry;
use crate::error::{GpuError, GpuResult};
use crate::types::{DType, DevicePtr, KernelArg, LaunchConfig, ParamBlock};

/// The most arguments one launch may pass.
const MAX_KERNEL_ARGS: usize = 32;

/// One argument as the bytes of its C type, in an 8-byte slot (little-endian, so a 4-byte
/// parameter reads the low half), and the parameter size it needs.
fn pack(arg: &KernelArg) -> (u64, usize) {
    match *arg {
        KernelArg::Ptr(p) => (p.0, 8),
        KernelArg::U64(v) => (v, 8),
        KernelArg::U32(v) => (u64::from(v), 4),
        KernelArg::I32(v) => (u64::from(v as u32), 4),
        KernelArg::F32(v) => (u64::from(v.to_bits()), 4),
        KernelArg::Params(_) => (0, 0),
    }
}

/// Pointers to each parameter inside `block`'s bytes, at the offsets the compiled kernel has
/// (`entry.params`, or the struct's own where the driver cannot say), after checking that the
/// struct lays its fields out there.
fn param_pointers(
    entry: &KernelEntry,
    block: &ParamBlock,
    ptrs: &mut [*mut c_void; MAX_KERNEL_ARGS],
) -> GpuResult<()> {
    let layout = block.layout();
    if let Some(manifest) = entry.struct_layout
        && manifest.name != layout.name
    {
        return Err(GpuError::BadArgument {
            kernel: entry.label.clone(),
            index: 0,
            problem: format!(
                "the kernel takes {}, the launch passed {}",
                manifest.name, layout.name
            ),
        });
    }
    let want: Vec<(usize, usize)> = layout.params().collect();
    let have = entry.params.as_deref().unwrap_or(&want);
    if have != want.as_slice() || have.len() > MAX_KERNEL_ARGS {
        return Err(GpuError::BadArgument {
            kernel: entry.label.clone(),
            index: 0,
            problem: format!(
                "the compiled kernel's parameters (offset, bytes) are {have:?}; {} lays out {want:?}",
                layout.name
            ),
        });
    }
    let base = block.bytes().as_ptr() as *mut u8;
    for (p, &(offset, _)) in ptrs.iter_mut().zip(have) {
        // SAFETY: every offset lies inside the struct's bytes (the struct's own layout, checked
        // equal above), so the pointer stays inside `block`.
        *p = unsafe { base.add(offset) } as *mut c_void;
    }
    Ok(())
}

/// Launch `entry` on stream `s` (the caller has bound the context).
pub(super) fn launch(
    entry: &KernelEntry,
    config: &LaunchConfig,
    args: &[KernelArg],
    s: sys::CUstream,
) -> GpuResult<()> {
    let mut slots = [0u64; MAX_KERNEL_ARGS];
    let mut ptrs = [std::ptr::null_mut::<c_void>(); MAX_KERNEL_ARGS];
    if let [KernelArg::Params(block)] = args {
        param_pointers(entry, block, &mut ptrs)?;
    } else {
        flat_pointers(entry, args, &mut slots, &mut ptrs)?;
    }
    let (g, b) = (config.grid, config.block);
    if config.programmatic {
        // SAFETY: an all-zero `CUlaunchAttribute` is a valid plain-data value (id 0, a
        // zeroed union) that is overwritten below before use.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let launch = driver_config(config, s, &mut attr, 1);
        // SAFETY: as for `cuLaunchKernel` below; `launch` and `attr` outlive the call, which
        // reads them and copies the parameters before returning.
        return check(&format!("cuLaunchKernelEx({})", entry.label), unsafe {
            sys::cuLaunchKernelEx(&launch, entry.func, ptrs.as_mut_ptr(), std::ptr::null_mut())
        });
    }
    // SAFETY: `entry.func` is live (its module stays loaded while the caller holds the kernel
    // table, and until drop); `ptrs` point at each parameter's bytes in its C type's size (in
    // `slots`, or in the parameter struct at its compiled offset), as checked against the
    // compiled signature above; the driver copies the parameters before returning, and `slots`
    // and `args` outlive the call.
    check(&format!("cuLaunchKernel({})", entry.label), unsafe {
        sys::cuLaunchKernel(
            entry.func,
            g.0,
            g.1,
            g.2,
            b.0,
            b.1,
            b.2,
            config.shared_mem_bytes,
            s,
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    })
}

/// Pointers to each flat argument, packed into `slots` as its C type, after checking the list
/// against the compiled parameter sizes. A kernel of the manifest takes its parameter struct
/// only, so a flat list for one is refused.
fn flat_pointers(
    entry: &KernelEntry,
    args: &[KernelArg],
    slots: &mut [u64; MAX_KERNEL_ARGS],
    ptrs: &mut [*mut c_void; MAX_KERNEL_ARGS],
) -> GpuResult<()> {
    let bad = |index: usize, problem: String| GpuError::BadArgument {
        kernel: entry.label.clone(),
        index,
        problem,
    };
    if let Some(manifest) = entry.struct_layout {
        return Err(bad(
            0,
            format!(
                "the kernel takes one {}, the launch passed {} arguments",
                manifest.name,
                args.len()
            ),
        ));
    }
    if args.len() > MAX_KERNEL_ARGS {
        return Err(bad(
            MAX_KERNEL_ARGS,
            format!(
                "{} arguments, at most {MAX_KERNEL_ARGS} supported",
                args.len()
            ),
        ));
    }
    if let Some(params) = &entry.params
        && params.len() != args.len()
    {
        return Err(bad(
            args.len().min(params.len()),
            format!(
                "the kernel takes {} arguments, the launch passed {}",
                params.len(),
                args.len()
            ),
        ));
    }
    for (i, arg) in args.iter().enumerate() {
        let (bits, size) = pack(arg);
        let compiled = entry.params.as_ref().map(|p| p[i].1);
        if size == 0 || compiled.is_some_and(|c| c != size) {
            return Err(bad(
                i,
                format!(
                    "the kernel's parameter is {} bytes, the launch passed {} ({size} bytes)",
                    compiled.unwrap_or(0),
                    arg.kind()
                ),
            ));
        }
        slots[i] = bits;
    }
    for (p, slot) in ptrs.iter_mut().zip(slots.iter_mut()) {
        *p = slot as *mut u64 as *mut c_void;
    }
    Ok(())
}

/// `config` as the driver's extended launch configuration on stream `s`, with `num_attrs`
/// attributes at `attrs`.
fn driver_config(
    config: &LaunchConfig,
    s: sys::CUstream,
    attrs: *mut sys::CUlaunchAttribute,
    num_attrs: u32,
) -> sys::CUlaunchConfig {
    let (g, b) = (config.grid, config.block);
    sys::CUlaunchConfig {
        gridDimX: g.0,
        gridDimY: g.1,
        gridDimZ: g.2,
        blockDimX: b.0,
        blockDimY: b.1,
        blockDimZ: b.2,
        sharedMemBytes: config.shared_mem_bytes,
        hStream: s,
        attrs,
        numAttrs: num_attrs,
    }
}

/// Clusters of `entry` resident at once with `config`'s geometry (the caller has bound the
/// context): `cuOccupancyMaxActiveClusters`, the cluster size taken from the kernel's compiled
/// `__cluster_dims__`.
pub(super) fn max_active_clusters(entry: &KernelEntry, config: &LaunchConfig) -> GpuResult<u32> {
    let query = driver_config(config, std::ptr::null_mut(), std::ptr::null_mut(), 0);
    let mut clusters: std::ffi::c_int = 0;
    // SAFETY: `entry.func` is live (see `launch`); `query` and `clusters` outlive the call, which
    // only reads the one and writes the other.
    check(
        &format!("cuOccupancyMaxActiveClusters({})", entry.label),
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, entry.func, &query) },
    )?;
    Ok(clusters.max(0) as u32)
}

/// Blocks of `entry` resident at once on `device` with `config`'s block size and dynamic shared
/// memory (the caller has bound the context): `cuOccupancyMaxActiveBlocksPerMultiprocessor`
/// times the multiprocessors.
pub(super) fn max_active_blocks(
    entry: &KernelEntry,
    config: &LaunchConfig,
    device: sys::CUdevice,
) -> GpuResult<u32> {
    let (bx, by, bz) = config.block;
    let threads = std::ffi::c_int::try_from(bx * by * bz).unwrap_or(std::ffi::c_int::MAX);
    let (mut per_sm, mut sms): (std::ffi::c_int, std::ffi::c_int) = (0, 0);
    // SAFETY: `entry.func` is live (see `launch`) and `device` valid; the out-pointers outlive
    // the calls, which only write them.
    check(
        &format!(
            "cuOccupancyMaxActiveBlocksPerMultiprocessor({})",
            entry.label
        ),
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut per_sm,
                entry.func,
                threads,
                config.shared_mem_bytes as usize,
            )
        },
    )?;
    // SAFETY: as above.
    check("cuDeviceGetAttribute", unsafe {
        sys::cuDeviceGetAttribute(
            &mut sms,
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            device,
        )
    })?;
    Ok((per_sm.max(0) as u32).saturating_mul(sms.max(0) as u32))
}

/// `cuTensorMapEncodeTiled` for a row-major `dtype` `[rows, cols]` matrix at `base` (bf16, or
/// the bytes of e4m3), boxes of `box_rows` x `box_cols` swizzled by a box row's bytes (128 or
/// 64), zero past the ends (see `GpuBackend::tensor_map_2d`).
pub(super) fn tensor_map_2d(
    base: DevicePtr,
    dtype: DType,
    (rows, cols): (u32, u32),
    (box_rows, box_cols): (u32, u32),
) -> GpuResult<[u8; 128]> {
    use sys::CUtensorMapDataType as T;
    use sys::CUtensorMapSwizzle as S;
    let refused = |what: String| GpuError::KernelFailed {
        kernel: "tensor map".into(),
        problem: format!("[{rows}, {cols}] {} at {:#x}: {what}", dtype.name(), base.0),
    };
    let elem = match dtype {
        DType::Bf16 => T::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        DType::F8E4M3 => T::CU_TENSOR_MAP_DATA_TYPE_UINT8,
        other => {
            return Err(refused(format!(
                "no tensor map of {} elements",
                other.name()
            )));
        }
    };
    let swizzle = match box_cols as usize * dtype.size() {
        128 => S::CU_TENSOR_MAP_SWIZZLE_128B,
        64 => S::CU_TENSOR_MAP_SWIZZLE_64B,
        bytes => {
            return Err(refused(format!(
                "box rows of {bytes} bytes (64 or 128 swizzle)"
            )));
        }
    };
    let dims: [sys::cuuint64_t; 2] = [cols as u64, rows as u64];
    let strides: [sys::cuuint64_t; 1] = [cols as u64 * dtype.size() as u64];
    let boxes: [sys::cuuint32_t; 2] = [box_cols, box_rows];
    let steps: [sys::cuuint32_t; 2] = [1, 1];
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array outlives the call, which reads them and writes `map`; the driver
    // checks the address, sizes and strides and reports what it refuses.
    check(
        &format!(
            "cuTensorMapEncodeTiled([{rows}, {cols}] {} at {:#x})",
            dtype.name(),
            base.0
        ),
        unsafe {
            sys::cuTensorMapEncodeTiled(
                &mut map,
                elem,
                2,
                base.0 as *mut c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                steps.as_ptr(),
                sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle,
                sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        },
    )?;
    Ok(bytemuck::cast(map.opaque))
}
