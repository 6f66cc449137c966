//! DataLoader: batching, drop_last, workers, early drop, custom collate, pin_memory.

use crate::common::{ids, xy, Slow};
use ember_core::{DType, Device, Error, Generator, Tensor};
use ember_data::{DataLoader, Sample, SequentialSampler};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn collect(loader: &DataLoader) -> Vec<Sample> {
    loader.iter().collect::<Result<_, _>>().unwrap()
}

/// Two batch lists with equal fields: shape, dtype and values.
fn assert_same_batches(a: &[Sample], b: &[Sample]) {
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.len(), y.len(), "batch {i}");
        for (f, g) in x.iter().zip(y) {
            assert_eq!(f.shape(), g.shape(), "batch {i}");
            assert_eq!(f.dtype(), g.dtype(), "batch {i}");
            assert_eq!(f.to_vec_f64().unwrap(), g.to_vec_f64().unwrap(), "batch {i}");
        }
    }
}

#[test]
fn last_partial_batch_is_kept() {
    let loader = DataLoader::new(xy(10), 4).unwrap();
    assert_eq!(loader.len(), 3);
    let batches = collect(&loader);
    assert_eq!(
        ids(&batches),
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
    assert_eq!(batches[0][0].dims(), &[4, 2]);
    assert_eq!(batches[2][0].dims(), &[2, 2]);
    assert_eq!(
        batches[2][0].to_vec::<f32>().unwrap(),
        vec![16.0, 17.0, 18.0, 19.0]
    );
}

#[test]
fn drop_last_drops_the_partial_batch() {
    let loader = DataLoader::builder(xy(10))
        .batch_size(4)
        .drop_last(true)
        .build()
        .unwrap();
    assert_eq!(loader.len(), 2);
    assert_eq!(ids(&collect(&loader)), vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]);
    let exact = DataLoader::builder(xy(8))
        .batch_size(4)
        .drop_last(true)
        .build()
        .unwrap();
    assert_eq!(exact.len(), 2);
    assert_eq!(collect(&exact).len(), 2);
    let none = DataLoader::builder(xy(3))
        .batch_size(4)
        .drop_last(true)
        .build()
        .unwrap();
    assert_eq!(none.len(), 0);
    assert_eq!(none.iter().count(), 0);
}

#[test]
fn size_hint_counts_down() {
    let loader = DataLoader::new(xy(5), 2).unwrap();
    let mut it = loader.iter();
    assert_eq!(it.size_hint(), (3, Some(3)));
    it.next().unwrap().unwrap();
    assert_eq!(it.size_hint(), (2, Some(2)));
}

#[test]
fn workers_give_the_batches_of_the_caller_in_order() {
    let ds = Arc::new(Slow::new(37));
    let build = |workers: usize| {
        let b = DataLoader::builder(ds.clone())
            .batch_size(3)
            .shuffle(true)
            .generator(Generator::new(11));
        let b = if workers > 0 {
            b.num_workers(workers).prefetch_factor(2)
        } else {
            b
        };
        b.build().unwrap()
    };
    let reference = collect(&build(0));
    assert_eq!(reference.len(), 13);
    for workers in [1, 3, 4] {
        assert_same_batches(&reference, &collect(&build(workers)));
    }
    // The reference really is shuffled, and the sample fields travel together.
    let order = ids(&reference).concat();
    assert_ne!(order, (0..37).collect::<Vec<i64>>());
    for b in &reference {
        let x = b[0].to_vec::<f32>().unwrap();
        let y = b[1].to_vec::<i64>().unwrap();
        for (row, &i) in x.chunks(3).zip(&y) {
            assert_eq!(row, [i as f32; 3]);
        }
    }
}

#[test]
fn workers_with_tensor_dataset_fast_path() {
    let plain = collect(&DataLoader::new(xy(50), 8).unwrap());
    let workers = DataLoader::builder(xy(50))
        .batch_size(8)
        .num_workers(2)
        .build()
        .unwrap();
    assert_eq!(workers.prefetch_factor(), 2);
    assert_same_batches(&plain, &collect(&workers));
}

#[test]
fn early_drop_stops_workers() {
    let mut slow = Slow::new(10_000);
    slow.sleep_ms = 2;
    let ds = Arc::new(slow);
    let loader = DataLoader::builder(ds.clone())
        .batch_size(4)
        .num_workers(4)
        .prefetch_factor(2)
        .build()
        .unwrap();
    let start = Instant::now();
    {
        let mut it = loader.iter();
        let first = it.next().unwrap().unwrap();
        assert_eq!(first[1].to_vec::<i64>().unwrap(), vec![0, 1, 2, 3]);
    } // dropped here: the workers stop and are joined
    let after_drop = ds.calls.load(Ordering::SeqCst);
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "dropping the iterator hung"
    );
    // At most the prefetch window (8 batches) plus the first one were ever loaded.
    assert!(
        after_drop <= 9 * 4,
        "{after_drop} samples loaded after an early drop"
    );
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        ds.calls.load(Ordering::SeqCst),
        after_drop,
        "workers kept loading after the drop"
    );
}

#[test]
fn errors_and_panics_in_workers_arrive_in_order() {
    let mut slow = Slow::new(12);
    slow.fail_at = Some(5);
    slow.panic_at = Some(9);
    let loader = DataLoader::builder(slow)
        .batch_size(2)
        .num_workers(3)
        .build()
        .unwrap();
    let results: Vec<_> = loader.iter().collect();
    assert_eq!(results.len(), 6);
    for (b, r) in results.iter().enumerate() {
        match b {
            2 => assert!(
                matches!(r, Err(Error::InvalidArgument { msg, .. }) if msg.contains("refusing index 5"))
            ),
            4 => assert!(matches!(r, Err(Error::InvalidArgument { msg, .. }) if msg.contains("panicked"))),
            _ => assert_eq!(
                r.as_ref().unwrap()[1].to_vec::<i64>().unwrap(),
                vec![2 * b as i64, 2 * b as i64 + 1]
            ),
        }
    }
}

#[test]
fn custom_collate() {
    // Sum each batch's x rows and list the labels, in workers and in the caller.
    for workers in [0, 2] {
        let mut b = DataLoader::builder(xy(5))
            .batch_size(2)
            .collate_fn(|samples: Vec<Sample>| {
                let xs: Vec<Tensor> = samples.iter().map(|s| s[0].clone()).collect();
                let sum = Tensor::stack(&xs, 0)?.sum_all()?;
                let n = Tensor::scalar(samples.len() as f64, DType::I64, Device::Cpu)?;
                Ok(vec![sum, n])
            });
        if workers > 0 {
            b = b.num_workers(workers);
        }
        let batches = collect(&b.build().unwrap());
        let sums: Vec<f64> = batches.iter().map(|b| b[0].item_f64().unwrap()).collect();
        let counts: Vec<i64> = batches.iter().map(|b| b[1].item::<i64>().unwrap()).collect();
        assert_eq!(
            sums,
            vec![0.0 + 1.0 + 2.0 + 3.0, 4.0 + 5.0 + 6.0 + 7.0, 8.0 + 9.0]
        );
        assert_eq!(counts, vec![2, 2, 1]);
    }
}

#[test]
fn custom_sampler_and_option_errors() {
    let loader = DataLoader::builder(xy(5))
        .sampler(SequentialSampler::new(3))
        .batch_size(2)
        .build()
        .unwrap();
    assert_eq!(ids(&collect(&loader)), vec![vec![0, 1], vec![2]]);
    let invalid = |r: Result<DataLoader, Error>, what: &str| match r {
        Err(Error::InvalidArgument { msg, .. }) => assert!(msg.contains(what), "{msg}"),
        other => panic!("expected an invalid argument about {what}, got {other:?}"),
    };
    invalid(DataLoader::new(xy(5), 0), "batch_size");
    invalid(
        DataLoader::builder(xy(5))
            .sampler(SequentialSampler::new(5))
            .shuffle(true)
            .build(),
        "mutually exclusive",
    );
    invalid(
        DataLoader::builder(xy(5)).prefetch_factor(2).build(),
        "prefetch_factor",
    );
    invalid(
        DataLoader::builder(xy(5))
            .num_workers(2)
            .prefetch_factor(0)
            .build(),
        "prefetch_factor",
    );
}

#[test]
fn pin_memory_pins_with_cuda_and_continues_unpinned_without() {
    // Twice: the second build without CUDA must not fail either (the warning is once only).
    for _ in 0..2 {
        let loader = DataLoader::builder(xy(4))
            .batch_size(2)
            .pin_memory(true)
            .build()
            .unwrap();
        let cuda = ember_core::cuda::is_available();
        assert_eq!(loader.pin_memory(), cuda);
        let mut batches = 0;
        for batch in &loader {
            assert!(batch.unwrap().iter().all(|t| t.is_pinned() == cuda));
            batches += 1;
        }
        assert_eq!(batches, 2);
    }
    let loader = DataLoader::builder(xy(4)).pin_memory(false).build().unwrap();
    assert!(!loader.pin_memory());
}

#[test]
fn batches_unpack_into_named_fields() {
    // PyTorch's `for inputs, labels in loader`.
    let x = Tensor::arange(0.0, 10.0, 1.0, DType::F32, Device::Cpu)
        .unwrap()
        .reshape([5, 2])
        .unwrap();
    let y = Tensor::arange_i64(0, 5, 1, Device::Cpu).unwrap();
    let loader = DataLoader::new(ember_data::TensorDataset::new(vec![x, y]).unwrap(), 2).unwrap();
    let mut seen = 0;
    for batch in loader.unpacked() {
        let [inputs, labels] = batch.unwrap();
        assert_eq!(inputs.dims()[0], labels.dims()[0]);
        assert_eq!(labels.dtype(), DType::I64);
        seen += labels.dims()[0];
    }
    assert_eq!(seen, 5);
    // Unpacking another number of fields is a typed error naming both counts.
    let e = loader.unpacked::<3>().next().unwrap().unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("2 fields"),
        "{e}"
    );
}
