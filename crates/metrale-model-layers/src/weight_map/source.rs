//! `SafetensorsSource`: a checkpoint's safetensors files, memory-mapped, with every tensor's
//! dtype, shape and byte range read from the headers. Either one `model.safetensors`, or the
//! shards named by `model.safetensors.index.json` (`weight_map`: tensor name -> file name).
//!
//! Invariants:
//! - Every file stays mapped (never read whole into memory) for the source's lifetime, and the
//!   files must not be modified or truncated meanwhile (that is what makes the mapping sound).
//! - Every tensor entry's byte range lies inside its file and holds exactly
//!   `numel * dtype size` bytes; a header that says otherwise is refused at `open`.
//! - With an index, the index is authoritative: each tensor comes from the shard it names, and
//!   that shard's header holds it.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::weight_map::error::WeightError;

/// The single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Bytes of the little-endian header length that opens a safetensors file.
const HEADER_LEN_BYTES: usize = 8;
/// Largest header accepted (the safetensors crate's own limit).
const MAX_HEADER_BYTES: usize = 100_000_000;

/// One mapped safetensors file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard")
            .field("path", &self.path)
            .field("bytes", &self.mmap.len())
            .finish()
    }
}

/// Where one tensor lives.
#[derive(Debug, Clone)]
struct TensorEntry {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Absolute byte range in the shard's file.
    start: usize,
    end: usize,
}

/// A checkpoint's tensors, memory-mapped; see the module header.
#[derive(Debug)]
pub struct SafetensorsSource {
    dir: PathBuf,
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
}

impl SafetensorsSource {
    /// Open the checkpoint in `dir`: `model.safetensors` if present (as transformers prefers),
    /// else the shards of `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<SafetensorsSource, WeightError> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let source = if single.is_file() {
            let shard = map_file(&single)?;
            let entries = read_header(&shard, 0)?;
            let tensors = entries.into_iter().collect();
            SafetensorsSource {
                dir: dir.to_path_buf(),
                shards: vec![shard],
                tensors,
            }
        } else if index.is_file() {
            open_sharded(dir, &index)?
        } else {
            return Err(WeightError::NoWeights {
                dir: dir.to_path_buf(),
            });
        };
        tracing::debug!(
            dir = %dir.display(),
            files = source.shards.len(),
            tensors = source.tensors.len(),
            "opened safetensors checkpoint"
        );
        Ok(source)
    }

    /// The checkpoint directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the checkpoint holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Whether the checkpoint holds `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// The dtype and shape of `name`.
    pub fn info(&self, name: &str) -> Result<(Dtype, &[usize]), WeightError> {
        let entry = self.entry(name)?;
        Ok((entry.dtype, &entry.shape))
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> Result<&Path, WeightError> {
        let entry = self.entry(name)?;
        Ok(&self.shards[entry.shard].path)
    }

    /// The dtype, shape and raw little-endian bytes of `name`.
    pub(crate) fn raw(&self, name: &str) -> Result<(Dtype, &[usize], &[u8]), WeightError> {
        let entry = self.entry(name)?;
        let bytes = &self.shards[entry.shard].mmap[entry.start..entry.end];
        Ok((entry.dtype, &entry.shape, bytes))
    }

    fn entry(&self, name: &str) -> Result<&TensorEntry, WeightError> {
        self.tensors.get(name).ok_or_else(|| WeightError::Missing {
            tensor: name.to_string(),
            dir: self.dir.clone(),
        })
    }
}

fn open_sharded(dir: &Path, index: &Path) -> Result<SafetensorsSource, WeightError> {
    let corrupt = |detail: String| WeightError::Corrupt {
        file: index.to_path_buf(),
        detail,
    };
    let text = std::fs::read_to_string(index).map_err(|source| WeightError::Io {
        file: index.to_path_buf(),
        source,
    })?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| corrupt(format!("invalid JSON: {e}")))?;
    let weight_map = value
        .get("weight_map")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| corrupt("no `weight_map` object".to_string()))?;

    let mut shards: Vec<Shard> = Vec::new();
    let mut headers: Vec<HashMap<String, TensorEntry>> = Vec::new();
    let mut shard_of_file: HashMap<&str, usize> = HashMap::new();
    let mut tensors = BTreeMap::new();
    for (name, file) in weight_map {
        let file = file.as_str().ok_or_else(|| {
            corrupt(format!(
                "`weight_map.{name}` is {file}, expected a file name"
            ))
        })?;
        let shard = match shard_of_file.get(file) {
            Some(&i) => i,
            None => {
                let relative = Path::new(file);
                if !relative
                    .components()
                    .all(|c| matches!(c, Component::Normal(_)))
                {
                    return Err(corrupt(format!(
                        "shard `{file}` (for `{name}`) is not a plain path inside the checkpoint"
                    )));
                }
                let path = dir.join(relative);
                if !path.is_file() {
                    return Err(WeightError::MissingShard {
                        index: index.to_path_buf(),
                        shard: path,
                        tensor: name.clone(),
                    });
                }
                let mapped = map_file(&path)?;
                headers.push(read_header(&mapped, shards.len())?.into_iter().collect());
                shards.push(mapped);
                shard_of_file.insert(file, shards.len() - 1);
                shards.len() - 1
            }
        };
        let entry = headers[shard].get(name).ok_or_else(|| {
            corrupt(format!(
                "places `{name}` in `{file}`, whose header has no such tensor"
            ))
        })?;
        tensors.insert(name.clone(), entry.clone());
    }
    let unindexed = headers.iter().map(HashMap::len).sum::<usize>() - tensors.len();
    if unindexed > 0 {
        tracing::debug!(index = %index.display(), unindexed, "shard tensors absent from the index are ignored");
    }
    Ok(SafetensorsSource {
        dir: dir.to_path_buf(),
        shards,
        tensors,
    })
}

fn map_file(path: &Path) -> Result<Shard, WeightError> {
    let io = |source| WeightError::Io {
        file: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only and lives in a `SafetensorsSource`, whose documented
    // invariant is that checkpoint files are not modified or truncated while it is alive;
    // under that invariant the mapped bytes never change and every access below is bounds-
    // checked against `mmap.len()`, the file length at mapping time.
    let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
    Ok(Shard {
        path: path.to_path_buf(),
        mmap,
    })
}

/// Parse and check one file's header; byte ranges become absolute offsets into the file.
fn read_header(shard: &Shard, index: usize) -> Result<Vec<(String, TensorEntry)>, WeightError> {
    let bytes: &[u8] = &shard.mmap;
    let file = || shard.path.clone();
    let file_len = bytes.len() as u64;
    let truncated = |expected_bytes: u64| WeightError::Truncated {
        file: file(),
        expected_bytes,
        found_bytes: file_len,
    };
    let Some(len_bytes) = bytes.get(..HEADER_LEN_BYTES) else {
        return Err(truncated(HEADER_LEN_BYTES as u64));
    };
    let mut le = [0u8; HEADER_LEN_BYTES];
    le.copy_from_slice(len_bytes);
    let header_len = u64::from_le_bytes(le);
    if header_len > MAX_HEADER_BYTES as u64 {
        let detail = format!("header length {header_len} exceeds {MAX_HEADER_BYTES} bytes");
        return Err(WeightError::Corrupt {
            file: file(),
            detail,
        });
    }
    let data_start = HEADER_LEN_BYTES + header_len as usize;
    if data_start > bytes.len() {
        return Err(truncated(data_start as u64));
    }
    let metadata = match SafeTensors::read_metadata(bytes) {
        Ok((_, metadata)) => metadata,
        Err(SafeTensorError::MetadataIncompleteBuffer) => {
            let declared =
                declared_data_len(&bytes[HEADER_LEN_BYTES..data_start]).map_err(|detail| {
                    WeightError::Corrupt {
                        file: file(),
                        detail,
                    }
                })?;
            let expected = (data_start + declared) as u64;
            if expected > file_len {
                return Err(truncated(expected));
            }
            let detail = format!(
                "{} bytes follow the last tensor (the header declares {expected} bytes)",
                file_len - expected
            );
            return Err(WeightError::Corrupt {
                file: file(),
                detail,
            });
        }
        Err(e) => {
            return Err(WeightError::Corrupt {
                file: file(),
                detail: e.to_string(),
            });
        }
    };
    Ok(metadata
        .tensors()
        .into_iter()
        .map(|(name, info)| {
            let entry = TensorEntry {
                shard: index,
                dtype: info.dtype,
                shape: info.shape.clone(),
                start: data_start + info.data_offsets.0,
                end: data_start + info.data_offsets.1,
            };
            (name, entry)
        })
        .collect())
}

/// The data length a header declares (its largest end offset), to size a truncation error.
fn declared_data_len(header: &[u8]) -> Result<usize, String> {
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| format!("invalid header JSON: {e}"))?;
    let mut end = 0usize;
    for (name, value) in &map {
        if name == "__metadata__" {
            continue;
        }
        let offsets = value
            .get("data_offsets")
            .and_then(serde_json::Value::as_array);
        let last = offsets
            .and_then(|o| o.get(1))
            .and_then(serde_json::Value::as_u64);
        let last = last.ok_or_else(|| format!("tensor `{name}` has no valid data_offsets"))?;
        end = end
            .max(usize::try_from(last).map_err(|_| format!("tensor `{name}`: offset overflows"))?);
    }
    Ok(end)
}
