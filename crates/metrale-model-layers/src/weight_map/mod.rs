//! Weight loading: a checkpoint's safetensors files memory-mapped (`SafetensorsSource`), each
//! tensor checked against the shape the model expects and converted to bf16 or f32 on the host
//! (`convert`), or kept as block FP8 with its scales (`fp8`), uploaded to the device
//! (`WeightLoader` -> `DenseWeight`), and the per-family table of tensor names (`WeightNames`).
//!
//! Architecture invariant: nothing here launches a kernel; weights reach the device by
//! `GpuBackend::copy_h2d` only.

mod convert;
mod error;
mod fp8;
mod layer_names;
mod loader;
mod names;
mod slice;
mod source;

pub use convert::{LOADABLE_DTYPES, concat_shape};
pub use error::WeightError;
pub use fp8::{Fp8Host, kv_scales};
pub use layer_names::{
    AttentionNames, ExpertNames, FfnNames, GdnNames, GdnProjectionNames, LayerNames, MixerNames,
    MlpNames, MoeNames,
};
pub use loader::{DenseWeight, WeightLoader};
pub use names::{CheckpointLayout, ExpertLayout, ModelPrefix, MtpNames, WeightNames};
/// The element types a safetensors header can declare.
pub use safetensors::Dtype as SourceDtype;
pub use slice::{TensorSlice, matrix_dims};
pub use source::{INDEX_FILE, SINGLE_FILE, SafetensorsSource};

#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;
