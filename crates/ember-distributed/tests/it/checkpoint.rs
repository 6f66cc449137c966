//! Distributed checkpoints on ranks as threads (and, in `processes.rs`, as processes): saved
//! on 2 ranks and loaded on 1, 2 and 3 with the values of the unsharded tensors; uneven and
//! empty shards; optimizer state; atomicity; and every bad input as a typed error.

use std::path::{Path, PathBuf};
use std::time::Duration;

use ember_core::{DType, Device, Tensor};
use ember_distributed::dcp::{self, CheckpointError, StateValue};
use ember_distributed::{distribute_tensor_from, DTensor, DeviceMesh, Placement, ProcessGroup};
use ember_nn::optim::{Adam, AdamConfig, Optimizer};

use crate::common::run_ranks;
use crate::dtensor::global;

const T: Duration = Duration::from_secs(20);

/// A fresh directory for one test (removed first).
fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ember-dcp-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn files(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for name in files(from) {
        std::fs::copy(from.join(&name), to.join(&name)).unwrap();
    }
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_vec_f64().unwrap()
}

#[derive(Clone, Copy)]
enum Kind {
    Shard,
    Replicate,
    Plain,
}

/// The test state dict as unsharded tensors (`offset` shifts every value): uneven rows (7 on
/// 2 or 3 ranks), fewer rows than ranks (empty shards), no rows, a replicated bf16 tensor, and
/// plain 0-d and integer entries as optimizers have.
fn globals(offset: f64) -> Vec<(&'static str, Tensor, Kind)> {
    let v = |v: Vec<f64>, dtype| {
        let n = v.len();
        Tensor::from_vec(v, n, Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
    };
    vec![
        ("w", global(7, 3, 0.5 + offset, DType::F32), Kind::Shard),
        ("b", v(vec![1.5 + offset, -2.5], DType::F64), Kind::Shard),
        ("e", global(1, 4, 3.0 + offset, DType::F32), Kind::Shard),
        (
            "z",
            Tensor::zeros([0, 5], DType::F32, Device::Cpu).unwrap(),
            Kind::Shard,
        ),
        ("r", global(2, 2, 0.25 + offset, DType::BF16), Kind::Replicate),
        (
            "step",
            Tensor::scalar(3.0 + offset, DType::F32, Device::Cpu).unwrap(),
            Kind::Plain,
        ),
        ("idx", v(vec![4.0, 5.0, 6.0 + offset], DType::I64), Kind::Plain),
    ]
}

/// The state dict on `mesh` (plain tensors without one): the values of [`globals`], or zeros
/// of the same layout to load into.
fn state(mesh: Option<&DeviceMesh>, offset: f64, zero: bool) -> Vec<(String, StateValue)> {
    globals(offset)
        .into_iter()
        .map(|(k, t, kind)| {
            let t = if zero { t.zeros_like().unwrap() } else { t };
            let p = match kind {
                Kind::Shard => Placement::Shard(0),
                Kind::Replicate => Placement::Replicate,
                Kind::Plain => return (k.to_string(), t.into()),
            };
            let v = match mesh {
                Some(m) => distribute_tensor_from(&t, m, &[p], None).unwrap().into(),
                None => t.into(),
            };
            (k.to_string(), v)
        })
        .collect()
}

/// Every entry of `sd` holds the values of [`globals`]`(offset)`: each shard its rows, each
/// DTensor's full tensor the whole.
fn check(sd: &[(String, StateValue)], offset: f64, what: &str) {
    for ((key, v), (k, full, _)) in sd.iter().zip(globals(offset)) {
        assert_eq!(key, k);
        match v {
            StateValue::DTensor(d) => {
                let rows = d.local_range();
                let mine = match full.dims().is_empty() {
                    true => full.clone(),
                    false => full.narrow(0, rows.start, rows.len()).unwrap(),
                };
                assert_eq!(values(&d.to_local()), values(&mine), "{what}: {key}'s shard");
                assert_eq!(values(&d.full_tensor().unwrap()), values(&full), "{what}: {key}");
            }
            StateValue::Tensor(t) => assert_eq!(values(t), values(&full), "{what}: {key}"),
        }
        assert_eq!(v.to_local().dtype(), full.dtype());
    }
}

fn save_on(n: usize, dir: &Path, offset: f64) {
    run_ranks(n, T, |pg| {
        let mesh = DeviceMesh::new(pg.clone());
        dcp::save(&state(Some(&mesh), offset, false), dir, Some(&pg)).unwrap();
    });
}

#[test]
fn save_on_2_load_on_1_2_3() {
    let dir = tmp("reshard");
    save_on(2, &dir, 0.0);
    let names = files(&dir);
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names[0], ".metadata");
    assert!(names[1].starts_with("__0_") && names[2].starts_with("__1_") && names[2].ends_with(".distcp"));

    // The metadata names each piece's file, offsets and lengths.
    let md: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join(".metadata")).unwrap()).unwrap();
    let w = &md["tensors"]["w"];
    assert_eq!(
        (w["dtype"].as_str(), &w["shape"]),
        (Some("float32"), &serde_json::json!([7, 3]))
    );
    let pieces = w["pieces"].as_array().unwrap();
    assert_eq!(pieces.len(), 2);
    assert_eq!(
        (&pieces[0]["offsets"], &pieces[0]["lengths"]),
        (&serde_json::json!([0, 0]), &serde_json::json!([4, 3]))
    );
    assert_eq!(
        (&pieces[1]["offsets"], &pieces[1]["lengths"]),
        (&serde_json::json!([4, 0]), &serde_json::json!([3, 3]))
    );
    assert_eq!(pieces[1]["file"].as_str(), Some(names[2].as_str()));
    assert_eq!(
        md["tensors"]["e"]["pieces"].as_array().unwrap().len(),
        1,
        "one row: rank 1's shard is empty"
    );
    assert!(md["tensors"]["z"]["pieces"].as_array().unwrap().is_empty());
    assert_eq!(
        md["tensors"]["r"]["pieces"][0]["file"].as_str(),
        Some(names[1].as_str())
    );
    assert_eq!(
        md["tensors"]["step"]["pieces"][0]["lengths"],
        serde_json::json!([])
    );

    for n in [1, 2, 3] {
        run_ranks(n, T, |pg| {
            let mesh = DeviceMesh::new(pg.clone());
            let sd = state(Some(&mesh), 0.0, true);
            dcp::load(&sd, &dir, Some(&pg)).unwrap();
            check(&sd, 0.0, &format!("rank {} of {n}", pg.rank()));
        });
    }
    // One process, no group, into plain tensors.
    let sd = state(None, 0.0, true);
    dcp::load(&sd, &dir, None).unwrap();
    check(&sd, 0.0, "plain tensors");

    // Saved on 3, loaded on 2; saved by one process, loaded on 2.
    let dir3 = tmp("reshard3");
    save_on(3, &dir3, 5.0);
    run_ranks(2, T, |pg| {
        let sd = state(Some(&DeviceMesh::new(pg.clone())), 0.0, true);
        dcp::load(&sd, &dir3, Some(&pg)).unwrap();
        check(&sd, 5.0, "saved on 3, loaded on 2");
    });
    let dir1 = tmp("reshard1");
    dcp::save(&state(None, 7.0, false), &dir1, None).unwrap();
    run_ranks(2, T, |pg| {
        let sd = state(Some(&DeviceMesh::new(pg.clone())), 0.0, true);
        dcp::load(&sd, &dir1, Some(&pg)).unwrap();
        check(&sd, 7.0, "saved by one process, loaded on 2");
    });
    for d in [dir, dir3, dir1] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// Adam's parameters after `steps` steps on the unsharded tensors, from [`adam_start`] with
/// [`adam_grads`]; then its state after the same steps.
fn adam_start() -> (Tensor, Tensor) {
    let w = global(5, 3, 0.25, DType::F64).mul_scalar(0.1).unwrap();
    let b = Tensor::from_vec(vec![0.5f64, -0.5], 2, Device::Cpu).unwrap();
    (w, b)
}

fn adam_grads(step: usize) -> (Tensor, Tensor) {
    let gw = global(5, 3, step as f64 - 20.0, DType::F64)
        .mul_scalar(0.01)
        .unwrap();
    let gb = Tensor::from_vec(vec![0.3 * step as f64 - 0.2, 1.0], 2, Device::Cpu).unwrap();
    (gw, gb)
}

fn adam() -> AdamConfig {
    AdamConfig {
        lr: 0.1,
        weight_decay: 0.01,
        ..AdamConfig::default()
    }
}

/// The rows of `g` that `p`'s shard holds.
fn chunk_of(g: &Tensor, p: &DTensor) -> Tensor {
    let r = p.local_range();
    g.narrow(0, r.start, r.len()).unwrap().contiguous().unwrap()
}

/// Sharded parameters on `pg` (zeros or the start values) and Adam over their shards.
fn sharded_adam(pg: &ProcessGroup, zero: bool) -> (DTensor, DTensor, Adam) {
    let mesh = DeviceMesh::new(pg.clone());
    let (w, b) = adam_start();
    let leaf = |t: Tensor| {
        let t = if zero { t.zeros_like().unwrap() } else { t };
        let t = t.requires_grad_(true).unwrap();
        distribute_tensor_from(&t, &mesh, &[Placement::Shard(0)], None).unwrap()
    };
    let (pw, pb) = (leaf(w), leaf(b));
    let opt = Adam::new(vec![pw.to_local(), pb.to_local()], adam()).unwrap();
    (pw, pb, opt)
}

fn step_sharded(pw: &DTensor, pb: &DTensor, opt: &mut Adam, step: usize) {
    let (gw, gb) = adam_grads(step);
    pw.to_local().set_grad(Some(chunk_of(&gw, pw))).unwrap();
    pb.to_local().set_grad(Some(chunk_of(&gb, pb))).unwrap();
    opt.step().unwrap();
}

/// Model and optimizer state as one state dict (`model.*`, `optim.*`).
fn train_state(pw: &DTensor, pb: &DTensor, opt: &Adam) -> Vec<(String, StateValue)> {
    let mut sd: Vec<(String, StateValue)> = vec![
        ("model.w".into(), pw.clone().into()),
        ("model.b".into(), pb.clone().into()),
    ];
    let optim = dcp::shard_optimizer_state(opt.state_dict(), &[pw.clone(), pb.clone()]).unwrap();
    sd.extend(optim.into_iter().map(|(k, v)| (format!("optim.{k}"), v)));
    sd
}

fn assert_close(got: &[f64], expected: &[f64], what: &str) {
    assert_eq!(got.len(), expected.len(), "{what}");
    for (g, e) in got.iter().zip(expected) {
        assert!(
            (g - e).abs() <= 1e-12 * e.abs().max(1.0),
            "{what}: {got:?} vs {expected:?}"
        );
    }
}

#[test]
fn optimizer_state_saved_on_2_resumes_on_3_as_unsharded() {
    // The unsharded reference: 3 Adam steps.
    let (w, b) = adam_start();
    let (w, b) = (w.requires_grad_(true).unwrap(), b.requires_grad_(true).unwrap());
    let mut opt = Adam::new(vec![w.clone(), b.clone()], adam()).unwrap();
    let mut after = Vec::new();
    for s in 0..3 {
        let (gw, gb) = adam_grads(s);
        w.set_grad(Some(gw)).unwrap();
        b.set_grad(Some(gb)).unwrap();
        opt.step().unwrap();
        let st = opt.state_dict();
        let exp_avg = st.iter().find(|(k, _)| k == "state.0.exp_avg").unwrap().1.clone();
        after.push((values(&w), values(&b), values(&exp_avg)));
    }

    let dir = tmp("adam");
    run_ranks(2, T, |pg| {
        let (pw, pb, mut opt) = sharded_adam(&pg, false);
        for s in 0..2 {
            step_sharded(&pw, &pb, &mut opt, s);
        }
        let sd = train_state(&pw, &pb, &opt);
        assert!(
            matches!(sd[2].1, StateValue::Tensor(_)),
            "{}: step counts stay plain",
            sd[2].0
        );
        assert!(
            matches!(sd[3].1, StateValue::DTensor(_)),
            "{}: moments are sharded",
            sd[3].0
        );
        dcp::save(&sd, &dir, Some(&pg)).unwrap();
    });
    run_ranks(3, T, |pg| {
        let (pw, pb, mut opt) = sharded_adam(&pg, true);
        // A step with zero gradients gives the optimizer state to load into.
        pw.to_local()
            .set_grad(Some(pw.to_local().zeros_like().unwrap()))
            .unwrap();
        pb.to_local()
            .set_grad(Some(pb.to_local().zeros_like().unwrap()))
            .unwrap();
        opt.step().unwrap();
        let sd = train_state(&pw, &pb, &opt);
        dcp::load(&sd, &dir, Some(&pg)).unwrap();
        let optim: Vec<(String, Tensor)> = dcp::to_local_state(&sd)
            .into_iter()
            .filter_map(|(k, t)| k.strip_prefix("optim.").map(|k| (k.to_string(), t)))
            .collect();
        opt.load_state_dict(&optim).unwrap();
        let what = format!("rank {} of 3", pg.rank());
        let exp_avg = |opt: &Adam| {
            let st = dcp::shard_optimizer_state(opt.state_dict(), &[pw.clone(), pb.clone()]).unwrap();
            let StateValue::DTensor(d) = &st.iter().find(|(k, _)| k == "state.0.exp_avg").unwrap().1 else {
                panic!("exp_avg is sharded")
            };
            values(&d.full_tensor().unwrap())
        };
        assert_close(&values(&pw.full_tensor().unwrap()), &after[1].0, &what);
        assert_close(&values(&pb.full_tensor().unwrap()), &after[1].1, &what);
        assert_close(&exp_avg(&opt), &after[1].2, &what);
        // The third step on 3 ranks continues the unsharded run.
        step_sharded(&pw, &pb, &mut opt, 2);
        assert_close(&values(&pw.full_tensor().unwrap()), &after[2].0, &what);
        assert_close(&values(&pb.full_tensor().unwrap()), &after[2].1, &what);
        assert_close(&exp_avg(&opt), &after[2].2, &what);
    });
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_failed_save_leaves_the_previous_checkpoint_and_a_new_one_replaces_it() {
    let dir = tmp("atomic");
    save_on(2, &dir, 0.0);
    let before = files(&dir);

    // Rank 1's state dict is bad: both ranks fail, rank 0 naming rank 1; no file of this save
    // stays behind and the previous checkpoint loads as it was.
    run_ranks(2, T, |pg| {
        let mut sd = state(Some(&DeviceMesh::new(pg.clone())), 100.0, false);
        if pg.rank() == 1 {
            sd.push(sd[0].clone());
        }
        let e = dcp::save(&sd, &dir, Some(&pg)).unwrap_err();
        match pg.rank() {
            0 => assert!(matches!(&e, CheckpointError::PeerFailed { rank: 1, .. }), "{e}"),
            _ => assert!(
                matches!(&e, CheckpointError::DuplicateKey { key } if key == "w"),
                "{e}"
            ),
        }
    });
    // Ranks that disagree on a tensor's shape: every rank says so.
    run_ranks(2, T, |pg| {
        let mut sd = state(Some(&DeviceMesh::new(pg.clone())), 100.0, false);
        if pg.rank() == 1 {
            sd[6].1 = Tensor::zeros(4, DType::I64, Device::Cpu).unwrap().into();
        }
        let e = dcp::save(&sd, &dir, Some(&pg)).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::InvalidStateDict { msg } if msg.contains("idx")),
            "{e}"
        );
    });
    // A DTensor of a 2-rank mesh saved without its group.
    run_ranks(2, T, |pg| {
        let e = dcp::save(&state(Some(&DeviceMesh::new(pg.clone())), 1.0, false), &dir, None).unwrap_err();
        assert!(
            matches!(&e, CheckpointError::InvalidStateDict { msg } if msg.contains("get_group")),
            "{e}"
        );
    });
    assert_eq!(files(&dir), before);
    let sd = state(None, 0.0, true);
    dcp::load(&sd, &dir, None).unwrap();
    check(&sd, 0.0, "after failed saves");

    // What a crash leaves (a file of an unfinished save, a temporary file) changes nothing.
    std::fs::write(dir.join("__1_00000000deadbeef.distcp"), b"partial").unwrap();
    std::fs::write(dir.join(".metadata.tmp.1.0"), b"{").unwrap();
    let sd = state(None, 0.0, true);
    dcp::load(&sd, &dir, None).unwrap();
    check(&sd, 0.0, "beside a crashed save's files");

    // A new save into the same directory replaces the checkpoint and removes the old files.
    save_on(3, &dir, 1000.0);
    let after = files(&dir);
    assert_eq!(
        after.iter().filter(|f| f.ends_with(".distcp")).count(),
        3,
        "{after:?}"
    );
    assert!(after.iter().all(|f| !before[1..].contains(f)), "{after:?}");
    run_ranks(2, T, |pg| {
        let sd = state(Some(&DeviceMesh::new(pg.clone())), 0.0, true);
        dcp::load(&sd, &dir, Some(&pg)).unwrap();
        check(&sd, 1000.0, "replaced");
    });

    // Without its metadata the checkpoint is incomplete, as is a directory that is not there.
    std::fs::remove_file(dir.join(".metadata")).unwrap();
    let e = dcp::load(&state(None, 0.0, true), &dir, None).unwrap_err();
    assert!(matches!(&e, CheckpointError::Incomplete { .. }), "{e}");
    assert!(e.to_string().contains("incomplete"), "{e}");
    let e = dcp::load(&state(None, 0.0, true), dir.join("nothing"), None).unwrap_err();
    assert!(matches!(e, CheckpointError::Incomplete { .. }), "{e}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn bad_loads_are_typed_errors_and_write_nothing() {
    let dir = tmp("errors");
    save_on(2, &dir, 0.0);
    let load = |sd: &[(String, StateValue)], d: &Path| dcp::load(sd, d, None).unwrap_err();
    let untouched = |sd: &[(String, StateValue)]| {
        for (k, v) in sd {
            assert!(values(&v.to_local()).iter().all(|&x| x == 0.0), "{k} was written");
        }
    };

    // Keys: the state dict has one the checkpoint lacks, or lacks one it has.
    let mut sd = state(None, 0.0, true);
    sd.push((
        "extra".into(),
        Tensor::zeros(1, DType::F32, Device::Cpu).unwrap().into(),
    ));
    match load(&sd, &dir) {
        CheckpointError::KeyMismatch {
            missing, unexpected, ..
        } => {
            assert_eq!((missing, unexpected), (vec!["extra".to_string()], vec![]))
        }
        e => panic!("{e}"),
    }
    let mut sd = state(None, 0.0, true);
    sd.remove(6);
    let e = load(&sd, &dir);
    assert!(
        matches!(&e, CheckpointError::KeyMismatch { unexpected, .. } if unexpected == &["idx"]),
        "{e}"
    );
    let mut sd = state(None, 0.0, true);
    sd.push(sd[1].clone());
    assert!(matches!(load(&sd, &dir), CheckpointError::DuplicateKey { .. }));

    // Shape and dtype.
    let mut sd = state(None, 0.0, true);
    sd[0].1 = Tensor::zeros([8, 3], DType::F32, Device::Cpu).unwrap().into();
    let e = load(&sd, &dir);
    assert!(
        matches!(&e, CheckpointError::ShapeMismatch { key, .. } if key == "w"),
        "{e}"
    );
    assert!(
        e.to_string().contains("[7, 3]") && e.to_string().contains("[8, 3]"),
        "{e}"
    );
    untouched(&sd);
    let mut sd = state(None, 0.0, true);
    sd[0].1 = Tensor::zeros([7, 3], DType::F64, Device::Cpu).unwrap().into();
    let e = load(&sd, &dir);
    assert!(
        matches!(&e, CheckpointError::DTypeMismatch { key, expected: DType::F64, found: DType::F32 } if key == "w"),
        "{e}"
    );
    untouched(&sd);

    // Damaged files: truncated, overwritten, missing; the metadata itself.
    let names = files(&dir);
    let damaged = tmp("errors-damaged");
    copy_dir(&dir, &damaged);
    let rank1 = damaged.join(&names[2]);
    let bytes = std::fs::read(&rank1).unwrap();
    std::fs::write(&rank1, &bytes[..bytes.len() - 8]).unwrap();
    let sd = state(None, 0.0, true);
    let e = load(&sd, &damaged);
    assert!(
        matches!(&e, CheckpointError::Corrupt { path, .. } if path == &rank1),
        "{e}"
    );
    untouched(&sd); // rank 0's file was read, but nothing is written before all reads succeed
    let mut same_size = bytes.clone();
    same_size[8..16].copy_from_slice(b"!garbage");
    std::fs::write(&rank1, &same_size).unwrap();
    assert!(matches!(load(&sd, &damaged), CheckpointError::Corrupt { .. }));
    std::fs::remove_file(&rank1).unwrap();
    let e = load(&sd, &damaged);
    assert!(
        matches!(&e, CheckpointError::MissingFile { path, .. } if path == &rank1),
        "{e}"
    );
    // A rank that needs only rank 0's rows never opens rank 1's file.
    run_ranks(2, T, |pg| {
        let sd = state(Some(&DeviceMesh::new(pg.clone())), 0.0, true);
        let got = dcp::load(&sd, &damaged, Some(&pg));
        match pg.rank() {
            0 => assert!(matches!(
                got,
                Err(CheckpointError::PeerFailed {
                    op: "load",
                    rank: 1,
                    ..
                })
            )),
            _ => assert!(matches!(got, Err(CheckpointError::MissingFile { .. }))),
        }
        untouched(&sd);
    });
    std::fs::write(damaged.join(".metadata"), b"{\"format\": 1").unwrap();
    assert!(matches!(
        load(&sd, &damaged),
        CheckpointError::InvalidMetadata { .. }
    ));
    std::fs::write(damaged.join(".metadata"), b"{\"format\": \"something else\"}").unwrap();
    assert!(matches!(
        load(&sd, &damaged),
        CheckpointError::InvalidMetadata { .. }
    ));

    // One rank's bad state dict fails the load on every rank, and none writes anything.
    run_ranks(2, T, |pg| {
        let mut sd = state(Some(&DeviceMesh::new(pg.clone())), 0.0, true);
        if pg.rank() == 1 {
            sd[5].1 = Tensor::zeros((), DType::F64, Device::Cpu).unwrap().into();
        }
        let e = dcp::load(&sd, &dir, Some(&pg)).unwrap_err();
        match pg.rank() {
            0 => assert!(
                e.to_string().contains("rank 1") && e.to_string().contains("step"),
                "{e}"
            ),
            _ => assert!(matches!(e, CheckpointError::DTypeMismatch { .. }), "{e}"),
        }
        untouched(&sd);
    });
    // Errors fold into ember's error for `?` in functions returning ember_core::Result.
    let e: ember_core::Error = load(&state(None, 0.0, true), &damaged).into();
    assert!(e.to_string().contains("metadata"), "{e}");
    for d in [dir, damaged] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

/// The process scenarios (`processes.rs`): save on this world through the default group and
/// a mesh from `init_device_mesh`, or load and check.
pub fn process_scenario(save: bool, dir: &Path) {
    let n = ember_distributed::get_world_size().unwrap();
    let mesh = ember_distributed::init_device_mesh("cpu", &[n]).unwrap();
    if save {
        dcp::save(&state(Some(&mesh), 9.0, false), dir, None).unwrap();
    } else {
        let sd = state(Some(&mesh), 0.0, true);
        dcp::load(&sd, dir, None).unwrap();
        check(&sd, 9.0, &format!("process {} of {n}", mesh.get_local_rank()));
    }
    assert!(ember_distributed::init_device_mesh("cuda", &[n]).is_err());
    assert!(ember_distributed::init_device_mesh("cpu", &[n, 1]).is_err());
}

/// The killed-rank scenario (`processes.rs`): a checkpoint saved by every rank, then the last
/// rank dies before the next save into the same directory; the survivors' save fails, and the
/// previous checkpoint still loads (here in one process each, the group being broken).
pub fn killed_scenario(dir: &Path) {
    use ember_distributed as dist;
    let (rank, n) = (dist::get_rank().unwrap(), dist::get_world_size().unwrap());
    let mesh = dist::init_device_mesh("cpu", &[n]).unwrap();
    dcp::save(&state(Some(&mesh), 9.0, false), dir, None).unwrap();
    dist::barrier().unwrap();
    if rank == n - 1 {
        // Long enough for the peers to have read this rank's last messages.
        std::thread::sleep(Duration::from_millis(300));
        std::process::exit(7);
    }
    let e = dcp::save(&state(Some(&mesh), 50.0, false), dir, None).unwrap_err();
    println!("rank {rank}: the save failed: {e}");
    dist::destroy_process_group();
    let sd = state(None, 0.0, true);
    dcp::load(&sd, dir, None).unwrap();
    check(&sd, 9.0, &format!("survivor {rank}"));
}

#[test]
#[ignore = "needs two CUDA devices"]
fn dtensors_and_checkpoints_on_two_gpus() {
    crate::common::require_two_gpus();
    let dir = tmp("nccl");
    crate::nccl::run_nccl_ranks(2, |pg, rank| {
        let mesh = DeviceMesh::new(pg.clone());
        assert_eq!(mesh.device_type(), Device::Cuda(rank));
        // CPU tensors go to the mesh's GPU; full_tensor all-gathers over NCCL.
        let sd = state(Some(&mesh), 0.0, false);
        let StateValue::DTensor(w) = &sd[0].1 else {
            panic!("w is sharded")
        };
        assert_eq!(w.device(), Device::Cuda(rank));
        check(&sd, 0.0, &format!("cuda:{rank}"));
        // distribute_tensor broadcasts rank 0's values over NCCL.
        let mine = crate::dtensor::global(5, 3, 100.0 * rank as f64, DType::F32);
        let d = ember_distributed::distribute_tensor(&mine, &mesh, &[Placement::Shard(0)]).unwrap();
        let rank0 = crate::dtensor::global(5, 3, 0.0, DType::F32);
        assert_eq!(values(&d.full_tensor().unwrap()), values(&rank0));
        // Saved from the GPUs, loaded back onto them.
        dcp::save(&sd, &dir, Some(&pg)).unwrap();
        let into = state(Some(&mesh), 0.0, true);
        dcp::load(&into, &dir, Some(&pg)).unwrap();
        check(&into, 0.0, &format!("loaded on cuda:{rank}"));
    });
    // The GPUs' checkpoint in one process on the CPU.
    let sd = state(None, 0.0, true);
    dcp::load(&sd, &dir, None).unwrap();
    check(&sd, 0.0, "on the CPU");
    std::fs::remove_dir_all(dir).unwrap();
}

/// The seed corpus of the fuzz target `dcp` (`fuzz/corpus/dcp/`): the metadata and both ranks'
/// files of [`save_on`]`(2, ..)` (uneven, empty and 0-d entries, a replicated bf16 tensor), each
/// read back by the target's entry points; and `read_metadata` of that checkpoint. `EMBER_WRITE_FUZZ_SEEDS=1 cargo test -p
/// ember-distributed --test it fuzz_seeds` rewrites the corpus with them.
#[test]
fn dcp_fuzz_seeds_are_read_by_the_fuzz_entry_points() {
    let dir = tmp("fuzz-seeds");
    save_on(2, &dir, 0.0);
    let names = files(&dir);
    assert_eq!(names.len(), 3, "{names:?}");
    // read_metadata lists every key with its dtype and global shape, in sorted order.
    let mut expected: Vec<(String, DType, Vec<usize>)> = globals(0.0)
        .into_iter()
        .map(|(k, t, _)| (k.to_string(), t.dtype(), t.dims().to_vec()))
        .collect();
    expected.sort_by(|a, b| a.0.cmp(&b.0));
    let listed: Vec<(String, DType, Vec<usize>)> = dcp::read_metadata(&dir)
        .unwrap()
        .into_iter()
        .map(|(k, t)| (k, t.dtype, t.shape.dims().to_vec()))
        .collect();
    assert_eq!(listed, expected);
    let md = std::fs::read(dir.join(dcp::METADATA_FILE)).unwrap();
    assert_eq!(dcp::fuzzing::metadata(&md), Some(globals(0.0).len()));
    assert_eq!(
        dcp::fuzzing::shard_file(&md),
        None,
        "JSON is not a safetensors file"
    );
    let mut seeds = vec![("metadata.json".to_string(), md)];
    for (rank, name) in names.iter().filter(|n| n.ends_with(".distcp")).enumerate() {
        let bytes = std::fs::read(dir.join(name)).unwrap();
        let pieces = dcp::fuzzing::shard_file(&bytes).unwrap();
        assert!(pieces > 0, "{name}: every piece it lists is read");
        assert_eq!(dcp::fuzzing::metadata(&bytes), None);
        // Every truncation of a piece file is refused, without a panic.
        for cut in 0..bytes.len() {
            assert!(dcp::fuzzing::shard_file(&bytes[..cut]).is_none_or(|n| n < pieces));
        }
        seeds.push((format!("rank{rank}.distcp"), bytes));
    }
    if std::env::var_os("EMBER_WRITE_FUZZ_SEEDS").is_some() {
        let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/dcp");
        std::fs::create_dir_all(&corpus).unwrap();
        for (name, bytes) in &seeds {
            std::fs::write(corpus.join(name), bytes).unwrap();
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}
