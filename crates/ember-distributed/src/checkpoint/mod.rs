//! Distributed checkpoints (`torch.distributed.checkpoint`, also reachable as
//! [`crate::dcp`]): every rank writes its own shards in parallel, and a load reshards to the
//! world size of the loading job.
//!
//! A checkpoint is a directory:
//! - `__{rank}_{id}.distcp`: one safetensors file per rank that has something to write, holding
//!   its pieces under the state dict's keys: the rows of its [`DTensor`] shards, and on rank 0
//!   the replicated DTensors and plain tensors (written once). `id` is one per save.
//! - `.metadata` (JSON, written by rank 0): each tensor's global shape and dtype, and each
//!   piece's file, offsets and lengths (see `metadata.rs`), and every file's size.
//!
//! Note [Checkpoint atomicity]: every file is written to a temporary name, synced and renamed
//! (ember-nn's `write_atomic`, as single-process checkpoints are), and the metadata is written last, once every
//! rank's file is in place: a directory without `.metadata` is an incomplete checkpoint, which
//! [`load`] reports as [`CheckpointError::Incomplete`]. A save into a directory that holds an
//! earlier checkpoint writes files of a new `id` beside the old ones and renames the new
//! metadata over the old, so until that rename the old checkpoint loads intact (a rank killed
//! mid-save leaves it loadable); after it, rank 0 removes the old `.distcp` files.
//!
//! Note [Checkpoint errors are collective]: [`save`] and [`load`] run on every rank of the
//! group. A rank that fails (bad input, a file it cannot write or read) still joins the
//! exchange of outcomes, so every rank returns an error: its own, or
//! [`CheckpointError::PeerFailed`] naming the rank that failed. A failed save writes no
//! metadata and removes this save's files where it can (Note [Removing a failed save's files]
//! in [`save`]); a failed load writes nothing into the state dict.
//!
//! Loading checks everything before writing anything: the keys of the state dict and of the
//! checkpoint must be the same ([`CheckpointError::KeyMismatch`]), each tensor's global shape
//! and dtype equal to the saved ones; files are checked against the sizes the metadata
//! recorded and their safetensors headers against the metadata. Each rank reads only the rows
//! its shards hold (the whole tensor for plain and replicated entries), from whichever rank's
//! file has them: every loading rank must see the whole directory (a shared filesystem, or a
//! copy on each node), as with PyTorch's `FileSystemReader`.
//!
//! ```
//! use ember_core::{DType, Device, Tensor};
//! use ember_distributed::dcp::{self, StateValue};
//! # fn main() -> Result<(), ember_distributed::dcp::CheckpointError> {
//! let dir = std::env::temp_dir().join(format!("ember-dcp-doc-{}", std::process::id()));
//! // One process, no process group: every tensor is written by "rank 0". Under ember-run,
//! // the default group coordinates and DTensors are written shard by shard.
//! let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], Device::Cpu)?;
//! dcp::save(&[("w".to_string(), StateValue::from(w))], &dir, None)?;
//! let into = Tensor::zeros([2, 2], DType::F32, Device::Cpu)?;
//! dcp::load(&[("w".to_string(), StateValue::from(into.clone()))], &dir, None)?;
//! assert_eq!(into.to_vec::<f32>()?, [1.0, 2.0, 3.0, 4.0]);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```

mod metadata;
mod storage;

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::path::{Path, PathBuf};

use ember_core::{no_grad, DType, Error, Shape, Tensor};
use ember_nn::state_dict::StateDictError;

/// The state dicts of sharded models and their optimizers
/// (`torch.distributed.checkpoint.state_dict`), from [`crate::fsdp`].
pub use crate::fsdp::{get_model_state_dict, get_optimizer_state_dict};

use crate::buffer::HostBuffer;
use crate::dtensor::{DTensor, Placement};
use crate::group::{default_group, is_initialized, ProcessGroup};
use metadata::{Metadata, Piece, TensorMeta};
use storage::ShardFile;

/// The metadata file's name in a checkpoint directory (PyTorch's name; JSON inside).
pub const METADATA_FILE: &str = ".metadata";

/// One entry of a state dict to save or load: a plain tensor (the same on every rank, written
/// once) or a [`DTensor`] (each rank writes and reads its own shard).
#[derive(Debug, Clone)]
pub enum StateValue {
    Tensor(Tensor),
    DTensor(DTensor),
}

impl From<Tensor> for StateValue {
    fn from(t: Tensor) -> StateValue {
        StateValue::Tensor(t)
    }
}

impl From<DTensor> for StateValue {
    fn from(t: DTensor) -> StateValue {
        StateValue::DTensor(t)
    }
}

impl StateValue {
    /// The tensor this rank holds: the plain tensor, or the DTensor's local shard.
    pub fn to_local(&self) -> Tensor {
        match self {
            StateValue::Tensor(t) => t.clone(),
            StateValue::DTensor(d) => d.to_local(),
        }
    }
}

/// The local tensors of a state dict, for `load_state_dict` of a module or an optimizer after
/// [`load`] (the same tensors, not copies).
pub fn to_local_state(state_dict: &[(String, StateValue)]) -> Vec<(String, Tensor)> {
    state_dict
        .iter()
        .map(|(k, v)| (k.clone(), v.to_local()))
        .collect()
}

/// An optimizer's state dict (`Optimizer::state_dict` over the local shards of `params`, in
/// the optimizer's parameter order) with each per-parameter state tensor of the shard's shape
/// (`state.{i}.exp_avg`, `momentum_buffer`, ...) made a [`DTensor`] laid out as `params[i]`,
/// so that [`save`] shards it and [`load`] reshards it. `step` counts and `param_groups`
/// entries stay plain tensors (the same on every rank). PyTorch's optimizer state under FSDP2
/// is made of DTensors in the same way.
pub fn shard_optimizer_state(
    state: Vec<(String, Tensor)>,
    params: &[DTensor],
) -> ember_core::Result<Vec<(String, StateValue)>> {
    state
        .into_iter()
        .map(|(key, t)| {
            let param = key
                .strip_prefix("state.")
                .and_then(|rest| rest.split_once('.'))
                .filter(|(_, name)| *name != "step")
                .and_then(|(i, _)| i.parse::<usize>().ok())
                .and_then(|i| params.get(i));
            match param {
                Some(p) if t.shape() == p.local_tensor().shape() => {
                    let d = DTensor::from_local(t, p.device_mesh(), p.placements(), Some(p.shape().clone()))?;
                    Ok((key, d.into()))
                }
                _ => Ok((key, t.into())),
            }
        })
        .collect()
}

/// Result of [`save`] and [`load`].
pub type CheckpointResult<T> = std::result::Result<T, CheckpointError>;

/// Why a distributed checkpoint could not be saved or loaded.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The directory holds no metadata (Note [Checkpoint atomicity]).
    #[error("{dir} holds no {METADATA_FILE}: it is not a checkpoint, or an incomplete one (a save that did not finish writes its metadata last); load an earlier checkpoint")]
    Incomplete { dir: PathBuf },

    /// The state dict and the checkpoint have different keys.
    #[error("the checkpoint in {dir} does not match the state dict: missing from the checkpoint: {missing:?}; in the checkpoint but not in the state dict: {unexpected:?}; load into the state dict of the model and optimizer that saved it")]
    KeyMismatch {
        dir: PathBuf,
        missing: Vec<String>,
        unexpected: Vec<String>,
    },

    /// A tensor's global shape differs from the saved one.
    #[error("size mismatch for {key}: the checkpoint holds global shape {found}, the state dict's tensor is {expected}; build the model with the shapes it was saved with")]
    ShapeMismatch {
        key: String,
        expected: Shape,
        found: Shape,
    },

    /// A tensor's dtype differs from the saved one.
    #[error("dtype mismatch for {key}: the checkpoint holds {found}, the state dict's tensor is {expected}; load into a tensor of dtype {found}, then convert it with to_dtype")]
    DTypeMismatch {
        key: String,
        expected: DType,
        found: DType,
    },

    /// A file the metadata names is not there.
    #[error("{path}, a file of the checkpoint, is missing ({msg}); copy the whole checkpoint directory (every __*.distcp file with its {METADATA_FILE})")]
    MissingFile { path: PathBuf, msg: String },

    /// A file of the checkpoint is not what the metadata says (truncated, replaced, damaged).
    #[error("checkpoint file {path} is damaged: {msg}; it was truncated or changed after the save: load an earlier checkpoint")]
    Corrupt { path: PathBuf, msg: String },

    /// The metadata file cannot be read as a checkpoint's.
    #[error("invalid checkpoint metadata {path}: {msg}")]
    InvalidMetadata { path: PathBuf, msg: String },

    /// The same key appears twice in the state dict.
    #[error("duplicate key {key} in the state dict")]
    DuplicateKey { key: String },

    /// The state dict cannot be saved as given (ranks disagree on it, a DTensor of another mesh).
    #[error("invalid state dict: {msg}")]
    InvalidStateDict { msg: String },

    /// A file could not be read or written.
    #[error("{op} {path}: {msg}")]
    Io {
        op: &'static str,
        path: PathBuf,
        msg: String,
    },

    /// Another rank failed (Note [Checkpoint errors are collective]).
    #[error("rank {rank} failed to {op} its part of the checkpoint, so no rank did: {msg}")]
    PeerFailed {
        op: &'static str,
        rank: usize,
        msg: String,
    },

    /// A tensor operation or a collective failed.
    #[error(transparent)]
    Tensor(#[from] Error),
}

impl From<CheckpointError> for Error {
    /// Folds the error into ember-core's, so that `?` works in functions returning
    /// `ember_core::Result`.
    fn from(e: CheckpointError) -> Error {
        match e {
            CheckpointError::Tensor(e) => e,
            CheckpointError::Io { .. } => Error::Io {
                kind: std::io::ErrorKind::Other,
                msg: e.to_string(),
            },
            other => Error::invalid("torch.distributed.checkpoint", other.to_string()),
        }
    }
}

/// The group that coordinates a save or load: the one given, else the default group, else
/// none (one process).
fn coordinator(explicit: Option<&ProcessGroup>) -> Option<ProcessGroup> {
    match explicit {
        Some(g) => Some(g.clone()),
        None if is_initialized() => default_group().ok(),
        None => None,
    }
}

/// Every rank's `bytes`, in rank order (lengths first, then one padded all-gather).
fn all_gather_bytes(group: &ProcessGroup, bytes: &[u8]) -> ember_core::Result<Vec<Vec<u8>>> {
    let (n, device) = (group.size(), group.device());
    let len = Tensor::from_vec(vec![bytes.len() as i64], 1, device)?;
    let lens = (0..n)
        .map(|_| Tensor::zeros(1, DType::I64, device))
        .collect::<ember_core::Result<Vec<_>>>()?;
    group.all_gather(&lens, &len)?;
    let lens = lens
        .iter()
        .map(|t| Ok(t.to_vec::<i64>()?[0] as usize))
        .collect::<ember_core::Result<Vec<_>>>()?;
    let max = lens.iter().copied().max().unwrap_or(0).max(1);
    let mut padded = bytes.to_vec();
    padded.resize(max, 0);
    let mine = Tensor::from_vec(padded, max, device)?;
    let all = (0..n)
        .map(|_| Tensor::zeros(max, DType::U8, device))
        .collect::<ember_core::Result<Vec<_>>>()?;
    group.all_gather(&all, &mine)?;
    all.iter()
        .zip(lens)
        .map(|(t, len)| {
            let mut v = t.to_vec::<u8>()?;
            v.truncate(len);
            Ok(v)
        })
        .collect()
}

/// Every rank's outcome of a step (Note [Checkpoint errors are collective]): `Ok(payload)` or
/// the error's message.
fn exchange(
    group: Option<&ProcessGroup>,
    mine: Result<Vec<u8>, String>,
) -> ember_core::Result<Vec<Result<Vec<u8>, String>>> {
    let encode = |o: &Result<Vec<u8>, String>| match o {
        Ok(p) => [&[1u8][..], p].concat(),
        Err(m) => [&[0u8][..], m.as_bytes()].concat(),
    };
    let Some(group) = group else {
        return Ok(vec![mine]);
    };
    let all = all_gather_bytes(group, &encode(&mine))?;
    Ok(all
        .into_iter()
        .map(|b| match b.split_first() {
            Some((1, p)) => Ok(p.to_vec()),
            Some((_, m)) => Err(String::from_utf8_lossy(m).into_owned()),
            None => Err("sent nothing".into()),
        })
        .collect())
}

/// The first rank whose outcome is an error, as [`CheckpointError::PeerFailed`].
fn first_failure<T>(op: &'static str, outcomes: &[Result<T, String>]) -> Option<CheckpointError> {
    outcomes.iter().enumerate().find_map(|(rank, o)| {
        o.as_ref().err().map(|msg| CheckpointError::PeerFailed {
            op,
            rank,
            msg: msg.clone(),
        })
    })
}

/// A number naming this save's files, the same on every rank (rank 0's).
fn save_id(group: Option<&ProcessGroup>) -> ember_core::Result<u64> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mine = nanos ^ (u64::from(std::process::id()) << 32);
    let Some(g) = group else {
        return Ok(mine);
    };
    let t = Tensor::from_vec(vec![mine as i64], 1, g.device())?;
    g.broadcast(&t, g.global_rank(0)?)?;
    Ok(t.to_vec::<i64>()?[0] as u64)
}

/// The rows of dim 0 of a tensor of `dims` (a 0-d tensor is one row).
fn all_rows(dims: &[usize]) -> Range<usize> {
    0..dims.first().copied().unwrap_or(1)
}

/// Saves `state_dict` into the directory `checkpoint_id` (`dcp.save`): each rank writes its
/// shards, rank 0 the plain and replicated tensors and then the metadata (see the module
/// docs). Collective over `process_group`, else the default group, else one process. Every
/// [`DTensor`] must live on a mesh of that group's ranks.
pub fn save(
    state_dict: &[(String, StateValue)],
    checkpoint_id: impl AsRef<Path>,
    process_group: Option<&ProcessGroup>,
) -> CheckpointResult<()> {
    let dir = checkpoint_id.as_ref();
    let group = coordinator(process_group);
    let rank = group.as_ref().map_or(0, ProcessGroup::rank);
    let id = save_id(group.as_ref())?;
    let file = format!("__{rank}_{id:016x}.distcp");
    // Note [Removing a failed save's files]: a rank removes its file only when it knows that
    // no metadata names it: it learnt of a failure through a completed exchange (rank 0 saw
    // the same outcomes, or is this rank), or it is rank 0 and wrote no metadata. A rank
    // whose exchange itself failed cannot know and keeps its file; the next successful save
    // into the directory removes it (`remove_stale_files`).
    let remove_mine = || {
        let _ = std::fs::remove_file(dir.join(&file));
    };
    let removing_if = |mine: bool, e: CheckpointError| {
        if mine {
            remove_mine();
        }
        e
    };

    // Every rank writes its file, then all learn every rank's outcome and part of the metadata.
    let mine = write_shards(state_dict, dir, &file, rank, group.as_ref());
    let payload = match &mine {
        Ok(part) => Ok(part.to_json().to_string().into_bytes()),
        Err(e) => Err(e.to_string()),
    };
    let outcomes = exchange(group.as_ref(), payload).map_err(|e| removing_if(rank == 0, e.into()))?;
    mine.map_err(|e| removing_if(true, e))?;
    if let Some(e) = first_failure("save", &outcomes) {
        return Err(removing_if(true, e));
    }
    // Every rank merges (the same parts, so the same verdict); rank 0 writes the result.
    let merged = outcomes
        .into_iter()
        .flatten()
        .map(|bytes| {
            let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| e.to_string())?;
            Metadata::parse(&v, Path::new("<a rank's part>")).map_err(|e| e.to_string())
        })
        .collect::<Result<Vec<_>, String>>()
        .and_then(Metadata::merge)
        .map_err(|msg| removing_if(true, CheckpointError::InvalidStateDict { msg }))?;
    let written = match rank {
        0 => {
            let path = dir.join(METADATA_FILE);
            ember_nn::state_dict::write_atomic(&path, merged.to_json().to_string().as_bytes())
                .map_err(|e| written_error(e, &path))
        }
        _ => Ok(()),
    };
    let wrote = written.is_ok();
    let outcome = written.as_ref().map(|_| vec![]).map_err(|e| e.to_string());
    let outcomes =
        exchange(group.as_ref(), outcome).map_err(|e| removing_if(rank == 0 && !wrote, e.into()))?;
    written.map_err(|e| removing_if(true, e))?;
    if let Some(e) = first_failure("save", &outcomes) {
        return Err(removing_if(true, e));
    }
    if rank == 0 {
        remove_stale_files(dir, &merged);
    }
    Ok(())
}

/// A failure of ember-nn's writers as a [`CheckpointError`].
fn written_error(e: StateDictError, path: &Path) -> CheckpointError {
    match e {
        StateDictError::Tensor(e) => CheckpointError::Tensor(e),
        other => CheckpointError::Io {
            op: "writing",
            path: path.to_owned(),
            msg: other.to_string(),
        },
    }
}

/// Removes the `.distcp` files of earlier saves into `dir` (Note [Checkpoint atomicity]);
/// best effort.
fn remove_stale_files(dir: &Path, current: &Metadata) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("__") && name.ends_with(".distcp") && !current.files.contains_key(&name) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Writes this rank's pieces into `dir/file` (nothing when it has none) and returns its part
/// of the metadata, which lists every key of the state dict.
fn write_shards(
    state_dict: &[(String, StateValue)],
    dir: &Path,
    file: &str,
    rank: usize,
    group: Option<&ProcessGroup>,
) -> CheckpointResult<Metadata> {
    std::fs::create_dir_all(dir).map_err(|e| CheckpointError::Io {
        op: "creating",
        path: dir.to_owned(),
        msg: e.to_string(),
    })?;
    let mut seen = HashSet::new();
    let mut part = Metadata::default();
    let mut to_write = Vec::new();
    for (key, value) in state_dict {
        if !seen.insert(key.as_str()) {
            return Err(CheckpointError::DuplicateKey { key: key.clone() });
        }
        let (t, dims, rows, writes) = match value {
            StateValue::Tensor(t) => (t, t.dims(), all_rows(t.dims()), rank == 0),
            StateValue::DTensor(d) => {
                let mesh = d.device_mesh();
                let fits = match group {
                    Some(g) => mesh.same_ranks(g),
                    None => mesh.size() == 1,
                };
                if !fits {
                    return Err(CheckpointError::InvalidStateDict {
                        msg: format!(
                            "{key} is a DTensor on {mesh}, which is not the group saving the checkpoint ({}); pass the mesh's group (mesh.get_group()) as the process group",
                            group.map_or("one process".to_string(), |g| format!("{:?}", g.ranks()))
                        ),
                    });
                }
                match d.placements()[0] {
                    Placement::Replicate => (d.local_tensor(), d.dims(), all_rows(d.dims()), rank == 0),
                    Placement::Shard(_) => (d.local_tensor(), d.dims(), d.local_range(), true),
                }
            }
        };
        let mut pieces = Vec::new();
        if writes && !dims.contains(&0) && !rows.is_empty() {
            pieces.push(Piece {
                file: file.to_owned(),
                offset: rows.start,
                rows: rows.len(),
            });
            to_write.push((key.clone(), t.clone()));
        }
        part.tensors.insert(
            key.clone(),
            TensorMeta {
                dtype: t.dtype(),
                shape: dims.to_vec(),
                pieces,
            },
        );
    }
    if !to_write.is_empty() {
        let path = dir.join(file);
        ember_nn::state_dict::save_tensors(&to_write, &path).map_err(|e| written_error(e, &path))?;
        let len = std::fs::metadata(&path)
            .map_err(|e| CheckpointError::Io {
                op: "reading",
                path: path.clone(),
                msg: e.to_string(),
            })?
            .len();
        part.files.insert(file.to_owned(), len);
    }
    Ok(part)
}

/// Loads the checkpoint in the directory `checkpoint_id` into `state_dict`, in place
/// (`dcp.load`): each tensor (each DTensor's local shard) receives its rows from whichever
/// pieces hold them, whatever the world size that saved it. Collective over `process_group`,
/// else the default group, else one process. See the module docs for the checks; nothing is
/// written into the state dict unless every rank's reads succeeded.
///
/// Optimizer state goes back into the optimizer with `load_state_dict` of
/// [`to_local_state`]; the optimizer needs state of the right shapes to load into (take one
/// step first, or build the state dict from one that has).
pub fn load(
    state_dict: &[(String, StateValue)],
    checkpoint_id: impl AsRef<Path>,
    process_group: Option<&ProcessGroup>,
) -> CheckpointResult<()> {
    let dir = checkpoint_id.as_ref();
    let group = coordinator(process_group);
    let staged = read_pieces(state_dict, dir);
    if let Some(g) = &group {
        let mine = staged.as_ref().map(|_| vec![]).map_err(|e| e.to_string());
        let outcomes = exchange(Some(g), mine)?;
        if staged.is_ok() {
            if let Some(e) = first_failure("load", &outcomes) {
                return Err(e);
            }
        }
    }
    let _g = no_grad();
    for (target, buf) in staged? {
        buf.write_into(0..buf.len(), &target)?;
    }
    Ok(())
}

/// What a checkpoint holds under one key (PyTorch's `TensorStorageMetadata`, without the
/// chunks): the tensor's dtype and global shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedTensor {
    pub dtype: DType,
    pub shape: Shape,
}

/// The keys of the checkpoint in the directory `checkpoint_id`, in sorted order, each with its
/// dtype and global shape (PyTorch's `FileSystemReader(path).read_metadata()`): what a
/// loading program needs to build the state dict to [`load`] into when it does not know every
/// key beforehand. Reads and checks the metadata file only; not collective.
pub fn read_metadata(checkpoint_id: impl AsRef<Path>) -> CheckpointResult<Vec<(String, SavedTensor)>> {
    let (md, _) = read_metadata_file(checkpoint_id.as_ref())?;
    Ok(md
        .tensors
        .into_iter()
        .map(|(k, t)| {
            let saved = SavedTensor {
                dtype: t.dtype,
                shape: Shape::new(t.shape),
            };
            (k, saved)
        })
        .collect())
}

/// Reads and checks `dir`'s metadata file; returns it with its path.
fn read_metadata_file(dir: &Path) -> CheckpointResult<(Metadata, PathBuf)> {
    let md_path = dir.join(METADATA_FILE);
    let bytes = std::fs::read(&md_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => CheckpointError::Incomplete { dir: dir.to_owned() },
        _ => CheckpointError::Io {
            op: "reading",
            path: md_path.clone(),
            msg: e.to_string(),
        },
    })?;
    let md = parse_metadata(&bytes, &md_path)?;
    Ok((md, md_path))
}

/// The metadata file's bytes parsed and checked; `path` names it in errors.
fn parse_metadata(bytes: &[u8], path: &Path) -> CheckpointResult<Metadata> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| CheckpointError::InvalidMetadata {
            path: path.to_owned(),
            msg: format!("not JSON ({e})"),
        })?;
    Metadata::from_json(&v, path)
}

/// Entry points for the fuzz target `dcp` (`fuzz/`): the checkpoint's readers run on bytes in
/// memory. Not an API: hidden, and free to change with the format.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// Parses `bytes` as a `.metadata` file; the number of tensors it lists when it is valid.
    pub fn metadata(bytes: &[u8]) -> Option<usize> {
        parse_metadata(bytes, Path::new(METADATA_FILE))
            .ok()
            .map(|m| m.tensors.len())
    }

    /// Parses `bytes` as a rank's `.distcp` file (its safetensors header: the file's index of
    /// pieces), then reads every piece it lists whole, as a load would with metadata that
    /// agrees with the header; the number of pieces read. Bad bytes must give errors, never
    /// panics, hangs or allocations beyond the bytes given.
    pub fn shard_file(bytes: &[u8]) -> Option<usize> {
        let len = bytes.len() as u64;
        let path = PathBuf::from("__0_0.distcp");
        let mut f = storage::ShardFile::from_reader(path, std::io::Cursor::new(bytes), len, len).ok()?;
        let pieces: Vec<(String, TensorMeta, Piece)> = f
            .entries()
            .filter_map(|(key, dtype, shape)| {
                let dtype = DType::ALL
                    .into_iter()
                    .find(|&d| storage::safetensors_dtype(d) == dtype)?;
                let meta = TensorMeta {
                    dtype,
                    shape: shape.to_vec(),
                    pieces: vec![],
                };
                let piece = Piece {
                    file: String::new(),
                    offset: 0,
                    rows: meta.rows(),
                };
                Some((key.to_owned(), meta, piece))
            })
            .collect();
        let mut read = 0;
        for (key, meta, piece) in &pieces {
            if f.read_rows(key, meta, piece, 0..piece.rows).is_ok() {
                read += 1;
            }
        }
        Some(read)
    }
}

/// Reads, for every entry of `state_dict`, the rows this rank holds: (where they go, their
/// values). Writes nothing.
fn read_pieces(
    state_dict: &[(String, StateValue)],
    dir: &Path,
) -> CheckpointResult<Vec<(Tensor, HostBuffer)>> {
    let (md, md_path) = read_metadata_file(dir)?;

    let mut seen = HashSet::new();
    for (key, _) in state_dict {
        if !seen.insert(key.as_str()) {
            return Err(CheckpointError::DuplicateKey { key: key.clone() });
        }
    }
    let missing: Vec<String> = state_dict
        .iter()
        .filter(|(k, _)| !md.tensors.contains_key(k))
        .map(|(k, _)| k.clone())
        .collect();
    let unexpected: Vec<String> = md
        .tensors
        .keys()
        .filter(|k| !seen.contains(k.as_str()))
        .cloned()
        .collect();
    if !missing.is_empty() || !unexpected.is_empty() {
        return Err(CheckpointError::KeyMismatch {
            dir: dir.to_owned(),
            missing,
            unexpected,
        });
    }

    let _g = no_grad();
    let mut files: HashMap<&str, ShardFile> = HashMap::new();
    let mut staged = Vec::new();
    for (key, value) in state_dict {
        let meta = &md.tensors[key];
        let (dest, dims, rows) = match value {
            StateValue::Tensor(t) => (t, t.dims(), all_rows(t.dims())),
            StateValue::DTensor(d) => (d.local_tensor(), d.dims(), d.local_range()),
        };
        if dims != meta.shape {
            return Err(CheckpointError::ShapeMismatch {
                key: key.clone(),
                expected: Shape::new(dims),
                found: Shape::new(meta.shape.clone()),
            });
        }
        if dest.dtype() != meta.dtype {
            return Err(CheckpointError::DTypeMismatch {
                key: key.clone(),
                expected: dest.dtype(),
                found: meta.dtype,
            });
        }
        if dims.contains(&0) || rows.is_empty() {
            continue;
        }
        let mut covered = 0;
        for piece in &meta.pieces {
            let (lo, hi) = (
                piece.offset.max(rows.start),
                (piece.offset + piece.rows).min(rows.end),
            );
            if lo >= hi {
                continue;
            }
            let f = match files.entry(piece.file.as_str()) {
                std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(ShardFile::open(dir, &piece.file, md.files[&piece.file])?)
                }
            };
            let bytes = f.read_rows(key, meta, piece, lo..hi)?;
            let count = bytes.len() / meta.dtype.size_in_bytes();
            let mut buf = HostBuffer::zeros(meta.dtype, count);
            buf.assign_from(0..count, &bytes);
            let target = match dims.is_empty() {
                true => dest.clone(),
                false => dest.narrow(0, lo - rows.start, hi - lo)?,
            };
            staged.push((target, buf));
            covered += hi - lo;
        }
        if covered != rows.len() {
            return Err(CheckpointError::InvalidMetadata {
                path: md_path,
                msg: format!(
                    "the pieces of {key} cover {covered} of rows {}..{}",
                    rows.start, rows.end
                ),
            });
        }
    }
    Ok(staged)
}
