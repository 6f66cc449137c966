//! The memviz page: one HTML file with inline CSS and SVG (no script, nothing fetched), so it
//! opens anywhere, offline, and prints. Per device: a summary line, the active-memory timeline
//! (`timeline.rs`'s bands, the reserved line, OOM marks, byte and event axes) and the segment
//! map (one row per segment, its blocks coloured by state). Hovering a band or a block shows
//! its details (SVG `<title>`).
//!
//! Layout contract (the CLI test screenshots it): the header is [`HEADER_PX`] tall and the
//! first device's timeline follows it at once, [`TIMELINE_W`] x [`TIMELINE_H`] pixels, its
//! plot area inset by [`PLOT_LEFT`], [`PLOT_TOP`], [`PLOT_RIGHT`], [`PLOT_BOTTOM`]. Page and
//! plot background are white; bands use saturated colours; axes and text are grey or black.

use super::snapshot::{BlockState, Segment, Snapshot};
use super::timeline::{timeline, Band, Timeline, MAX_BANDS};
use std::fmt::Write;

/// Height of the page header (title and legend), pixels.
pub const HEADER_PX: u32 = 96;
/// Size of a timeline's SVG, pixels.
pub const TIMELINE_W: u32 = 1160;
/// Size of a timeline's SVG, pixels.
pub const TIMELINE_H: u32 = 380;
/// Insets of the plot area inside a timeline's SVG, pixels.
pub const PLOT_LEFT: u32 = 84;
/// Insets of the plot area inside a timeline's SVG, pixels.
pub const PLOT_TOP: u32 = 12;
/// Insets of the plot area inside a timeline's SVG, pixels.
pub const PLOT_RIGHT: u32 = 16;
/// Insets of the plot area inside a timeline's SVG, pixels.
pub const PLOT_BOTTOM: u32 = 36;

/// Segment rows drawn per device (the rest are counted).
const MAX_SEGMENT_ROWS: usize = 400;

/// Band colours (Tableau 10, its grey replaced), by allocation order.
const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
    "#d37295",
];
const SUMMARIZED: &str = "#8c9ad6";
const ALLOCATED: [&str; 2] = ["#4e79a7", "#7fa6d1"];
const PENDING: &str = "#f28e2b";
const INACTIVE: &str = "#e4e4e4";

const STYLE: &str = "
body { margin: 0; font: 13px/1.4 system-ui, -apple-system, 'Segoe UI', sans-serif; color: #222; background: #fff; }
header { box-sizing: border-box; padding: 10px 20px 0; overflow: hidden; border-bottom: 1px solid #ddd; }
h1 { font-size: 18px; margin: 0 0 4px; }
h2 { font-size: 15px; margin: 18px 20px 4px; }
p { margin: 2px 20px; }
.note { color: #666; }
.legend span { display: inline-block; margin-right: 14px; }
.legend i { display: inline-block; width: 11px; height: 11px; margin-right: 4px; vertical-align: -1px; border: 1px solid #999; }
svg { display: block; margin: 0 20px; }
svg text { font: 11px system-ui, sans-serif; fill: #444; }
";

/// The page for `snap`, titled with `name` (the snapshot's file name).
pub fn render(snap: &Snapshot, name: &str) -> String {
    let mut devices = snap.devices();
    if devices.is_empty() {
        devices.push(0);
    }
    let mut h = String::new();
    let _ = write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>ember memviz: {}</title>\n\
         <style>{STYLE}header {{ height: {HEADER_PX}px; }}\n</style>\n</head>\n<body>\n<header>\n\
         <h1>Memory snapshot <code>{}</code></h1>\n",
        esc(name),
        esc(name)
    );
    let events: usize = snap.device_traces.iter().map(Vec::len).sum();
    let _ = writeln!(
        h,
        "<p>{} segment{} on {} device{}; {} trace event{}. Hover a band or a block for its details.</p>",
        snap.segments.len(),
        plural(snap.segments.len()),
        devices.len(),
        plural(devices.len()),
        events,
        plural(events)
    );
    h += "<p class=\"legend\">";
    for (colour, what) in [
        (PALETTE[0], "allocation (one colour each)"),
        (SUMMARIZED, "other allocations, summed"),
        (PENDING, "freed, pending other streams"),
        (INACTIVE, "cached, free"),
    ] {
        let _ = write!(h, "<span><i style=\"background:{colour}\"></i>{what}</span>");
    }
    h += "<span>- - - reserved</span><span style=\"color:#d62728\">| out of memory</span></p>\n</header>\n";
    for &d in &devices {
        let t = timeline(snap, d);
        let segs: Vec<&Segment> = snap.segments.iter().filter(|s| s.device == d).collect();
        let events = snap.device_traces.get(d).map_or(0, Vec::len);
        let _ = writeln!(h, "<section id=\"cuda{d}\">");
        let _ = writeln!(h, "<h2>cuda:{d}: active memory timeline</h2>");
        timeline_svg(&mut h, &t, d, events);
        device_summary(&mut h, &t, &segs, events);
        let _ = writeln!(h, "<h2>cuda:{d}: segments</h2>");
        segment_map(&mut h, &segs);
        h += "</section>\n";
    }
    h += "</body>\n</html>\n";
    h
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// HTML-escaped text.
fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out += "&amp;",
            '<' => out += "&lt;",
            '>' => out += "&gt;",
            '"' => out += "&quot;",
            '\'' => out += "&#39;",
            c => out.push(c),
        }
    }
    out
}

/// Bytes in binary units ("512 B", "1.50 MiB").
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut v = bytes as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.2} {}", UNITS[unit])
}

fn device_summary(h: &mut String, t: &Timeline, segs: &[&Segment], events: usize) {
    let bytes = |keep: fn(BlockState) -> bool| -> u64 {
        segs.iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| keep(b.state))
            .fold(0u64, |sum, b| sum.saturating_add(b.size))
    };
    let reserved = segs.iter().fold(0u64, |sum, s| sum.saturating_add(s.total_size));
    let allocated = bytes(|s| s == BlockState::ActiveAllocated);
    let active = bytes(|s| s != BlockState::Inactive);
    let _ = write!(
        h,
        "<p>At the snapshot: {} segment{}, reserved {}, allocated {}, active {}. Trace: {} event{}, peak \
         active {}",
        segs.len(),
        plural(segs.len()),
        format_bytes(reserved),
        format_bytes(allocated),
        format_bytes(active),
        events,
        plural(events),
        format_bytes(t.peak_active)
    );
    if !t.ooms.is_empty() {
        let _ = write!(
            h,
            ", {} out-of-memory error{}",
            t.ooms.len(),
            plural(t.ooms.len())
        );
    }
    if t.summarized_count > 0 {
        let _ = write!(
            h,
            "; the {MAX_BANDS} allocations of largest size times lifetime are drawn one by one, the {} \
             others summed on top",
            t.summarized_count
        );
    }
    h.push_str(".</p>\n");
}

/// A "nice" step (1, 2 or 5 times a power of ten) giving at most about `n` ticks over `span`.
fn decimal_step(span: f64, n: f64) -> f64 {
    let raw = (span / n).max(1.0);
    let pow = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * pow)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * pow)
}

/// A byte step (1, 2 or 5 times a power of 1024 unit... as 2^k) giving at most about `n` ticks.
fn byte_step(span: u64, n: u64) -> u64 {
    (span / n).max(1).checked_next_power_of_two().unwrap_or(1 << 63)
}

fn timeline_svg(h: &mut String, t: &Timeline, device: usize, events: usize) {
    let (w, ht) = (TIMELINE_W as f64, TIMELINE_H as f64);
    let (l, top) = (PLOT_LEFT as f64, PLOT_TOP as f64);
    let pw = w - l - PLOT_RIGHT as f64;
    let ph = ht - top - PLOT_BOTTOM as f64;
    let px = |x: f64| l + x / t.x_max * pw;
    // 5% headroom keeps the top of the reserved line off the plot's frame.
    let y_span = t.y_max as f64 * 1.05;
    let py = |b: u64| top + ph - b as f64 / y_span * ph;
    let _ = writeln!(
        h,
        "<svg id=\"timeline{device}\" class=\"timeline\" width=\"{w}\" height=\"{ht}\" viewBox=\"0 0 {w} {ht}\" \
         xmlns=\"http://www.w3.org/2000/svg\">"
    );
    // Axes and grid.
    let step = byte_step(t.y_max, 6);
    let mut y = 0;
    while y <= t.y_max {
        let yy = py(y);
        let _ = writeln!(
            h,
            "<line x1=\"{l}\" x2=\"{:.1}\" y1=\"{yy:.1}\" y2=\"{yy:.1}\" stroke=\"#eee\"/>\
             <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>",
            l + pw,
            l - 6.0,
            yy + 4.0,
            format_bytes(y).replace(".00 ", " ")
        );
        match y.checked_add(step) {
            Some(next) => y = next,
            None => break,
        }
    }
    let xstep = decimal_step(t.x_max, 10.0);
    let mut x = 0.0;
    // The last label stays clear of the right edge.
    while x <= t.x_max && (x == 0.0 || px(x) < l + pw - 24.0) {
        let _ = writeln!(
            h,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{x}</text>",
            px(x),
            top + ph + 16.0
        );
        x += xstep;
    }
    let _ = writeln!(
        h,
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">allocation events (alloc and free)</text>",
        l + pw / 2.0,
        top + ph + 32.0
    );
    // Bands.
    for (i, b) in t.bands.iter().enumerate() {
        band(h, b, i, &px, &py);
    }
    if t.summarized_count > 0 {
        let mut pts = String::new();
        for &(x, _, top_b) in &t.summarized {
            let _ = write!(pts, "{:.1},{:.1} ", px(x), py(top_b));
        }
        for &(x, bottom, _) in t.summarized.iter().rev() {
            let _ = write!(pts, "{:.1},{:.1} ", px(x), py(bottom));
        }
        let _ = writeln!(
            h,
            "<polygon points=\"{}\" fill=\"{SUMMARIZED}\"><title>{} other allocations (smaller size times \
             lifetime), summed</title></polygon>",
            pts.trim_end(),
            t.summarized_count
        );
    }
    // Reserved memory, as a step line.
    let mut pts = String::new();
    let mut last: Option<u64> = None;
    for &(x, r) in &t.reserved {
        if let Some(prev) = last {
            let _ = write!(pts, "{:.1},{:.1} ", px(x), py(prev));
        }
        let _ = write!(pts, "{:.1},{:.1} ", px(x), py(r));
        last = Some(r);
    }
    let _ = writeln!(
        h,
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#333\" stroke-width=\"1.2\" stroke-dasharray=\"5 4\">\
         <title>reserved (segments)</title></polyline>",
        pts.trim_end()
    );
    for &(x, requested) in &t.ooms {
        let _ = writeln!(
            h,
            "<line x1=\"{0:.1}\" x2=\"{0:.1}\" y1=\"{top}\" y2=\"{1:.1}\" stroke=\"#d62728\" stroke-width=\"2\">\
             <title>out of memory: {2} requested</title></line>",
            px(x),
            top + ph,
            format_bytes(requested)
        );
    }
    // Frame of the plot.
    let _ = writeln!(
        h,
        "<rect x=\"{l}\" y=\"{top}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#999\"/>"
    );
    if events == 0 {
        let _ = writeln!(
            h,
            "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\" style=\"font-size:14px\">No events recorded \
             for cuda:{device}: call ember::cuda::record_memory_history_on({device}, true, max_entries) before \
             the code to trace.</text>",
            l + pw / 2.0,
            top + ph / 2.0
        );
    }
    h.push_str("</svg>\n");
}

fn band(h: &mut String, b: &Band, i: usize, px: &dyn Fn(f64) -> f64, py: &dyn Fn(u64) -> f64) {
    let mut pts: Vec<(f64, u64)> = b.points.clone();
    let last = pts.last().map_or(0, |p| p.1);
    if b.end_x > pts.last().map_or(0.0, |p| p.0) {
        pts.push((b.end_x, last));
    }
    let mut s = String::new();
    for &(x, off) in &pts {
        let _ = write!(s, "{:.1},{:.1} ", px(x), py(off.saturating_add(b.size)));
    }
    for &(x, off) in pts.iter().rev() {
        let _ = write!(s, "{:.1},{:.1} ", px(x), py(off));
    }
    let when = |e: Option<usize>, what: &str| match e {
        Some(i) => format!("{what} at event {i}"),
        None if what == "allocated" => "allocated before recording began".to_string(),
        None => "alive at the end".to_string(),
    };
    let mut title = format!(
        "{} at {:#x}, {}, {}",
        format_bytes(b.size),
        b.addr,
        when(b.alloc_event, "allocated"),
        when(b.free_event, "freed")
    );
    for f in b.frames.iter().take(6) {
        title += "\n  ";
        title += f;
    }
    let _ = writeln!(
        h,
        "<polygon points=\"{}\" fill=\"{}\"><title>{}</title></polygon>",
        s.trim_end(),
        PALETTE[i % PALETTE.len()],
        esc(&title)
    );
}

fn segment_map(h: &mut String, segs: &[&Segment]) {
    if segs.is_empty() {
        h.push_str("<p class=\"note\">No segments at the snapshot.</p>\n");
        return;
    }
    const ROW: f64 = 18.0;
    const GAP: f64 = 5.0;
    const LABEL: f64 = 300.0;
    let w = TIMELINE_W as f64;
    let bar = w - LABEL - PLOT_RIGHT as f64;
    let rows = segs.len().min(MAX_SEGMENT_ROWS);
    let height = rows as f64 * (ROW + GAP) + GAP;
    let _ = writeln!(
        h,
        "<p class=\"note\">One row per segment, in address order; each bar is its segment's whole size, \
         its blocks in proportion.</p>\n<svg class=\"segments\" width=\"{w}\" height=\"{height}\" \
         viewBox=\"0 0 {w} {height}\" xmlns=\"http://www.w3.org/2000/svg\">"
    );
    for (row, seg) in segs.iter().take(rows).enumerate() {
        let y = GAP + row as f64 * (ROW + GAP);
        let pool = if seg.pool_id == (0, 0) {
            String::new()
        } else {
            format!(" pool ({}, {})", seg.pool_id.0, seg.pool_id.1)
        };
        let _ = writeln!(
            h,
            "<text x=\"0\" y=\"{:.1}\">{:#x}  {} {} stream {}{}</text>",
            y + 13.0,
            seg.address,
            format_bytes(seg.total_size),
            esc(&seg.segment_type),
            seg.stream,
            pool
        );
        let total = seg.total_size.max(1) as f64;
        for (i, b) in seg.blocks.iter().enumerate() {
            let x = LABEL + (b.address.saturating_sub(seg.address)) as f64 / total * bar;
            // Blocks in use stay visible (one pixel) even in a large segment.
            let bw = b.size as f64 / total * bar;
            let bw = if b.state == BlockState::Inactive {
                bw
            } else {
                bw.max(1.0)
            };
            let colour = match b.state {
                BlockState::ActiveAllocated => ALLOCATED[i % 2],
                BlockState::ActivePendingFree => PENDING,
                BlockState::Inactive => INACTIVE,
            };
            let mut title = format!(
                "{} at {:#x}: {}, {} requested",
                format_bytes(b.size),
                b.address,
                b.state.as_str(),
                format_bytes(b.requested_size)
            );
            for f in b.frames.iter().take(6) {
                title += "\n  ";
                title += f;
            }
            let _ = writeln!(
                h,
                "<rect x=\"{x:.2}\" y=\"{y:.1}\" width=\"{bw:.2}\" height=\"{ROW}\" fill=\"{colour}\"><title>{}</title></rect>",
                esc(&title)
            );
        }
        let _ = writeln!(
            h,
            "<rect x=\"{LABEL}\" y=\"{y:.1}\" width=\"{bar:.1}\" height=\"{ROW}\" fill=\"none\" stroke=\"#888\"/>"
        );
    }
    h.push_str("</svg>\n");
    if segs.len() > rows {
        let _ = writeln!(
            h,
            "<p class=\"note\">... and {} more segments, not drawn.</p>",
            segs.len() - rows
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_units() {
        assert_eq!(format_bytes(512), "512 B");
        assert_eq!(format_bytes(3 << 20), "3.00 MiB");
        assert_eq!(decimal_step(95.0, 10.0), 10.0);
        assert_eq!(decimal_step(3.0, 10.0), 1.0);
        assert_eq!(decimal_step(1200.0, 10.0), 200.0);
        assert_eq!(byte_step(36 << 20, 6), 8 << 20);
        assert_eq!(esc("<a href='x'>&\""), "&lt;a href=&#39;x&#39;&gt;&amp;&quot;");
    }

    #[test]
    fn an_empty_snapshot_still_makes_a_page() {
        let html = render(&Snapshot::default(), "empty.pickle");
        assert!(html.contains("No events recorded for cuda:0"), "{html}");
        assert!(html.contains("No segments at the snapshot."));
        assert!(
            !html.contains("<script") && !html.contains("http://") && !html.contains("https://")
                || html.contains("xmlns=\"http://www.w3.org/2000/svg\"")
        );
    }
}
