//! `ember train --model gpt2`'s distributed checkpoints (Note [Sharded checkpoints]): a
//! directory written by `ember_distributed::dcp`, each process writing its own shards.
//!
//! Note [Sharded checkpoints]: with `--shard`, `--checkpoint PATH` names a directory that
//! `dcp::save` fills: every process writes the rows of the parameters and AdamW moments it
//! holds (`model.*` and `optimizer.*` as DTensors), rank 0 also the entries of
//! [`run_state`] (position, generators, scaler) as plain tensors, then the metadata, last
//! (Note [Checkpoint atomicity] in ember-distributed: a killed save leaves the previous
//! checkpoint loadable). The names are the single-file checkpoint's: the model's own,
//! without the `_checkpoint_wrapped_module.` of activation checkpointing (as PyTorch's
//! `get_model_state_dict` cleans them), so the keys do not depend on how a run wraps the
//! model. A load reshards to the loading job's world size (saved on 2 processes, resumed on
//! 1 or on 2), and a replicated run (no `--shard`, one process or DDP) resumes from such a
//! directory too, each process reading the whole tensors (cheap: `dcp::load` reads any rows
//! from any pieces, as PyTorch's DCP loads a sharded checkpoint into plain tensors). A run
//! that resumed from a directory keeps writing one there. The other way, a `--shard` run
//! refuses a single-file checkpoint with an error that says to resume it without `--shard`.
//!
//! The optimizer needs state of the right shapes to load into: [`init_optimizer_state`]
//! gives it one as PyTorch's `_init_optim_state` does. The hyperparameters of its param groups
//! (`optimizer.param_groups.{g}.lr`, `.betas`, ...: plain tensors, the same on every process)
//! are read as the checkpoint holds them, as the run state is, so a checkpoint written before
//! the groups kept every hyperparameter (`lr` and `initial_lr` only) still loads, the run's
//! values standing for the others, as a single-file checkpoint's do.

use super::checkpoint::{restore_state, run_state, CheckpointResult, Position};
use ember::amp::GradScaler;
use ember::distributed::dcp::{self, CheckpointError, StateValue};
use ember::nn::optim::Optimizer;
use ember::nn::Module;
use ember::{Device, Tensor};
use std::path::Path;

/// The prefix activation checkpointing (`Checkpointed`, PyTorch's `checkpoint_wrapper`) puts
/// before a wrapped module's names.
const WRAPPED: &str = "_checkpoint_wrapped_module.";

/// The state dict of `model` and `opt` (their own tensors, the shards of `fully_shard`
/// units as DTensors) under the checkpoint's names: `model.*` and `optimizer.*`.
pub fn train_state(model: &dyn Module, opt: &dyn Optimizer) -> ember::Result<Vec<(String, StateValue)>> {
    let mut out: Vec<(String, StateValue)> = dcp::get_model_state_dict(model)?
        .into_iter()
        .map(|(k, v)| (format!("model.{}", k.replace(WRAPPED, "")), v))
        .collect();
    out.extend(
        dcp::get_optimizer_state_dict(opt)?
            .into_iter()
            .map(|(k, v)| (format!("optimizer.{k}"), v)),
    );
    Ok(out)
}

/// Gives `opt` state of the right shapes to load into (PyTorch's `_init_optim_state`): a
/// step on zero gradients at learning rate 0, which leaves every parameter as it was (AdamW's
/// decoupled decay multiplies by 1 - 0·wd, its update is 0·m/(√v + eps) with m = v = 0); the
/// learning rates are restored and the gradients released after it. The state it makes is
/// replaced by the checkpoint's.
pub fn init_optimizer_state(opt: &mut dyn Optimizer) -> ember::Result<()> {
    let lrs = opt.group_lrs();
    for p in opt.params() {
        p.set_grad(Some(p.zeros_like()?))?;
    }
    opt.set_lr(0.0);
    opt.step()?;
    for (g, lr) in lrs.into_iter().enumerate() {
        opt.set_group_lr(g, lr);
    }
    opt.zero_grad()
}

/// Saves `state` ([`train_state`]) with the scaler, the generators and `pos` into the
/// directory `path`. Collective over the default group (every process of the job calls it).
pub fn save(
    path: &Path,
    state: Vec<(String, StateValue)>,
    scaler: &GradScaler,
    pos: Position,
) -> CheckpointResult<()> {
    let mut state = state;
    state.extend(
        run_state(scaler, pos)?
            .into_iter()
            .map(|(k, t)| (k, StateValue::from(t))),
    );
    dcp::save(&state, path, None).map_err(|e| format!("saving checkpoint {}: {e}", path.display()))?;
    Ok(())
}

/// Whether a checkpoint entry is read as the checkpoint holds it rather than into the run's
/// own tensor (see [`load`]): everything but the model and the optimizer's parameter state and
/// group `params`.
fn read_as_saved(key: &str) -> bool {
    match key.strip_prefix("optimizer.param_groups.") {
        Some(rest) => rest.split_once('.').is_some_and(|(_, name)| name != "params"),
        None => !key.starts_with("model.") && !key.starts_with("optimizer."),
    }
}

/// Loads the distributed checkpoint in `path` into `state` ([`train_state`] of the run's
/// model and an optimizer with state, [`init_optimizer_state`]), then `opt`, `scaler` and
/// the generators; returns the position. Collective over the default group.
pub fn load(
    path: &Path,
    model_name: &str,
    state: Vec<(String, StateValue)>,
    opt: &mut dyn Optimizer,
    scaler: &mut GradScaler,
) -> CheckpointResult<Position> {
    let bad = |what: String| format!("--resume: checkpoint {}: {what}", path.display());
    if path.is_file() {
        return Err(bad(
            "a single-file checkpoint, written by a replicated run (without --shard): resume it without --shard, \
             or start the sharded run afresh (a --shard run reads and writes a distributed checkpoint directory)"
                .into(),
        )
        .into());
    }
    if !path.exists() {
        return Err(bad("no such directory (run once without --resume to create it)".into()).into());
    }
    let saved = dcp::read_metadata(path).map_err(|e| bad(e.to_string()))?;
    // Position, generators and scaler, and the hyperparameters of the optimizer's groups:
    // whatever the checkpoint holds, read as saved (checkpoints of earlier versions hold no
    // group entries but `params`, `lr` and `initial_lr`; the optimizer keeps its own values of
    // the others, and checks those it reads).
    let mut state: Vec<(String, StateValue)> = state.into_iter().filter(|(k, _)| !read_as_saved(k)).collect();
    for (key, t) in saved {
        if read_as_saved(&key) {
            state.push((key, Tensor::zeros(t.shape, t.dtype, Device::Cpu)?.into()));
        }
    }
    dcp::load(&state, path, None).map_err(|e| match e {
        e @ (CheckpointError::KeyMismatch { .. } | CheckpointError::ShapeMismatch { .. }) => bad(format!(
            "does not hold a --model {model_name} of this shape and its AdamW state (trained with other sizes?): {e}"
        )),
        e => bad(e.to_string()),
    })?;
    // The model's tensors were loaded in place; the optimizer copies its state in.
    let local = dcp::to_local_state(&state);
    Ok(restore_state(local, model_name, None, opt, scaler).map_err(bad)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember::amp::GradScalerConfig;
    use ember::nn::optim::{AdamConfig, AdamW, ParamGroup};
    use ember::nn::{Linear, ModuleExt};

    /// A Linear and an AdamW of two groups (the bias's of other betas and no decay) over it.
    fn parts(config: AdamConfig) -> (Linear, AdamW, GradScaler) {
        let model = Linear::new(3, 2, Device::Cpu).unwrap();
        let ps = model.parameters();
        let groups = vec![
            ParamGroup::new(vec![ps[0].clone()]),
            ParamGroup::new(vec![ps[1].clone()])
                .weight_decay(0.0)
                .betas((0.8, 0.9)),
        ];
        let opt = AdamW::with_groups(groups, config).unwrap();
        let scaler = GradScaler::with_config(GradScalerConfig::default()).unwrap();
        (model, opt, scaler)
    }

    /// Loads the checkpoint in `dir` into fresh parts built with `config`.
    fn resume(dir: &Path, config: AdamConfig) -> AdamW {
        let (model, mut opt, mut scaler) = parts(config);
        init_optimizer_state(&mut opt).unwrap();
        let state = train_state(&model, &opt).unwrap();
        let pos = load(dir, "linear", state, &mut opt, &mut scaler).unwrap();
        assert_eq!(pos.step, 4);
        opt
    }

    /// The groups' hyperparameters come back from a distributed checkpoint, all of them; a
    /// checkpoint written before they were kept (group entries `params` and `lr` only) still
    /// loads, the groups keeping the resuming run's values of the others.
    #[test]
    fn group_hyperparameters_resume_and_older_checkpoints_still_load() {
        let dir = std::env::temp_dir().join(format!("ember-train-dcp-{}", std::process::id()));
        let saved = AdamConfig {
            lr: 0.01,
            betas: (0.85, 0.95),
            eps: 1e-6,
            weight_decay: 0.2,
            ..AdamConfig::default()
        };
        let resumed_with = AdamConfig {
            lr: 0.5,
            amsgrad: false,
            fused: Some(false),
            ..AdamConfig::adamw()
        };
        let (model, mut opt, scaler) = parts(saved);
        for p in opt.params() {
            p.set_grad(Some(p.ones_like().unwrap())).unwrap();
        }
        opt.step().unwrap();
        let pos = Position {
            step: 4,
            ..Position::default()
        };
        let state = train_state(&model, &opt).unwrap();
        let new = dir.join("new");
        save(&new, state.clone(), &scaler, pos).unwrap();
        let opt2 = resume(&new, resumed_with);
        for g in 0..2 {
            assert_eq!(opt2.param_groups()[g].config(), opt.param_groups()[g].config());
        }
        assert_eq!(opt2.param_groups()[1].config().betas, (0.8, 0.9));

        let old_keys = |k: &String| match k.strip_prefix("optimizer.param_groups.") {
            Some(rest) => rest.ends_with(".params") || rest.ends_with(".lr"),
            None => true,
        };
        let old: Vec<(String, StateValue)> = state.into_iter().filter(|(k, _)| old_keys(k)).collect();
        let old_dir = dir.join("old");
        save(&old_dir, old, &scaler, pos).unwrap();
        let opt3 = resume(&old_dir, resumed_with);
        assert_eq!(
            opt3.param_groups()[0].config(),
            &AdamConfig {
                lr: 0.01,
                ..resumed_with
            }
        );
        assert_eq!(opt3.param_groups()[1].config().weight_decay, 0.0);
        assert_eq!(opt3.param_groups()[1].config().eps, resumed_with.eps);
        std::fs::remove_dir_all(&dir).ok();
    }
}
