//! The pickle reader: CPython's unpickling machine for the plain-data opcodes.
//!
//! A memo entry is a reference, not a copy: CPython memoizes a list or dict when it is created,
//! empty, and fills it afterwards, and a later `BINGET` must see it filled (PyTorch's snapshots
//! share one `frames` list among many entries this way). So lists and dicts are built as shared
//! nodes and turned into [`Value`]s, copying what is shared, once `STOP` is reached. The copy is
//! bounded ([`MAX_VALUES`], [`MAX_DEPTH`]), so a small file whose memo references nest or repeat
//! cannot make it run away, and a container that contains itself is an error.

use super::*;
use std::cell::RefCell;
use std::rc::Rc;

/// Most values one pickle may expand to (copies of shared parts included).
const MAX_VALUES: usize = 1 << 24;
/// Deepest nesting of containers.
const MAX_DEPTH: usize = 1000;

#[derive(Clone)]
enum Node {
    Leaf(Value),
    List(Rc<RefCell<Vec<Node>>>),
    Tuple(Rc<Vec<Node>>),
    Dict(Rc<RefCell<Vec<(Node, Node)>>>),
}

pub(super) fn loads(data: &[u8]) -> Result<Value, PickleError> {
    loads_limited(data, MAX_VALUES)
}

/// [`loads`] expanding to at most `max_values` values.
pub(super) fn loads_limited(data: &[u8], max_values: usize) -> Result<Value, PickleError> {
    let mut r = Reader {
        data,
        at: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
    };
    let node = r.run()?;
    let mut budget = max_values;
    to_value(&node, 0, &mut budget).map_err(|what| PickleError::Malformed {
        offset: data.len(),
        what: what.into(),
    })
}

fn to_value(node: &Node, depth: usize, budget: &mut usize) -> Result<Value, &'static str> {
    if depth > MAX_DEPTH {
        return Err("containers nest too deep (or contain themselves)");
    }
    *budget = budget
        .checked_sub(1)
        .ok_or("the data expands to too many values (shared parts repeated)")?;
    let seq = |items: &[Node], budget: &mut usize| -> Result<Vec<Value>, &'static str> {
        items.iter().map(|n| to_value(n, depth + 1, budget)).collect()
    };
    Ok(match node {
        Node::Leaf(v) => v.clone(),
        Node::List(items) => Value::List(seq(&items.borrow(), budget)?),
        Node::Tuple(items) => Value::Tuple(seq(items, budget)?),
        Node::Dict(items) => Value::Dict(
            items
                .borrow()
                .iter()
                .map(|(k, v)| Ok((to_value(k, depth + 1, budget)?, to_value(v, depth + 1, budget)?)))
                .collect::<Result<_, &'static str>>()?,
        ),
    })
}

/// Whether two dict keys are equal (keys are strings, numbers or tuples of them).
fn same_key(a: &Node, b: &Node) -> bool {
    match (a, b) {
        (Node::Leaf(x), Node::Leaf(y)) => x == y,
        (Node::Tuple(x), Node::Tuple(y)) => {
            x.len() == y.len() && x.iter().zip(y.iter()).all(|(p, q)| same_key(p, q))
        }
        _ => false,
    }
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
    stack: Vec<Node>,
    /// Stack heights at each `MARK`.
    marks: Vec<usize>,
    memo: HashMap<u64, Node>,
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
        let mut it = items.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            // A repeated key replaces the value in place, as Python's dict does.
            match dict.iter_mut().rev().find(|(key, _)| same_key(key, &k)) {
                Some(slot) => slot.1 = v,
                None => dict.push((k, v)),
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
