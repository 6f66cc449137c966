//! `checkpoint::checkpoint(&module, &x)`: a borrowed module checkpointed inside a model's own
//! `forward` gives the gradients of the plain run (dropout included) to the input and to the
//! original module's parameters, on every device.
//!
//! The two runs draw their dropout masks from the default generators after the same
//! `manual_seed`, which other tests of this binary draw from concurrently, so the test runs its
//! body in a process of its own (`common::in_own_process`).

use crate::common::{devices, in_own_process};
use ember_core::{DType, Result, Tensor};
use ember_nn::checkpoint::checkpoint;
use ember_nn::{Dropout, Forward, Linear, Module, ModuleExt};

#[derive(Module, Clone)]
struct Block {
    fc1: Linear,
    dropout: Dropout,
    fc2: Linear,
}

impl Forward for Block {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2
            .forward(&self.dropout.forward(&self.fc1.forward(x)?.tanh()?)?)
    }
}

#[derive(Module)]
struct Model {
    block: Block,
    checkpointed: bool,
}

impl Forward for Model {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // `self.block` is borrowed, as in PyTorch's `checkpoint(self.block, x)`.
        if self.checkpointed {
            checkpoint(&self.block, x)
        } else {
            self.block.forward(x)
        }
    }
}

/// The input's gradient and every parameter's, after one backward.
fn gradients(model: &Model, x: &Tensor) -> Result<Vec<Vec<f32>>> {
    model.zero_grad()?;
    let x = x.detach().requires_grad_(true)?;
    ember_core::manual_seed(7)?; // every device's generator: the same dropout masks
    model.forward(&x)?.square()?.sum_all()?.backward()?;
    let mut grads = vec![x.grad().expect("the input's gradient").to_vec::<f32>()?];
    for p in model.parameters() {
        grads.push(p.grad().expect("a parameter's gradient").to_vec::<f32>()?);
    }
    Ok(grads)
}

#[test]
fn a_borrowed_module_checkpoints_with_the_plain_gradients() {
    in_own_process(
        "checkpoint_modules::a_borrowed_module_checkpoints_with_the_plain_gradients",
        || checkpointed_gradients_equal_plain().unwrap(),
    );
}

fn checkpointed_gradients_equal_plain() -> Result<()> {
    for device in devices() {
        ember_core::manual_seed(0)?;
        let mut model = Model {
            block: Block {
                fc1: Linear::new(6, 16, device)?,
                dropout: Dropout::new(0.3)?,
                fc2: Linear::new(16, 3, device)?,
            },
            checkpointed: false,
        };
        let x = Tensor::randn([5, 6], DType::F32, device)?;
        let plain = gradients(&model, &x)?;
        model.checkpointed = true;
        let checkpointed = gradients(&model, &x)?;
        assert_eq!(plain.len(), 5, "input and four parameters");
        for (a, b) in plain.iter().zip(&checkpointed) {
            assert_eq!(a, b, "{device}: checkpointed gradients differ");
        }
        assert!(
            plain[0].iter().any(|&g| g != 0.0),
            "{device}: a zero gradient proves nothing"
        );
    }
    Ok(())
}
