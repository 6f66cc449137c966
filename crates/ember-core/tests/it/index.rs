//! Tests of index (filled in with the family).
