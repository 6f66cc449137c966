//! Tests of reduce (filled in with the family).
