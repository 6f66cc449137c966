//! The backend boundary: the op vocabulary ([`table`], [`op`], [`geometry`], [`step`]) and the
//! interface every backend implements: one trait per op family ([`ElementwiseOps`],
//! [`ReduceOps`], ...), gathered by [`BackendStorage`] for a backend's storage, and
//! [`BackendDevice`] for what is made from nothing on a device.
//!
//! Layers: the op layer (`ops/`, `tensor/`, `autograd/`, `random/`) calls the enum
//! [`Storage`](crate::storage::Storage), which forwards each call to the trait on matching
//! variants (one device-mismatch error path) and never names a backend; the backends
//! (`cpu/`, `cuda_backend/`) implement the traits and depend only on this module's vocabulary, never
//! on the op layer. Everything is static dispatch: `Storage` is an enum, the traits are never
//! used as `dyn`.
//!
//! Contract of every method: operands are storages with [`Layout`]s that the op layer has
//! checked (shapes broadcast, dims in range, dtypes promoted, devices equal); results are new
//! row-major storages unless the method writes in place (`*_into`, `copy_strided_from`, the
//! fused steps). The multi-tensor steps (optimizers, GradScaler) take lists of operands over
//! distinct locked storages, checked by `storage/families.rs` against their description in [`step`]. A backend that cannot run one particular problem (CUDA without cuDNN, or with
//! it switched off, a size past cuDNN's limits, a dtype a kernel lacks) answers `Ok(None)` from
//! the methods that return an `Option`, and the op layer takes a composite path; every other
//! failure is a typed [`Error`](crate::Error), never a panic.
//!
//! Adding an op family: its enum or parameter struct goes in [`op`] (or [`geometry`] /
//! [`step`]), its trait here (a supertrait of [`BackendStorage`]), its methods' lines in a `forward!`
//! of `Storage` (`storage/families.rs`), and the trait's implementations in `cpu/<family>.rs` and
//! `cuda_backend/<family>.rs` (+ `kernels/<family>.cu`). An elementwise op is one line of its table
//! ([`table`]; the crate's `architecture` page).

#![deny(unsafe_code)]

pub mod geometry;
pub mod host;
pub mod op;
pub mod step;
pub mod table;

pub use geometry::{ConvParams, PackedGrads, PoolParams, SdpaGrads, SdpaParams};
pub use op::LayerNormGrads;
pub use op::{
    BinaryOp, CmpOp, Distribution, IndexOp, LogicalOp, PhiloxState, PoolMode, ReduceOp, RngState, ScatterOp,
    SoftmaxOp, SortParams, UnaryOp,
};
pub use op::{CrossEntropyParams, Reduction};
pub use step::{
    AdamStep, AdamTensor, Arrival, Arrives, Elems, ForeachCopy, ForeachNorm, GradElems, LstmBackwardStep,
    LstmForwardStep, ScaleUpdate, SgdStep, SgdTensor, StepCount, StepScalars, UnscaleGrads, Variant,
};

use crate::layout::Layout;
use crate::{DType, Device, Result};
pub use host::CpuStorage;

/// A tensor's elements on one backend, and every op family on them (one trait per family,
/// implemented by `cpu/<family>.rs` and `cuda_backend/<family>.rs`). Method names and arguments mirror
/// the op layer's; `self` is the first operand.
pub trait BackendStorage:
    Sized
    + Clone
    + std::fmt::Debug
    + Send
    + Sync
    + CopyOps
    + ElementwiseOps
    + UnaryOps
    + ReduceOps
    + MatmulOps
    + IndexOps
    + SoftmaxOps
    + RandomOps
    + LossOps
    + ConvOps
    + PoolOps
    + RnnOps
    + OptimOps
    + AmpOps
    + AttentionOps
    + NormOps
    + SortOps
{
    /// The device the elements live on.
    fn device(&self) -> Device;
    fn dtype(&self) -> DType;
    /// Number of elements held.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Copies, casts and fills between storages of one backend.
pub trait CopyOps: Sized {
    /// The elements of `layout` in a new row-major storage of `dtype` (a copy when `dtype` is
    /// the storage's own).
    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Result<Self>;
    /// The elements of `layout` copied to host memory, row-major (waits for the device).
    fn to_cpu(&self, layout: &Layout) -> Result<CpuStorage>;
    /// Writes `src` at `src_layout` into `self` at `dst_layout` (equal shapes), converting the
    /// dtype. Both on this backend (across the devices of one backend where it has several).
    fn copy_strided_from(&mut self, dst_layout: &Layout, src: &Self, src_layout: &Layout) -> Result<()>;
    /// Every copy of `list` (`_foreach_copy_`'s plain pairs), converting the dtype as
    /// [`CopyOps::copy_strided_from`] does where a pair's differ (f32, bf16, f16), in as few
    /// launches as the backend can (one per 64 pairs on a GPU).
    fn foreach_copy(list: ForeachCopy<'_, Self>) -> Result<()>;
}

/// Elementwise ops of two or three operands broadcast to one shape (`cpu/binary.rs`, `cuda_backend/elementwise.rs`).
pub trait ElementwiseOps: Sized {
    /// `self op rhs` elementwise over two layouts of one broadcast shape and one dtype.
    fn binary(&self, op: BinaryOp, layout: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self>;
    /// As [`ElementwiseOps::binary`], written into `out` at `out_layout` (contiguous, the
    /// broadcast shape, the dtype of the operands); `out` is no operand's storage.
    #[allow(clippy::too_many_arguments)]
    fn binary_into(
        &self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &Self,
        rhs_layout: &Layout,
        out: &mut Self,
        out_layout: &Layout,
    ) -> Result<()>;
    /// `self op rhs` written over `self`'s elements at `layout` (row-major from its offset),
    /// `rhs` at `rhs_layout` broadcast to that shape, one dtype: the in-place ops (`add_`) as
    /// one kernel and no new buffer; `rhs` is not `self`'s storage.
    fn binary_inplace(
        &mut self,
        op: BinaryOp,
        layout: &Layout,
        rhs: &Self,
        rhs_layout: &Layout,
    ) -> Result<()>;
    /// Comparison giving bool.
    fn compare(&self, op: CmpOp, layout: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self>;
    /// Logical op of two bool operands giving bool.
    fn logical(&self, op: LogicalOp, layout: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self>;
    /// `self ? on_true : on_false` with `self` bool and the other two of one dtype.
    fn where_cond(
        &self,
        layout: &Layout,
        on_true: &Self,
        true_layout: &Layout,
        on_false: &Self,
        false_layout: &Layout,
    ) -> Result<Self>;
}

/// Elementwise functions of one operand.
pub trait UnaryOps: Sized {
    /// `op` applied to each element, in `op.result_dtype(self.dtype())`.
    fn unary(&self, op: UnaryOp, layout: &Layout) -> Result<Self>;
    /// `op` written over `self`'s elements at `layout` (row-major from its offset), for an op
    /// whose result has `self`'s dtype: the in-place scalar ops (`mul_scalar_`) as one kernel
    /// and no new buffer. `false` where the backend has no such form; the caller then writes
    /// the out-of-place result back.
    fn unary_inplace(&mut self, _op: UnaryOp, _layout: &Layout) -> Result<bool> {
        Ok(false)
    }
    /// ReLU's input gradient from its output (`self`) and the output gradient, both contiguous
    /// `len`-element storages of one float dtype: the gradient where the output is positive,
    /// else 0; `None` where the backend leaves it to the comparison and select ops.
    fn relu_backward(&self, _grad_out: &Self, _len: usize) -> Result<Option<Self>> {
        Ok(None)
    }
}

/// Reductions over dims.
pub trait ReduceOps: Sized {
    /// `op` over `dims` (sorted, unique) of `layout`, as a row-major storage of the kept dims.
    fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<Self>;
    /// Max or min over `dims` and the i64 index of its first occurrence.
    fn reduce_with_indices(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Result<(Self, Self)>;
}

/// Orderings along rows (`sort`, `argsort`, `topk`; `cpu/sort.rs`, `cuda_backend/sort.rs`).
pub trait SortOps: Sized {
    /// The positions, as a new row-major int64 storage `[p.rows, p.k]`, of the first `p.k`
    /// elements of each row of `self` at `layout` (contiguous, `p.rows * p.n` elements of
    /// `p.dtype`) in the order [`SortParams`] says: ascending or descending, NaN above every
    /// number, ties in the order of their positions. On a GPU found on the device with nothing
    /// read back, so a CUDA graph may capture it.
    fn sort_indices(&self, layout: &Layout, p: &SortParams) -> Result<Self>;
}

/// Matrix products.
pub trait MatmulOps: Sized {
    /// The batched product of `[B.., m, k]` and `[B.., k, n]` (batch dims already broadcast).
    fn matmul(&self, layout: &Layout, rhs: &Self, rhs_layout: &Layout) -> Result<Self>;
    /// [`MatmulOps::matmul`] plus `bias` (`[n]`) added to every row in the product's
    /// accumulator, rounded once to the output dtype (floats only; `linear`'s addmm).
    fn matmul_bias(
        &self,
        layout: &Layout,
        rhs: &Self,
        rhs_layout: &Layout,
        bias: &Self,
        bias_layout: &Layout,
    ) -> Result<Self>;
    /// [`MatmulOps::matmul`] of float16 or bfloat16 operands written in float32, the
    /// accumulator not rounded to their dtype; `None` where the backend does not (the op layer
    /// then takes the product in their dtype).
    fn matmul_widened(&self, _layout: &Layout, _rhs: &Self, _rhs_layout: &Layout) -> Result<Option<Self>> {
        Ok(None)
    }
    /// The product of the `[m, k]` matrix `self` and the `[k, n]` matrix `rhs` times
    /// `gelu'(aux)` (tanh form) elementwise, `aux` a row-major `[m, n]` of the product's half
    /// dtype: the gradient of a tanh-GELU's input from the product that is the gradient of its
    /// output, in one pass (cuBLASLt's DGELU epilogue; Note [Activation epilogues] in
    /// `autograd/engine.rs`). `None` where the backend does not (the op layer then takes the
    /// product and GELU's backward kernel).
    fn matmul_dgelu(
        &self,
        _layout: &Layout,
        _rhs: &Self,
        _rhs_layout: &Layout,
        _aux: (&Self, &Layout),
    ) -> Result<Option<Self>> {
        Ok(None)
    }
}

/// Reads and writes at index tensors.
pub trait IndexOps: Sized {
    /// `self` read at `index` along `dim` as `op` says (`name` in errors).
    #[allow(clippy::too_many_arguments)]
    fn index_read(
        &self,
        op: IndexOp,
        name: &'static str,
        layout: &Layout,
        dim: usize,
        index: &Self,
        index_layout: &Layout,
    ) -> Result<Self>;
    /// A row-major copy of `self` with `src` written at `index` along `dim` as `op` says.
    #[allow(clippy::too_many_arguments)]
    fn index_write(
        &self,
        op: ScatterOp,
        layout: &Layout,
        dim: usize,
        index: &Self,
        index_layout: &Layout,
        src: &Self,
        src_layout: &Layout,
    ) -> Result<Self>;
    /// int64 one-hot rows of the class indices, and the number of classes used.
    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> Result<(Self, usize)>;

    /// The `[rows, d]` gradient of a table read at `index` along dim 0 (embedding's weight,
    /// index_select's source) from the contiguous `[n, d]` gradient `self` of the rows read and
    /// the contiguous `[n]` indices (int64 or int32, checked in range by the read): each row
    /// the sum of the gradient rows read from it, accumulated in f32 (f64 for f64) in the order
    /// of the positions and rounded once; rows never read are 0. Deterministic: the same bits
    /// on every run (Note [Deterministic embedding backward] in `cuda_backend/index.rs`). With
    /// `into` (`[rows, d]` contiguous, `self`'s dtype), the gradient is added to what it holds
    /// and None is returned (Note [Gradients added in place] in `autograd/engine.rs`).
    fn embedding_backward(
        &self,
        index: &Self,
        n: usize,
        d: usize,
        rows: usize,
        into: Option<&mut Self>,
    ) -> Result<Option<Self>>;
}

/// Softmax and log-softmax along a dim.
pub trait SoftmaxOps: Sized {
    /// `op` along `dim`, as a row-major storage of the same shape.
    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Result<Self>;
    /// The input gradient of `op` from its output (`self`) and the output gradient.
    fn softmax_backward(
        &self,
        layout: &Layout,
        grad: &Self,
        grad_layout: &Layout,
        op: SoftmaxOp,
        dim: usize,
    ) -> Result<Self>;
}

/// Random draws that read a storage (Note [Philox stream] in `random/mod.rs`).
pub trait RandomOps: Sized {
    /// Bernoulli draws with the probabilities of `layout`, in the same dtype (Note [Philox
    /// stream] in `random/mod.rs`); an error naming a probability outside [0, 1].
    fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Result<Self>;
}

/// Losses over contiguous operands from their first element.
pub trait LossOps: Sized {
    /// The negative log-likelihood of the `[m, c]` log-probability rows `self` at the `[m]`
    /// class indices `target` (int64 or int32), weighted by the `[c]` class `weight` when given
    /// (same dtype as `self`): `(loss, total_weight)`, one element each in `self`'s dtype, where
    /// loss = `Σ -w[t]·self[i, t]` over the rows whose target is not `ignore_index`, divided by
    /// total_weight = `Σ w[t]` over them when `mean`. A target outside `0..c` (other than
    /// `ignore_index`) is an [`crate::Error::IndexOutOfRange`] of `nll_loss` (on a GPU reported
    /// at the next synchronizing call).
    fn nll_loss_forward(
        &self,
        target: &Self,
        weight: Option<&Self>,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<(Self, Self)>;
    /// The `[m, c]` gradient of that loss for its (one-element) gradient `self`: `-w[t]·g`, divided
    /// by the forward's `total_weight` when `mean`, at each counted row's target; 0 elsewhere.
    fn nll_loss_backward(
        &self,
        target: &Self,
        weight: Option<&Self>,
        total_weight: &Self,
        mc: (usize, usize),
        ignore_index: i64,
        mean: bool,
    ) -> Result<Self>;

    /// The fused classifier (Note [Classifier in fp32] in `ops/loss.rs`): cross-entropy of the
    /// contiguous `[n, c]` logit rows `self` (any float dtype) at the `[n]` class indices
    /// `target` (int64 or int32), with the optional `[c]` class `weight` and the `[2]` results
    /// in the accumulation dtype `A` (f64 for f64 logits, else f32). Returns `(loss, lse,
    /// total)`: the loss in `p.out_dtype` (`[n]` per row for `Reduction::None`, else one
    /// element), each row's log-sum-exp (`[n]` of `A`) and `total = [Σ w[t], Σ_c w[c]]` (`A`;
    /// the first over the counted rows: the mean's divisor). Rows whose target is
    /// `ignore_index` count for nothing; another target outside `0..c` is an
    /// [`crate::Error::IndexOutOfRange`] of `cross_entropy` (on a GPU reported at the next
    /// synchronizing call, the row counting for nothing). Reductions in a fixed order.
    fn cross_entropy_forward(
        &self,
        target: &Self,
        weight: Option<&Self>,
        p: &CrossEntropyParams,
    ) -> Result<(Self, Self, Self)>;
    /// The `[n, c]` gradient of that loss in the logits' dtype, from the logits `self`, the
    /// forward's `lse` and `total`, and the loss's gradient `grad` (`A`, `[n]` for
    /// `Reduction::None`, else one element), in one pass over the logits.
    #[allow(clippy::too_many_arguments)]
    fn cross_entropy_backward(
        &self,
        target: &Self,
        weight: Option<&Self>,
        lse: &Self,
        total: &Self,
        grad: &Self,
        p: &CrossEntropyParams,
    ) -> Result<Self>;
}

/// Fused attention (`ops/attention.rs`); `None` where the backend does not run the problem
/// (the op layer then computes attention from its parts, PyTorch's math backend).
pub trait AttentionOps: Sized {
    /// The output (`[b, s_q, h, d_v]` row-major, i.e. `[b, h, s_q, d_v]` in BSHD order) and
    /// the float32 log-sum-exp of each score row (`[b, h, s_q]`) of attention of the query
    /// `self` over `key` and `value`, laid out as `p` says.
    fn sdpa_forward(&self, _key: &Self, _value: &Self, _p: &SdpaParams) -> Result<Option<(Self, Self)>> {
        Ok(None)
    }
    /// The gradients of query, key and value (with the strides of `p.grads`, in one buffer
    /// where `p.grads_packed` says) from the forward's operands (`self` the query), its output
    /// and log-sum-exp, and the output's gradient `grad_out` (both in BSHD order).
    #[allow(clippy::too_many_arguments)]
    fn sdpa_backward(
        &self,
        _key: &Self,
        _value: &Self,
        _out: &Self,
        _lse: &Self,
        _grad_out: &Self,
        _p: &SdpaParams,
    ) -> Result<Option<SdpaGrads<Self>>> {
        Ok(None)
    }
}

/// Convolutions over contiguous NCHW operands from their first element; `None` where the backend does not run the problem.
pub trait ConvOps: Sized {
    /// `conv(input = self, weight)` as a new `[N, O, OH, OW]` storage; `None` where this
    /// backend does not run the problem.
    fn conv_forward(&self, weight: &Self, p: &ConvParams) -> Result<Option<Self>>;
    /// The input gradient from the weight (`self`) and the output gradient.
    fn conv_backward_data(&self, grad_out: &Self, p: &ConvParams) -> Result<Option<Self>>;
    /// The weight gradient from the input (`self`) and the output gradient.
    fn conv_backward_filter(&self, grad_out: &Self, p: &ConvParams) -> Result<Option<Self>>;
    /// Adds the `[O]` `bias` to every channel of the convolution output `self` in place (a
    /// fresh `[N, O, OH, OW]` storage of `conv_forward`); false where the backend leaves the
    /// bias to the broadcast addition.
    fn conv_bias_add(&self, _bias: &Self, _p: &ConvParams) -> Result<bool> {
        Ok(false)
    }
}

/// Pooling over contiguous NCHW operands from their first element; `None` where the backend does not run the problem.
pub trait PoolOps: Sized {
    /// `pool(input = self)` as a new `[N, C, OH, OW]` storage; `None` where this backend does
    /// not run the problem.
    fn pool_forward(&self, p: &PoolParams) -> Result<Option<Self>>;
    /// The input gradient from the forward's input (`self`), its output and the output gradient.
    fn pool_backward(&self, output: &Self, grad_out: &Self, p: &PoolParams) -> Result<Option<Self>>;
}

/// The fused LSTM recurrence's steps (in place; offsets checked by the caller).
pub trait RnnOps: Sized {
    /// One forward step of the fused LSTM recurrence (offsets checked by the caller).
    fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &Self,
        hh: &Self,
        h: &mut Self,
        c: &mut Self,
        gates: &mut Self,
    ) -> Result<()>;
    /// One backward step of the fused LSTM recurrence (offsets checked by the caller).
    #[allow(clippy::too_many_arguments)]
    fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &Self,
        dh_rec: Option<&Self>,
        gates: &Self,
        c: &Self,
        dc: &mut Self,
        dgates: &mut Self,
    ) -> Result<()>;
}

/// Fused multi-tensor optimizer steps (in place; `step.rs` describes the operands, and
/// [`Arrives`] what an Adam step's arriving gradient blocks wait on).
pub trait OptimOps: Sized + Arrives {
    /// One fused Adam/AdamW step of every tensor of `tensors` (`torch._fused_adam_`; the
    /// formula is in `ops/fused_optim.rs`), under GradScaler's `amp` scalars. Device step
    /// counts are incremented before the update that reads them, all in stream order; nothing
    /// is read back to the host.
    fn adam_step(
        step: &AdamStep,
        tensors: Vec<AdamTensor<'_, Self>>,
        amp: StepScalars<'_, Self>,
    ) -> Result<()>;
    /// One fused SGD step of every tensor of `tensors` (`torch._fused_sgd_`).
    fn sgd_step(step: &SgdStep, tensors: Vec<SgdTensor<'_, Self>>, amp: StepScalars<'_, Self>) -> Result<()>;
}

/// GradScaler's device-side steps (in place; `step.rs` describes the operands).
pub trait AmpOps: Sized {
    /// Multiplies every gradient by the f32 at `inv_scale` (not at all when it is 1) and sets
    /// the f32 at `found_inf` to 1 when any of them held an inf or NaN before
    /// (`torch._amp_foreach_non_finite_check_and_unscale_`); `found_inf` is never cleared.
    fn non_finite_check_and_unscale(
        grads: UnscaleGrads<'_, Self>,
        found_inf: Elems<&mut Self>,
        inv_scale: Elems<&Self>,
    ) -> Result<()>;
    /// The norm of every run of `list` (of order 2, or infinity) into the f32 `norms[i]`
    /// (`torch._foreach_norm`, for `clip_grad_norm_`): on a GPU a few launches for any number
    /// of tensors, and nothing read back.
    fn foreach_norm(list: ForeachNorm<'_, Self>, norms: Elems<&mut Self>) -> Result<()>;
    /// Updates the f32 `scale` and i32 `growth_tracker` from the f32 at `found_inf` by the
    /// rule `u` (`torch._amp_update_scale_`).
    fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut Self>,
        growth_tracker: Elems<&mut Self>,
        found_inf: Elems<&Self>,
    ) -> Result<()>;
}

/// Fused layer normalization over rows of `n` elements (PyTorch's `native_layer_norm` and
/// `native_layer_norm_backward`; `cpu/norm.rs`, `cuda_backend/norm.rs`). Every operand is
/// contiguous at its layout (the op layer makes it so); `mean` and `rstd` are the forward's,
/// read from their first element. x, y and their gradients share one float dtype; weight and
/// bias have it too, or f32 for an f16/bf16 x (PyTorch's mixed-type kernels); the statistics
/// are the math type (f32; f64 for f64).
pub trait NormOps: Sized {
    /// `self` normalized per row of `n` elements, times `weight`, plus `bias` (each `n`
    /// elements): the output (row-major, x's dtype) and each row's mean and `1/√(var + eps)`;
    /// and, where `twin` asks and the backend writes one, the output's twin in that dtype
    /// (Note [Cast twins] in `storage/mod.rs`).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm(
        &self,
        layout: &Layout,
        weight: Option<(&Self, &Layout)>,
        bias: Option<(&Self, &Layout)>,
        n: usize,
        eps: f64,
        twin: Option<DType>,
    ) -> Result<(Self, Self, Self, Option<Self>)>;
    /// The fused residual add (llm.c's `fused_residual_forward`): `sum = self + residual`
    /// rounded to `self`'s dtype (the sum `add` writes), and [`NormOps::layer_norm`] of that
    /// rounded sum, in one pass: `(sum, (y, mean, rstd, y's twin))`. The residual has `self`'s
    /// dtype and layout size, or (backends that read the pair, Note [Mixed operands] in
    /// `kernels/elementwise.cu`) f16/bf16 beside an f32 `self`; the rest as for `layer_norm`.
    #[allow(clippy::too_many_arguments)]
    fn add_layer_norm(
        &self,
        layout: &Layout,
        residual: (&Self, &Layout),
        weight: Option<(&Self, &Layout)>,
        bias: Option<(&Self, &Layout)>,
        n: usize,
        eps: f64,
        twin: Option<DType>,
    ) -> Result<(Self, (Self, Self, Self, Option<Self>))>;
    /// The gradients of [`NormOps::layer_norm`] from the output gradient `self` and the
    /// forward's input, statistics and weight: those `want` asks for (input, weight, bias).
    /// With `dx_into` (x's dtype, as many elements as x, row-major from its first), the input
    /// gradient is added to what it holds, rounding once, and is not returned (Note [Gradients
    /// added in place] in `autograd/engine.rs`); with `addend` (the same form, only read), the
    /// input gradient returned is `addend + dx`, rounded once (at most one of the two). The
    /// fourth result: where `twin` asks and the backend writes one, the input gradient's twin
    /// in that dtype (of the sum with `dx_into` or `addend`).
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_backward(
        &self,
        layout: &Layout,
        x: (&Self, &Layout),
        mean: &Self,
        rstd: &Self,
        weight: Option<(&Self, &Layout)>,
        n: usize,
        want: LayerNormGrads,
        dx_into: Option<&mut Self>,
        addend: Option<&Self>,
        twin: Option<DType>,
    ) -> Result<[Option<Self>; 4]>;
}

/// A device of one backend: the storages made from nothing there.
pub trait BackendDevice {
    type Storage: BackendStorage;

    /// Host elements moved (CPU) or copied (GPU) onto this device.
    fn storage_from_cpu(&self, cpu: CpuStorage) -> Result<Self::Storage>;
    /// `n` elements of `dtype`, all `value` (converted as a cast would).
    fn full(&self, dtype: DType, n: usize, value: f64) -> Result<Self::Storage>;
    /// Room for `n` elements of `dtype` whose contents the caller writes in full before reading
    /// them (uninitialized on a GPU, zeros on the CPU).
    fn alloc(&self, dtype: DType, n: usize) -> Result<Self::Storage>;
    /// `n` elements of `dtype` drawn from `dist` at `state`, row-major (Note [Philox stream]).
    fn random(&self, dtype: DType, n: usize, dist: Distribution, state: PhiloxState)
        -> Result<Self::Storage>;
    /// The `n` int64 values `start, start + step, ...`, made on the device (no host copy, so a
    /// CUDA graph may capture it).
    fn arange_i64(&self, start: i64, step: i64, n: usize) -> Result<Self::Storage>;
}
