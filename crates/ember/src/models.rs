//! The models `ember train` and `ember bench` build: the Fashion-MNIST MLP and CNN, the
//! benchmark classifiers of `shared/bench/WORKLOADS.md`, and a small [`Lstm`] module (a
//! stand-in until ember-nn has its own `nn.LSTM` type) over `ember_nn::functional::lstm`.
//!
//! Layer sizes and parameter names follow the PyTorch models of `torch_reference.py` and the
//! PyTorch tutorial CNN, so state dicts line up with theirs.

use ember::nn::functional::{self, Pair};
use ember::nn::layers::Conv2dConfig;
use ember::nn::module::join_name;
use ember::nn::{Conv2d, Flatten, Linear, MaxPool2d, Module, ReLU, Sequential, TensorKind};
use ember::{DType, Device, Error, Result, Tensor};

/// `Conv2d(cin, cout, 3, stride 1, padding 1)`.
fn conv3x3(cin: usize, cout: usize, device: Device) -> Result<Conv2d> {
    let config = Conv2dConfig {
        padding: Pair([1, 1]),
        ..Default::default()
    };
    Conv2d::with_config(cin, cout, 3, config, device)
}

/// Stacked `Linear` layers with a ReLU between each pair (`sizes[0] -> .. -> sizes[last]`),
/// after a `Flatten` when `flatten`.
pub fn mlp(sizes: &[usize], flatten: bool, device: Device) -> Result<Sequential> {
    let mut seq = Sequential::new();
    if flatten {
        seq.push(Flatten::new());
    }
    for (i, w) in sizes.windows(2).enumerate() {
        if i > 0 {
            seq.push(ReLU::new());
        }
        seq.push(Linear::new(w[0], w[1], device)?);
    }
    Ok(seq)
}

/// The two-conv CNN for `[N, cin, 28, 28]` inputs: conv(cin->c1) ReLU pool, conv(c1->c2) ReLU
/// pool, flatten, Linear(c2·7·7, 128) ReLU Linear(128, 10).
pub fn cnn(cin: usize, c1: usize, c2: usize, device: Device) -> Result<Sequential> {
    Ok(Sequential::new()
        .with(conv3x3(cin, c1, device)?)
        .with(ReLU::new())
        .with(MaxPool2d::new(2))
        .with(conv3x3(c1, c2, device)?)
        .with(ReLU::new())
        .with(MaxPool2d::new(2))
        .with(Flatten::new())
        .with(Linear::new(c2 * 7 * 7, 128, device)?)
        .with(ReLU::new())
        .with(Linear::new(128, 10, device)?))
}

/// A multi-layer, unidirectional LSTM (`nn.LSTM(input_size, hidden_size, num_layers,
/// batch_first=..)` with biases, no dropout, no projection). `forward` returns the output
/// sequence (the last layer's `h` at every step); parameters are named as PyTorch's
/// (`weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, ...).
pub struct Lstm {
    /// Per layer `[weight_ih, weight_hh, bias_ih, bias_hh]`, gates stacked `i, f, g, o`.
    pub weights: Vec<[Tensor; 4]>,
    /// Features of each input step.
    pub input_size: usize,
    /// Inputs and outputs are `[N, T, F]` when true, `[T, N, F]` otherwise.
    pub batch_first: bool,
    training: bool,
}

const LSTM_NAMES: [&str; 4] = ["weight_ih", "weight_hh", "bias_ih", "bias_hh"];

impl Lstm {
    /// Builds the parameters on `device`, each uniform on `±1/√hidden_size` as PyTorch's
    /// `reset_parameters`.
    pub fn new(
        input_size: usize,
        hidden_size: usize,
        num_layers: usize,
        batch_first: bool,
        device: Device,
    ) -> Result<Lstm> {
        let bound = 1.0 / (hidden_size as f64).sqrt();
        let gates = 4 * hidden_size;
        let param = |dims: &[usize]| -> Result<Tensor> {
            let t = Tensor::empty(dims, DType::F32, device)?;
            t.uniform_(-bound, bound)?;
            t.requires_grad_(true)
        };
        let weights = (0..num_layers)
            .map(|l| {
                let input = if l == 0 { input_size } else { hidden_size };
                Ok([
                    param(&[gates, input])?,
                    param(&[gates, hidden_size])?,
                    param(&[gates])?,
                    param(&[gates])?,
                ])
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Lstm {
            weights,
            input_size,
            batch_first,
            training: true,
        })
    }
}

impl Module for Lstm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.dims().last() != Some(&self.input_size) {
            return Err(Error::invalid(
                "Lstm",
                format!(
                    "expected input of {} features, got shape {}",
                    self.input_size,
                    x.shape()
                ),
            ));
        }
        let layers: Vec<&[Tensor]> = self.weights.iter().map(|w| &w[..]).collect();
        let (out, _) = functional::lstm(
            x,
            None,
            &layers,
            self.weights.len(),
            self.batch_first,
            0.0,
            self.training,
        )?;
        Ok(out)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        for (l, w) in self.weights.iter().enumerate() {
            for (t, name) in w.iter().zip(LSTM_NAMES) {
                f(
                    &join_name(prefix, &format!("{name}_l{l}")),
                    t,
                    TensorKind::Parameter,
                );
            }
        }
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        for (l, w) in self.weights.iter_mut().enumerate() {
            for (t, name) in w.iter_mut().zip(LSTM_NAMES) {
                f(
                    &join_name(prefix, &format!("{name}_l{l}")),
                    t,
                    TensorKind::Parameter,
                )?;
            }
        }
        Ok(())
    }

    fn set_training(&mut self, training: bool) {
        self.training = training;
    }

    fn is_training(&self) -> bool {
        self.training
    }
}

/// The benchmark's `LSTMClassifier`: an [`Lstm`] (batch first) and a `Linear` head on the
/// output of the last time step.
pub struct LstmClassifier {
    /// The recurrent body (`lstm.*` in the state dict).
    pub lstm: Lstm,
    /// The classifier on the last step's `h` (`head.*`).
    pub head: Linear,
}

impl LstmClassifier {
    /// `LSTM(input, hidden, layers, batch_first=True)` then `Linear(hidden, classes)`.
    pub fn new(input: usize, hidden: usize, layers: usize, classes: usize, device: Device) -> Result<Self> {
        Ok(LstmClassifier {
            lstm: Lstm::new(input, hidden, layers, true, device)?,
            head: Linear::new(hidden, classes, device)?,
        })
    }
}

impl Module for LstmClassifier {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.lstm.forward(x)?;
        self.head.forward(&out.select(1, -1)?)
    }

    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.lstm.visit(&join_name(prefix, "lstm"), f);
        self.head.visit(&join_name(prefix, "head"), f);
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.lstm.visit_mut(&join_name(prefix, "lstm"), f)?;
        self.head.visit_mut(&join_name(prefix, "head"), f)
    }

    fn set_training(&mut self, training: bool) {
        self.lstm.set_training(training);
        self.head.set_training(training);
    }

    fn is_training(&self) -> bool {
        self.lstm.is_training()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember::nn::ModuleExt;

    #[test]
    fn lstm_classifier_names_and_shapes_match_pytorch() -> Result<()> {
        let m = LstmClassifier::new(4, 3, 2, 5, Device::Cpu)?;
        let names: Vec<(String, Vec<usize>)> = m
            .named_parameters()
            .into_iter()
            .map(|(n, t)| (n, t.dims().to_vec()))
            .collect();
        assert_eq!(names[0], ("lstm.weight_ih_l0".into(), vec![12, 4]));
        assert_eq!(names[4], ("lstm.weight_ih_l1".into(), vec![12, 3]));
        assert_eq!(names[8], ("head.weight".into(), vec![5, 3]));
        let y = m.forward(&Tensor::randn([2, 6, 4], DType::F32, Device::Cpu)?)?;
        assert_eq!(y.dims(), &[2, 5]);
        Ok(())
    }

    #[test]
    fn fashion_models_map_images_to_ten_logits() -> Result<()> {
        let x = Tensor::randn([3, 1, 28, 28], DType::F32, Device::Cpu)?;
        assert_eq!(
            mlp(&[784, 16, 10], true, Device::Cpu)?.forward(&x)?.dims(),
            &[3, 10]
        );
        assert_eq!(cnn(1, 4, 8, Device::Cpu)?.forward(&x)?.dims(), &[3, 10]);
        Ok(())
    }
}
