//! Collation: how the samples of one batch become one batch ([`default_collate`], and the
//! [`CollateFn`] type for your own).

use crate::dataset::Sample;
use ember_core::{Error, Result, Tensor};

/// A collate function: the samples of one batch, in sampler order, to one batch
/// (`collate_fn` of `torch.utils.data.DataLoader`). Workers call it from their threads.
pub type CollateFn = dyn Fn(Vec<Sample>) -> Result<Sample> + Send + Sync;

/// Each field of the samples stacked along a new dim 0 (`default_collate` for tuples of
/// tensors): `[[x0, y0], [x1, y1]]` becomes `[stack([x0, x1]), stack([y0, y1])]`. The samples
/// must be non-empty, have the same number of fields, and agree in shape field by field.
pub fn default_collate(samples: Vec<Sample>) -> Result<Sample> {
    const OP: &str = "default_collate";
    let first = samples
        .first()
        .ok_or_else(|| Error::invalid(OP, "cannot collate an empty batch"))?;
    let fields = first.len();
    if let Some((i, bad)) = samples.iter().enumerate().find(|(_, s)| s.len() != fields) {
        return Err(Error::invalid(
            OP,
            format!(
                "each sample of a batch must have the same number of fields: sample 0 has {fields}, sample {i} has {}",
                bad.len()
            ),
        ));
    }
    (0..fields)
        .map(|f| {
            let column: Vec<&Tensor> = samples.iter().map(|s| &s[f]).collect();
            Tensor::stack(&column, 0)
        })
        .collect()
}
