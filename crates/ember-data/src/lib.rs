//! ember-data: `Dataset`, `DataLoader`, samplers and dataset readers (`torch.utils.data`).
//! It builds on `ember-core` only; its contents arrive with the training work.
#![forbid(unsafe_code)]
