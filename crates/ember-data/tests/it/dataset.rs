//! TensorDataset, default_collate and the get_batch fast path.

use crate::common::xy;
use ember_core::{DType, Device, Error, Tensor};
use ember_data::{default_collate, Dataset, TensorDataset};

#[test]
fn tensor_dataset_indexes_first_dim() {
    let ds = xy(5);
    assert_eq!(ds.len(), 5);
    let s = ds.get(3).unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].dims(), &[2]);
    assert_eq!(s[0].to_vec::<f32>().unwrap(), vec![6.0, 7.0]);
    assert_eq!(s[1].rank(), 0);
    assert_eq!(s[1].item::<i64>().unwrap(), 3);
}

#[test]
fn tensor_dataset_errors() {
    let a = Tensor::zeros([4, 2], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros([5], DType::I64, Device::Cpu).unwrap();
    match TensorDataset::new(vec![a.clone(), b]) {
        Err(Error::ShapeMismatch { op, lhs, rhs, .. }) => {
            assert_eq!(op, "TensorDataset::new");
            assert_eq!(lhs.dims(), &[4, 2]);
            assert_eq!(rhs.dims(), &[5]);
        }
        other => panic!("expected a shape mismatch, got {other:?}"),
    }
    assert!(matches!(
        TensorDataset::new(vec![]),
        Err(Error::InvalidArgument { .. })
    ));
    let scalar = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
    assert!(matches!(
        TensorDataset::new(vec![a.clone(), scalar]),
        Err(Error::InvalidArgument { .. })
    ));
    let ds = TensorDataset::new(vec![a]).unwrap();
    assert!(matches!(
        ds.get(4),
        Err(Error::IndexOutOfRange {
            index: 4,
            size: 4,
            ..
        })
    ));
    assert!(matches!(
        ds.get_batch(&[0, 9]),
        Err(Error::IndexOutOfRange { index: 9, .. })
    ));
}

#[test]
fn get_batch_fast_path_matches_stacked_gets() {
    let ds = xy(6);
    let idx = [4, 0, 5, 4];
    let fast = ds.get_batch(&idx).unwrap();
    let slow = default_collate(idx.iter().map(|&i| ds.get(i).unwrap()).collect()).unwrap();
    for (f, s) in fast.iter().zip(&slow) {
        assert_eq!(f.shape(), s.shape());
        assert_eq!(f.dtype(), s.dtype());
        assert_eq!(f.to_vec_f64().unwrap(), s.to_vec_f64().unwrap());
    }
    assert_eq!(fast[0].dims(), &[4, 2]);
    assert_eq!(fast[1].to_vec::<i64>().unwrap(), vec![4, 0, 5, 4]);
}

#[test]
fn default_collate_errors() {
    assert!(matches!(
        default_collate(vec![]),
        Err(Error::InvalidArgument { .. })
    ));
    let a = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
    let b = Tensor::zeros([3], DType::F32, Device::Cpu).unwrap();
    assert!(matches!(
        default_collate(vec![vec![a.clone()], vec![a.clone(), a.clone()]]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        default_collate(vec![vec![a], vec![b]]),
        Err(Error::ShapeMismatch { .. })
    ));
}
