//! CPU kernels of the matmul family.
