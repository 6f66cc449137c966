//! `ember train --model gpt2`: a byte-level GPT-2 ([`Gpt`] of `models.rs`, a vocabulary of the 256
//! byte values) trained on any text file with nanoGPT's `train.py` recipe: AdamW, a linear
//! warm-up then a cosine decay of the learning rate to a tenth, bfloat16 autocast on a GPU,
//! train and held-out losses every `--eval-interval` iterations, a checkpoint, and at the end a
//! sample of generated text (temperature and top-k, nanoGPT's `sample.py`).
//!
//! Data: the file's bytes (any language, any encoding), the first 90% to train on and the last
//! 10% held out, as nanoGPT's `prepare.py` splits; without `--data`, ember's own README, bundled
//! into the program. The default sizes depend on the device: on the CPU a tiny model that
//! learns in seconds even in a debug build (CI trains it), on a GPU nanoGPT's shakespeare-char
//! model (6 layers, 6 heads, 384 wide, 256 bytes of context, batches of 64) for 250 iterations
//! (on an H200 its held-out loss on the 28 KB README was lowest, about 3.0, near iteration 100
//! and rose to 4.8 by 500 while the training loss fell to 0.07: a larger text wants more).
//!
//! Note [GPT batches and resume]: batch `i` is `--batch-size` windows of `block_size + 1`
//! bytes at offsets hashed from (`--seed`, `i`), and the learning rate of iteration `i` is a
//! function of `i` (and the flags) alone, so a run resumed from a checkpoint (model, AdamW,
//! GradScaler, RNG states and the completed iterations, `checkpoint.rs`; sharded, a distributed
//! checkpoint, `dcp.rs`) trains on the same batches at the same rates as an uninterrupted run.
//! The batches are the same bytes on every device too, and the model is initialized on the CPU
//! and then moved, so one seed gives a GPU run and a CPU run the same start and the same data:
//! `tests/cli.rs` compares their loss curves. The loss estimates read fixed windows (their own
//! hash streams), so two evaluations differ only by the model.

use super::checkpoint::{load_checkpoint, save_checkpoint, Position};
use super::dcp;
use super::dist::Dist;
use super::fits::DoesNotFit;
use super::{progress_bar, AmpMode, CliResult, TrainArgs, PROGRESS_EVERY};
use crate::models::{Block, Checkpointed, Gpt};
use clap::Args;
use ember::amp::{GradScaler, GradScalerConfig};
use ember::distributed::{
    self, fully_shard, DdpOptions, DeviceMesh, DistributedDataParallel, FSDPModule, FullyShardOptions,
    MixedPrecisionPolicy, ShardedGradScaler,
};
use ember::nn::functional as F;
use ember::nn::optim::{clip_grad_norm_, AdamConfig, AdamW, Optimizer, ParamGroup};
use ember::nn::{Forward, Module, ModuleExt};
use ember::{cuda, DType, Device, Tensor};
use serde_json::json;
use std::io::IsTerminal;
use std::path::Path;
use std::time::Instant;

/// The text `--model gpt2` trains on without `--data`: ember's README.
const BUNDLED_TEXT: &str = include_str!("../../../../README.md");
/// Byte-level tokens: every byte value is one token.
const VOCAB: usize = 256;
/// Hash streams of the batch offsets (Note [GPT batches and resume]).
const TRAIN_BATCHES: u64 = 1;
const TRAIN_ESTIMATE: u64 = 2;
const VAL_ESTIMATE: u64 = 3;

/// Options of `ember train --model gpt2` (names after nanoGPT's config); each size defaults to
/// the tiny CPU configuration or the GPU one by the device.
#[derive(Debug, Args)]
#[command(next_help_heading = "GPT options (--model gpt2)")]
pub struct GptArgs {
    /// Transformer blocks (default 2 on the CPU, 6 on a GPU).
    #[arg(long)]
    n_layer: Option<usize>,
    /// Attention heads per block (default 2 on the CPU, 6 on a GPU).
    #[arg(long)]
    n_head: Option<usize>,
    /// Embedding width, a multiple of --n-head (default 32 on the CPU, 384 on a GPU).
    #[arg(long)]
    n_embd: Option<usize>,
    /// Context length in bytes (default 32 on the CPU, 256 on a GPU).
    #[arg(long)]
    block_size: Option<usize>,
    /// Training iterations, one batch each (default 100 on the CPU, 250 on a GPU: the GPU model
    /// overfits the bundled README after about 150; raise it for a larger text); a resumed run
    /// continues up to this number.
    #[arg(long, alias = "steps")]
    max_iters: Option<usize>,
    /// Iterations between two loss estimates (train and held-out, printed, and the
    /// --checkpoint written); default 25 on the CPU, 50 on a GPU.
    #[arg(long)]
    eval_interval: Option<usize>,
    /// Batches per loss estimate (default 2 on the CPU, 20 on a GPU).
    #[arg(long)]
    eval_iters: Option<usize>,
    /// Iterations of linear learning-rate warm-up (default a tenth of --max-iters, at most 100).
    #[arg(long)]
    warmup_iters: Option<usize>,
    /// The iteration where the cosine decay reaches a tenth of --lr (default --max-iters); a
    /// run that stops early and is resumed to a later --max-iters gives it to keep the
    /// schedule of the whole run.
    #[arg(long)]
    lr_decay_iters: Option<usize>,
    /// AdamW's decoupled weight decay, of the matrices and embeddings (biases and LayerNorm
    /// weights have none, as in nanoGPT).
    #[arg(long, default_value_t = 0.1)]
    weight_decay: f64,
    /// Clips the gradients' global 2-norm to this before every step (nanoGPT's `grad_clip`;
    /// 0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// Bytes of text to generate at the end (0: none).
    #[arg(long, default_value_t = 200)]
    sample_bytes: usize,
    /// Sampling temperature (0: always the most likely byte).
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    /// Sample from the K most likely bytes only.
    #[arg(long, value_name = "K", default_value_t = 40)]
    top_k: usize,
}

/// The resolved configuration of one run.
#[derive(Debug, Clone, Copy)]
struct Config {
    n_layer: usize,
    n_head: usize,
    n_embd: usize,
    block_size: usize,
    batch_size: usize,
    max_iters: usize,
    eval_interval: usize,
    eval_iters: usize,
    warmup_iters: usize,
    lr_decay_iters: usize,
    lr: f64,
    weight_decay: f64,
    grad_clip: f64,
}

impl Config {
    /// The flags over the device's defaults, checked.
    fn resolve(args: &TrainArgs, device: Device) -> CliResult<Config> {
        let g = &args.gpt;
        let gpu = device.is_cuda();
        let pick = |v: Option<usize>, cpu: usize, cuda: usize| v.unwrap_or(if gpu { cuda } else { cpu });
        let max_iters = pick(g.max_iters, 100, 250);
        let c = Config {
            n_layer: pick(g.n_layer, 2, 6),
            n_head: pick(g.n_head, 2, 6),
            n_embd: pick(g.n_embd, 32, 384),
            block_size: pick(g.block_size, 32, 256),
            batch_size: pick(args.batch_size, 4, 64),
            max_iters,
            eval_interval: pick(g.eval_interval, 25, 50),
            eval_iters: pick(g.eval_iters, 2, 20),
            warmup_iters: g.warmup_iters.unwrap_or((max_iters / 10).min(100)),
            lr_decay_iters: g.lr_decay_iters.unwrap_or(max_iters),
            lr: args.lr.unwrap_or(if gpu { 1e-3 } else { 3e-3 }),
            weight_decay: g.weight_decay,
            grad_clip: g.grad_clip,
        };
        for (flag, v) in [
            ("--n-layer", c.n_layer),
            ("--n-head", c.n_head),
            ("--n-embd", c.n_embd),
            ("--block-size", c.block_size),
            ("--batch-size", c.batch_size),
            ("--eval-interval", c.eval_interval),
            ("--eval-iters", c.eval_iters),
        ] {
            if v == 0 {
                return Err(format!("{flag} must be at least 1").into());
            }
        }
        if c.n_embd % c.n_head != 0 {
            return Err(format!(
                "--n-embd {} is not a multiple of --n-head {}: each head takes n_embd / n_head dimensions",
                c.n_embd, c.n_head
            )
            .into());
        }
        if !(c.lr > 0.0 && c.lr.is_finite()) || !(c.weight_decay >= 0.0) || !(c.grad_clip >= 0.0) {
            return Err("--lr must be positive, --weight-decay and --grad-clip non-negative".into());
        }
        if !(g.temperature >= 0.0 && g.temperature.is_finite()) || g.top_k == 0 {
            return Err("--temperature must be a number >= 0 and --top-k at least 1".into());
        }
        Ok(c)
    }

    /// The learning rate of iteration `it` (nanoGPT's `get_lr`): linear warm-up over
    /// `warmup_iters`, then a cosine decay to a tenth of `lr` at `lr_decay_iters`.
    fn lr_at(&self, it: usize) -> f64 {
        let min_lr = self.lr / 10.0;
        if it < self.warmup_iters {
            return self.lr * (it + 1) as f64 / (self.warmup_iters + 1) as f64;
        }
        if it >= self.lr_decay_iters {
            return min_lr;
        }
        let ratio = (it - self.warmup_iters) as f64 / (self.lr_decay_iters - self.warmup_iters).max(1) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        min_lr + coeff * (self.lr - min_lr)
    }
}

/// The text and where it came from.
struct Text {
    bytes: Vec<u8>,
    name: String,
}

impl Text {
    /// `--data FILE`'s bytes, or the bundled README.
    fn load(path: Option<&Path>) -> CliResult<Text> {
        let Some(path) = path else {
            return Ok(Text {
                bytes: BUNDLED_TEXT.as_bytes().to_vec(),
                name: "ember's README (bundled)".into(),
            });
        };
        if path.is_dir() {
            return Err(format!(
                "--data {}: is a directory; --model gpt2 trains on the bytes of one text file",
                path.display()
            )
            .into());
        }
        let bytes = std::fs::read(path).map_err(|e| {
            format!(
                "--data {}: cannot read it ({e}); give a text file, or leave --data out to train on the bundled README",
                path.display()
            )
        })?;
        Ok(Text {
            bytes,
            name: path.display().to_string(),
        })
    }

    /// The 90% / 10% split, each part checked to hold one window of `block + 1` bytes.
    fn split(&self, block: usize) -> CliResult<(&[u8], &[u8])> {
        let n = self.bytes.len() * 9 / 10;
        let (train, val) = self.bytes.split_at(n);
        if val.len() <= block || train.len() <= block {
            let need = (block + 1..)
                .find(|&m| m - m * 9 / 10 > block)
                .unwrap_or(usize::MAX);
            return Err(format!(
                "--data {}: {} bytes are too short for --block-size {block}: the held-out last 10% \
                 must hold one window of {} bytes, so the text needs at least {need} bytes; use a \
                 longer text or a smaller --block-size",
                self.name,
                self.bytes.len(),
                block + 1
            )
            .into());
        }
        Ok((train, val))
    }
}

/// SplitMix64's output function: a well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Which part of a global batch a process reads: `(rank, world)`; `(0, 1)` reads all of it.
type Part = (usize, usize);

/// Rows `rank·batch .. (rank+1)·batch` of batch `index` of hash stream `stream` (Note [GPT
/// batches and resume]), a batch of `world·batch` windows of `data` (`part = (rank, world)`):
/// inputs and next-byte targets, `[batch, block]` int64 each, on `device`. The processes of a
/// data-parallel job read the parts of the batch one process of `world·batch` windows reads.
fn get_batch(
    data: &[u8],
    seed: u64,
    stream: u64,
    index: usize,
    (batch, part): (usize, Part),
    block: usize,
    device: Device,
) -> ember::Result<(Tensor, Tensor)> {
    let key = mix(mix(seed) ^ stream);
    let windows = (data.len() - block) as u64;
    let (rank, world) = part;
    let mut x = Vec::with_capacity(batch * block);
    let mut y = Vec::with_capacity(batch * block);
    for row in rank * batch..(rank + 1) * batch {
        let i = (mix(key ^ (index * batch * world + row) as u64) % windows) as usize;
        x.extend(data[i..i + block].iter().map(|&b| b as i64));
        y.extend(data[i + 1..i + 1 + block].iter().map(|&b| b as i64));
    }
    Ok((
        Tensor::from_vec(x, [batch, block], Device::Cpu)?.to_non_blocking(device)?,
        Tensor::from_vec(y, [batch, block], Device::Cpu)?.to_non_blocking(device)?,
    ))
}

/// What the steps and estimates share.
struct Trainer<'a> {
    model: &'a Model,
    config: Config,
    amp: Option<AmpMode>,
    device: Device,
    seed: u64,
}

impl Trainer<'_> {
    /// Mean cross-entropy of the next bytes `y` after `x` (forward and loss under autocast
    /// with an amp mode; cross-entropy itself runs in float32 there, PyTorch's policy).
    fn loss(&self, x: &Tensor, y: &Tensor) -> ember::Result<Tensor> {
        self.loss_of(self.model.train_forward(), x, y)
    }

    /// [`Trainer::loss`] of `model`.
    fn loss_of(&self, model: &dyn Forward, x: &Tensor, y: &Tensor) -> ember::Result<Tensor> {
        let _autocast = self
            .amp
            .map(|a| ember::amp::autocast(self.device.device_type(), a.dtype()))
            .transpose()?;
        let logits = model.forward(x)?;
        F::cross_entropy(&logits.view([-1, VOCAB as isize])?, &y.view([-1])?)
    }

    /// The mean loss over `eval_iters` fixed batches of `data` (hash stream `stream`), in eval
    /// mode without gradients.
    fn estimate(&self, data: &[u8], stream: u64) -> ember::Result<f64> {
        let _g = ember::no_grad();
        let model = self.model.eval_forward();
        model.eval();
        let c = &self.config;
        let mut total = Tensor::zeros([], DType::F32, self.device)?;
        for k in 0..c.eval_iters {
            let (x, y) = get_batch(
                data,
                self.seed,
                stream,
                k,
                (c.batch_size, (0, 1)),
                c.block_size,
                self.device,
            )?;
            total = total.add(&self.loss_of(model, &x, &y)?.to_dtype(DType::F32)?)?;
        }
        model.train();
        Ok(total.item_f64()? / c.eval_iters as f64)
    }

    /// nanoGPT's `generate`: `n` times, the logits of the last position (of the context cropped
    /// to `block_size`) over `temperature`, cut to the `top_k` largest, one byte drawn from
    /// their softmax (the device's default generator) and appended. Returns the new bytes.
    fn generate(&self, prompt: &[u8], n: usize, temperature: f64, top_k: usize) -> ember::Result<Vec<u8>> {
        let _g = ember::no_grad();
        let model = self.model.eval_forward();
        model.eval();
        let block = self.config.block_size;
        let k = top_k.clamp(1, VOCAB);
        let ids: Vec<i64> = prompt.iter().map(|&b| b as i64).collect();
        let mut idx = Tensor::from_vec(ids, [1, prompt.len()], Device::Cpu)?.to(self.device)?;
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let t = idx.dims()[1];
            let cond = idx.narrow(1, t.saturating_sub(block), t.min(block))?;
            let logits = {
                let _autocast = self
                    .amp
                    .map(|a| ember::amp::autocast(self.device.device_type(), a.dtype()))
                    .transpose()?;
                model.forward(&cond)?
            };
            let logits = logits.select(1, -1)?.to_dtype(DType::F32)?;
            let next = if temperature == 0.0 {
                logits.argmax(Some(-1), true)?
            } else {
                let logits = logits.div_scalar(temperature)?;
                let (top, _) = logits.topk(k, -1, true)?;
                let kth = top.narrow(-1, k - 1, 1)?;
                let logits = logits.masked_fill(&logits.lt(&kth)?, f64::NEG_INFINITY)?;
                logits.softmax(-1)?.multinomial(1, true)?
            };
            out.push(next.to_vec::<i64>()?[0] as u8);
            // Only the last `block` bytes are ever read again.
            let t = t + 1;
            idx = Tensor::cat(&[idx, next], 1)?;
            if t > block {
                idx = idx.narrow(1, t - block, block)?;
            }
        }
        model.train();
        Ok(out)
    }
}

/// One loss estimate: after `iter` iterations.
struct Eval {
    iter: usize,
    train: f64,
    val: f64,
}

/// The model as the steps run it (Note [Sharded GPT]): alone, replicated in every process of
/// a job (DistributedDataParallel), or sharded over them (`fully_shard` on every block, then
/// on the whole model).
enum Model {
    Single(Gpt),
    Replicated(DistributedDataParallel<Gpt>),
    Sharded(FSDPModule<Gpt<FSDPModule<Checkpointed<Block>>>>),
}

impl Model {
    /// What a training step calls.
    fn train_forward(&self) -> &dyn Forward {
        match self {
            Model::Single(m) => m,
            Model::Replicated(m) => m,
            Model::Sharded(m) => m,
        }
    }

    /// What the estimates and the sampling call: DDP's module itself (they need no gradient
    /// synchronization), the others as they are (a sharded model's forward gathers, so every
    /// process runs them).
    fn eval_forward(&self) -> &dyn Forward {
        match self {
            Model::Single(m) => m,
            Model::Replicated(m) => m.module(),
            Model::Sharded(m) => m,
        }
    }

    /// The module whose state a checkpoint holds: DDP's module, the others as they are.
    fn module(&self) -> &dyn Module {
        match self {
            Model::Single(m) => m,
            Model::Replicated(m) => m.module(),
            Model::Sharded(m) => m,
        }
    }

    /// The whole model, for single-file checkpoints; None when sharded.
    fn whole(&self) -> Option<&Gpt> {
        match self {
            Model::Single(m) => Some(m),
            Model::Replicated(m) => Some(m.module()),
            Model::Sharded(_) => None,
        }
    }
}

/// Parameters of a byte-level [`Gpt`] of `c` (the head is tied to the token embedding): the
/// embeddings, per block two LayerNorms and four Linears (12·d² + 13·d), the final LayerNorm.
fn parameter_count(c: &Config) -> usize {
    let d = c.n_embd;
    (VOCAB + c.block_size) * d + c.n_layer * (12 * d * d + 13 * d) + 2 * d
}

/// Runs `ember train --model gpt2` on `device`, in one process or as a worker of a job
/// (`dist`); an out-of-memory error on a GPU comes back as [`DoesNotFit`], saying what to
/// change.
pub fn run(args: &TrainArgs, device: Device, dist: Option<Dist>) -> CliResult<()> {
    let world = dist.map_or(1, |d| d.world);
    let outcome = train(args, device, dist);
    let Err(e) = outcome else { return Ok(()) };
    match e.downcast::<ember::Error>() {
        Ok(e) => match *e {
            oom @ ember::Error::OutOfMemory { .. } => {
                let parameters = parameter_count(&Config::resolve(args, device)?);
                Err(Box::new(DoesNotFit::out_of_memory(
                    parameters, world, args.shard, oom,
                )))
            }
            e => Err(Box::new(e)),
        },
        Err(e) => Err(e),
    }
}

/// Note [Sharded GPT]: `--nproc-per-node N` trains in N processes, each on its part of every
/// batch (`get_batch`'s `part`: the processes together read the batch one process of N times
/// --batch-size reads), their gradients averaged: by DistributedDataParallel, or with `--shard`
/// by `fully_shard` (FSDP2): every block, then the whole model (embeddings, final LayerNorm,
/// tied head), each process keeping 1/N of every parameter and of its AdamW state, under a
/// `MixedPrecisionPolicy` of bfloat16 parameters and float32 reductions with `--amp bf16`.
/// Each block runs under activation checkpointing (`Checkpointed`, PyTorch's
/// `checkpoint_wrapper` before `fully_shard`) and reshards after its forward (Note [Reshard
/// after forward] in ember-distributed): between forward and backward a process holds its
/// shards and each block's input, and in backward a block's parameters are gathered again
/// and its forward recomputed. The model is built and initialized whole first
/// (on the GPU when sharding there: the same values as on the CPU, ember's RNG being
/// counter-based), so a seed starts a sharded, a replicated and a single run alike. Clipping
/// takes the norm over every process's rows (`fsdp::clip_grad_norm_`), and float16 loss
/// scaling skips a step on every process when any process's rows overflowed
/// (`ShardedGradScaler`). The reported losses are the means over the processes; every process
/// evaluates and samples (a sharded forward is collective), rank 0 prints. `--shard` without
/// `--nproc-per-node` shards over a group of this one process (every shard whole), so that a
/// sharded checkpoint resumes with the same flags on one process (Note [Sharded checkpoints]
/// in `dcp.rs`: every process writes its part of it).
fn train(args: &TrainArgs, device: Device, dist: Option<Dist>) -> CliResult<()> {
    let started = Instant::now();
    for (set, flag, hint) in [
        (args.cuda_graph, "--cuda-graph", ""),
        (args.profile.is_some(), "--profile", ""),
        (
            args.limit_train.is_some(),
            "--limit-train",
            "; --max-iters sets how long it trains",
        ),
    ] {
        if set {
            return Err(format!(
                "{flag} is not supported with --model gpt2 yet, only with the mlp and cnn{hint}"
            )
            .into());
        }
    }
    if args.checkpoint_every == Some(0) {
        return Err("--checkpoint-every must be at least 1".into());
    }
    let c = Config::resolve(args, device)?;
    let text = Text::load(args.data.as_deref())?;
    let (train, val) = text.split(c.block_size)?;
    let amp = args.amp.or(device.is_cuda().then_some(AmpMode::Bf16));
    let (rank, world) = dist.map_or((0, 1), |d| (d.rank, d.world));
    let lead = rank == 0;
    if let Device::Cuda(i) = device {
        let total = cuda::get_device_properties(i)?.total_memory;
        DoesNotFit::check(parameter_count(&c), world, args.shard, device, total)?;
    }
    match dist {
        Some(d) => d.init(device)?,
        // Note [Sharded GPT]: a sharded run of one process shards over a group of one.
        None if args.shard => init_one_process_group(device)?,
        None => {}
    }
    // Note [Sharded checkpoints]: a directory (written sharded), or one file.
    let distributed_checkpoint = args.shard || args.checkpoint.as_deref().is_some_and(Path::is_dir);

    ember::manual_seed(args.seed)?;
    // Built and initialized on the CPU, then moved: one seed, the same weights on every device
    // (Note [Sharded GPT]: a sharded model on its GPU).
    let build_on = if args.shard { device } else { Device::Cpu };
    let mut gpt = Gpt::new(VOCAB, c.block_size, c.n_embd, c.n_layer, c.n_head, build_on)?;
    gpt.init_gpt2_weights()?;
    gpt.to_device(device)?;
    let parameters = gpt.num_parameters();
    let mut scaler = GradScaler::with_config(GradScalerConfig {
        enabled: amp == Some(AmpMode::Fp16),
        ..Default::default()
    })?;
    // nanoGPT's `configure_optimizers`: weight decay on the parameters of 2 or more dims (the
    // matrices and the embeddings), none on biases and LayerNorm weights.
    let adamw = |params: &[Tensor]| -> ember::Result<AdamW> {
        let (decay, no_decay): (Vec<Tensor>, Vec<Tensor>) =
            params.iter().cloned().partition(|p| p.rank() >= 2);
        AdamW::with_groups(
            vec![
                ParamGroup::new(decay).weight_decay(c.weight_decay),
                ParamGroup::new(no_decay).weight_decay(0.0),
            ],
            AdamConfig {
                lr: c.lr,
                // nanoGPT's shakespeare-char: beta2 0.99, as each batch holds few tokens.
                betas: (0.9, 0.99),
                ..Default::default()
            },
        )
    };
    let mut start = 0;
    let (model, mut opt) = if args.shard {
        let mesh = DeviceMesh::new(distributed::default_group()?);
        let options = FullyShardOptions {
            mp_policy: MixedPrecisionPolicy {
                param_dtype: amp.map(AmpMode::dtype),
                reduce_dtype: amp.map(|_| DType::F32),
            },
            ..Default::default()
        };
        let gpt = gpt.map_blocks(|b| fully_shard(Checkpointed::new(b), &mesh, options))?;
        let model = fully_shard(gpt, &mesh, options)?;
        let mut opt = adamw(&model.parameters())?;
        if let (true, Some(path)) = (args.resume, args.checkpoint.as_deref()) {
            start = resume_distributed(path, &model, &mut opt, &mut scaler)?;
        }
        (Model::Sharded(model), opt)
    } else {
        let mut opt = adamw(&gpt.parameters())?;
        if args.resume {
            // Every process loads the same file, before DDP wraps the model.
            let path = args
                .checkpoint
                .as_deref()
                .expect("clap requires --checkpoint with --resume");
            start = match distributed_checkpoint {
                true => resume_distributed(path, &gpt, &mut opt, &mut scaler)?,
                false => load_checkpoint(path, "gpt2", &mut gpt, &mut opt, &mut scaler)?.step,
            };
        }
        let model = match dist {
            Some(_) => Model::Replicated(DistributedDataParallel::new(gpt, DdpOptions::new())?),
            None => Model::Single(gpt),
        };
        (model, opt)
    };
    let params = model.train_forward().parameters();
    // Float16 loss scaling agrees across processes by itself when they hold the same averaged
    // gradients; sharded, every process checks its own rows (Note [Sharded GPT]).
    let mut sharded_scaler;
    let scaler: &mut GradScaler = if args.shard {
        sharded_scaler = ShardedGradScaler::with_scaler(scaler, distributed::default_group()?);
        &mut sharded_scaler
    } else {
        &mut scaler
    };

    let say = |line: String| {
        if !lead {
            return;
        }
        if args.json {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let precision = match amp {
        Some(a) => format!("{} autocast", format!("{a:?}").to_lowercase()),
        None => "float32".into(),
    };
    let job = match dist {
        Some(d) if args.shard => format!(" in {} processes, sharded (FSDP)", d.world),
        None if args.shard => " in one process, sharded (FSDP)".into(),
        Some(d) => format!(" in {} processes (DDP)", d.world),
        None => String::new(),
    };
    say(format!(
        "training gpt2 ({} parameters: {} layers, {} heads, {} wide, {} bytes of context) on {device}{job} in {precision}: \
         {} ({} bytes: {} train, {} held out), batch {} per process, iterations {}..{}",
        parameters,
        c.n_layer,
        c.n_head,
        c.n_embd,
        c.block_size,
        text.name,
        text.bytes.len(),
        train.len(),
        val.len(),
        c.batch_size,
        start,
        c.max_iters,
    ));
    if start >= c.max_iters {
        say(format!(
            "checkpoint already has {start} iteration(s), --max-iters is {}: nothing to train",
            c.max_iters
        ));
    }

    let t = Trainer {
        model: &model,
        config: c,
        amp,
        device,
        seed: args.seed,
    };
    let hidden = args.json || !lead || !std::io::stderr().is_terminal();
    let bar = progress_bar(c.max_iters, hidden, "iterations");
    bar.set_prefix("gpt2");
    bar.set_position(start.min(c.max_iters) as u64);
    let mut losses: Vec<f64> = Vec::new();
    let mut pending: Vec<Tensor> = Vec::new();
    let mut evals: Vec<Eval> = Vec::new();
    let (mut eval_s, mut first_step_s) = (0.0f64, None);
    let t0 = Instant::now();
    let mut it = start;
    loop {
        let last = it >= c.max_iters;
        if it % c.eval_interval == 0 || last {
            let e0 = Instant::now();
            let e = Eval {
                iter: it,
                train: t.estimate(train, TRAIN_ESTIMATE)?,
                val: t.estimate(val, VAL_ESTIMATE)?,
            };
            eval_s += e0.elapsed().as_secs_f64();
            let line = format!(
                "step {it}: train loss {:.4}, val loss {:.4} (lr {:.2e}, {:.1} s)",
                e.train,
                e.val,
                c.lr_at(it.min(c.max_iters.saturating_sub(1))),
                started.elapsed().as_secs_f64()
            );
            bar.suspend(|| say(line));
            evals.push(e);
            if it > start && !last {
                save_at(args, &model, &opt, scaler, it, lead, distributed_checkpoint)?;
            }
        } else if args.checkpoint_every.is_some_and(|n| it % n == 0) && it > start {
            save_at(args, &model, &opt, scaler, it, lead, distributed_checkpoint)?;
        }
        if last {
            break;
        }
        opt.set_lr(c.lr_at(it));
        let (x, y) = get_batch(
            train,
            args.seed,
            TRAIN_BATCHES,
            it,
            (c.batch_size, (rank, world)),
            c.block_size,
            device,
        )?;
        opt.zero_grad()?;
        let loss = t.loss(&x, &y)?;
        scaler.scale(&loss)?.backward()?;
        if c.grad_clip > 0.0 {
            // nanoGPT's `scaler.unscale_(optimizer)` then `clip_grad_norm_`: the norm of the
            // true gradients (a pass-through without fp16's scaler).
            scaler.unscale_(&mut opt)?;
            if args.shard {
                distributed::fsdp::clip_grad_norm_(&params, c.grad_clip, 2.0)?;
            } else {
                clip_grad_norm_(&params, c.grad_clip, 2.0)?;
            }
        }
        scaler.step(&mut opt)?;
        scaler.update()?;
        if first_step_s.is_none() {
            if let Device::Cuda(i) = device {
                cuda::synchronize_on(i)?;
            }
            first_step_s = Some(started.elapsed().as_secs_f64());
        }
        pending.push(loss.detach().to_dtype(DType::F32)?);
        it += 1;
        bar.inc(1);
        if pending.len() >= PROGRESS_EVERY || it == c.max_iters {
            // One read (one wait for the device) per PROGRESS_EVERY iterations.
            let read: Vec<f64> = Tensor::stack(&pending, 0)?
                .to_vec::<f32>()?
                .iter()
                .map(|&l| l as f64)
                .collect();
            pending.clear();
            // The mean over the processes: the loss of the whole batch.
            let read = match dist {
                Some(d) => d.sum(&read, device)?.iter().map(|l| l / d.world as f64).collect(),
                None => read,
            };
            losses.extend(read);
            let secs = (t0.elapsed().as_secs_f64() - eval_s).max(1e-9);
            let tokens = (it - start) * c.batch_size * c.block_size * world;
            let mut msg = format!(
                "loss {:.4}  lr {:.2e}  {:.0} tokens/s",
                losses.last().copied().unwrap_or(f64::NAN),
                c.lr_at(it - 1),
                tokens as f64 / secs
            );
            if let Device::Cuda(i) = device {
                msg += &format!("  mem {:.0} MiB", cuda::memory_allocated_on(i) as f64 / 1048576.0);
            }
            bar.set_message(msg);
        }
    }
    bar.finish_and_clear();
    let train_s = (t0.elapsed().as_secs_f64() - eval_s).max(0.0);
    let iters = c.max_iters.saturating_sub(start);
    if let Some(path) = &args.checkpoint {
        save_at(args, &model, &opt, scaler, it, lead, distributed_checkpoint)?;
        say(format!(
            "checkpoint written: {} ({it} iterations)",
            path.display()
        ));
    }

    let sample = t.generate(b"\n", args.gpt.sample_bytes, args.gpt.temperature, args.gpt.top_k)?;
    let sample = String::from_utf8_lossy(&sample).into_owned();
    let last = evals.last().expect("the last iteration is evaluated");
    if !lead {
        return Ok(());
    }
    if args.json {
        let out = json!({
            "model": "gpt2",
            "device": device.to_string(),
            "world_size": world,
            "sharded": args.shard,
            "data": text.name,
            "data_bytes": text.bytes.len(),
            "train_bytes": train.len(),
            "val_bytes": val.len(),
            "parameters": parameters,
            "config": {
                "n_layer": c.n_layer,
                "n_head": c.n_head,
                "n_embd": c.n_embd,
                "block_size": c.block_size,
                "batch_size": c.batch_size,
                "max_iters": c.max_iters,
                "eval_interval": c.eval_interval,
                "eval_iters": c.eval_iters,
                "warmup_iters": c.warmup_iters,
                "lr_decay_iters": c.lr_decay_iters,
                "lr": c.lr,
                "weight_decay": c.weight_decay,
                "grad_clip": c.grad_clip,
            },
            "amp": amp.map(|a| format!("{a:?}").to_lowercase()),
            "start_iter": start,
            "iters": iters,
            "losses": losses,
            "evals": evals
                .iter()
                .map(|e| json!({"iter": e.iter, "train_loss": e.train, "val_loss": e.val}))
                .collect::<Vec<_>>(),
            "final_train_loss": last.train,
            "final_val_loss": last.val,
            "train_s": train_s,
            "first_step_s": first_step_s,
            "tokens_per_s": if train_s > 0.0 { (iters * c.batch_size * c.block_size * world) as f64 / train_s } else { 0.0 },
            "checkpoint": args.checkpoint.as_ref().map(|p| p.display().to_string()),
            "sample": sample,
        });
        println!("{out}");
    } else {
        if args.gpt.sample_bytes > 0 {
            println!(
                "--- sample ({} bytes, temperature {}, top-k {}) ---\n{sample}\n---",
                args.gpt.sample_bytes, args.gpt.temperature, args.gpt.top_k
            );
        }
        println!("val loss {:.4}", last.val);
    }
    Ok(())
}

/// Writes `--checkpoint` (when given) after `iters` completed iterations: a distributed
/// checkpoint (Note [Sharded checkpoints]; every process calls this, each writes its part),
/// or one file, which the `lead` process writes alone.
fn save_at(
    args: &TrainArgs,
    model: &Model,
    opt: &AdamW,
    scaler: &GradScaler,
    iters: usize,
    lead: bool,
    distributed: bool,
) -> CliResult<()> {
    let Some(path) = &args.checkpoint else {
        return Ok(());
    };
    let pos = Position {
        step: iters,
        ..Position::default()
    };
    match (distributed, model.whole()) {
        (true, _) => dcp::save(path, dcp::train_state(model.module(), opt)?, scaler, pos),
        (false, Some(whole)) if lead => save_checkpoint(path, whole, opt, scaler, pos),
        (false, _) => Ok(()),
    }
}

/// Resumes a run from the distributed checkpoint in `path` (Note [Sharded checkpoints]):
/// `model` (sharded or whole) and `opt` (given state to load into first) read it in place,
/// then the scaler and the generators; returns the completed iterations. Collective.
fn resume_distributed(
    path: &Path,
    model: &dyn Module,
    opt: &mut AdamW,
    scaler: &mut GradScaler,
) -> CliResult<usize> {
    dcp::init_optimizer_state(opt)?;
    let state = dcp::train_state(model, opt)?;
    Ok(dcp::load(path, "gpt2", state, opt, scaler)?.step)
}

/// Joins a default process group of this process alone (a store on a free local port), so
/// that `--shard` without `--nproc-per-node` shards over one process.
fn init_one_process_group(device: Device) -> CliResult<()> {
    let store = distributed::TcpStore::new("127.0.0.1", 0, true, std::time::Duration::from_secs(60))?;
    let mut options = distributed::InitOptions::new(match device {
        Device::Cuda(_) => distributed::BackendKind::Nccl,
        Device::Cpu => distributed::BackendKind::Gloo,
    })
    .world_size(1)
    .rank(0)
    .store(std::sync::Arc::new(store));
    if let Device::Cuda(i) = device {
        options = options.device_id(i);
    }
    distributed::init_process_group(options)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config {
            n_layer: 1,
            n_head: 1,
            n_embd: 8,
            block_size: 4,
            batch_size: 2,
            max_iters: 100,
            eval_interval: 10,
            eval_iters: 1,
            warmup_iters: 10,
            lr_decay_iters: 100,
            lr: 1e-3,
            weight_decay: 0.0,
            grad_clip: 1.0,
        }
    }

    #[test]
    fn parameter_count_is_the_models() {
        use ember::nn::ModuleExt;
        let c = Config {
            n_layer: 3,
            n_head: 2,
            n_embd: 16,
            block_size: 8,
            ..config()
        };
        let gpt = Gpt::new(VOCAB, 8, 16, 3, 2, Device::Cpu).unwrap();
        assert_eq!(parameter_count(&c), gpt.num_parameters());
    }

    #[test]
    fn learning_rate_warms_up_then_decays_to_a_tenth() {
        let c = config();
        assert!((c.lr_at(0) - 1e-3 / 11.0).abs() < 1e-15);
        assert!((c.lr_at(10) - 1e-3).abs() < 1e-15);
        assert!((c.lr_at(55) - 0.55e-3).abs() < 1e-12);
        assert!((c.lr_at(100) - 1e-4).abs() < 1e-15);
        assert!((1..100).all(|i| c.lr_at(i) > 0.0));
    }

    #[test]
    fn batches_are_a_function_of_seed_and_index() {
        let data: Vec<u8> = (0..=255).collect();
        let b =
            |seed, stream, index| get_batch(&data, seed, stream, index, (3, (0, 1)), 5, Device::Cpu).unwrap();
        let (x, y) = b(7, TRAIN_BATCHES, 4);
        let (x, y) = (x.to_vec::<i64>().unwrap(), y.to_vec::<i64>().unwrap());
        assert_eq!(x, b(7, TRAIN_BATCHES, 4).0.to_vec::<i64>().unwrap());
        // Targets are the inputs shifted by one byte.
        for r in 0..3 {
            assert_eq!(&x[r * 5 + 1..r * 5 + 5], &y[r * 5..r * 5 + 4]);
        }
        assert_ne!(x, b(7, TRAIN_BATCHES, 5).0.to_vec::<i64>().unwrap());
        assert_ne!(x, b(8, TRAIN_BATCHES, 4).0.to_vec::<i64>().unwrap());
        assert_ne!(x, b(7, VAL_ESTIMATE, 4).0.to_vec::<i64>().unwrap());
    }

    #[test]
    fn short_texts_are_refused_with_the_length_needed() {
        let text = Text {
            bytes: vec![b'a'; 40],
            name: "t.txt".into(),
        };
        assert!(text.split(3).is_ok());
        let err = text.split(4).unwrap_err().to_string();
        assert!(err.contains("40 bytes are too short for --block-size 4"), "{err}");
        assert!(err.contains("at least 41 bytes"), "{err}");
    }
}
