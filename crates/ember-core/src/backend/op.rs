//! The op vocabulary the backends implement: one enum (or parameter struct) per op family,
//! with the names errors report and the dtype rules every backend shares. Defined here, below
//! both backends, so that `cpu/` and `cuda/` depend on nothing above the backend boundary; the
//! op layer re-exports each one from its family's file (`ops::binary::BinaryOp`, ...).
//!
//! The elementwise families' enums, names and kernel names are expanded from their op table
//! ([`super::table`]): an op is added there, not here.

use super::table::{binary_table, compare_table, logical_table, unary_table};
use crate::{DType, Error, Result};

// ---------------------------------------------------------------------------------------------
// Elementwise (`ops/binary.rs`).

/// How the dispatch point brings an op's operands to one dtype (after autocast): a column of
/// the op table (`dispatch::policy`), here because the CUDA backend's mixed-operand kernels
/// read it too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    /// Operands keep their dtypes (the op checks them, or they have different roles such as
    /// an index tensor).
    None,
    /// All operands cast to their promoted dtype (`torch.result_type`).
    Common,
    /// As `Common`, except that a float32 operand beside a float16 or bfloat16 one stays as it
    /// is on CUDA, whose kernels read such a pair and compute in float32, as after the cast
    /// (Note [Mixed operands] in `kernels/elementwise.cu`).
    CommonMixed,
    /// As `Common`, with integer results computed as float32 (true division).
    CommonFloat,
    /// All operands but the first (a condition or mask) cast to their promoted dtype.
    CommonAfterFirst,
}

/// Which integer dtypes an elementwise op keeps (the table's `ints` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ints {
    /// Integer and bool inputs compute in float32 (or never arrive: a `CommonFloat` promotion).
    Float,
    /// Integer dtypes are kept, with wrapping integer kernels.
    Int,
    /// Integer dtypes are kept and the op is the identity on them (the rounding ops: a copy).
    Whole,
}

/// What a binary op is on two bool operands (the table's `bools` column).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bools {
    Or,
    And,
    /// Refused: PyTorch has no such op on bool tensors.
    No,
}

macro_rules! define_binary {
    ($( ($v:ident, [$stem:ident $($scalar:ident $inplace:ident $inplace_scalar:ident)?], $cast:ident, $promote:ident, $ints:ident, $bools:ident, $saves:ident)
        |$g:ident, $a:ident, $b:ident, $out:ident| ($da:expr, $db:expr), $doc:literal; )*) => {
        /// Arithmetic on two operands of one dtype (the op table's binary family).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum BinaryOp {
            $(#[doc = $doc] $v,)*
        }

        impl BinaryOp {
            /// Every op of the family, in table order.
            pub const ALL: &'static [BinaryOp] = &[$(BinaryOp::$v),*];

            /// PyTorch's name of the op.
            pub fn name(self) -> &'static str {
                match self {
                    $(BinaryOp::$v => stringify!($stem),)*
                }
            }

            /// The op's kernels' base name: `binary_<name>` (then `_<dtype>`).
            pub fn kernel(self) -> &'static str {
                match self {
                    $(BinaryOp::$v => concat!("binary_", stringify!($stem)),)*
                }
            }

            /// Whether integer operands reach a kernel.
            pub fn ints(self) -> Ints {
                match self {
                    $(BinaryOp::$v => Ints::$ints,)*
                }
            }

            /// What the op is on bool operands.
            pub fn bools(self) -> Bools {
                match self {
                    $(BinaryOp::$v => Bools::$bools,)*
                }
            }
        }
    };
}
binary_table!(define_binary);

macro_rules! define_compare {
    ($( ($v:ident, $stem:ident, $scalar:ident); )*) => {
        /// Comparisons producing bool tensors (the op table's compare family).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum CmpOp {
            $($v,)*
        }

        impl CmpOp {
            /// Every op of the family, in table order.
            pub const ALL: &'static [CmpOp] = &[$(CmpOp::$v),*];

            /// PyTorch's name of the op.
            pub fn name(self) -> &'static str {
                match self {
                    $(CmpOp::$v => stringify!($stem),)*
                }
            }

            /// The op's kernels' base name: `compare_<name>` (then `_<dtype>`).
            pub fn kernel(self) -> &'static str {
                match self {
                    $(CmpOp::$v => concat!("compare_", stringify!($stem)),)*
                }
            }
        }
    };
}
compare_table!(define_compare);

macro_rules! define_logical {
    ($( ($v:ident, $stem:ident, $short:ident); )*) => {
        /// Logical ops on bool tensors (the op table's logical family).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum LogicalOp {
            $($v,)*
        }

        impl LogicalOp {
            /// Every op of the family, in table order.
            pub const ALL: &'static [LogicalOp] = &[$(LogicalOp::$v),*];

            /// PyTorch's name of the op.
            pub fn name(self) -> &'static str {
                match self {
                    $(LogicalOp::$v => stringify!($stem),)*
                }
            }

            /// The op's kernel: `logical_<and|or|xor>`.
            pub fn kernel(self) -> &'static str {
                match self {
                    $(LogicalOp::$v => concat!("logical_", stringify!($short)),)*
                }
            }
        }
    };
}
logical_table!(define_logical);

// ---------------------------------------------------------------------------------------------
// Elementwise of one operand (`ops/unary.rs`).

/// `κ` of the tanh approximation of GELU.
pub const GELU_TANH_KAPPA: f64 = 0.044_715;

/// The name of a unary op: its stem, or the binary op it is the scalar form of.
macro_rules! unary_name {
    ($stem:ident) => {
        stringify!($stem)
    };
    ($stem:ident as $bin:ident) => {
        BinaryOp::$bin.name()
    };
}

/// Up to three kernel parameters, zero-padded.
fn params<const N: usize>(p: [f64; N]) -> [f64; 3] {
    let mut out = [0.0; 3];
    out[..N].copy_from_slice(&p);
    out
}

macro_rules! define_unary {
    ($( ($v:ident $({ $($f:ident),* })? $([ $($p:expr),* ])?, $stem:ident $(as $bin:ident)?,
         $cast:ident, $ints:ident, $saves:ident) |$g:ident, $s:ident $(, $d:ident)?| $rule:expr, $doc:literal; )*) => {
        /// An elementwise function of one operand (the op table's unary family); parameters of
        /// parametrized activations ride along.
        #[derive(Debug, Clone, Copy, PartialEq)]
        pub enum UnaryOp {
            $(#[doc = $doc] $v $({ $($f: f64),* })?,)*
        }

        impl UnaryOp {
            /// Every op of the family in table order, parametrized ones with parameters 0.
            pub const ALL: &'static [UnaryOp] = &[$(UnaryOp::$v $({ $($f: 0.0),* })?),*];

            /// Every kernel of the family and its integer rule, in table order.
            pub const KERNELS: &'static [(&'static str, Ints)] =
                &[$((concat!("unary_", stringify!($stem)), Ints::$ints)),*];

            /// PyTorch's name of the op.
            pub fn name(self) -> &'static str {
                match self {
                    $(UnaryOp::$v { .. } => unary_name!($stem $(as $bin)?),)*
                }
            }

            /// The op's kernels' base name: `unary_<stem>` (then `_<dtype>`).
            pub fn kernel(self) -> &'static str {
                match self {
                    $(UnaryOp::$v { .. } => concat!("unary_", stringify!($stem)),)*
                }
            }

            /// The op's integer rule (Note [Unary dtypes] in `ops/unary.rs`).
            pub fn ints(self) -> Ints {
                match self {
                    $(UnaryOp::$v { .. } => Ints::$ints,)*
                }
            }

            /// The kernel's parameters `c0..c2`, from the op's fields.
            pub fn kernel_params(self) -> [f64; 3] {
                match self {
                    $(UnaryOp::$v { $($($f),*)? } => params([$($($p),*)?]),)*
                }
            }
        }
    };
}
unary_table!(define_unary);

impl UnaryOp {
    /// True for the ops that keep integer dtypes (see Note [Unary dtypes] in `ops/unary.rs`).
    pub fn keeps_integers(self) -> bool {
        self.ints() != Ints::Float
    }

    /// The dtype of `op(x)` for `x` of dtype `input`, or the error PyTorch raises.
    pub fn result_dtype(self, input: DType) -> Result<DType> {
        use UnaryOp::*;
        if input.is_floating_point() {
            return Ok(input);
        }
        if input.is_integer() {
            return Ok(if self.keeps_integers() { input } else { DType::F32 });
        }
        match self {
            Abs | Sign => Ok(DType::Bool),
            Square => Ok(DType::I64),
            Neg => Err(Error::UnsupportedDType {
                op: "neg",
                dtype: DType::Bool,
                hint: "to invert a mask, use logical_not()",
            }),
            _ if self.keeps_integers() => Err(Error::UnsupportedDType {
                op: self.name(),
                dtype: DType::Bool,
                hint: "convert with to_dtype() first",
            }),
            _ => Ok(DType::F32),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reductions (`ops/reduce.rs`).

/// A reduction, as the backends see it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    Sum,
    Prod,
    Mean,
    Max,
    Min,
    ArgMax,
    ArgMin,
    /// `log Σ exp(x)`, computed stably (shifted by the max).
    LogSumExp,
    /// Variance dividing by `K - correction` (1 is Bessel's correction).
    Var {
        correction: f64,
    },
    /// Square root of [`ReduceOp::Var`].
    Std {
        correction: f64,
    },
    /// `linalg.vector_norm` of order `p` (any real or ±inf).
    Norm {
        p: f64,
    },
}

impl ReduceOp {
    /// PyTorch's name of the op, as errors report it.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
            ReduceOp::LogSumExp => "logsumexp",
            ReduceOp::Var { .. } => "var",
            ReduceOp::Std { .. } => "std",
            ReduceOp::Norm { .. } => "linalg.vector_norm",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Indexing (`ops/index.rs`).

/// Index ops that read `self` at the indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexOp {
    /// `out[.., i, ..] = self[.., index[i], ..]` along `dim`; `index` is 1-D.
    Select,
    /// `out[p] = self[p with p[dim] = index[p]]`; `index` has `self`'s rank, `out` its shape.
    Gather,
}

/// Index ops that write `src` into a copy of `self` at the indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScatterOp {
    /// `out[p with p[dim] = index[p]] = src[p]` for `p` over `index`'s shape (last write wins).
    Scatter,
    /// `out[p with p[dim] = index[p]] += src[p]` for `p` over `index`'s shape.
    ScatterAdd,
    /// `out[.., index[i], ..] += src[.., i, ..]` along `dim`; `index` is 1-D.
    IndexAdd,
}

impl IndexOp {
    pub fn name(self) -> &'static str {
        match self {
            IndexOp::Select => "index_select",
            IndexOp::Gather => "gather",
        }
    }
}

impl ScatterOp {
    pub fn name(self) -> &'static str {
        match self {
            ScatterOp::Scatter => "scatter",
            ScatterOp::ScatterAdd => "scatter_add",
            ScatterOp::IndexAdd => "index_add",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Softmax (`ops/softmax.rs`).

/// Which normalization along a dim, as the backends see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SoftmaxOp {
    Softmax,
    LogSoftmax,
}

impl SoftmaxOp {
    /// PyTorch's name of the op, as errors report it.
    pub fn name(self) -> &'static str {
        match self {
            SoftmaxOp::Softmax => "softmax",
            SoftmaxOp::LogSoftmax => "log_softmax",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pooling (`ops/pool.rs`).

/// Which pooling [`crate::ops::pool::pool2d`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PoolMode {
    /// The maximum over each window; padding acts as -inf, NaN propagates (`F.max_pool2d`).
    Max,
    /// The mean over each window with the padding counted as zeros in the divisor `KH·KW`
    /// (`F.avg_pool2d` with `count_include_pad=True`).
    Avg,
}

// ---------------------------------------------------------------------------------------------
// Random draws (`random/`).

/// What to draw, backend-independent (the op enum of the random family).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Distribution {
    /// Uniform on `[low, high)`, floating dtypes.
    Uniform { low: f64, high: f64 },
    /// Normal with this mean and standard deviation, floating dtypes.
    Normal { mean: f64, std: f64 },
    /// 1 with probability `p`, else 0, any dtype.
    Bernoulli { p: f64 },
    /// Integers uniform on `[low, high)`, i64.
    RandInt { low: i64, high: i64 },
}

impl Distribution {
    /// Elements drawn from one counter block (`E` in Note [Philox stream]).
    pub fn per_block(self, dtype: DType) -> usize {
        match self {
            Distribution::Uniform { .. } | Distribution::Normal { .. } => {
                if dtype == DType::F64 {
                    2
                } else {
                    4
                }
            }
            Distribution::Bernoulli { .. } => 4,
            Distribution::RandInt { low, high } => {
                if randint_range(low, high) <= 1 << 32 {
                    4
                } else {
                    2
                }
            }
        }
    }

    /// Counter blocks a draw of `n` elements of `dtype` consumes.
    pub fn blocks(self, n: usize, dtype: DType) -> u64 {
        blocks_for(n, self.per_block(dtype))
    }
}

/// `high - low` of a randint as u64 (callers ensure `low < high`).
pub(crate) fn randint_range(low: i64, high: i64) -> u64 {
    (high as i128 - low as i128) as u64
}

/// `ceil(n / per_block)`.
pub(crate) fn blocks_for(n: usize, per_block: usize) -> u64 {
    n.div_ceil(per_block) as u64
}

/// Elements of one randperm key block (two words per key).
pub(crate) const RANDPERM_PER_BLOCK: usize = 2;

/// The whole state of a generator (`random::Generator`): the Philox key (`seed`) and the next
/// counter block (`offset`, in blocks of four 32-bit words; see Note [Philox stream] in
/// `random/mod.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RngState {
    pub seed: u64,
    pub offset: u64,
}

/// Where one draw's kernels find the Philox `(seed, offset)` (Note [Philox under graph capture]
/// in `random/mod.rs`): what a generator hands a backend for each draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PhiloxState {
    /// The generator's state, passed to the kernels by value (eager execution).
    Value(RngState),
    /// In device memory of GPU `device`, for a draw recorded into a CUDA graph: the kernels
    /// read the seed at `seed_ptr` and use `*offset_ptr + offset` (wrapping) as the offset,
    /// where the generator rewrites `*offset_ptr` before every replay.
    Device {
        device: usize,
        seed_ptr: u64,
        offset_ptr: u64,
        offset: u64,
    },
}

impl PhiloxState {
    /// The state by value, or an error naming `op` for a draw that must read it on the device
    /// (a backend or op that computes on the host cannot be captured).
    pub fn value(self, op: &'static str) -> crate::Result<RngState> {
        match self {
            PhiloxState::Value(s) => Ok(s),
            PhiloxState::Device { device, .. } => Err(crate::Error::invalid(
                op,
                format!(
                    "the generator is capturing a CUDA graph on cuda:{device}, and {op} here reads its state on the host; \
                     draw with another generator, or outside the capture"
                ),
            )),
        }
    }
}

/// The gradients a layer normalization's backward computes: the input's (in its dtype), and
/// the weight's and bias's in the dtype given (None: not needed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerNormGrads {
    pub input: bool,
    pub weight: Option<DType>,
    pub bias: Option<DType>,
}

/// How a loss reduces its per-row values (`reduction=` in PyTorch).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Per-row losses, shaped as the target.
    None,
    /// The (weighted) mean over the rows.
    #[default]
    Mean,
    /// The sum over the rows.
    Sum,
}

impl Reduction {
    /// PyTorch's string for this reduction (`"none"`, `"mean"`, `"sum"`).
    pub fn name(self) -> &'static str {
        match self {
            Reduction::None => "none",
            Reduction::Mean => "mean",
            Reduction::Sum => "sum",
        }
    }

    /// Parses PyTorch's reduction strings.
    pub fn parse(s: &str) -> crate::Result<Reduction> {
        match s {
            "none" => Ok(Reduction::None),
            "mean" => Ok(Reduction::Mean),
            "sum" => Ok(Reduction::Sum),
            other => Err(crate::Error::invalid(
                "reduction",
                format!("{other:?} is not a valid value for reduction; use \"none\", \"mean\" or \"sum\""),
            )),
        }
    }
}

/// The fused classifier's problem (`LossOps::cross_entropy_forward`): `n` rows of `c` logits
/// against class indices, PyTorch's `F.cross_entropy` arguments, and the loss's dtype.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropyParams {
    pub n: usize,
    pub c: usize,
    pub ignore_index: i64,
    /// In `[0, 1]`.
    pub label_smoothing: f64,
    pub reduction: Reduction,
    /// The loss's dtype: the logits' own, or f32 for f16/bf16 logits under autocast (read
    /// as if upcast, Note [Classifier in fp32] in `ops/loss.rs`).
    pub out_dtype: crate::DType,
}

impl CrossEntropyParams {
    /// The backward's check of what it reads: `lse` (one per row), `total` (two) and the loss
    /// gradient (one per row with `Reduction::None`, else one), given their lengths.
    pub fn check_backward_lengths(&self, lse: usize, total: usize, grad: usize) -> crate::Result<()> {
        let grad_len = if self.reduction == Reduction::None {
            self.n
        } else {
            1
        };
        if lse < self.n || total < 2 || grad < grad_len {
            return Err(crate::Error::invalid(
                "cross_entropy_backward",
                format!(
                    "the saved values hold {lse} and {total} elements and the gradient {grad}, for {} rows",
                    self.n
                ),
            ));
        }
        Ok(())
    }
}

/// One problem of `sort`, `argsort` and `topk` (`SortOps::sort_indices`): `rows` rows of `n`
/// elements of `dtype`, one after another from the first element of a contiguous layout, and
/// the first `k` positions (`k <= n`; `k == n` for a sort) of each row in ascending order of
/// the elements, or descending with `descending`. The order is PyTorch's: NaN above every
/// number (so first when descending), -0.0 equal to 0.0, and equal elements in the order of
/// their positions either way (stable).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SortParams {
    pub rows: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: crate::DType,
    pub descending: bool,
}

impl SortParams {
    /// Checks the problem against the storage it reads: its dtype, `k <= n`, and `rows * n`
    /// elements from `offset` among the storage's `len`.
    pub fn check(&self, dtype: crate::DType, offset: usize, len: usize) -> crate::Result<()> {
        const OP: &str = "sort";
        if dtype != self.dtype {
            return Err(crate::Error::DTypeMismatch {
                op: OP,
                expected: self.dtype,
                found: dtype,
            });
        }
        let numel = self.rows.checked_mul(self.n);
        if self.k > self.n
            || numel
                .and_then(|m| m.checked_add(offset))
                .is_none_or(|end| end > len)
        {
            return Err(crate::Error::invalid(
                OP,
                format!(
                    "internal: {} rows of {} (first {}) from element {offset} do not fit a storage of {len}",
                    self.rows, self.n, self.k
                ),
            ));
        }
        Ok(())
    }
}
