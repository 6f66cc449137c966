//! The op families of [`Storage`]: each family's methods forward to its backend trait
//! (`backend/mod.rs`) on the backend of their first operand, one [`forward!`] per family;
//! the few that do more are written out below it (an in-place write, row blocks, the fused
//! LSTM steps, the multi-tensor steps).

use super::{list_mismatch, Storage};
use crate::backend::BackendStorage;
use crate::backend::{
    AdamStep, AdamTensor, AmpOps, AttentionOps, ConvOps, ConvParams, CopyOps, CrossEntropyParams,
    ElementwiseOps, Elems, ForeachCopy, ForeachNorm, IndexOp, IndexOps, LayerNormGrads, LogicalOp, LossOps,
    LstmBackwardStep, LstmForwardStep, MatmulOps, NormOps, OptimOps, PhiloxState, PoolOps, PoolParams,
    RandomOps, ReduceOp, ReduceOps, RnnOps, ScaleUpdate, ScatterOp, SdpaGrads, SdpaParams, SgdStep,
    SgdTensor, SoftmaxOp, SoftmaxOps, SortOps, SortParams, StepScalars, UnaryOp, UnaryOps, UnscaleGrads,
    Variant,
};
use crate::backend::{BinaryOp, CmpOp};
use crate::cpu::CpuStorage;
use crate::cuda_backend::CudaStorage;
use crate::layout::Layout;
use crate::{DType, Device, Error, Result};

/// A `Storage` operand of a family method as backend `B`'s (`&Storage`, `&mut Storage`, an
/// optional one, one with its layout), or the device of the storage when it is another
/// backend's: what `forward!` passes on for each operand after the first.
trait Operand<B> {
    type Of;
    fn of(self) -> std::result::Result<Self::Of, Device>;
}

impl<'a, B: 'a> Operand<B> for &'a Storage
where
    Storage: Variant<B>,
{
    type Of = &'a B;
    #[inline]
    fn of(self) -> std::result::Result<&'a B, Device> {
        self.variant()
    }
}

impl<'a, B: 'a> Operand<B> for &'a mut Storage
where
    Storage: Variant<B>,
{
    type Of = &'a mut B;
    #[inline]
    fn of(self) -> std::result::Result<&'a mut B, Device> {
        self.variant_mut()
    }
}

impl<'a, B: 'a> Operand<B> for Option<&'a Storage>
where
    Storage: Variant<B>,
{
    type Of = Option<&'a B>;
    #[inline]
    fn of(self) -> std::result::Result<Option<&'a B>, Device> {
        self.map(Variant::variant).transpose()
    }
}

impl<'a, B: 'a> Operand<B> for Option<&'a mut Storage>
where
    Storage: Variant<B>,
{
    type Of = Option<&'a mut B>;
    #[inline]
    fn of(self) -> std::result::Result<Option<&'a mut B>, Device> {
        self.map(Variant::variant_mut).transpose()
    }
}

impl<'a, B: 'a> Operand<B> for (&'a Storage, &'a Layout)
where
    Storage: Variant<B>,
{
    type Of = (&'a B, &'a Layout);
    #[inline]
    fn of(self) -> std::result::Result<(&'a B, &'a Layout), Device> {
        Ok((self.0.variant()?, self.1))
    }
}

impl<'a, B: 'a> Operand<B> for Option<(&'a Storage, &'a Layout)>
where
    Storage: Variant<B>,
{
    type Of = Option<(&'a B, &'a Layout)>;
    #[inline]
    fn of(self) -> std::result::Result<Option<(&'a B, &'a Layout)>, Device> {
        self.map(Operand::<B>::of).transpose()
    }
}

/// A family method's result with every backend storage in it made a [`Storage`].
trait Lift {
    type Out;
    fn lift(self) -> Self::Out;
}

impl Lift for CpuStorage {
    type Out = Storage;
    #[inline]
    fn lift(self) -> Storage {
        Storage::Cpu(self)
    }
}

impl Lift for CudaStorage {
    type Out = Storage;
    #[inline]
    fn lift(self) -> Storage {
        Storage::Cuda(self)
    }
}

/// Results that hold no storage pass unchanged.
macro_rules! lift_as_is {
    ($($t:ty),*) => {$(
        impl Lift for $t {
            type Out = $t;
            #[inline]
            fn lift(self) -> $t {
                self
            }
        }
    )*};
}
lift_as_is!((), bool, usize);

impl<T: Lift> Lift for Option<T> {
    type Out = Option<T::Out>;
    #[inline]
    fn lift(self) -> Self::Out {
        self.map(Lift::lift)
    }
}

impl<A: Lift, B: Lift> Lift for (A, B) {
    type Out = (A::Out, B::Out);
    #[inline]
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift())
    }
}

impl<A: Lift, B: Lift, C: Lift, D: Lift> Lift for (A, B, C, D) {
    type Out = (A::Out, B::Out, C::Out, D::Out);
    #[inline]
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift(), self.2.lift(), self.3.lift())
    }
}

impl<A: Lift, B: Lift, C: Lift> Lift for (A, B, C) {
    type Out = (A::Out, B::Out, C::Out);
    #[inline]
    fn lift(self) -> Self::Out {
        (self.0.lift(), self.1.lift(), self.2.lift())
    }
}

impl<T: Lift, const N: usize> Lift for [T; N] {
    type Out = [T::Out; N];
    #[inline]
    fn lift(self) -> Self::Out {
        self.map(Lift::lift)
    }
}

impl<T: Lift> Lift for SdpaGrads<T> {
    type Out = SdpaGrads<T::Out>;
    #[inline]
    fn lift(self) -> Self::Out {
        self.map(Lift::lift)
    }
}

/// The error for an operand of `op` on `rhs` beside a first operand on `lhs`.
#[cold]
#[inline(never)]
fn mismatch_at(op: &'static str, lhs: Device, rhs: Device) -> Error {
    Error::DeviceMismatch { op, lhs, rhs }
}

/// Forwards one op family: each line is a `Storage` method (its signature with `Storage`
/// operands and the result as `Storage`s, less the `Result`), the operands after `self`
/// that it passes on, and the op named by its device-mismatch error. The method calls the
/// family trait's method of the same name with its arguments in order, on the backend of
/// `self`, each operand made that backend's ([`Operand`]; another backend's is the error) and
/// each storage of the result made a `Storage` again ([`Lift`]).
macro_rules! forward {
    ($family:ident { $(
        $(#[$attr:meta])*
        fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) -> $ret:ty; [$($operand:ident),*] $op:expr;
    )* }) => {
        impl Storage { $(
            $(#[$attr])*
            #[allow(clippy::too_many_arguments)]
            pub(crate) fn $name(&self $(, $arg: $ty)*) -> Result<$ret> {
                match self {
                    Storage::Cpu(this) => {
                        $(let $operand = Operand::<CpuStorage>::of($operand)
                            .map_err(|d| mismatch_at($op, Device::Cpu, d))?;)*
                        Ok(Lift::lift(<CpuStorage as $family>::$name(this $(, $arg)*)?))
                    }
                    Storage::Cuda(this) => {
                        $(let $operand = Operand::<CudaStorage>::of($operand)
                            .map_err(|d| mismatch_at($op, this.device(), d))?;)*
                        Ok(Lift::lift(<CudaStorage as $family>::$name(this $(, $arg)*)?))
                    }
                }
            }
        )* }
    };
}

forward!(ElementwiseOps {
    fn binary(&self, op: BinaryOp, al: &Layout, rhs: &Storage, bl: &Layout) -> Storage;
        [rhs] op.name();
    /// `self op rhs` written into `out` at `ol` (see [`ElementwiseOps::binary_into`]).
    fn binary_into(&self, op: BinaryOp, al: &Layout, rhs: &Storage, bl: &Layout, out: &mut Storage,
        ol: &Layout) -> ();
        [rhs, out] op.name();
    fn compare(&self, op: CmpOp, al: &Layout, rhs: &Storage, bl: &Layout) -> Storage;
        [rhs] op.name();
    fn logical(&self, op: LogicalOp, al: &Layout, rhs: &Storage, bl: &Layout) -> Storage;
        [rhs] op.name();
    fn where_cond(&self, cl: &Layout, a: &Storage, al: &Layout, b: &Storage, bl: &Layout) -> Storage;
        [a, b] "where";
});

forward!(UnaryOps {
    /// `op` applied to the elements of `layout`, in a new row-major storage of
    /// `op.result_dtype(self.dtype())`.
    fn unary(&self, op: UnaryOp, layout: &Layout) -> Storage;
        [] op.name();
    /// ReLU's input gradient from its output `self` and the output gradient (contiguous
    /// `len`-element storages), or `None` where the backend leaves it to the tensor ops.
    fn relu_backward(&self, grad_out: &Storage, len: usize) -> Option<Storage>;
        [grad_out] "relu_backward";
});

forward!(ReduceOps {
    /// `op` over `dims` (sorted, unique) of `layout`, as a row-major storage of the kept dims.
    fn reduce(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> Storage;
        [] op.name();
    /// Max or min over `dims` and the i64 index of its first occurrence.
    fn reduce_with_indices(&self, layout: &Layout, op: ReduceOp, dims: &[usize]) -> (Storage, Storage);
        [] op.name();
});

forward!(MatmulOps {
    /// The batched product of `[B.., m, k]` (`al`) and `[B.., k, n]` (`bl`), two layouts with
    /// the same batch dims, as a new row-major storage of shape `[B.., m, n]`.
    fn matmul(&self, al: &Layout, rhs: &Storage, bl: &Layout) -> Storage;
        [rhs] "matmul";
    /// [`MatmulOps::matmul_widened`]: a half product written in float32, where the backend can.
    fn matmul_widened(&self, al: &Layout, rhs: &Storage, bl: &Layout) -> Option<Storage>;
        [rhs] "matmul";
    /// [`MatmulOps::matmul_dgelu`].
    fn matmul_dgelu(&self, al: &Layout, rhs: &Storage, bl: &Layout, aux: (&Storage, &Layout)) -> Option<Storage>;
        [rhs, aux] "matmul";
    /// [`Storage::matmul`] plus `bias` (`[n]` at `bias_l`) added to every row, in the product's
    /// accumulator, before the one rounding to the output dtype (floats only).
    fn matmul_bias(&self, al: &Layout, rhs: &Storage, bl: &Layout, bias: &Storage, bias_l: &Layout)
        -> Storage;
        [rhs, bias] "linear";
});

forward!(SortOps {
    /// The int64 `[p.rows, p.k]` positions of the first `p.k` elements of each row of `self`
    /// at `layout` (contiguous) in the order of `p` (`SortOps::sort_indices`).
    fn sort_indices(&self, layout: &Layout, p: &SortParams) -> Storage;
        [] "sort";
});

forward!(IndexOps {
    /// `self` (at `layout`) read at `index` along `dim`, as a new row-major storage; `op`
    /// (`name` in errors) says how the index maps to positions.
    fn index_read(&self, op: IndexOp, name: &'static str, layout: &Layout, dim: usize, index: &Storage,
        il: &Layout) -> Storage;
        [index] name;
    /// A row-major copy of `self` (at `layout`) with `src` (at `sl`) written at `index` along
    /// `dim` as `op` says.
    fn index_write(&self, op: ScatterOp, layout: &Layout, dim: usize, index: &Storage, il: &Layout,
        src: &Storage, sl: &Layout) -> Storage;
        [index, src] op.name();
    /// int64 one-hot rows of the class indices at `layout`, and the number of classes used
    /// (`num_classes`, or max + 1 when `None`).
    fn one_hot(&self, layout: &Layout, num_classes: Option<usize>) -> (Storage, usize);
        [] "one_hot";
    /// The `[rows, d]` gradient of a table read at the contiguous `[n]` `index` along dim 0,
    /// from the contiguous `[n, d]` gradient `self` (`IndexOps::embedding_backward`); with
    /// `into`, added to it and `None` returned.
    fn embedding_backward(&self, index: &Storage, n: usize, d: usize, rows: usize, into: Option<&mut Storage>)
        -> Option<Storage>;
        [index, into] "embedding_backward";
});

forward!(LossOps {
    /// `(loss, total_weight)` of the contiguous `[m, c]` log-probability rows `self` at the
    /// class indices `target` (`LossOps::nll_loss_forward`).
    fn nll_loss_forward(&self, target: &Storage, weight: Option<&Storage>, mc: (usize, usize),
        ignore_index: i64, mean: bool) -> (Storage, Storage);
        [target, weight] "nll_loss";
    /// The `[m, c]` gradient of that loss for its gradient `self` (one element).
    fn nll_loss_backward(&self, target: &Storage, weight: Option<&Storage>, total_weight: &Storage,
        mc: (usize, usize), ignore_index: i64, mean: bool) -> Storage;
        [target, weight, total_weight] "nll_loss_backward";
    /// `(loss, lse, total)` of the contiguous `[n, c]` logits `self` at `target`
    /// (`LossOps::cross_entropy_forward`).
    fn cross_entropy_forward(&self, target: &Storage, weight: Option<&Storage>, p: &CrossEntropyParams)
        -> (Storage, Storage, Storage);
        [target, weight] "cross_entropy";
    /// The `[n, c]` gradient of that loss (`LossOps::cross_entropy_backward`).
    fn cross_entropy_backward(&self, target: &Storage, weight: Option<&Storage>, lse: &Storage,
        total: &Storage, grad: &Storage, p: &CrossEntropyParams) -> Storage;
        [target, weight, lse, total, grad] "cross_entropy_backward";
});

forward!(AttentionOps {
    /// Fused attention of the query `self` over `key` and `value` (`AttentionOps::sdpa_forward`):
    /// the output and the row log-sum-exp, or `None` where the backend does not run `p`.
    fn sdpa_forward(&self, key: &Storage, value: &Storage, p: &SdpaParams) -> Option<(Storage, Storage)>;
        [key, value] "_scaled_dot_product_cudnn_attention";
    /// The query, key and value gradients of fused attention (`AttentionOps::sdpa_backward`).
    fn sdpa_backward(&self, key: &Storage, value: &Storage, out: &Storage, lse: &Storage, grad_out: &Storage,
        p: &SdpaParams) -> Option<SdpaGrads<Storage>>;
        [key, value, out, lse, grad_out] "_scaled_dot_product_cudnn_attention_backward";
});

forward!(SoftmaxOps {
    /// `op` along `dim` of `layout`, as a row-major storage of the same shape.
    fn softmax(&self, layout: &Layout, op: SoftmaxOp, dim: usize) -> Storage;
        [] op.name();
    /// The input gradient of `op` along `dim` from its output (`self`) and output gradient.
    fn softmax_backward(&self, yl: &Layout, grad: &Storage, gl: &Layout, op: SoftmaxOp, dim: usize)
        -> Storage;
        [grad] op.name();
});

forward!(RandomOps {
    /// Bernoulli draws with the probabilities of `layout` (row-major order), in the same dtype;
    /// fails when a probability is outside [0, 1].
    fn bernoulli(&self, layout: &Layout, state: PhiloxState) -> Storage;
        [] "bernoulli";
});

forward!(ConvOps {
    /// The convolution of the input `self` with `weight` (both contiguous from their first
    /// element), or `None` where the backend does not run the problem.
    fn conv_forward(&self, weight: &Storage, p: &ConvParams) -> Option<Storage>;
        [weight] "convolution";
    /// The input gradient of a convolution from its weight (`self`) and output gradient.
    fn conv_backward_data(&self, grad_out: &Storage, p: &ConvParams) -> Option<Storage>;
        [grad_out] "convolution_backward";
    /// The weight gradient of a convolution from its input (`self`) and output gradient.
    fn conv_backward_filter(&self, grad_out: &Storage, p: &ConvParams) -> Option<Storage>;
        [grad_out] "convolution_backward";
    /// Adds the `[O]` `bias` to the fresh convolution output `self` in place; false where the
    /// backend leaves it to the broadcast addition.
    fn conv_bias_add(&self, bias: &Storage, p: &ConvParams) -> bool;
        [bias] "convolution";
});

forward!(PoolOps {
    /// Pooling of the input `self` (contiguous from its first element), or `None` where the
    /// backend does not run the problem.
    fn pool_forward(&self, p: &PoolParams) -> Option<Storage>;
        [] "pool2d";
    /// The input gradient of pooling from its input (`self`), output and output gradient.
    fn pool_backward(&self, output: &Storage, grad_out: &Storage, p: &PoolParams) -> Option<Storage>;
        [output, grad_out] "pool2d_backward";
});

forward!(NormOps {
    /// Layer normalization of the rows of `n` elements of `self` (contiguous at `layout`): the
    /// output, each row's mean and each row's `1/√(var + eps)` ([`NormOps::layer_norm`]).
    fn layer_norm(&self, layout: &Layout, weight: Option<(&Storage, &Layout)>,
        bias: Option<(&Storage, &Layout)>, n: usize, eps: f64, twin: Option<DType>)
        -> (Storage, Storage, Storage, Option<Storage>);
        [weight, bias] "layer_norm";
    /// `self + residual` and the layer normalization of that sum in one pass
    /// ([`NormOps::add_layer_norm`]): `(sum, (y, mean, rstd, y's twin))`.
    fn add_layer_norm(&self, layout: &Layout, residual: (&Storage, &Layout), weight: Option<(&Storage, &Layout)>,
        bias: Option<(&Storage, &Layout)>, n: usize, eps: f64, twin: Option<DType>)
        -> (Storage, (Storage, Storage, Storage, Option<Storage>));
        [residual, weight, bias] "add_layer_norm";
    /// The gradients of [`Storage::layer_norm`] from the output gradient `self`
    /// ([`NormOps::layer_norm_backward`]); with `dx_into`, the input's added to it; with
    /// `addend`, the input's returned as `addend + dx`.
    fn layer_norm_backward(&self, layout: &Layout, x: (&Storage, &Layout), mean: &Storage, rstd: &Storage,
        weight: Option<(&Storage, &Layout)>, n: usize, want: LayerNormGrads, dx_into: Option<&mut Storage>,
        addend: Option<&Storage>, twin: Option<DType>) -> [Option<Storage>; 4];
        [x, mean, rstd, weight, dx_into, addend] "layer_norm_backward";
});

forward!(CopyOps {
    /// The elements of `layout` in a new row-major storage of `dtype` on the same device.
    fn to_dtype(&self, layout: &Layout, dtype: DType) -> Storage;
        [] "to_dtype";
});

// The methods that do more than forward.
impl Storage {
    /// `op` over `self`'s elements at `layout`, in place, where the backend can (see
    /// [`UnaryOps::unary_inplace`]).
    pub(crate) fn unary_inplace(&mut self, op: UnaryOp, layout: &Layout) -> Result<bool> {
        match self {
            Storage::Cpu(s) => s.unary_inplace(op, layout),
            Storage::Cuda(s) => s.unary_inplace(op, layout),
        }
    }

    /// `self op rhs` over `self`'s elements at `al` (see [`ElementwiseOps::binary_inplace`]).
    pub(crate) fn binary_inplace(
        &mut self,
        op: BinaryOp,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
    ) -> Result<()> {
        let (a, b) = (self, rhs);
        on_backend!(op.name(), (a, b), _wrap => ElementwiseOps::binary_inplace(a, op, al, b, bl))
    }

    /// [`Storage::matmul`] of two matrices in row blocks of the output, with the events that
    /// mark each block done (GPU only; Note [Gradients in row blocks] in `storage/row_blocks.rs`).
    pub(crate) fn matmul_row_blocks(
        &self,
        al: &Layout,
        rhs: &Storage,
        bl: &Layout,
        blocks: usize,
    ) -> Result<(Storage, Vec<crate::cuda_backend::RowBlockEvent>)> {
        match (self, rhs) {
            (Storage::Cuda(a), Storage::Cuda(b)) => {
                let (out, events) = a.matmul_row_blocks(al, b, bl, blocks)?;
                Ok((Storage::Cuda(out), events))
            }
            _ => Ok((self.matmul(al, rhs, bl)?, Vec::new())),
        }
    }

    /// [`Storage::matmul_bias`] of a `linear` whose weight rows are still arriving on a GPU,
    /// block by block at `arrivals` (Note [Copies in row blocks] in `storage/row_blocks.rs`).
    pub(crate) fn matmul_bias_in_column_blocks(
        &self,
        al: &Layout,
        (rhs, bl): (&Storage, &Layout),
        (bias, bias_l): (&Storage, &Layout),
        arrivals: &super::row_blocks::Arrivals,
    ) -> Result<Storage> {
        match (self, rhs, bias) {
            (Storage::Cuda(a), Storage::Cuda(b), Storage::Cuda(c)) => Ok(Storage::Cuda(
                a.matmul_bias_in_column_blocks(al, (b, bl), (c, bias_l), &arrivals.0)?,
            )),
            _ => self.matmul_bias(al, rhs, bl, bias, bias_l),
        }
    }
}

impl Storage {
    /// One forward step of the fused LSTM recurrence (see [`LstmForwardStep`]); the offsets are
    /// checked against the storages here, before any kernel reads them.
    pub(crate) fn lstm_forward_step(
        s: &LstmForwardStep,
        gi: &Storage,
        hh: &Storage,
        h: &mut Storage,
        c: &mut Storage,
        gates: &mut Storage,
    ) -> Result<()> {
        s.check(gi.len(), hh.len(), h.len(), c.len(), gates.len())?;
        on_backend!("lstm_recurrence", (gi, hh, h, c, gates), _wrap => {
            RnnOps::lstm_forward_step(s, gi, hh, h, c, gates)
        })
    }

    /// One backward step of the fused LSTM recurrence (see [`LstmBackwardStep`]).
    pub(crate) fn lstm_backward_step(
        s: &LstmBackwardStep,
        dh_out: &Storage,
        dh_rec: Option<&Storage>,
        gates: &Storage,
        c: &Storage,
        dc: &mut Storage,
        dgates: &mut Storage,
    ) -> Result<()> {
        s.check(
            dh_out.len(),
            dh_rec.map(Storage::len),
            gates.len(),
            c.len(),
            dc.len(),
            dgates.len(),
        )?;
        const OP: &str = "lstm_recurrence_backward";
        match dh_rec {
            None => on_backend!(OP, (dh_out, gates, c, dc, dgates), _wrap => {
                RnnOps::lstm_backward_step(s, dh_out, None, gates, c, dc, dgates)
            }),
            Some(r) => on_backend!(OP, (dh_out, r, gates, c, dc, dgates), _wrap => {
                RnnOps::lstm_backward_step(s, dh_out, Some(r), gates, c, dc, dgates)
            }),
        }
    }
}

// Multi-tensor steps: the operand lists are cast to the backend of their first storage (an
// operand on another backend is the device-mismatch error) and checked against their
// description (`backend/step.rs`) before a kernel sees them.
impl Storage {
    /// One fused Adam step (see [`AdamTensor`]); the device is that of the first parameter.
    pub(crate) fn adam_step(
        step: &AdamStep,
        tensors: Vec<AdamTensor<'_, Storage>>,
        amp: StepScalars<'_, Storage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let device = first.param.storage.device();
        on_backend_type!(device, B => {
            let tensors: Vec<AdamTensor<'_, B>> = tensors
                .into_iter()
                .map(AdamTensor::cast)
                .collect::<std::result::Result<_, _>>()
                .map_err(list_mismatch("adam_", device))?;
            let amp = amp.cast::<B>().map_err(list_mismatch("adam_", device))?;
            step.check(&tensors, &amp)?;
            <B as OptimOps>::adam_step(step, tensors, amp)
        })
    }

    /// One fused SGD step (see [`SgdTensor`]); the device is that of the first parameter.
    pub(crate) fn sgd_step(
        step: &SgdStep,
        tensors: Vec<SgdTensor<'_, Storage>>,
        amp: StepScalars<'_, Storage>,
    ) -> Result<()> {
        let Some(first) = tensors.first() else {
            return Ok(());
        };
        let device = first.param.storage.device();
        on_backend_type!(device, B => {
            let tensors: Vec<SgdTensor<'_, B>> = tensors
                .into_iter()
                .map(SgdTensor::cast)
                .collect::<std::result::Result<_, _>>()
                .map_err(list_mismatch("sgd_", device))?;
            let amp = amp.cast::<B>().map_err(list_mismatch("sgd_", device))?;
            step.check(&tensors, &amp)?;
            <B as OptimOps>::sgd_step(step, tensors, amp)
        })
    }

    /// GradScaler's inf check and unscale (see [`UnscaleGrads`]) on the device of `found_inf`.
    pub(crate) fn non_finite_check_and_unscale(
        grads: UnscaleGrads<'_, Storage>,
        found_inf: Elems<&mut Storage>,
        inv_scale: Elems<&Storage>,
    ) -> Result<()> {
        const OP: &str = "non_finite_check_and_unscale_";
        let device = found_inf.storage.device();
        on_backend_type!(device, B => {
            let grads = grads.cast::<B>().map_err(list_mismatch(OP, device))?;
            let found_inf = found_inf.cast::<B>().map_err(list_mismatch(OP, device))?;
            let inv_scale = inv_scale.cast::<B>().map_err(list_mismatch(OP, device))?;
            grads.check(&found_inf, &inv_scale)?;
            <B as AmpOps>::non_finite_check_and_unscale(grads, found_inf, inv_scale)
        })
    }

    /// `torch._foreach_norm` (see [`ForeachNorm`]) into `norms`, on its device.
    pub(crate) fn foreach_norm(list: ForeachNorm<'_, Storage>, norms: Elems<&mut Storage>) -> Result<()> {
        const OP: &str = "_foreach_norm";
        let device = norms.storage.device();
        on_backend_type!(device, B => {
            let list = list.cast::<B>().map_err(list_mismatch(OP, device))?;
            let norms = norms.cast::<B>().map_err(list_mismatch(OP, device))?;
            list.check(&norms)?;
            <B as AmpOps>::foreach_norm(list, norms)
        })
    }

    /// `_foreach_copy_`'s plain list (see [`ForeachCopy`]) on the device of its first written
    /// storage.
    pub(crate) fn foreach_copy(list: ForeachCopy<'_, Storage>) -> Result<()> {
        const OP: &str = "_foreach_copy_";
        let Some(device) = list.written.first().map(|s| s.device()) else {
            return Ok(());
        };
        on_backend_type!(device, B => {
            let list = list.cast::<B>().map_err(list_mismatch(OP, device))?;
            list.check()?;
            <B as CopyOps>::foreach_copy(list)
        })
    }

    /// GradScaler's scale update (see [`ScaleUpdate`]) on the device of `scale`.
    pub(crate) fn update_scale(
        u: &ScaleUpdate,
        scale: Elems<&mut Storage>,
        growth_tracker: Elems<&mut Storage>,
        found_inf: Elems<&Storage>,
    ) -> Result<()> {
        const OP: &str = "update_scale_";
        let device = scale.storage.device();
        on_backend_type!(device, B => {
            let scale = scale.cast::<B>().map_err(list_mismatch(OP, device))?;
            let growth_tracker = growth_tracker.cast::<B>().map_err(list_mismatch(OP, device))?;
            let found_inf = found_inf.cast::<B>().map_err(list_mismatch(OP, device))?;
            u.check(&scale, &growth_tracker, &found_inf)?;
            <B as AmpOps>::update_scale(u, scale, growth_tracker, found_inf)
        })
    }
}
