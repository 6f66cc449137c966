//! Tests of unary (filled in with the family).
