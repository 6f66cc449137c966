//! [`Embedding`] (`nn.Embedding`): a lookup table of `num_embeddings` rows of
//! `embedding_dim`, initialized normal(0, 1), with an optional `padding_idx` whose row starts
//! at zero and gets no gradient.

use super::new_param;
use crate::init;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{no_grad, Device, Error, Result, Tensor};

/// Keyword options of [`Embedding`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EmbeddingConfig {
    /// A row that is zero initially and never receives a gradient (default `None`); negative
    /// values count from the end, as in PyTorch.
    pub padding_idx: Option<i64>,
}

/// A lookup table from int64 indices to rows (`nn.Embedding(num_embeddings, embedding_dim)`).
#[derive(Debug, Clone)]
pub struct Embedding {
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Tensor,
    /// Rows in the table.
    pub num_embeddings: usize,
    /// Size of each row.
    pub embedding_dim: usize,
    /// The padding row, normalized to `0..num_embeddings`.
    pub padding_idx: Option<usize>,
    training: crate::module::Training,
}

impl Embedding {
    /// `nn.Embedding(num_embeddings, embedding_dim)` on `device`.
    pub fn new(num_embeddings: usize, embedding_dim: usize, device: Device) -> Result<Embedding> {
        Embedding::with_config(num_embeddings, embedding_dim, EmbeddingConfig::default(), device)
    }

    /// `nn.Embedding(num_embeddings, embedding_dim, padding_idx=..)` on `device`.
    pub fn with_config(
        num_embeddings: usize,
        embedding_dim: usize,
        config: EmbeddingConfig,
        device: Device,
    ) -> Result<Embedding> {
        let n = num_embeddings as i64;
        let padding_idx = match config.padding_idx {
            None => None,
            Some(p) if (0..n).contains(&p) => Some(p as usize),
            Some(p) if (-n..0).contains(&p) => Some((p + n) as usize),
            Some(p) => {
                return Err(Error::invalid(
                    "Embedding",
                    format!("padding_idx must be within num_embeddings ({num_embeddings}), got {p}"),
                ))
            }
        };
        let weight = new_param(&[num_embeddings, embedding_dim], device, |w| {
            init::normal_(w, 0.0, 1.0)?;
            if let Some(p) = padding_idx {
                let _g = no_grad();
                w.select(0, p as isize)?.fill_(0.0)?;
            }
            Ok(w.clone())
        })?;
        Ok(Embedding {
            weight,
            num_embeddings,
            embedding_dim,
            padding_idx,
            training: crate::module::Training::new(true),
        })
    }
}

impl Forward for Embedding {
    /// Rows of `weight` at the int64 (or int32) indices `x`: shape `x.shape + [embedding_dim]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = Tensor::embedding(x, &self.weight)?;
        match self.padding_idx {
            // Same values, but the rows read at padding_idx pass no gradient to the weight.
            Some(p) if out.requires_grad() => {
                let mask = x.eq_scalar(p as i64)?.unsqueeze(-1)?;
                Tensor::where_cond(&mask, &out.detach(), &out)
            }
            _ => Ok(out),
        }
    }
}

impl Module for Embedding {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        f(&join_name(prefix, "weight"), &self.weight, TensorKind::Parameter);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        f(
            &join_name(prefix, "weight"),
            &mut self.weight,
            TensorKind::Parameter,
        )
    }

    fn set_training(&self, training: bool) {
        self.training.set(training);
    }

    fn is_training(&self) -> bool {
        self.training.get()
    }
}
