//! Collectives between ranks that are threads of this process (the same TCP paths as
//! between processes), failures and timeouts.

use std::io::ErrorKind;
use std::time::{Duration, Instant};

use ember_core::{Device, Error, Tensor};
use ember_distributed::ReduceOp;

use crate::common::{check_all_collectives, check_flat_collectives, run_ranks};

const T: Duration = Duration::from_secs(20);

#[test]
fn every_collective_world_2_and_3() {
    for n in [2, 3] {
        run_ranks(n, T, |pg| check_all_collectives(&pg));
    }
}

#[test]
fn flat_collectives_world_1_2_and_3() {
    for n in [1, 2, 3] {
        run_ranks(n, T, |pg| check_flat_collectives(&pg, Device::Cpu));
    }
}

#[test]
fn world_of_one_is_a_no_op() {
    run_ranks(1, T, |pg| {
        let x = Tensor::from_vec(vec![3.0f32], 1, Device::Cpu).unwrap();
        pg.all_reduce(&x, ReduceOp::Avg).unwrap();
        pg.barrier().unwrap();
        assert_eq!(x.to_vec::<f32>().unwrap(), [3.0]);
    });
}

#[test]
fn subgroups() {
    run_ranks(3, T, |pg| {
        let sub = pg.new_group(&[2, 0]).unwrap();
        let odd = pg.new_group(&[1]).unwrap();
        match pg.rank() {
            1 => {
                assert!(sub.is_none());
                let odd = odd.unwrap();
                assert_eq!((odd.rank(), odd.size()), (0, 1));
            }
            r => {
                assert!(odd.is_none());
                let sub = sub.unwrap();
                assert_eq!(sub.ranks(), [0, 2]);
                assert_eq!(sub.rank(), r / 2);
                let x = Tensor::from_vec(vec![r as i64], 1, Device::Cpu).unwrap();
                sub.all_reduce(&x, ReduceOp::Sum).unwrap();
                assert_eq!(x.to_vec::<i64>().unwrap(), [2]);
                // src is a global rank.
                sub.broadcast(&x, 2).unwrap();
                assert!(sub.broadcast(&x, 1).is_err(), "rank 1 is not in the group");
                check_all_collectives(&sub);
            }
        }
        assert!(pg.new_group(&[5]).is_err());
    });
}

#[test]
fn bad_arguments_are_errors_that_leave_the_group_usable() {
    run_ranks(2, T, |pg| {
        let one = Tensor::from_vec(vec![1.0f32], 1, Device::Cpu).unwrap();
        let expanded = one.expand(&[3]).unwrap();
        assert!(pg.all_reduce(&expanded, ReduceOp::Sum).is_err());
        assert!(pg.broadcast(&one, 5).is_err());
        assert!(pg.send(&one, pg.rank()).is_err());
        assert!(pg.recv(&one, 9).is_err());
        assert!(pg.all_gather(&[one.clone()], &one).is_err());
        let wrong = Tensor::from_vec(vec![1.0f64], 1, Device::Cpu).unwrap();
        assert!(pg.all_gather(&[one.clone(), wrong], &one).is_err());
        // Nothing was sent: the group still works.
        pg.all_reduce(&one, ReduceOp::Sum).unwrap();
        assert_eq!(one.to_vec::<f32>().unwrap(), [2.0]);
    });
}

#[test]
fn mismatched_calls_are_reported() {
    let errs = run_ranks(2, T, |pg| {
        let x = Tensor::from_vec(vec![1.0f32; 4 + pg.rank()], 4 + pg.rank(), Device::Cpu).unwrap();
        let e = pg.all_reduce(&x, ReduceOp::Sum).unwrap_err();
        // The group is broken afterwards: later calls fail at once.
        assert!(pg.barrier().is_err());
        e.to_string()
    });
    assert!(errs.iter().any(|e| e.contains("same shape")), "{errs:?}");
}

#[test]
fn silent_peer_times_out() {
    let timeout = Duration::from_millis(700);
    let outcomes = run_ranks(2, timeout, |pg| {
        if pg.rank() == 0 {
            let start = Instant::now();
            let x = Tensor::from_vec(vec![1.0f32], 1, Device::Cpu).unwrap();
            let e = pg.all_reduce(&x, ReduceOp::Sum).unwrap_err();
            Some((e, start.elapsed()))
        } else {
            // Alive, but never joins the collective.
            std::thread::sleep(Duration::from_millis(1500));
            None
        }
    });
    let (e, elapsed) = outcomes[0].clone().unwrap();
    assert!(
        matches!(
            e,
            Error::Io {
                kind: ErrorKind::TimedOut,
                ..
            }
        ),
        "{e}"
    );
    assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
}

#[test]
fn peer_that_leaves_fails_the_collective_fast() {
    let outcomes = run_ranks(3, T, |pg| {
        if pg.rank() == 2 {
            pg.shutdown(); // as a crash would: its connections close
            drop(pg);
            return None;
        }
        let start = Instant::now();
        let x = Tensor::from_vec(vec![1.0f32; 1000], 1000, Device::Cpu).unwrap();
        let e = pg.all_reduce(&x, ReduceOp::Sum).unwrap_err();
        Some((e.to_string(), start.elapsed()))
    });
    for (e, elapsed) in outcomes.into_iter().flatten() {
        assert!(elapsed < Duration::from_secs(5), "{elapsed:?}: {e}");
    }
}

#[test]
fn a_store_serves_successive_groups() {
    use ember_distributed::{BackendKind, ProcessGroup, Store, TcpStore};
    use std::sync::Arc;
    let master = TcpStore::new("127.0.0.1", 0, true, T).unwrap();
    let port = master.port();
    let master: Arc<dyn Store> = Arc::new(master);
    let client: Arc<dyn Store> = Arc::new(TcpStore::new("127.0.0.1", port, false, T).unwrap());
    for round in 0..3 {
        // The previous round's group is gone; its keys must not mislead this one.
        std::thread::scope(|s| {
            for (rank, store) in [master.clone(), client.clone()].into_iter().enumerate() {
                s.spawn(move || {
                    let pg = ProcessGroup::new(BackendKind::Gloo, store, rank, 2, T).unwrap();
                    let x = Tensor::from_vec(vec![round as f32], 1, Device::Cpu).unwrap();
                    pg.all_reduce(&x, ReduceOp::Sum).unwrap();
                    assert_eq!(x.to_vec::<f32>().unwrap(), [2.0 * round as f32]);
                });
            }
        });
    }
}

#[test]
fn default_group_functions_need_init_and_say_so() {
    use ember_distributed as dist;
    // Nothing in this (parent) test process initializes the default group.
    assert!(!dist::is_initialized());
    let e = dist::get_rank().unwrap_err().to_string();
    assert!(e.contains("init_process_group"), "{e}");
    assert!(dist::all_reduce(
        &Tensor::from_vec(vec![1f32], 1, Device::Cpu).unwrap(),
        ReduceOp::Sum
    )
    .is_err());
    dist::destroy_process_group(); // a no-op
                                   // Bad environments fail before any connection, with what to set.
    let none = |_: &str| None;
    let opts = dist::InitOptions::new(dist::BackendKind::Gloo);
    let e = dist::init_process_group_with_env(opts.clone(), &none)
        .unwrap_err()
        .to_string();
    assert!(e.contains("RANK") || e.contains("rank"), "{e}");
    let e =
        dist::init_process_group_with_env(opts.init_method("tcp://127.0.0.1:1").rank(3).world_size(2), &none)
            .unwrap_err()
            .to_string();
    assert!(e.contains("rank 3"), "{e}");
    assert!("nccl".parse::<dist::BackendKind>().unwrap() == dist::BackendKind::Nccl);
    assert!("mpi".parse::<dist::BackendKind>().is_err());
    // PyTorch's string form: init_process_group("gloo") reads the same environment.
    let e = dist::init_process_group_with_env("gloo", &none)
        .unwrap_err()
        .to_string();
    assert!(e.contains("RANK") || e.contains("rank"), "{e}");
    let e = dist::init_process_group("mpi").unwrap_err();
    assert!(
        matches!(e, ember_core::Error::InvalidArgument { .. }) && e.to_string().contains("nccl"),
        "{e}"
    );
    // DistributedSampler(dataset) needs the default group for its world size and rank.
    let ds = ember_data::TensorDataset::new(vec![
        Tensor::zeros([10], ember_core::DType::F32, Device::Cpu).unwrap()
    ])
    .unwrap();
    let e = ember_data::DistributedSampler::new(&ds).unwrap_err().to_string();
    assert!(
        e.contains("init_process_group") && e.contains("with_replicas"),
        "{e}"
    );
    assert!(!dist::is_initialized());
}
