//! CPU kernels of the index family.
