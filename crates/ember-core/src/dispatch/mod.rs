//! The dispatch point: the one path every public op takes, views, casts, device moves,
//! `copy_` and `fill_` included (a cast to a tensor's own dtype, or a move to its own device,
//! returns the tensor without entering). `call` reads as the list of layers an op passes, in
//! order (PyTorch keeps the same list in `c10/core/DispatchKey.h`):
//!
//! 1. **device check**: every tensor operand on one device ([`check_devices`], the one
//!    builder of `Error::DeviceMismatch` for ops above the backends), and an operand that a copy
//!    between GPUs in row blocks still reads or writes waits for it (`settle_copies`);
//! 2. **autocast**: the op's line in the policy table ([`policy`]) casts floating inputs when
//!    an [`crate::amp::autocast`] region is open for their device type (`autocast::apply`);
//! 3. **dtype promotion**: the op's [`Promotion`] brings the operands to one dtype;
//! 4. **observer hook**: [`observer`] sees the op's name, inputs and CPU time (the profiler's
//!    entry point); with no observer installed it costs one relaxed atomic load;
//! 5. **backend**: the op's kernel closure, which calls `Storage` (the backend boundary) on
//!    the prepared inputs;
//! 6. **autograd record**: when grad mode is on and an input requires a gradient, the op's
//!    backward rule (built only then) is recorded with the prepared inputs as edges.
//!
//! Ops that PyTorch's autocast policy names as one op but that are built from other ops
//! (layer_norm, the losses, scaled_dot_product_attention, the LSTM layers) enter through
//! [`composite`]: steps 1–4 run once for the whole op, and its body runs with autocast
//! suspended, so the inner ops keep the dtypes the policy chose (as PyTorch redispatches
//! below its Autocast key).
//!
//! The kernel closure of every entry gets the op's `Door`, the only way to make a tensor
//! from a backend's storage or record an autograd node (Note [The door]).
//!
//! Ops with no policy of their own enter more lightly, still under their PyTorch name:
//! `named` for PyTorch's implicit composites (`flatten`, `masked_fill`, `split`, ...), whose
//! inner ops pass every step themselves, and `enter` for ops with no tensor input (the
//! factories, the random draws) or whose operands the op checks itself. `tests/it/door.rs`
//! reads every public function of the op layer and fails on one that no observer sees.
//!
//! Adding an op: an elementwise op is one line of its family's table (`backend/table.rs`),
//! its CPU formula and its CUDA expression (the crate's `architecture` page). Another op: its
//! line in [`policy`] (name, autocast policy, promotion), its `Tensor` method in
//! `ops/<family>.rs` calling `call` with the kernel and backward rule, a method of its
//! family's backend trait for a new kernel (`backend/mod.rs`, forwarded by its family's
//! `forward!` in `storage/families.rs`), and its kernels in each backend (`cpu/<family>.rs`,
//! `cuda_backend/<family>.rs` + `kernels/<family>.cu`).

#![deny(unsafe_code)]

pub mod autocast;
pub(crate) mod grad_mode;
pub(crate) mod graph;
pub mod observer;
pub mod policy;
pub(crate) mod row_blocks;
pub(crate) mod tensor_impl;

pub use policy::{CastPolicy, Op, Promotion};

/// Leave to make tensors from storage ([`Door::tensor`], [`Door::tensor_at`]) and to record
/// autograd nodes ([`Door::record`] and its view and cast forms): what an op's kernel and its
/// backward need behind the dispatch point, and nothing else can do.
///
/// Note [The door]: only this module makes a `Door` (its field is private here), and only its
/// entries hand one out, to the kernel closure of the op that entered (`call`, `call_with`,
/// `call_list`, `composite_kernel`, `enter`, ...). So the compiler checks that every tensor
/// built from a backend's storage and every recorded node comes from an op that passed the
/// dispatch point (device check, autocast, promotion, observers). A backward closure keeps
/// its op's door (it is `Copy`). The methods are written where the types they build keep
/// their fields private: `dispatch/tensor_impl.rs` (tensors) and `autograd/mod.rs` (nodes). User code
/// joins the graph through `autograd::custom_op`, as `torch.autograd.Function` does.
#[derive(Clone, Copy)]
pub(crate) struct Door(());

use crate::{DType, Device, Error, Result};
use tensor_impl::Tensor;

/// The device all of `inputs` live on, or the error naming the first two that differ.
pub fn check_devices(op: &'static str, inputs: &[&Tensor]) -> Result<Device> {
    let Some(first) = inputs.first() else {
        return Ok(Device::Cpu);
    };
    let device = first.device();
    for t in &inputs[1..] {
        if t.device() != device {
            return Err(device_mismatch(op, device, t.device()));
        }
    }
    Ok(device)
}

/// The error for operands of `op` on two devices: the one place it is built above the backends.
pub fn device_mismatch(op: &'static str, lhs: Device, rhs: Device) -> Error {
    Error::DeviceMismatch { op, lhs, rhs }
}

/// Step 1b: an input that a copy between GPUs in row blocks still reads or writes orders this
/// thread's stream after the copy, except where the op uses it as the copy allows: views (they
/// read no element; ops on them wait instead), `linear`'s weight (the source is only read; a
/// target `linear` reads block by block itself) and the source of another copy (Note [Copies
/// in row blocks] in `storage/row_blocks.rs`). One load while no such copy is in flight.
fn settle_copies(op: &'static Op, inputs: &[&Tensor]) -> Result<()> {
    const VIEWS: [&Op; 10] = [
        &policy::VIEW,
        &policy::RESHAPE,
        &policy::PERMUTE,
        &policy::TRANSPOSE,
        &policy::NARROW,
        &policy::SLICE,
        &policy::SELECT,
        &policy::UNSQUEEZE,
        &policy::SQUEEZE,
        &policy::EXPAND,
    ];
    let is = |other: &Op| std::ptr::eq(op, other);
    // Asked only while a copy is in flight.
    row_blocks::settle(inputs, |i, source| {
        VIEWS.iter().any(|v| is(v)) || (is(&policy::LINEAR) && i == 1) || (is(&policy::TO) && source)
    })
}

/// Step 3: the operands of `op` cast to the dtype its [`Promotion`] asks for.
fn promote(op: &Op, inputs: &mut [Tensor]) -> Result<()> {
    let operands = match op.promotion {
        Promotion::None => return Ok(()),
        Promotion::CommonMixed if mixed_pair(inputs) => return Ok(()),
        Promotion::Common | Promotion::CommonMixed | Promotion::CommonFloat => &mut inputs[..],
        Promotion::CommonAfterFirst => &mut inputs[1..],
    };
    let Some(first) = operands.first() else {
        return Ok(());
    };
    let mut target = first.dtype();
    for t in &operands[1..] {
        target = target.promote(t.dtype());
    }
    if op.promotion == Promotion::CommonFloat && !target.is_floating_point() {
        target = DType::F32;
    }
    for t in operands.iter_mut() {
        if t.dtype() != target {
            *t = t.to_dtype(target)?;
        }
    }
    Ok(())
}

/// Two CUDA operands, one float32 and the other float16 or bfloat16: the pair that kernels of
/// ops promoted with `Promotion::CommonMixed` read without a cast.
fn mixed_pair(inputs: &[Tensor]) -> bool {
    let [a, b] = inputs else { return false };
    let half = |d: DType| matches!(d, DType::BF16 | DType::F16);
    let pair = (a.dtype() == DType::F32 && half(b.dtype())) || (b.dtype() == DType::F32 && half(a.dtype()));
    pair && a.device().is_cuda() && b.device().is_cuda()
}

/// Inputs of one op after steps 1–3, with the observer's scope (step 4) open until it drops.
pub struct Prepared<const N: usize> {
    /// The operands as the backend sees them: cast by autocast, promoted.
    pub inputs: [Tensor; N],
    /// The device they live on.
    pub device: Device,
    _scope: observer::Scope,
}

/// Steps 1–4 of the dispatch point for `op` over `inputs` (see the module docs).
pub fn prepare<const N: usize>(op: &'static Op, inputs: [&Tensor; N]) -> Result<Prepared<N>> {
    crate::memory::set_current_op(op.name);
    let device = check_devices(op.name, &inputs)?;
    settle_copies(op, &inputs)?;
    let mut inputs = inputs.map(Tensor::clone);
    autocast::apply(op, device, &mut inputs)?;
    promote(op, &mut inputs)?;
    let scope = observer::Scope::enter(op, device, &inputs);
    Ok(Prepared {
        inputs,
        device,
        _scope: scope,
    })
}

/// Runs the differentiable op `op` through every layer: `kernel` computes the output from the
/// prepared inputs (the backend step); `rule` builds the backward closure from the prepared
/// inputs and the output, only when autograd records the op. The closure gets the output's
/// gradient and per input whether it needs one, and returns one entry per input.
pub(crate) fn call<const N: usize, K, R, B>(
    op: &'static Op,
    inputs: [&Tensor; N],
    kernel: K,
    rule: R,
) -> Result<Tensor>
where
    K: FnOnce(&[Tensor; N], Door) -> Result<Tensor>,
    R: FnOnce(&[Tensor; N], &Tensor, Door) -> Result<B>,
    B: Fn(&Tensor, &[bool]) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
{
    let p = prepare(op, inputs)?;
    let out = kernel(&p.inputs, Door(()))?;
    let refs = p.inputs.each_ref();
    if !out.dtype().is_floating_point() || !graph::needs_grad(&refs) {
        return Ok(out);
    }
    let backward = rule(&p.inputs, &out, Door(()))?;
    Ok(Door(()).record(op.name, &refs, out, backward))
}

/// Runs an op with no gradient (comparisons, logical ops, argmax, ...) or one that records
/// its own graph (several outputs): steps 1–4, then `body` on the prepared inputs.
pub(crate) fn call_with<const N: usize, T>(
    op: &'static Op,
    inputs: [&Tensor; N],
    body: impl FnOnce(&[Tensor; N], Door) -> Result<T>,
) -> Result<T> {
    let p = prepare(op, inputs)?;
    body(&p.inputs, Door(()))
}

/// Runs an op built from other ops as ONE op: steps 1–4 for `op` over `inputs`, then `body`
/// on the prepared inputs with autocast suspended (the inner ops run in the dtypes `op`'s
/// policy chose). Inner ops still pass the dispatch point (device checks, observers nested
/// under `op`, autograd). For ops with a variable number of tensors use [`composite_list`].
///
/// ```
/// use ember_core::dispatch::{self, policy};
/// use ember_core::{amp, DType, Device, DeviceType, Tensor};
/// // A mean squared error that autocast and observers see as one `mse_loss` (float32 policy).
/// let mse = |a: &Tensor, b: &Tensor| {
///     dispatch::composite(&policy::MSE_LOSS, [a, b], |[a, b]| a.sub(b)?.square()?.mean_all())
/// };
/// let a = Tensor::ones([4], DType::BF16, Device::Cpu)?;
/// let b = Tensor::zeros([4], DType::BF16, Device::Cpu)?;
/// let _ac = amp::autocast(DeviceType::Cpu, DType::BF16)?;
/// assert_eq!(mse(&a, &b)?.dtype(), DType::F32);
/// # Ok::<(), ember_core::Error>(())
/// ```
pub fn composite<const N: usize, T>(
    op: &'static Op,
    inputs: [&Tensor; N],
    body: impl FnOnce(&[Tensor; N]) -> Result<T>,
) -> Result<T> {
    composite_kernel(op, inputs, |inputs, _| body(inputs))
}

/// [`composite`] for ember's own ops whose body runs kernels (convolution, pooling,
/// layer_norm, linear, the LSTM recurrence): the body also gets the [`Door`].
pub(crate) fn composite_kernel<const N: usize, T>(
    op: &'static Op,
    inputs: [&Tensor; N],
    body: impl FnOnce(&[Tensor; N], Door) -> Result<T>,
) -> Result<T> {
    let p = prepare(op, inputs)?;
    let _suspended = autocast::suspend();
    body(&p.inputs, Door(()))
}

/// [`composite`] for ops over a list of tensors (some of which may be absent, e.g. an
/// optional bias): `inputs` are checked, cast and observed together; `body` gets them back in
/// order.
pub fn composite_list<T>(
    op: &'static Op,
    inputs: &[Option<&Tensor>],
    body: impl FnOnce(&[Option<Tensor>]) -> Result<T>,
) -> Result<T> {
    composite_list_kernel(op, inputs, |inputs, _| body(inputs))
}

/// [`composite_list`] for ember's own ops whose body runs kernels: the body also gets the
/// [`Door`].
pub(crate) fn composite_list_kernel<T>(
    op: &'static Op,
    inputs: &[Option<&Tensor>],
    body: impl FnOnce(&[Option<Tensor>], Door) -> Result<T>,
) -> Result<T> {
    crate::memory::set_current_op(op.name);
    let present: Vec<&Tensor> = inputs.iter().flatten().copied().collect();
    let device = check_devices(op.name, &present)?;
    settle_copies(op, &present)?;
    let mut prepared: Vec<Tensor> = present.into_iter().cloned().collect();
    autocast::apply(op, device, &mut prepared)?;
    promote(op, &mut prepared)?;
    let _scope = observer::Scope::enter(op, device, &prepared);
    let mut it = prepared.into_iter();
    let inputs: Vec<Option<Tensor>> = inputs.iter().map(|t| t.and_then(|_| it.next())).collect();
    let _suspended = autocast::suspend();
    body(&inputs, Door(()))
}

/// An op built from other ops that has no policy of its own (PyTorch's
/// `CompositeImplicitAutograd`: `flatten`, `masked_fill`, `split`, ...): the device check and
/// the observers (steps 1 and 4) see it under its name, then `body` runs, and its inner ops pass
/// every step themselves, autocast included (as PyTorch's implicit composites decompose below
/// the Autocast key). No observer: one device loop and one relaxed load. Its line is in
/// `named_table!` (`policy.rs`); ember-nn's composites (`adaptive_avg_pool2d`) enter here too.
pub fn named<T>(op: &'static Op, inputs: &[&Tensor], body: impl FnOnce() -> Result<T>) -> Result<T> {
    crate::memory::set_current_op(op.name);
    let device = check_devices(op.name, inputs)?;
    let _scope = if observer::is_active() {
        let seen: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
        observer::Scope::enter(op, device, &seen)
    } else {
        observer::Scope::enter(op, device, &[])
    };
    body()
}

/// [`named`] for ember's own ops whose body also runs a kernel of its own beside its inner
/// ops: as `named`, and an input that a copy between GPUs in row blocks still writes is waited
/// for first (step 1b, as `call` does), since the kernel reads it; the body gets the [`Door`].
/// `sort` and `topk` (the backend's ordering, then `gather`), and fused ops of ember's own
/// that stand for a composition of ops with policies of their own (`add_layer_norm`: `add`,
/// then `layer_norm`), whose body applies its parts' policies itself or, where the fused
/// kernel cannot give the composition's result, runs the composition (whose ops pass every
/// step themselves).
pub(crate) fn named_kernel<T>(
    op: &'static Op,
    inputs: &[&Tensor],
    body: impl FnOnce(Door) -> Result<T>,
) -> Result<T> {
    named(op, inputs, || {
        settle_copies(op, inputs)?;
        body(Door(()))
    })
}

/// An op with no tensor input (a factory or a random draw: `zeros`, `arange`, `randn`, ...),
/// or one that checks its operands' devices itself with its own errors (GradScaler's steps), on
/// `device`: the observers see it under its name, then `body` runs.
pub(crate) fn enter<T>(op: &'static Op, device: Device, body: impl FnOnce(Door) -> T) -> T {
    crate::memory::set_current_op(op.name);
    let _scope = observer::Scope::enter(op, device, &[]);
    body(Door(()))
}

/// Steps 1–4 for an op over a list of tensors (`cat`, the fused optimizer steps), then
/// `body` on the prepared list.
pub(crate) fn call_list<T>(
    op: &'static Op,
    inputs: &[&Tensor],
    body: impl FnOnce(&[Tensor], Door) -> Result<T>,
) -> Result<T> {
    crate::memory::set_current_op(op.name);
    let device = check_devices(op.name, inputs)?;
    settle_copies(op, inputs)?;
    let mut prepared: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    autocast::apply(op, device, &mut prepared)?;
    promote(op, &mut prepared)?;
    let _scope = observer::Scope::enter(op, device, &prepared);
    body(&prepared, Door(()))
}

/// Steps 1–4 for an `Fp32` op whose kernel reads f16/bf16 operands and computes in f32 inside
/// (the fused classifier, Note [Classifier in fp32] in `ops/loss.rs`), then `body` on the
/// prepared list and whether its result must be f32: under autocast the first operand is not
/// cast (the kernel reads it as if upcast, without the copy) and `body` gets `true` when that
/// operand is f16 or bf16; the other operands are cast as the policy says. Without autocast,
/// as [`call_list`].
pub(crate) fn call_list_fp32_inside<T>(
    op: &'static Op,
    inputs: &[&Tensor],
    body: impl FnOnce(&[Tensor], bool, Door) -> Result<T>,
) -> Result<T> {
    crate::memory::set_current_op(op.name);
    let device = check_devices(op.name, inputs)?;
    settle_copies(op, inputs)?;
    let mut prepared: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let casting = op.autocast == CastPolicy::Fp32 && autocast::active_dtype(device.device_type()).is_some();
    let f32_result = casting
        && prepared
            .first()
            .is_some_and(|t| matches!(t.dtype(), DType::F16 | DType::BF16));
    if casting && prepared.len() > 1 {
        autocast::apply(op, device, &mut prepared[1..])?;
    }
    promote(op, &mut prepared)?;
    let _scope = observer::Scope::enter(op, device, &prepared);
    body(&prepared, f32_result, Door(()))
}
