//! Recurrent layers: [`RNN`], [`LSTM`], [`GRU`] (`nn.RNN/LSTM/GRU`, multi-layer and
//! unidirectional) and the single-step [`RNNCell`], [`LSTMCell`], [`GRUCell`], each a module
//! over its function in `crate::functional::recurrent`.
//!
//! Parameters are named and ordered as PyTorch's: per layer `k`, `weight_ih_l{k}`
//! `[G·H, in]`, `weight_hh_l{k}` `[G·H, H]`, `bias_ih_l{k}`, `bias_hh_l{k}` `[G·H]` (the
//! cells drop the `_l{k}`), with `G` gates stacked (LSTM `i, f, g, o`, GRU `r, z, n`, RNN one).
//! All are initialized uniform on `±1/√hidden_size`, as PyTorch's `reset_parameters`.
//!
//! `Forward::forward` returns the output sequence (the new `h` for the cells) from zero initial
//! states; `forward_with` takes the initial state and returns the final one too, as PyTorch's
//! `forward(input, hx)`.

use super::new_param;
use crate::functional::{self, RnnNonlinearity};
use crate::init;
use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::{Device, Error, Result, Tensor};

/// Keyword options of [`LSTM`] and [`GRU`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecurrentConfig {
    /// Stacked recurrent layers (default 1).
    pub num_layers: usize,
    /// Whether the layers have `bias_ih` and `bias_hh` (default `true`).
    pub bias: bool,
    /// Inputs and outputs are `[N, T, F]` when true, `[T, N, F]` otherwise (default `false`);
    /// the states stay `[num_layers, N, H]`.
    pub batch_first: bool,
    /// Dropout on the outputs of every layer but the last while training (default 0).
    pub dropout: f64,
}

impl Default for RecurrentConfig {
    fn default() -> Self {
        RecurrentConfig {
            num_layers: 1,
            bias: true,
            batch_first: false,
            dropout: 0.0,
        }
    }
}

/// Keyword options of [`RNN`]: those of [`RecurrentConfig`] plus the nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RNNConfig {
    /// `tanh` (default) or `relu`.
    pub nonlinearity: RnnNonlinearity,
    /// Stacked recurrent layers (default 1).
    pub num_layers: usize,
    /// Whether the layers have `bias_ih` and `bias_hh` (default `true`).
    pub bias: bool,
    /// Inputs and outputs are `[N, T, F]` when true (default `false`).
    pub batch_first: bool,
    /// Dropout on the outputs of every layer but the last while training (default 0).
    pub dropout: f64,
}

impl Default for RNNConfig {
    fn default() -> Self {
        let r = RecurrentConfig::default();
        RNNConfig {
            nonlinearity: RnnNonlinearity::Tanh,
            num_layers: r.num_layers,
            bias: r.bias,
            batch_first: r.batch_first,
            dropout: r.dropout,
        }
    }
}

/// Keyword options of [`RNNCell`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RNNCellConfig {
    /// Whether the cell has `bias_ih` and `bias_hh` (default `true`).
    pub bias: bool,
    /// `tanh` (default) or `relu`.
    pub nonlinearity: RnnNonlinearity,
}

impl Default for RNNCellConfig {
    fn default() -> Self {
        RNNCellConfig {
            bias: true,
            nonlinearity: RnnNonlinearity::Tanh,
        }
    }
}

/// Keyword options of [`LSTMCell`] and [`GRUCell`], with PyTorch's defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CellConfig {
    /// Whether the cell has `bias_ih` and `bias_hh` (default `true`).
    pub bias: bool,
}

impl Default for CellConfig {
    fn default() -> Self {
        CellConfig { bias: true }
    }
}

/// The weights of one recurrent layer (or of a cell).
#[derive(Debug, Clone)]
pub struct RecurrentWeights {
    /// `weight_ih`: `[G·H, input features]`.
    pub weight_ih: Tensor,
    /// `weight_hh`: `[G·H, H]`.
    pub weight_hh: Tensor,
    /// `bias_ih`: `[G·H]`, `None` without bias.
    pub bias_ih: Option<Tensor>,
    /// `bias_hh`: `[G·H]`, `None` without bias.
    pub bias_hh: Option<Tensor>,
}

impl RecurrentWeights {
    /// Weights for `gates` gates, uniform on `±1/√hidden`.
    fn new(gates: usize, input: usize, hidden: usize, bias: bool, device: Device) -> Result<Self> {
        let bound = 1.0 / (hidden as f64).sqrt();
        let param = |dims: &[usize]| new_param(dims, device, |t| init::uniform_(t, -bound, bound));
        Ok(RecurrentWeights {
            weight_ih: param(&[gates * hidden, input])?,
            weight_hh: param(&[gates * hidden, hidden])?,
            bias_ih: bias.then(|| param(&[gates * hidden])).transpose()?,
            bias_hh: bias.then(|| param(&[gates * hidden])).transpose()?,
        })
    }

    /// The list the functional forms take: both weights, then both biases if present.
    fn list(&self) -> Vec<Tensor> {
        let mut v = vec![self.weight_ih.clone(), self.weight_hh.clone()];
        if let (Some(bi), Some(bh)) = (&self.bias_ih, &self.bias_hh) {
            v.push(bi.clone());
            v.push(bh.clone());
        }
        v
    }

    fn visit(&self, prefix: &str, suffix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        let name = |n: &str| join_name(prefix, &format!("{n}{suffix}"));
        f(&name("weight_ih"), &self.weight_ih, TensorKind::Parameter);
        f(&name("weight_hh"), &self.weight_hh, TensorKind::Parameter);
        if let Some(b) = &self.bias_ih {
            f(&name("bias_ih"), b, TensorKind::Parameter);
        }
        if let Some(b) = &self.bias_hh {
            f(&name("bias_hh"), b, TensorKind::Parameter);
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        suffix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        let name = |n: &str| join_name(prefix, &format!("{n}{suffix}"));
        f(&name("weight_ih"), &mut self.weight_ih, TensorKind::Parameter)?;
        f(&name("weight_hh"), &mut self.weight_hh, TensorKind::Parameter)?;
        if let Some(b) = &mut self.bias_ih {
            f(&name("bias_ih"), b, TensorKind::Parameter)?;
        }
        if let Some(b) = &mut self.bias_hh {
            f(&name("bias_hh"), b, TensorKind::Parameter)?;
        }
        Ok(())
    }
}

/// Checks the sizes and options shared by every recurrent layer.
fn check_sizes(
    op: &'static str,
    input_size: usize,
    hidden_size: usize,
    num_layers: usize,
    dropout: f64,
) -> Result<()> {
    if input_size == 0 || hidden_size == 0 || num_layers == 0 {
        return Err(Error::invalid(
            op,
            format!(
                "input_size ({input_size}), hidden_size ({hidden_size}) and num_layers ({num_layers}) must be positive"
            ),
        ));
    }
    if !(0.0..=1.0).contains(&dropout) {
        return Err(Error::invalid(
            op,
            format!("dropout should be a number in range [0, 1] representing the probability of an element being zeroed, got {dropout}"),
        ));
    }
    Ok(())
}

/// Checks that the input's last dim is `input_size`, as PyTorch's `check_input`.
fn check_input(op: &'static str, input: &Tensor, input_size: usize) -> Result<()> {
    if input.dims().last() != Some(&input_size) {
        return Err(Error::invalid(
            op,
            format!(
                "input.size(-1) must be equal to input_size. Expected {input_size}, got shape {}",
                input.shape()
            ),
        ));
    }
    Ok(())
}

/// The per-layer weights of a sequence layer, built for `gates` gates.
fn layer_weights(
    gates: usize,
    input: usize,
    hidden: usize,
    num_layers: usize,
    bias: bool,
    device: Device,
) -> Result<Vec<RecurrentWeights>> {
    (0..num_layers)
        .map(|l| RecurrentWeights::new(gates, if l == 0 { input } else { hidden }, hidden, bias, device))
        .collect()
}

macro_rules! sequence_module_impl {
    ($ty:ident) => {
        impl $ty {
            /// The weight lists of every layer, in the form the functional forms take.
            fn weight_lists(&self) -> Vec<Vec<Tensor>> {
                self.layers.iter().map(RecurrentWeights::list).collect()
            }
        }

        impl Forward for $ty {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                Ok(self.forward_with(x, None)?.0)
            }
        }

        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                for (l, w) in self.layers.iter().enumerate() {
                    w.visit(prefix, &format!("_l{l}"), f);
                }
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                for (l, w) in self.layers.iter_mut().enumerate() {
                    w.visit_mut(prefix, &format!("_l{l}"), f)?;
                }
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

/// Declares a sequence layer's struct (the fields shared by RNN, LSTM and GRU).
macro_rules! sequence_struct {
    ($(#[$doc:meta])* $ty:ident { $($(#[$fdoc:meta])* $field:ident: $fty:ty,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $ty {
            /// The weights of each layer (`weight_ih_l{k}`, ...).
            pub layers: Vec<RecurrentWeights>,
            /// Features of each input step.
            pub input_size: usize,
            /// Features of the hidden state.
            pub hidden_size: usize,
            /// Whether inputs and outputs are `[N, T, F]`.
            pub batch_first: bool,
            /// Dropout between layers while training.
            pub dropout: f64,
            $($(#[$fdoc])* pub $field: $fty,)*
            training: crate::module::Training,
        }
    };
}

sequence_struct!(
    /// A multi-layer Elman RNN with tanh or ReLU (`nn.RNN`), unidirectional.
    RNN {
        /// The activation.
        nonlinearity: RnnNonlinearity,
    }
);
sequence_struct!(
    /// A multi-layer LSTM (`nn.LSTM`), unidirectional, without projection.
    LSTM {}
);
sequence_struct!(
    /// A multi-layer GRU (`nn.GRU`), unidirectional.
    GRU {}
);

impl RNN {
    /// `nn.RNN(input_size, hidden_size)` on `device`.
    pub fn new(input_size: usize, hidden_size: usize, device: Device) -> Result<RNN> {
        RNN::with_config(input_size, hidden_size, RNNConfig::default(), device)
    }

    /// `nn.RNN(input_size, hidden_size, num_layers=.., nonlinearity=.., ...)` on `device`.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RNNConfig,
        device: Device,
    ) -> Result<RNN> {
        check_sizes("RNN", input_size, hidden_size, config.num_layers, config.dropout)?;
        Ok(RNN {
            layers: layer_weights(1, input_size, hidden_size, config.num_layers, config.bias, device)?,
            input_size,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            nonlinearity: config.nonlinearity,
            training: crate::module::Training::new(true),
        })
    }

    /// `rnn(input, h0)`: returns `(output, h_n)`. `input` is `[T, N, in]` (`[N, T, in]` with
    /// `batch_first`) or unbatched `[T, in]`; `h0` and `h_n` are `[num_layers, N, H]`
    /// (`[num_layers, H]` unbatched), `h0` zeros when `None`.
    pub fn forward_with(&self, input: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        check_input("RNN", input, self.input_size)?;
        let lists = self.weight_lists();
        let refs: Vec<&[Tensor]> = lists.iter().map(|l| &l[..]).collect();
        functional::rnn(
            input,
            h0,
            &refs,
            self.nonlinearity,
            self.layers.len(),
            self.batch_first,
            self.dropout,
            self.training.get(),
        )
    }
}

impl LSTM {
    /// `nn.LSTM(input_size, hidden_size)` on `device`.
    pub fn new(input_size: usize, hidden_size: usize, device: Device) -> Result<LSTM> {
        LSTM::with_config(input_size, hidden_size, RecurrentConfig::default(), device)
    }

    /// `nn.LSTM(input_size, hidden_size, num_layers=.., batch_first=.., ...)` on `device`.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RecurrentConfig,
        device: Device,
    ) -> Result<LSTM> {
        check_sizes("LSTM", input_size, hidden_size, config.num_layers, config.dropout)?;
        Ok(LSTM {
            layers: layer_weights(4, input_size, hidden_size, config.num_layers, config.bias, device)?,
            input_size,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: crate::module::Training::new(true),
        })
    }

    /// `lstm(input, (h0, c0))`: returns `(output, (h_n, c_n))`, states zeros when `hx` is
    /// `None`. Shapes as [`RNN::forward_with`].
    pub fn forward_with(
        &self,
        input: &Tensor,
        hx: Option<(&Tensor, &Tensor)>,
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        check_input("LSTM", input, self.input_size)?;
        let lists = self.weight_lists();
        let refs: Vec<&[Tensor]> = lists.iter().map(|l| &l[..]).collect();
        functional::lstm(
            input,
            hx,
            &refs,
            self.layers.len(),
            self.batch_first,
            self.dropout,
            self.training.get(),
        )
    }
}

impl GRU {
    /// `nn.GRU(input_size, hidden_size)` on `device`.
    pub fn new(input_size: usize, hidden_size: usize, device: Device) -> Result<GRU> {
        GRU::with_config(input_size, hidden_size, RecurrentConfig::default(), device)
    }

    /// `nn.GRU(input_size, hidden_size, num_layers=.., batch_first=.., ...)` on `device`.
    pub fn with_config(
        input_size: usize,
        hidden_size: usize,
        config: RecurrentConfig,
        device: Device,
    ) -> Result<GRU> {
        check_sizes("GRU", input_size, hidden_size, config.num_layers, config.dropout)?;
        Ok(GRU {
            layers: layer_weights(3, input_size, hidden_size, config.num_layers, config.bias, device)?,
            input_size,
            hidden_size,
            batch_first: config.batch_first,
            dropout: config.dropout,
            training: crate::module::Training::new(true),
        })
    }

    /// `gru(input, h0)`: returns `(output, h_n)`. Shapes as [`RNN::forward_with`].
    pub fn forward_with(&self, input: &Tensor, h0: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        check_input("GRU", input, self.input_size)?;
        let lists = self.weight_lists();
        let refs: Vec<&[Tensor]> = lists.iter().map(|l| &l[..]).collect();
        functional::gru(
            input,
            h0,
            &refs,
            self.layers.len(),
            self.batch_first,
            self.dropout,
            self.training.get(),
        )
    }
}

sequence_module_impl!(RNN);
sequence_module_impl!(LSTM);
sequence_module_impl!(GRU);

/// Declares a cell's struct, its constructors and its `Module` impl; `$extra` are the fields
/// taken from the config besides `bias`.
macro_rules! cell {
    ($(#[$doc:meta])* $ty:ident, $name:literal, $gates:expr, $cfg:ty { $($(#[$fdoc:meta])* $extra:ident: $ety:ty,)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $ty {
            /// `weight_ih`, `weight_hh`, `bias_ih`, `bias_hh`.
            pub weights: RecurrentWeights,
            /// Features of the input.
            pub input_size: usize,
            /// Features of the hidden state.
            pub hidden_size: usize,
            $($(#[$fdoc])* pub $extra: $ety,)*
            training: crate::module::Training,
        }

        impl $ty {
            #[doc = concat!("`nn.", $name, "(input_size, hidden_size)` on `device`.")]
            pub fn new(input_size: usize, hidden_size: usize, device: Device) -> Result<$ty> {
                $ty::with_config(input_size, hidden_size, <$cfg>::default(), device)
            }

            #[doc = concat!("`nn.", $name, "(input_size, hidden_size, bias=..)` on `device`.")]
            pub fn with_config(input_size: usize, hidden_size: usize, config: $cfg, device: Device) -> Result<$ty> {
                check_sizes($name, input_size, hidden_size, 1, 0.0)?;
                Ok($ty {
                    weights: RecurrentWeights::new($gates, input_size, hidden_size, config.bias, device)?,
                    input_size,
                    hidden_size,
                    $($extra: config.$extra,)*
                    training: crate::module::Training::new(true),
                })
            }
        }

        impl Forward for $ty {
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                self.step(x)
            }
        }

        impl Module for $ty {
            fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
                self.weights.visit(prefix, "", f)
            }

            fn visit_mut(
                &mut self,
                prefix: &str,
                f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
            ) -> Result<()> {
                self.weights.visit_mut(prefix, "", f)
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

cell!(
    /// One step of an Elman RNN (`nn.RNNCell`).
    RNNCell, "RNNCell", 1, RNNCellConfig {
        /// The activation.
        nonlinearity: RnnNonlinearity,
    }
);
cell!(
    /// One LSTM step (`nn.LSTMCell`); `Forward::forward` returns the new `h`.
    LSTMCell, "LSTMCell", 4, CellConfig {}
);
cell!(
    /// One GRU step (`nn.GRUCell`).
    GRUCell, "GRUCell", 3, CellConfig {}
);

impl RNNCell {
    fn step(&self, input: &Tensor) -> Result<Tensor> {
        self.forward_with(input, None)
    }

    /// `cell(input, hx)`: the new `h`. `input` is `[N, in]` or `[in]`, `hx` `[N, H]` (`[H]`)
    /// or zeros when `None`.
    pub fn forward_with(&self, input: &Tensor, hx: Option<&Tensor>) -> Result<Tensor> {
        check_input("RNNCell", input, self.input_size)?;
        let w = &self.weights;
        let cell = match self.nonlinearity {
            RnnNonlinearity::Tanh => functional::rnn_tanh_cell,
            RnnNonlinearity::Relu => functional::rnn_relu_cell,
        };
        cell(
            input,
            hx,
            &w.weight_ih,
            &w.weight_hh,
            w.bias_ih.as_ref(),
            w.bias_hh.as_ref(),
        )
    }
}

impl LSTMCell {
    /// `cell(input, (h, c))`: returns `(h', c')`; states zeros when `hx` is `None`. Shapes as
    /// [`RNNCell::forward_with`].
    pub fn forward_with(&self, input: &Tensor, hx: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, Tensor)> {
        check_input("LSTMCell", input, self.input_size)?;
        let w = &self.weights;
        functional::lstm_cell(
            input,
            hx,
            &w.weight_ih,
            &w.weight_hh,
            w.bias_ih.as_ref(),
            w.bias_hh.as_ref(),
        )
    }

    fn step(&self, input: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with(input, None)?.0)
    }
}

impl GRUCell {
    fn step(&self, input: &Tensor) -> Result<Tensor> {
        self.forward_with(input, None)
    }

    /// `cell(input, hx)`: the new `h`. Shapes as [`RNNCell::forward_with`].
    pub fn forward_with(&self, input: &Tensor, hx: Option<&Tensor>) -> Result<Tensor> {
        check_input("GRUCell", input, self.input_size)?;
        let w = &self.weights;
        functional::gru_cell(
            input,
            hx,
            &w.weight_ih,
            &w.weight_hh,
            w.bias_ih.as_ref(),
            w.bias_hh.as_ref(),
        )
    }
}
