//! Writes the seed corpus of every fuzz target into `fuzz/corpus/TARGET/`, each file made by
//! ember's own writer of that format (`save_tensors`, `save_checkpoint`, `to_idx_bytes`,
//! `pickle::dumps`, the store client's request encoder). Files named `cpython-*` were written by
//! CPython's `pickle` and are kept as they are (see the README's "Fuzzing" section). The seeds
//! of `dcp` need a checkpoint saved by two ranks, so ember-distributed's test
//! `dcp_fuzz_seeds_are_read_by_the_fuzz_entry_points` writes them (with
//! `EMBER_WRITE_FUZZ_SEEDS=1`), and checks that the target's readers read them back.
//!
//! `fuzz/run.sh --seeds` builds and runs it with the targets' flags (so nothing is built twice).

// Built with libFuzzer's coverage instrumentation like the targets: libFuzzer's runtime
// provides the hooks the instrumented code calls (this program's own `main` runs, not
// libFuzzer's).
use libfuzzer_sys as _;

#[allow(dead_code)]
#[path = "../../../crates/ember/src/train/checkpoint.rs"]
mod checkpoint;

use ember::nn::optim::Optimizer;
use ember::nn::state_dict::{save_safetensors, save_tensors};
use ember::nn::{Forward, ModuleExt};
use ember::pickle::{self, Value};
use ember::{DType, Device, Tensor};
use ember_fuzz::{adam, scaler, sgd, Mlp, Zoo};
use std::io::Write;
use std::path::{Path, PathBuf};

type Res = Result<(), Box<dyn std::error::Error>>;

const CPU: Device = Device::Cpu;

fn dir(target: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus").join(target);
    std::fs::create_dir_all(&d).expect("the corpus folder");
    d
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    std::fs::write(dir(target).join(name), bytes).expect("writing a seed");
}

/// One small tensor of each dtype ember loads.
fn one_of_each_dtype() -> ember::Result<Vec<(String, Tensor)>> {
    let v = Tensor::from_vec(vec![1.5f64, -2.0, 0.25, 3.0, -0.5, 8.0], [2, 3], CPU)?;
    let mut out = Vec::new();
    for dtype in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I64,
        DType::I32,
        DType::U8,
        DType::Bool,
    ] {
        out.push((format!("t_{}", dtype.name()), v.to_dtype(dtype)?));
    }
    out.push(("scalar".into(), Tensor::scalar(7.0, DType::I64, CPU)?));
    out.push(("empty".into(), Tensor::zeros([0, 4], DType::F32, CPU)?));
    Ok(out)
}

/// One training step of `params` so that optimizers and the scaler have state.
fn train_step(
    model: &dyn Forward,
    opt: &mut dyn Optimizer,
    scaler: Option<&mut ember::amp::GradScaler>,
) -> ember::Result<()> {
    let x = Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 0.25, 1.0, 0.0, -0.5, 1.5], [2, 4], CPU)?;
    let loss = model.forward(&x)?.square()?.mean_all()?;
    match scaler {
        Some(s) => {
            s.scale(&loss)?.backward()?;
            s.step(opt)?;
            s.update()?;
        }
        None => {
            loss.backward()?;
            opt.step()?;
        }
    }
    Ok(())
}

fn safetensors_seeds() -> Res {
    let d = dir("safetensors");
    save_tensors(&one_of_each_dtype()?, d.join("each_dtype.safetensors"))?;
    save_tensors(&[], d.join("no_tensors.safetensors"))?;
    save_safetensors(&Mlp::new()?, d.join("mlp.safetensors"))?;
    Ok(())
}

fn state_dict_seeds() -> Res {
    let d = dir("state_dict");
    ember::manual_seed(0)?;
    let zoo = Zoo::new()?;
    save_safetensors(&zoo, d.join("zoo.safetensors"))?;
    let mlp = Mlp::new()?;
    // Optimizer and scaler states of the fuzzed model's parameters after one step each.
    let x = Tensor::from_vec(vec![0.5f32, -1.0, 2.0, 0.25, 1.0, 0.0, -0.5, 1.5], [2, 4], CPU)?;
    let zoo_loss = || -> ember::Result<Tensor> { zoo.fc.forward(&x)?.square()?.mean_all() };
    let mut a = adam(zoo.parameters())?;
    zoo_loss()?.backward()?;
    a.step()?;
    save_tensors(&a.state_dict(), d.join("adam.safetensors"))?;
    let mut s = sgd(zoo.parameters())?;
    zoo_loss()?.backward()?;
    s.step()?;
    save_tensors(&s.state_dict(), d.join("sgd.safetensors"))?;
    let mut sc = scaler()?;
    let mut a2 = adam(mlp.parameters())?;
    train_step(&mlp, &mut a2, Some(&mut sc))?;
    save_tensors(&sc.state_dict()?, d.join("grad_scaler.safetensors"))?;
    Ok(())
}

fn checkpoint_seeds() -> Res {
    let d = dir("checkpoint");
    ember::manual_seed(1)?;
    let model = Mlp::new()?;
    let mut opt = adam(model.parameters())?;
    let mut sc = scaler()?;
    train_step(&model, &mut opt, Some(&mut sc))?;
    let pos = checkpoint::Position {
        epoch: 1,
        step: 3,
        loss_sum: 1.25,
        seen: 12,
    };
    checkpoint::save_checkpoint(&d.join("mlp_fp16.safetensors"), &model, &opt, &sc, pos)?;
    let mut off = ember::amp::GradScaler::with_config(ember::amp::GradScalerConfig {
        enabled: false,
        ..Default::default()
    })?;
    train_step(&model, &mut opt, Some(&mut off))?;
    let boundary = checkpoint::Position {
        epoch: 2,
        ..Default::default()
    };
    checkpoint::save_checkpoint(
        &d.join("mlp_epoch_boundary.safetensors"),
        &model,
        &opt,
        &off,
        boundary,
    )?;
    Ok(())
}

fn idx_seeds() -> Res {
    let idx = |t: &Tensor| ember::data::idx::to_idx_bytes(t);
    let u8s = Tensor::from_vec((0u8..24).collect::<Vec<_>>(), [2, 3, 4], CPU)?;
    write("idx", "u8_2x3x4.idx", &idx(&u8s)?);
    write(
        "idx",
        "i32_5.idx",
        &idx(&Tensor::from_vec(
            vec![-3i32, 0, 7, i32::MAX, i32::MIN],
            [5],
            CPU,
        )?)?,
    );
    write(
        "idx",
        "f32_2x2.idx",
        &idx(&Tensor::from_vec(vec![0.5f32, -1.0, 1e-3, 3.0e8], [2, 2], CPU)?)?,
    );
    write(
        "idx",
        "f64_scalar.idx",
        &idx(&Tensor::scalar(2.5, DType::F64, CPU)?)?,
    );
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&idx(&u8s)?)?;
    write("idx", "u8_2x3x4.idx.gz", &gz.finish()?);
    Ok(())
}

/// A snapshot as `cuda::dump_snapshot` writes it: one segment of two blocks, a few events.
fn snapshot_value(with_trace: bool) -> Value {
    let base: u64 = 0x7f00_0000_0000;
    let mib: u64 = 1 << 20;
    let frames = Value::List(vec![Value::dict([
        ("filename", "/src/train.rs".into()),
        ("line", 42.into()),
        ("name", "forward".into()),
    ])]);
    let event = |action: &str, addr: u64, size: u64, t: u64| {
        Value::dict([
            ("action", action.into()),
            ("addr", addr.into()),
            ("size", size.into()),
            ("stream", 0.into()),
            ("time_us", t.into()),
            ("frames", frames.clone()),
        ])
    };
    let mut trace = vec![
        event("segment_alloc", base, 8 * mib, 1),
        event("alloc", base, 2 * mib, 2),
        event("alloc", base + 2 * mib, 4 * mib, 3),
        event("free_requested", base, 2 * mib, 4),
        event("free_completed", base, 2 * mib, 5),
    ];
    trace.push(Value::dict([
        ("action", "oom".into()),
        ("device_free", 1024.into()),
        ("size", (64 * mib).into()),
        ("stream", 0.into()),
        ("time_us", 6.into()),
        ("frames", frames.clone()),
    ]));
    let block = |addr: u64, size: u64, state: &str| {
        Value::dict([
            ("address", addr.into()),
            ("size", size.into()),
            ("requested_size", size.into()),
            ("state", state.into()),
            ("frames", frames.clone()),
        ])
    };
    let segment = Value::dict([
        ("device", 0.into()),
        ("address", base.into()),
        ("total_size", (8 * mib).into()),
        ("allocated_size", (4 * mib).into()),
        ("active_size", (4 * mib).into()),
        ("requested_size", (4 * mib).into()),
        ("stream", 0.into()),
        ("segment_type", "large".into()),
        ("segment_pool_id", Value::Tuple(vec![0.into(), 0.into()])),
        ("is_expandable", false.into()),
        ("frames", Value::List(vec![])),
        (
            "blocks",
            Value::List(vec![
                block(base, 2 * mib, "inactive"),
                block(base + 2 * mib, 4 * mib, "active_allocated"),
                block(base + 6 * mib, 2 * mib, "active_pending_free"),
            ]),
        ),
    ]);
    Value::dict([
        ("segments", Value::List(vec![segment])),
        (
            "device_traces",
            Value::List(vec![Value::List(if with_trace { trace } else { vec![] })]),
        ),
    ])
}

fn pickle_seeds() -> Res {
    let plain = Value::dict([
        ("none", Value::None),
        ("bools", Value::List(vec![true.into(), false.into()])),
        (
            "ints",
            Value::List(
                [
                    0i128,
                    255,
                    256,
                    65535,
                    65536,
                    -1,
                    i32::MIN as i128,
                    1 << 40,
                    -(1 << 70),
                    i128::MAX,
                ]
                .into_iter()
                .map(Value::Int)
                .collect(),
            ),
        ),
        (
            "floats",
            Value::List(vec![0.5.into(), (-1e300).into(), f64::INFINITY.into()]),
        ),
        (
            "tuples",
            Value::List(
                (0..5)
                    .map(|n| Value::Tuple((0..n).map(|i| (i as i64).into()).collect()))
                    .collect(),
            ),
        ),
        (
            "repeated",
            Value::List(vec!["key".into(), "key".into(), "ключ".into()]),
        ),
        ("one", Value::List(vec![Value::dict([("k", 1.into())])])),
    ]);
    write("pickle", "plain_data.pickle", &pickle::dumps(&plain));
    write("pickle", "snapshot.pickle", &pickle::dumps(&snapshot_value(true)));
    let long = Value::List((0..1200).map(|i| ((i % 300) as i64).into()).collect());
    write("pickle", "batched_appends.pickle", &pickle::dumps(&long));
    Ok(())
}

fn memviz_seeds() -> Res {
    write("memviz", "snapshot.pickle", &pickle::dumps(&snapshot_value(true)));
    write(
        "memviz",
        "segments_only.pickle",
        &pickle::dumps(&snapshot_value(false)),
    );
    let Value::Dict(items) = snapshot_value(false) else {
        unreachable!("a dict")
    };
    // torch.cuda.memory_snapshot(): the bare list of segments.
    write("memviz", "bare_segment_list.pickle", &pickle::dumps(&items[0].1));
    Ok(())
}

fn store_seeds() -> Res {
    let requests = ember::distributed::store::fuzzing::client_requests();
    write("store", "every_request.bin", &requests.concat());
    for (i, r) in requests.iter().enumerate() {
        write("store", &format!("request_{i}.bin"), r);
    }
    // The server's answers to them, as it writes them.
    let answers = ember::distributed::store::fuzzing::decode(&requests.concat(), &[]);
    assert_eq!(answers.len(), requests.len(), "every request is answered");
    for (i, a) in answers.iter().enumerate() {
        write("store", &format!("answer_{i}.bin"), a);
    }
    Ok(())
}

fn main() -> Res {
    safetensors_seeds()?;
    state_dict_seeds()?;
    checkpoint_seeds()?;
    idx_seeds()?;
    pickle_seeds()?;
    memviz_seeds()?;
    store_seeds()?;
    println!("seeds written under {}", dir("").display());
    Ok(())
}
