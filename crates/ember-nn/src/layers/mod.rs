//! The layer types of `torch.nn`, one file per family: [`linear`], [`conv`], [`pooling`],
//! [`norm`], [`activation`], [`dropout`], [`embedding`], [`recurrent`] (RNN, LSTM, GRU and
//! their cells), [`attention`] (multi-head attention), [`transformer`], the containers in
//! [`container`] and the loss modules in [`loss`] (options set builder-style, see there).
//!
//! One constructor style for all: `Layer::new(required args.., device)` builds the layer with
//! PyTorch's defaults, and layers with keyword options also have
//! `Layer::with_config(required args.., LayerConfig { .., ..Default::default() }, device)`,
//! the config struct holding PyTorch's keyword arguments with PyTorch's defaults. Parameters
//! are created as f32 on `device` and initialized as PyTorch's `reset_parameters` does (see
//! `crate::init`); use `ModuleExt::to_dtype` for another dtype. Layers without tensors take
//! no device.
//!
//! Every layer is a plain struct with public fields (`linear.weight`, `conv.stride`), as the
//! attributes of PyTorch's modules.

pub mod activation;
pub mod attention;
pub mod container;
pub mod conv;
pub mod dropout;
pub mod embedding;
pub mod linear;
pub mod loss;
pub mod norm;
pub mod pooling;
pub mod recurrent;
pub mod transformer;

pub use activation::{GeluApproximate, LogSoftmax, ReLU, SiLU, Sigmoid, Softmax, Tanh, GELU};
pub use attention::{MultiheadAttention, MultiheadAttentionConfig};
pub use container::{Flatten, ModuleList, Sequential};
pub use conv::{Conv1d, Conv1dConfig, Conv2d, Conv2dConfig};
pub use dropout::Dropout;
pub use embedding::{Embedding, EmbeddingConfig};
pub use linear::{Linear, LinearConfig};
pub use loss::{BCEWithLogitsLoss, CrossEntropyLoss, L1Loss, MSELoss, NLLLoss};
pub use norm::{BatchNorm1d, BatchNorm2d, BatchNormConfig, LayerNorm, LayerNormConfig};
pub use pooling::{AdaptiveAvgPool2d, AvgPool2d, MaxPool2d, PoolConfig};
pub use recurrent::{
    CellConfig, GRUCell, LSTMCell, RNNCell, RNNCellConfig, RNNConfig, RecurrentConfig, RecurrentWeights, GRU,
    LSTM, RNN,
};
pub use transformer::{
    DecoderMasks, EncoderMasks, Transformer, TransformerActivation, TransformerConfig, TransformerDecoder,
    TransformerDecoderLayer, TransformerEncoder, TransformerEncoderLayer, TransformerLayerConfig,
    TransformerMasks,
};

use crate::module::{join_name, Module, TensorKind};
use ember_core::{no_grad, DType, Device, Result, Tensor};

/// A copy of `m` whose tensors are new leaves with equal values (`copy.deepcopy(module)`):
/// parameters keep their `requires_grad`, gradients are not copied.
pub(crate) fn deep_copy<M: Module + Clone>(m: &M) -> Result<M> {
    let mut copy = m.clone();
    copy.visit_mut("", &mut |_, t, _| {
        let new = {
            let _g = no_grad();
            t.detach().deep_clone()?
        };
        *t = if t.requires_grad() {
            new.requires_grad_(true)?
        } else {
            new
        };
        Ok(())
    })?;
    Ok(copy)
}

/// A new f32 parameter of `dims` on `device`, filled by `init` and then marked as requiring
/// grad (in that order, so the fill is not recorded).
pub(crate) fn new_param(
    dims: &[usize],
    device: Device,
    init: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let t = Tensor::empty(dims, DType::F32, device)?;
    init(&t)?;
    t.requires_grad_(true)
}

/// Calls `f` with `t` under `prefix.name` when present.
pub(crate) fn visit_opt(
    prefix: &str,
    name: &str,
    t: &Option<Tensor>,
    kind: TensorKind,
    f: &mut dyn FnMut(&str, &Tensor, TensorKind),
) {
    if let Some(t) = t {
        f(&join_name(prefix, name), t, kind);
    }
}

/// Mutable twin of [`visit_opt`].
pub(crate) fn visit_opt_mut(
    prefix: &str,
    name: &str,
    t: &mut Option<Tensor>,
    kind: TensorKind,
    f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
) -> Result<()> {
    match t {
        Some(t) => f(&join_name(prefix, name), t, kind),
        None => Ok(()),
    }
}

/// Implements [`crate::Module`] for a layer without tensors whose struct has a
/// `training: bool` field; `forward` is the given closure-like body.
macro_rules! stateless_module {
    ($ty:ty, |$s:ident, $x:ident| $body:expr) => {
        impl $crate::module::Forward for $ty {
            fn forward(&self, $x: &ember_core::Tensor) -> ember_core::Result<ember_core::Tensor> {
                let $s = self;
                $body
            }
        }

        impl $crate::module::Module for $ty {
            fn visit(
                &self,
                _prefix: &str,
                _f: &mut dyn FnMut(&str, &ember_core::Tensor, $crate::module::TensorKind),
            ) {
            }

            fn visit_mut(
                &mut self,
                _prefix: &str,
                _f: &mut dyn FnMut(
                    &str,
                    &mut ember_core::Tensor,
                    $crate::module::TensorKind,
                ) -> ember_core::Result<()>,
            ) -> ember_core::Result<()> {
                Ok(())
            }

            fn set_training(&self, training: bool) {
                self.training.set(training);
            }

            fn is_training(&self) -> bool {
                self.training.get()
            }
        }
    };
}
pub(crate) use stateless_module;
