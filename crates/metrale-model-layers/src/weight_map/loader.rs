//! `WeightLoader`: loads tensors from a `SafetensorsSource`, converts them on the host, and
//! uploads each into its own device allocation as a `DenseWeight`.
//!
//! Invariants:
//! - A `DenseWeight` is a plain handle: it does not free its allocation on drop; whoever owns
//!   the model frees it with `GpuBackend::free` (or keeps it for the process's life).
//! - On any error nothing stays allocated: a failed copy frees the allocation it was for.

use bytemuck::Pod;
use metrale_gpu_runtime::{DType, DevicePtr, GpuBackend, GpuBackendExt, StreamHandle};

use crate::ops_view::BlockScales;
use crate::weight_map::convert::concat_shape;
use crate::weight_map::error::WeightError;
use crate::weight_map::fp8::Fp8Host;
use crate::weight_map::source::SafetensorsSource;

/// A dense tensor on the device, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseWeight {
    /// Start of the data.
    pub ptr: DevicePtr,
    /// Dims, outermost first (`[out_features, in_features]` for a linear layer).
    pub shape: Vec<usize>,
    /// Element type.
    pub dtype: DType,
    /// The block scales of an `F8E4M3` weight (a separate allocation, freed with it).
    pub scales: Option<BlockScales>,
}

impl DenseWeight {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of data.
    pub fn bytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
}

/// Uploads checkpoint tensors to one device stream.
#[derive(Debug, Clone, Copy)]
pub struct WeightLoader<'a> {
    /// Where the tensors come from.
    pub source: &'a SafetensorsSource,
    /// The device.
    pub gpu: &'a dyn GpuBackend,
    /// The stream the copies are queued on.
    pub stream: StreamHandle,
}

impl<'a> WeightLoader<'a> {
    /// A loader from `source` to `gpu`, copying on `stream`.
    pub fn new(
        source: &'a SafetensorsSource,
        gpu: &'a dyn GpuBackend,
        stream: StreamHandle,
    ) -> Self {
        WeightLoader {
            source,
            gpu,
            stream,
        }
    }

    /// Tensor `name` (shape `shape`) as bf16 on the device.
    pub fn upload_bf16(&self, name: &str, shape: &[usize]) -> Result<DenseWeight, WeightError> {
        let data = self.source.load_bf16(name, shape)?;
        self.upload(name, &data, shape.to_vec(), DType::Bf16)
    }

    /// Several tensors concatenated along dim 0, as one bf16 weight on the device (fused q/k/v
    /// or gate/up projections, stacked experts).
    pub fn upload_bf16_concat(
        &self,
        parts: &[(&str, &[usize])],
    ) -> Result<DenseWeight, WeightError> {
        let shape = concat_shape(parts)?;
        let data = self.source.load_bf16_concat(parts)?;
        self.upload(&label_of(parts), &data, shape, DType::Bf16)
    }

    /// A projection weight `name` (`[n, k]`) as the checkpoint stores it: block FP8 with its
    /// scales where the tensor is FP8, else bf16.
    pub fn upload_linear(&self, name: &str, shape: &[usize]) -> Result<DenseWeight, WeightError> {
        self.upload_linear_concat(&[(name, shape)])
    }

    /// Projection weights concatenated along dim 0: block FP8 where every part is FP8, else
    /// bf16 (an FP8 part among bf16 ones dequantized, as the checkpoints leave small
    /// projections such as Gated DeltaNet's a and b unquantized beside quantized ones).
    pub fn upload_linear_concat(
        &self,
        parts: &[(&str, &[usize])],
    ) -> Result<DenseWeight, WeightError> {
        if !parts.iter().all(|(name, _)| self.source.is_fp8(name)) {
            return self.upload_bf16_concat(parts);
        }
        self.upload_fp8(&label_of(parts), &self.source.load_fp8_concat(parts)?)
    }

    /// Projection weights concatenated along dim 0 as block FP8, each part not stored so
    /// quantized on the host with the packs' recipe
    /// ([`SafetensorsSource::quantize_fp8_concat`]).
    pub fn upload_linear_concat_fp8(
        &self,
        parts: &[(&str, &[usize])],
    ) -> Result<DenseWeight, WeightError> {
        self.upload_fp8(&label_of(parts), &self.source.quantize_fp8_concat(parts)?)
    }

    /// An FP8 weight named `label` from the host (for layouts built on the host, such as a
    /// permuted projection): its bytes and its scales, two allocations.
    pub fn upload_fp8(&self, label: &str, q: &Fp8Host) -> Result<DenseWeight, WeightError> {
        let scales = self.upload(
            &format!("{label} (scales)"),
            &q.scales,
            vec![q.scales.len()],
            DType::F32,
        )?;
        match self.upload(label, &q.bytes, vec![q.shape.0, q.shape.1], DType::F8E4M3) {
            Ok(w) => Ok(DenseWeight {
                scales: Some(BlockScales {
                    ptr: scales.ptr,
                    row_shift: q.row_shift,
                }),
                ..w
            }),
            Err(e) => {
                if let Err(free_error) = self.gpu.free(scales.ptr) {
                    tracing::warn!(tensor = label, %free_error, "could not free after a failed upload");
                }
                Err(e)
            }
        }
    }

    /// Tensor `name` (shape `shape`) as f32 on the device.
    pub fn upload_f32(&self, name: &str, shape: &[usize]) -> Result<DenseWeight, WeightError> {
        let data = self.source.load_f32(name, shape)?;
        self.upload(name, &data, shape.to_vec(), DType::F32)
    }

    /// Host data as a device weight named `name` (for layouts built on the host, such as a
    /// permuted projection).
    pub fn upload<T: Pod>(
        &self,
        label: &str,
        data: &[T],
        shape: Vec<usize>,
        dtype: DType,
    ) -> Result<DenseWeight, WeightError> {
        let device = |source| WeightError::Device {
            tensor: label.to_string(),
            source,
        };
        let ptr = self
            .gpu
            .alloc(std::mem::size_of_val(data).max(1))
            .map_err(device)?;
        if let Err(source) = self.gpu.upload(ptr, data, self.stream) {
            if let Err(free_error) = self.gpu.free(ptr) {
                tracing::warn!(tensor = label, %free_error, "could not free after a failed upload");
            }
            return Err(device(source));
        }
        Ok(DenseWeight {
            ptr,
            shape,
            dtype,
            scales: None,
        })
    }
}

/// A concatenation's name in errors and logs: its parts' names joined by ` + `.
fn label_of(parts: &[(&str, &[usize])]) -> String {
    (parts.iter().map(|(name, _)| *name))
        .collect::<Vec<_>>()
        .join(" + ")
}
