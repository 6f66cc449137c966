//! IDX files (MNIST's format), gzipped or not (`ember_data::idx::parse_idx`).
#![no_main]

ember_fuzz::reader_target!(|data| {
    if let Ok(t) = ember::data::idx::parse_idx(data) {
        t.to_vec_f64().expect("a loaded tensor reads back");
    }
});
