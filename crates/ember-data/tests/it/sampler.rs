//! Reproducible shuffling through the DataLoader.

use crate::common::{ids, xy};
use ember_core::Generator;
use ember_data::{DataLoader, RandomSampler, Sampler};

fn order(seed: u64, n: usize) -> Vec<i64> {
    let loader = DataLoader::builder(xy(n))
        .batch_size(4)
        .shuffle(true)
        .generator(Generator::new(seed))
        .build()
        .unwrap();
    let batches: Vec<_> = loader.iter().collect::<Result<_, _>>().unwrap();
    ids(&batches).concat()
}

#[test]
fn same_seed_same_order_different_seed_different_order() {
    let a = order(42, 100);
    assert_eq!(a, order(42, 100));
    assert_ne!(a, order(43, 100));
    assert_ne!(
        a,
        (0..100).collect::<Vec<i64>>(),
        "a shuffle that keeps the order is not one"
    );
    let mut sorted = a.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..100).collect::<Vec<i64>>(), "every index exactly once");
}

#[test]
fn each_epoch_reshuffles_reproducibly() {
    let make = || {
        DataLoader::builder(xy(30))
            .batch_size(30)
            .shuffle(true)
            .generator(Generator::new(7))
            .build()
            .unwrap()
    };
    let (l1, l2) = (make(), make());
    let epoch = |l: &DataLoader| ids(&l.iter().map(Result::unwrap).collect::<Vec<_>>()).concat();
    let (a1, a2) = (epoch(&l1), epoch(&l1));
    assert_ne!(a1, a2);
    assert_eq!((a1, a2), (epoch(&l2), epoch(&l2)));
}

#[test]
fn default_generator_follows_manual_seed() {
    // RandomSampler::new draws from the CPU default generator.
    ember_core::manual_seed(5).unwrap();
    let a = RandomSampler::new(20).indices().unwrap();
    ember_core::manual_seed(5).unwrap();
    let b = RandomSampler::new(20).indices().unwrap();
    assert_eq!(a, b);
}

/// Every rank's indices for one epoch of a `DistributedSampler`.
fn shares(len: usize, replicas: usize, shuffle: bool, drop_last: bool, epoch: u64) -> Vec<Vec<usize>> {
    (0..replicas)
        .map(|rank| {
            let s = ember_data::DistributedSampler::with_replicas(len, replicas, rank)
                .unwrap()
                .shuffle(shuffle)
                .seed(7)
                .drop_last(drop_last);
            s.set_epoch(epoch);
            let idx = s.indices().unwrap();
            assert_eq!(idx.len(), s.len());
            idx
        })
        .collect()
}

#[test]
fn distributed_sampler_matches_pytorch_arithmetic() {
    // PyTorch, shuffle=False: len 10 over 4 ranks pads with [0, 1] to 12.
    assert_eq!(
        shares(10, 4, false, false, 0),
        vec![vec![0, 4, 8], vec![1, 5, 9], vec![2, 6, 0], vec![3, 7, 1]]
    );
    // drop_last: floor(10 / 4) = 2 each, the tail [8, 9] dropped.
    assert_eq!(
        shares(10, 4, false, true, 0),
        vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]
    );
    // Padding longer than the dataset repeats it: len 2 over 5 ranks -> [0, 1, 0, 1, 0].
    assert_eq!(
        shares(2, 5, false, false, 0),
        vec![vec![0], vec![1], vec![0], vec![1], vec![0]]
    );
    // Fewer samples than ranks with drop_last: nothing for anyone.
    assert!(shares(3, 4, false, true, 0).iter().all(Vec::is_empty));
    assert!(ember_data::DistributedSampler::with_replicas(10, 4, 4).is_err());
    assert!(ember_data::DistributedSampler::with_replicas(10, 0, 0).is_err());
}

#[test]
fn distributed_sampler_partitions_and_reshuffles() {
    for (len, replicas) in [(100, 4), (101, 3), (7, 2)] {
        let e0 = shares(len, replicas, true, false, 0);
        // Same count per rank, and together every index at least once; disjoint up to the
        // padding (exactly total_size - len repeats).
        let counts: Vec<usize> = e0.iter().map(Vec::len).collect();
        assert!(counts.iter().all(|&c| c == len.div_ceil(replicas)), "{counts:?}");
        let mut all: Vec<usize> = e0.concat();
        all.sort_unstable();
        let total = all.len();
        all.dedup();
        assert_eq!(all, (0..len).collect::<Vec<_>>());
        assert_eq!(total - len, len.div_ceil(replicas) * replicas - len);
        // drop_last: disjoint and the same count everywhere.
        let dl = shares(len, replicas, true, true, 0).concat();
        let mut sorted = dl.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), dl.len(), "disjoint");
        assert_eq!(dl.len(), len / replicas * replicas);
        // A new epoch reshuffles; the same epoch replays.
        assert_ne!(e0, shares(len, replicas, true, false, 1));
        assert_eq!(e0, shares(len, replicas, true, false, 0));
    }
}

#[test]
fn distributed_sampler_drives_a_loader_across_epochs() {
    use std::sync::Arc;
    let sampler = Arc::new(
        ember_data::DistributedSampler::with_replicas(20, 2, 1)
            .unwrap()
            .seed(3),
    );
    let loader = DataLoader::builder(xy(20))
        .batch_size(4)
        .sampler(sampler.clone())
        .build()
        .unwrap();
    assert_eq!(loader.len(), 3); // 10 indices in batches of 4
    let epoch = |e: u64| {
        sampler.set_epoch(e);
        let batches: Vec<_> = loader.iter().collect::<Result<_, _>>().unwrap();
        ids(&batches).concat()
    };
    let (a, b) = (epoch(0), epoch(1));
    assert_eq!(a.len(), 10);
    assert_ne!(a, b);
    assert_eq!(a, epoch(0));
}

#[test]
fn distributed_sampler_new_needs_the_default_group() {
    // ember-data alone has no process group: `DistributedSampler::new(&dataset)` says what to do.
    let ds = ember_data::TensorDataset::new(vec![ember_core::Tensor::zeros(
        [4],
        ember_core::DType::F32,
        ember_core::Device::Cpu,
    )
    .unwrap()])
    .unwrap();
    let e = ember_data::DistributedSampler::new(&ds).unwrap_err().to_string();
    assert!(e.contains("init_process_group"), "{e}");
}
