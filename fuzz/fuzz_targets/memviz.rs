//! `ember memviz`: a memory snapshot's bytes read into its typed model and drawn as the page,
//! by the program's own code (included by path).
#![no_main]

#[allow(dead_code)]
#[path = "../../crates/ember/src/memviz/mod.rs"]
mod memviz;

ember_fuzz::reader_target!(|data| {
    let _ = memviz::page_of(data, std::path::Path::new("fuzz.pickle"));
});
