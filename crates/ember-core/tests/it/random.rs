//! Tests of random (filled in with the family).
