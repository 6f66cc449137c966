//! Fashion-MNIST from the bundled t10k files, and from hand-built IDX bytes.

use ember_core::{DType, Error};
use ember_data::datasets::FashionMnist;
use ember_data::{DataLoader, Dataset, TensorDataset};
use std::io::Read;
use std::path::PathBuf;
use std::sync::OnceLock;

const IMAGES_GZ: &[u8] = include_bytes!("../../../ember/data/fashion-mnist/t10k-images-idx3-ubyte.gz");
const LABELS_GZ: &[u8] = include_bytes!("../../../ember/data/fashion-mnist/t10k-labels-idx1-ubyte.gz");

/// A folder holding the bundled t10k files as `FashionMnist::from_dir` reads them, written
/// once per process from the bytes built into this binary: the test binary also runs away
/// from the checkout (the GPU bundle), where the repository's path does not exist. One folder
/// for every run, each file written under a name of its own and renamed into place, so that
/// processes side by side never read a half-written file and nothing piles up.
fn data_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join("ember-tests-fashion-mnist");
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in [
            ("t10k-images-idx3-ubyte.gz", IMAGES_GZ),
            ("t10k-labels-idx1-ubyte.gz", LABELS_GZ),
        ] {
            let part = dir.join(format!("{name}.{}", std::process::id()));
            std::fs::write(&part, bytes).unwrap();
            std::fs::rename(&part, dir.join(name)).unwrap();
        }
        dir
    })
    .clone()
}

/// The labels file's bytes after its 8-byte header, decoded independently of the reader.
fn raw_labels() -> Vec<u8> {
    let mut raw = Vec::new();
    flate2::read::GzDecoder::new(LABELS_GZ)
        .read_to_end(&mut raw)
        .unwrap();
    raw[8..].to_vec()
}

#[test]
fn t10k_split() {
    let ds = FashionMnist::from_dir(data_dir(), false).unwrap();
    assert_eq!(ds.len(), 10_000);
    assert_eq!(ds.images().dims(), &[10_000, 1, 28, 28]);
    assert_eq!(ds.images().dtype(), DType::F32);
    assert_eq!(ds.labels().dims(), &[10_000]);
    assert_eq!(ds.labels().dtype(), DType::I64);
    let labels = ds.labels().to_vec::<i64>().unwrap();
    let raw = raw_labels();
    assert_eq!(labels[0], raw[0] as i64);
    assert_eq!(labels[0], 9, "the first t10k item is an ankle boot");
    assert_eq!(FashionMnist::CLASSES[labels[0] as usize], "Ankle boot");
    assert!(labels.iter().zip(&raw).all(|(&l, &r)| l == r as i64));
    let mut counts = [0usize; 10];
    for &l in &labels {
        counts[l as usize] += 1;
    }
    assert_eq!(counts, [1000; 10]);
    let pixels = ds.images().to_vec::<f32>().unwrap();
    assert!(pixels.iter().all(|&p| (0.0..=1.0).contains(&p)));
    assert!(pixels.contains(&1.0) && pixels.contains(&0.0));
    // A sample and a batch through the loader.
    let s = ds.get(0).unwrap();
    assert_eq!(s[0].dims(), &[1, 28, 28]);
    assert_eq!(s[1].item::<i64>().unwrap(), 9);
    let loader = DataLoader::builder(TensorDataset::from(ds))
        .batch_size(64)
        .build()
        .unwrap();
    assert_eq!(loader.len(), 157);
    let first = loader.iter().next().unwrap().unwrap();
    assert_eq!(first[0].dims(), &[64, 1, 28, 28]);
    assert_eq!(first[1].to_vec::<i64>().unwrap(), labels[..64].to_vec());
}

#[test]
fn from_idx_bytes_scales_and_checks_counts() {
    let mut images = vec![0, 0, 0x08, 3, 0, 0, 0, 2, 0, 0, 0, 28, 0, 0, 0, 28];
    images.extend((0..2 * 28 * 28).map(|i| (i % 256) as u8));
    let labels = [0, 0, 0x08, 1, 0, 0, 0, 2, 3, 7];
    let ds = FashionMnist::from_idx_bytes(&images, &labels).unwrap();
    assert_eq!(ds.len(), 2);
    assert_eq!(ds.labels().to_vec::<i64>().unwrap(), vec![3, 7]);
    let px = ds.images().to_vec::<f32>().unwrap();
    assert_eq!(px[0], 0.0);
    assert_eq!(px[255], 1.0);
    assert_eq!(px[51], 51.0 / 255.0);

    let three_labels = [0, 0, 0x08, 1, 0, 0, 0, 3, 1, 2, 3];
    match FashionMnist::from_idx_bytes(&images, &three_labels) {
        Err(Error::InvalidArgument { msg, .. }) => {
            assert!(msg.contains("2 images") && msg.contains("3 labels"), "{msg}")
        }
        other => panic!("expected a count mismatch, got {other:?}"),
    }
    let bad_label = [0, 0, 0x08, 1, 0, 0, 0, 2, 3, 10];
    assert!(matches!(
        FashionMnist::from_idx_bytes(&images, &bad_label),
        Err(Error::InvalidArgument { .. })
    ));
    // Images that are not 28x28.
    let small = [0, 0, 0x08, 3, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 5];
    let one_label = [0, 0, 0x08, 1, 0, 0, 0, 1, 3];
    assert!(matches!(
        FashionMnist::from_idx_bytes(&small, &one_label),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn missing_files_are_named() {
    match FashionMnist::from_dir(data_dir(), true) {
        // The train split is not in the repository.
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains("train-images-idx3-ubyte"), "{msg}"),
        Ok(_) => panic!("the train split should not be bundled"),
        Err(e) => panic!("unexpected {e}"),
    }
}
