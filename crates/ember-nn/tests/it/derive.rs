//! `#[derive(Module)]`: PyTorch's state-dict names and order from a struct's fields (`Vec`,
//! `Option`, arrays and tuple structs included), kinds from attributes, the mode reaching
//! every child, and a module whose forward takes and returns two tensors.

use ember_core::{DType, Device, Result, Tensor};
use ember_nn::functional::cross_entropy;
use ember_nn::{Forward, Linear, Module, ModuleExt, ReLU, Sequential, TensorKind, Training};

const CPU: Device = Device::Cpu;

/// Data of a type the derive knows nothing about: must be skipped.
#[derive(Debug, Clone)]
struct Notes {
    _text: String,
}

#[derive(Module)]
struct Everything {
    #[module(skip)]
    _notes: Notes,
    hidden: usize,
    head: Linear,
    scale: Tensor,
    #[module(buffer)]
    running: Tensor,
    blocks: Vec<Linear>,
    extra: Option<Linear>,
    missing: Option<Linear>,
    shift: Option<Tensor>,
    #[module(buffer)]
    counters: Vec<Tensor>,
    #[module(name = "final")]
    last: Sequential,
    pair: [ReLU; 2],
    training: Training,
}

fn everything() -> Result<Everything> {
    Ok(Everything {
        _notes: Notes {
            _text: "not a tensor".into(),
        },
        hidden: 3,
        head: Linear::new(3, 2, CPU)?,
        scale: Tensor::ones([2], DType::F32, CPU)?.requires_grad_(true)?,
        running: Tensor::zeros([2], DType::F32, CPU)?,
        blocks: vec![Linear::new(3, 3, CPU)?, Linear::new(3, 3, CPU)?],
        extra: Some(Linear::new(2, 2, CPU)?),
        missing: None,
        shift: Some(Tensor::zeros([2], DType::F32, CPU)?.requires_grad_(true)?),
        counters: vec![Tensor::zeros([1], DType::I64, CPU)?],
        last: Sequential::new().with(ReLU::new()).with(Linear::new(2, 1, CPU)?),
        pair: [ReLU::new(), ReLU::new()],
        training: Training::new(true),
    })
}

#[test]
fn derive_names_tensors_as_pytorch_state_dicts_do() -> Result<()> {
    let m = everything()?;
    assert_eq!(m.hidden, 3);
    let mut seen = Vec::new();
    m.visit("", &mut |name, _, kind| seen.push((name.to_owned(), kind)));
    let p = TensorKind::Parameter;
    let b = TensorKind::Buffer;
    // Own parameters, own buffers, then children, each in field order (Note [Visit order]).
    let expected = [
        ("scale", p),
        ("shift", p),
        ("running", b),
        ("counters.0", b),
        ("head.weight", p),
        ("head.bias", p),
        ("blocks.0.weight", p),
        ("blocks.0.bias", p),
        ("blocks.1.weight", p),
        ("blocks.1.bias", p),
        ("extra.weight", p),
        ("extra.bias", p),
        ("final.1.weight", p),
        ("final.1.bias", p),
    ];
    let expected: Vec<(String, TensorKind)> = expected.iter().map(|(n, k)| (n.to_string(), *k)).collect();
    assert_eq!(seen, expected);
    // Under a prefix, as a child of another module.
    let mut names = Vec::new();
    m.visit("model", &mut |name, _, _| names.push(name.to_owned()));
    assert_eq!(names[0], "model.scale");
    assert_eq!(m.num_parameters(), 2 + 2 + 8 + 2 * 12 + 6 + 3);
    Ok(())
}

#[test]
fn derive_visit_mut_moves_and_loads_every_tensor() -> Result<()> {
    let mut a = everything()?;
    let b = everything()?;
    a.to_dtype(DType::F64)?;
    let mut dtypes = Vec::new();
    a.visit("", &mut |name, t, _| dtypes.push((name.to_owned(), t.dtype())));
    assert!(dtypes.iter().all(|(n, d)| if n == "counters.0" {
        *d == DType::I64
    } else {
        *d == DType::F64
    }));
    // load_state_dict goes through visit_mut: every tensor, nested ones included, is copied.
    let mut a = everything()?;
    let missing = a
        .load_state_dict(&b.state_dict(), true)
        .map_err(|e| ember_core::Error::invalid("load", e.to_string()))?;
    assert!(missing.missing_keys.is_empty() && missing.unexpected_keys.is_empty());
    assert_eq!(
        a.blocks[1].weight.to_vec::<f32>()?,
        b.blocks[1].weight.to_vec::<f32>()?
    );
    assert_eq!(
        a.extra.as_ref().unwrap().bias.as_ref().unwrap().to_vec::<f32>()?,
        b.extra.as_ref().unwrap().bias.as_ref().unwrap().to_vec::<f32>()?
    );
    Ok(())
}

#[test]
fn derive_tells_every_child_the_mode() -> Result<()> {
    let m = everything()?;
    m.eval();
    assert!(!m.is_training() && !m.training.get());
    assert!(!m.head.is_training() && !m.blocks[1].is_training() && !m.extra.as_ref().unwrap().is_training());
    assert!(!m.last.is_training() && !m.pair[1].is_training());
    m.train();
    assert!(m.blocks[0].is_training() && m.pair[0].is_training());

    // Without a `training` field the mode is the first child's.
    let t = Tuple(Linear::new(2, 2, CPU)?, vec![ReLU::new()]);
    assert!(t.is_training());
    t.eval();
    assert!(!t.is_training() && !t.1[0].is_training());
    Ok(())
}

/// A tuple struct: children named by position, as `nn.Sequential`'s.
#[derive(Module)]
struct Tuple(Linear, Vec<ReLU>);

#[test]
fn derive_names_tuple_fields_by_position() -> Result<()> {
    let t = Tuple(Linear::new(2, 2, CPU)?, vec![ReLU::new()]);
    let names: Vec<String> = t.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.weight", "0.bias"]);
    Ok(())
}

/// A generic module: the derive keeps the struct's bounds.
#[derive(Module, Clone)]
struct Residual<M: Forward> {
    inner: M,
}

impl<M: Forward> Forward for Residual<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.add(&self.inner.forward(x)?)
    }
}

#[test]
fn derive_handles_generic_modules_that_sequential_chains() -> Result<()> {
    let seq = Sequential::new()
        .with(Residual {
            inner: Linear::new(4, 4, CPU)?,
        })
        .with(ReLU::new());
    let names: Vec<String> = seq.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["0.inner.weight", "0.inner.bias"]);
    let y = seq.forward(&Tensor::randn([3, 4], DType::F32, CPU)?)?;
    assert_eq!(y.dims(), [3, 4]);
    Ok(())
}

/// The PyTorch tutorial's character RNN: `forward(input, hidden) -> (output, hidden)`, a
/// module with two inputs and two outputs (issue 10, part 2).
#[derive(Module)]
struct CharRnn {
    i2h: Linear,
    h2o: Linear,
    hidden_size: usize,
}

impl CharRnn {
    fn new(input: usize, hidden: usize, output: usize) -> Result<CharRnn> {
        Ok(CharRnn {
            i2h: Linear::new(input + hidden, hidden, CPU)?,
            h2o: Linear::new(hidden, output, CPU)?,
            hidden_size: hidden,
        })
    }

    fn forward(&self, input: &Tensor, hidden: &Tensor) -> Result<(Tensor, Tensor)> {
        let hidden = self
            .i2h
            .forward(&Tensor::cat(&[input.clone(), hidden.clone()], 1)?)?
            .tanh()?;
        let output = self.h2o.forward(&hidden)?.log_softmax(1)?;
        Ok((output, hidden))
    }

    fn init_hidden(&self) -> Result<Tensor> {
        Tensor::zeros([1, self.hidden_size], DType::F32, CPU)
    }
}

#[test]
fn a_module_with_two_inputs_and_outputs_trains_through_its_own_forward() -> Result<()> {
    let rnn = CharRnn::new(5, 8, 3)?;
    let mut hidden = rnn.init_hidden()?;
    let mut output = None;
    for step in 0..4 {
        let x = Tensor::from_vec(vec![step as i64], [1], CPU)?
            .one_hot(5)?
            .to_dtype(DType::F32)?;
        let (o, h) = rnn.forward(&x, &hidden)?;
        hidden = h;
        output = Some(o);
    }
    let target = Tensor::from_vec(vec![2i64], [1], CPU)?;
    let loss = cross_entropy(&output.unwrap(), &target)?;
    loss.backward()?;
    let named = rnn.named_parameters();
    let names: Vec<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["i2h.weight", "i2h.bias", "h2o.weight", "h2o.bias"]);
    for (name, p) in &named {
        let g = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
        assert!(
            g.abs()?.sum_all()?.item::<f32>()? > 0.0,
            "{name}'s gradient is zero"
        );
    }
    Ok(())
}
