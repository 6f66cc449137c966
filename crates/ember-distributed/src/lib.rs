//! ember-distributed: process groups, the rendezvous store, NCCL, DDP and the launcher
//! (`torch.distributed`). It builds on `ember-core` only; its contents arrive with multi-GPU work.
#![forbid(unsafe_code)]
