//! A memory snapshot read from its pickle value into types: PyTorch's `_snapshot()` structure
//! (`segments`, `device_traces`), as ember and PyTorch 2.x write it. Fields a drawing needs
//! (addresses, sizes, states, actions) are required and a missing one is an error naming its
//! place; the rest (requested sizes, streams, pool ids, frames) default, so snapshots of older
//! PyTorch versions and PyTorch's bare segment list (`torch.cuda.memory_snapshot()`) draw too.

use ember::pickle::Value;

/// A whole snapshot.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Snapshot {
    /// Every device's segments, in the file's order.
    pub segments: Vec<Segment>,
    /// Recorded events per device ordinal (empty lists for devices without events).
    pub device_traces: Vec<Vec<Event>>,
}

/// One driver segment and its blocks.
#[derive(Clone, Debug, PartialEq)]
pub struct Segment {
    /// Device ordinal.
    pub device: usize,
    /// Base address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Stream that owns it.
    pub stream: i128,
    /// "small" or "large".
    pub segment_type: String,
    /// Private pool id, (0, 0) for the default pools.
    pub pool_id: (i128, i128),
    /// Blocks in address order.
    pub blocks: Vec<Block>,
}

/// State of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Held by a tensor.
    ActiveAllocated,
    /// Freed, waiting on other streams' work.
    ActivePendingFree,
    /// Free, cached.
    Inactive,
}

impl BlockState {
    /// The snapshot's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }
}

/// One block of a segment.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// Address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes asked for (the size when the file does not say).
    pub requested_size: u64,
    /// Allocated, pending or free.
    pub state: BlockState,
    /// Where it was allocated, innermost first, as "file:line:function".
    pub frames: Vec<String>,
}

/// One recorded allocator event.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    /// "segment_map", "segment_unmap", "oom", "snapshot", or another name a newer PyTorch uses.
    pub action: String,
    /// Block or segment address; for "oom", the device's free bytes.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Stream.
    pub stream: i128,
    /// Microseconds (since the UNIX epoch in ember's files), 0 when absent.
    pub time_us: i128,
    /// Stack, innermost first, as "file:line:function".
    pub frames: Vec<String>,
}

fn field<'a>(v: &'a Value, key: &str, at: &str) -> Result<&'a Value, String> {
    v.get(key).ok_or_else(|| format!("{at} has no \"{key}\""))
}

fn uint(v: &Value, key: &str, at: &str) -> Result<u64, String> {
    let x = field(v, key, at)?
        .as_int()
        .ok_or_else(|| format!("{at}[\"{key}\"] is not an integer"))?;
    u64::try_from(x).map_err(|_| format!("{at}[\"{key}\"] = {x} is not a size or address"))
}

fn opt_int(v: &Value, key: &str) -> Option<i128> {
    v.get(key).and_then(Value::as_int)
}

fn list<'a>(v: &'a Value, key: &str, at: &str) -> Result<&'a [Value], String> {
    field(v, key, at)?
        .as_seq()
        .ok_or_else(|| format!("{at}[\"{key}\"] is not a list"))
}

/// "file:line:function" of each frame dict that has them.
fn frames(v: &Value) -> Vec<String> {
    v.get("frames")
        .and_then(Value::as_seq)
        .map_or_else(Vec::new, |fs| {
            fs.iter()
                .filter_map(|f| {
                    let file = f.get("filename")?.as_str()?;
                    let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
                    let line = f.get("line").and_then(Value::as_int).unwrap_or(0);
                    let file = file.rsplit('/').next().unwrap_or(file);
                    Some(format!("{file}:{line}:{name}"))
                })
                .collect()
        })
}

impl Snapshot {
    /// The snapshot in a pickle's value; the error says which field is missing or mistyped.
    pub fn from_value(v: &Value) -> Result<Snapshot, String> {
        let (segments, traces) = match v {
            Value::Dict(_) => (
                list(v, "segments", "the snapshot")?,
                match v.get("device_traces") {
                    Some(t) => t
                        .as_seq()
                        .ok_or("the snapshot's \"device_traces\" is not a list")?,
                    None => &[],
                },
            ),
            // torch.cuda.memory_snapshot(): the segments alone.
            Value::List(segments) => (&segments[..], &[][..]),
            other => return Err(format!("the file holds a {} value", type_name(other))),
        };
        let segments = segments
            .iter()
            .enumerate()
            .map(|(i, s)| Segment::from_value(s, &format!("segments[{i}]")))
            .collect::<Result<_, _>>()?;
        let device_traces = traces
            .iter()
            .enumerate()
            .map(|(d, t)| {
                let at = format!("device_traces[{d}]");
                t.as_seq()
                    .ok_or_else(|| format!("{at} is not a list"))?
                    .iter()
                    .enumerate()
                    .map(|(i, e)| Event::from_value(e, &format!("{at}[{i}]")))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<_, _>>()?;
        Ok(Snapshot {
            segments,
            device_traces,
        })
    }

    /// Device ordinals with segments or events, ascending.
    pub fn devices(&self) -> Vec<usize> {
        let mut d: Vec<usize> = self.segments.iter().map(|s| s.device).collect();
        d.extend((0..self.device_traces.len()).filter(|&i| !self.device_traces[i].is_empty()));
        d.sort_unstable();
        d.dedup();
        d
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::None => "None",
        Value::Bool(_) => "bool",
        Value::Int(_) => "int",
        Value::Float(_) => "float",
        Value::Str(_) => "str",
        Value::List(_) => "list",
        Value::Tuple(_) => "tuple",
        Value::Dict(_) => "dict",
    }
}

impl Segment {
    fn from_value(v: &Value, at: &str) -> Result<Segment, String> {
        let address = uint(v, "address", at)?;
        let mut next = address;
        let blocks = list(v, "blocks", at)?
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let at = format!("{at}[\"blocks\"][{i}]");
                let size = uint(b, "size", &at)?;
                // Old snapshots have no block addresses: blocks are back to back.
                let address = match b.get("address") {
                    Some(_) => uint(b, "address", &at)?,
                    None => next,
                };
                next = address.saturating_add(size);
                let state = match field(b, "state", &at)?.as_str() {
                    Some("active_allocated") => BlockState::ActiveAllocated,
                    Some("active_pending_free") => BlockState::ActivePendingFree,
                    Some("inactive") => BlockState::Inactive,
                    _ => return Err(format!("{at}[\"state\"] is not a block state")),
                };
                let requested_size = opt_int(b, "requested_size")
                    .and_then(|r| u64::try_from(r).ok())
                    .unwrap_or(size);
                Ok(Block {
                    address,
                    size,
                    requested_size,
                    state,
                    frames: frames(b),
                })
            })
            .collect::<Result<_, String>>()?;
        let pool_id = match v.get("segment_pool_id").and_then(Value::as_seq) {
            Some([a, b]) => (a.as_int().unwrap_or(0), b.as_int().unwrap_or(0)),
            _ => (0, 0),
        };
        Ok(Segment {
            device: opt_int(v, "device")
                .and_then(|d| usize::try_from(d).ok())
                .unwrap_or(0),
            address,
            total_size: uint(v, "total_size", at)?,
            stream: opt_int(v, "stream").unwrap_or(0),
            segment_type: v
                .get("segment_type")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string(),
            pool_id,
            blocks,
        })
    }
}

impl Event {
    fn from_value(v: &Value, at: &str) -> Result<Event, String> {
        let action = field(v, "action", at)?
            .as_str()
            .ok_or_else(|| format!("{at}[\"action\"] is not a string"))?
            .to_string();
        let addr_key = if action == "oom" { "device_free" } else { "addr" };
        let addr = match v.get(addr_key) {
            Some(_) => uint(v, addr_key, at)?,
            None if action == "snapshot" || action == "oom" => 0,
            None => return Err(format!("{at} has no \"{addr_key}\"")),
        };
        Ok(Event {
            addr,
            size: match v.get("size") {
                Some(_) => uint(v, "size", at)?,
                None if action == "snapshot" => 0,
                None => return Err(format!("{at} has no \"size\"")),
            },
            stream: opt_int(v, "stream").unwrap_or(0),
            time_us: opt_int(v, "time_us").unwrap_or(0),
            frames: frames(v),
            action,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(addr: u64, size: u64, state: &str) -> Value {
        Value::dict([
            ("address", addr.into()),
            ("size", size.into()),
            ("requested_size", size.into()),
            ("state", state.into()),
            ("frames", Value::List(vec![])),
        ])
    }

    #[test]
    fn reads_segments_blocks_and_events() {
        let v = Value::dict([
            (
                "segments",
                Value::List(vec![Value::dict([
                    ("device", 1.into()),
                    ("address", 4096u64.into()),
                    ("total_size", 3072u64.into()),
                    ("stream", 7.into()),
                    ("segment_type", "small".into()),
                    ("segment_pool_id", Value::Tuple(vec![0.into(), 3.into()])),
                    (
                        "blocks",
                        Value::List(vec![
                            block(4096, 1024, "active_allocated"),
                            block(5120, 2048, "inactive"),
                        ]),
                    ),
                ])]),
            ),
            (
                "device_traces",
                Value::List(vec![
                    Value::List(vec![]),
                    Value::List(vec![
                        Value::dict([
                            ("action", "alloc".into()),
                            ("addr", 4096u64.into()),
                            ("size", 1024u64.into()),
                            ("stream", 7.into()),
                            ("time_us", 5.into()),
                            (
                                "frames",
                                Value::List(vec![Value::dict([
                                    ("filename", "/src/train.py".into()),
                                    ("line", 12.into()),
                                    ("name", "step".into()),
                                ])]),
                            ),
                        ]),
                        Value::dict([
                            ("action", "oom".into()),
                            ("device_free", 10u64.into()),
                            ("size", 1u64.into()),
                        ]),
                    ]),
                ]),
            ),
        ]);
        let s = Snapshot::from_value(&v).unwrap();
        assert_eq!(s.devices(), vec![1]);
        let seg = &s.segments[0];
        assert_eq!(
            (seg.device, seg.stream, seg.pool_id, seg.blocks.len()),
            (1, 7, (0, 3), 2)
        );
        assert_eq!(seg.blocks[1].state, BlockState::Inactive);
        let e = &s.device_traces[1];
        assert_eq!(e[0].frames, vec!["train.py:12:step".to_string()]);
        assert_eq!((e[1].action.as_str(), e[1].addr), ("oom", 10));
    }

    #[test]
    fn errors_name_the_missing_field() {
        let no_segments = Value::dict([("device_traces", Value::List(vec![]))]);
        assert_eq!(
            Snapshot::from_value(&no_segments).unwrap_err(),
            "the snapshot has no \"segments\""
        );
        let bad_block = Value::dict([(
            "segments",
            Value::List(vec![Value::dict([
                ("address", 0.into()),
                ("total_size", 512.into()),
                (
                    "blocks",
                    Value::List(vec![Value::dict([
                        ("size", 512.into()),
                        ("state", "gone".into()),
                    ])]),
                ),
            ])]),
        )]);
        assert_eq!(
            Snapshot::from_value(&bad_block).unwrap_err(),
            "segments[0][\"blocks\"][0][\"state\"] is not a block state"
        );
        assert_eq!(
            Snapshot::from_value(&Value::Int(3)).unwrap_err(),
            "the file holds a int value"
        );
        // PyTorch's bare segment list, with blocks lacking addresses, reads.
        let bare = Value::List(vec![Value::dict([
            ("address", 1024.into()),
            ("total_size", 1024.into()),
            (
                "blocks",
                Value::List(vec![
                    Value::dict([("size", 512.into()), ("state", "inactive".into())]),
                    Value::dict([("size", 512.into()), ("state", "active_allocated".into())]),
                ]),
            ),
        ])]);
        let s = Snapshot::from_value(&bare).unwrap();
        assert_eq!(s.segments[0].blocks[1].address, 1536);
        assert!(s.device_traces.is_empty());
    }
}
