//! The pickle reader: CPython's unpickling machine for the plain-data opcodes.
//!
//! A memo entry is a reference, not a copy: CPython memoizes a list or dict when it is created,
//! empty, and fills it afterwards, and a later `BINGET` must see it filled (PyTorch's snapshots
//! share one `frames` list among many entries this way). So lists and dicts are built as shared
//! nodes and turned into [`Value`]s, copying what is shared, once `STOP` is reached. The copy is
//! bounded ([`MAX_VALUES`], [`MAX_DEPTH`]), so a small file whose memo references nest or repeat
//! cannot make it run away, and a container that contains itself is an error.
//!
//! Whatever the bytes, reading costs time and memory in proportion to them: a node is dropped
//! without recursion (a file of a million nested lists must not overflow the stack when its
//! nodes are freed), the memo's containers are emptied at the end (so one that contains itself
//! is freed too), and a dict finds a repeated key through a hash of the key, not a scan of its
//! items (a dict of a million keys is not a trillion comparisons).

use super::*;
use std::cell::RefCell;
use std::rc::Rc;

/// Most values one pickle may expand to (copies of shared parts included).
const MAX_VALUES: usize = 1 << 24;
/// Most bytes of strings one pickle may expand to (copies of shared strings included): a
/// string read once and referenced a million times through nested memo references would
/// otherwise be copied a million times.
const MAX_STRING_BYTES: usize = 1 << 30;
/// Deepest nesting of containers.
const MAX_DEPTH: usize = 1000;

#[derive(Clone)]
enum Node {
    Leaf(Value),
    List(Rc<RefCell<Vec<Node>>>),
    Tuple(Rc<Vec<Node>>),
    Dict(Rc<RefCell<DictNode>>),
}

/// A dict's items in insertion order, and the items of each key hash ([`key_hash`]).
#[derive(Default)]
struct DictNode {
    items: Vec<(Node, Node)>,
    by_hash: HashMap<u64, Vec<usize>>,
}

impl Node {
    /// Moves the children of a container that nothing else holds into `out`, leaving it empty.
    fn take_children(&mut self, out: &mut Vec<Node>) {
        match self {
            Node::Leaf(_) => {}
            Node::List(items) => {
                if let Some(items) = Rc::get_mut(items) {
                    out.append(items.get_mut());
                }
            }
            Node::Tuple(items) => {
                if let Some(items) = Rc::get_mut(items) {
                    out.append(items);
                }
            }
            Node::Dict(dict) => {
                if let Some(dict) = Rc::get_mut(dict) {
                    for (k, v) in dict.get_mut().items.drain(..) {
                        out.push(k);
                        out.push(v);
                    }
                }
            }
        }
    }
}

impl Drop for Node {
    /// Frees a tree of nodes with a loop instead of recursion (the nesting is the file's).
    fn drop(&mut self) {
        let mut pending = Vec::new();
        self.take_children(&mut pending);
        while let Some(mut node) = pending.pop() {
            node.take_children(&mut pending);
        }
    }
}

pub(super) fn loads(data: &[u8]) -> Result<Value, PickleError> {
    loads_limited(data, MAX_VALUES, MAX_STRING_BYTES)
}

/// What copying the nodes into values may still spend.
struct Budget {
    values: usize,
    string_bytes: usize,
}

/// [`loads`] expanding to at most `max_values` values holding at most `max_string_bytes` of
/// strings.
pub(super) fn loads_limited(
    data: &[u8],
    max_values: usize,
    max_string_bytes: usize,
) -> Result<Value, PickleError> {
    let mut r = Reader {
        data,
        at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    let node = r.run()?;
    let mut budget = Budget {
        values: max_values,
        string_bytes: max_string_bytes,
    };
    to_value(&node, 0, &mut budget).map_err(|what| PickleError::Malformed {
        offset: data.len(),
        what: what.into(),
    })
}

fn to_value(node: &Node, depth: usize, budget: &mut Budget) -> Result<Value, &'static str> {
    if depth > MAX_DEPTH {
        return Err("containers nest too deep (or contain themselves)");
    }
    budget.values = budget
        .values
        .checked_sub(1)
        .ok_or("the data expands to too many values (shared parts repeated)")?;
    let seq = |items: &[Node], budget: &mut Budget| -> Result<Vec<Value>, &'static str> {
        items.iter().map(|n| to_value(n, depth + 1, budget)).collect()
    };
    Ok(match node {
        Node::Leaf(v) => {
            if let Value::Str(s) = v {
                budget.string_bytes = budget
                    .string_bytes
                    .checked_sub(s.len())
                    .ok_or("the data expands to too many bytes of strings (shared strings repeated)")?;
            }
            v.clone()
        }
        Node::List(items) => Value::List(seq(&items.borrow(), budget)?),
        Node::Tuple(items) => Value::Tuple(seq(items, budget)?),
        Node::Dict(dict) => Value::Dict(
            dict.borrow()
                .items
                .iter()
                .map(|(k, v)| Ok((to_value(k, depth + 1, budget)?, to_value(v, depth + 1, budget)?)))
                .collect::<Result<_, &'static str>>()?,
        ),
    })
}

/// Whether two dict keys are equal (keys are strings, numbers or tuples of them; a key nested
/// deeper than [`MAX_DEPTH`] equals nothing, and the file is refused when it is copied).
fn same_key(a: &Node, b: &Node, depth: usize) -> bool {
    match (a, b) {
        (Node::Leaf(x), Node::Leaf(y)) => x == y,
        (Node::Tuple(x), Node::Tuple(y)) => {
            depth < MAX_DEPTH
                && x.len() == y.len()
                && x.iter().zip(y.iter()).all(|(p, q)| same_key(p, q, depth + 1))
        }
        _ => false,
    }
}

/// A hash equal for keys that [`same_key`] finds equal.
fn key_hash(key: &Node) -> u64 {
    use std::hash::{Hash, Hasher};
    fn feed(node: &Node, depth: usize, h: &mut std::collections::hash_map::DefaultHasher) {
        match node {
            Node::Leaf(v) => match v {
                Value::None => 0u8.hash(h),
                Value::Bool(b) => (1u8, b).hash(h),
                Value::Int(i) => (2u8, i).hash(h),
                // 0.0 == -0.0; NaN equals nothing, so its bits may hash as they are.
                Value::Float(f) => (3u8, if *f == 0.0 { 0 } else { f.to_bits() }).hash(h),
                Value::Str(s) => (4u8, s).hash(h),
                // Containers are never equal keys: any hash will do.
                Value::List(_) | Value::Tuple(_) | Value::Dict(_) => 5u8.hash(h),
            },
            Node::Tuple(items) if depth < MAX_DEPTH => {
                (6u8, items.len()).hash(h);
                items.iter().for_each(|n| feed(n, depth + 1, h));
            }
            _ => 7u8.hash(h),
        }
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    feed(key, 0, &mut h);
    h.finish()
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
    stack: Vec<Node>,
    /// Stack heights at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u64, Node>,
}

impl Drop for Reader<'_> {
    /// Empties every memoized container: a container that contains itself (through a memo
    /// reference) is then freed like any other. Its value, if any, was copied out before.
    fn drop(&mut self) {
        for node in self.memo.values() {
            let children = match node {
                Node::List(items) => std::mem::take(&mut *items.borrow_mut()),
                Node::Dict(dict) => {
                    let items = std::mem::take(&mut dict.borrow_mut().items);
                    items.into_iter().flat_map(|(k, v)| [k, v]).collect()
                }
                Node::Leaf(_) | Node::Tuple(_) => continue,
            };
            drop(children);
        }
    }
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PickleError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&e| e <= self.data.len())
            .ok_or(PickleError::Truncated {
                offset: self.data.len(),
            })?;
        let bytes = &self.data[self.at..end];
        self.at = end;
        Ok(bytes)
    }

    fn byte(&mut self) -> Result<u8, PickleError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    fn u64(&mut self) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    fn malformed(&self, what: impl Into<String>) -> PickleError {
        PickleError::Malformed {
            offset: self.at,
            what: what.into(),
        }
    }

    fn push(&mut self, v: Value) {
        self.stack.push(Node::Leaf(v));
    }

    fn pop(&mut self) -> Result<Node, PickleError> {
        self.stack.pop().ok_or_else(|| self.malformed("stack underflow"))
    }

    /// The values pushed since the last `MARK`, popping the mark.
    fn pop_mark(&mut self) -> Result<Vec<Node>, PickleError> {
        let height = self.marks.pop().ok_or_else(|| self.malformed("no MARK"))?;
        if height > self.stack.len() {
            return Err(self.malformed("MARK above the stack"));
        }
        Ok(self.stack.split_off(height))
    }

    fn str(&mut self, n: usize) -> Result<(), PickleError> {
        let bytes = self.take(n)?;
        let s =
            std::str::from_utf8(bytes).map_err(|e| self.malformed(format!("string is not UTF-8: {e}")))?;
        self.push(Value::Str(s.to_string()));
        Ok(())
    }

    fn long(&mut self, n: usize) -> Result<(), PickleError> {
        let bytes = self.take(n)?;
        if n > 16 {
            return Err(self.malformed(format!("integer of {n} bytes is wider than 128 bits")));
        }
        let fill = if bytes.last().is_some_and(|b| b & 0x80 != 0) {
            0xff
        } else {
            0
        };
        let mut full = [fill; 16];
        full[..n].copy_from_slice(bytes);
        self.push(Value::Int(i128::from_le_bytes(full)));
        Ok(())
    }

    fn top(&self) -> Result<&Node, PickleError> {
        self.stack.last().ok_or_else(|| self.malformed("stack underflow"))
    }

    fn extend_list(&mut self, items: Vec<Node>) -> Result<(), PickleError> {
        match self.top()? {
            Node::List(list) => {
                list.borrow_mut().extend(items);
                Ok(())
            }
            _ => Err(self.malformed("APPEND to a value that is not a list")),
        }
    }

    fn extend_dict(&mut self, items: Vec<Node>) -> Result<(), PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.malformed("odd number of dict items"));
        }
        let Node::Dict(dict) = self.top()? else {
            return Err(self.malformed("SETITEM on a value that is not a dict"));
        };
        let mut dict = dict.borrow_mut();
        let dict = &mut *dict;
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            // A repeated key replaces the value in place, as Python's dict does.
            let same = dict.by_hash.entry(key_hash(&k)).or_default();
            match same.iter().find(|&&i| same_key(&dict.items[i].0, &k, 0)) {
                Some(&i) => dict.items[i].1 = v,
                None => {
                    same.push(dict.items.len());
                    dict.items.push((k, v));
                }
            }
        }
        Ok(())
    }

    fn memo_put(&mut self, key: u64) -> Result<(), PickleError> {
        let top = self.top()?.clone();
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<(), PickleError> {
        let v = self
            .memo
            .get(&key)
            .cloned()
            .ok_or_else(|| self.malformed(format!("unknown memo key {key}")))?;
        self.stack.push(v);
        Ok(())
    }

    fn run(&mut self) -> Result<Node, PickleError> {
        loop {
            let offset = self.at;
            let op = self.byte()?;
            match op {
                PROTO => {
                    let version = self.byte()?;
                    if version > 5 {
                        return Err(self.malformed(format!("pickle protocol {version} is newer than 5")));
                    }
                }
                FRAME => {
                    self.take(8)?;
                }
                STOP => {
                    let v = self.pop()?;
                    if !self.stack.is_empty() || !self.marks.is_empty() {
                        return Err(self.malformed("values left on the stack at STOP"));
                    }
                    if self.at != self.data.len() {
                        return Err(self.malformed("data after STOP"));
                    }
                    return Ok(v);
                }
                MARK => self.marks.push(self.stack.len()),
                NONE => self.push(Value::None),
                NEWTRUE => self.push(Value::Bool(true)),
                NEWFALSE => self.push(Value::Bool(false)),
                BININT => {
                    let v = i32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"));
                    self.push(Value::Int(v as i128));
                }
                BININT1 => {
                    let v = self.byte()?;
                    self.push(Value::Int(v as i128));
                }
                BININT2 => {
                    let v = u16::from_le_bytes(self.take(2)?.try_into().expect("2 bytes"));
                    self.push(Value::Int(v as i128));
                }
                LONG1 => {
                    let n = self.byte()? as usize;
                    self.long(n)?;
                }
                LONG4 => {
                    let n = self.u32()? as usize;
                    self.long(n)?;
                }
                BINFLOAT => {
                    let v = f64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes"));
                    self.push(Value::Float(v));
                }
                BINUNICODE => {
                    let n = self.u32()? as usize;
                    self.str(n)?;
                }
                SHORT_BINUNICODE => {
                    let n = self.byte()? as usize;
                    self.str(n)?;
                }
                BINUNICODE8 => {
                    let n = usize::try_from(self.u64()?).map_err(|_| self.malformed("string too long"))?;
                    self.str(n)?;
                }
                EMPTY_LIST => self.stack.push(Node::List(Rc::default())),
                APPEND => {
                    let v = self.pop()?;
                    self.extend_list(vec![v])?;
                }
                APPENDS => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                EMPTY_DICT => self.stack.push(Node::Dict(Rc::default())),
                SETITEM => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.extend_dict(vec![k, v])?;
                }
                SETITEMS => {
                    let items = self.pop_mark()?;
                    self.extend_dict(items)?;
                }
                EMPTY_TUPLE => self.stack.push(Node::Tuple(Rc::default())),
                TUPLE => {
                    let items = self.pop_mark()?;
                    self.stack.push(Node::Tuple(Rc::new(items)));
                }
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let n = (op - TUPLE1 + 1) as usize;
                    if self.stack.len() < n {
                        return Err(self.malformed("stack underflow"));
                    }
                    let items = self.stack.split_off(self.stack.len() - n);
                    self.stack.push(Node::Tuple(Rc::new(items)));
                }
                BINPUT => {
                    let key = self.byte()? as u64;
                    self.memo_put(key)?;
                }
                LONG_BINPUT => {
                    let key = self.u32()? as u64;
                    self.memo_put(key)?;
                }
                MEMOIZE => {
                    let key = self.memo.len() as u64;
                    self.memo_put(key)?;
                }
                BINGET => {
                    let key = self.byte()? as u64;
                    self.memo_get(key)?;
                }
                LONG_BINGET => {
                    let key = self.u32()? as u64;
                    self.memo_get(key)?;
                }
                opcode => return Err(PickleError::Unsupported { opcode, offset }),
            }
        }
    }
}
