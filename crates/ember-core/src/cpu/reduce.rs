//! CPU kernels of the reduce family.
