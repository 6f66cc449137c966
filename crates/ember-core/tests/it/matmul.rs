//! Tests of matmul (filled in with the family).
