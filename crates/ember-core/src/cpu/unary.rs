//! CPU kernels of the unary family.
