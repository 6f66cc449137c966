//! Autograd engine: accumulation, graph retention, grad modes, leaves, hooks, `grad`, and the
//! in-place version check.

use crate::common::t64;
use ember_core::{autograd, DType, Device, Error, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn leaf(v: &[f64]) -> Tensor {
    t64(v, &[v.len()], Device::Cpu).requires_grad_(true).unwrap()
}

fn ones(n: usize) -> Tensor {
    Tensor::ones([n], DType::F64, Device::Cpu).unwrap()
}

#[test]
fn gradients_accumulate_across_backward_calls() {
    let x = leaf(&[1.0, 2.0]);
    for _ in 0..2 {
        let y = x.mul(&x).unwrap(); // dy/dx = 2x
        y.backward_with(Some(&ones(2)), false).unwrap();
    }
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![4.0, 8.0]);
    x.set_grad(None).unwrap();
    assert!(x.grad().is_none());
}

#[test]
fn shared_subexpressions_sum_their_gradients() {
    let x = leaf(&[3.0]);
    let y = x.mul_scalar(2.0).unwrap();
    let z = y.mul(&y).unwrap().add(&y).unwrap(); // z = 4x² + 2x, dz/dx = 8x + 2
    z.backward().unwrap();
    assert_eq!(x.grad().unwrap().item::<f64>().unwrap(), 26.0);
}

#[test]
fn second_backward_needs_retain_graph() {
    let x = leaf(&[1.0]);
    let y = x.mul(&x).unwrap();
    y.backward_with(None, true).unwrap();
    y.backward().unwrap();
    assert_eq!(x.grad().unwrap().item::<f64>().unwrap(), 4.0);
    let err = y.backward().unwrap_err();
    assert!(
        err.to_string()
            .contains("backward through the graph a second time"),
        "{err}"
    );
}

#[test]
fn non_scalar_backward_needs_a_gradient() {
    let x = leaf(&[1.0, 2.0]);
    let err = x.mul_scalar(2.0).unwrap().backward().unwrap_err();
    assert!(err.to_string().contains("only for scalar outputs"), "{err}");
    let err = Tensor::ones([1], DType::F64, Device::Cpu)
        .unwrap()
        .backward()
        .unwrap_err();
    assert!(err.to_string().contains("does not require grad"), "{err}");
}

#[test]
fn no_grad_and_enable_grad_scopes() {
    let x = leaf(&[1.0]);
    {
        let _g = autograd::no_grad();
        assert!(!autograd::is_grad_enabled());
        let y = x.mul_scalar(2.0).unwrap();
        assert!(!y.requires_grad());
        {
            let _e = autograd::enable_grad();
            assert!(x.mul_scalar(2.0).unwrap().requires_grad());
        }
        assert!(!autograd::is_grad_enabled());
    }
    assert!(autograd::is_grad_enabled());
    // Grad mode is per thread.
    let _g = autograd::no_grad();
    std::thread::spawn(|| assert!(autograd::is_grad_enabled()))
        .join()
        .unwrap();
}

#[test]
fn stored_gradients_own_dense_memory() {
    // sum's backward hands back a broadcast view; the leaf must not keep it.
    let x = t64(&[1.0, 2.0, 3.0, 4.0], &[2, 2], Device::Cpu)
        .requires_grad_(true)
        .unwrap();
    x.sum_all().unwrap().backward().unwrap();
    let g = x.grad().unwrap();
    assert!(g.is_contiguous());
    g.add_scalar_(1.0).unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0; 4]);
    // The gradient given to backward is not aliased by `.grad`.
    let y = leaf(&[1.0, 2.0]);
    let w = ones(2);
    y.add_scalar(0.0).unwrap().backward_with(Some(&w), false).unwrap();
    y.grad().unwrap().mul_scalar_(5.0).unwrap();
    assert_eq!(w.to_vec::<f64>().unwrap(), vec![1.0, 1.0]);
}

#[test]
fn leaves_detach_and_retain_grad() {
    let x = leaf(&[2.0]);
    assert!(x.is_leaf());
    let y = x.mul(&x).unwrap();
    assert!(!y.is_leaf());
    assert_eq!(y.grad_fn_name(), Some("mul"));
    let d = y.detach();
    assert!(!d.requires_grad() && d.is_leaf() && d.shares_storage_with(&y));
    y.retain_grad().unwrap();
    let z = y.mul_scalar(3.0).unwrap();
    z.backward().unwrap();
    assert_eq!(y.grad().unwrap().item::<f64>().unwrap(), 3.0);
    assert_eq!(x.grad().unwrap().item::<f64>().unwrap(), 12.0);
    assert!(y.requires_grad_(false).is_err());
    let ints = Tensor::zeros([2], DType::I64, Device::Cpu).unwrap();
    assert!(matches!(
        ints.requires_grad_(true).unwrap_err(),
        Error::UnsupportedDType { .. }
    ));
}

#[test]
fn hooks_see_and_replace_gradients() {
    let x = leaf(&[1.0, 2.0]);
    let calls = Arc::new(AtomicUsize::new(0));
    let seen = calls.clone();
    let handle = x
        .register_hook(move |g| {
            seen.fetch_add(1, Ordering::SeqCst);
            Ok(Some(g.mul_scalar(10.0)?))
        })
        .unwrap();
    // x is used twice: the hook sees the summed gradient once, as in PyTorch.
    let y = x.mul_scalar(2.0).unwrap().add(&x).unwrap();
    y.backward_with(Some(&ones(2)), false).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![30.0, 30.0]);
    handle.remove();
    x.set_grad(None).unwrap();
    x.mul_scalar(2.0)
        .unwrap()
        .backward_with(Some(&ones(2)), false)
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![2.0, 2.0]);
}

#[test]
fn hooks_on_intermediate_tensors_change_what_flows_upstream() {
    let x = leaf(&[1.0, 2.0]);
    let h = x.mul_scalar(3.0).unwrap();
    h.register_hook(|g| Ok(Some(g.mul_scalar(0.5)?))).unwrap();
    h.mul_scalar(2.0)
        .unwrap()
        .backward_with(Some(&ones(2)), false)
        .unwrap();
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 3.0]);
}

/// A hook lives as long as the graph, not the tensor it was registered on (PyTorch keeps it on
/// the grad_fn): an intermediate handed on and dropped before backward still has it run; and
/// its handle still removes it.
#[test]
fn hooks_on_dropped_intermediate_tensors_still_run() {
    let x = leaf(&[1.0, 2.0]);
    let ran = Arc::new(AtomicUsize::new(0));
    let make = |ran: Arc<AtomicUsize>| {
        let h = x.mul_scalar(3.0).unwrap();
        let handle = h
            .register_hook(move |g| {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(Some(g.mul_scalar(0.5)?))
            })
            .unwrap();
        (h.mul_scalar(2.0).unwrap(), handle) // `h` itself is dropped here
    };
    let (y, _kept) = make(ran.clone());
    y.backward_with(Some(&ones(2)), false).unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1);
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 3.0]);
    x.set_grad(None).unwrap();
    let (y, handle) = make(ran.clone());
    handle.remove();
    y.backward_with(Some(&ones(2)), false).unwrap();
    assert_eq!(ran.load(Ordering::SeqCst), 1, "a removed hook ran");
    assert_eq!(x.grad().unwrap().to_vec::<f64>().unwrap(), vec![6.0, 6.0]);
}

#[test]
fn grad_returns_gradients_without_touching_dot_grad() {
    let a = leaf(&[1.0, 2.0]);
    let b = leaf(&[3.0, 4.0]);
    let y = a.mul(&b).unwrap();
    let g = autograd::grad(&[y], &[a.clone(), b.clone()], Some(&[ones(2)]), false).unwrap();
    assert_eq!(g[0].as_ref().unwrap().to_vec::<f64>().unwrap(), vec![3.0, 4.0]);
    assert_eq!(g[1].as_ref().unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0]);
    assert!(a.grad().is_none() && b.grad().is_none());
    let c = leaf(&[0.0]);
    let y = a.mul_scalar(2.0).unwrap();
    let g = autograd::grad(&[y], &[c], Some(&[ones(2)]), false).unwrap();
    assert!(g[0].is_none(), "an unused input gets no gradient");
}

#[test]
fn modifying_a_saved_tensor_fails_backward() {
    let x = leaf(&[1.0, 2.0]);
    let y = x.mul_scalar(2.0).unwrap();
    let z = y.mul(&y).unwrap(); // saves y
    {
        let _g = autograd::no_grad();
        y.add_scalar_(1.0).unwrap();
    }
    let err = z.backward_with(Some(&ones(2)), false).unwrap_err();
    assert!(matches!(err, Error::InplaceModified { op: "mul", .. }), "{err}");
    assert!(err.to_string().contains("modified by an in-place operation"));
}

/// Records the names of the leaves whose post-accumulate-grad hooks ran, in order.
fn record_post_hooks(leaves: &[(&str, &Tensor)]) -> Arc<std::sync::Mutex<Vec<String>>> {
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    for (name, t) in leaves {
        let (log, name) = (log.clone(), name.to_string());
        t.register_post_accumulate_grad_hook(move |_| {
            log.lock().unwrap().push(name.clone());
            Ok(())
        })
        .unwrap();
    }
    log
}

#[test]
fn post_accumulate_grad_hooks_see_the_stored_gradient() {
    let w = leaf(&[1.0, 2.0]);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = seen.clone();
    let handle = w
        .register_post_accumulate_grad_hook(move |p| {
            s.lock().unwrap().push(p.grad().unwrap().to_vec::<f64>()?);
            Ok(())
        })
        .unwrap();
    // Used twice: the hook runs once, after both contributions are summed in .grad.
    w.mul(&w)
        .unwrap()
        .add(&w)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap(); // 2w + 1
    w.mul_scalar(3.0).unwrap().sum_all().unwrap().backward().unwrap(); // accumulates 3
    assert_eq!(*seen.lock().unwrap(), vec![vec![3.0, 5.0], vec![6.0, 8.0]]);
    // autograd::grad stores no .grad, so runs no such hook.
    let y = w.mul_scalar(2.0).unwrap().sum_all().unwrap();
    autograd::grad(&[y], &[w.clone()], None, false).unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2);
    handle.remove();
    w.sum_all().unwrap().backward().unwrap();
    assert_eq!(seen.lock().unwrap().len(), 2, "removed");
    // A leaf the graph reaches but whose gradient a backward rule left out (as zero): the
    // hooks run once, `.grad` unchanged.
    let v = leaf(&[1.0]);
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    v.register_post_accumulate_grad_hook(move |p| {
        assert!(p.grad().is_none());
        r.fetch_add(1, Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    let out = autograd::custom_op("zero_grad_op", &[&v], v.detach(), |_, _| Ok(vec![None]));
    out.sum_all().unwrap().backward().unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert!(v.grad().is_none());
    // Only leaves that require grad take one; a failing hook fails backward.
    let y = w.mul_scalar(2.0).unwrap();
    assert!(matches!(
        y.register_post_accumulate_grad_hook(|_| Ok(())),
        Err(Error::Autograd(_))
    ));
    assert!(ones(2).register_post_accumulate_grad_hook(|_| Ok(())).is_err());
    w.register_post_accumulate_grad_hook(|_| Err(Error::invalid("hook", "refused")))
        .unwrap();
    assert!(matches!(
        w.sum_all().unwrap().backward(),
        Err(Error::InvalidArgument { op: "hook", .. })
    ));
}

#[test]
fn ready_nodes_run_latest_recorded_first_and_leaves_as_soon_as_ready() {
    // A chain: the gradients become ready from the last layer back.
    let x = leaf(&[0.5, -1.0]);
    let (w1, w2, w3) = (leaf(&[1.0, 2.0]), leaf(&[3.0, 4.0]), leaf(&[5.0, 6.0]));
    let log = record_post_hooks(&[("w1", &w1), ("w2", &w2), ("w3", &w3), ("x", &x)]);
    let y = x
        .mul(&w1)
        .unwrap()
        .tanh()
        .unwrap()
        .mul(&w2)
        .unwrap()
        .mul(&w3)
        .unwrap();
    y.sum_all().unwrap().backward().unwrap();
    // x and w1 become ready together (inputs of one node): in the node's input order.
    assert_eq!(*log.lock().unwrap(), ["w3", "w2", "x", "w1"]);

    // Two branches joined as `b + a` with `b` recorded after `a`: the later branch runs
    // first, whatever the order of the join's inputs (a stack would have run `a` first).
    for _ in 0..3 {
        let (wa, wb) = (leaf(&[1.0]), leaf(&[2.0]));
        let log = record_post_hooks(&[("wa", &wa), ("wb", &wb)]);
        let x = leaf(&[3.0]);
        let a = x.mul(&wa).unwrap().exp().unwrap();
        let b = x.mul(&wb).unwrap().exp().unwrap();
        b.add(&a).unwrap().sum_all().unwrap().backward().unwrap();
        assert_eq!(*log.lock().unwrap(), ["wb", "wa"]);
    }
}

#[test]
fn queued_callbacks_run_once_backward_ends() {
    let (w1, w2) = (leaf(&[1.0]), leaf(&[2.0]));
    let log = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let (l, w1c) = (log.clone(), w1.clone());
    // The hook of w2 (ready first) queues a callback; it runs after w1's gradient is stored.
    w2.register_post_accumulate_grad_hook(move |_| {
        let (l, w1c) = (l.clone(), w1c.clone());
        l.lock().unwrap().push("hook w2".into());
        autograd::queue_callback(move || {
            l.lock().unwrap().push(format!(
                "callback sees w1.grad = {:?}",
                w1c.grad().map(|g| g.to_vec::<f64>().unwrap())
            ));
            let l2 = l.clone();
            // A callback may queue another: it runs in the same loop.
            autograd::queue_callback(move || Ok(l2.lock().unwrap().push("second callback".into())))
        })
    })
    .unwrap();
    let y = w1.mul_scalar(2.0).unwrap().mul(&w2).unwrap().sum_all().unwrap();
    y.backward().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        [
            "hook w2",
            "callback sees w1.grad = Some([4.0])",
            "second callback"
        ]
    );
    // Outside a backward pass there is nothing to queue on.
    assert!(matches!(
        autograd::queue_callback(|| Ok(())),
        Err(Error::Autograd(_))
    ));

    // A failing callback fails backward; a failed backward drops what it queued.
    let w = leaf(&[1.0]);
    let fired = Arc::new(AtomicUsize::new(0));
    let f = fired.clone();
    let h = w
        .register_post_accumulate_grad_hook(move |_| {
            let f = f.clone();
            autograd::queue_callback(move || {
                f.fetch_add(1, Ordering::SeqCst);
                Err(Error::invalid("callback", "refused"))
            })
        })
        .unwrap();
    assert!(matches!(
        w.sum_all().unwrap().backward(),
        Err(Error::InvalidArgument { op: "callback", .. })
    ));
    assert_eq!(fired.load(Ordering::SeqCst), 1);
    h.remove();
    let bad = w
        .register_post_accumulate_grad_hook(|_| {
            autograd::queue_callback(|| panic!("a callback of a failed backward ran"))?;
            Err(Error::invalid("hook", "refused"))
        })
        .unwrap();
    assert!(w.sum_all().unwrap().backward().is_err());
    bad.remove();
    w.sum_all().unwrap().backward().unwrap();
}

#[test]
fn a_gradient_nothing_else_holds_is_stored_without_a_copy() {
    // AccumulateGrad keeps a fresh, unshared gradient as `.grad` (PyTorch's "steal" path):
    // with `.grad` released by zero_grad, a copy there would cost a pass over every gradient
    // of every training step.
    let x = leaf(&[1.0, 2.0, 3.0]);
    let fresh = Arc::new(AtomicUsize::new(0));
    let seen = fresh.clone();
    x.register_hook(move |g| {
        let replacement = g.mul_scalar(1.0)?;
        seen.store(replacement.data_ptr(), Ordering::SeqCst);
        Ok(Some(replacement))
    })
    .unwrap();
    x.mul_scalar(2.0).unwrap().sum_all().unwrap().backward().unwrap();
    let grad = x.grad().unwrap();
    assert_eq!(grad.to_vec::<f64>().unwrap(), [2.0, 2.0, 2.0]);
    assert_eq!(
        grad.data_ptr(),
        fresh.load(Ordering::SeqCst),
        "the gradient was copied"
    );
    // A gradient the caller still holds is copied, so that `.grad` owns its memory.
    let y = leaf(&[1.0, 2.0]);
    let given = ones(2);
    y.backward_with(Some(&given), false).unwrap();
    assert_ne!(y.grad().unwrap().data_ptr(), given.data_ptr());
    assert_eq!(y.grad().unwrap().to_vec::<f64>().unwrap(), [1.0, 1.0]);
}

/// The order in which backward reaches the links of two chains of `mul_scalar`, each chain
/// recorded whole before the other, with fresh node numbering per chain or not.
fn chain_order(fresh: bool) -> Vec<String> {
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    // The links stay alive (a hook lives with its tensor); the last is the chain's output.
    let chain = |x: &Tensor, name: &'static str| {
        let mut links = vec![x.clone()];
        for i in 0..3 {
            let t = links[i].mul_scalar(2.0).unwrap();
            let o = order.clone();
            t.register_hook(move |_| {
                o.lock().unwrap().push(format!("{name}{i}"));
                Ok(None)
            })
            .unwrap();
            links.push(t);
        }
        links
    };
    let (a, b) = (leaf(&[1.0]), leaf(&[2.0]));
    let (ya, yb) = match fresh {
        true => (
            autograd::with_fresh_sequence_nr(|| chain(&a, "a")),
            autograd::with_fresh_sequence_nr(|| chain(&b, "b")),
        ),
        false => (chain(&a, "a"), chain(&b, "b")),
    };
    ya[3].add(&yb[3]).unwrap().sum_all().unwrap().backward().unwrap();
    assert_eq!(a.grad().unwrap().to_vec::<f64>().unwrap(), [8.0]);
    let order = order.lock().unwrap().clone();
    order
}

#[test]
fn fresh_sequence_numbers_interleave_branches_recorded_one_after_the_other() {
    // Recorded last, run first: chain b entirely, then chain a.
    assert_eq!(chain_order(false), ["b2", "b1", "b0", "a2", "a1", "a0"]);
    // Numbered alike, the chains' nodes tie and run in turn (DataParallel's replicas).
    assert_eq!(chain_order(true), ["a2", "b2", "a1", "b1", "a0", "b0"]);
}

/// Note [Swapping storages]: a tensor autograd saved, freed by a swap with an empty tensor and
/// filled again by a swap with a copy of its values (FSDP's gathered parameters), gives the
/// gradients of an untouched run: no version error, the same values.
#[test]
fn saved_tensors_freed_and_refilled_by_storage_swaps_give_the_same_gradients() {
    let run = |swap: bool| -> (Vec<f64>, Vec<f64>) {
        let w = leaf(&[1.0, -2.0, 3.0, 0.5]);
        let x = leaf(&[0.25, 4.0]);
        // A non-leaf view of w's values, as a gathered parameter is of the shards.
        let full = w.mul_scalar(2.0).unwrap().reshape([2, 2]).unwrap();
        let y = x.reshape([1, 2]).unwrap().matmul(&full).unwrap().tanh().unwrap();
        if swap {
            let keep = full.detach().deep_clone().unwrap();
            let empty = Tensor::empty([0], DType::F64, Device::Cpu).unwrap();
            full.swap_storage_(&empty).unwrap();
            // The elements went to `empty`'s storage, whose own view still reads none.
            assert_eq!(empty.to_vec_f64().unwrap(), Vec::<f64>::new());
            full.swap_storage_(&keep).unwrap();
        }
        y.sum_all().unwrap().backward().unwrap();
        (
            w.grad().unwrap().to_vec_f64().unwrap(),
            x.grad().unwrap().to_vec_f64().unwrap(),
        )
    };
    assert_eq!(run(true), run(false));
    let a = Tensor::zeros([2], DType::F64, Device::Cpu).unwrap();
    let b = Tensor::zeros([2], DType::F32, Device::Cpu).unwrap();
    let err = a.swap_storage_(&b).unwrap_err().to_string();
    assert!(
        err.contains("only storages of one dtype and device swap"),
        "{err}"
    );
}
