//! Reading the ranks' safetensors files a row range at a time (header parsed, then only the
//! bytes of the rows wanted), so a rank reads no more than the pieces that overlap its shards.
//! (Files are written by ember-nn's `save_tensors` and `write_atomic`.)

use std::collections::HashMap;
use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

use ember_core::DType;
use serde_json::Value;

use super::metadata::{Piece, TensorMeta};
use super::{CheckpointError, CheckpointResult};

fn io(op: &'static str, path: &Path, e: std::io::Error) -> CheckpointError {
    CheckpointError::Io {
        op,
        path: path.to_owned(),
        msg: e.to_string(),
    }
}

/// The safetensors name of a dtype.
pub(crate) fn safetensors_dtype(d: DType) -> &'static str {
    match d {
        DType::Bool => "BOOL",
        DType::U8 => "U8",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
    }
}

/// One tensor of a safetensors header: dtype name, shape, byte range in the data section.
struct Entry {
    dtype: String,
    shape: Vec<usize>,
    bytes: Range<u64>,
}

/// An open piece file of the checkpoint (a [`File`], or bytes in memory for the fuzz
/// target), its header parsed.
///
/// Nothing is allocated by what the bytes claim alone: the header is read only after its
/// claimed length is checked against the file's actual length, every entry's byte range
/// against the data section, and a read of rows only after the entry's size is checked
/// against the metadata's shape, in checked arithmetic.
pub(crate) struct ShardFile<R = File> {
    path: PathBuf,
    file: R,
    data_start: u64,
    entries: HashMap<String, Entry>,
}

impl ShardFile {
    /// Opens `dir/name`, which the metadata says is `expected_len` bytes long.
    pub fn open(dir: &Path, name: &str, expected_len: u64) -> CheckpointResult<ShardFile> {
        let path = dir.join(name);
        let file = File::open(&path).map_err(|e| match e.kind() {
            ErrorKind::NotFound => CheckpointError::MissingFile {
                path: path.clone(),
                msg: e.to_string(),
            },
            _ => io("opening", &path, e),
        })?;
        let len = file.metadata().map_err(|e| io("reading", &path, e))?.len();
        ShardFile::from_reader(path, file, len, expected_len)
    }
}

impl<R: Read + Seek> ShardFile<R> {
    /// Parses the header of `file`, `len` bytes long, which the metadata says is
    /// `expected_len` bytes; `path` names it in errors.
    pub fn from_reader(
        path: PathBuf,
        mut file: R,
        len: u64,
        expected_len: u64,
    ) -> CheckpointResult<ShardFile<R>> {
        let corrupt = |msg: String| CheckpointError::Corrupt {
            path: path.clone(),
            msg,
        };
        if len != expected_len {
            return Err(corrupt(format!(
                "it is {len} bytes, the checkpoint's metadata says {expected_len}"
            )));
        }
        let mut n = [0u8; 8];
        file.read_exact(&mut n)
            .map_err(|e| corrupt(format!("no safetensors header ({e})")))?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) {
            return Err(corrupt(format!(
                "its header claims {n} bytes, the file has {len}"
            )));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| io("reading", &path, e))?;
        let header: Value = serde_json::from_slice(&header)
            .map_err(|e| corrupt(format!("its safetensors header is not JSON ({e})")))?;
        let header = header
            .as_object()
            .ok_or_else(|| corrupt("its safetensors header is not an object".into()))?;
        let data_start = 8 + n;
        let mut entries = HashMap::new();
        for (key, v) in header {
            if key == "__metadata__" {
                continue;
            }
            let ints =
                |f: &str| -> Option<Vec<u64>> { v.get(f)?.as_array()?.iter().map(Value::as_u64).collect() };
            let (Some(dtype), Some(shape), Some(offsets)) = (
                v.get("dtype").and_then(Value::as_str),
                ints("shape"),
                ints("data_offsets"),
            ) else {
                return Err(corrupt(format!("its header entry for {key} is malformed")));
            };
            let [start, end] = offsets[..] else {
                return Err(corrupt(format!("its header entry for {key} has no byte range")));
            };
            if start > end || end > len - data_start {
                return Err(corrupt(format!(
                    "{key} claims bytes {start}..{end} of a {}-byte data section",
                    len - data_start
                )));
            }
            let shape = shape.into_iter().map(|d| d as usize).collect();
            entries.insert(
                key.clone(),
                Entry {
                    dtype: dtype.to_owned(),
                    shape,
                    bytes: start..end,
                },
            );
        }
        Ok(ShardFile {
            path,
            file,
            data_start,
            entries,
        })
    }

    /// The entries of the header: each key with its safetensors dtype name and shape.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &str, &[usize])> {
        self.entries
            .iter()
            .map(|(k, e)| (k.as_str(), e.dtype.as_str(), e.shape.as_slice()))
    }

    /// The little-endian bytes of rows `rows` (global rows, inside `piece`) of tensor `key`.
    pub fn read_rows(
        &mut self,
        key: &str,
        meta: &TensorMeta,
        piece: &Piece,
        rows: Range<usize>,
    ) -> CheckpointResult<Vec<u8>> {
        let corrupt = |msg: String| CheckpointError::Corrupt {
            path: self.path.clone(),
            msg,
        };
        let e = self.entries.get(key).ok_or_else(|| {
            corrupt(format!(
                "it holds no piece of {key}, which the metadata puts there"
            ))
        })?;
        let mut shape = meta.shape.clone();
        if let Some(r) = shape.first_mut() {
            *r = piece.rows;
        }
        let size = meta.dtype.size_in_bytes() as u64;
        // Checked: the metadata's parser bounds a whole tensor's bytes, but this reader trusts
        // nothing it is handed.
        let row_bytes = meta
            .shape
            .iter()
            .skip(1)
            .try_fold(size, |a, &d| a.checked_mul(d as u64));
        let expected = row_bytes.and_then(|r| r.checked_mul(piece.rows as u64));
        let (Some(row_bytes), Some(expected)) = (row_bytes, expected) else {
            return Err(corrupt(format!("the bytes of {key}'s piece {shape:?} overflow")));
        };
        if e.dtype != safetensors_dtype(meta.dtype)
            || e.shape != shape
            || e.bytes.end - e.bytes.start != expected
            || !(piece.offset <= rows.start
                && rows.start <= rows.end
                && rows.end <= piece.offset.saturating_add(piece.rows))
        {
            return Err(corrupt(format!(
                "its piece of {key} is {} {:?} ({} bytes), the metadata says {} {shape:?}",
                e.dtype,
                e.shape,
                e.bytes.end - e.bytes.start,
                safetensors_dtype(meta.dtype)
            )));
        }
        // Both within the entry's bytes, which lie inside the file (checked above and in
        // `from_reader`).
        let skip = (rows.start - piece.offset) as u64 * row_bytes;
        let mut out = vec![0u8; (rows.len() as u64 * row_bytes) as usize];
        self.file
            .seek(SeekFrom::Start(self.data_start + e.bytes.start + skip))
            .map_err(|err| io("reading", &self.path, err))?;
        self.file.read_exact(&mut out).map_err(|err| match err.kind() {
            ErrorKind::UnexpectedEof => corrupt(format!("it ends inside {key}")),
            _ => io("reading", &self.path, err),
        })?;
        Ok(out)
    }
}
