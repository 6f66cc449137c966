//! Random tensors (`rand`, `randn`, `normal`, `randint`, `randperm`, `rand_like`,
//! `randn_like`, `bernoulli`) and in-place random fills (`uniform_`, `normal_`, `bernoulli_`).
//!
//! API: each op draws from the default generator of the target device
//! ([`default_generator`]); its `_with` twin takes an explicit `&Generator` as the last
//! argument instead (`Tensor::rand_with(shape, dtype, device, &gen)`, and for in-place fills
//! `x.uniform_with_(lo, hi, &gen)`), as PyTorch's `generator=` keyword. Values follow Note
//! [Philox stream] (`random/mod.rs`). Random tensors are leaves that do not require grad; an
//! in-place fill of a tensor that requires grad is refused while grad mode is on (fill it
//! under `no_grad`, as `nn.init` does).

use super::{default_generator, Distribution, Generator};
use crate::dispatch::{self, policy, Op};
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{autograd, DType, Device, Error, Result, Shape, Tensor};

fn check_float(op: &'static str, dtype: DType) -> Result<()> {
    if dtype.is_floating_point() {
        return Ok(());
    }
    Err(Error::UnsupportedDType {
        op,
        dtype,
        hint: "it needs a floating point dtype (float16, bfloat16, float32 or float64)",
    })
}

fn check_uniform(op: &'static str, low: f64, high: f64) -> Result<Distribution> {
    if !(low.is_finite() && high.is_finite() && low <= high) {
        return Err(Error::invalid(
            op,
            format!("expects a finite range [from, to) with from <= to, but got from={low}, to={high}"),
        ));
    }
    Ok(Distribution::Uniform { low, high })
}

fn check_normal(op: &'static str, mean: f64, std: f64) -> Result<Distribution> {
    if !std.is_finite() || std < 0.0 || !mean.is_finite() {
        return Err(Error::invalid(
            op,
            format!("expects a finite mean and std >= 0.0, but got mean={mean}, std={std}"),
        ));
    }
    Ok(Distribution::Normal { mean, std })
}

fn check_probability(op: &'static str, p: f64) -> Result<Distribution> {
    if !(0.0..=1.0).contains(&p) {
        return Err(Error::invalid(
            op,
            format!("expects p to be in [0, 1], but got p={p}"),
        ));
    }
    Ok(Distribution::Bernoulli { p })
}

/// A new tensor of `shape` drawn from `dist` with `gen`, entering the dispatch point as `op`.
fn draw(
    op: &'static Op,
    shape: Shape,
    dtype: DType,
    device: Device,
    dist: Distribution,
    gen: &Generator,
) -> Result<Tensor> {
    let n = shape.checked_elements(op.name)?;
    crate::shape::checked_bytes(op.name, n, dtype)?;
    dispatch::enter(op, device, |door| {
        let state = gen.reserve_draw(dist.blocks(n, dtype));
        let storage = Storage::random(device, dtype, n, dist, state)?;
        Ok(door.tensor(storage, shape))
    })
}

impl Tensor {
    /// Uniform values on [0, 1) (`torch.rand`); floating dtypes only.
    pub fn rand(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::rand_with(shape, dtype, device, default_generator(device))
    }

    /// [`Tensor::rand`] drawing from `gen`.
    pub fn rand_with(
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
        gen: &Generator,
    ) -> Result<Tensor> {
        check_float("rand", dtype)?;
        let dist = Distribution::Uniform { low: 0.0, high: 1.0 };
        draw(&policy::RAND, shape.into(), dtype, device, dist, gen)
    }

    /// Standard normal values (`torch.randn`); floating dtypes only.
    pub fn randn(shape: impl Into<Shape>, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::randn_with(shape, dtype, device, default_generator(device))
    }

    /// [`Tensor::randn`] drawing from `gen`.
    pub fn randn_with(
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
        gen: &Generator,
    ) -> Result<Tensor> {
        check_float("randn", dtype)?;
        let dist = Distribution::Normal { mean: 0.0, std: 1.0 };
        draw(&policy::RANDN, shape.into(), dtype, device, dist, gen)
    }

    /// Normal values with mean `mean` and standard deviation `std` (`torch.normal(mean, std,
    /// size)`); floating dtypes only.
    pub fn normal(
        mean: f64,
        std: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        Tensor::normal_with(mean, std, shape, dtype, device, default_generator(device))
    }

    /// [`Tensor::normal`] drawing from `gen`.
    pub fn normal_with(
        mean: f64,
        std: f64,
        shape: impl Into<Shape>,
        dtype: DType,
        device: Device,
        gen: &Generator,
    ) -> Result<Tensor> {
        check_float("normal", dtype)?;
        let dist = check_normal("normal", mean, std)?;
        draw(&policy::NORMAL, shape.into(), dtype, device, dist, gen)
    }

    /// Integers uniform on `[low, high)` as i64 (`torch.randint(low, high, size)`).
    pub fn randint(low: i64, high: i64, shape: impl Into<Shape>, device: Device) -> Result<Tensor> {
        Tensor::randint_with(low, high, shape, device, default_generator(device))
    }

    /// [`Tensor::randint`] drawing from `gen`.
    pub fn randint_with(
        low: i64,
        high: i64,
        shape: impl Into<Shape>,
        device: Device,
        gen: &Generator,
    ) -> Result<Tensor> {
        if low >= high {
            return Err(Error::invalid(
                "randint",
                format!("expects 'low' to be less than 'high', but got low={low} >= high={high}"),
            ));
        }
        draw(
            &policy::RANDINT,
            shape.into(),
            DType::I64,
            device,
            Distribution::RandInt { low, high },
            gen,
        )
    }

    /// A random permutation of `0..n` as i64 (`torch.randperm`).
    pub fn randperm(n: usize, device: Device) -> Result<Tensor> {
        Tensor::randperm_with(n, device, default_generator(device))
    }

    /// [`Tensor::randperm`] drawing from `gen`.
    pub fn randperm_with(n: usize, device: Device, gen: &Generator) -> Result<Tensor> {
        Shape::from(n).checked_elements("randperm")?;
        crate::shape::checked_bytes("randperm", n, DType::I64)?;
        dispatch::enter(&policy::RANDPERM, device, |door| {
            let state = gen
                .reserve_draw(crate::backend::op::blocks_for(
                    n,
                    crate::backend::op::RANDPERM_PER_BLOCK,
                ))
                .value("randperm")?;
            Ok(door.tensor(Storage::randperm(device, n, state)?, [n]))
        })
    }

    /// Uniform values on [0, 1) with this tensor's shape, dtype and device (`torch.rand_like`).
    pub fn rand_like(&self) -> Result<Tensor> {
        dispatch::named(&policy::RAND_LIKE, &[self], || {
            Tensor::rand(self.shape(), self.dtype(), self.device())
        })
    }

    /// Standard normal values with this tensor's shape, dtype and device (`torch.randn_like`).
    pub fn randn_like(&self) -> Result<Tensor> {
        dispatch::named(&policy::RANDN_LIKE, &[self], || {
            Tensor::randn(self.shape(), self.dtype(), self.device())
        })
    }

    /// 1 with probability given by each element of this tensor, else 0, in its dtype
    /// (`torch.bernoulli(input)`); probabilities must lie in [0, 1].
    pub fn bernoulli(&self) -> Result<Tensor> {
        self.bernoulli_with(default_generator(self.device()))
    }

    /// [`Tensor::bernoulli`] drawing from `gen`.
    pub fn bernoulli_with(&self, gen: &Generator) -> Result<Tensor> {
        check_float("bernoulli", self.dtype())?;
        dispatch::call_with(&policy::BERNOULLI, [self], |_, door| {
            let n = self.numel();
            let state = gen.reserve_draw(Distribution::Bernoulli { p: 0.0 }.blocks(n, self.dtype()));
            let storage = self.storage().read().bernoulli(self.layout(), state)?;
            Ok(door.tensor(storage, self.shape()))
        })
    }

    /// A tensor of this shape, dtype and device with 1 drawn with probability `p`, else 0
    /// (`torch.bernoulli(input, p)`).
    pub fn bernoulli_p(&self, p: f64) -> Result<Tensor> {
        self.bernoulli_p_with(p, default_generator(self.device()))
    }

    /// [`Tensor::bernoulli_p`] drawing from `gen`: the values `bernoulli_with_(p, gen)` writes
    /// into a tensor of this shape, without the copy an in-place fill makes.
    pub fn bernoulli_p_with(&self, p: f64, gen: &Generator) -> Result<Tensor> {
        let dist = check_probability("bernoulli", p)?;
        draw(
            &policy::BERNOULLI,
            self.shape().clone(),
            self.dtype(),
            self.device(),
            dist,
            gen,
        )
    }

    /// Fills with uniform values on `[low, high)` in place (`Tensor.uniform_`).
    pub fn uniform_(&self, low: f64, high: f64) -> Result<Tensor> {
        self.uniform_with_(low, high, default_generator(self.device()))
    }

    /// [`Tensor::uniform_`] drawing from `gen`.
    pub fn uniform_with_(&self, low: f64, high: f64, gen: &Generator) -> Result<Tensor> {
        check_float("uniform_", self.dtype())?;
        let dist = check_uniform("uniform_", low, high)?;
        self.fill_random_(&policy::UNIFORM_, dist, gen)
    }

    /// Fills with normal values of mean `mean` and standard deviation `std` in place
    /// (`Tensor.normal_`).
    pub fn normal_(&self, mean: f64, std: f64) -> Result<Tensor> {
        self.normal_with_(mean, std, default_generator(self.device()))
    }

    /// [`Tensor::normal_`] drawing from `gen`.
    pub fn normal_with_(&self, mean: f64, std: f64, gen: &Generator) -> Result<Tensor> {
        check_float("normal_", self.dtype())?;
        let dist = check_normal("normal_", mean, std)?;
        self.fill_random_(&policy::NORMAL_, dist, gen)
    }

    /// Fills with 1 drawn with probability `p`, else 0, in place (`Tensor.bernoulli_(p)`); any
    /// dtype.
    pub fn bernoulli_(&self, p: f64) -> Result<Tensor> {
        self.bernoulli_with_(p, default_generator(self.device()))
    }

    /// [`Tensor::bernoulli_`] drawing from `gen`.
    pub fn bernoulli_with_(&self, p: f64, gen: &Generator) -> Result<Tensor> {
        let dist = check_probability("bernoulli_", p)?;
        self.fill_random_(&policy::BERNOULLI_, dist, gen)
    }

    /// Draws `numel` values contiguously, then writes them into this view's layout through the
    /// storage's write lock (which bumps the version counter).
    fn fill_random_(&self, line: &'static Op, dist: Distribution, gen: &Generator) -> Result<Tensor> {
        let op = line.name;
        if autograd::is_grad_enabled() && self.requires_grad() {
            return Err(Error::Autograd(format!(
                "{op}: a tensor that requires grad is being used in an in-place operation; \
                 fill it under no_grad() or fill a detached copy"
            )));
        }
        if self
            .dims()
            .iter()
            .zip(self.stride())
            .any(|(&d, &s)| d > 1 && s == 0)
        {
            return Err(Error::invalid(
                op,
                "unsupported operation: more than one element of the written-to tensor refers to a \
                 single memory location; call .contiguous() on it first",
            ));
        }
        dispatch::named(line, &[self], || {
            let n = self.numel();
            let state = gen.reserve_draw(dist.blocks(n, self.dtype()));
            let fresh = Storage::random(self.device(), self.dtype(), n, dist, state)?;
            let src = Layout::contiguous(self.shape().clone());
            self.storage()
                .write()
                .copy_strided_from(self.layout(), &fresh, &src)?;
            Ok(self.clone())
        })
    }
}
