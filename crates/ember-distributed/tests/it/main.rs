//! Integration tests of ember-distributed, one module per feature (one test binary).
//!
//! Multi-process tests re-execute this binary as workers: `processes::worker_entry` does
//! nothing unless `EMBER_DIST_WORKER` names a scenario.

mod checkpoint;
mod collectives;
mod common;
mod ddp;
mod ddp_hooks;
mod dtensor;
mod fsdp;
mod launcher;
mod nccl;
mod processes;
mod store;
mod zero;
