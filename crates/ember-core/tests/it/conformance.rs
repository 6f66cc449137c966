//! Tests of conformance (filled in with the family).
