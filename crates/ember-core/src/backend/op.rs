//! The op vocabulary the backends implement: one enum (or parameter struct) per op family,
//! with the names errors report and the dtype rules every backend shares. Defined here, below
//! both backends, so that `cpu/` and `cuda/` depend on nothing above the backend boundary; the
//! op layer re-exports each one from its family's file (`ops::binary::BinaryOp`, ...).

use crate::{DType, Error, Result};

// ---------------------------------------------------------------------------------------------
// Elementwise (`ops/binary.rs`).

/// Arithmetic on two operands of one dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
        }
    }
}

/// Comparisons producing bool tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub fn name(self) -> &'static str {
        match self {
            CmpOp::Eq => "eq",
            CmpOp::Ne => "ne",
            CmpOp::Lt => "lt",
            CmpOp::Le => "le",
            CmpOp::Gt => "gt",
            CmpOp::Ge => "ge",
        }
    }
}

/// Logical ops on bool tensors (other dtypes are converted with `!= 0` first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogicalOp {
    And,
    Or,
    Xor,
}

impl LogicalOp {
    pub fn name(self) -> &'static str {
        match self {
            LogicalOp::And => "logical_and",
            LogicalOp::Or => "logical_or",
            LogicalOp::Xor => "logical_xor",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Elementwise of one operand (`ops/unary.rs`).

/// `κ` of the tanh approximation of GELU.
pub const GELU_TANH_KAPPA: f64 = 0.044_715;

/// An elementwise function of one operand; parameters of parametrized activations ride along.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    Neg,
    Abs,
    Sign,
    Square,
    Reciprocal,
    Sqrt,
    Rsqrt,
    Exp,
    Exp2,
    Expm1,
    Log,
    Log2,
    Log10,
    Log1p,
    Sin,
    Cos,
    Tan,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    Erf,
    Erfc,
    Floor,
    Ceil,
    /// Round half to even, as `torch.round`.
    Round,
    Trunc,
    Sigmoid,
    LogSigmoid,
    Relu,
    /// `x > 0 ? x : negative_slope * x`.
    LeakyRelu {
        negative_slope: f64,
    },
    /// `x > 0 ? scale * x : scale * alpha * (exp(input_scale * x) - 1)` (ELU, SELU, CELU).
    Elu {
        alpha: f64,
        scale: f64,
        input_scale: f64,
    },
    /// `x` clamped to `[min, max]` (hardtanh, relu6).
    Hardtanh {
        min: f64,
        max: f64,
    },
    Hardsigmoid,
    Hardswish,
    /// `x * Φ(x)` with the exact normal CDF (PyTorch's default GELU).
    Gelu,
    /// `0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))` (`approximate='tanh'`).
    GeluTanh,
    Silu,
    Mish,
    /// `βx > threshold ? x : log(1 + exp(βx)) / β`.
    Softplus {
        beta: f64,
        threshold: f64,
    },
    Softsign,
    /// `x + value` for a float tensor and a scalar (`add_scalar`); the scalar is rounded once
    /// to the compute type (float32 for half dtypes), as PyTorch computes a tensor with a
    /// Python number: never rounded to the tensor's half dtype first.
    AddScalar {
        value: f64,
    },
    /// `x - value` (see [`UnaryOp::AddScalar`]).
    SubScalar {
        value: f64,
    },
    /// `x * value` (see [`UnaryOp::AddScalar`]).
    MulScalar {
        value: f64,
    },
    /// `x / value` (see [`UnaryOp::AddScalar`]).
    DivScalar {
        value: f64,
    },
}

impl UnaryOp {
    /// PyTorch's name of the op.
    pub fn name(self) -> &'static str {
        use UnaryOp::*;
        match self {
            Neg => "neg",
            Abs => "abs",
            Sign => "sign",
            Square => "square",
            Reciprocal => "reciprocal",
            Sqrt => "sqrt",
            Rsqrt => "rsqrt",
            Exp => "exp",
            Exp2 => "exp2",
            Expm1 => "expm1",
            Log => "log",
            Log2 => "log2",
            Log10 => "log10",
            Log1p => "log1p",
            Sin => "sin",
            Cos => "cos",
            Tan => "tan",
            Asin => "asin",
            Acos => "acos",
            Atan => "atan",
            Sinh => "sinh",
            Cosh => "cosh",
            Tanh => "tanh",
            Erf => "erf",
            Erfc => "erfc",
            Floor => "floor",
            Ceil => "ceil",
            Round => "round",
            Trunc => "trunc",
            Sigmoid => "sigmoid",
            LogSigmoid => "logsigmoid",
            Relu => "relu",
            LeakyRelu { .. } => "leaky_relu",
            Elu { .. } => "elu",
            Hardtanh { .. } => "hardtanh",
            Hardsigmoid => "hardsigmoid",
            Hardswish => "hardswish",
            Gelu => "gelu",
            GeluTanh => "gelu_tanh",
            Silu => "silu",
            Mish => "mish",
            Softplus { .. } => "softplus",
            Softsign => "softsign",
            AddScalar { .. } => "add",
            SubScalar { .. } => "sub",
            MulScalar { .. } => "mul",
            DivScalar { .. } => "div",
        }
    }

    /// True for the ops that keep integer dtypes (see Note [Unary dtypes] in `ops/unary.rs`).
    pub fn keeps_integers(self) -> bool {
        use UnaryOp::*;
        matches!(
            self,
            Neg | Abs | Sign | Relu | Square | Floor | Ceil | Round | Trunc
        )
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
            Relu | Floor | Ceil | Round | Trunc => Err(Error::UnsupportedDType {
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
