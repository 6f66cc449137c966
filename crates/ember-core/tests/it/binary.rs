//! Tests of binary (filled in with the family).
