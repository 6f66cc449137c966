//! Tests of autograd (filled in with the family).
