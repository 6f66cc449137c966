//! Distributed optimizers (`torch.distributed.optim`): [`ZeroRedundancyOptimizer`], which
//! shards an optimizer's state across the ranks of a process group (ZeRO stage 1).

mod zero_redundancy_optimizer;

pub use zero_redundancy_optimizer::ZeroRedundancyOptimizer;
