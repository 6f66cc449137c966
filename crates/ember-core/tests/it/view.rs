//! Tests of view (filled in with the family).
