//! The op table: one line per op with its PyTorch name, its autocast policy and how its
//! operands are promoted. The autocast column is PyTorch's (`aten/src/ATen/autocast_mode.cpp`:
//! `KERNEL_CUDA(op, lower_precision_fp | fp32 | fp32_set_opt_dtype | fp32_append_dtype |
//! promote)`); an op missing from PyTorch's lists is `Inputs` here. The same table serves CPU
//! autocast (bfloat16): for the ops ember has, PyTorch's CPU lists differ only in ops ember
//! does not have.
//!
//! A line is read by `dispatch::call` and friends, never by the ops themselves: an op names its
//! line (`policy::MATMUL`, `UnaryOp::line`) and the dispatch point applies it. The elementwise
//! families (unary, binary, comparisons, logical ops) keep their lines in their op table
//! (`backend/table.rs`, beside each op's dtype and backward rules), expanded here; [`all`]
//! lists every line. The table lists the ops ember has; PyTorch's lists hold more
//! (group_norm, kl_div, addcmul, index_put, ...), to be added here with the op.

pub use crate::backend::op::Promotion;
use crate::backend::op::{BinaryOp, CmpOp, LogicalOp, UnaryOp};
use crate::backend::table::{binary_table, compare_table, logical_table, unary_table};

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
        /// Every line of this table, in order (the families' lines are in [`all`]).
        static TABLE: &[&Op] = &[$(&$id),*];
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
    WHERE = "where", Inputs, CommonAfterFirst;
    CLAMP = "clamp", Inputs, None;
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
    SCALED_DOT_PRODUCT_CUDNN_ATTENTION = "_scaled_dot_product_cudnn_attention", Inputs, None;
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

/// Ops that enter the dispatch point under their own name without a policy of their own
/// (PyTorch's `CompositeImplicitAutograd` ops, the factories and the random draws): the
/// observers see them, their inner ops do the work and take the autocast and promotion policy
/// of their own lines. [`all`] leaves them out; [`named`] lists them.
macro_rules! named_table {
    ($($id:ident = $name:literal;)*) => {
        $(
            #[doc = concat!("`", $name, "`: seen by the observers, no policy of its own.")]
            pub static $id: Op = Op { name: $name, autocast: CastPolicy::Inputs, promotion: Promotion::None };
        )*
        static NAMED: &[&Op] = &[$(&$id),*];
    };
}

named_table! {
    EMPTY = "empty";
    ZEROS = "zeros";
    ONES = "ones";
    FULL = "full";
    SCALAR_TENSOR = "scalar_tensor";
    TENSOR = "tensor";
    ARANGE = "arange";
    LINSPACE = "linspace";
    EYE = "eye";
    EMPTY_LIKE = "empty_like";
    ZEROS_LIKE = "zeros_like";
    ONES_LIKE = "ones_like";
    FULL_LIKE = "full_like";

    RAND = "rand";
    RANDN = "randn";
    NORMAL = "normal";
    RANDINT = "randint";
    RANDPERM = "randperm";
    RAND_LIKE = "rand_like";
    RANDN_LIKE = "randn_like";
    BERNOULLI = "bernoulli";
    UNIFORM_ = "uniform_";
    NORMAL_ = "normal_";
    BERNOULLI_ = "bernoulli_";

    CONTIGUOUS = "contiguous";
    CLONE = "clone";
    PIN_MEMORY = "pin_memory";
    BROADCAST_COALESCED = "broadcast_coalesced";
    ITEM = "item";
    DETACH = "detach";

    LOGICAL_NOT = "logical_not";
    MASKED_FILL = "masked_fill";
    CLAMP_MIN = "clamp_min";
    CLAMP_MAX = "clamp_max";
    CLAMP_ = "clamp_";
    ZERO_ = "zero_";
    ADDCMUL_ = "addcmul_";
    ADDCDIV_ = "addcdiv_";
    LERP_ = "lerp_";
    RELU6 = "relu6";
    SELU = "selu";
    CELU = "celu";
    T = "t";
    FLATTEN = "flatten";
    SPLIT = "split";
    SPLIT_WITH_SIZES = "split_with_sizes";
    CHUNK = "chunk";
    STACK = "stack";
    UNBIND = "unbind";
    BROADCAST_TO = "broadcast_to";
    IM2COL = "im2col";
    ADAPTIVE_AVG_POOL2D = "adaptive_avg_pool2d";
    SLICE_SCATTER = "slice_scatter";
    SORT = "sort";
    ARGSORT = "argsort";
    TOPK = "topk";
    MULTINOMIAL = "multinomial";
    TRIL = "tril";
    TRIU = "triu";
    AMP_NON_FINITE_CHECK_AND_UNSCALE_ = "_amp_foreach_non_finite_check_and_unscale_";
    AMP_UPDATE_SCALE_ = "_amp_update_scale_";
    FOREACH_NORM = "_foreach_norm";
    FOREACH_MUL_ = "_foreach_mul_";
    // ember's fused residual add (no PyTorch op; llm.c's `fused_residual_forward`): its parts'
    // policies, `add`'s and `layer_norm`'s (`ops/norm.rs`).
    ADD_LAYER_NORM = "add_layer_norm";
}

/// Every op that enters under its own name without a policy of its own (`named_table!`).
pub fn named() -> &'static [&'static Op] {
    NAMED
}

/// A family op's line: a static of its own, made where the family's table is expanded.
macro_rules! family_line {
    ($name:expr, $cast:ident, $promote:ident) => {{
        static LINE: Op = Op {
            name: $name,
            autocast: CastPolicy::$cast,
            promotion: Promotion::$promote,
        };
        &LINE
    }};
}

/// The line of a binary op's in-place form; an op with none (`gelu_backward`) answers its own.
macro_rules! inplace_line {
    ($v:ident) => {
        BinaryOp::$v.line()
    };
    ($v:ident $inplace:ident) => {
        family_line!(stringify!($inplace), Inputs, None)
    };
}

macro_rules! binary_lines {
    ($( ($v:ident, [$stem:ident $($scalar:ident $inplace:ident $inplace_scalar:ident)?], $cast:ident, $promote:ident, $ints:ident, $bools:ident, $saves:ident)
        |$g:ident, $a:ident, $b:ident, $out:ident| ($da:expr, $db:expr), $doc:literal; )*) => {
        impl BinaryOp {
            /// The op's policy line.
            pub fn line(self) -> &'static Op {
                match self {
                    $(BinaryOp::$v => family_line!(stringify!($stem), $cast, $promote),)*
                }
            }

            /// The line of the op's in-place form (`add_`): never cast or promoted, as
            /// PyTorch's autocast leaves in-place ops alone; the op converts `other` itself.
            pub fn inplace_line(self) -> &'static Op {
                match self {
                    $(BinaryOp::$v => inplace_line!($v $($inplace)?),)*
                }
            }
        }
    };
}
binary_table!(binary_lines);

/// A unary op's line: its own, or (a scalar form) its binary op's.
macro_rules! unary_line {
    ($stem:ident, $cast:ident) => {
        family_line!(stringify!($stem), $cast, None)
    };
    ($stem:ident as $bin:ident, $cast:ident) => {
        BinaryOp::$bin.line()
    };
}

macro_rules! unary_lines {
    ($( ($v:ident $({ $($f:ident),* })? $([ $($p:expr),* ])?, $stem:ident $(as $bin:ident)?,
         $cast:ident, $ints:ident, $saves:ident) |$g:ident, $s:ident $(, $d:ident)?| $rule:expr, $doc:literal; )*) => {
        impl UnaryOp {
            /// The op's policy line.
            pub fn line(self) -> &'static Op {
                match self {
                    $(UnaryOp::$v { .. } => unary_line!($stem $(as $bin)?, $cast),)*
                }
            }
        }
    };
}
unary_table!(unary_lines);

macro_rules! compare_lines {
    ($( ($v:ident, $stem:ident, $scalar:ident); )*) => {
        impl CmpOp {
            /// The op's policy line.
            pub fn line(self) -> &'static Op {
                match self {
                    $(CmpOp::$v => family_line!(stringify!($stem), Inputs, Common),)*
                }
            }
        }
    };
}
compare_table!(compare_lines);

macro_rules! logical_lines {
    ($( ($v:ident, $stem:ident, $short:ident); )*) => {
        impl LogicalOp {
            /// The op's policy line.
            pub fn line(self) -> &'static Op {
                match self {
                    $(LogicalOp::$v => family_line!(stringify!($stem), Inputs, None),)*
                }
            }
        }
    };
}
logical_table!(logical_lines);

/// Every line: this file's table, then the elementwise families' (each line once).
pub fn all() -> Vec<&'static Op> {
    let mut lines: Vec<&'static Op> = TABLE.to_vec();
    let family = (UnaryOp::ALL.iter().map(|op| op.line()))
        .chain(BinaryOp::ALL.iter().map(|op| op.line()))
        .chain(BinaryOp::ALL.iter().map(|op| op.inplace_line()))
        .chain(CmpOp::ALL.iter().map(|op| op.line()))
        .chain(LogicalOp::ALL.iter().map(|op| op.line()));
    for line in family {
        if !lines.iter().any(|l| std::ptr::eq(*l, line)) {
            lines.push(line);
        }
    }
    lines
}

/// The line named `name`, if the table has one.
pub fn lookup(name: &str) -> Option<&'static Op> {
    all().into_iter().find(|op| op.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique() {
        let mut names: Vec<&str> = all().iter().map(|op| op.name).collect();
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
        // Family lines: the scalar forms share their binary op's line.
        assert!(std::ptr::eq(
            UnaryOp::MulScalar { value: 2.0 }.line(),
            BinaryOp::Mul.line()
        ));
        assert_eq!(lookup("erfinv").map(|op| op.autocast), Some(CastPolicy::Fp32));
        assert_eq!(lookup("div").map(|op| op.promotion), Some(Promotion::CommonFloat));
        assert_eq!(lookup("pow").map(|op| op.autocast), Some(CastPolicy::Fp32));
    }
}
