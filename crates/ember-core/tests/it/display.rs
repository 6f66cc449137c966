//! Tests of display (filled in with the family).
