//! Group "core": each case's PyTorch `op` + `kwargs` mapped to ember's Tensor calls, computing
//! exactly what `core_cases` in `gen_reference.py` computes (view cases end in `.contiguous()`,
//! `reshape_t` transposes first, `chain` evaluates its expression).
//!
//! An op without an arm here is reported as skipped ("not mapped"); add the arm when ember
//! gains the method.

use super::kwargs::Kwargs;
use super::Fail;
use ember_core::{Result as EResult, Tensor};

/// PyTorch's outputs of `case`, computed with ember from `x` (the inputs in manifest order).
pub fn forward(op: &str, id: &str, kw: &Kwargs, x: &[Tensor]) -> Result<Vec<Tensor>, Fail> {
    let one = |t: EResult<Tensor>| -> Result<Vec<Tensor>, Fail> { Ok(vec![t?]) };
    let arity = |n: usize| -> Result<(), Fail> {
        if x.len() == n {
            Ok(())
        } else {
            Err(Fail::Failed(format!(
                "runner: {op} takes {n} inputs, the case has {}",
                x.len()
            )))
        }
    };
    match op {
        // ---- unary -------------------------------------------------------------------------
        "neg" | "abs" | "exp" | "log" | "log1p" | "sqrt" | "rsqrt" | "sin" | "cos" | "tanh" | "sigmoid"
        | "relu" | "silu" | "softplus" | "reciprocal" | "sign" | "floor" | "ceil" | "round" => {
            arity(1)?;
            kw.only(&[])?;
            let t = &x[0];
            one(match op {
                "neg" => t.neg(),
                "abs" => t.abs(),
                "exp" => t.exp(),
                "log" => t.log(),
                "log1p" => t.log1p(),
                "sqrt" => t.sqrt(),
                "rsqrt" => t.rsqrt(),
                "sin" => t.sin(),
                "cos" => t.cos(),
                "tanh" => t.tanh(),
                "sigmoid" => t.sigmoid(),
                "relu" => t.relu(),
                "silu" => t.silu(),
                "softplus" => t.softplus(),
                "reciprocal" => t.reciprocal(),
                "sign" => t.sign(),
                "floor" => t.floor(),
                "ceil" => t.ceil(),
                "round" => t.round(),
                _ => unreachable!("listed above"),
            })
        }
        "gelu" => {
            arity(1)?;
            kw.only(&["approximate"])?;
            match kw.opt_str("approximate")?.unwrap_or("none") {
                "none" => one(x[0].gelu()),
                "tanh" => one(x[0].gelu_tanh()),
                other => Err(Fail::unmapped(format!("gelu approximate={other:?}"))),
            }
        }

        // ---- binary, comparisons, selection -------------------------------------------------
        "add" | "sub" | "mul" | "div" | "maximum" | "minimum" | "pow" => {
            kw.only(&["other", "exponent"])?;
            let (a, scalar) = (&x[0], kw.opt_scalar("other")?.or(kw.opt_scalar("exponent")?));
            match scalar {
                Some(s) => {
                    arity(1)?;
                    one(match op {
                        "add" => a.add_scalar(s),
                        "sub" => a.sub_scalar(s),
                        "mul" => a.mul_scalar(s),
                        "div" => a.div_scalar(s),
                        "maximum" => a.maximum_scalar(s),
                        "minimum" => a.minimum_scalar(s),
                        _ => a.pow_scalar(s),
                    })
                }
                None => {
                    arity(2)?;
                    let b = &x[1];
                    one(match op {
                        "add" => a.add(b),
                        "sub" => a.sub(b),
                        "mul" => a.mul(b),
                        "div" => a.div(b),
                        "maximum" => a.maximum(b),
                        "minimum" => a.minimum(b),
                        _ => a.pow(b),
                    })
                }
            }
        }
        "eq" | "ne" | "lt" | "le" | "gt" | "ge" => {
            arity(2)?;
            kw.only(&[])?;
            let (a, b) = (&x[0], &x[1]);
            one(match op {
                "eq" => a.eq(b),
                "ne" => a.ne(b),
                "lt" => a.lt(b),
                "le" => a.le(b),
                "gt" => a.gt(b),
                _ => a.ge(b),
            })
        }
        "where" => {
            arity(3)?;
            kw.only(&[])?;
            one(Tensor::where_cond(&x[0], &x[1], &x[2]))
        }
        "masked_fill" => {
            arity(2)?;
            kw.only(&["value"])?;
            one(x[0].masked_fill(&x[1], kw.scalar("value")?))
        }
        "clamp" => {
            arity(1)?;
            kw.only(&["min", "max"])?;
            one(x[0].clamp(kw.opt_f64("min")?, kw.opt_f64("max")?))
        }

        // ---- reductions ---------------------------------------------------------------------
        "sum" | "mean" => {
            arity(1)?;
            kw.only(&["dim", "keepdim"])?;
            let t = &x[0];
            match kw.opt_dims("dim")? {
                None if op == "sum" => one(t.sum_all()),
                None => one(t.mean_all()),
                Some(d) if op == "sum" => one(t.sum_dims(&d, kw.bool_or("keepdim", false)?)),
                Some(d) => one(t.mean_dims(&d, kw.bool_or("keepdim", false)?)),
            }
        }
        "prod" => {
            arity(1)?;
            kw.only(&["dim", "keepdim"])?;
            match kw.opt_dim("dim")? {
                Some(d) => one(x[0].prod_dim(d, kw.bool_or("keepdim", false)?)),
                None => one(x[0].prod_all()),
            }
        }
        "amax" | "amin" | "logsumexp" => {
            arity(1)?;
            kw.only(&["dim", "keepdim"])?;
            let (t, dims, keep) = (&x[0], kw.dims("dim")?, kw.bool_or("keepdim", false)?);
            one(match op {
                "amax" => t.amax(&dims, keep),
                "amin" => t.amin(&dims, keep),
                _ => t.logsumexp(&dims, keep),
            })
        }
        "var" | "std" => {
            arity(1)?;
            kw.only(&["dim", "correction", "keepdim"])?;
            let dims = kw.opt_dims("dim")?.unwrap_or_default();
            let correction = kw.opt_f64("correction")?.unwrap_or(1.0);
            let keep = kw.bool_or("keepdim", false)?;
            one(if op == "var" {
                x[0].var(&dims, correction, keep)
            } else {
                x[0].std(&dims, correction, keep)
            })
        }
        "norm" => {
            // torch.linalg.vector_norm(x, p, dim, keepdim=False)
            arity(1)?;
            kw.only(&["p", "dim", "keepdim"])?;
            let dims = kw.opt_dims("dim")?.unwrap_or_default();
            one(x[0].norm(kw.f64("p")?, &dims, kw.bool_or("keepdim", false)?))
        }
        "max" | "min" => {
            arity(1)?;
            kw.only(&["dim", "keepdim"])?;
            let Some(d) = kw.opt_dim("dim")? else {
                return Err(Fail::unmapped(format!("{op} without dim")));
            };
            let keep = kw.bool_or("keepdim", false)?;
            let (values, indices) = if op == "max" {
                x[0].max_dim(d, keep)?
            } else {
                x[0].min_dim(d, keep)?
            };
            Ok(vec![values, indices])
        }
        "argmax" | "argmin" => {
            arity(1)?;
            kw.only(&["dim", "keepdim"])?;
            let (d, keep) = (kw.opt_dim("dim")?, kw.bool_or("keepdim", false)?);
            one(if op == "argmax" {
                x[0].argmax(d, keep)
            } else {
                x[0].argmin(d, keep)
            })
        }
        "softmax" => {
            arity(1)?;
            kw.only(&["dim"])?;
            one(x[0].softmax(kw.dim("dim")?))
        }
        "log_softmax" => {
            arity(1)?;
            kw.only(&["dim"])?;
            one(x[0].log_softmax(kw.dim("dim")?))
        }

        // ---- matrix products ----------------------------------------------------------------
        "matmul" => {
            arity(2)?;
            kw.only(&[])?;
            one(x[0].matmul(&x[1]))
        }
        "bmm" => {
            arity(2)?;
            kw.only(&[])?;
            one(x[0].bmm(&x[1]))
        }

        // ---- indexing -----------------------------------------------------------------------
        "index_select" => {
            arity(2)?;
            kw.only(&["dim"])?;
            one(x[0].index_select(kw.dim("dim")?, &x[1]))
        }
        "gather" => {
            arity(2)?;
            kw.only(&["dim"])?;
            one(x[0].gather(kw.dim("dim")?, &x[1]))
        }
        "scatter_add" => {
            arity(3)?;
            kw.only(&["dim"])?;
            one(x[0].scatter_add(kw.dim("dim")?, &x[1], &x[2]))
        }
        "embedding" => {
            arity(2)?;
            kw.only(&[])?;
            one(Tensor::embedding(&x[0], &x[1]))
        }
        "one_hot" => {
            arity(1)?;
            kw.only(&["num_classes"])?;
            one(x[0].one_hot(kw.i64("num_classes")?))
        }

        // ---- views and joins (the generator makes each view contiguous) ---------------------
        "cat" => {
            kw.only(&["dim"])?;
            one(Tensor::cat(x, kw.dim("dim")?))
        }
        "stack" => {
            kw.only(&["dim"])?;
            one(Tensor::stack(x, kw.dim("dim")?))
        }
        "permute" => {
            arity(1)?;
            kw.only(&["dims"])?;
            one(x[0].permute(&kw.dims("dims")?).and_then(|t| t.contiguous()))
        }
        "transpose" => {
            arity(1)?;
            kw.only(&["dim0", "dim1"])?;
            one(x[0]
                .transpose(kw.dim("dim0")?, kw.dim("dim1")?)
                .and_then(|t| t.contiguous()))
        }
        "narrow" => {
            arity(1)?;
            kw.only(&["dim", "start", "length"])?;
            let t = x[0].narrow(kw.dim("dim")?, kw.usize("start")?, kw.usize("length")?);
            one(t.and_then(|t| t.contiguous()))
        }
        "expand" => {
            arity(1)?;
            kw.only(&["size"])?;
            one(x[0].expand(&kw.dims("size")?).and_then(|t| t.contiguous()))
        }
        "reshape" => {
            arity(1)?;
            kw.only(&["shape"])?;
            // `reshape_t` reshapes a transposed (non-contiguous) input: the generator calls
            // `t.transpose(0, 1).reshape(5, -1)`, which the kwargs do not record.
            let t = if id == "reshape_t" {
                x[0].transpose(0, 1)?
            } else {
                x[0].clone()
            };
            one(t.reshape(&kw.dims("shape")?))
        }

        // ---- composite expressions ----------------------------------------------------------
        "chain" => {
            arity(2)?;
            kw.only(&["expr"])?;
            match kw.str("expr")? {
                "((a*b).sum(1, keepdim=True) - a.exp().mean(0)).tanh()" => {
                    let (a, b) = (&x[0], &x[1]);
                    let lhs = a.mul(b)?.sum_dims(&[1], true)?;
                    one(lhs.sub(&a.exp()?.mean_dims(&[0], false)?).and_then(|t| t.tanh()))
                }
                other => Err(Fail::unmapped(format!("chain expression {other:?}"))),
            }
        }

        _ => Err(Fail::unmapped(format!(
            "op {op:?} has no ember call in the runner yet"
        ))),
    }
}
