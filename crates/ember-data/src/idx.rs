//! IDX files, the format of MNIST and Fashion-MNIST: [`read_idx`], [`parse_idx`], and
//! [`to_idx_bytes`] to write one.
//!
//! Layout (all integers big-endian):
//!
//! | bytes | meaning |
//! |-------|---------|
//! | 0..2  | zero |
//! | 2     | element type: `0x08` u8, `0x09` i8, `0x0B` i16, `0x0C` i32, `0x0D` f32, `0x0E` f64 |
//! | 3     | number of dimensions `n` |
//! | 4..4+4n | each dimension's size as a u32 |
//! | then  | the elements in row-major order, exactly `prod(dims)` of them, nothing after |
//!
//! Element types map to ember dtypes: u8 → `U8`, i32 → `I32`, f32 → `F32`, f64 → `F64`; i8
//! and i16, which ember has no dtype for, widen to `I32` exactly. Input that starts with the
//! gzip header (`1f 8b`) is decompressed first, so `.gz` files read as they are (as far as the
//! header's dimensions say and one byte more, so a stream never inflates past them). Anything
//! malformed (bad magic, unknown type, a truncated header or data, dimensions whose product
//! overflows, bytes after the data, a broken gzip stream) is an
//! [`Error::InvalidArgument`] naming the file and what is wrong, never a panic.

use ember_core::{DType, Device, Error, Result, Tensor};
use std::io::Read;
use std::path::Path;

const OP: &str = "read_idx";

/// The gzip magic (RFC 1952, ID1 ID2).
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// An IDX element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IdxType {
    U8,
    I8,
    I16,
    I32,
    F32,
    F64,
}

impl IdxType {
    fn from_code(code: u8) -> Option<IdxType> {
        Some(match code {
            0x08 => IdxType::U8,
            0x09 => IdxType::I8,
            0x0B => IdxType::I16,
            0x0C => IdxType::I32,
            0x0D => IdxType::F32,
            0x0E => IdxType::F64,
            _ => return None,
        })
    }

    /// Bytes per element in the file.
    fn size(self) -> usize {
        match self {
            IdxType::U8 | IdxType::I8 => 1,
            IdxType::I16 => 2,
            IdxType::I32 | IdxType::F32 => 4,
            IdxType::F64 => 8,
        }
    }
}

/// The tensor stored in the IDX file at `path` (gzipped or not), on the CPU.
pub fn read_idx(path: impl AsRef<Path>) -> Result<Tensor> {
    let path = path.as_ref();
    let bytes = std::fs::read(path)
        .map_err(|e| Error::invalid(OP, format!("{}: cannot read the file: {e}", path.display())))?;
    parse_idx_named(&bytes, &path.display().to_string())
}

/// The tensor stored in the IDX bytes `bytes` (gzipped or not), on the CPU.
pub fn parse_idx(bytes: &[u8]) -> Result<Tensor> {
    parse_idx_named(bytes, "<IDX bytes>")
}

/// [`parse_idx`] naming the data `name` (a path) in its errors.
pub fn parse_idx_named(bytes: &[u8], name: &str) -> Result<Tensor> {
    let bad = |what: String| Error::invalid(OP, format!("{name}: {what}"));
    if bytes.starts_with(&GZIP_MAGIC) {
        // Decompressed as far as the header says and one byte more (to find trailing bytes):
        // a stream that inflates past what its header claims is never held whole.
        let mut gz = flate2::read::MultiGzDecoder::new(bytes);
        let mut raw = Vec::new();
        let mut more = |raw: &mut Vec<u8>, n: u64| {
            (&mut gz)
                .take(n)
                .read_to_end(raw)
                .map_err(|e| bad(format!("not a valid gzip stream: {e}")))
        };
        more(&mut raw, 4)?;
        if let Some(&ndims) = raw.get(3) {
            more(&mut raw, 4 * ndims as u64)?;
            if let Ok(h) = Header::parse(&raw, name) {
                more(&mut raw, (h.data_len as u64).saturating_add(1))?;
                if raw.len() > h.len + h.data_len {
                    return Err(bad(format!(
                        "trailing garbage: the decompressed data runs past the {} bytes that dimensions {:?} need",
                        h.data_len, h.dims
                    )));
                }
            }
        }
        return parse_raw(&raw, name);
    }
    parse_raw(bytes, name)
}

/// An IDX header: element type, dimensions, and the bytes it takes and announces.
struct Header {
    ty: IdxType,
    dims: Vec<usize>,
    /// Bytes of the header itself (4 + 4 per dimension).
    len: usize,
    /// Bytes of data the dimensions need.
    data_len: usize,
}

impl Header {
    /// The header at the start of `bytes` (which may hold more); an error when it is cut short
    /// or malformed.
    fn parse(bytes: &[u8], name: &str) -> Result<Header> {
        let bad = |what: String| Error::invalid(OP, format!("{name}: {what}"));
        let Some(magic) = bytes.get(..4) else {
            return Err(bad(format!(
                "truncated header: an IDX file starts with 4 magic bytes, found {} bytes",
                bytes.len()
            )));
        };
        if magic[0] != 0 || magic[1] != 0 {
            return Err(bad(format!(
                "bad magic {:02x} {:02x} {:02x} {:02x}: an IDX file starts with two zero bytes",
                magic[0], magic[1], magic[2], magic[3]
            )));
        }
        let ty = IdxType::from_code(magic[2]).ok_or_else(|| {
            bad(format!(
                "bad magic: unknown element type 0x{:02x} (expected 08, 09, 0b, 0c, 0d or 0e)",
                magic[2]
            ))
        })?;
        let ndims = magic[3] as usize;
        let len = 4 + 4 * ndims;
        let Some(dim_bytes) = bytes.get(4..len) else {
            return Err(bad(format!(
                "truncated header: {ndims} dimensions need {len} header bytes, found {}",
                bytes.len()
            )));
        };
        let dims: Vec<usize> = dim_bytes
            .chunks_exact(4)
            .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize)
            .collect();
        let data_len = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(ty.size()))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| {
                bad(format!(
                    "dimensions {dims:?} overflow: their product cannot be addressed"
                ))
            })?;
        Ok(Header {
            ty,
            dims,
            len,
            data_len,
        })
    }
}

fn parse_raw(bytes: &[u8], name: &str) -> Result<Tensor> {
    let bad = |what: String| Error::invalid(OP, format!("{name}: {what}"));
    let Header {
        ty,
        dims,
        len: header,
        data_len,
    } = Header::parse(bytes, name)?;
    let data = &bytes[header..];
    if data.len() < data_len {
        return Err(bad(format!(
            "truncated data: dimensions {dims:?} of {ty:?} need {data_len} bytes after the header, found {}",
            data.len()
        )));
    }
    if data.len() > data_len {
        return Err(bad(format!(
            "{} bytes of trailing garbage after the {data_len} bytes of data for dimensions {dims:?}",
            data.len() - data_len
        )));
    }
    let cpu = Device::Cpu;
    match ty {
        IdxType::U8 => Tensor::from_slice(data, dims, cpu),
        IdxType::I8 => Tensor::from_vec(
            data.iter().map(|&b| b as i8 as i32).collect::<Vec<_>>(),
            dims,
            cpu,
        ),
        IdxType::I16 => Tensor::from_vec(
            data.chunks_exact(2)
                .map(|c| i16::from_be_bytes([c[0], c[1]]) as i32)
                .collect::<Vec<_>>(),
            dims,
            cpu,
        ),
        IdxType::I32 => Tensor::from_vec(
            data.chunks_exact(4)
                .map(|c| i32::from_be_bytes(c.try_into().expect("chunks of 4")))
                .collect::<Vec<_>>(),
            dims,
            cpu,
        ),
        IdxType::F32 => Tensor::from_vec(
            data.chunks_exact(4)
                .map(|c| f32::from_be_bytes(c.try_into().expect("chunks of 4")))
                .collect::<Vec<_>>(),
            dims,
            cpu,
        ),
        IdxType::F64 => Tensor::from_vec(
            data.chunks_exact(8)
                .map(|c| f64::from_be_bytes(c.try_into().expect("chunks of 8")))
                .collect::<Vec<_>>(),
            dims,
            cpu,
        ),
    }
}

/// `tensor` as an uncompressed IDX file: U8 as `0x08`, I32 as `0x0C`, F32 as `0x0D`, F64 as
/// `0x0E` (other dtypes are [`Error::UnsupportedDType`]); at most 255 dimensions of at most
/// `u32::MAX` each.
pub fn to_idx_bytes(tensor: &Tensor) -> Result<Vec<u8>> {
    const OP: &str = "to_idx_bytes";
    let code = match tensor.dtype() {
        DType::U8 => 0x08,
        DType::I32 => 0x0C,
        DType::F32 => 0x0D,
        DType::F64 => 0x0E,
        dtype => {
            return Err(Error::UnsupportedDType {
                op: OP,
                dtype,
                hint: "IDX holds u8, i8, i16, i32, f32 or f64; convert with .to_dtype()",
            })
        }
    };
    let ndims = u8::try_from(tensor.rank()).map_err(|_| {
        Error::invalid(
            OP,
            format!("IDX holds at most 255 dimensions, got {}", tensor.rank()),
        )
    })?;
    let mut out = vec![0, 0, code, ndims];
    for &d in tensor.dims() {
        let d = u32::try_from(d)
            .map_err(|_| Error::invalid(OP, format!("dimension {d} does not fit in a u32")))?;
        out.extend_from_slice(&d.to_be_bytes());
    }
    match tensor.dtype() {
        DType::U8 => out.extend_from_slice(&tensor.to_vec::<u8>()?),
        DType::I32 => out.extend(tensor.to_vec::<i32>()?.iter().flat_map(|v| v.to_be_bytes())),
        DType::F32 => out.extend(tensor.to_vec::<f32>()?.iter().flat_map(|v| v.to_be_bytes())),
        DType::F64 => out.extend(tensor.to_vec::<f64>()?.iter().flat_map(|v| v.to_be_bytes())),
        _ => unreachable!("dtype checked above"),
    }
    Ok(out)
}
