//! State dicts: loading named tensors into a module with checks ([`load_into`], behind
//! `ModuleExt::load_state_dict`), and safetensors files as `safetensors.torch.save_file` /
//! `load_file` write and read them ([`save_safetensors`], [`load_safetensors`]).
//!
//! Loading validates everything before it writes anything: a failed load leaves the module as
//! it was. Checks, per key: the shape must equal the module tensor's (no broadcasting), and
//! the dtype must be of the same kind (a floating-point checkpoint tensor is cast to the
//! module's floating dtype, as PyTorch's `copy_` does; float into an integer buffer or the
//! reverse is an error). Values are copied into the module's existing tensors, so they stay
//! on the module's device and parameters stay the same leaves an optimizer holds.
//!
//! Files are written atomically: to a temporary file in the target's directory, flushed to
//! disk, then renamed over the target, so a crash or a failed write never leaves a truncated
//! checkpoint and never loses the previous one.

use crate::module::Module;
use ember_core::{no_grad, DType, Device, Error, Shape, Tensor};
use half::{bf16, f16};
use safetensors::{Dtype as StDtype, SafeTensors};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Result of the state-dict and checkpoint functions.
pub type StateDictResult<T> = std::result::Result<T, StateDictError>;

/// Keys that did not match when loading non-strictly (PyTorch's `_IncompatibleKeys`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IncompatibleKeys {
    /// Module tensors the state dict has no entry for.
    pub missing_keys: Vec<String>,
    /// State dict entries the module has no tensor for.
    pub unexpected_keys: Vec<String>,
}

impl IncompatibleKeys {
    /// True when every key matched.
    pub fn is_empty(&self) -> bool {
        self.missing_keys.is_empty() && self.unexpected_keys.is_empty()
    }
}

/// Why a state dict or checkpoint could not be loaded or saved.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum StateDictError {
    /// Strict loading found keys missing from the state dict or not in the module (a
    /// checkpoint of another model).
    #[error("error(s) in loading state_dict: missing key(s): {missing:?}; unexpected key(s): {unexpected:?}; pass strict=false to load the matching keys only")]
    IncompatibleKeys {
        missing: Vec<String>,
        unexpected: Vec<String>,
    },

    /// A state dict tensor's shape differs from the module's tensor of that name.
    #[error("size mismatch for {key}: copying a tensor with shape {found} from the checkpoint, the shape in the current model is {expected}")]
    ShapeMismatch {
        key: String,
        expected: Shape,
        found: Shape,
    },

    /// A state dict tensor's dtype cannot be loaded into the module's tensor of that name.
    #[error("dtype mismatch for {key}: the checkpoint holds {found}, the model's tensor is {expected}; floating point and integer tensors do not convert into each other")]
    DTypeMismatch {
        key: String,
        expected: DType,
        found: DType,
    },

    /// The same key appears twice in the state dict.
    #[error("duplicate key {key} in the state dict")]
    DuplicateKey { key: String },

    /// A file could not be read or written.
    #[error("{op} {path}: {msg}")]
    Io {
        op: &'static str,
        path: PathBuf,
        msg: String,
    },

    /// A file is not a valid safetensors file, or holds a dtype ember cannot load.
    #[error("invalid safetensors file {path}: {msg}")]
    Format { path: PathBuf, msg: String },

    /// An optimizer state dict has another number of param groups than the optimizer it is
    /// loaded into (PyTorch's "loaded state dict has a different number of parameter groups").
    #[error("{optimizer}: loaded state dict has a different number of parameter groups: {found} in the state dict, {expected} in the optimizer; build the optimizer with the param groups of the one that saved it (the same groups in the same order, e.g. AdamW::with_groups), or add the missing groups with add_param_group before loading")]
    ParamGroupCount {
        optimizer: &'static str,
        expected: usize,
        found: usize,
    },

    /// A param group of an optimizer state dict has another number of parameters than the
    /// optimizer's group of that index (PyTorch's "loaded state dict contains a parameter group
    /// that doesn't match the size of optimizer's group").
    #[error("{optimizer}: loaded state dict contains a parameter group that doesn't match the size of optimizer's group: param group {group} has {found} parameters in the state dict, {expected} in the optimizer; build each group from the same parameters, in the same order, as the optimizer that saved it")]
    ParamGroupSize {
        optimizer: &'static str,
        group: usize,
        expected: usize,
        found: usize,
    },

    /// A tensor operation failed while saving or copying.
    #[error(transparent)]
    Tensor(#[from] Error),
}

impl From<StateDictError> for Error {
    /// Folds the error into ember-core's, so that `?` works in functions returning
    /// `ember_core::Result`.
    fn from(e: StateDictError) -> Error {
        match e {
            StateDictError::Tensor(e) => e,
            other => Error::invalid("load_state_dict", other.to_string()),
        }
    }
}

/// Loads `state` into `module`; see the module docs for the checks.
pub fn load_into<M: Module + ?Sized>(
    module: &M,
    state: &[(String, Tensor)],
    strict: bool,
) -> StateDictResult<IncompatibleKeys> {
    let mut given: HashMap<&str, &Tensor> = HashMap::with_capacity(state.len());
    for (k, t) in state {
        if given.insert(k.as_str(), t).is_some() {
            return Err(StateDictError::DuplicateKey { key: k.clone() });
        }
    }
    let mut targets = Vec::new();
    module.visit("", &mut |name, t, _| targets.push((name.to_owned(), t.clone())));
    let names: HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
    let keys = IncompatibleKeys {
        missing_keys: targets
            .iter()
            .filter(|(n, _)| !given.contains_key(n.as_str()))
            .map(|(n, _)| n.clone())
            .collect(),
        unexpected_keys: state
            .iter()
            .filter(|(k, _)| !names.contains(k.as_str()))
            .map(|(k, _)| k.clone())
            .collect(),
    };
    if strict && !keys.is_empty() {
        return Err(StateDictError::IncompatibleKeys {
            missing: keys.missing_keys,
            unexpected: keys.unexpected_keys,
        });
    }
    let matched: Vec<(&str, &Tensor, &Tensor)> = targets
        .iter()
        .filter_map(|(n, dst)| given.get(n.as_str()).map(|src| (n.as_str(), dst, *src)))
        .collect();
    for (name, dst, src) in &matched {
        check_compatible(name, dst, src)?;
    }
    let _g = no_grad();
    for (_, dst, src) in matched {
        dst.copy_(src)?;
    }
    Ok(keys)
}

/// Shape equal and dtype of the same kind (see the module docs).
fn check_compatible(key: &str, dst: &Tensor, src: &Tensor) -> StateDictResult<()> {
    if dst.shape() != src.shape() {
        return Err(StateDictError::ShapeMismatch {
            key: key.to_owned(),
            expected: dst.shape().clone(),
            found: src.shape().clone(),
        });
    }
    let kind = |d: DType| (d.is_floating_point(), d == DType::Bool);
    if kind(dst.dtype()) != kind(src.dtype()) {
        return Err(StateDictError::DTypeMismatch {
            key: key.to_owned(),
            expected: dst.dtype(),
            found: src.dtype(),
        });
    }
    Ok(())
}

/// Writes `module.state_dict()` to `path` as `safetensors.torch.save_file` does (row-major,
/// little-endian, each tensor in its own dtype, metadata `{"format": "pt"}`), atomically.
pub fn save_safetensors<M: Module + ?Sized>(module: &M, path: impl AsRef<Path>) -> StateDictResult<()> {
    let mut state = Vec::new();
    module.visit("", &mut |name, t, _| state.push((name.to_owned(), t.clone())));
    save_tensors(&state, path)
}

/// Writes named tensors to a safetensors file at `path`, atomically (see the module docs).
pub fn save_tensors(tensors: &[(String, Tensor)], path: impl AsRef<Path>) -> StateDictResult<()> {
    let path = path.as_ref();
    write_atomic(path, &serialize(tensors, path)?)
}

/// Named tensors as the bytes of a safetensors file (`safetensors.torch.save(tensors)`), for
/// sending them elsewhere; [`load_tensors_from_bytes`] reads them back.
pub fn save_tensors_to_bytes(tensors: &[(String, Tensor)]) -> StateDictResult<Vec<u8>> {
    serialize(tensors, Path::new("<bytes>"))
}

/// The safetensors bytes of `tensors` (`path` names the destination in errors).
fn serialize(tensors: &[(String, Tensor)], path: &Path) -> StateDictResult<Vec<u8>> {
    let mut seen = HashSet::new();
    let mut encoded = Vec::with_capacity(tensors.len());
    for (name, t) in tensors {
        if !seen.insert(name.as_str()) {
            return Err(StateDictError::DuplicateKey { key: name.clone() });
        }
        encoded.push((name.clone(), Encoded::of(t)?));
    }
    let metadata = HashMap::from([("format".to_owned(), "pt".to_owned())]);
    safetensors::serialize(encoded, Some(metadata)).map_err(|e| StateDictError::Format {
        path: path.to_owned(),
        msg: e.to_string(),
    })
}

/// Reads every tensor of a safetensors file onto `device`, in the file's order of offsets.
/// Loads f32, f64, f16, bf16, i64, i32, u8 and bool tensors.
pub fn load_tensors(path: impl AsRef<Path>, device: Device) -> StateDictResult<Vec<(String, Tensor)>> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| StateDictError::Io {
        op: "reading",
        path: path.to_owned(),
        msg: e.to_string(),
    })?;
    parse(&bytes, path, device)
}

/// [`load_tensors`] of a safetensors file's bytes (`safetensors.torch.load(data)`). Every
/// size and offset the header claims is checked against the bytes present before anything is
/// allocated for it; malformed bytes are [`StateDictError::Format`], never a panic.
pub fn load_tensors_from_bytes(bytes: &[u8], device: Device) -> StateDictResult<Vec<(String, Tensor)>> {
    parse(bytes, Path::new("<bytes>"), device)
}

/// The tensors of safetensors `bytes` read from `path` (named in errors).
fn parse(bytes: &[u8], path: &Path, device: Device) -> StateDictResult<Vec<(String, Tensor)>> {
    let format = |msg: String| StateDictError::Format {
        path: path.to_owned(),
        msg,
    };
    let st = SafeTensors::deserialize(bytes).map_err(|e| format(e.to_string()))?;
    // The file's order: `SafeTensors::iter` walks a hash map, so two reads of one file gave
    // two orders. The views borrow `bytes`, so their addresses are their offsets (empty
    // tensors may share one; their names order them).
    let mut views: Vec<_> = st.iter().collect();
    views.sort_by_key(|(name, view)| (view.data().as_ptr() as usize, *name));
    let mut out = Vec::with_capacity(views.len());
    for (name, view) in views {
        let t = decode(view.dtype(), view.shape(), view.data(), device).map_err(|e| match e {
            StateDictError::Format { msg, .. } => format(format!("tensor {name}: {msg}")),
            e => e,
        })?;
        out.push((name.to_owned(), t));
    }
    Ok(out)
}

/// Loads a safetensors checkpoint into `module`, strictly: a checkpoint of another model is
/// [`StateDictError::IncompatibleKeys`] listing the missing and unexpected keys.
pub fn load_safetensors<M: Module + ?Sized>(module: &mut M, path: impl AsRef<Path>) -> StateDictResult<()> {
    let state = load_tensors(path, Device::Cpu)?;
    load_into(module, &state, true).map(drop)
}

/// A tensor's safetensors dtype, shape and little-endian bytes.
struct Encoded {
    dtype: StDtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl Encoded {
    fn of(t: &Tensor) -> StateDictResult<Encoded> {
        fn le<T, const N: usize>(v: Vec<T>, f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
            v.into_iter().flat_map(f).collect()
        }
        let (dtype, data) = match t.dtype() {
            DType::F32 => (StDtype::F32, le(t.to_vec::<f32>()?, f32::to_le_bytes)),
            DType::F64 => (StDtype::F64, le(t.to_vec::<f64>()?, f64::to_le_bytes)),
            DType::F16 => (
                StDtype::F16,
                le(t.to_vec::<f16>()?, |x| x.to_bits().to_le_bytes()),
            ),
            DType::BF16 => (
                StDtype::BF16,
                le(t.to_vec::<bf16>()?, |x| x.to_bits().to_le_bytes()),
            ),
            DType::I64 => (StDtype::I64, le(t.to_vec::<i64>()?, i64::to_le_bytes)),
            DType::I32 => (StDtype::I32, le(t.to_vec::<i32>()?, i32::to_le_bytes)),
            DType::U8 => (StDtype::U8, t.to_vec::<u8>()?),
            DType::Bool => (StDtype::BOOL, le(t.to_vec::<bool>()?, |b| [b as u8])),
        };
        Ok(Encoded {
            dtype,
            shape: t.dims().to_vec(),
            data,
        })
    }
}

impl safetensors::View for Encoded {
    fn dtype(&self) -> StDtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// A tensor from safetensors bytes.
fn decode(dtype: StDtype, shape: &[usize], data: &[u8], device: Device) -> StateDictResult<Tensor> {
    fn chunks<const N: usize, T>(data: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        data.chunks_exact(N)
            .map(|c| f(c.try_into().expect("chunks_exact gives N bytes")))
            .collect()
    }
    let shape = shape.to_vec();
    let t = match dtype {
        StDtype::F32 => Tensor::from_vec(chunks(data, f32::from_le_bytes), shape, device),
        StDtype::F64 => Tensor::from_vec(chunks(data, f64::from_le_bytes), shape, device),
        StDtype::F16 => Tensor::from_vec(
            chunks(data, |b| f16::from_bits(u16::from_le_bytes(b))),
            shape,
            device,
        ),
        StDtype::BF16 => Tensor::from_vec(
            chunks(data, |b| bf16::from_bits(u16::from_le_bytes(b))),
            shape,
            device,
        ),
        StDtype::I64 => Tensor::from_vec(chunks(data, i64::from_le_bytes), shape, device),
        StDtype::I32 => Tensor::from_vec(chunks(data, i32::from_le_bytes), shape, device),
        StDtype::U8 => Tensor::from_vec(data.to_vec(), shape, device),
        StDtype::BOOL => Tensor::from_vec(data.iter().map(|&b| b != 0).collect::<Vec<bool>>(), shape, device),
        other => {
            return Err(StateDictError::Format {
                path: PathBuf::new(),
                msg: format!("dtype {other:?} is not supported by ember"),
            })
        }
    };
    Ok(t?)
}

/// Writes `bytes` to a temporary file beside `path`, syncs it, renames it over `path` and
/// syncs the directory (so the rename too survives a crash); the temporary file is removed
/// when any step fails. Every checkpoint file of ember is written through here (distributed
/// checkpoints' metadata too).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> StateDictResult<()> {
    let io = |op: &'static str, p: &Path, e: std::io::Error| StateDictError::Io {
        op,
        path: p.to_owned(),
        msg: e.to_string(),
    };
    let file_name = path.file_name().ok_or_else(|| StateDictError::Io {
        op: "writing",
        path: path.to_owned(),
        msg: "the path names no file".into(),
    })?;
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_owned(),
        _ => PathBuf::from("."),
    };
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp.{}.{n}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let result = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(|e| io("creating", &tmp, e))?;
        f.write_all(bytes).map_err(|e| io("writing", &tmp, e))?;
        f.sync_all().map_err(|e| io("syncing", &tmp, e))?;
        drop(f);
        std::fs::rename(&tmp, path).map_err(|e| io("renaming onto", path, e))?;
        // Best effort: not every platform can open a directory to sync it.
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
