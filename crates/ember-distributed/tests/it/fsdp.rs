//! fully_shard (FSDP2) over the CPU backend, ranks as threads: the shards' gradients and the
//! gathered parameters after AdamW steps against DDP + AdamW on the same data, with the module
//! sharded whole, layer by layer, or nested (layers, then the root), resharded after forward
//! (gathered again in backward) or not; gradient accumulation without sync against DDP's
//! `no_sync`; a mixed-precision policy; and the errors of fully_shard.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ember_core::{no_grad, DType, Device, Error, Tensor};
use ember_distributed::dcp::{self, StateValue};
use ember_distributed::dtensor::chunk_range;
use ember_distributed::{
    fully_shard, get_model_state_dict, get_optimizer_state_dict, DTensor, DdpOptions, DeviceMesh,
    DistributedDataParallel, FSDPModule, FullyShardOptions, MixedPrecisionPolicy, ProcessGroup,
    ShardedGradScaler,
};
use ember_nn::functional::mse_loss;
use ember_nn::optim::{AdamConfig, AdamW, Optimizer};
use ember_nn::{Forward, Linear, Module, ModuleExt, Reduction, Sequential, Tanh, TensorKind};

use crate::common::run_ranks;
use crate::ddp::{assert_close_tol, data, fill_params, mlp};

const T: Duration = Duration::from_secs(20);
const ROWS: usize = 12;
const STEPS: usize = 3;

fn adamw(params: Vec<Tensor>) -> AdamW {
    AdamW::new(
        params,
        AdamConfig {
            lr: 0.05,
            weight_decay: 0.1,
            ..AdamConfig::adamw()
        },
    )
    .unwrap()
}

/// This rank's rows of [`data`] on `device`, in `parts` consecutive micro-batches.
fn rank_rows(pg: &ProcessGroup, parts: usize, device: Device) -> Vec<(Tensor, Tensor)> {
    let (x, y) = data(ROWS);
    let share = ROWS / pg.size() / parts;
    let first = pg.rank() * share * parts;
    let rows = |t: &Tensor, at: usize| t.narrow(0, at, share).unwrap().to(device).unwrap();
    (0..parts)
        .map(|k| {
            let at = first + k * share;
            (rows(&x, at), rows(&y, at))
        })
        .collect()
}

fn loss_backward<M: Forward>(m: &M, x: &Tensor, y: &Tensor) {
    let out = m.forward(x).unwrap();
    let y = y.to_dtype(out.dtype()).unwrap();
    mse_loss(&out, &y, Reduction::Mean).unwrap().backward().unwrap();
}

fn ddp_mlp(pg: &ProcessGroup, device: Device) -> DistributedDataParallel<Sequential> {
    let mut m = mlp();
    fill_params(&m, 0.0);
    m.to_device(device).unwrap();
    DistributedDataParallel::new(m, DdpOptions::new().process_group(pg.clone())).unwrap()
}

fn full_grads(m: &Sequential) -> Vec<Vec<f64>> {
    m.parameters()
        .iter()
        .map(|p| p.grad().unwrap().to_vec_f64().unwrap())
        .collect()
}

/// DDP + AdamW on [`mlp`]: the gradients of the first backward and the parameters after
/// [`STEPS`] steps.
fn ddp_reference(pg: &ProcessGroup, device: Device) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let ddp = ddp_mlp(pg, device);
    let mut opt = adamw(ddp.module().parameters());
    let [(x, y)] = <[_; 1]>::try_from(rank_rows(pg, 1, device)).unwrap();
    let mut first = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad().unwrap();
        loss_backward(&ddp, &x, &y);
        if step == 0 {
            first = full_grads(ddp.module());
        }
        opt.step().unwrap();
    }
    let params = ddp
        .module()
        .parameters()
        .iter()
        .map(|p| p.to_vec_f64().unwrap())
        .collect();
    (first, params)
}

#[derive(Clone, Copy, Debug)]
enum Wrap {
    /// One unit over the whole model.
    Whole,
    /// One unit per Linear, chained in a Sequential.
    PerLayer,
    /// The first two Linears as units, then the root over them and the last Linear.
    Nested,
}

/// A Linear of `i` → `o` features in f64 with the given weight and bias.
fn linear(i: usize, o: usize, w: &Tensor, b: &Tensor) -> Linear {
    let mut layer = Linear::new(i, o, Device::Cpu).unwrap();
    layer.to_dtype(DType::F64).unwrap();
    let _g = no_grad();
    layer.weight.copy_(w).unwrap();
    layer.bias.as_ref().unwrap().copy_(b).unwrap();
    layer
}

/// [`mlp`] with [`fill_params`]' values, sharded as `wrap` says: the model and its units, whose
/// own parameters in order are the model's.
fn sharded_mlp(
    mesh: &DeviceMesh,
    wrap: Wrap,
    options: FullyShardOptions,
) -> (Sequential, Vec<FSDPModule<Sequential>>) {
    let m = mlp();
    fill_params(&m, 0.0);
    let v = m.parameters();
    let dims = [(4, 8), (8, 8), (8, 3)];
    let layer = |k: usize| linear(dims[k].0, dims[k].1, &v[2 * k], &v[2 * k + 1]);
    match wrap {
        Wrap::Whole => {
            let whole = fully_shard(m, mesh, options).unwrap();
            (Sequential::new().with(whole.clone()), vec![whole])
        }
        Wrap::PerLayer => {
            let units: Vec<_> = (0..3)
                .map(|k| fully_shard(Sequential::new().with(layer(k)), mesh, options).unwrap())
                .collect();
            let seq = Sequential::new()
                .with(units[0].clone())
                .with(Tanh::new())
                .with(units[1].clone())
                .with(Tanh::new())
                .with(units[2].clone());
            (seq, units)
        }
        Wrap::Nested => {
            let inner: Vec<_> = (0..2)
                .map(|k| fully_shard(Sequential::new().with(layer(k)), mesh, options).unwrap())
                .collect();
            let body = Sequential::new()
                .with(inner[0].clone())
                .with(Tanh::new())
                .with(inner[1].clone())
                .with(Tanh::new())
                .with(layer(2));
            let root = fully_shard(body, mesh, options).unwrap();
            // The root keeps its parameters gathered after forward, as PyTorch's does.
            assert!(!root.reshard_after_forward());
            assert_eq!(inner[0].reshard_after_forward(), options.reshard_after_forward);
            let units = vec![inner[0].clone(), inner[1].clone(), root.clone()];
            (Sequential::new().with(root), units)
        }
    }
}

/// The full tensors of the units' shards' gradients, in the model's parameter order.
fn gathered_grads(units: &[FSDPModule<Sequential>]) -> Vec<Vec<f64>> {
    let mut out = Vec::new();
    for unit in units {
        for (_, d) in unit.named_dtensors().unwrap() {
            let g = d.local_tensor().grad().unwrap();
            let mesh = d.device_mesh();
            assert_eq!(
                d.local_range(),
                chunk_range(d.dims()[0], mesh.size(), mesh.get_local_rank())
            );
            let g = DTensor::from_local(g, mesh, d.placements(), Some(d.shape().clone())).unwrap();
            out.push(g.full_tensor().unwrap().to_vec_f64().unwrap());
        }
    }
    out
}

fn fsdp_run(
    pg: &ProcessGroup,
    wrap: Wrap,
    reshard_after_forward: bool,
    device: Device,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let mesh = DeviceMesh::new(pg.clone());
    let options = FullyShardOptions {
        reshard_after_forward,
        ..Default::default()
    };
    let (model, units) = sharded_mlp(&mesh, wrap, options);
    assert_eq!(model.parameters().len(), 6, "{wrap:?}");
    let mut opt = adamw(model.parameters());
    let [(x, y)] = <[_; 1]>::try_from(rank_rows(pg, 1, device)).unwrap();
    let mut first = Vec::new();
    for step in 0..STEPS {
        opt.zero_grad().unwrap();
        loss_backward(&model, &x, &y);
        if step == 0 {
            first = gathered_grads(&units);
        }
        opt.step().unwrap();
    }
    let mut params = Vec::new();
    for unit in &units {
        for (_, d) in unit.named_dtensors().unwrap() {
            params.push(d.full_tensor().unwrap().to_vec_f64().unwrap());
        }
    }
    (first, params)
}

fn close(a: &[Vec<f64>], b: &[Vec<f64>], rtol: f64, what: &str) {
    let wrap = |v: &[Vec<f64>]| v.iter().cloned().map(Some).collect::<Vec<_>>();
    assert_close_tol(&wrap(a), &wrap(b), rtol * 1e-2, rtol, what);
}

/// On 1 rank (the gathered buffer is the whole model, and an inner unit's output is dropped
/// after the outer forward: its buffer must still be filled again in backward), on 2 and on 4
/// (uneven shards, and an empty one: the last Linear's 3 rows give rank 3 none), the shards' gradients are DDP's rows and the parameters after AdamW steps DDP's, for
/// the module sharded whole (resharded after forward: gathered again in backward),
/// layer by layer (kept gathered until backward) and nested. Within 1e-11 relative: bitwise
/// on 2 ranks, but on 4 the reduce-scatter and DDP's all-reduce add the ranks' gradients in
/// different orders (the last bit differs).
#[test]
fn fully_shard_matches_ddp_with_adamw() {
    for n in [1, 2, 4] {
        run_ranks(n, T, |pg| fsdp_matches_ddp(&pg, Device::Cpu));
    }
}

/// The body of [`fully_shard_matches_ddp_with_adamw`] on `device` (the NCCL tests run it on
/// GPUs, where the mesh's device is the group's GPU).
pub(crate) fn fsdp_matches_ddp(pg: &ProcessGroup, device: Device) {
    let (grads, params) = ddp_reference(pg, device);
    for (wrap, reshard) in [(Wrap::Whole, true), (Wrap::PerLayer, false), (Wrap::Nested, true)] {
        let what = format!("rank {} of {}, {wrap:?}, reshard {reshard}", pg.rank(), pg.size());
        let (g, p) = fsdp_run(pg, wrap, reshard, device);
        close(&g, &grads, 1e-11, &format!("gradients, {what}"));
        close(&p, &params, 1e-11, &format!("parameters, {what}"));
    }
}

/// Each element's bits, for a bf16 or f16 tensor.
fn half_bits(t: &Tensor) -> Vec<u16> {
    match t.dtype() {
        DType::BF16 => t
            .to_vec::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::F16 => t
            .to_vec::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        d => panic!("{d} is not a half dtype"),
    }
}

/// f32 shards gathered in `param_dtype` bf16 or f16 on 1 and 4 ranks (uneven shards; rank 3
/// holds none of the last layer's 3 rows): the full parameters are the f32 parameters cast as
/// `to_dtype` casts them, bit for bit.
#[test]
fn fully_shard_gathers_f32_shards_in_half_dtypes_as_to_dtype_casts() {
    for n in [1, 4] {
        run_ranks(n, T, |pg| gathers_in_half_dtypes(&pg));
    }
}

/// The body of [`fully_shard_gathers_f32_shards_in_half_dtypes_as_to_dtype_casts`] on the
/// group's device (the NCCL tests run it on GPUs, where the gather packs the shards with one
/// `foreach_copy_` of casts, Note [Foreach copies] in ember-core). The parameters' values are
/// pseudo-random f32 bit patterns: NaNs, infinities, subnormals, values that round to
/// infinity or on a tie in the half dtypes among them.
pub(crate) fn gathers_in_half_dtypes(pg: &ProcessGroup) {
    let mesh = DeviceMesh::new(pg.clone());
    let device = mesh.device_type();
    for half in [DType::BF16, DType::F16] {
        let mut m = mlp();
        m.to_dtype(DType::F32).unwrap();
        {
            let _g = no_grad();
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            for p in m.parameters() {
                let v: Vec<f32> = (0..p.numel())
                    .map(|_| {
                        state = state
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        f32::from_bits((state >> 32) as u32)
                    })
                    .collect();
                p.copy_(&Tensor::from_vec(v, p.dims(), Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        let expected: Vec<Vec<u16>> = m
            .parameters()
            .iter()
            .map(|p| half_bits(&p.to(device).unwrap().to_dtype(half).unwrap()))
            .collect();
        let options = FullyShardOptions {
            mp_policy: MixedPrecisionPolicy {
                param_dtype: Some(half),
                reduce_dtype: None,
            },
            ..Default::default()
        };
        let unit = fully_shard(m, &mesh, options).unwrap();
        let full = unit.forward_with(|m| Ok(m.parameters())).unwrap();
        assert_eq!(full.len(), expected.len());
        for (i, (f, e)) in full.iter().zip(&expected).enumerate() {
            assert_eq!((f.dtype(), f.device()), (half, device), "parameter {i}");
            assert!(
                half_bits(f) == *e,
                "rank {} of {}: parameter {i} in {half}",
                pg.rank(),
                pg.size()
            );
        }
    }
}

/// Gradient accumulation: a backward without sync then one with it gives the gradients of
/// DDP's `no_sync` then a synchronized backward (the sum over both micro-batches, averaged
/// over ranks). A mixed-precision policy computes in f32 (and reduces in f32) while the shards
/// and their gradients stay f64.
#[test]
fn fully_shard_accumulates_without_sync_and_computes_in_param_dtype() {
    run_ranks(2, T, |pg| {
        let batches = rank_rows(&pg, 2, Device::Cpu);
        let ddp = ddp_mlp(&pg, Device::Cpu);
        {
            let _no_sync = ddp.no_sync();
            loss_backward(&ddp, &batches[0].0, &batches[0].1);
        }
        loss_backward(&ddp, &batches[1].0, &batches[1].1);
        let expected = full_grads(ddp.module());

        let mesh = DeviceMesh::new(pg.clone());
        let (model, units) = sharded_mlp(&mesh, Wrap::Nested, FullyShardOptions::default());
        units.iter().for_each(|u| u.set_requires_gradient_sync(false));
        loss_backward(&model, &batches[0].0, &batches[0].1);
        assert!(model.parameters().iter().all(|p| p.grad().is_none()));
        units.iter().for_each(|u| u.set_requires_gradient_sync(true));
        loss_backward(&model, &batches[1].0, &batches[1].1);
        close(&gathered_grads(&units), &expected, 1e-11, "accumulated gradients");

        // param_dtype f32: the output is f32, the shards' gradients f64 and near DDP's.
        let [(x, y)] = <[_; 1]>::try_from(rank_rows(&pg, 1, Device::Cpu)).unwrap();
        let f32_policy = FullyShardOptions {
            mp_policy: MixedPrecisionPolicy {
                param_dtype: Some(DType::F32),
                reduce_dtype: None,
            },
            ..Default::default()
        };
        let (model, units) = sharded_mlp(&mesh, Wrap::PerLayer, f32_policy);
        assert_eq!(model.forward(&x).unwrap().dtype(), DType::F32);
        loss_backward(&model, &x, &y);
        assert!(model
            .parameters()
            .iter()
            .all(|p| p.grad().unwrap().dtype() == DType::F64));
        let ddp = ddp_mlp(&pg, Device::Cpu);
        loss_backward(&ddp, &x, &y);
        close(
            &gathered_grads(&units),
            &full_grads(ddp.module()),
            1e-4,
            "f32 gradients",
        );
    });
}

/// Parameters of two dtypes and a module without parameters are typed errors.
#[test]
fn fully_shard_refuses_what_it_cannot_shard() {
    run_ranks(1, T, |pg| {
        let mesh = DeviceMesh::new(pg.clone());
        let mut mixed = Linear::new(2, 2, Device::Cpu).unwrap();
        let bias = mixed.bias.take().unwrap().to_dtype(DType::F64).unwrap();
        mixed.bias = Some(bias.detach().requires_grad_(true).unwrap());
        let e = fully_shard(mixed, &mesh, FullyShardOptions::default())
            .err()
            .unwrap();
        assert!(
            matches!(&e, Error::InvalidArgument { msg, .. } if msg.contains("to_dtype")),
            "{e}"
        );
        assert!(fully_shard(Tanh::new(), &mesh, FullyShardOptions::default()).is_err());
        // A root whose every parameter belongs to an inner unit has nothing left to shard.
        let inner = fully_shard(
            Linear::new(2, 2, Device::Cpu).unwrap(),
            &mesh,
            FullyShardOptions::default(),
        )
        .unwrap();
        let e = fully_shard(Sequential::new().with(inner), &mesh, FullyShardOptions::default())
            .err()
            .unwrap();
        assert!(e.to_string().contains("no parameters"), "{e}");
    });
}

/// One AdamW step of `m` on the MSE of (`x`, `y`).
fn step<M: Forward>(m: &M, opt: &mut AdamW, x: &Tensor, y: &Tensor) {
    opt.zero_grad().unwrap();
    loss_backward(m, x, y);
    opt.step().unwrap();
}

/// The full tensors of the units' parameters, in the model's order.
fn gathered_params(units: &[FSDPModule<Sequential>]) -> Vec<Vec<f64>> {
    let mut out = Vec::new();
    for unit in units {
        for (_, d) in unit.named_dtensors().unwrap() {
            out.push(d.full_tensor().unwrap().to_vec_f64().unwrap());
        }
    }
    out
}

/// The model's and the optimizer's sharded state dicts in one (`optim.` before the latter's).
fn training_state(model: &Sequential, opt: &AdamW) -> Vec<(String, StateValue)> {
    let mut sd = get_model_state_dict(model).unwrap();
    for (k, v) in get_optimizer_state_dict(opt).unwrap() {
        sd.push((format!("optim.{k}"), v));
    }
    sd
}

/// A nested FSDP model and its AdamW state, saved with dcp on 2 ranks (each rank its own rows
/// of the parameters and of `exp_avg`, `exp_avg_sq`), load into an unsharded model and
/// optimizer in one process (the full values), and into a fresh sharded model and optimizer on
/// 2 ranks, which then trains on exactly as the original does.
#[test]
fn fully_shard_state_dicts_save_on_two_ranks_and_load_on_one_and_two() {
    let dir = std::env::temp_dir().join(format!("ember-fsdp-dcp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let saved = run_ranks(2, T, |pg| {
        let mesh = DeviceMesh::new(pg.clone());
        let [(x, y)] = <[_; 1]>::try_from(rank_rows(&pg, 1, Device::Cpu)).unwrap();
        let (model, units) = sharded_mlp(&mesh, Wrap::Nested, FullyShardOptions::default());
        let mut opt = adamw(model.parameters());
        step(&model, &mut opt, &x, &y);
        step(&model, &mut opt, &x, &y);
        let sd = training_state(&model, &opt);
        assert!(matches!(sd[0].1, StateValue::DTensor(_)), "{}", sd[0].0);
        dcp::save(&sd, &dir, Some(&pg)).unwrap();
        let names: Vec<String> = model.named_parameters().into_iter().map(|(k, _)| k).collect();
        let at_save = gathered_params(&units);

        // A fresh model (other values) and optimizer (one step made its state) load it all.
        let (model2, units2) = sharded_mlp(&mesh, Wrap::Nested, FullyShardOptions::default());
        let mut opt2 = adamw(model2.parameters());
        step(&model2, &mut opt2, &x, &y);
        let sd2 = training_state(&model2, &opt2);
        dcp::load(&sd2, &dir, Some(&pg)).unwrap();
        let optim: Vec<(String, Tensor)> = dcp::to_local_state(&sd2)
            .into_iter()
            .filter_map(|(k, t)| Some((k.strip_prefix("optim.")?.to_owned(), t)))
            .collect();
        opt2.load_state_dict(&optim).unwrap();
        assert_eq!(gathered_params(&units2), at_save);
        step(&model, &mut opt, &x, &y);
        step(&model2, &mut opt2, &x, &y);
        assert_eq!(gathered_params(&units2), gathered_params(&units));
        (names, at_save)
    });
    let (names, at_save) = saved[0].clone();

    // One process, no group: an unsharded mlp and AdamW (with state) under the same keys.
    let plain = mlp();
    let mut opt = adamw(plain.parameters());
    let (x, y) = data(ROWS);
    step(&plain, &mut opt, &x, &y);
    let mut sd: Vec<(String, StateValue)> = names
        .iter()
        .zip(plain.parameters())
        .map(|(k, p)| (k.clone(), StateValue::Tensor(p.detach())))
        .collect();
    for (k, t) in opt.state_dict() {
        sd.push((format!("optim.{k}"), StateValue::Tensor(t)));
    }
    dcp::load(&sd, &dir, None).unwrap();
    let loaded: Vec<Vec<f64>> = plain
        .parameters()
        .iter()
        .map(|p| p.to_vec_f64().unwrap())
        .collect();
    assert_eq!(loaded, at_save);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Linear of 4 → 3 features sharded on 2 ranks (rows 0-1 on rank 0, row 2 on rank 1), whose
/// rank-1 target holds inf in column 2: only rank 1's shard gets an inf gradient. A plain
/// GradScaler lets rank 0 step while rank 1 skips; the ShardedGradScaler skips both and backs
/// off both scales, then both step on a clean batch.
#[test]
fn sharded_grad_scaler_skips_every_rank_when_one_shard_overflows() {
    run_ranks(2, T, |pg| sharded_scaler_keeps_ranks_together(&pg, Device::Cpu));
}

/// The body of [`sharded_grad_scaler_skips_every_rank_when_one_shard_overflows`] on `device`
/// (2 ranks; the NCCL tests run it on two GPUs).
pub(crate) fn sharded_scaler_keeps_ranks_together(pg: &ProcessGroup, device: Device) {
    assert_eq!(pg.size(), 2);
    let mesh = DeviceMesh::new(pg.clone());
    let x = Tensor::ones([2usize, 4], DType::F32, device).unwrap();
    let mut bad = vec![0.5f32; 6];
    if pg.rank() == 1 {
        bad[2] = f32::INFINITY;
    }
    let bad = Tensor::from_vec(bad, [2, 3], Device::Cpu)
        .unwrap()
        .to(device)
        .unwrap();
    let clean = Tensor::full([2usize, 3], 0.5, DType::F32, device).unwrap();
    let values = |m: &FSDPModule<Linear>| -> Vec<Vec<f64>> {
        m.parameters().iter().map(|p| p.to_vec_f64().unwrap()).collect()
    };
    let scaled_step =
        |m: &FSDPModule<Linear>, opt: &mut AdamW, scaler: &mut ember_nn::amp::GradScaler, y: &Tensor| {
            opt.zero_grad().unwrap();
            let loss = mse_loss(&m.forward(&x).unwrap(), y, Reduction::Mean).unwrap();
            scaler.scale(&loss).unwrap().backward().unwrap();
            scaler.step(opt).unwrap();
            scaler.update().unwrap();
        };
    let make = || {
        let mut lin = Linear::new(4, 3, Device::Cpu).unwrap();
        fill_params(&lin, 0.0);
        lin.to_device(device).unwrap();
        let m = fully_shard(lin, &mesh, FullyShardOptions::default()).unwrap();
        let opt = adamw(m.parameters());
        (m, opt)
    };

    // The plain scaler: the ranks part.
    let (m, mut opt) = make();
    let before = values(&m);
    let mut plain = ember_nn::amp::GradScaler::new();
    scaled_step(&m, &mut opt, &mut plain, &bad);
    let finite = m.parameters().iter().all(|p| {
        p.grad()
            .unwrap()
            .to_vec_f64()
            .unwrap()
            .iter()
            .all(|v| v.is_finite())
    });
    assert_eq!(finite, pg.rank() == 0);
    assert_eq!(values(&m) == before, pg.rank() == 1);

    // The sharded scaler: both skip, both back off, then both step.
    let (m, mut opt) = make();
    let mut scaler = ShardedGradScaler::new(Some(pg.clone())).unwrap();
    scaled_step(&m, &mut opt, &mut scaler, &bad);
    assert_eq!(values(&m), before, "rank {}", pg.rank());
    assert_eq!(scaler.get_scale().unwrap(), 32768.0);
    scaled_step(&m, &mut opt, &mut scaler, &clean);
    assert_ne!(values(&m), before);
    assert_eq!(scaler.get_scale().unwrap(), 32768.0);
}

/// Clipping the shards' gradients by their global norm (ember_distributed::fsdp's
/// clip_grad_norm_) gives DDP's clipping of the full gradients (ember-nn's): the same total
/// norm on every rank, the same parameters after AdamW steps, for the 2-norm and the inf-norm.
#[test]
fn clip_grad_norm_of_shards_is_ddps_clip_of_full_gradients() {
    run_ranks(2, T, |pg| clip_matches_ddp(&pg, Device::Cpu));
}

/// The body of [`clip_grad_norm_of_shards_is_ddps_clip_of_full_gradients`] on `device` (the
/// NCCL tests run it on GPUs).
pub(crate) fn clip_matches_ddp(pg: &ProcessGroup, device: Device) {
    let mesh = DeviceMesh::new(pg.clone());
    let [(x, y)] = <[_; 1]>::try_from(rank_rows(pg, 1, device)).unwrap();
    for norm_type in [2.0, f64::INFINITY] {
        let ddp = ddp_mlp(pg, device);
        let mut opt = adamw(ddp.module().parameters());
        let (model, units) = sharded_mlp(&mesh, Wrap::Nested, FullyShardOptions::default());
        let mut fopt = adamw(model.parameters());
        for _ in 0..2 {
            opt.zero_grad().unwrap();
            loss_backward(&ddp, &x, &y);
            let expected =
                ember_nn::optim::clip_grad_norm_(&ddp.module().parameters(), 0.05, norm_type).unwrap();
            opt.step().unwrap();
            fopt.zero_grad().unwrap();
            loss_backward(&model, &x, &y);
            let total =
                ember_distributed::fsdp::clip_grad_norm_(&model.parameters(), 0.05, norm_type).unwrap();
            fopt.step().unwrap();
            let (t, e) = (total.item_f64().unwrap(), expected.item_f64().unwrap());
            assert!((t - e).abs() <= 1e-12 * e, "norm {norm_type}: {t} vs {e}");
            assert!(e > 0.05, "the test must clip");
        }
        let params: Vec<Vec<f64>> = ddp
            .module()
            .parameters()
            .iter()
            .map(|p| p.to_vec_f64().unwrap())
            .collect();
        close(
            &gathered_params(&units),
            &params,
            1e-11,
            &format!("clipped by the {norm_type}-norm"),
        );
    }
}

/// [`mlp`] that counts the calls of its forward.
struct Counted {
    inner: Sequential,
    calls: Arc<AtomicUsize>,
}

impl Module for Counted {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.inner.visit(prefix, f)
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> ember_core::Result<()>,
    ) -> ember_core::Result<()> {
        self.inner.visit_mut(prefix, f)
    }

    fn set_training(&self, training: bool) {
        self.inner.set_training(training)
    }

    fn is_training(&self) -> bool {
        self.inner.is_training()
    }
}

impl Forward for Counted {
    fn forward(&self, x: &Tensor) -> ember_core::Result<Tensor> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.forward(x)
    }
}

/// Note [Reshard after forward]: a resharded unit runs its module's forward once, frees the
/// gathered parameters its graph holds and gathers them again in backward (no recomputation),
/// also for a second backward over the same graph; its gradients are bitwise those of the
/// unit that keeps them gathered, and of DDP.
#[test]
fn resharded_units_gather_again_in_backward_instead_of_recomputing() {
    run_ranks(2, T, |pg| {
        let mesh = DeviceMesh::new(pg.clone());
        let [(x, y)] = <[_; 1]>::try_from(rank_rows(&pg, 1, Device::Cpu)).unwrap();
        let grads = |reshard_after_forward: bool| {
            let calls = Arc::new(AtomicUsize::new(0));
            let inner = mlp();
            fill_params(&inner, 0.0);
            let options = FullyShardOptions {
                reshard_after_forward,
                ..Default::default()
            };
            let unit = fully_shard(
                Counted {
                    inner,
                    calls: calls.clone(),
                },
                &mesh,
                options,
            )
            .unwrap();
            let out = unit.forward(&x).unwrap();
            let loss = mse_loss(&out, &y, Reduction::Mean).unwrap();
            loss.backward_with(None, true).unwrap();
            loss.backward_with(None, false).unwrap();
            assert_eq!(
                calls.load(Ordering::SeqCst),
                1,
                "one forward, reshard {reshard_after_forward}"
            );
            unit.named_dtensors()
                .unwrap()
                .iter()
                .map(|(_, d)| {
                    let g = d.local_tensor().grad().unwrap();
                    let g = DTensor::from_local(g, d.device_mesh(), d.placements(), Some(d.shape().clone()))
                        .unwrap();
                    g.full_tensor().unwrap().to_vec_f64().unwrap()
                })
                .collect::<Vec<_>>()
        };
        let (resharded, kept) = (grads(true), grads(false));
        assert_eq!(resharded, kept);
        // Two backward passes: twice DDP's gradients of one.
        let ddp = ddp_mlp(&pg, Device::Cpu);
        loss_backward(&ddp, &x, &y);
        let twice: Vec<Vec<f64>> = full_grads(ddp.module())
            .into_iter()
            .map(|g| g.iter().map(|v| 2.0 * v).collect())
            .collect();
        close(&resharded, &twice, 1e-12, "two backward passes against DDP");
    });
}
