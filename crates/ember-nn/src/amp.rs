//! Mixed-precision training (`torch.amp`): [`GradScaler`], which scales the loss so that small
//! float16 gradients do not flush to zero, then unscales the gradients, skips the steps whose
//! gradients overflowed and adapts the scale (`torch.amp.GradScaler`).
//!
//! The usual loop, as in PyTorch:
//! ```
//! use ember_core::{DType, Device, Tensor};
//! use ember_nn::amp::GradScaler;
//! use ember_nn::optim::{Optimizer, SgdConfig, SGD};
//! # fn main() -> ember_core::Result<()> {
//! let w = Tensor::ones([3], DType::F32, Device::Cpu)?.requires_grad_(true)?;
//! let mut opt = SGD::new(vec![w.clone()], SgdConfig { lr: 0.1, ..Default::default() })?;
//! let mut scaler = GradScaler::new(); // PyTorch's GradScaler(); .init_scale(..) etc. to change
//! for _ in 0..3 {
//!     opt.zero_grad()?;
//!     let loss = w.mul(&w)?.sum_all()?;
//!     scaler.scale(&loss)?.backward()?; // gradients carry the scale (65536)
//!     scaler.step(&mut opt)?; // unscaled and checked for inf/NaN: a bad step is skipped
//!     scaler.update()?; // the scale backs off after a skip, grows after clean steps
//! }
//! assert_eq!(scaler.get_scale()?, 65536.0);
//! # Ok(())
//! # }
//! ```
//!
//! Note [GradScaler keeps the host out]: the scale (0-d f32) and growth tracker (0-d i32) live
//! on the device of the first scaled loss, made by the first [`GradScaler::scale`]; the inverse
//! scale is computed there (in f64, then rounded to f32, as PyTorch's
//! `scale.double().reciprocal().float()`), the inf check and unscale are one fused kernel per
//! device and dtype (`ember_core::amp_scaling::non_finite_check_and_unscale_`), and the scale
//! update is one device kernel (`update_scale_`). [`GradScaler::step`] hands optimizers that
//! support it ([`Optimizer::supports_amp_scaling`]: SGD, Adam, AdamW) the scale and the
//! found-inf flag, and their fused steps skip on the device; other optimizers get PyTorch's
//! generic path, which reads the flag on the host. So with SGD/Adam/AdamW a whole scaled step
//! (`scale`, backward, `unscale_`, `clip_grad_norm_`, `step`, `update`) never waits for the
//! GPU; only [`GradScaler::get_scale`], [`GradScaler::get_growth_tracker`] and
//! [`GradScaler::state_dict`] read values back.
//!
//! Per optimizer and iteration the scaler moves through READY → UNSCALED (after
//! [`GradScaler::unscale_`]) → STEPPED (after [`GradScaler::step`]); [`GradScaler::update`]
//! starts the next iteration. Optimizers are told apart by address, as PyTorch does by `id()`:
//! keep an optimizer in place between `unscale_` and `update`.

use crate::optim::Optimizer;
use ember_core::amp_scaling::{non_finite_check_and_unscale_, update_scale_};
use ember_core::{DType, Device, Error, Result, Tensor};

/// The settings of a [`GradScaler`]; `Default` is PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradScalerConfig {
    /// The scale to start from (2^16).
    pub init_scale: f64,
    /// The factor the scale grows by after `growth_interval` clean steps in a row (2.0; > 1).
    pub growth_factor: f64,
    /// The factor the scale shrinks by after a step with inf/NaN gradients (0.5; < 1).
    pub backoff_factor: f64,
    /// Clean steps in a row before the scale grows (2000).
    pub growth_interval: i64,
    /// False makes every method a pass-through (`scale` returns the loss, `step` calls
    /// `optimizer.step()`), so one training loop serves both precisions.
    pub enabled: bool,
}

impl Default for GradScalerConfig {
    fn default() -> Self {
        GradScalerConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            enabled: true,
        }
    }
}

/// Where one optimizer is in the current iteration (PyTorch's `OptState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OptState {
    /// Nothing done yet since the last `update()`.
    Ready,
    /// `unscale_` ran: its gradients are unscaled.
    Unscaled,
    /// `step` ran.
    Stepped,
}

/// What the scaler knows of one optimizer in this iteration.
#[derive(Debug)]
struct OptimizerState {
    /// The optimizer's address (see the module docs).
    key: usize,
    stage: OptState,
    /// One 0-d f32 flag per device the optimizer's gradients are on: nonzero when one of them
    /// held inf or NaN.
    found_inf_per_device: Vec<(Device, Tensor)>,
}

/// A function each found-inf flag passes through right after the check (see
/// [`GradScaler::found_inf_hook`]).
#[derive(Clone)]
struct FoundInfHook(std::sync::Arc<dyn Fn(&Tensor) -> Result<()> + Send + Sync>);

impl std::fmt::Debug for FoundInfHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FoundInfHook")
    }
}

/// Dynamic loss scaling for float16 training (`torch.amp.GradScaler`); see the module docs.
#[derive(Debug)]
pub struct GradScaler {
    enabled: bool,
    init_scale: f64,
    growth_factor: f64,
    backoff_factor: f64,
    growth_interval: i64,
    init_growth_tracker: i64,
    /// 0-d f32 on the device of the first scaled output, made by the first `scale()`.
    scale: Option<Tensor>,
    /// 0-d i32 beside `scale`.
    growth_tracker: Option<Tensor>,
    per_optimizer: Vec<OptimizerState>,
    found_inf_hook: Option<FoundInfHook>,
}

impl Default for GradScaler {
    /// A scaler with PyTorch's defaults (see [`GradScalerConfig`]).
    fn default() -> Self {
        GradScaler::from_valid(GradScalerConfig::default())
    }
}

/// The identity of an optimizer: its address (PyTorch's `id(optimizer)`).
fn key_of<O: Optimizer + ?Sized>(optimizer: &O) -> usize {
    optimizer as *const O as *const () as usize
}

fn state_error(op: &'static str, msg: &str) -> Error {
    Error::invalid(op, msg.to_string())
}

/// `found` moved to `device` and added up (the flag itself when there is one on `device`).
fn combine(found: &[&Tensor], device: Device) -> Result<Tensor> {
    let _g = ember_core::no_grad();
    match found {
        [] => Tensor::scalar(0.0, DType::F32, device),
        [one] => one.to(device),
        [first, rest @ ..] => {
            let sum = first.to(device)?.deep_clone()?;
            for t in rest {
                sum.add_(&t.to(device)?)?;
            }
            Ok(sum)
        }
    }
}

impl GradScaler {
    /// `GradScaler()`: PyTorch's defaults (see [`GradScalerConfig`]); change them builder-style,
    /// `GradScaler::new().init_scale(1024.0).growth_interval(100)`, as the loss modules do.
    /// Settings given this way are checked at the first [`GradScaler::scale`].
    pub fn new() -> GradScaler {
        GradScaler::from_valid(GradScalerConfig::default())
    }

    /// A scaler with the settings of `config`; an error when `growth_factor <= 1` or
    /// `backoff_factor >= 1` (checked only when enabled, as PyTorch does). This was `new` before
    /// `new` took no argument.
    pub fn with_config(config: GradScalerConfig) -> Result<GradScaler> {
        let scaler = GradScaler::from_valid(config);
        scaler.check_config()?;
        Ok(scaler)
    }

    /// The scale to start from (`init_scale=`, 2^16).
    pub fn init_scale(mut self, init_scale: f64) -> GradScaler {
        self.init_scale = init_scale;
        self
    }

    /// The factor the scale grows by (`growth_factor=`, 2.0; must be > 1).
    pub fn growth_factor(mut self, growth_factor: f64) -> GradScaler {
        self.growth_factor = growth_factor;
        self
    }

    /// The factor the scale shrinks by after an overflow (`backoff_factor=`, 0.5; must be < 1).
    pub fn backoff_factor(mut self, backoff_factor: f64) -> GradScaler {
        self.backoff_factor = backoff_factor;
        self
    }

    /// Clean steps in a row before the scale grows (`growth_interval=`, 2000).
    pub fn growth_interval(mut self, growth_interval: i64) -> GradScaler {
        self.growth_interval = growth_interval;
        self
    }

    /// Whether scaling is on (`enabled=`, true); off, every method is a pass-through.
    pub fn enabled(mut self, enabled: bool) -> GradScaler {
        self.enabled = enabled;
        self
    }

    /// PyTorch's constructor checks (only when enabled).
    fn check_config(&self) -> Result<()> {
        if self.enabled {
            if !(self.growth_factor > 1.0) {
                return Err(Error::invalid("GradScaler", "The growth factor must be > 1.0."));
            }
            if !(self.backoff_factor < 1.0) {
                return Err(Error::invalid("GradScaler", "The backoff factor must be < 1.0."));
            }
        }
        Ok(())
    }

    fn from_valid(config: GradScalerConfig) -> GradScaler {
        GradScaler {
            enabled: config.enabled,
            init_scale: config.init_scale,
            growth_factor: config.growth_factor,
            backoff_factor: config.backoff_factor,
            growth_interval: config.growth_interval,
            init_growth_tracker: 0,
            scale: None,
            growth_tracker: None,
            per_optimizer: Vec::new(),
            found_inf_hook: None,
        }
    }

    /// Passes every found-inf flag (a 0-d f32 tensor, nonzero when a gradient held inf or NaN)
    /// through `hook` right after the check, before the step or the scale update reads it. A
    /// hook may change the flag in place: a sharded model's scaler (ember-distributed's
    /// `ShardedGradScaler`) all-reduces it over the ranks there, so that an overflow in any
    /// rank's shard skips every rank's step and backs off every rank's scale.
    pub fn found_inf_hook(
        mut self,
        hook: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static,
    ) -> GradScaler {
        self.found_inf_hook = Some(FoundInfHook(std::sync::Arc::new(hook)));
        self
    }

    /// Runs the found-inf hook, if any, on each of `found`'s flags.
    fn after_check(&self, found: &[(Device, Tensor)]) -> Result<()> {
        match &self.found_inf_hook {
            Some(hook) => found.iter().try_for_each(|(_, f)| (hook.0)(f)),
            None => Ok(()),
        }
    }

    /// `outputs` multiplied by the scale (`GradScaler.scale`); the first call makes the scale
    /// and growth tracker on `outputs`' device. The result keeps `outputs`' dtype: a float16 or
    /// bfloat16 output is scaled in f32 and rounded once (so a float16 loss times 2^16 is inf:
    /// scale the float32 loss, as autocast produces it). Disabled: `outputs` itself.
    pub fn scale(&mut self, outputs: &Tensor) -> Result<Tensor> {
        if !self.enabled {
            return Ok(outputs.clone());
        }
        if self.scale.is_none() {
            self.check_config()?;
            let device = outputs.device();
            self.scale = Some(Tensor::scalar(self.init_scale, DType::F32, device)?);
            self.growth_tracker = Some(Tensor::scalar(
                self.init_growth_tracker as f64,
                DType::I32,
                device,
            )?);
        }
        let scale = self.scale.as_ref().expect("made above").to(outputs.device())?;
        match outputs.dtype() {
            DType::F16 | DType::BF16 => outputs
                .to_dtype(DType::F32)?
                .mul(&scale)?
                .to_dtype(outputs.dtype()),
            dtype if dtype.is_floating_point() => outputs.mul(&scale.to_dtype(dtype)?),
            _ => outputs.mul(&scale),
        }
    }

    /// Each of `outputs` scaled as by [`GradScaler::scale`] (PyTorch's `scale` of an iterable).
    pub fn scale_all(&mut self, outputs: &[Tensor]) -> Result<Vec<Tensor>> {
        outputs.iter().map(|o| self.scale(o)).collect()
    }

    /// The scale and growth tracker, or PyTorch's error when `scale()` was never called.
    fn scale_and_tracker(&self, op: &'static str) -> Result<(Tensor, Tensor)> {
        match (&self.scale, &self.growth_tracker) {
            (Some(s), Some(t)) => Ok((s.clone(), t.clone())),
            _ => Err(Error::invalid(
                op,
                format!("Attempted {op} but _scale is None.  This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."),
            )),
        }
    }

    /// The state of the optimizer `key` in this iteration, made READY on first use.
    fn state_mut(&mut self, key: usize) -> &mut OptimizerState {
        let i = match self.per_optimizer.iter().position(|s| s.key == key) {
            Some(i) => i,
            None => {
                self.per_optimizer.push(OptimizerState {
                    key,
                    stage: OptState::Ready,
                    found_inf_per_device: Vec::new(),
                });
                self.per_optimizer.len() - 1
            }
        };
        &mut self.per_optimizer[i]
    }

    /// Where `optimizer` is in the current iteration.
    pub fn optimizer_state<O: Optimizer + ?Sized>(&self, optimizer: &O) -> OptState {
        let key = key_of(optimizer);
        self.per_optimizer
            .iter()
            .find(|s| s.key == key)
            .map_or(OptState::Ready, |s| s.stage)
    }

    /// Multiplies the gradients of `params` by `inv_scale` and checks them for inf/NaN, one
    /// fused call per device and dtype (PyTorch's `_unscale_grads_`); returns one found-inf
    /// flag per device that had gradients. float16 gradients are refused unless `allow_fp16`.
    fn unscale_grads(
        op: &'static str,
        params: &[Tensor],
        inv_scale: &Tensor,
        allow_fp16: bool,
    ) -> Result<Vec<(Device, Tensor)>> {
        let mut groups: Vec<((Device, DType), Vec<Tensor>)> = Vec::new();
        for g in params.iter().filter_map(|p| p.grad()) {
            if !allow_fp16 && g.dtype() == DType::F16 {
                return Err(Error::invalid(
                    op,
                    "Attempting to unscale FP16 gradients. Keep the parameters in float32 (autocast casts them for the forward pass)",
                ));
            }
            let key = (g.device(), g.dtype());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push(g),
                None => groups.push((key, vec![g])),
            }
        }
        let _g = ember_core::no_grad();
        let mut per_device: Vec<(Device, Tensor, Tensor)> = Vec::new();
        for ((device, _), grads) in groups {
            let i = match per_device.iter().position(|(d, _, _)| *d == device) {
                Some(i) => i,
                None => {
                    let found = Tensor::scalar(0.0, DType::F32, device)?;
                    per_device.push((device, found, inv_scale.to(device)?));
                    per_device.len() - 1
                }
            };
            let (_, found, inv) = &per_device[i];
            non_finite_check_and_unscale_(&grads, found, inv)?;
        }
        Ok(per_device.into_iter().map(|(d, f, _)| (d, f)).collect())
    }

    /// Divides `optimizer`'s gradients by the scale in place and records whether any is inf or
    /// NaN (`GradScaler.unscale_`), so they can be inspected or clipped before
    /// [`GradScaler::step`]. Errors when called twice for one optimizer in an iteration, after
    /// `step`, or on float16 gradients. Disabled: nothing.
    pub fn unscale_<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<()> {
        const OP: &str = "GradScaler.unscale_";
        if !self.enabled {
            return Ok(());
        }
        let (scale, _) = self.scale_and_tracker("unscale_")?;
        let key = key_of(optimizer);
        match self.state_mut(key).stage {
            OptState::Unscaled => {
                return Err(state_error(
                    OP,
                    "unscale_() has already been called on this optimizer since the last update().",
                ))
            }
            OptState::Stepped => return Err(state_error(OP, "unscale_() is being called after step().")),
            OptState::Ready => {}
        }
        // FP32 division can be imprecise for certain compile options, so the reciprocal is
        // taken in FP64 (PyTorch's comment and order).
        let inv_scale = {
            let _g = ember_core::no_grad();
            scale.to_dtype(DType::F64)?.reciprocal()?.to_dtype(DType::F32)?
        };
        let found = Self::unscale_grads(OP, optimizer.params(), &inv_scale, false)?;
        self.after_check(&found)?;
        let state = self.state_mut(key);
        state.found_inf_per_device = found;
        state.stage = OptState::Unscaled;
        Ok(())
    }

    /// Steps `optimizer` unless its gradients held inf or NaN (`GradScaler.step`), unscaling
    /// them first if [`GradScaler::unscale_`] was not called. SGD, Adam and AdamW unscale and
    /// skip inside their fused steps, on the device, with no host synchronization; other
    /// optimizers are unscaled here and stepped after a host read of the flag. Errors when
    /// called twice for one optimizer in an iteration. Disabled: `optimizer.step()`.
    pub fn step<O: Optimizer + ?Sized>(&mut self, optimizer: &mut O) -> Result<()> {
        const OP: &str = "GradScaler.step";
        if !self.enabled {
            return optimizer.step();
        }
        let (scale, _) = self.scale_and_tracker("step")?;
        let key = key_of(optimizer);
        let stage = self.state_mut(key).stage;
        if stage == OptState::Stepped {
            return Err(state_error(
                OP,
                "step() has already been called since the last update().",
            ));
        }
        if optimizer.supports_amp_scaling() {
            if stage == OptState::Ready {
                // Only the check: the fused step divides by the scale itself.
                let dummy_inv_scale = Tensor::scalar(1.0, DType::F32, scale.device())?;
                let found = Self::unscale_grads(OP, optimizer.params(), &dummy_inv_scale, true)?;
                self.after_check(&found)?;
                self.state_mut(key).found_inf_per_device = found;
            }
            let flags: Vec<&Tensor> = self
                .state_mut(key)
                .found_inf_per_device
                .iter()
                .map(|(_, f)| f)
                .collect();
            if flags.is_empty() {
                return Err(state_error(OP, "No inf checks were recorded for this optimizer."));
            }
            let found_inf = combine(&flags, scale.device())?;
            let grad_scale = (stage == OptState::Ready).then_some(&scale);
            optimizer.step_scaled(grad_scale, &found_inf)?;
        } else {
            if stage == OptState::Ready {
                self.unscale_(optimizer)?;
            }
            let state = self.state_mut(key);
            if state.found_inf_per_device.is_empty() {
                return Err(state_error(OP, "No inf checks were recorded for this optimizer."));
            }
            // PyTorch's `_maybe_opt_step`: the flags are read on the host.
            let mut found = 0.0;
            for (_, f) in &state.found_inf_per_device {
                found += f.item_f64()?;
            }
            if found == 0.0 {
                optimizer.step()?;
            }
        }
        self.state_mut(key).stage = OptState::Stepped;
        Ok(())
    }

    /// Updates the scale for the next iteration (`GradScaler.update()`): backs it off if any
    /// optimizer stepped in this iteration had inf/NaN gradients, or grows it after
    /// `growth_interval` clean iterations in a row, on the device. Then every optimizer is
    /// READY again. Disabled: nothing.
    pub fn update(&mut self) -> Result<()> {
        self.update_opt(None)
    }

    /// [`GradScaler::update`] that sets the scale to `new_scale` instead
    /// (`GradScaler.update(new_scale)`).
    pub fn update_with(&mut self, new_scale: f64) -> Result<()> {
        self.update_opt(Some(new_scale))
    }

    fn update_opt(&mut self, new_scale: Option<f64>) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        let (scale, tracker) = self.scale_and_tracker("update")?;
        match new_scale {
            Some(v) => {
                let _g = ember_core::no_grad();
                scale.fill_(v)?;
            }
            None => {
                let flags: Vec<&Tensor> = self
                    .per_optimizer
                    .iter()
                    .flat_map(|s| s.found_inf_per_device.iter().map(|(_, f)| f))
                    .collect();
                if flags.is_empty() {
                    return Err(state_error(
                        "GradScaler.update",
                        "No inf checks were recorded prior to update.",
                    ));
                }
                let found_inf = combine(&flags, scale.device())?;
                update_scale_(
                    &scale,
                    &tracker,
                    &found_inf,
                    self.growth_factor,
                    self.backoff_factor,
                    self.growth_interval,
                )?;
            }
        }
        self.per_optimizer.clear();
        Ok(())
    }

    /// [`GradScaler::update`] to the value of `new_scale`, a one-element f32 tensor on the
    /// scale's device that does not require grad (PyTorch's `update(new_scale=tensor)`).
    pub fn update_to_tensor(&mut self, new_scale: &Tensor) -> Result<()> {
        const OP: &str = "GradScaler.update";
        if !self.enabled {
            return Ok(());
        }
        let (scale, _) = self.scale_and_tracker("update")?;
        let reason = "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False.";
        if new_scale.numel() != 1 || new_scale.dtype() != DType::F32 || new_scale.requires_grad() {
            return Err(Error::invalid(OP, reason));
        }
        if new_scale.device() != scale.device() {
            return Err(Error::DeviceMismatch {
                op: OP,
                lhs: scale.device(),
                rhs: new_scale.device(),
            });
        }
        {
            let _g = ember_core::no_grad();
            scale.copy_(&new_scale.reshape(())?)?;
        }
        self.per_optimizer.clear();
        Ok(())
    }

    /// The current scale as a number (`GradScaler.get_scale`): a host read of the device value
    /// (a synchronization on CUDA); `init_scale` before the first `scale()`; 1.0 when disabled.
    pub fn get_scale(&self) -> Result<f64> {
        if !self.enabled {
            return Ok(1.0);
        }
        match &self.scale {
            Some(s) => s.item_f64(),
            None => Ok(self.init_scale),
        }
    }

    /// The scale tensor (0-d f32 on the device) without reading it, `None` before the first
    /// `scale()` or when disabled (PyTorch's `_get_scale_async`).
    pub fn get_scale_async(&self) -> Option<&Tensor> {
        self.scale.as_ref()
    }

    /// Clean steps since the scale last changed (PyTorch's `_get_growth_tracker`): a host read;
    /// 0 when disabled.
    pub fn get_growth_tracker(&self) -> Result<i64> {
        if !self.enabled {
            return Ok(0);
        }
        match &self.growth_tracker {
            Some(t) => Ok(t.item_f64()? as i64),
            None => Ok(self.init_growth_tracker),
        }
    }

    /// The growth factor.
    pub fn get_growth_factor(&self) -> f64 {
        self.growth_factor
    }

    /// Sets the growth factor used by the next `update()`s.
    pub fn set_growth_factor(&mut self, new_factor: f64) {
        self.growth_factor = new_factor;
    }

    /// The backoff factor.
    pub fn get_backoff_factor(&self) -> f64 {
        self.backoff_factor
    }

    /// Sets the backoff factor used by the next `update()`s.
    pub fn set_backoff_factor(&mut self, new_factor: f64) {
        self.backoff_factor = new_factor;
    }

    /// The growth interval.
    pub fn get_growth_interval(&self) -> i64 {
        self.growth_interval
    }

    /// Sets the growth interval used by the next `update()`s.
    pub fn set_growth_interval(&mut self, new_interval: i64) {
        self.growth_interval = new_interval;
    }

    /// Whether the scaler is enabled.
    pub fn is_enabled(&self) -> bool {
        self.enabled
    }

    /// The scaler's state as named 0-d CPU tensors with PyTorch's keys: `scale`,
    /// `growth_factor`, `backoff_factor` (f64), `growth_interval`, `_growth_tracker` (i64).
    /// Reads the scale and tracker back (a synchronization on CUDA). Empty when disabled.
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        if !self.enabled {
            return Ok(Vec::new());
        }
        let f = |v: f64| Tensor::scalar(v, DType::F64, Device::Cpu);
        let i = |v: i64| Tensor::scalar(v as f64, DType::I64, Device::Cpu);
        Ok(vec![
            ("scale".to_string(), f(self.get_scale()?)?),
            ("growth_factor".to_string(), f(self.growth_factor)?),
            ("backoff_factor".to_string(), f(self.backoff_factor)?),
            ("growth_interval".to_string(), i(self.growth_interval)?),
            ("_growth_tracker".to_string(), i(self.get_growth_tracker()?)?),
        ])
    }

    /// Loads a state written by [`GradScaler::state_dict`] (or PyTorch's, as tensors): every
    /// key is required, values may have any dtype and device. The scale and tracker are set on
    /// their device when they exist, else used for the first `scale()`. Disabled: nothing.
    pub fn load_state_dict(&mut self, state: &[(String, Tensor)]) -> Result<()> {
        const OP: &str = "GradScaler.load_state_dict";
        if !self.enabled {
            return Ok(());
        }
        if state.is_empty() {
            return Err(Error::invalid(
                OP,
                "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler.",
            ));
        }
        const KEYS: [&str; 5] = [
            "scale",
            "growth_factor",
            "backoff_factor",
            "growth_interval",
            "_growth_tracker",
        ];
        let mut values = [None; 5];
        for (key, value) in state {
            let Some(k) = KEYS.iter().position(|k| k == key) else {
                return Err(Error::invalid(
                    OP,
                    format!("unexpected key {key:?} in state dict: expected {KEYS:?}"),
                ));
            };
            values[k] = Some(value.item_f64()?);
        }
        let mut got = [0.0; 5];
        for (k, v) in values.into_iter().enumerate() {
            got[k] = v.ok_or_else(|| Error::invalid(OP, format!("state dict has no {:?}", KEYS[k])))?;
        }
        let [scale, growth_factor, backoff_factor, growth_interval, tracker] = got;
        let _g = ember_core::no_grad();
        self.init_scale = scale;
        if let Some(s) = &self.scale {
            s.fill_(scale)?;
        }
        self.growth_factor = growth_factor;
        self.backoff_factor = backoff_factor;
        self.growth_interval = growth_interval as i64;
        self.init_growth_tracker = tracker as i64;
        if let Some(t) = &self.growth_tracker {
            t.fill_(tracker)?;
        }
        Ok(())
    }
}
