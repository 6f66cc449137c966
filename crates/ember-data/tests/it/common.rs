//! Datasets for the tests.

use ember_core::{DType, Device, Error, Result, Tensor};
use ember_data::{Dataset, Sample, TensorDataset};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// `x[i] = [2i, 2i + 1]` (f32) and `y[i] = i` (i64), for `n` samples.
pub fn xy(n: usize) -> TensorDataset {
    let x = Tensor::arange(0.0, (2 * n) as f64, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[n as isize, 2])
        .unwrap();
    let y = Tensor::arange(0.0, n as f64, 1.0, DType::I64, Device::Cpu).unwrap();
    TensorDataset::new(vec![x, y]).unwrap()
}

/// The `y` field (sample indices) of each batch.
pub fn ids(batches: &[Sample]) -> Vec<Vec<i64>> {
    batches.iter().map(|b| b[1].to_vec::<i64>().unwrap()).collect()
}

/// Sample `i` is `[f32 [3] filled with i, i64 i]`; `get` sleeps a few milliseconds varying
/// with `i` (so workers finish out of order), counts its calls, and fails or panics at the
/// chosen indices.
pub struct Slow {
    pub n: usize,
    pub calls: AtomicUsize,
    pub fail_at: Option<usize>,
    pub panic_at: Option<usize>,
    pub sleep_ms: u64,
}

impl Slow {
    pub fn new(n: usize) -> Slow {
        Slow {
            n,
            calls: AtomicUsize::new(0),
            fail_at: None,
            panic_at: None,
            sleep_ms: 3,
        }
    }
}

impl Dataset for Slow {
    fn len(&self) -> usize {
        self.n
    }

    fn get(&self, index: usize) -> Result<Sample> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(Duration::from_millis((index as u64 * 7) % 5 * self.sleep_ms));
        if Some(index) == self.fail_at {
            return Err(Error::invalid("Slow::get", format!("refusing index {index}")));
        }
        if Some(index) == self.panic_at {
            panic!("Slow::get panics at {index}");
        }
        Ok(vec![
            Tensor::full([3], index as f64, DType::F32, Device::Cpu)?,
            Tensor::scalar(index as f64, DType::I64, Device::Cpu)?,
        ])
    }
}
