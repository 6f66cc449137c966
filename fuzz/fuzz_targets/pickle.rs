//! The pickle reader behind `ember memviz` (`ember::pickle::loads`). What it reads, the writer
//! writes back and the reader reads again to the same value.
#![no_main]

use ember::pickle;

ember_fuzz::reader_target!(|data| {
    if let Ok(v) = pickle::loads(data) {
        let bytes = pickle::dumps(&v);
        let again = pickle::loads(&bytes).expect("the writer's bytes read back");
        // Compared as bytes: NaN floats are not equal to themselves.
        assert_eq!(
            pickle::dumps(&again),
            bytes,
            "a value read, written and read again changed"
        );
    }
});
