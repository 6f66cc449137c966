//! [`FashionMnist`]: Zalando's Fashion-MNIST (`torchvision.datasets.FashionMNIST` followed by
//! `transforms.ToTensor()`), read from its four IDX files.
//!
//! Invariants: `images` is f32 `[N, 1, 28, 28]` with values `pixel / 255` in `[0, 1]`, and
//! `labels` is i64 `[N]` with values in `0..10` (indices into [`FashionMnist::CLASSES`]).

use crate::dataset::{Dataset, Sample, TensorDataset};
use crate::idx::{parse_idx_named, read_idx};
use ember_core::{DType, Device, Error, Result, Tensor};
use std::path::Path;

const OP: &str = "FashionMnist";

/// Image side in pixels.
const SIDE: usize = 28;

/// Fashion-MNIST images and labels (60,000 in the train split, 10,000 in `t10k`).
#[derive(Clone)]
pub struct FashionMnist {
    images: Tensor,
    labels: Tensor,
}

impl FashionMnist {
    /// The class names, indexed by label (torchvision's `FashionMNIST.classes`).
    pub const CLASSES: [&'static str; 10] = [
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ];

    /// The split in `dir`: `train-*` when `train`, else `t10k-*`, reading
    /// `{split}-images-idx3-ubyte` and `{split}-labels-idx1-ubyte`, each plain or with `.gz`.
    pub fn from_dir(dir: impl AsRef<Path>, train: bool) -> Result<FashionMnist> {
        let dir = dir.as_ref();
        let split = if train { "train" } else { "t10k" };
        let images = read_idx(find(dir, &format!("{split}-images-idx3-ubyte"))?)?;
        let labels = read_idx(find(dir, &format!("{split}-labels-idx1-ubyte"))?)?;
        FashionMnist::from_idx_tensors(images, labels, &dir.join(split).display().to_string())
    }

    /// From the bytes of an images file and a labels file (each plain or gzipped).
    pub fn from_idx_bytes(images: &[u8], labels: &[u8]) -> Result<FashionMnist> {
        let images = parse_idx_named(images, "<images IDX bytes>")?;
        let labels = parse_idx_named(labels, "<labels IDX bytes>")?;
        FashionMnist::from_idx_tensors(images, labels, "<IDX bytes>")
    }

    /// From IDX contents: u8 images `[N, 28, 28]` and u8 labels `[N]` below 10.
    fn from_idx_tensors(images: Tensor, labels: Tensor, name: &str) -> Result<FashionMnist> {
        if images.dtype() != DType::U8 || images.rank() != 3 || images.dims()[1..] != [SIDE, SIDE] {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name}: images must be u8 [N, 28, 28], got {} {}",
                    images.dtype(),
                    images.shape()
                ),
            ));
        }
        if labels.dtype() != DType::U8 || labels.rank() != 1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name}: labels must be u8 [N], got {} {}",
                    labels.dtype(),
                    labels.shape()
                ),
            ));
        }
        let n = images.dims()[0];
        if labels.dims()[0] != n {
            return Err(Error::invalid(
                OP,
                format!(
                    "{name}: the images file holds {n} images but the labels file {} labels",
                    labels.dims()[0]
                ),
            ));
        }
        let labels = labels.to_vec::<u8>()?;
        if let Some((i, &l)) = labels
            .iter()
            .enumerate()
            .find(|(_, &l)| l as usize >= Self::CLASSES.len())
        {
            return Err(Error::invalid(
                OP,
                format!("{name}: label {i} is {l}, outside the 10 classes 0..=9"),
            ));
        }
        // ToTensor: u8 / 255 in f32, as `img.float().div(255)`.
        let pixels: Vec<f32> = images.to_vec::<u8>()?.iter().map(|&p| p as f32 / 255.0).collect();
        Ok(FashionMnist {
            images: Tensor::from_vec(pixels, [n, 1, SIDE, SIDE], Device::Cpu)?,
            labels: Tensor::from_vec(
                labels.iter().map(|&l| l as i64).collect::<Vec<_>>(),
                [n],
                Device::Cpu,
            )?,
        })
    }

    /// All images, f32 `[N, 1, 28, 28]` in `[0, 1]`.
    pub fn images(&self) -> &Tensor {
        &self.images
    }

    /// All labels, i64 `[N]` in `0..10`.
    pub fn labels(&self) -> &Tensor {
        &self.labels
    }

    /// The pair as a [`TensorDataset`] `[images, labels]`.
    pub fn to_tensor_dataset(&self) -> TensorDataset {
        TensorDataset::new(vec![self.images.clone(), self.labels.clone()])
            .expect("images and labels agree in count (checked at construction)")
    }
}

impl From<FashionMnist> for TensorDataset {
    fn from(ds: FashionMnist) -> TensorDataset {
        ds.to_tensor_dataset()
    }
}

/// `dir/name`, or `dir/name.gz` when only that exists.
fn find(dir: &Path, name: &str) -> Result<std::path::PathBuf> {
    let plain = dir.join(name);
    if plain.is_file() {
        return Ok(plain);
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        return Ok(gz);
    }
    Err(Error::invalid(
        OP,
        format!("{}: found neither {name} nor {name}.gz", dir.display()),
    ))
}

impl Dataset for FashionMnist {
    fn len(&self) -> usize {
        self.labels.dims()[0]
    }

    /// `[image f32 [1, 28, 28], label i64 []]`.
    fn get(&self, index: usize) -> Result<Sample> {
        if index >= self.len() {
            return Err(Error::IndexOutOfRange {
                op: "FashionMnist::get",
                index: index as i64,
                dim: 0,
                size: self.len(),
            });
        }
        Ok(vec![
            self.images.select(0, index as isize)?,
            self.labels.select(0, index as isize)?,
        ])
    }

    /// `[images f32 [B, 1, 28, 28], labels i64 [B]]` by one `index_select` each.
    fn get_batch(&self, indices: &[usize]) -> Result<Sample> {
        self.to_tensor_dataset().get_batch(indices)
    }
}

impl std::fmt::Debug for FashionMnist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FashionMnist(len={})", self.len())
    }
}
