//! `ember train`'s checkpoints: [`save_checkpoint`] writes model, optimizer, scaler, RNG
//! states and the run's [`Position`] into one safetensors file (the format is in the module
//! docs of `train.rs`, Note [Bit-exact resume] there); [`load_checkpoint`] reads one back for
//! `--resume`, checking everything it reads: a file that is not such a checkpoint is an error
//! naming what is wrong, never a panic. This file uses only the `ember` crate, so the fuzz
//! target `checkpoint` (`fuzz/`) includes it by path and runs this very code.

use ember::amp::GradScaler;
use ember::nn::optim::Optimizer;
use ember::nn::state_dict::{load_tensors_from_bytes, save_tensors};
use ember::nn::{Forward, ModuleExt};
use ember::{cuda, DType, Device, Tensor};
use std::path::Path;

/// The error of saving and loading: a message for the user.
pub type CheckpointResult<T> = Result<T, Box<dyn std::error::Error>>;

/// Where a run stands: what a checkpoint holds besides model, optimizer and scaler. A `--model
/// gpt2` run counts iterations, not epochs: its checkpoints hold epoch 0 and the completed
/// iterations in `step`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Position {
    /// Completed epochs.
    pub epoch: usize,
    /// Completed steps of epoch `epoch + 1`.
    pub step: usize,
    /// The running loss sum and sample count of that partly done epoch.
    pub loss_sum: f64,
    pub seen: usize,
}

/// The (seed, offset) of a generator as a 2-element i64 tensor (the bits of the two u64).
fn rng_tensor(state: ember::RngState) -> ember::Result<Tensor> {
    Tensor::from_vec(vec![state.seed as i64, state.offset as i64], [2], Device::Cpu)
}

fn rng_from_tensor(t: &Tensor) -> Option<ember::RngState> {
    match t.to_vec::<i64>().ok()?.as_slice() {
        &[seed, offset] => Some(ember::RngState {
            seed: seed as u64,
            offset: offset as u64,
        }),
        _ => None,
    }
}

/// Writes model, optimizer, scaler, RNG states and `pos` into one safetensors file
/// (atomically).
pub fn save_checkpoint(
    path: &Path,
    model: &dyn Forward,
    opt: &dyn Optimizer,
    scaler: &GradScaler,
    pos: Position,
) -> CheckpointResult<()> {
    let mut state: Vec<(String, Tensor)> = model
        .state_dict()
        .into_iter()
        // A DistributedDataParallel wrapper names its module's tensors `module.*`: the file
        // holds the module's own names, as PyTorch's `model.module.state_dict()`, so any run
        // (one process or several) resumes from it.
        .map(|(k, t)| (format!("model.{}", k.strip_prefix("module.").unwrap_or(&k)), t))
        .collect();
    state.extend(
        opt.state_dict()
            .into_iter()
            .map(|(k, t)| (format!("optimizer.{k}"), t)),
    );
    state.extend(run_state(scaler, pos)?);
    save_tensors(&state, path).map_err(|e| format!("saving checkpoint: {e}"))?;
    Ok(())
}

/// What a checkpoint holds besides model and optimizer: the scaler's state (when enabled),
/// `pos`, and the default generators' states. A distributed checkpoint (`train/dcp.rs`) holds
/// the same entries as plain tensors.
pub fn run_state(scaler: &GradScaler, pos: Position) -> ember::Result<Vec<(String, Tensor)>> {
    let mut state = Vec::new();
    if scaler.is_enabled() {
        state.extend(
            scaler
                .state_dict()?
                .into_iter()
                .map(|(k, t)| (format!("scaler.{k}"), t)),
        );
    }
    let i64_scalar = |v: usize| Tensor::scalar(v as f64, DType::I64, Device::Cpu);
    state.push(("epoch".into(), i64_scalar(pos.epoch)?));
    state.push(("step".into(), i64_scalar(pos.step)?));
    state.push(("epoch_seen".into(), i64_scalar(pos.seen)?));
    state.push((
        "epoch_loss_sum".into(),
        Tensor::scalar(pos.loss_sum, DType::F64, Device::Cpu)?,
    ));
    state.push(("rng.cpu".into(), rng_tensor(ember::get_rng_state())?));
    for i in 0..cuda::device_count() {
        let g = ember::default_generator(Device::Cuda(i));
        state.push((format!("rng.cuda.{i}"), rng_tensor(g.get_state())?));
    }
    Ok(state)
}

/// Loads a checkpoint of [`save_checkpoint`] at `path` into `model` (a `--model
/// model_name`), `opt`, `scaler` and the default generators; returns its position. Checkpoints
/// of older versions (model, optimizer and `epoch` only) load as epoch boundaries.
pub fn load_checkpoint(
    path: &Path,
    model_name: &str,
    model: &mut dyn Forward,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
) -> CheckpointResult<Position> {
    let bad = |what: String| format!("--resume: checkpoint {}: {what}", path.display());
    if !path.is_file() {
        return Err(bad("no such file (run once without --resume to create it)".into()).into());
    }
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    Ok(restore_checkpoint(&bytes, model_name, model, opt, scaler).map_err(bad)?)
}

/// [`load_checkpoint`] of a checkpoint's bytes; the error says what is wrong with them (bad
/// bytes are an error, never a panic). The position is checked before anything is loaded; a
/// state that fails its checks may leave the parts loaded before it, so a run stops there.
pub fn restore_checkpoint(
    bytes: &[u8],
    model_name: &str,
    model: &mut dyn Forward,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
) -> Result<Position, String> {
    let state = load_tensors_from_bytes(bytes, Device::Cpu).map_err(|e| e.to_string())?;
    restore_state(state, model_name, Some(model), opt, scaler)
}

/// [`restore_checkpoint`] of a checkpoint's tensors: loads them into `model` (`None`: it was
/// loaded in place already, as a distributed checkpoint's load does; its entries are then
/// ignored), `opt`, `scaler` and the default generators, and returns the position.
pub fn restore_state(
    state: Vec<(String, Tensor)>,
    model_name: &str,
    model: Option<&mut dyn Forward>,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
) -> Result<Position, String> {
    let (mut model_state, mut opt_state, mut scaler_state) = (Vec::new(), Vec::new(), Vec::new());
    let (mut epoch, mut step, mut seen, mut loss_sum) = (None, 0.0, 0.0, 0.0);
    let mut rngs = Vec::new();
    let number = |t: &Tensor| t.item_f64().map_err(|e| e.to_string());
    for (k, t) in state {
        if let Some(k) = k.strip_prefix("model.") {
            model_state.push((k.to_owned(), t));
        } else if let Some(k) = k.strip_prefix("optimizer.") {
            opt_state.push((k.to_owned(), t));
        } else if let Some(k) = k.strip_prefix("scaler.") {
            scaler_state.push((k.to_owned(), t));
        } else if let Some(which) = k.strip_prefix("rng.") {
            let device = match which {
                "cpu" => Device::Cpu,
                _ => match which.strip_prefix("cuda.").and_then(|i| i.parse().ok()) {
                    Some(i) => Device::Cuda(i),
                    None => return Err(format!("unexpected entry {k:?}")),
                },
            };
            let rng = rng_from_tensor(&t).ok_or_else(|| format!("bad {k}"))?;
            rngs.push((device, rng));
        } else {
            match k.as_str() {
                "epoch" => epoch = Some(number(&t)?),
                "step" => step = number(&t)?,
                "epoch_seen" => seen = number(&t)?,
                "epoch_loss_sum" => loss_sum = number(&t)?,
                _ => return Err(format!("unexpected entry {k:?}: not an `ember train` checkpoint")),
            }
        }
    }
    let epoch = epoch.ok_or("no `epoch` entry: not an `ember train` checkpoint")?;
    let count = |v: f64, what: &str| {
        if v >= 0.0 && v.fract() == 0.0 {
            Ok(v as usize)
        } else {
            Err(format!("bad {what} {v}"))
        }
    };
    let position = Position {
        epoch: count(epoch, "epoch")?,
        step: count(step, "step")?,
        seen: count(seen, "epoch_seen")?,
        loss_sum,
    };
    if let Some(model) = model {
        model.load_state_dict(&model_state, true).map_err(|e| {
            format!("does not hold a --model {model_name} of this shape (trained with another --model?): {e}")
        })?;
    }
    opt.load_state_dict(&opt_state)
        .map_err(|e| format!("optimizer state: {e}"))?;
    if scaler.is_enabled() && !scaler_state.is_empty() {
        scaler
            .load_state_dict(&scaler_state)
            .map_err(|e| format!("scaler state: {e}"))?;
    }
    for (device, rng) in rngs {
        match device {
            Device::Cpu => ember::set_rng_state(rng),
            Device::Cuda(i) if i < cuda::device_count() => ember::default_generator(device).set_state(rng),
            // Saved on a machine with more GPUs: those generators are not used here.
            Device::Cuda(_) => {}
        }
    }
    Ok(position)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember::amp::GradScalerConfig;
    use ember::nn::optim::Adam;
    use ember::nn::Linear;

    fn parts() -> (Linear, Adam, GradScaler) {
        let model = Linear::new(3, 2, Device::Cpu).unwrap();
        let opt = Adam::new(model.parameters(), Default::default()).unwrap();
        let scaler = GradScaler::with_config(GradScalerConfig::default()).unwrap();
        (model, opt, scaler)
    }

    /// What `save_checkpoint` wrote restores its position; every truncation of it (a run killed
    /// mid-copy, a partial download) and a few corruptions are errors naming what is wrong.
    #[test]
    fn restores_what_it_saved_and_refuses_cut_or_corrupt_bytes() {
        let dir = std::env::temp_dir().join(format!("ember-checkpoint-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ck.safetensors");
        let (model, opt, scaler) = parts();
        let pos = Position {
            epoch: 3,
            step: 5,
            loss_sum: 2.5,
            seen: 40,
        };
        save_checkpoint(&path, &model, &opt, &scaler, pos).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let (mut m, mut o, mut s) = parts();
        assert_eq!(
            restore_checkpoint(&bytes, "linear", &mut m, &mut o, &mut s),
            Ok(pos)
        );
        for cut in (0..bytes.len()).step_by(7) {
            let (mut m, mut o, mut s) = parts();
            assert!(restore_checkpoint(&bytes[..cut], "linear", &mut m, &mut o, &mut s).is_err());
        }
        // An `epoch` that is not a count.
        let mut bad = Vec::new();
        let state = load_tensors_from_bytes(&bytes, Device::Cpu).unwrap();
        for (k, t) in state {
            let t = if k == "epoch" {
                Tensor::scalar(-1.0, DType::I64, Device::Cpu).unwrap()
            } else {
                t
            };
            bad.push((k, t));
        }
        save_tensors(&bad, &path).unwrap();
        let (mut m, mut o, mut s) = parts();
        let err = restore_checkpoint(&std::fs::read(&path).unwrap(), "linear", &mut m, &mut o, &mut s);
        assert_eq!(err, Err("bad epoch -1".to_string()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The optimizer's group hyperparameters come back from a checkpoint; one written before
    /// they were kept (group entries `params` and `lr` only) restores too, the optimizer keeping
    /// its own values of the others.
    #[test]
    fn group_hyperparameters_restore_and_older_checkpoints_still_do() {
        let dir = std::env::temp_dir().join(format!("ember-checkpoint-groups-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ck.safetensors");
        let (model, opt, scaler) = parts();
        save_checkpoint(&path, &model, &opt, &scaler, Position::default()).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let other = || {
            let (m, _, s) = parts();
            let config = ember::nn::optim::AdamConfig {
                lr: 0.5,
                eps: 1e-3,
                betas: (0.5, 0.6),
                ..Default::default()
            };
            let o = Adam::new(m.parameters(), config).unwrap();
            (m, o, s)
        };
        let (mut m, mut o, mut s) = other();
        restore_checkpoint(&bytes, "linear", &mut m, &mut o, &mut s).unwrap();
        assert_eq!(o.config(), opt.config());
        let old: Vec<(String, Tensor)> = load_tensors_from_bytes(&bytes, Device::Cpu)
            .unwrap()
            .into_iter()
            .filter(|(k, _)| {
                !k.starts_with("optimizer.param_groups.") || k.ends_with(".params") || k.ends_with(".lr")
            })
            .collect();
        let old = ember::nn::state_dict::save_tensors_to_bytes(&old).unwrap();
        let (mut m, mut o, mut s) = other();
        restore_checkpoint(&old, "linear", &mut m, &mut o, &mut s).unwrap();
        assert_eq!((o.config().lr, o.config().eps), (opt.config().lr, 1e-3));
        assert_eq!(o.config().betas, (0.5, 0.6));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
