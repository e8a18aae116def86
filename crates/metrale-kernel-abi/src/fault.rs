//! The device fault word: how a kernel that refuses its launch says so. A kernel whose
//! precondition fails (a block size it is not compiled for, an offset that does not fit a row,
//! an index past its table, a misaligned operand) writes [`fault_code`] of its manifest index
//! and a [`FaultReason`] into the backend's fault word (the first fault wins) and leaves its
//! outputs as the kernel documents; the backend reads the word back as a typed error. The CPU
//! twins check the same preconditions and fail the launch.

use crate::manifest::{KERNELS, KernelInfo};

/// The `__device__` pointer every module holds to the backend's fault word (a `uint32_t`);
/// the backend sets it when it loads the module.
pub const FAULT_WORD_SYMBOL: &str = "mt_fault_word";

/// Why a kernel refused its launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum FaultReason {
    /// The launch geometry (block size, grid, dynamic shared memory) is not the one the kernel
    /// is written for.
    Geometry = 1,
    /// The shapes do not fit together (an offset past a row, a dimension the kernel does not
    /// take).
    Shape = 2,
    /// An index read from device memory lies outside its table (a cache slot past the pool, a
    /// token id past the vocabulary, a row past its source, a sequence past the step).
    Index = 3,
    /// An operand is not aligned as the kernel needs.
    Alignment = 4,
}

impl FaultReason {
    /// Every reason, in code order.
    pub const ALL: [FaultReason; 4] = [
        FaultReason::Geometry,
        FaultReason::Shape,
        FaultReason::Index,
        FaultReason::Alignment,
    ];

    /// Its name in `kernels/abi.cuh` (`MT_FAULT_GEOMETRY`, ...).
    pub const fn c_name(self) -> &'static str {
        match self {
            FaultReason::Geometry => "MT_FAULT_GEOMETRY",
            FaultReason::Shape => "MT_FAULT_SHAPE",
            FaultReason::Index => "MT_FAULT_INDEX",
            FaultReason::Alignment => "MT_FAULT_ALIGNMENT",
        }
    }

    /// What it means, for error messages.
    pub const fn describe(self) -> &'static str {
        match self {
            FaultReason::Geometry => "launched with a geometry it is not written for",
            FaultReason::Shape => "given shapes that do not fit together",
            FaultReason::Index => "read an index outside its table",
            FaultReason::Alignment => "given a misaligned operand",
        }
    }
}

/// The code a kernel writes: `(manifest index + 1) * 256 + reason`; 0 is "no fault".
pub const fn fault_code(kernel_index: usize, reason: FaultReason) -> u32 {
    (kernel_index as u32 + 1) * 256 + reason as u32
}

/// The kernel and reason a non-zero fault word names, or `None` for a word no kernel of this
/// manifest writes.
pub fn decode_fault(code: u32) -> Option<(&'static KernelInfo, FaultReason)> {
    let index = (code / 256).checked_sub(1)? as usize;
    let reason = FaultReason::ALL
        .into_iter()
        .find(|r| *r as u32 == code % 256)?;
    Some((KERNELS.get(index)?, reason))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_decodes_to_its_kernel_and_reason() {
        for (i, k) in KERNELS.iter().enumerate() {
            for r in FaultReason::ALL {
                let (kernel, reason) = decode_fault(fault_code(i, r)).expect("a manifest code");
                assert_eq!((kernel.module, kernel.name, reason), (k.module, k.name, r));
            }
        }
        assert!(decode_fault(0).is_none());
        assert!(decode_fault(fault_code(KERNELS.len(), FaultReason::Shape)).is_none());
        assert!(decode_fault(256 + 9).is_none());
    }
}
