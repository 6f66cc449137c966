//! `sort`, `argsort`, `topk`, `multinomial`, `tril`, `triu` against values worked by hand and
//! PyTorch's conventions (NaN above every number, stable ties, gradients through the values).

use ember_core::{manual_seed, DType, Device, Error, Tensor};

const CPU: Device = Device::Cpu;

fn t(v: &[f32], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, CPU).unwrap()
}

#[test]
fn sort_orders_rows_stably_with_nan_last() {
    let x = t(&[3.0, f32::NAN, 1.0, 3.0, -2.0, 0.5, 0.5, 9.0], &[2, 4]);
    let (v, i) = x.sort(1, false).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![2, 0, 3, 1, 0, 1, 2, 3]);
    let v = v.to_vec::<f32>().unwrap();
    assert_eq!(&v[..3], &[1.0, 3.0, 3.0]);
    assert!(v[3].is_nan());
    // Descending: NaN first (it is the largest), ties still in order.
    let (_, i) = x.sort(-1, true).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 0, 3, 2, 3, 1, 2, 0]);
    // Along dim 0, column by column: (3, -2), (NaN, 0.5), (1, 0.5), (3, 9).
    assert_eq!(
        x.argsort(0, false).unwrap().to_vec::<i64>().unwrap(),
        vec![1, 1, 1, 0, 0, 0, 0, 1]
    );
    assert!(matches!(
        x.sort(2, false),
        Err(Error::DimOutOfRange { .. }) | Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn topk_takes_the_largest_or_smallest_in_order_and_passes_gradients_to_them() {
    let x = t(&[0.1, 0.7, -0.3, 0.7, 0.2], &[5]).requires_grad_(true).unwrap();
    let (v, i) = x.topk(3, 0, true).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![0.7, 0.7, 0.2]);
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![1, 3, 4]);
    v.sum_all().unwrap().backward().unwrap();
    assert_eq!(
        x.grad().unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 1.0, 0.0, 1.0, 1.0]
    );
    let (v, _) = x.detach().topk(2, 0, false).unwrap();
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![-0.3, 0.1]);
    assert!(matches!(x.topk(6, 0, true), Err(Error::InvalidArgument { .. })));
}

#[test]
fn multinomial_draws_in_proportion_and_never_a_zero_weight() {
    manual_seed(7).unwrap();
    let w = t(&[0.0, 1.0, 3.0, 0.0], &[4]);
    let draws = w.multinomial(20_000, true).unwrap().to_vec::<i64>().unwrap();
    assert!(
        draws.iter().all(|&d| d == 1 || d == 2),
        "zero weights are never drawn"
    );
    let twos = draws.iter().filter(|&&d| d == 2).count() as f64 / draws.len() as f64;
    // 3/4 expected; 20,000 draws put 4 standard deviations at ±0.012.
    assert!(
        (twos - 0.75).abs() < 0.012,
        "frequency of the weight-3 category: {twos}"
    );
    // Without replacement: each row's draws are distinct and of positive weight.
    let rows = t(&[1.0, 1.0, 0.0, 5.0, 2.0, 2.0, 2.0, 2.0], &[2, 4]);
    let d = rows.multinomial(3, false).unwrap();
    assert_eq!(d.dims(), &[2, 3]);
    let d = d.to_vec::<i64>().unwrap();
    let mut first = d[..3].to_vec();
    first.sort();
    assert_eq!(first, vec![0, 1, 3]);
    let mut second = d[3..].to_vec();
    second.sort();
    second.dedup();
    assert_eq!(second.len(), 3);
    // Same seed, same draws.
    manual_seed(7).unwrap();
    assert_eq!(
        w.multinomial(20_000, true).unwrap().to_vec::<i64>().unwrap(),
        draws
    );
    // Bad input: a typed error that says what to do.
    assert!(matches!(
        rows.multinomial(4, false),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t(&[1.0, -1.0], &[2]).multinomial(1, true),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t(&[0.0, 0.0], &[2]).multinomial(1, true),
        Err(Error::InvalidArgument { .. })
    ));
    let ints = Tensor::ones([3], DType::I64, CPU).unwrap();
    assert!(matches!(
        ints.multinomial(1, true),
        Err(Error::UnsupportedDType { .. })
    ));
}

#[test]
fn tril_and_triu_keep_their_triangles_of_the_last_two_dims() {
    let x = Tensor::arange(1.0, 13.0, 1.0, DType::F32, CPU)
        .unwrap()
        .reshape(&[1, 3, 4])
        .unwrap();
    assert_eq!(
        x.tril(0).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 0.0, 0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 9.0, 10.0, 11.0, 0.0]
    );
    assert_eq!(
        x.triu(1).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 2.0, 3.0, 4.0, 0.0, 0.0, 7.0, 8.0, 0.0, 0.0, 0.0, 12.0]
    );
    assert_eq!(
        x.tril(-1).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0, 0.0, 0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 9.0, 10.0, 0.0, 0.0]
    );
    let causal = Tensor::ones([3, 3], DType::Bool, CPU).unwrap().tril(0).unwrap();
    assert_eq!(
        causal.to_vec::<bool>().unwrap(),
        vec![true, false, false, true, true, false, true, true, true]
    );
    assert!(matches!(
        t(&[1.0], &[1]).tril(0),
        Err(Error::InvalidArgument { .. })
    ));
}
