//! `WeightError`: everything opening a checkpoint's safetensors files and loading or uploading a
//! tensor can fail with. Each variant names the file or the tensor, and expected vs found.

use std::path::PathBuf;

use metrale_gpu_runtime::GpuError;

/// An error from reading a checkpoint's weights or putting them on the device.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    /// A file could not be opened, read or mapped.
    #[error("{}: cannot read: {source}", file.display())]
    Io {
        /// The file.
        file: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The directory holds neither `model.safetensors` nor `model.safetensors.index.json`.
    #[error("{}: no model.safetensors or model.safetensors.index.json", dir.display())]
    NoWeights {
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// A part of a tensor (a tensor-parallel rank's shard) that cannot be read as asked.
    #[error("tensor `{tensor}`: cannot read its shard: {problem}")]
    Slice {
        /// The tensor's name.
        tensor: String,
        /// What does not fit.
        problem: String,
    },
    /// A tensor the model needs is not in the checkpoint.
    #[error("tensor `{tensor}` is not in the checkpoint at {}", dir.display())]
    Missing {
        /// The tensor's name.
        tensor: String,
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// An FP8 weight's scale tensor is not in the checkpoint under either name packs use.
    #[error(
        "FP8 tensor `{tensor}` has no scale: neither `{}` nor `{}` is in the checkpoint at {}",
        names[0],
        names[1],
        dir.display()
    )]
    MissingScale {
        /// The FP8 weight.
        tensor: String,
        /// The scale names looked for (`W.weight_scale_inv`, `W.weight_scale`).
        names: [String; 2],
        /// The checkpoint directory.
        dir: PathBuf,
    },
    /// An FP8 weight or scale holds a value the kernels cannot read.
    #[error("tensor `{tensor}` {problem}")]
    Fp8Value {
        /// The tensor.
        tensor: String,
        /// What it holds.
        problem: String,
    },
    /// The shard index names a file that does not exist.
    #[error(
        "{}: names shard `{}` (for tensor `{tensor}`), which does not exist",
        index.display(),
        shard.display()
    )]
    MissingShard {
        /// The index file.
        index: PathBuf,
        /// The missing shard.
        shard: PathBuf,
        /// The first tensor the index places in that shard.
        tensor: String,
    },
    /// A tensor's shape is not what the model expects.
    #[error("tensor `{tensor}`: expected shape {expected:?}, found {found:?}")]
    Shape {
        /// The tensor's name.
        tensor: String,
        /// The shape the model needs.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },
    /// A tensor's element type cannot be converted to what the model needs.
    #[error("tensor `{tensor}`: dtype {found} cannot be loaded (expected {expected})")]
    Dtype {
        /// The tensor's name.
        tensor: String,
        /// The dtype in the file (safetensors spelling, e.g. `I64`).
        found: String,
        /// The dtypes accepted.
        expected: &'static str,
    },
    /// Tensors to concatenate along dim 0 disagree in their other dims (or are scalars).
    #[error(
        "cannot concatenate `{tensor}` after `{first}` along dim 0: trailing dims {found:?} \
         differ from {expected:?}"
    )]
    Concat {
        /// The first tensor of the concatenation.
        first: String,
        /// The tensor that does not fit.
        tensor: String,
        /// The first tensor's trailing dims.
        expected: Vec<usize>,
        /// This tensor's trailing dims.
        found: Vec<usize>,
    },
    /// A file's header or the shard index is malformed.
    #[error("{}: corrupt: {detail}", file.display())]
    Corrupt {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// A file is shorter than its header says.
    #[error(
        "{}: truncated: its header needs {expected_bytes} bytes, the file has {found_bytes}",
        file.display()
    )]
    Truncated {
        /// The file.
        file: PathBuf,
        /// Bytes the header requires.
        expected_bytes: u64,
        /// Bytes in the file.
        found_bytes: u64,
    },
    /// The device refused an allocation or a copy.
    #[error("tensor `{tensor}`: device error: {source}")]
    Device {
        /// The tensor (or `a + b` for a concatenation).
        tensor: String,
        /// The backend's error.
        #[source]
        source: GpuError,
    },
}
