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
