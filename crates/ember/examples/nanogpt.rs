//! nanoGPT (Karpathy's `model.py` and `train.py`, line for line where Rust allows): a GPT with
//! pre-LayerNorm blocks, causal self-attention through `F.scaled_dot_product_attention`
//! (cuDNN's fused attention on a GPU), a tanh-GELU MLP, weights tied between the token
//! embedding and the head, nanoGPT's initialization (normal 0.02, residual projections scaled
//! by `1/√(2·n_layer)`), AdamW with weight decay on the matrices only, bfloat16 autocast on a
//! GPU, and at the end a sample of generated text (temperature and top-k).
//!
//! Text is byte-level (a vocabulary of 256: any file works, any language). Without `--data` it
//! trains on ember's own README, bundled into the program; any other text file works, e.g.
//! `--data /usr/share/games/fortunes/fortunes` (Debian's `fortunes` package). The default
//! configuration is tiny so that it trains on a CPU in seconds (CI runs it: 40 steps); on a GPU try
//! `--layers 6 --heads 6 --embd 384 --block 256 --batch 64 --steps 2000` (nanoGPT's
//! Shakespeare-char model). It prints the loss on held-out text every `--eval-every` steps and
//! fails unless the last one is well under ln(256) = 5.55, the loss of a uniform guess.
//!
//! Run: `cargo run --release -p ember --example nanogpt -- [--data FILE] [--steps N] ...`

use ember::nn::layers::LinearConfig;
use ember::nn::optim::{AdamConfig, AdamW, ParamGroup};
use ember::nn::{init, Dropout, Embedding, LayerNorm, Linear};
use ember::prelude::*;
use std::time::Instant;

/// nanoGPT's `GPTConfig`.
#[derive(Debug, Clone, Copy)]
struct GptConfig {
    block_size: usize,
    vocab_size: usize,
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    dropout: f64,
}

/// `CausalSelfAttention`: one projection to q, k, v, attention over the heads, a projection
/// back.
#[derive(Module)]
struct CausalSelfAttention {
    c_attn: Linear,
    c_proj: Linear,
    resid_dropout: Dropout,
    #[module(skip)]
    n_head: usize,
    #[module(skip)]
    dropout: f64,
}

impl CausalSelfAttention {
    fn new(c: &GptConfig, device: Device) -> Result<Self> {
        Ok(CausalSelfAttention {
            c_attn: Linear::new(c.n_embd, 3 * c.n_embd, device)?,
            c_proj: Linear::new(c.n_embd, c.n_embd, device)?,
            resid_dropout: Dropout::new(c.dropout)?,
            n_head: c.n_head,
            dropout: c.dropout,
        })
    }
}

impl Forward for CausalSelfAttention {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let &[b, t, c] = x.dims() else {
            return Err(Error::invalid("CausalSelfAttention", "expected [B, T, C]"));
        };
        let (b, t, c, h) = (b as isize, t as isize, c as isize, self.n_head as isize);
        // q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        let qkv = self.c_attn.forward(x)?.split(c as usize, 2)?;
        // k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        let heads = |p: &Tensor| p.view([b, t, h, c / h])?.transpose(1, 2);
        let (q, k, v) = (heads(&qkv[0])?, heads(&qkv[1])?, heads(&qkv[2])?);
        let dropout_p = if self.is_training() { self.dropout } else { 0.0 };
        let options = F::SdpaOptions::new().is_causal(true).dropout_p(dropout_p);
        let y = F::scaled_dot_product_attention_with(&q, &k, &v, options)?;
        // y = y.transpose(1, 2).contiguous().view(B, T, C)
        let y = y.transpose(1, 2)?.contiguous()?.view([b, t, c])?;
        self.resid_dropout.forward(&self.c_proj.forward(&y)?)
    }
}

/// `MLP`: 4× wider, tanh-GELU, back.
#[derive(Module)]
struct Mlp {
    c_fc: Linear,
    c_proj: Linear,
    dropout: Dropout,
}

impl Forward for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = F::gelu(&self.c_fc.forward(x)?, F::GeluApproximate::Tanh)?;
        self.dropout.forward(&self.c_proj.forward(&x)?)
    }
}

#[derive(Module)]
struct Block {
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (x + &self.attn.forward(&self.ln_1.forward(x)?)?)?;
        &x + &self.mlp.forward(&self.ln_2.forward(&x)?)?
    }
}

#[derive(Module)]
struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    drop: Dropout,
    h: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
    #[module(skip)]
    config: GptConfig,
}

impl Gpt {
    fn new(config: GptConfig, device: Device) -> Result<Gpt> {
        let c = &config;
        let h = (0..c.n_layer)
            .map(|_| {
                Ok(Block {
                    ln_1: LayerNorm::new(&[c.n_embd], device)?,
                    attn: CausalSelfAttention::new(c, device)?,
                    ln_2: LayerNorm::new(&[c.n_embd], device)?,
                    mlp: Mlp {
                        c_fc: Linear::new(c.n_embd, 4 * c.n_embd, device)?,
                        c_proj: Linear::new(4 * c.n_embd, c.n_embd, device)?,
                        dropout: Dropout::new(c.dropout)?,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let wte = Embedding::new(c.vocab_size, c.n_embd, device)?;
        let mut lm_head = Linear::with_config(c.n_embd, c.vocab_size, LinearConfig { bias: false }, device)?;
        // self.transformer.wte.weight = self.lm_head.weight  # weight tying
        lm_head.weight = wte.weight.clone();
        let model = Gpt {
            wte,
            wpe: Embedding::new(c.block_size, c.n_embd, device)?,
            drop: Dropout::new(c.dropout)?,
            h,
            ln_f: LayerNorm::new(&[c.n_embd], device)?,
            lm_head,
            config,
        };
        // self.apply(self._init_weights), then the scaled init of the residual projections.
        let _g = no_grad();
        for (name, p) in model.named_parameters() {
            if name.ends_with("c_proj.weight") {
                init::normal_(&p, 0.0, 0.02 / (2.0 * c.n_layer as f64).sqrt())?;
            } else if name.ends_with(".bias") && !name.contains("ln_") {
                init::zeros_(&p)?;
            } else if name.ends_with(".weight") && !name.contains("ln_") {
                init::normal_(&p, 0.0, 0.02)?;
            }
        }
        Ok(model)
    }

    /// Logits `[B, T, vocab]` of the byte indices `idx` (`[B, T]`).
    fn forward(&self, idx: &Tensor) -> Result<Tensor> {
        let t = idx.dims()[1];
        let pos = Tensor::arange_i64(0, t as i64, 1, idx.device())?;
        let mut x = self.drop.forward(&(&self.wte.forward(idx)? + &self.wpe.forward(&pos)?)?)?;
        for block in &self.h {
            x = block.forward(&x)?;
        }
        self.lm_head.forward(&self.ln_f.forward(&x)?)
    }

    /// nanoGPT's `configure_optimizers`: one AdamW of two param groups, weight decay on the
    /// parameters of 2 or more dims (the matrices and embeddings), none on biases and LayerNorm
    /// weights.
    fn configure_optimizers(&self, weight_decay: f64, lr: f64) -> Result<AdamW> {
        let (decay, no_decay): (Vec<Tensor>, Vec<Tensor>) =
            self.parameters().into_iter().partition(|p| p.rank() >= 2);
        let optim_groups = vec![
            ParamGroup::new(decay).weight_decay(weight_decay),
            ParamGroup::new(no_decay).weight_decay(0.0),
        ];
        // The fused multi-tensor step on every device (nanoGPT's `fused=True` on CUDA).
        AdamW::with_groups(optim_groups, AdamConfig { lr, betas: (0.9, 0.95), ..AdamConfig::adamw() })
    }

    /// nanoGPT's `generate`: `max_new_tokens` times, the logits of the last position (of the
    /// context cropped to `block_size`) over `temperature`, cut to the `top_k` largest, one
    /// byte drawn from their softmax and appended.
    fn generate(
        &self,
        idx: &Tensor,
        max_new_tokens: usize,
        temperature: f64,
        top_k: usize,
    ) -> Result<Tensor> {
        let _g = no_grad();
        let mut idx = idx.clone();
        for _ in 0..max_new_tokens {
            let t = idx.dims()[1];
            let cond =
                idx.narrow(1, t.saturating_sub(self.config.block_size), t.min(self.config.block_size))?;
            let logits = self.forward(&cond)?.select(1, -1)?.to_dtype(DType::F32)?.div_scalar(temperature)?;
            let (v, _) = logits.topk(top_k.min(self.config.vocab_size), -1, true)?;
            let kth = v.narrow(-1, top_k.min(self.config.vocab_size) - 1, 1)?;
            let logits = logits.masked_fill(&logits.lt(&kth)?, f64::NEG_INFINITY)?;
            let next = logits.softmax(-1)?.multinomial(1, true)?;
            idx = Tensor::cat(&[idx, next], 1)?;
        }
        Ok(idx)
    }
}

/// The command line: `--name value` pairs over nanoGPT's defaults for a tiny model.
struct Args {
    data: Option<String>,
    steps: usize,
    batch: usize,
    block: usize,
    layers: usize,
    heads: usize,
    embd: usize,
    lr: f64,
    eval_every: usize,
    sample: usize,
    device: Option<String>,
}

fn parse_args() -> std::result::Result<Args, String> {
    let mut a = Args {
        data: None,
        steps: 40,
        batch: 8,
        block: 32,
        layers: 2,
        heads: 2,
        embd: 64,
        lr: 3e-3,
        eval_every: 20,
        sample: 120,
        device: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let num = |v: &str| v.parse::<usize>().map_err(|_| format!("{flag} takes a whole number, got {v:?}"));
        match flag.as_str() {
            "--data" => a.data = Some(value),
            "--steps" => a.steps = num(&value)?,
            "--batch" => a.batch = num(&value)?,
            "--block" => a.block = num(&value)?,
            "--layers" => a.layers = num(&value)?,
            "--heads" => a.heads = num(&value)?,
            "--embd" => a.embd = num(&value)?,
            "--eval-every" => a.eval_every = num(&value)?.max(1),
            "--sample" => a.sample = num(&value)?,
            "--lr" => a.lr = value.parse().map_err(|_| format!("--lr takes a number, got {value:?}"))?,
            "--device" => a.device = Some(value),
            _ => return Err(format!("unknown flag {flag}; flags: --data --steps --batch --block --layers --heads --embd --lr --eval-every --sample --device")),
        }
    }
    if a.embd % a.heads != 0 {
        return Err(format!("--embd ({}) must be a multiple of --heads ({})", a.embd, a.heads));
    }
    Ok(a)
}

/// A batch of `batch` windows of `block + 1` bytes at random offsets of `data`: inputs and
/// next-byte targets, `[batch, block]` each (nanoGPT's `get_batch`).
fn get_batch(data: &[u8], batch: usize, block: usize, device: Device) -> Result<(Tensor, Tensor)> {
    let ix = Tensor::randint(0, (data.len() - block) as i64, [batch], Device::Cpu)?.to_vec::<i64>()?;
    let mut x = Vec::with_capacity(batch * block);
    let mut y = Vec::with_capacity(batch * block);
    for &i in &ix {
        let i = i as usize;
        x.extend(data[i..i + block].iter().map(|&b| b as i64));
        y.extend(data[i + 1..i + 1 + block].iter().map(|&b| b as i64));
    }
    Ok((
        Tensor::from_vec(x, [batch, block], Device::Cpu)?.to(device)?,
        Tensor::from_vec(y, [batch, block], Device::Cpu)?.to(device)?,
    ))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let text: Vec<u8> = match &args.data {
        Some(path) => std::fs::read(path).map_err(|e| format!("--data {path}: {e}"))?,
        None => include_bytes!("../../../README.md").to_vec(),
    };
    if text.len() < 4 * (args.block + 1) {
        return Err(format!("the text has {} bytes: too short for --block {}", text.len(), args.block).into());
    }
    let device = match args.device.as_deref() {
        Some(d) => d.parse::<Device>()?,
        None if ember::cuda::is_available() => Device::Cuda(0),
        None => Device::Cpu,
    };
    ember::manual_seed(1337)?;
    let n = text.len() * 9 / 10;
    let (train, val) = (&text[..n], &text[n..]);
    let config = GptConfig {
        block_size: args.block,
        vocab_size: 256,
        n_layer: args.layers,
        n_head: args.heads,
        n_embd: args.embd,
        dropout: 0.0,
    };
    let model = Gpt::new(config, device)?;
    let count: usize = model.parameters().iter().map(|p| p.numel()).sum();
    println!(
        "nanogpt: {} bytes of text ({}), {count} parameters, {} on {device}",
        text.len(),
        args.data.as_deref().unwrap_or("ember's README"),
        format_args!("{} layers × {} heads × {}", args.layers, args.heads, args.embd)
    );
    let mut opt = model.configure_optimizers(0.1, args.lr)?;
    let autocast = |d: Device| -> Result<Option<ember::amp::AutocastGuard>> {
        Ok(if d.is_cuda() { Some(ember::amp::autocast(d.device_type(), DType::BF16)?) } else { None })
    };
    let loss_of = |x: &Tensor, y: &Tensor| -> Result<Tensor> {
        let _ac = autocast(device)?;
        let logits = model.forward(x)?;
        F::cross_entropy(&logits.view([-1, 256])?, &y.view([-1])?)
    };
    let estimate = |data: &[u8]| -> Result<f64> {
        let _g = no_grad();
        model.eval();
        let mut total = 0.0;
        for _ in 0..4 {
            let (x, y) = get_batch(data, args.batch, args.block, device)?;
            total += loss_of(&x, &y)?.item_f64()?;
        }
        model.train();
        Ok(total / 4.0)
    };
    let start = Instant::now();
    let mut last_val = f64::INFINITY;
    for step in 0..=args.steps {
        if step % args.eval_every == 0 || step == args.steps {
            last_val = estimate(val)?;
            println!(
                "step {step:>5}: train loss {:.4}, val loss {last_val:.4} ({:.1} s)",
                estimate(train)?,
                start.elapsed().as_secs_f64()
            );
        }
        if step == args.steps {
            break;
        }
        let (x, y) = get_batch(train, args.batch, args.block, device)?;
        opt.zero_grad()?;
        loss_of(&x, &y)?.backward()?;
        opt.step()?;
    }
    model.eval();
    let prompt = Tensor::from_vec(vec![b'\n' as i64], [1, 1], device)?;
    let sample = model.generate(&prompt, args.sample, 0.8, 40)?.to_vec::<i64>()?;
    let bytes: Vec<u8> = sample.iter().map(|&b| b as u8).collect();
    println!("--- sample ---\n{}\n--------------", String::from_utf8_lossy(&bytes));
    let uniform = 256f64.ln();
    if !(last_val < uniform - 1.0) {
        return Err(format!(
            "the model did not learn: validation loss {last_val:.3} against {uniform:.3} for a uniform guess"
        )
        .into());
    }
    Ok(())
}
