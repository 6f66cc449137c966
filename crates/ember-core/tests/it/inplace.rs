//! Tests of inplace (filled in with the family).
