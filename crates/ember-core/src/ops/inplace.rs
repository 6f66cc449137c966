//! In-place ops (`add_`, `mul_`, `copy_`, `zero_`, `fill_`, ...): they write through to the
//! shared storage and bump its version counter, so autograd can detect a saved tensor that was
//! modified (see Note [Saved tensors] in `autograd`).
