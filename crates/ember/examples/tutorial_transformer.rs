//! PyTorch's "Language Modeling with nn.Transformer": the `TransformerModel` (`Embedding`
//! scaled by √d_model, sinusoidal `PositionalEncoding`, an `nn.TransformerEncoder` under the
//! causal mask, a `Linear` to the vocabulary) trained to predict the next token with
//! `CrossEntropyLoss`, SGD, gradient clipping and `StepLR`, its data batchified into columns
//! and cut into `bptt`-long pieces by `get_batch`, printing the validation loss and perplexity.
//!
//! The text is made up in the program: runs of consecutive token ids (`7 8 9 10 11`, then a new
//! run from a random id), standing in for WikiText-2, so the next token is predictable inside a
//! run and the perplexity falls from about the vocabulary size (20) towards 2. The model is
//! smaller than the tutorial's and trains two epochs of 15 steps.
//!
//! Run: `cargo run --release -p ember --example tutorial_transformer`

use ember::cuda;
use ember::nn::layers::{EncoderMasks, TransformerLayerConfig};
use ember::nn::optim::{clip_grad_norm_, LRScheduler, SgdConfig, StepLR, SGD};
use ember::nn::{
    CrossEntropyLoss, Dropout, Embedding, Linear, Transformer, TransformerEncoder, TransformerEncoderLayer,
};
use ember::prelude::*;

#[derive(Module)]
struct PositionalEncoding {
    dropout: Dropout,
    #[module(buffer)]
    pe: Tensor,
}

impl PositionalEncoding {
    fn new(d_model: usize, dropout: f64, max_len: usize, device: Device) -> Result<Self> {
        let position = Tensor::arange(0.0, max_len as f64, 1.0, DType::F32, device)?.unsqueeze(1)?;
        let div_term = Tensor::arange(0.0, d_model as f64, 2.0, DType::F32, device)?
            .mul_scalar(-(10000f64.ln()) / d_model as f64)?
            .exp()?;
        let angle = (&position * &div_term)?;
        // pe[:, 0, 0::2] = sin(angle); pe[:, 0, 1::2] = cos(angle)
        let pe = Tensor::zeros([max_len, 1, d_model], DType::F32, device)?;
        let pe = pe.slice_scatter(&angle.sin()?.unsqueeze(1)?, 2, 0, isize::MAX, 2)?;
        let pe = pe.slice_scatter(&angle.cos()?.unsqueeze(1)?, 2, 1, isize::MAX, 2)?;
        Ok(PositionalEncoding { dropout: Dropout::new(dropout)?, pe })
    }
}

impl Forward for PositionalEncoding {
    /// `x`: `[seq_len, batch_size, embedding_dim]`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.dropout.forward(&(x + &self.pe.narrow(0, 0, x.dims()[0])?)?)
    }
}

#[derive(Module)]
struct TransformerModel {
    d_model: usize,
    pos_encoder: PositionalEncoding,
    transformer_encoder: TransformerEncoder,
    embedding: Embedding,
    linear: Linear,
}

impl TransformerModel {
    fn new(
        ntoken: usize,
        d_model: usize,
        nhead: usize,
        d_hid: usize,
        nlayers: usize,
        dropout: f64,
        device: Device,
    ) -> Result<Self> {
        let config = TransformerLayerConfig { dim_feedforward: d_hid, dropout, ..Default::default() };
        let encoder_layers = TransformerEncoderLayer::with_config(d_model, nhead, config, device)?;
        let model = TransformerModel {
            d_model,
            pos_encoder: PositionalEncoding::new(d_model, dropout, 5000, device)?,
            transformer_encoder: TransformerEncoder::new(&encoder_layers, nlayers, None)?,
            embedding: Embedding::new(ntoken, d_model, device)?,
            linear: Linear::new(d_model, ntoken, device)?,
        };
        // init_weights
        let _no_grad = ember::no_grad();
        model.embedding.weight.uniform_(-0.1, 0.1)?;
        model.linear.weight.uniform_(-0.1, 0.1)?;
        model.linear.bias.as_ref().expect("Linear has a bias").zero_()?;
        Ok(model)
    }

    /// `src`: `[seq_len, batch_size]` token ids; returns `[seq_len, batch_size, ntoken]`. Without
    /// a mask, each position sees itself and those before it (the causal mask).
    fn forward(&self, src: &Tensor, src_mask: Option<&Tensor>) -> Result<Tensor> {
        let causal;
        let src_mask = match src_mask {
            Some(mask) => mask,
            None => {
                causal = Transformer::generate_square_subsequent_mask(src.dims()[0], src.device())?;
                &causal
            }
        };
        let src = self.embedding.forward(src)?.mul_scalar((self.d_model as f64).sqrt())?;
        let src = self.pos_encoder.forward(&src)?;
        let masks = EncoderMasks { mask: Some(src_mask), is_causal: true, ..Default::default() };
        self.linear.forward(&self.transformer_encoder.forward_with(&src, masks)?)
    }
}

/// `len` tokens of runs of consecutive ids (mod `ntokens`), each run 4 to 11 tokens long.
fn made_up_text(len: usize, ntokens: usize) -> Result<Vec<i64>> {
    let draws = Tensor::randint(0, 1 << 20, [len], Device::Cpu)?.to_vec::<i64>()?;
    let (mut text, mut i) = (Vec::with_capacity(len + 11), 0);
    while text.len() < len {
        let (start, run) = (draws[i] % ntokens as i64, 4 + draws[i + 1] % 8);
        text.extend((0..run).map(|k| (start + k) % ntokens as i64));
        i += 2;
    }
    text.truncate(len);
    Ok(text)
}

/// The text as `bsz` columns, `[len / bsz, bsz]` (the tutorial's `batchify`).
fn batchify(data: Vec<i64>, bsz: usize, device: Device) -> Result<Tensor> {
    let seq_len = data.len() / bsz;
    Tensor::from_vec(data[..seq_len * bsz].to_vec(), [bsz, seq_len], device)?.t()?.contiguous()
}

/// Rows `i..i + bptt` as input and the same rows one token on, flattened, as target.
fn get_batch(source: &Tensor, i: usize, bptt: usize) -> Result<(Tensor, Tensor)> {
    let seq_len = bptt.min(source.dims()[0] - 1 - i);
    Ok((source.narrow(0, i, seq_len)?, source.narrow(0, i + 1, seq_len)?.reshape([-1])?))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(0)?;
    let (ntokens, bptt) = (20, 16);
    let train_data = batchify(made_up_text(16 * 241, ntokens)?, 16, device)?;
    let val_data = batchify(made_up_text(8 * 65, ntokens)?, 8, device)?;

    // emsize, d_hid, nlayers, nhead, dropout: the tutorial's 200, 200, 2, 2, 0.2, smaller.
    let model = TransformerModel::new(ntokens, 32, 2, 64, 2, 0.1, device)?;
    let criterion = CrossEntropyLoss::new();
    let mut optimizer = SGD::new(model.parameters(), SgdConfig { lr: 5.0, ..Default::default() })?;
    let mut scheduler = StepLR::new(&mut optimizer, 1, 0.95)?;

    let evaluate = |model: &TransformerModel, eval_data: &Tensor| -> Result<f64> {
        model.eval();
        let _no_grad = ember::no_grad();
        let mut total_loss = 0.0;
        for i in (0..eval_data.dims()[0] - 1).step_by(bptt) {
            let (data, targets) = get_batch(eval_data, i, bptt)?;
            let seq_len = data.dims()[0];
            let output = model.forward(&data, None)?;
            total_loss +=
                seq_len as f64 * criterion.forward(&output.view((-1, ntokens))?, &targets)?.item_f64()?;
        }
        Ok(total_loss / (eval_data.dims()[0] - 1) as f64)
    };

    let initial = evaluate(&model, &val_data)?;
    println!("before training: valid loss {initial:5.2} | valid ppl {:8.2}", initial.exp());
    let mut val_loss = initial;
    for epoch in 1..=2 {
        model.train();
        let mut total_loss = 0.0;
        for (batch, i) in (0..train_data.dims()[0] - 1).step_by(bptt).enumerate() {
            let (data, targets) = get_batch(&train_data, i, bptt)?;
            let output = model.forward(&data, None)?;
            let loss = criterion.forward(&output.view((-1, ntokens))?, &targets)?;
            optimizer.zero_grad()?;
            loss.backward()?;
            clip_grad_norm_(&model.parameters(), 0.5, 2.0)?;
            optimizer.step()?;
            total_loss += loss.item_f64()?;
            if (batch + 1) % 5 == 0 {
                let cur_loss = total_loss / 5.0;
                println!(
                    "| epoch {epoch} | batch {:3} | lr {:.2} | loss {cur_loss:5.2} | ppl {:8.2}",
                    batch + 1,
                    scheduler.get_last_lr(),
                    cur_loss.exp()
                );
                total_loss = 0.0;
            }
        }
        val_loss = evaluate(&model, &val_data)?;
        println!("| end of epoch {epoch} | valid loss {val_loss:5.2} | valid ppl {:8.2}", val_loss.exp());
        scheduler.step(&mut optimizer);
    }
    if !(val_loss < 0.5 * initial) {
        return Err(format!("did not learn: valid loss {initial:.3} -> {val_loss:.3}").into());
    }
    Ok(())
}
