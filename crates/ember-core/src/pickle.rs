//! Python's pickle format for plain data: the values memory snapshots are made of (dict, list,
//! tuple, str, int, float, bool, None), written as `pickle.dump` writes them at protocol 2 and
//! read back from protocols 2 to 5 (what `pickle.dump` of such data writes in any Python 3).
//!
//! The writer ([`dumps`]) emits the opcodes CPython's pickler chooses for these types at
//! protocol 2 (its C implementation, `_pickle.c`, which `pickle.dump` uses): `PROTO 2`;
//! `EMPTY_DICT`/`EMPTY_LIST` then `SETITEM`/`APPEND` for a single item, else `MARK ...
//! SETITEMS`/`APPENDS` per batch of 1,000; `TUPLE1..3` or `MARK ... TUPLE`;
//! `BININT1`/`BININT2`/`BININT`/`LONG1` by magnitude; `BINFLOAT`; `NEWTRUE`/`NEWFALSE`; `N`;
//! `BINUNICODE`. Every container and string is memoized (`BINPUT`/`LONG_BINPUT`), and an equal
//! string written again is a `BINGET` of the first, as CPython does for the shared key objects of
//! a PyTorch snapshot; so the snapshot's repeated keys cost a few bytes each.
//!
//! The reader ([`loads`]) accepts those opcodes plus what protocols 3 to 5 add for plain data
//! (`FRAME`, `SHORT_BINUNICODE`, `BINUNICODE8`, `MEMOIZE`, `LONG4`); anything else (classes,
//! bytes, sets, protocol 0 text opcodes) is a [`PickleError::Unsupported`] naming the opcode.

use std::collections::HashMap;
use std::fmt;

/// A Python value of the plain-data subset. Dicts keep their insertion order, as Python's do.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int` (Python's are unbounded; 128 bits hold every address and size).
    Int(i128),
    /// A `float` (IEEE double).
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<Value>),
    /// A `tuple`.
    Tuple(Vec<Value>),
    /// A `dict`, in insertion order.
    Dict(Vec<(Value, Value)>),
}

impl Value {
    /// A dict with string keys, in the given order.
    pub fn dict<K: Into<String>>(items: impl IntoIterator<Item = (K, Value)>) -> Value {
        Value::Dict(
            items
                .into_iter()
                .map(|(k, v)| (Value::Str(k.into()), v))
                .collect(),
        )
    }

    /// The value under string key `key` of a dict (the last one, as Python's dict keeps the last
    /// of repeated keys); None for other values or a missing key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Dict(items) => items
                .iter()
                .rev()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The integer, if this is one (`bool` counts, as in Python).
    pub fn as_int(&self) -> Option<i128> {
        match *self {
            Value::Int(i) => Some(i),
            Value::Bool(b) => Some(b as i128),
            _ => None,
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The items of a list or tuple.
    pub fn as_seq(&self) -> Option<&[Value]> {
        match self {
            Value::List(v) | Value::Tuple(v) => Some(v),
            _ => None,
        }
    }
}

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}

impl From<String> for Value {
    fn from(s: String) -> Self {
        Value::Str(s)
    }
}

impl From<bool> for Value {
    fn from(b: bool) -> Self {
        Value::Bool(b)
    }
}

impl From<f64> for Value {
    fn from(f: f64) -> Self {
        Value::Float(f)
    }
}

macro_rules! int_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Value {
            fn from(i: $t) -> Self {
                Value::Int(i as i128)
            }
        }
    )*};
}
int_from!(i32, i64, u32, u64, usize);

/// Why bytes could not be read as a pickle of plain data.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PickleError {
    /// The data ended before `STOP`.
    #[error("pickle data ends early (at byte {offset}): the file is truncated")]
    Truncated {
        /// Bytes read.
        offset: usize,
    },
    /// An opcode outside the plain-data subset.
    #[error(
        "unsupported pickle opcode {opcode:#04x} at byte {offset}: ember reads dicts, lists, tuples, \
         strings, numbers, booleans and None"
    )]
    Unsupported {
        /// The opcode byte.
        opcode: u8,
        /// Where it is.
        offset: usize,
    },
    /// Well-formed opcodes that do not make a value (an empty stack, a missing `MARK`, an
    /// unknown memo key, bad UTF-8, an odd number of dict items, data after `STOP`).
    #[error("malformed pickle at byte {offset}: {what}")]
    Malformed {
        /// Where it went wrong.
        offset: usize,
        /// What went wrong.
        what: String,
    },
}

// The opcodes (CPython's `Lib/pickle.py` names).
const PROTO: u8 = 0x80;
const FRAME: u8 = 0x95;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const LONG4: u8 = 0x8b;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINUNICODE8: u8 = 0x8d;
const EMPTY_LIST: u8 = b']';
const APPEND: u8 = b'a';
const APPENDS: u8 = b'e';
const EMPTY_DICT: u8 = b'}';
const SETITEM: u8 = b's';
const SETITEMS: u8 = b'u';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const BINPUT: u8 = b'q';
const LONG_BINPUT: u8 = b'r';
const BINGET: u8 = b'h';
const LONG_BINGET: u8 = b'j';
const MEMOIZE: u8 = 0x94;

/// Items per `SETITEMS`/`APPENDS` batch (CPython's `_BATCHSIZE`).
const BATCH: usize = 1000;

/// `value` as a protocol-2 pickle, byte for byte what CPython's `pickle.dumps(value, protocol=2)`
/// writes when equal strings are one object.
pub fn dumps(value: &Value) -> Vec<u8> {
    let mut w = Writer::default();
    w.out.extend_from_slice(&[PROTO, 2]);
    w.value(value);
    w.out.push(STOP);
    w.out
}

/// Writes `value` as a protocol-2 pickle to `path` (Python's `pickle.dump` into a file).
pub fn dump(value: &Value, path: impl AsRef<std::path::Path>) -> std::io::Result<()> {
    std::fs::write(path, dumps(value))
}

#[derive(Default)]
struct Writer {
    out: Vec<u8>,
    /// Memo entries written so far.
    memo_len: u32,
    /// Strings already written, by memo index.
    strings: HashMap<String, u32>,
}

impl Writer {
    fn put(&mut self) -> u32 {
        let index = self.memo_len;
        if index < 256 {
            self.out.extend_from_slice(&[BINPUT, index as u8]);
        } else {
            self.out.push(LONG_BINPUT);
            self.out.extend_from_slice(&index.to_le_bytes());
        }
        self.memo_len += 1;
        index
    }

    fn get(&mut self, index: u32) {
        if index < 256 {
            self.out.extend_from_slice(&[BINGET, index as u8]);
        } else {
            self.out.push(LONG_BINGET);
            self.out.extend_from_slice(&index.to_le_bytes());
        }
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::None => self.out.push(NONE),
            Value::Bool(true) => self.out.push(NEWTRUE),
            Value::Bool(false) => self.out.push(NEWFALSE),
            Value::Int(i) => self.int(*i),
            Value::Float(f) => {
                self.out.push(BINFLOAT);
                self.out.extend_from_slice(&f.to_be_bytes());
            }
            Value::Str(s) => self.str(s),
            Value::List(items) => {
                self.out.push(EMPTY_LIST);
                self.put();
                if let [one] = &items[..] {
                    self.value(one);
                    self.out.push(APPEND);
                    return;
                }
                for batch in items.chunks(BATCH) {
                    self.out.push(MARK);
                    batch.iter().for_each(|x| self.value(x));
                    self.out.push(APPENDS);
                }
            }
            Value::Tuple(items) => {
                match items.len() {
                    0 => {
                        // The empty tuple is a singleton CPython does not memoize.
                        self.out.push(EMPTY_TUPLE);
                        return;
                    }
                    1..=3 => {
                        items.iter().for_each(|x| self.value(x));
                        self.out.push([TUPLE1, TUPLE2, TUPLE3][items.len() - 1]);
                    }
                    _ => {
                        self.out.push(MARK);
                        items.iter().for_each(|x| self.value(x));
                        self.out.push(TUPLE);
                    }
                }
                self.put();
            }
            Value::Dict(items) => {
                self.out.push(EMPTY_DICT);
                self.put();
                if let [(k, v)] = &items[..] {
                    self.value(k);
                    self.value(v);
                    self.out.push(SETITEM);
                    return;
                }
                for batch in items.chunks(BATCH) {
                    self.out.push(MARK);
                    for (k, v) in batch {
                        self.value(k);
                        self.value(v);
                    }
                    self.out.push(SETITEMS);
                }
            }
        }
    }

    fn str(&mut self, s: &str) {
        if let Some(&index) = self.strings.get(s) {
            self.get(index);
            return;
        }
        self.out.push(BINUNICODE);
        self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        self.out.extend_from_slice(s.as_bytes());
        let index = self.put();
        self.strings.insert(s.to_string(), index);
    }

    /// CPython's `save_long` at protocol 2.
    fn int(&mut self, i: i128) {
        if (0..=0xff).contains(&i) {
            self.out.extend_from_slice(&[BININT1, i as u8]);
        } else if (0..=0xffff).contains(&i) {
            self.out.push(BININT2);
            self.out.extend_from_slice(&(i as u16).to_le_bytes());
        } else if (i32::MIN as i128..=i32::MAX as i128).contains(&i) {
            self.out.push(BININT);
            self.out.extend_from_slice(&(i as i32).to_le_bytes());
        } else {
            let bytes = encode_long(i);
            self.out.extend_from_slice(&[LONG1, bytes.len() as u8]);
            self.out.extend_from_slice(&bytes);
        }
    }
}

/// CPython's `encode_long`: the shortest little-endian two's complement bytes of `x`.
fn encode_long(x: i128) -> Vec<u8> {
    if x == 0 {
        return Vec::new();
    }
    // Python's `bit_length` is that of `abs(x)`; one more byte holds the sign.
    let bit_length = 128 - x.unsigned_abs().leading_zeros() as usize;
    let nbytes = (bit_length >> 3) + 1;
    let mut full = x.to_le_bytes().to_vec();
    full.push(if x < 0 { 0xff } else { 0 });
    let mut result = full[..nbytes].to_vec();
    if x < 0 && nbytes > 1 && result[nbytes - 1] == 0xff && result[nbytes - 2] & 0x80 != 0 {
        result.pop();
    }
    result
}

/// Reads a pickle of plain data (the inverse of [`dumps`], and what CPython's `pickle.dumps`
/// writes for such values at protocols 2 to 5).
pub fn loads(data: &[u8]) -> Result<Value, PickleError> {
    read::loads(data)
}

/// Reads the pickle file at `path`; I/O errors and bad data as one error type for callers
/// that report both alike.
pub fn load(path: impl AsRef<std::path::Path>) -> Result<Value, LoadError> {
    let data = std::fs::read(path.as_ref()).map_err(|e| LoadError::Io(e.to_string()))?;
    loads(&data).map_err(LoadError::Pickle)
}

/// Why [`load`] failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The file could not be read.
    #[error("{0}")]
    Io(String),
    /// Its bytes are not a pickle of plain data.
    #[error(transparent)]
    Pickle(#[from] PickleError),
}

impl fmt::Display for Value {
    /// Close to Python's `repr` of the value (for messages).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let seq = |f: &mut fmt::Formatter<'_>, items: &[Value]| -> fmt::Result {
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{x}")?;
            }
            Ok(())
        };
        match self {
            Value::None => f.write_str("None"),
            Value::Bool(true) => f.write_str("True"),
            Value::Bool(false) => f.write_str("False"),
            Value::Int(i) => write!(f, "{i}"),
            Value::Float(x) => write!(f, "{x:?}"),
            Value::Str(s) => write!(f, "'{}'", s.replace('\\', "\\\\").replace('\'', "\\'")),
            Value::List(items) => {
                f.write_str("[")?;
                seq(f, items)?;
                f.write_str("]")
            }
            Value::Tuple(items) => {
                f.write_str("(")?;
                seq(f, items)?;
                f.write_str(if items.len() == 1 { ",)" } else { ")" })
            }
            Value::Dict(items) => {
                f.write_str("{")?;
                for (i, (k, v)) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}: {v}")?;
                }
                f.write_str("}")
            }
        }
    }
}

mod read;
#[cfg(test)]
mod tests;
