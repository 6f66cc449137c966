//! The op table: one line per op with its PyTorch name, its autocast policy and how its
//! operands are promoted. The autocast column is PyTorch's (`aten/src/ATen/autocast_mode.cpp`:
//! `KERNEL_CUDA(op, lower_precision_fp | fp32 | fp32_set_opt_dtype | fp32_append_dtype |
//! promote)`); an op missing from PyTorch's lists is `Inputs` here. The same table serves CPU
//! autocast (bfloat16): for the ops ember has, PyTorch's CPU lists differ only in ops ember
//! does not have.
//!
//! A line is read by `dispatch::call` and friends, never by the ops themselves: an op names its
//! line (`policy::MATMUL`) and the dispatch point applies it. The table lists the ops ember
//! has; PyTorch's lists hold more (group_norm, kl_div, addcmul, index_put, ...), to be added
//! here with the op.

/// How autocast treats an op's floating-point inputs (PyTorch's `CastPolicy`). Only CUDA (or
/// CPU) floating tensors that are not float64 are ever cast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CastPolicy {
    /// Not in PyTorch's lists: runs in its inputs' dtypes, after the usual promotion.
    Inputs,
    /// `lower_precision_fp`: inputs cast to the autocast dtype (float16 or bfloat16).
    LowerPrecision,
    /// `fp32` (and `fp32_set_opt_dtype`, `fp32_append_dtype`: ember's ops take no dtype
    /// argument): inputs cast to float32.
    Fp32,
    /// `promote`: inputs cast to the widest floating dtype among them.
    Promote,
}

/// How the dispatch point brings an op's operands to one dtype (after autocast).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Promotion {
    /// Operands keep their dtypes (the op checks them, or they have different roles such as
    /// an index tensor).
    None,
    /// All operands cast to their promoted dtype (`torch.result_type`).
    Common,
    /// As `Common`, with integer results computed as float32 (true division).
    CommonFloat,
    /// All operands but the first (a condition or mask) cast to their promoted dtype.
    CommonAfterFirst,
}

/// One line of the table: what the dispatch point knows about an op.
#[derive(Debug)]
pub struct Op {
    /// PyTorch's name (`aten::<name>`), also the autograd node's and the profiler's.
    pub name: &'static str,
    /// The autocast policy.
    pub autocast: CastPolicy,
    /// The operand promotion.
    pub promotion: Promotion,
}

macro_rules! table {
    ($($id:ident = $name:literal, $cast:ident, $promote:ident;)*) => {
        $(
            #[doc = concat!("`", $name, "`: autocast `", stringify!($cast), "`, promotion `", stringify!($promote), "`.")]
            pub static $id: Op = Op { name: $name, autocast: CastPolicy::$cast, promotion: Promotion::$promote };
        )*
        /// Every line of the table, in order.
        pub static ALL: &[&Op] = &[$(&$id),*];
    };
}

table! {
    // ---- lower_precision_fp: matrix products, convolutions, attention, recurrent layers ----
    MATMUL = "matmul", LowerPrecision, None;
    MM = "mm", LowerPrecision, None;
    BMM = "bmm", LowerPrecision, None;
    LINEAR = "linear", LowerPrecision, None;
    CONV1D = "conv1d", LowerPrecision, None;
    CONV2D = "conv2d", LowerPrecision, None;
    SCALED_DOT_PRODUCT_ATTENTION = "scaled_dot_product_attention", LowerPrecision, None;
    LSTM = "lstm", LowerPrecision, None;
    GRU = "gru", LowerPrecision, None;
    RNN_TANH = "rnn_tanh", LowerPrecision, None;
    RNN_RELU = "rnn_relu", LowerPrecision, None;
    LSTM_CELL = "lstm_cell", LowerPrecision, None;
    GRU_CELL = "gru_cell", LowerPrecision, None;
    RNN_TANH_CELL = "rnn_tanh_cell", LowerPrecision, None;
    RNN_RELU_CELL = "rnn_relu_cell", LowerPrecision, None;

    // ---- fp32: precision-sensitive pointwise ops, reductions, normalization, losses ----
    EXP = "exp", Fp32, None;
    EXPM1 = "expm1", Fp32, None;
    LOG = "log", Fp32, None;
    LOG2 = "log2", Fp32, None;
    LOG10 = "log10", Fp32, None;
    LOG1P = "log1p", Fp32, None;
    RECIPROCAL = "reciprocal", Fp32, None;
    RSQRT = "rsqrt", Fp32, None;
    TAN = "tan", Fp32, None;
    ASIN = "asin", Fp32, None;
    ACOS = "acos", Fp32, None;
    SINH = "sinh", Fp32, None;
    COSH = "cosh", Fp32, None;
    POW = "pow", Fp32, Common;
    SOFTPLUS = "softplus", Fp32, None;
    SOFTMAX = "softmax", Fp32, None;
    LOG_SOFTMAX = "log_softmax", Fp32, None;
    SUM = "sum", Fp32, None;
    PROD = "prod", Fp32, None;
    NORM = "norm", Fp32, None;
    LOGSUMEXP = "logsumexp", Fp32, None;
    LAYER_NORM = "layer_norm", Fp32, None;
    CROSS_ENTROPY = "cross_entropy", Fp32, None;
    NLL_LOSS = "nll_loss", Fp32, None;
    MSE_LOSS = "mse_loss", Fp32, None;
    L1_LOSS = "l1_loss", Fp32, None;
    BINARY_CROSS_ENTROPY_WITH_LOGITS = "binary_cross_entropy_with_logits", Fp32, None;

    // ---- promote: mixed operands run in the widest of their dtypes ----
    SCATTER_ADD = "scatter_add", Promote, None;

    // ---- not in PyTorch's lists: the inputs' dtypes ----
    ADD = "add", Inputs, Common;
    SUB = "sub", Inputs, Common;
    MUL = "mul", Inputs, Common;
    DIV = "div", Inputs, CommonFloat;
    MAXIMUM = "maximum", Inputs, Common;
    MINIMUM = "minimum", Inputs, Common;
    EQ = "eq", Inputs, Common;
    NE = "ne", Inputs, Common;
    LT = "lt", Inputs, Common;
    LE = "le", Inputs, Common;
    GT = "gt", Inputs, Common;
    GE = "ge", Inputs, Common;
    LOGICAL_AND = "logical_and", Inputs, None;
    LOGICAL_OR = "logical_or", Inputs, None;
    LOGICAL_XOR = "logical_xor", Inputs, None;
    WHERE = "where", Inputs, CommonAfterFirst;
    CLAMP = "clamp", Inputs, None;
    NEG = "neg", Inputs, None;
    ABS = "abs", Inputs, None;
    SIGN = "sign", Inputs, None;
    SQUARE = "square", Inputs, None;
    SQRT = "sqrt", Inputs, None;
    EXP2 = "exp2", Inputs, None;
    SIN = "sin", Inputs, None;
    COS = "cos", Inputs, None;
    ATAN = "atan", Inputs, None;
    TANH = "tanh", Inputs, None;
    ERF = "erf", Inputs, None;
    ERFC = "erfc", Inputs, None;
    FLOOR = "floor", Inputs, None;
    CEIL = "ceil", Inputs, None;
    ROUND = "round", Inputs, None;
    TRUNC = "trunc", Inputs, None;
    SIGMOID = "sigmoid", Inputs, None;
    LOGSIGMOID = "logsigmoid", Inputs, None;
    RELU = "relu", Inputs, None;
    LEAKY_RELU = "leaky_relu", Inputs, None;
    ELU = "elu", Inputs, None;
    HARDTANH = "hardtanh", Inputs, None;
    HARDSIGMOID = "hardsigmoid", Inputs, None;
    HARDSWISH = "hardswish", Inputs, None;
    GELU = "gelu", Inputs, None;
    GELU_TANH = "gelu_tanh", Inputs, None;
    SILU = "silu", Inputs, None;
    MISH = "mish", Inputs, None;
    SOFTSIGN = "softsign", Inputs, None;
    MEAN = "mean", Inputs, None;
    MAX = "max", Inputs, None;
    MIN = "min", Inputs, None;
    AMAX = "amax", Inputs, None;
    AMIN = "amin", Inputs, None;
    ARGMAX = "argmax", Inputs, None;
    ARGMIN = "argmin", Inputs, None;
    VAR = "var", Inputs, None;
    STD = "std", Inputs, None;
    INDEX_SELECT = "index_select", Inputs, None;
    GATHER = "gather", Inputs, None;
    SCATTER = "scatter", Inputs, None;
    INDEX_ADD = "index_add", Inputs, None;
    EMBEDDING = "embedding", Inputs, None;
    ONE_HOT = "one_hot", Inputs, None;
    NLL_LOSS_FORWARD = "nll_loss_forward", Inputs, None;
    CAT = "cat", Inputs, Common;
    MAX_POOL2D = "max_pool2d", Inputs, None;
    AVG_POOL2D = "avg_pool2d", Inputs, None;
    BATCH_NORM = "batch_norm", Inputs, None;
    DROPOUT = "dropout", Inputs, None;

    // ---- views, casts, moves and copies: never cast or promoted; they pass the point so that
    // device checks and observers see them (PyTorch's profiler lists aten::view, aten::to, ...) ----
    TO = "to", Inputs, None;
    COPY_ = "copy_", Inputs, None;
    FILL_ = "fill_", Inputs, None;
    VIEW = "view", Inputs, None;
    RESHAPE = "reshape", Inputs, None;
    PERMUTE = "permute", Inputs, None;
    TRANSPOSE = "transpose", Inputs, None;
    NARROW = "narrow", Inputs, None;
    SLICE = "slice", Inputs, None;
    SELECT = "select", Inputs, None;
    UNSQUEEZE = "unsqueeze", Inputs, None;
    SQUEEZE = "squeeze", Inputs, None;
    EXPAND = "expand", Inputs, None;
    LSTM_RECURRENCE = "lstm_recurrence", Inputs, None;
    FUSED_ADAM = "_fused_adam_", Inputs, None;
    FUSED_SGD = "_fused_sgd_", Inputs, None;
    FOREACH_COPY = "_foreach_copy_", Inputs, None;
}

/// The line named `name`, if the table has one.
pub fn lookup(name: &str) -> Option<&'static Op> {
    ALL.iter().copied().find(|op| op.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique() {
        let mut names: Vec<&str> = ALL.iter().map(|op| op.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "two lines of the op table share a name");
    }

    #[test]
    fn lookup_finds_lines() {
        assert_eq!(
            lookup("matmul").map(|op| op.autocast),
            Some(CastPolicy::LowerPrecision)
        );
        assert_eq!(lookup("layer_norm").map(|op| op.autocast), Some(CastPolicy::Fp32));
        assert!(lookup("no_such_op").is_none());
    }
}
