//! The active-memory timeline of one device, as PyTorch's `trace_plot` draws it: every
//! allocation is a band whose height is its size, stacked in allocation order; when one is
//! freed, the bands above it slide down over one step. The x axis counts allocation events
//! (each `alloc` and `free_completed` is one step), not time, so bursts stay readable.
//!
//! Allocations alive before recording began (freed in the trace without an `alloc`, or active
//! in the snapshot's segments) sit at the bottom from the start. With more than
//! [`MAX_BANDS`] allocations, those of largest area (size times lifetime) are drawn one by one
//! and the rest are summed into one band on top of them. Reserved memory (segments) is a step line from `segment_alloc` /
//! `segment_free` (and `segment_map` / `segment_unmap`), its start derived from the snapshot's
//! segments; `oom` events are marks.
//!
//! Sizes come from the file, which may be corrupt: sums and differences of them saturate at
//! `u64::MAX` and 0 rather than overflow (such a file draws wrong, never panics), and the work
//! is linear in the trace.

use super::snapshot::{BlockState, Event, Snapshot};
use std::collections::HashMap;

/// Allocations drawn as bands of their own; the others (of smaller size times lifetime) are
/// summed into one band.
pub const MAX_BANDS: usize = 1000;

/// One allocation's band.
#[derive(Clone, Debug, PartialEq)]
pub struct Band {
    /// Address.
    pub addr: u64,
    /// Bytes (its height).
    pub size: u64,
    /// Index of its `alloc` event in the trace; None when allocated before recording began.
    pub alloc_event: Option<usize>,
    /// Index of its `free_completed` event; None when still alive at the end.
    pub free_event: Option<usize>,
    /// (x, offset of the band's bottom), linear in between; the first is where it starts.
    pub points: Vec<(f64, u64)>,
    /// Where it ends.
    pub end_x: f64,
    /// Its allocation's stack, innermost first.
    pub frames: Vec<String>,
}

/// The drawing of one device's trace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// The bands, in allocation order (earliest at the bottom).
    pub bands: Vec<Band>,
    /// Summed small allocations on top of the bands: (x, bottom, top), linear in between.
    pub summarized: Vec<(f64, u64, u64)>,
    /// Allocations in `summarized`.
    pub summarized_count: usize,
    /// Reserved bytes from x on (a step line).
    pub reserved: Vec<(f64, u64)>,
    /// (x, requested bytes) of each out-of-memory event.
    pub ooms: Vec<(f64, u64)>,
    /// Width of the x axis.
    pub x_max: f64,
    /// Largest of active and reserved bytes over the trace (at least 1).
    pub y_max: u64,
    /// Largest active bytes over the trace.
    pub peak_active: u64,
}

enum Live {
    Band(usize),
    Small(u64),
}

/// The timeline of `device`'s trace in `snap`.
pub fn timeline(snap: &Snapshot, device: usize) -> Timeline {
    let events: &[Event] = snap.device_traces.get(device).map_or(&[], |t| &t[..]);
    // Pass 1: allocations alive before the trace began (bottom of the stack, in address
    // order) and each allocation's lifetime in events, to choose which get a band.
    let mut open: HashMap<u64, usize> = HashMap::new(); // addr -> its alloc event
    let mut alloc_end: HashMap<usize, usize> = HashMap::new(); // alloc event -> free event
    let mut before: Vec<(u64, u64, usize)> = Vec::new(); // addr, size, free event
    for (i, e) in events.iter().enumerate() {
        match e.action.as_str() {
            "alloc" => {
                open.insert(e.addr, i);
            }
            "free_completed" => match open.remove(&e.addr) {
                Some(start) => {
                    alloc_end.insert(start, i);
                }
                None => before.push((e.addr, e.size, i)),
            },
            _ => {}
        }
    }
    let mut freed_before: std::collections::HashSet<u64> = before.iter().map(|&(a, _, _)| a).collect();
    for seg in snap.segments.iter().filter(|s| s.device == device) {
        for b in seg.blocks.iter().filter(|b| b.state != BlockState::Inactive) {
            if !open.contains_key(&b.address) && freed_before.insert(b.address) {
                before.push((b.address, b.size, events.len()));
            }
        }
    }
    before.sort_unstable();

    // Which allocations get a band: the MAX_BANDS of largest area (size times lifetime), so
    // what shows on the plot is drawn and a crowd of short-lived ones is summed.
    let mut areas: Vec<(u128, usize)> = before
        .iter()
        .enumerate()
        .map(|(i, &(_, size, end))| (size as u128 * (end as u128 + 1), i))
        .collect();
    areas.extend(
        events
            .iter()
            .enumerate()
            .filter(|(_, e)| e.action == "alloc")
            .map(|(i, e)| {
                let end = alloc_end.get(&i).copied().unwrap_or(events.len());
                (e.size as u128 * (end - i + 1) as u128, before.len() + i)
            }),
    );
    let individual: std::collections::HashSet<usize> = if areas.len() > MAX_BANDS {
        areas.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        areas[..MAX_BANDS].iter().map(|&(_, i)| i).collect()
    } else {
        areas.iter().map(|&(_, i)| i).collect()
    };

    // Pass 2: the stack.
    let mut t = Timeline::default();
    let mut stack: Vec<usize> = Vec::new(); // band ids, bottom first
    let mut offsets: Vec<u64> = Vec::new(); // current bottom of each band, by id
    let mut live: HashMap<u64, Live> = HashMap::new();
    let (mut big, mut small) = (0u64, 0u64);
    let mut x = 0.0f64;
    for (i, &(addr, size, _)) in before.iter().enumerate() {
        if individual.contains(&i) {
            live.insert(addr, Live::Band(t.bands.len()));
            stack.push(t.bands.len());
            offsets.push(big);
            t.bands.push(Band {
                addr,
                size,
                alloc_event: None,
                free_event: None,
                points: vec![(0.0, big)],
                end_x: 0.0,
                frames: Vec::new(),
            });
            big = big.saturating_add(size);
        } else {
            live.insert(addr, Live::Small(size));
            small = small.saturating_add(size);
            t.summarized_count += 1;
        }
    }
    let segment_bytes: u64 = snap
        .segments
        .iter()
        .filter(|s| s.device == device)
        .fold(0u64, |sum, s| sum.saturating_add(s.total_size));
    let net: i128 = events
        .iter()
        .map(|e| match e.action.as_str() {
            "segment_alloc" | "segment_map" => e.size as i128,
            "segment_free" | "segment_unmap" => -(e.size as i128),
            _ => 0,
        })
        .sum();
    let mut reserved = (segment_bytes as i128 - net).clamp(0, u64::MAX as i128) as u64;
    t.reserved.push((0.0, reserved));
    let active = |big: u64, small: u64| big.saturating_add(small);
    t.summarized.push((0.0, big, active(big, small)));
    t.peak_active = active(big, small);
    let mut y_max = reserved.max(active(big, small));
    for (i, e) in events.iter().enumerate() {
        match e.action.as_str() {
            "alloc" => {
                if individual.contains(&(before.len() + i)) {
                    live.insert(e.addr, Live::Band(t.bands.len()));
                    stack.push(t.bands.len());
                    offsets.push(big);
                    t.bands.push(Band {
                        addr: e.addr,
                        size: e.size,
                        alloc_event: Some(i),
                        free_event: None,
                        points: vec![(x, big)],
                        end_x: x,
                        frames: e.frames.clone(),
                    });
                    big = big.saturating_add(e.size);
                } else {
                    live.insert(e.addr, Live::Small(e.size));
                    small = small.saturating_add(e.size);
                    t.summarized_count += 1;
                }
                t.summarized.push((x, big, active(big, small)));
                x += 1.0;
            }
            "free_completed" => match live.remove(&e.addr) {
                Some(Live::Band(id)) => {
                    let pos = stack
                        .iter()
                        .rposition(|&b| b == id)
                        .expect("a live band is on the stack");
                    stack.remove(pos);
                    let size = t.bands[id].size;
                    t.bands[id].free_event = Some(i);
                    t.bands[id].end_x = x;
                    for &above in &stack[pos..] {
                        let off = offsets[above];
                        let band = &mut t.bands[above];
                        band.points.push((x, off));
                        band.points.push((x + 1.0, off.saturating_sub(size)));
                        offsets[above] = off.saturating_sub(size);
                    }
                    t.summarized.push((x, big, active(big, small)));
                    big = big.saturating_sub(size);
                    t.summarized.push((x + 1.0, big, active(big, small)));
                    x += 1.0;
                }
                Some(Live::Small(size)) => {
                    small = small.saturating_sub(size);
                    t.summarized.push((x, big, active(big, small)));
                    x += 1.0;
                }
                None => {}
            },
            "segment_alloc" | "segment_map" => {
                reserved = reserved.saturating_add(e.size);
                t.reserved.push((x, reserved));
            }
            "segment_free" | "segment_unmap" => {
                reserved = reserved.saturating_sub(e.size);
                t.reserved.push((x, reserved));
            }
            "oom" => t.ooms.push((x, e.size)),
            _ => {}
        }
        t.peak_active = t.peak_active.max(active(big, small));
        y_max = y_max.max(active(big, small)).max(reserved);
    }
    t.x_max = x.max(1.0);
    for &id in &stack {
        t.bands[id].end_x = t.x_max;
    }
    t.summarized.push((t.x_max, big, active(big, small)));
    t.reserved.push((t.x_max, reserved));
    t.y_max = y_max.max(1);
    t
}

#[cfg(test)]
mod tests {
    use super::super::snapshot::{Block, Segment};
    use super::*;

    fn ev(action: &str, addr: u64, size: u64) -> Event {
        Event {
            action: action.into(),
            addr,
            size,
            stream: 0,
            time_us: 0,
            frames: vec![],
        }
    }

    fn snap(events: Vec<Event>, segments: Vec<Segment>) -> Snapshot {
        Snapshot {
            segments,
            device_traces: vec![events],
        }
    }

    #[test]
    fn bands_above_a_freed_allocation_slide_down() {
        let s = snap(
            vec![
                ev("segment_alloc", 0, 1000),
                ev("alloc", 0, 100),
                ev("alloc", 100, 50),
                ev("free_requested", 0, 100),
                ev("free_completed", 0, 100),
                ev("alloc", 200, 10),
                ev("oom", 5, 5000),
            ],
            vec![],
        );
        let t = timeline(&s, 0);
        assert_eq!(t.bands.len(), 3);
        assert_eq!(t.bands[0].points, vec![(0.0, 0)]);
        assert_eq!(
            (t.bands[0].alloc_event, t.bands[0].free_event, t.bands[0].end_x),
            (Some(1), Some(4), 2.0)
        );
        assert_eq!(t.bands[1].points, vec![(1.0, 100), (2.0, 100), (3.0, 0)]);
        assert_eq!((t.bands[1].end_x, t.bands[2].points[0]), (4.0, (3.0, 50)));
        assert_eq!(t.peak_active, 150);
        assert_eq!(t.ooms, vec![(4.0, 5000)]);
        // The segment came in the trace: nothing reserved before it, 1000 after (the snapshot
        // lists no segments, so the start is clamped at 0).
        assert_eq!(t.reserved.first(), Some(&(0.0, 0)));
        assert_eq!(t.reserved[1], (0.0, 1000));
        assert_eq!(t.y_max, 1000);
    }

    #[test]
    fn allocations_from_before_the_trace_sit_at_the_bottom() {
        let seg = Segment {
            device: 0,
            address: 0,
            total_size: 4096,
            stream: 0,
            segment_type: "small".into(),
            pool_id: (0, 0),
            blocks: vec![
                Block {
                    address: 0,
                    size: 1024,
                    requested_size: 1000,
                    state: BlockState::ActiveAllocated,
                    frames: vec![],
                },
                Block {
                    address: 1024,
                    size: 3072,
                    requested_size: 0,
                    state: BlockState::Inactive,
                    frames: vec![],
                },
            ],
        };
        // 2048 was allocated before recording and is freed in it; 0 lives throughout.
        let s = snap(
            vec![ev("free_completed", 2048, 512), ev("alloc", 1024, 512)],
            vec![seg],
        );
        let t = timeline(&s, 0);
        let starts: Vec<(u64, Option<usize>, f64)> = t
            .bands
            .iter()
            .map(|b| (b.addr, b.alloc_event, b.points[0].0))
            .collect();
        assert_eq!(
            starts,
            vec![(0, None, 0.0), (2048, None, 0.0), (1024, Some(1), 1.0)]
        );
        assert_eq!(t.bands[0].end_x, t.x_max);
        assert_eq!(t.peak_active, 1536);
        assert_eq!(t.reserved[0], (0.0, 4096));
    }

    #[test]
    fn past_max_bands_the_smallest_are_summed_on_top() {
        // The first ten are small and long-lived, the rest 1 MiB: the ten have the smallest
        // areas even though the last allocations live for one or two steps only.
        let size = |i: u64| if i < 10 { 512 } else { 1 << 20 };
        let mut events: Vec<Event> = (0..MAX_BANDS as u64 + 10)
            .map(|i| ev("alloc", i * (2 << 20), size(i)))
            .collect();
        events.push(ev("free_completed", 0, 512)); // a summarized one
        let t = timeline(&snap(events, vec![]), 0);
        assert_eq!((t.bands.len(), t.summarized_count), (MAX_BANDS, 10));
        assert!(t.bands.iter().all(|b| b.size == 1 << 20));
        let &(_, bottom, top) = t.summarized.last().unwrap();
        assert_eq!(top - bottom, 9 * 512);
    }

    #[test]
    fn an_empty_trace_draws_nothing() {
        let t = timeline(&Snapshot::default(), 3);
        assert!(t.bands.is_empty() && t.ooms.is_empty());
        assert_eq!((t.x_max, t.y_max, t.peak_active), (1.0, 1, 0));
    }
}
