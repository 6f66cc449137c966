//! Comparing one ember result with its PyTorch reference: dtype and shape exactly, floating
//! values within `|ours - ref| <= atol + rtol*|ref|` (NaN equals NaN, equal infinities match),
//! integer and bool values exactly. A miss is described in one line: the first mismatching index
//! with both values, the number of misses and the largest difference.

use super::fixture::Reference;
use ember_core::Tensor;

/// Row-major flat index `i` of `shape` as a multi-index (`[1, 0, 3]`).
fn multi_index(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (d, &n) in shape.iter().enumerate().rev() {
        if n > 0 {
            idx[d] = i % n;
            i /= n;
        }
    }
    idx
}

/// True when `ours` matches `expected` at these tolerances (`exact` for integer/bool data).
pub fn close(ours: f64, expected: f64, rtol: f64, atol: f64, exact: bool) -> bool {
    if ours == expected || (ours.is_nan() && expected.is_nan()) {
        return true;
    }
    // Past equality, an infinity or NaN on either side is a miss (the bound would be infinite).
    !exact
        && ours.is_finite()
        && expected.is_finite()
        && (ours - expected).abs() <= atol + rtol * expected.abs()
}

/// Checks values already on the host; `Err` holds the one-line description of the first miss.
pub fn compare_values(
    ours: &[f64],
    shape: &[usize],
    expected: &Reference,
    rtol: f64,
    atol: f64,
) -> Result<(), String> {
    if shape != expected.shape.as_slice() {
        return Err(format!("shape {shape:?}, expected {:?}", expected.shape));
    }
    let exact = !expected.dtype.is_floating_point();
    let mut first = None;
    let mut misses = 0usize;
    let mut worst = 0.0f64;
    for (i, (&a, &e)) in ours.iter().zip(&expected.values).enumerate() {
        if !close(a, e, rtol, atol, exact) {
            misses += 1;
            let d = (a - e).abs();
            worst = if d.is_nan() || worst.is_nan() {
                f64::NAN
            } else {
                worst.max(d)
            };
            first.get_or_insert((i, a, e));
        }
    }
    match first {
        None => Ok(()),
        Some((i, a, e)) => Err(format!(
            "{misses} of {} elements differ; first at {:?}: got {a}, expected {e} (rtol {rtol}, atol {atol}, max |diff| {worst:e})",
            ours.len(),
            multi_index(i, shape)
        )),
    }
}

/// Checks an ember tensor (any device) against `expected`: dtype, shape, then values.
pub fn compare(ours: &Tensor, expected: &Reference, rtol: f64, atol: f64) -> Result<(), String> {
    if ours.dtype() != expected.dtype {
        return Err(format!(
            "dtype {}, expected {} (PyTorch's result dtype)",
            ours.dtype().name(),
            expected.dtype.name()
        ));
    }
    let values = ours
        .to_vec_f64()
        .map_err(|e| format!("reading the result: {e}"))?;
    compare_values(&values, ours.dims(), expected, rtol, atol)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ember_core::{DType, Device};

    fn reference(dtype: DType, shape: &[usize], values: &[f64]) -> Reference {
        Reference {
            dtype,
            shape: shape.to_vec(),
            values: values.to_vec(),
        }
    }

    #[test]
    fn tolerance_is_atol_plus_rtol_times_reference() {
        assert!(close(1.0 + 1.5e-9, 1.0, 1e-9, 1e-9, false));
        assert!(!close(1.0 + 2.5e-9, 1.0, 1e-9, 1e-9, false));
        assert!(close(f64::NAN, f64::NAN, 0.0, 0.0, false));
        assert!(!close(f64::NAN, 1.0, 1.0, 1.0, false));
        assert!(!close(1.0, f64::NAN, 1.0, 1.0, false));
        assert!(close(f64::INFINITY, f64::INFINITY, 0.0, 0.0, false));
        assert!(!close(f64::NEG_INFINITY, f64::INFINITY, 1.0, 1.0, false));
        assert!(!close(3.0, 2.0, 1.0, 1.0, true), "integers compare exactly");
    }

    #[test]
    fn first_miss_is_reported_with_its_index_and_values() {
        let r = reference(DType::F64, &[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let msg = compare_values(&[0.0, 1.0, 2.0, 3.0, 4.5, 5.0], &[2, 3], &r, 1e-9, 1e-9).unwrap_err();
        assert!(
            msg.contains("[1, 1]") && msg.contains("got 4.5, expected 4"),
            "{msg}"
        );
        assert!(compare_values(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0], &[3, 2], &r, 0.0, 0.0).is_err());
    }

    #[test]
    fn dtype_must_match_pytorch() {
        let ours = Tensor::from_vec(vec![1.0f32, 2.0], [2], Device::Cpu).unwrap();
        let r = reference(DType::F64, &[2], &[1.0, 2.0]);
        let msg = compare(&ours, &r, 1e-3, 1e-3).unwrap_err();
        assert!(msg.contains("dtype float32, expected float64"), "{msg}");
        let ours = Tensor::from_vec(vec![1i64, 2], [2], Device::Cpu).unwrap();
        assert!(compare(&ours, &reference(DType::I64, &[2], &[1.0, 2.0]), 0.0, 0.0).is_ok());
        assert!(compare(&ours, &reference(DType::I64, &[2], &[1.0, 3.0]), 0.5, 0.5).is_err());
    }
}
