//! Containers and layers are `Clone` (Note [Container clones]) and switch mode through `&self`
//! (`Training`): what `nn.DataParallel(nn.Sequential(..))`, `checkpoint(block, x)` on a
//! Sequential and `model.eval()` in an evaluation function taking `&model` need.

use ember_core::{DType, Device, Error, Tensor};
use ember_nn::checkpoint::checkpoint;
use ember_nn::*;

const CPU: Device = Device::Cpu;

fn mlp() -> Sequential {
    Sequential::new()
        .with(Linear::new(4, 8, CPU).unwrap())
        .with(ReLU::new())
        .with(Dropout::new(0.5).unwrap())
        .with(Linear::new(8, 2, CPU).unwrap())
}

fn assert_clone<T: Clone>() {}

#[test]
fn every_built_in_layer_and_container_is_clone() {
    assert_clone::<Sequential>();
    assert_clone::<ModuleList>();
    assert_clone::<Linear>();
    assert_clone::<Conv2d>();
    assert_clone::<BatchNorm2d>();
    assert_clone::<LayerNorm>();
    assert_clone::<Embedding>();
    assert_clone::<LSTM>();
    assert_clone::<GRU>();
    assert_clone::<MultiheadAttention>();
    assert_clone::<TransformerEncoder>();
    assert_clone::<Transformer>();
    assert_clone::<Dropout>();
    assert_clone::<CrossEntropyLoss>();
}

#[test]
fn a_cloned_sequential_shares_parameters_and_keeps_its_own_structure() {
    let a = mlp();
    let mut b = a.clone();
    assert_eq!(b.len(), 4);
    let (pa, pb) = (a.parameters(), b.parameters());
    assert_eq!(pa.len(), pb.len());
    assert!(pa.iter().zip(&pb).all(|(x, y)| x.shares_storage_with(y)));
    // Replacing the clone's tensors (as DataParallel's replicas do) leaves the original alone.
    b.visit_mut("", &mut |_, t, _| {
        *t = t.detach().deep_clone()?;
        Ok(())
    })
    .unwrap();
    assert!(!a.parameters()[0].shares_storage_with(&b.parameters()[0]));
    // Modes are per clone.
    b.eval();
    assert!(a.is_training() && !b.is_training());
    assert!(!b.get(2).unwrap().is_training());
}

#[test]
fn a_boxed_child_is_shared_and_replacing_its_tensors_is_a_typed_error() {
    let mut a = Sequential::new();
    a.push_boxed(Box::new(Linear::new(2, 2, CPU).unwrap()));
    let b = a.clone();
    assert!(a.get_mut(0).is_none(), "shared with b");
    let e = a.visit_mut("", &mut |_, _, _| Ok(())).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("push_boxed"),
        "{e}"
    );
    drop(b);
    assert!(a.get_mut(0).is_some());
    assert!(a.visit_mut("", &mut |_, _, _| Ok(())).is_ok());
}

#[test]
fn module_list_clones_too() {
    let mut list = ModuleList::new();
    list.push(Linear::new(3, 3, CPU).unwrap())
        .push(LayerNorm::new(&[3], CPU).unwrap());
    let copy = list.clone();
    assert_eq!(copy.len(), 2);
    assert_eq!(copy.parameters().len(), list.parameters().len());
}

/// PyTorch's `def evaluate(model): model.eval(); ...` with the model borrowed shared.
fn evaluate(model: &Sequential, x: &Tensor) -> ember_core::Result<Tensor> {
    model.eval();
    let _g = ember_core::no_grad();
    let y = model.forward(x);
    model.train();
    y
}

#[test]
fn eval_and_train_take_a_shared_reference() {
    let model = mlp();
    let x = Tensor::ones([16, 4], DType::F32, CPU).unwrap();
    // In evaluation mode dropout is off: two calls agree.
    let (a, b) = (evaluate(&model, &x).unwrap(), evaluate(&model, &x).unwrap());
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    assert!(model.is_training());
    assert!(model.iter().all(|m| m.is_training()));
}

#[test]
fn a_sequential_block_can_be_checkpointed() {
    let block = Sequential::new()
        .with(Linear::new(4, 4, CPU).unwrap())
        .with(ReLU::new());
    let x = Tensor::ones([2, 4], DType::F32, CPU)
        .unwrap()
        .requires_grad_(true)
        .unwrap();
    let y = checkpoint(&block, &x).unwrap();
    assert_eq!(
        y.to_vec::<f32>().unwrap(),
        block.forward(&x).unwrap().to_vec::<f32>().unwrap()
    );
    y.sum_all().unwrap().backward().unwrap();
    assert!(block.parameters()[0].grad().is_some() && x.grad().is_some());
}
