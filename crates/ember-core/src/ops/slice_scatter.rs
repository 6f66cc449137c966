//! `slice_scatter` (`torch.slice_scatter`): a copy of a tensor with a strided slice replaced,
//! the out-of-place form of PyTorch's `x[:, start:end:step] = src` (the positional encoding's
//! `pe[:, 0::2] = torch.sin(...)`). In place, `x.slice(dim, start, end, step)?.copy_(&src)`
//! writes through the view.
//!
//! Gradients, as PyTorch's `slice_scatter_backward`: the input's is the output's gradient with
//! the slice zeroed, `src`'s is the output's gradient at the slice.

use crate::dispatch::{self, policy};
use crate::{autograd, no_grad, Error, Result, Tensor};

impl Tensor {
    /// `self` with the elements `start..end` (every `step`-th) of `dim` replaced by `src`
    /// (`torch.slice_scatter(input, src, dim, start, end, step)`); bounds as in
    /// [`Tensor::slice`] (negative from the end, clamped; `isize::MAX` for "to the end").
    /// `src` must have the slice's shape; its dtype is converted to `self`'s, as by `copy_`.
    pub fn slice_scatter(
        &self,
        src: &Tensor,
        dim: isize,
        start: isize,
        end: isize,
        step: usize,
    ) -> Result<Tensor> {
        dispatch::named(&policy::SLICE_SCATTER, &[self, src], || {
            self.slice_scatter_composite(src, dim, start, end, step)
        })
    }

    fn slice_scatter_composite(
        &self,
        src: &Tensor,
        dim: isize,
        start: isize,
        end: isize,
        step: usize,
    ) -> Result<Tensor> {
        let out = {
            let _g = no_grad();
            let out = self.detach().deep_clone()?;
            let view = out.slice(dim, start, end, step)?;
            if view.dims() != src.dims() {
                return Err(Error::ShapeMismatch {
                    op: "slice_scatter",
                    lhs: view.shape().clone(),
                    rhs: src.shape().clone(),
                    hint: "src must have the shape of the slice it replaces",
                });
            }
            view.copy_(&src.detach())?;
            out
        };
        Ok(autograd::custom_op(
            "slice_scatter",
            &[self, src],
            out,
            move |g, needs| {
                let grad_input = match needs[0] {
                    true => Some(g.slice_scatter(
                        &g.slice(dim, start, end, step)?.zeros_like()?,
                        dim,
                        start,
                        end,
                        step,
                    )?),
                    false => None,
                };
                let grad_src = match needs[1] {
                    true => Some(g.slice(dim, start, end, step)?.contiguous()?),
                    false => None,
                };
                Ok(vec![grad_input, grad_src])
            },
        ))
    }
}
