//! The checkpoint's `.metadata` file: what each tensor is (global shape, dtype) and where
//! its pieces are, as JSON.
//!
//! ```text
//! { "format": "ember.distributed.checkpoint", "version": 1, "world_size": 2,
//!   "files": { "__0_<id>.distcp": 1234, "__1_<id>.distcp": 1102 },      (name: bytes)
//!   "tensors": { "fc.weight": { "dtype": "float32", "shape": [5, 3],
//!       "pieces": [ { "file": "__0_<id>.distcp", "offsets": [0, 0], "lengths": [3, 3] },
//!                   { "file": "__1_<id>.distcp", "offsets": [3, 0], "lengths": [2, 3] } ] } } }
//! ```
//!
//! A piece is a block of whole rows (dim 0) stored under the tensor's name in a safetensors
//! file; `offsets` and `lengths` are per dim, as PyTorch's chunk metadata (only dim 0's differ
//! from the full tensor's). A 0-d tensor has one piece with empty `offsets` and `lengths`. The
//! file sizes let a load find a truncated or replaced file before reading it.

use std::collections::BTreeMap;
use std::path::Path;

use ember_core::DType;
use serde_json::{json, Value};

use super::{CheckpointError, CheckpointResult};

pub(crate) const FORMAT: &str = "ember.distributed.checkpoint";
pub(crate) const VERSION: u64 = 1;

/// Rows `offset..offset + rows` of a tensor, stored in `file` (a 0-d tensor: `0..1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Piece {
    pub file: String,
    pub offset: usize,
    pub rows: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TensorMeta {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub pieces: Vec<Piece>,
}

impl TensorMeta {
    /// The rows of dim 0 (1 for a 0-d tensor, its one "row").
    pub fn rows(&self) -> usize {
        self.shape.first().copied().unwrap_or(1)
    }
}

/// A whole checkpoint's metadata, or one rank's part of it while saving.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Metadata {
    pub world_size: usize,
    pub files: BTreeMap<String, u64>,
    pub tensors: BTreeMap<String, TensorMeta>,
}

pub(crate) fn dtype_from_name(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|d| d.name() == name)
}

impl Metadata {
    pub fn to_json(&self) -> Value {
        let tensors: serde_json::Map<String, Value> = self
            .tensors
            .iter()
            .map(|(k, t)| {
                let pieces: Vec<Value> = t
                    .pieces
                    .iter()
                    .map(|p| {
                        let (mut offsets, mut lengths) = (vec![], vec![]);
                        if !t.shape.is_empty() {
                            offsets.push(p.offset);
                            offsets.extend(std::iter::repeat_n(0, t.shape.len() - 1));
                            lengths.push(p.rows);
                            lengths.extend_from_slice(&t.shape[1..]);
                        }
                        json!({ "file": p.file, "offsets": offsets, "lengths": lengths })
                    })
                    .collect();
                let v = json!({ "dtype": t.dtype.name(), "shape": t.shape, "pieces": pieces });
                (k.clone(), v)
            })
            .collect();
        json!({
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.world_size,
            "files": self.files,
            "tensors": tensors,
        })
    }

    /// Parses and checks the JSON of [`Metadata::to_json`] (a whole checkpoint's: the pieces
    /// must tile every tensor); `path` names the file in errors.
    pub fn from_json(v: &Value, path: &Path) -> CheckpointResult<Metadata> {
        let m = Metadata::parse(v, path)?;
        for (key, t) in &m.tensors {
            check_coverage(key, t).map_err(|msg| CheckpointError::InvalidMetadata {
                path: path.to_owned(),
                msg,
            })?;
        }
        Ok(m)
    }

    /// [`Metadata::from_json`] without the coverage check (one rank's part).
    pub fn parse(v: &Value, path: &Path) -> CheckpointResult<Metadata> {
        let bad = |msg: String| CheckpointError::InvalidMetadata {
            path: path.to_owned(),
            msg,
        };
        if v.get("format").and_then(Value::as_str) != Some(FORMAT) {
            return Err(bad(format!(
                "not an ember distributed checkpoint (no \"format\": \"{FORMAT}\")"
            )));
        }
        let version = v.get("version").and_then(Value::as_u64);
        if version != Some(VERSION) {
            return Err(bad(format!(
                "format version {version:?}; this ember reads version {VERSION}: load it with the ember that saved it"
            )));
        }
        let usize_of = |v: &Value, what: &str| -> CheckpointResult<usize> {
            v.as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| bad(format!("{what} is not a non-negative integer")))
        };
        let list_of = |v: Option<&Value>, what: &str| -> CheckpointResult<Vec<usize>> {
            v.and_then(Value::as_array)
                .ok_or_else(|| bad(format!("{what} is not a list")))?
                .iter()
                .map(|x| usize_of(x, what))
                .collect()
        };
        let world_size = usize_of(v.get("world_size").unwrap_or(&Value::Null), "world_size")?;
        let mut files = BTreeMap::new();
        for (name, len) in v
            .get("files")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("\"files\" is not an object".into()))?
        {
            let len = len
                .as_u64()
                .ok_or_else(|| bad(format!("the size of file {name} is not an integer")))?;
            if name.contains(['/', '\\']) || name.starts_with('.') {
                return Err(bad(format!("file name {name:?} is not a plain file name")));
            }
            files.insert(name.clone(), len);
        }
        let mut tensors = BTreeMap::new();
        for (key, t) in v
            .get("tensors")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("\"tensors\" is not an object".into()))?
        {
            let name = t.get("dtype").and_then(Value::as_str).unwrap_or("");
            let dtype = dtype_from_name(name).ok_or_else(|| bad(format!("{key}: unknown dtype {name:?}")))?;
            let shape = list_of(t.get("shape"), &format!("{key}: shape"))?;
            // Its bytes (8 at most per element) must be countable.
            if shape.iter().try_fold(8usize, |a, &d| a.checked_mul(d)).is_none() {
                return Err(bad(format!("{key}: shape {shape:?} overflows")));
            }
            let mut pieces = Vec::new();
            for p in t
                .get("pieces")
                .and_then(Value::as_array)
                .ok_or_else(|| bad(format!("{key}: \"pieces\" is not a list")))?
            {
                let file = p
                    .get("file")
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("{key}: a piece names no file")))?;
                if !files.contains_key(file) {
                    return Err(bad(format!(
                        "{key}: a piece names {file}, which \"files\" does not list"
                    )));
                }
                let offsets = list_of(p.get("offsets"), &format!("{key}: offsets"))?;
                let lengths = list_of(p.get("lengths"), &format!("{key}: lengths"))?;
                let (offset, rows) = if shape.is_empty() {
                    if !offsets.is_empty() || !lengths.is_empty() {
                        return Err(bad(format!(
                            "{key}: a piece of a 0-d tensor has offsets or lengths"
                        )));
                    }
                    (0, 1)
                } else {
                    let whole_rows = offsets.len() == shape.len()
                        && lengths.len() == shape.len()
                        && offsets[1..].iter().all(|&o| o == 0)
                        && lengths[1..] == shape[1..];
                    if !whole_rows {
                        return Err(bad(format!(
                            "{key}: piece offsets {offsets:?}, lengths {lengths:?} are not whole rows of shape {shape:?}"
                        )));
                    }
                    (offsets[0], lengths[0])
                };
                pieces.push(Piece {
                    file: file.to_owned(),
                    offset,
                    rows,
                });
            }
            tensors.insert(key.clone(), TensorMeta { dtype, shape, pieces });
        }
        Ok(Metadata {
            world_size,
            files,
            tensors,
        })
    }

    /// Merges the ranks' parts (rank order) into the checkpoint's metadata: every rank must
    /// have listed the same keys with the same dtype and global shape, and the pieces must
    /// cover each tensor's rows exactly once.
    pub fn merge(parts: Vec<Metadata>) -> Result<Metadata, String> {
        let mut out = Metadata {
            world_size: parts.len(),
            ..Metadata::default()
        };
        let Some(first) = parts.first() else {
            return Ok(out);
        };
        let keys: Vec<&String> = first.tensors.keys().collect();
        for (rank, part) in parts.iter().enumerate() {
            let theirs: Vec<&String> = part.tensors.keys().collect();
            if theirs != keys {
                let only = |a: &[&String], b: &[&String]| -> Vec<String> {
                    a.iter()
                        .filter(|k| !b.contains(k))
                        .map(|k| (*k).clone())
                        .collect()
                };
                return Err(format!(
                    "rank {rank}'s state dict has other keys than rank 0's (only on rank {rank}: {:?}; only on rank 0: {:?}); every rank must save the same keys",
                    only(&theirs, &keys),
                    only(&keys, &theirs)
                ));
            }
        }
        for part in parts {
            out.files.extend(part.files);
            for (key, t) in part.tensors {
                match out.tensors.get_mut(&key) {
                    None => {
                        out.tensors.insert(key, t);
                    }
                    Some(have) => {
                        if (have.dtype, &have.shape) != (t.dtype, &t.shape) {
                            return Err(format!(
                                "{key} is {} of global shape {:?} on one rank and {} of shape {:?} on another; every rank must save the same tensors",
                                have.dtype, have.shape, t.dtype, t.shape
                            ));
                        }
                        have.pieces.extend(t.pieces);
                    }
                }
            }
        }
        for (key, t) in &mut out.tensors {
            t.pieces.sort_by_key(|p| p.offset);
            check_coverage(key, t)?;
        }
        Ok(out)
    }
}

/// The pieces of `t` cover its rows `0..rows` exactly once (in any order). A tensor of no
/// elements has no pieces (nothing to store).
fn check_coverage(key: &str, t: &TensorMeta) -> Result<(), String> {
    if t.shape.contains(&0) {
        return match t.pieces.is_empty() {
            true => Ok(()),
            false => Err(format!("{key} has no elements but lists pieces")),
        };
    }
    let mut pieces: Vec<&Piece> = t.pieces.iter().collect();
    pieces.sort_by_key(|p| p.offset);
    let mut next = 0;
    for p in &pieces {
        if p.offset != next || p.rows == 0 {
            return Err(format!(
                "{key}: the pieces do not tile its rows (a piece of {} row(s) starts at row {}, expected one at {next})",
                p.rows, p.offset
            ));
        }
        next = p.offset.saturating_add(p.rows);
    }
    if next != t.rows() {
        return Err(format!("{key}: the pieces cover rows 0..{next} of {}", t.rows()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Metadata {
        let piece = |file: &str, offset, rows| Piece {
            file: file.into(),
            offset,
            rows,
        };
        Metadata {
            world_size: 2,
            files: BTreeMap::from([("a".into(), 10), ("b".into(), 20)]),
            tensors: BTreeMap::from([
                (
                    "w".into(),
                    TensorMeta {
                        dtype: DType::F32,
                        shape: vec![5, 3],
                        pieces: vec![piece("a", 0, 3), piece("b", 3, 2)],
                    },
                ),
                (
                    "step".into(),
                    TensorMeta {
                        dtype: DType::BF16,
                        shape: vec![],
                        pieces: vec![piece("a", 0, 1)],
                    },
                ),
                (
                    "none".into(),
                    TensorMeta {
                        dtype: DType::I64,
                        shape: vec![0, 4],
                        pieces: vec![],
                    },
                ),
            ]),
        }
    }

    #[test]
    fn json_round_trip() {
        let m = meta();
        let v = m.to_json();
        assert_eq!(v["tensors"]["w"]["pieces"][1]["offsets"], json!([3, 0]));
        assert_eq!(v["tensors"]["w"]["pieces"][1]["lengths"], json!([2, 3]));
        assert_eq!(Metadata::from_json(&v, Path::new("m")).unwrap(), m);
    }

    #[test]
    fn bad_metadata_is_an_error() {
        let p = Path::new("m");
        let mut v = meta().to_json();
        v["tensors"]["w"]["pieces"][1]["offsets"] = json!([4, 0]);
        assert!(Metadata::from_json(&v, p)
            .unwrap_err()
            .to_string()
            .contains("tile"));
        let mut v = meta().to_json();
        v["tensors"]["w"]["pieces"][1]["file"] = json!("c");
        assert!(Metadata::from_json(&v, p).is_err());
        let mut v = meta().to_json();
        v["tensors"]["w"]["dtype"] = json!("float128");
        assert!(Metadata::from_json(&v, p).is_err());
        let mut v = meta().to_json();
        v["version"] = json!(2);
        assert!(Metadata::from_json(&v, p)
            .unwrap_err()
            .to_string()
            .contains("version"));
        assert!(Metadata::from_json(&json!([1, 2]), p).is_err());
    }

    #[test]
    fn merge_checks_ranks_agree() {
        let mut a = meta();
        let mut b = meta();
        a.files.remove("b");
        b.files.remove("a");
        a.tensors.get_mut("w").unwrap().pieces.truncate(1);
        b.tensors.get_mut("w").unwrap().pieces.remove(0);
        b.tensors.get_mut("step").unwrap().pieces.clear();
        let merged = Metadata::merge(vec![a.clone(), b.clone()]).unwrap();
        assert_eq!(merged, meta());
        b.tensors.get_mut("w").unwrap().shape = vec![6, 3];
        assert!(Metadata::merge(vec![a.clone(), b.clone()]).is_err());
        b.tensors.remove("w");
        assert!(Metadata::merge(vec![a, b]).unwrap_err().contains("other keys"));
    }
}
