//! The models `ember train` and `ember bench` build: the Fashion-MNIST MLP and CNN, the
//! benchmark models of `shared/bench/WORKLOADS.md` (its classifiers and GPT-2), and GPT-2 again
//! as `ember train --model gpt2` trains it (byte-level, GPT-2's initialization).
//!
//! Layer sizes and parameter names follow the PyTorch models of `torch_reference.py` and the
//! PyTorch tutorial CNN, so state dicts line up with theirs.

use ember::nn::functional as F;
use ember::nn::functional::Pair;
use ember::nn::layers::{Conv2dConfig, LinearConfig, RecurrentConfig};
use ember::nn::{
    Conv2d, Embedding, Flatten, Forward, LayerNorm, Linear, MaxPool2d, Module, ReLU, Sequential, LSTM,
};
use ember::{DType, Device, Result, Tensor};

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

/// [`mlp`]'s layers (no flatten) as a cloneable struct, for `nn::DataParallel`, which copies
/// the module to every device (`Sequential` holds boxed layers and cannot be cloned). Same
/// layers, drawn in the same order; the state dict names them `layers.0`, `layers.1`, ...
#[derive(Module, Clone)]
pub struct LinearStack {
    layers: Vec<Linear>,
}

impl LinearStack {
    pub fn new(sizes: &[usize], device: Device) -> Result<LinearStack> {
        let layers = sizes
            .windows(2)
            .map(|w| Linear::new(w[0], w[1], device))
            .collect::<Result<Vec<_>>>()?;
        Ok(LinearStack { layers })
    }
}

impl Forward for LinearStack {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            if i > 0 {
                x = x.relu()?;
            }
            x = layer.forward(&x)?;
        }
        Ok(x)
    }
}

/// The PyTorch tutorial's two-conv CNN (`CNN` of `torch_reference.py`) for `[N, cin, 28, 28]`
/// inputs: conv(cin->c1) ReLU pool, conv(c1->c2) ReLU pool, flatten, Linear(c2·7·7, 128) ReLU
/// Linear(128, 10); state-dict names `conv1.weight`, ..., `fc2.bias` as PyTorch's.
#[derive(Module, Clone)]
pub struct Cnn {
    conv1: Conv2d,
    pool1: MaxPool2d,
    conv2: Conv2d,
    pool2: MaxPool2d,
    fc1: Linear,
    fc2: Linear,
}

impl Cnn {
    /// `Conv2d(cin, c1, 3, 1, 1)`, `Conv2d(c1, c2, 3, 1, 1)` and the two linear layers.
    pub fn new(cin: usize, c1: usize, c2: usize, device: Device) -> Result<Cnn> {
        Ok(Cnn {
            conv1: conv3x3(cin, c1, device)?,
            pool1: MaxPool2d::new(2),
            conv2: conv3x3(c1, c2, device)?,
            pool2: MaxPool2d::new(2),
            fc1: Linear::new(c2 * 7 * 7, 128, device)?,
            fc2: Linear::new(128, 10, device)?,
        })
    }
}

impl Forward for Cnn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = self.pool1.forward(&self.conv1.forward(x)?.relu()?)?;
        let x = self.pool2.forward(&self.conv2.forward(&x)?.relu()?)?;
        self.fc2.forward(&self.fc1.forward(&x.flatten(1, -1)?)?.relu()?)
    }
}

/// The benchmark's `LSTMClassifier`: an `nn::LSTM` (batch first) and a `Linear` head on the
/// output of the last time step (`lstm.weight_ih_l0`, ..., `head.bias` in the state dict).
#[derive(Module)]
pub struct LstmClassifier {
    lstm: LSTM,
    head: Linear,
}

impl LstmClassifier {
    /// `LSTM(input, hidden, layers, batch_first=True)` then `Linear(hidden, classes)`.
    pub fn new(input: usize, hidden: usize, layers: usize, classes: usize, device: Device) -> Result<Self> {
        let config = RecurrentConfig {
            num_layers: layers,
            batch_first: true,
            ..Default::default()
        };
        Ok(LstmClassifier {
            lstm: LSTM::with_config(input, hidden, config, device)?,
            head: Linear::new(hidden, classes, device)?,
        })
    }
}

impl Forward for LstmClassifier {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let out = self.lstm.forward(x)?;
        self.head.forward(&out.select(1, -1)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember::nn::ModuleExt;
    use ember::DType;

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
    fn gpt2_init_draws_small_weights_zero_biases_and_keeps_the_head_tied() -> Result<()> {
        ember::manual_seed(0)?;
        let gpt = Gpt::new(64, 16, 32, 2, 2, Device::Cpu)?;
        gpt.init_gpt2_weights()?;
        let std = |t: &Tensor| -> Result<f64> {
            let v = t.to_vec::<f32>()?;
            let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
            Ok((v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt())
        };
        let named: Vec<(String, Tensor)> = gpt.named_parameters();
        let get = |n: &str| {
            named
                .iter()
                .find(|(k, _)| k == n)
                .map(|(_, t)| t.clone())
                .unwrap()
        };
        assert!((std(&get("wte.weight"))? - 0.02).abs() < 0.002);
        assert!((std(&get("blocks.0.qkv.weight"))? - 0.02).abs() < 0.002);
        // Residual projections: 0.02 / sqrt(2 * layers) = 0.01.
        assert!((std(&get("blocks.1.fc2.weight"))? - 0.01).abs() < 0.001);
        assert!((std(&get("blocks.1.proj.weight"))? - 0.01).abs() < 0.002);
        assert!(get("blocks.0.fc.bias").to_vec::<f32>()?.iter().all(|&x| x == 0.0));
        assert!(get("ln_f.weight").to_vec::<f32>()?.iter().all(|&x| x == 1.0));
        assert!(gpt.head.weight.is_same(&gpt.wte.weight), "the head stays tied");
        assert_eq!((gpt.wpe.weight.dims()[0], gpt.wte.weight.dims()[0]), (16, 64));
        Ok(())
    }

    /// GPT-2's forward as it was before the fused residual add: `x + proj(..)`, then `ln2`.
    fn unfused_block(blk: &Block, x: &Tensor) -> Result<Tensor> {
        let &[b, t, c] = x.dims() else {
            unreachable!("[B, T, C]")
        };
        let (b, t, c, h) = (b as isize, t as isize, c as isize, blk.h as isize);
        let qkv = blk.qkv.forward(&blk.ln1.forward(x)?)?.split(c as usize, 2)?;
        let heads = |p: &Tensor| p.view([b, t, h, c / h])?.transpose(1, 2);
        let (q, k, v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?);
        let y = F::scaled_dot_product_attention_with(&q, &k, &v, F::SdpaOptions::new().is_causal(true))?;
        let x = x.add(
            &blk.proj
                .forward(&y.transpose(1, 2)?.contiguous()?.view([b, t, c])?)?,
        )?;
        let mlp = F::gelu(&blk.fc.forward(&blk.ln2.forward(&x)?)?, F::GeluApproximate::Tanh)?;
        x.add(&blk.fc2.forward(&mlp)?)
    }

    fn unfused_gpt(gpt: &Gpt, idx: &Tensor) -> Result<Tensor> {
        let t = idx.dims()[1];
        let pos = Tensor::arange(0.0, t as f64, 1.0, DType::I64, idx.device())?;
        let mut x = gpt.wte.forward(idx)?.add(&gpt.wpe.forward(&pos)?)?;
        for blk in &gpt.blocks {
            x = unfused_block(blk, &x)?;
        }
        gpt.head.forward(&gpt.ln_f.forward(&x)?)
    }

    /// The fused residual add + ln2 (issue 37) leaves GPT-2's logits and every parameter's
    /// gradient as the unfused forward gives them on the CPU in f32 (the fused op is the
    /// composition's values bit for bit there; the bound allows a reordered sum), with the
    /// parameter names unchanged.
    #[test]
    fn gpt2_with_the_fused_residual_add_keeps_logits_and_gradients() -> Result<()> {
        ember::manual_seed(3)?;
        let gpt = Gpt::new(50, 8, 32, 2, 4, Device::Cpu)?;
        gpt.init_gpt2_weights()?;
        let idx = Tensor::from_vec(
            (0..2 * 8).map(|i| (i * 7 % 50) as i64).collect::<Vec<_>>(),
            [2, 8],
            Device::Cpu,
        )?;
        let target = Tensor::from_vec(
            (0..2 * 8).map(|i| (i * 3 % 50) as i64).collect::<Vec<_>>(),
            [16],
            Device::Cpu,
        )?;
        let run = |f: &dyn Fn() -> Result<Tensor>| -> Result<(Vec<f32>, Vec<(String, Vec<f32>)>)> {
            gpt.zero_grad()?;
            let logits = f()?;
            F::cross_entropy(&logits.view([16, 50])?, &target)?.backward()?;
            let grads = gpt
                .named_parameters()
                .into_iter()
                .map(|(n, p)| Ok((n, p.grad().expect("every parameter learns").to_vec::<f32>()?)))
                .collect::<Result<Vec<_>>>()?;
            Ok((logits.to_vec::<f32>()?, grads))
        };
        let (logits, grads) = run(&|| gpt.forward(&idx))?;
        let (e_logits, e_grads) = run(&|| unfused_gpt(&gpt, &idx))?;
        let close = |a: &[f32], e: &[f32]| {
            a.iter()
                .zip(e)
                .all(|(a, e)| (a - e).abs() <= 1e-6 + 1e-5 * e.abs())
        };
        assert!(close(&logits, &e_logits), "logits moved");
        assert_eq!(grads.len(), e_grads.len());
        assert!(grads.iter().any(|(n, _)| n == "blocks.1.ln2.weight"));
        for ((n, g), (en, eg)) in grads.iter().zip(&e_grads) {
            assert_eq!(n, en);
            assert!(close(g, eg), "{n}'s gradient moved");
        }
        Ok(())
    }

    #[test]
    fn a_checkpointed_block_computes_the_blocks_values_and_gradients() -> Result<()> {
        let block = Block::new(8, 2, Device::Cpu)?;
        let wrapped = Checkpointed::new(block.clone());
        let names: Vec<String> = wrapped.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names[0], "_checkpoint_wrapped_module.ln1.weight");
        let x = Tensor::randn([2, 3, 8], DType::F32, Device::Cpu)?.requires_grad_(true)?;
        let run = |m: &dyn Forward| -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
            m.zero_grad()?;
            x.set_grad(None)?;
            let y = m.forward(&x)?;
            y.mul(&y)?.sum_all()?.backward()?;
            let mut grads = vec![x.grad().unwrap().to_vec::<f32>()?];
            for p in m.parameters() {
                grads.push(p.grad().unwrap().to_vec::<f32>()?);
            }
            Ok((y.to_vec::<f32>()?, grads))
        };
        // The same parameters (shared handles): the same values, bit for bit.
        assert_eq!(run(&wrapped)?, run(&block)?);
        Ok(())
    }

    #[test]
    fn fashion_models_map_images_to_ten_logits() -> Result<()> {
        let x = Tensor::randn([3, 1, 28, 28], DType::F32, Device::Cpu)?;
        assert_eq!(
            mlp(&[784, 16, 10], true, Device::Cpu)?.forward(&x)?.dims(),
            &[3, 10]
        );
        let cnn = Cnn::new(1, 4, 8, Device::Cpu)?;
        assert_eq!(cnn.forward(&x)?.dims(), &[3, 10]);
        let names: Vec<String> = cnn.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [
                "conv1.weight",
                "conv1.bias",
                "conv2.weight",
                "conv2.bias",
                "fc1.weight",
                "fc1.bias",
                "fc2.weight",
                "fc2.bias"
            ]
        );
        Ok(())
    }
}

/// One pre-LayerNorm transformer block of GPT-2 (`Block` of `torch_reference.py`): causal
/// self-attention over `h` heads from one fused `qkv` projection, then a tanh-GELU MLP (4×),
/// each added to the residual stream. The attention's add and `ln2` run as one fused op
/// ([`LayerNorm::forward_residual`]); the MLP's add stays a plain add, since the next block's
/// `ln1` (or `ln_f`) sits behind the block boundary that `Checkpointed` and FSDP's wrappers
/// keep (one tensor in, one out).
#[derive(Module, Clone)]
pub struct Block {
    ln1: LayerNorm,
    qkv: Linear,
    proj: Linear,
    ln2: LayerNorm,
    fc: Linear,
    fc2: Linear,
    #[module(skip)]
    h: usize,
}

impl Block {
    pub fn new(d: usize, h: usize, device: Device) -> Result<Block> {
        Ok(Block {
            ln1: LayerNorm::new(&[d], device)?,
            qkv: Linear::new(d, 3 * d, device)?,
            proj: Linear::new(d, d, device)?,
            ln2: LayerNorm::new(&[d], device)?,
            fc: Linear::new(d, 4 * d, device)?,
            fc2: Linear::new(4 * d, d, device)?,
            h,
        })
    }
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let &[b, t, c] = x.dims() else {
            return Err(ember::Error::invalid(
                "Block",
                format!("expected [B, T, C], got {}", x.shape()),
            ));
        };
        let (b, t, c, h) = (b as isize, t as isize, c as isize, self.h as isize);
        let qkv = self.qkv.forward(&self.ln1.forward(x)?)?.split(c as usize, 2)?;
        let heads = |p: &Tensor| p.view([b, t, h, c / h])?.transpose(1, 2);
        let (q, k, v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?);
        let y = F::scaled_dot_product_attention_with(&q, &k, &v, F::SdpaOptions::new().is_causal(true))?;
        // The attention's residual add and ln2 in one kernel (issue 37: `x + proj(y)`, then
        // `ln2` of it, the same values and gradients).
        let attn = self
            .proj
            .forward(&y.transpose(1, 2)?.contiguous()?.view([b, t, c])?)?;
        let (x, h) = self.ln2.forward_residual(x, &attn)?;
        let mlp = F::gelu(&self.fc.forward(&h)?, F::GeluApproximate::Tanh)?;
        x.add(&self.fc2.forward(&mlp)?)
    }
}

/// A module whose forward runs under activation checkpointing (PyTorch's
/// `checkpoint_wrapper`, under the same parameter-name prefix): backward recomputes its
/// forward instead of keeping its activations (ember-nn's `checkpoint`). Applied to each block
/// before `fully_shard`, as PyTorch's recipe for models too large for one GPU.
#[derive(Module, Clone)]
pub struct Checkpointed<M: Module> {
    _checkpoint_wrapped_module: M,
}

impl<M: Module> Checkpointed<M> {
    pub fn new(module: M) -> Checkpointed<M> {
        Checkpointed {
            _checkpoint_wrapped_module: module,
        }
    }
}

impl<M: Forward + Clone + Send + Sync + 'static> Forward for Checkpointed<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ember::nn::checkpoint::checkpoint(&self._checkpoint_wrapped_module, x)
    }
}

/// GPT-2 (`GPT` of `torch_reference.py`): token and position embeddings, `layers` blocks, a
/// final LayerNorm and the output head, whose weight is the token embedding's (tied).
///
/// `B` is what holds each block: a [`Block`], or a wrapper of one (an `FSDPModule<Block>`
/// when each block is sharded, as `fsdp_gpt2` and `ember train --shard` do), chosen by
/// [`Gpt::new_with`].
#[derive(Module, Clone)]
pub struct Gpt<B: Module = Block> {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<B>,
    ln_f: LayerNorm,
    head: Linear,
}

impl Gpt {
    pub fn new(
        vocab: usize,
        seq: usize,
        d: usize,
        layers: usize,
        heads: usize,
        device: Device,
    ) -> Result<Gpt> {
        Gpt::new_with(vocab, seq, d, layers, heads, device, Ok)
    }

    /// Puts each block into what `wrap` makes of it (after the whole model is drawn, so the
    /// weights are [`Gpt::new`]'s for a seed): `fully_shard` on every block, as FSDP2's recipe.
    pub fn map_blocks<C: Module>(self, wrap: impl FnMut(Block) -> Result<C>) -> Result<Gpt<C>> {
        Ok(Gpt {
            wte: self.wte,
            wpe: self.wpe,
            blocks: self.blocks.into_iter().map(wrap).collect::<Result<Vec<_>>>()?,
            ln_f: self.ln_f,
            head: self.head,
        })
    }

    /// GPT-2's initialization (nanoGPT's `_init_weights`): every weight matrix and embedding
    /// drawn from N(0, 0.02), the residual projections (`proj`, `fc2`) from N(0, 0.02/√(2·layers)),
    /// biases zero, LayerNorms left at (1, 0). [`Gpt::new`] keeps PyTorch's layer defaults (what
    /// the benchmark times); with those the tied head starts from N(0, 1) embeddings and the
    /// first losses are far above ln(vocab).
    pub fn init_gpt2_weights(&self) -> Result<()> {
        use ember::nn::{init, ModuleExt};
        let _g = ember::no_grad();
        let residual_std = 0.02 / (2.0 * self.blocks.len().max(1) as f64).sqrt();
        for (name, p) in self.named_parameters() {
            let is_norm = name.starts_with("ln_f.") || name.contains(".ln1.") || name.contains(".ln2.");
            if is_norm {
                continue;
            }
            if name.ends_with(".bias") {
                init::zeros_(&p)?;
            } else if name.ends_with("proj.weight") || name.ends_with("fc2.weight") {
                init::normal_(&p, 0.0, residual_std)?;
            } else {
                init::normal_(&p, 0.0, 0.02)?;
            }
        }
        Ok(())
    }
}

impl<B: Module> Gpt<B> {
    /// [`Gpt::new`] with each block put into what `wrap` makes of it as soon as it is drawn
    /// (the random draws, and so the weights for a seed, are [`Gpt::new`]'s). A model too
    /// large for one device never exists whole there: `wrap = fully_shard` keeps this rank's
    /// rows of each block and releases the rest before the next block is drawn.
    pub fn new_with(
        vocab: usize,
        seq: usize,
        d: usize,
        layers: usize,
        heads: usize,
        device: Device,
        mut wrap: impl FnMut(Block) -> Result<B>,
    ) -> Result<Gpt<B>> {
        let wte = Embedding::new(vocab, d, device)?;
        let wpe = Embedding::new(seq, d, device)?;
        let blocks = (0..layers)
            .map(|_| wrap(Block::new(d, heads, device)?))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = LayerNorm::new(&[d], device)?;
        let mut head = Linear::with_config(d, vocab, LinearConfig { bias: false }, device)?;
        head.weight = wte.weight.clone();
        Ok(Gpt {
            wte,
            wpe,
            blocks,
            ln_f,
            head,
        })
    }
}

impl<B: Forward> Forward for Gpt<B> {
    /// Logits `[B, T, vocab]` of the token indices `idx` (`[B, T]`, int64).
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        let t = idx.dims().get(1).copied().unwrap_or(0);
        let pos = Tensor::arange(0.0, t as f64, 1.0, DType::I64, idx.device())?;
        let mut x = self.wte.forward(idx)?.add(&self.wpe.forward(&pos)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.head.forward(&self.ln_f.forward(&x)?)
    }
}
