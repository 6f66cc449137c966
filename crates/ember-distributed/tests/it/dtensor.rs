//! DTensor on ranks as threads: torch.chunk's layout, uneven and empty shards, full_tensor
//! round trips, from_local's checks, and an optimizer stepping on local shards.

use std::time::Duration;

use ember_core::{no_grad, DType, Device, Error, Shape, Tensor};
use ember_distributed::dtensor::chunk_range;
use ember_distributed::{distribute_tensor, distribute_tensor_from, DTensor, DeviceMesh, Placement};
use ember_nn::optim::{Optimizer, SgdConfig, SGD};

use crate::common::run_ranks;

const T: Duration = Duration::from_secs(20);

/// A `[rows, cols]` tensor of distinct values (`10·i + j + offset`).
pub fn global(rows: usize, cols: usize, offset: f64, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..rows * cols)
        .map(|k| (10 * (k / cols) + k % cols) as f64 + offset)
        .collect();
    Tensor::from_vec(v, [rows, cols], Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[test]
fn chunk_range_is_torch_chunk() {
    let all = |rows, world| {
        (0..world)
            .map(|r| chunk_range(rows, world, r))
            .collect::<Vec<_>>()
    };
    // torch.chunk(torch.arange(n), w): sizes ceil(n / w), the last ones shorter or empty.
    assert_eq!(all(5, 4), [0..2, 2..4, 4..5, 5..5]);
    assert_eq!(all(7, 3), [0..3, 3..6, 6..7]);
    assert_eq!(all(6, 3), [0..2, 2..4, 4..6]);
    assert_eq!(all(1, 3), [0..1, 1..1, 1..1]);
    assert_eq!(all(0, 2), [0..0, 0..0]);
    assert_eq!((all(7, 1).len(), chunk_range(7, 1, 0)), (1, 0..7));
}

#[test]
fn distribute_then_full_tensor_round_trips() {
    for n in [1, 2, 3] {
        run_ranks(n, T, |pg| {
            let (r, mesh) = (pg.rank(), DeviceMesh::new(pg));
            // Rows divisible or not by the world size, fewer rows than ranks, none at all.
            for (rows, dtype) in [
                (6, DType::F32),
                (7, DType::F64),
                (1, DType::F32),
                (0, DType::F32),
                (5, DType::I64),
            ] {
                let full = global(rows, 3, 0.5 * (dtype != DType::I64) as u8 as f64, dtype);
                let full = match dtype.is_floating_point() {
                    true => full.requires_grad_(true).unwrap(),
                    false => full,
                };
                let d = distribute_tensor(&full, &mesh, &[Placement::Shard(0)]).unwrap();
                let mine = chunk_range(rows, n, r);
                assert_eq!(d.shape().dims(), [rows, 3]);
                assert_eq!(d.local_range(), mine);
                assert_eq!(d.placements(), [Placement::Shard(0)]);
                assert_eq!(d.device_mesh().size(), n);
                let local = d.to_local();
                assert_eq!(local.dims(), [mine.len(), 3], "rows {rows}, rank {r} of {n}");
                assert_eq!(
                    values(&local),
                    values(&full.narrow(0, mine.start, mine.len()).unwrap())
                );
                // The shard is a leaf of its own that requires grad as the input did.
                assert!(local.is_leaf());
                assert_eq!(local.requires_grad(), dtype.is_floating_point());
                let back = d.full_tensor().unwrap();
                assert_eq!((back.dims(), back.dtype()), (full.dims(), dtype));
                assert_eq!(values(&back), values(&full), "rows {rows}, rank {r} of {n}");

                let rep = distribute_tensor(&full, &mesh, &[Placement::Replicate]).unwrap();
                assert_eq!(rep.to_local().dims(), full.dims());
                assert_eq!(values(&rep.full_tensor().unwrap()), values(&full));
            }
            // A 1-D tensor, and a 0-d one replicated.
            let v = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0], 5, Device::Cpu).unwrap();
            let d = distribute_tensor(&v, &mesh, &[Placement::Shard(0)]).unwrap();
            assert_eq!(values(&d.full_tensor().unwrap()), [1.0, 2.0, 3.0, 4.0, 5.0]);
            let s = Tensor::scalar(2.5, DType::F64, Device::Cpu).unwrap();
            let d = distribute_tensor(&s, &mesh, &[Placement::Replicate]).unwrap();
            assert_eq!(values(&d.full_tensor().unwrap()), [2.5]);
        });
    }
}

#[test]
fn distribute_takes_rank_0s_values_unless_told_otherwise() {
    run_ranks(3, T, |pg| {
        let (r, mesh) = (pg.rank(), DeviceMesh::new(pg));
        let mine = global(5, 2, 100.0 * r as f64, DType::F32);
        // PyTorch's default src_data_rank=0: rank 0's values everywhere.
        let d = distribute_tensor(&mine, &mesh, &[Placement::Shard(0)]).unwrap();
        assert_eq!(
            values(&d.full_tensor().unwrap()),
            values(&global(5, 2, 0.0, DType::F32))
        );
        // The caller's tensor is not overwritten by the broadcast.
        assert_eq!(values(&mine), values(&global(5, 2, 100.0 * r as f64, DType::F32)));
        // src_data_rank = None: each rank's chunk of its own tensor, no communication.
        let d = distribute_tensor_from(&mine, &mesh, &[Placement::Shard(0)], None).unwrap();
        let rows = chunk_range(5, 3, r);
        assert_eq!(
            values(&d.to_local()),
            values(&mine.narrow(0, rows.start, rows.len()).unwrap())
        );
        // From rank 2.
        let d = distribute_tensor_from(&mine, &mesh, &[Placement::Replicate], Some(2)).unwrap();
        assert_eq!(values(&d.to_local()), values(&global(5, 2, 200.0, DType::F32)));
    });
}

#[test]
fn from_local_checks_the_layout() {
    run_ranks(2, T, |pg| {
        let (r, mesh) = (pg.rank(), DeviceMesh::new(pg));
        let full = global(5, 2, 0.0, DType::F32);
        let rows = chunk_range(5, 2, r); // 0..3, 3..5
        let local = full
            .narrow(0, rows.start, rows.len())
            .unwrap()
            .deep_clone()
            .unwrap();
        let d = DTensor::from_local(
            local.clone(),
            &mesh,
            &[Placement::Shard(0)],
            Some(Shape::new([5, 2])),
        )
        .unwrap();
        assert_eq!(values(&d.full_tensor().unwrap()), values(&full));
        // to_local is the same storage: writes to it are the DTensor's.
        {
            let _g = no_grad();
            d.to_local().add_scalar_(1.0).unwrap();
        }
        assert_eq!(
            values(&local),
            values(
                &full
                    .narrow(0, rows.start, rows.len())
                    .unwrap()
                    .add_scalar(1.0)
                    .unwrap()
            )
        );

        // Without a shape: even shards assumed (2 ranks × 3 rows).
        let even = Tensor::zeros([3, 2], DType::F32, Device::Cpu).unwrap();
        let d = DTensor::from_local(even.clone(), &mesh, &[Placement::Shard(0)], None).unwrap();
        assert_eq!(d.shape().dims(), [6, 2]);

        // Rows that are not this rank's chunk: a shape mismatch naming the expected shape.
        let e =
            DTensor::from_local(even, &mesh, &[Placement::Shard(0)], Some(Shape::new([4, 2]))).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
        assert!(
            e.to_string().contains("[2, 2]") && e.to_string().contains("chunk"),
            "{e}"
        );
        // Only Shard(0) and one placement per mesh dim; a 0-d tensor cannot be sharded.
        let e = DTensor::from_local(local.clone(), &mesh, &[Placement::Shard(1)], None).unwrap_err();
        assert!(e.to_string().contains("Shard(0)"), "{e}");
        assert!(DTensor::from_local(local.clone(), &mesh, &[], None).is_err());
        let s = Tensor::scalar(1.0, DType::F32, Device::Cpu).unwrap();
        assert!(distribute_tensor(&s, &mesh, &[Placement::Shard(0)]).is_err());
        assert!(
            DTensor::from_local(local, &mesh, &[Placement::Replicate], Some(Shape::new([5, 2]))).is_err()
        );
    });
}

#[test]
fn an_optimizer_steps_on_the_local_shards() {
    // SGD on shards equals SGD on the full tensor: the shard is the parameter.
    let full = global(5, 3, 0.25, DType::F64);
    let grad = global(5, 3, -7.0, DType::F64).mul_scalar(0.01).unwrap();
    let expected = values(&full.sub(&grad.mul_scalar(0.1).unwrap()).unwrap());
    let got = run_ranks(2, T, |pg| {
        let (r, mesh) = (pg.rank(), DeviceMesh::new(pg));
        let p =
            distribute_tensor(&full.requires_grad_(true).unwrap(), &mesh, &[Placement::Shard(0)]).unwrap();
        let rows = chunk_range(5, 2, r);
        let mut opt = SGD::new(
            vec![p.to_local()],
            SgdConfig {
                lr: 0.1,
                ..Default::default()
            },
        )
        .unwrap();
        p.to_local()
            .set_grad(Some(
                grad.narrow(0, rows.start, rows.len())
                    .unwrap()
                    .contiguous()
                    .unwrap(),
            ))
            .unwrap();
        opt.step().unwrap();
        values(&p.full_tensor().unwrap())
    });
    for g in got {
        assert_eq!(g, expected);
    }
}
