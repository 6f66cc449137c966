//! Compile units of the kernel sources: which unit each kernel is in, every unit of each source,
//! and the units a program that runs in a float dtype is likely to need.
//!
//! Note [Kernel units]: NVRTC compiles one unit at a time, not a whole `.cu` file. A unit is
//! one kernel (`binary_f32`, `cast_contig_f16_f32`, `fill_u64`), except that a reduction's
//! second-pass kernel `reduce_<op>_final_<T>` is in its reduction's unit `reduce_<op>_<T>`.
//! The sources wrap every `extern "C"` kernel in its unit's guard (`EMBER_IN_UNIT` in
//! `kernels/prelude.cuh`), and the runtime compiles a file with `-DEMBER_UNIT_<unit>`, so the
//! cubin holds that unit's kernels and nothing else; CI compiles each file with every unit of
//! [`Module::units`] at once and checks that the result has exactly the kernels of the whole
//! file (so this list and the sources agree), plus single units alone. Compiling whole files
//! made a program's first GPU op wait 44-57 s on a fresh H100 host (every op in every dtype);
//! a unit takes a fraction of a second to a few seconds, and a program compiles only the units
//! it launches (Note [Loading kernel units] in `runtime.rs`).

use super::kernels::{dtype_suffix, KernelKey, Module};
use crate::backend::op::Promotion;
use crate::backend::op::{BinaryOp, Bools, CmpOp, Ints, LogicalOp, UnaryOp};
use crate::DType;

/// One compile unit: a source file and the unit's name in it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Unit {
    pub module: Module,
    pub name: String,
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const ALL: [DType; 8] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I64,
    DType::I32,
    DType::U8,
    DType::Bool,
];
/// The (x, weight) dtype pairs of the layer norm kernels.
const LAYER_NORM_PAIRS: [(DType, DType); 6] = [
    (DType::F32, DType::F32),
    (DType::F64, DType::F64),
    (DType::F16, DType::F16),
    (DType::BF16, DType::BF16),
    (DType::F16, DType::F32),
    (DType::BF16, DType::F32),
];
const INDEX: [DType; 2] = [DType::I64, DType::I32];
const INTS: [DType; 3] = [DType::I64, DType::I32, DType::U8];

impl Unit {
    fn new(module: Module, name: impl Into<String>) -> Unit {
        Unit {
            module,
            name: name.into(),
        }
    }

    /// The unit of kernel `key`.
    pub(crate) fn of(key: &KernelKey) -> Unit {
        let base = match key.module {
            Module::Reduce => key.base.strip_suffix("_final").unwrap_or(key.base),
            _ => key.base,
        };
        let mut name = base.to_string();
        for d in key.dtypes.iter().flatten() {
            name.push('_');
            name.push_str(dtype_suffix(*d));
        }
        Unit::new(key.module, name)
    }

    /// The NVRTC option that selects this unit.
    pub fn define(&self) -> String {
        format!("-DEMBER_UNIT_{}", self.name)
    }

    /// The `extern "C"` kernels the unit holds.
    pub fn symbols(&self) -> Vec<String> {
        let mut symbols = vec![self.name.clone()];
        if self.module == Module::Reduce {
            let (op, dtype) = self
                .name
                .rsplit_once('_')
                .expect("reduce units are reduce_<op>_<dtype>");
            symbols.push(format!("{op}_final_{dtype}"));
        }
        symbols
    }
}

fn each<'a>(module: Module, base: &'a str, dtypes: &'a [DType]) -> impl Iterator<Item = Unit> + 'a {
    dtypes
        .iter()
        .map(move |&d| Unit::new(module, format!("{base}_{}", dtype_suffix(d))))
}

impl Module {
    /// Every compile unit of the module's source, as its instantiations list them
    /// (Note [Kernel units]; CI checks the two agree).
    pub fn units(self) -> Vec<Unit> {
        let m = self;
        let mut units: Vec<Unit> = Vec::new();
        match m {
            Module::Copy => {
                for s in ALL {
                    for d in ALL {
                        let pair = format!("{}_{}", dtype_suffix(s), dtype_suffix(d));
                        units.push(Unit::new(m, format!("cast_contig_{pair}")));
                        units.push(Unit::new(m, format!("cast_strided_{pair}")));
                    }
                }
                units.push(Unit::new(m, "fill_u64"));
                units.push(Unit::new(m, "arange_i64"));
                units.push(Unit::new(m, "multi_copy"));
            }
            Module::Elementwise => {
                // The op tables' families (`backend/table.rs`): every binary op in the float
                // dtypes, in the integer ones where it keeps them, on bool where it has a form.
                for &op in BinaryOp::ALL {
                    units.extend(each(m, op.kernel(), &FLOATS));
                    // Note [Mixed operands]: a float32 beside each half dtype, either order.
                    if op.line().promotion == Promotion::CommonMixed {
                        for h in [DType::BF16, DType::F16] {
                            for (a, b) in [(DType::F32, h), (h, DType::F32)] {
                                let name = format!("{}_{}_{}", op.kernel(), dtype_suffix(a), dtype_suffix(b));
                                units.push(Unit::new(m, name));
                            }
                        }
                    }
                    if op.ints() == Ints::Int {
                        units.extend(each(m, op.kernel(), &INTS));
                    }
                    if op.bools() != Bools::No {
                        units.extend(each(m, op.kernel(), &[DType::Bool]));
                    }
                }
                for &op in CmpOp::ALL {
                    units.extend(each(m, op.kernel(), &ALL));
                }
                units.extend(LogicalOp::ALL.iter().map(|op| Unit::new(m, op.kernel())));
                units.extend(each(m, "where_select", &ALL));
                units.extend(each(m, "check_pow_exponent", &INDEX));
            }
            Module::Unary => {
                // The unary table: every op in the float dtypes, and in the integer ones where
                // an integer kernel keeps them (`Ints::Int`).
                for &(kernel, ints) in UnaryOp::KERNELS {
                    units.extend(each(m, kernel, &FLOATS));
                    if ints == Ints::Int {
                        units.extend(each(m, kernel, &INTS));
                    }
                }
            }
            Module::Reduce => {
                for op in ["sum", "prod"] {
                    units.extend(each(m, &format!("reduce_{op}"), &ALL));
                }
                for op in ["lse", "var"] {
                    units.extend(each(m, &format!("reduce_{op}"), &FLOATS));
                }
                for op in ["minmax", "arg"] {
                    units.extend(each(m, &format!("reduce_{op}"), &ALL));
                }
                units.extend(each(m, "reduce_cols_sum", &FLOATS));
            }
            Module::Softmax => {
                units.extend(each(m, "softmax", &FLOATS));
                units.extend(each(m, "softmax_backward", &FLOATS));
            }
            Module::Index => {
                for base in ["check_index", "scatter_mark", "one_hot"] {
                    units.extend(each(m, base, &INDEX));
                }
                for width in [1, 2, 4, 8] {
                    units.extend(each(m, &format!("gather_w{width}"), &INDEX));
                    units.extend(each(m, &format!("scatter_w{width}"), &INDEX));
                }
                for width in [1, 2, 4, 8, 16] {
                    units.extend(each(m, &format!("select_rows_w{width}"), &INDEX));
                }
                for d in ALL {
                    units.extend(each(m, &format!("scatter_add_{}", dtype_suffix(d)), &INDEX));
                }
                for d in FLOATS {
                    units.extend(each(m, &format!("nll_loss_{}", dtype_suffix(d)), &INDEX));
                    units.extend(each(m, &format!("nll_loss_backward_{}", dtype_suffix(d)), &INDEX));
                }
            }
            Module::Random => {
                units.extend(each(m, "uniform", &FLOATS));
                units.extend(each(m, "normal", &FLOATS));
                units.extend(each(m, "bernoulli_p", &ALL));
                units.extend(each(m, "bernoulli", &ALL));
                units.push(Unit::new(m, "randint_i64"));
            }
            Module::Matmul => units.extend(each(m, "matmul", &[DType::I64, DType::I32, DType::U8])),
            Module::Rnn => {
                units.extend(each(m, "lstm_forward", &FLOATS));
                units.extend(each(m, "lstm_backward", &FLOATS));
            }
            Module::Optim => {
                units.extend(each(m, "adam", &FLOATS));
                units.extend(each(m, "sgd", &FLOATS));
                units.push(Unit::new(m, "increment_steps"));
            }
            Module::Amp => {
                units.extend(each(m, "non_finite_check_and_unscale", &FLOATS));
                units.push(Unit::new(m, "update_scale"));
                units.extend(each(m, "foreach_norm_partials", &FLOATS));
                units.push(Unit::new(m, "foreach_norm_finish"));
            }
            Module::Norm => {
                // x's dtype with the parameters' (the same, or f32 for half inputs).
                for (t, w) in LAYER_NORM_PAIRS {
                    let pair = format!("{}_{}", dtype_suffix(t), dtype_suffix(w));
                    units.push(Unit::new(m, format!("layer_norm_{pair}")));
                    units.push(Unit::new(m, format!("layer_norm_backward_{pair}")));
                    units.push(Unit::new(m, format!("add_layer_norm_{pair}")));
                    if t != DType::F64 {
                        units.push(Unit::new(m, format!("layer_norm_backward_rows_{pair}")));
                    }
                }
                units.extend(each(m, "layer_norm_backward_params", &FLOATS));
                // The fused residual add with a float32 x beside a half residual.
                units.extend(each(m, "add_layer_norm_mixed", &[DType::BF16, DType::F16]));
            }
            Module::Loss => {
                for d in FLOATS {
                    units.extend(each(m, &format!("cross_entropy_{}", dtype_suffix(d)), &INDEX));
                    units.extend(each(
                        m,
                        &format!("cross_entropy_backward_{}", dtype_suffix(d)),
                        &INDEX,
                    ));
                }
                units.extend(each(m, "cross_entropy_reduce", &FLOATS));
            }
            Module::Sort => {
                // `sort`, `argsort`, `topk` on the device (Note [Device sort] in `sort.rs`).
                units.extend(each(m, "sort_block", &ALL));
                units.push(Unit::new(m, "sort_merge"));
            }
        }
        if m == Module::Index {
            // The deterministic embedding backward (issue 37).
            units.extend(each(m, "embedding_sort", &INDEX));
            units.extend(each(m, "embedding_backward", &FLOATS));
        }
        units
    }
}

/// The units a program computing in float dtype `dtype` most likely launches (a training
/// step's forward, backward and optimizer, then the usual initializers), in about the order a
/// step first needs them: what the background compiles start on when the first unit of that
/// dtype misses the disk cache (Note [Loading kernel units]). A unit listed here and never used
/// costs only background CPU time on the first run.
pub(crate) fn likely_units(dtype: DType) -> Vec<Unit> {
    let t = dtype_suffix(dtype);
    let width = dtype.size_in_bytes();
    let u = |m: Module, name: String| Unit::new(m, name);
    let mut units = vec![
        u(Module::Elementwise, format!("binary_add_{t}")),
        u(Module::Elementwise, format!("binary_mul_{t}")),
        u(Module::Unary, format!("unary_relu_{t}")),
        u(Module::Copy, format!("cast_strided_{t}_{t}")),
        u(Module::Reduce, format!("reduce_lse_{t}")),
        u(Module::Softmax, format!("softmax_{t}")),
        u(Module::Index, format!("gather_w{width}_i64")),
        u(Module::Index, "check_index_i64".to_string()),
        u(Module::Reduce, format!("reduce_sum_{t}")),
        u(Module::Softmax, format!("softmax_backward_{t}")),
        u(Module::Index, format!("scatter_add_{t}_i64")),
        u(Module::Index, format!("nll_loss_{t}_i64")),
        u(Module::Index, format!("nll_loss_backward_{t}_i64")),
        u(Module::Elementwise, format!("compare_gt_{t}")),
        u(Module::Elementwise, format!("where_select_{t}")),
        u(Module::Elementwise, "where_select_i64".to_string()),
        u(Module::Elementwise, format!("binary_sub_{t}")),
        u(Module::Elementwise, format!("binary_div_{t}")),
        u(Module::Unary, format!("unary_mul_scalar_{t}")),
        u(Module::Unary, format!("unary_add_scalar_{t}")),
        u(Module::Unary, format!("unary_sqrt_{t}")),
        u(Module::Unary, format!("unary_exp_{t}")),
        u(Module::Unary, format!("unary_neg_{t}")),
        u(Module::Optim, format!("adam_{t}")),
        u(Module::Reduce, format!("reduce_minmax_{t}")),
        u(Module::Reduce, format!("reduce_arg_{t}")),
        u(Module::Index, format!("select_rows_w{width}_i64")),
        u(Module::Optim, format!("sgd_{t}")),
        u(Module::Random, format!("normal_{t}")),
        u(Module::Random, format!("uniform_{t}")),
        u(Module::Random, format!("bernoulli_p_{t}")),
        u(Module::Copy, "fill_u64".to_string()),
        u(Module::Elementwise, "compare_eq_i64".to_string()),
        u(Module::Reduce, "reduce_sum_bool".to_string()),
        u(Module::Copy, format!("cast_contig_bool_{t}")),
        u(Module::Copy, format!("cast_contig_i64_{t}")),
    ];
    if dtype != DType::F32 {
        // Mixed precision: master weights and losses stay in f32.
        units.push(u(Module::Copy, format!("cast_contig_f32_{t}")));
        units.push(u(Module::Copy, format!("cast_contig_{t}_f32")));
        units.push(u(Module::Amp, format!("non_finite_check_and_unscale_{t}")));
        units.push(u(Module::Amp, "update_scale".to_string()));
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reduction_and_its_final_pass_share_a_unit() {
        let main = Unit::of(&KernelKey::new(Module::Reduce, "reduce_sum", DType::F16));
        let last = Unit::of(&KernelKey::new(Module::Reduce, "reduce_sum_final", DType::F16));
        assert_eq!(main, last);
        assert_eq!(main.name, "reduce_sum_f16");
        assert_eq!(main.symbols(), ["reduce_sum_f16", "reduce_sum_final_f16"]);
        assert_eq!(main.define(), "-DEMBER_UNIT_reduce_sum_f16");
        let cast = Unit::of(&KernelKey::with2(
            Module::Copy,
            "cast_contig",
            DType::F32,
            DType::Bool,
        ));
        assert_eq!(cast.name, "cast_contig_f32_bool");
        assert_eq!(
            Unit::of(&KernelKey::plain(Module::Copy, "fill_u64")).symbols(),
            ["fill_u64"]
        );
    }

    #[test]
    fn every_likely_unit_is_a_unit_of_its_module() {
        for dtype in FLOATS {
            for unit in likely_units(dtype) {
                assert!(unit.module.units().contains(&unit), "{unit:?}");
            }
        }
        let all: usize = Module::ALL.iter().map(|m| m.units().len()).sum();
        assert!(all > 300, "{all} units");
    }
}
