//! PyTorch's "NLP From Scratch: Classifying Names with a Character-Level RNN": the tutorial's
//! own `RNN` module (`hidden = tanh(i2h(input) + h2h(hidden))`, `output = log_softmax(h2o(hidden))`)
//! whose `forward(input, hidden)` returns `(output, hidden)`, run over a name one one-hot letter
//! at a time, trained on one name per step with `NLLLoss` and the tutorial's hand-written SGD
//! update (`p.data.add_(p.grad.data, alpha=-learning_rate)`), then asked where names come from.
//!
//! The names are made up in the program from three "languages" of syllables, standing in for
//! the tutorial's files of surnames; 500 steps at a learning rate of 0.05 (the tutorial's:
//! 100,000 at 0.005).
//!
//! Run: `cargo run --release -p ember --example tutorial_rnn`

use ember::cuda;
use ember::nn::{Linear, LogSoftmax, NLLLoss};
use ember::prelude::*;
use std::time::Instant;

const LANGUAGES: [(&str, [&str; 8]); 3] = [
    ("Japanese", ["ka", "ki", "ko", "mi", "na", "ta", "ya", "shi"]),
    ("Russian", ["ov", "sky", "vich", "kov", "lev", "din", "pav", "zhu"]),
    ("Scottish", ["mac", "gor", "don", "ald", "son", "bell", "craig", "burn"]),
];

#[derive(Module)]
struct RNN {
    hidden_size: usize,
    i2h: Linear,
    h2h: Linear,
    h2o: Linear,
    softmax: LogSoftmax,
}

impl RNN {
    fn new(input_size: usize, hidden_size: usize, output_size: usize, device: Device) -> Result<RNN> {
        Ok(RNN {
            hidden_size,
            i2h: Linear::new(input_size, hidden_size, device)?,
            h2h: Linear::new(hidden_size, hidden_size, device)?,
            h2o: Linear::new(hidden_size, output_size, device)?,
            softmax: LogSoftmax::new(1),
        })
    }

    fn forward(&self, input: &Tensor, hidden: &Tensor) -> Result<(Tensor, Tensor)> {
        let hidden = (&self.i2h.forward(input)? + &self.h2h.forward(hidden)?)?.tanh()?;
        let output = self.softmax.forward(&self.h2o.forward(&hidden)?)?;
        Ok((output, hidden))
    }

    fn init_hidden(&self, device: Device) -> Result<Tensor> {
        Tensor::zeros([1, self.hidden_size], DType::F32, device)
    }
}

/// A name as `[letters, 1, 26]` one-hot rows (the tutorial's `lineToTensor`).
fn line_to_tensor(name: &str, device: Device) -> Result<Tensor> {
    let letters: Vec<i64> = name.bytes().map(|b| i64::from(b - b'a')).collect();
    Tensor::from_vec(letters, [name.len()], device)?.one_hot(26)?.to_dtype(DType::F32)?.unsqueeze(1)
}

/// `n` random names (two or three syllables of one language) with their language's index.
fn random_names(n: usize) -> Result<Vec<(String, usize)>> {
    let r = Tensor::randint(0, 1 << 20, [n, 5], Device::Cpu)?.to_vec::<i64>()?;
    Ok(r.chunks(5)
        .map(|r| {
            let language = r[0] as usize % LANGUAGES.len();
            let syllables = 2 + r[1] as usize % 2;
            (r[2..2 + syllables].iter().map(|&s| LANGUAGES[language].1[s as usize % 8]).collect(), language)
        })
        .collect())
}

/// The output after the last letter (the tutorial's `evaluate`).
fn evaluate(rnn: &RNN, line: &Tensor) -> Result<Tensor> {
    let mut hidden = rnn.init_hidden(line.device())?;
    let mut output = None;
    for i in 0..line.dims()[0] {
        let (o, h) = rnn.forward(&line.select(0, i as isize)?, &hidden)?;
        (output, hidden) = (Some(o), h);
    }
    Ok(output.expect("a name has letters"))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(0)?;
    let rnn = RNN::new(26, 128, LANGUAGES.len(), device)?;
    let criterion = NLLLoss::new();
    let learning_rate = 0.05;
    let (n_iters, print_every) = (500, 100);
    let (start, mut current_loss, mut average_losses) = (Instant::now(), 0.0, Vec::new());
    for (iter, (name, language)) in random_names(n_iters)?.into_iter().enumerate() {
        let category = Tensor::from_vec(vec![language as i64], [1], device)?;
        rnn.zero_grad()?;
        let output = evaluate(&rnn, &line_to_tensor(&name, device)?)?;
        let loss = criterion.forward(&output, &category)?;
        loss.backward()?;
        {
            let _no_grad = ember::no_grad();
            for p in rnn.parameters() {
                p.add_scaled_(&p.grad().expect("every parameter has a gradient"), -learning_rate)?;
            }
        }
        current_loss += loss.item_f64()?;
        if (iter + 1) % print_every == 0 {
            let guess = output.argmax(Some(1), false)?.item::<i64>()? as usize;
            let mark = if guess == language {
                "✓".to_string()
            } else {
                format!("✗ ({})", LANGUAGES[language].0)
            };
            let (done, secs) = (iter + 1, start.elapsed().as_secs_f64());
            println!(
                "{done} {}% ({secs:.1}s) {:.4} {name} / {} {mark}",
                100 * done / n_iters,
                loss.item_f64()?,
                LANGUAGES[guess].0
            );
            average_losses.push(current_loss / print_every as f64);
            current_loss = 0.0;
        }
    }
    println!("average loss per {print_every} names: {average_losses:.3?}");

    // Accuracy on names it has not seen, then the tutorial's `predict`.
    let _no_grad = ember::no_grad();
    let test = random_names(100)?;
    let mut correct = 0;
    for (name, language) in &test {
        let guess = evaluate(&rnn, &line_to_tensor(name, device)?)?.argmax(Some(1), false)?;
        correct += usize::from(guess.item::<i64>()? as usize == *language);
    }
    let accuracy = correct as f64 / test.len() as f64;
    println!("accuracy on {} new names: {:.1}%", test.len(), 100.0 * accuracy);
    for name in ["kovalev", "takashi", "macdougall"] {
        let scores = evaluate(&rnn, &line_to_tensor(name, device)?)?.to_vec::<f32>()?;
        let mut ranked: Vec<(f32, &str)> = scores.into_iter().zip(LANGUAGES.map(|l| l.0)).collect();
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
        println!("> {name}: {ranked:.2?}");
    }
    let (first, last) = (average_losses[0], average_losses[average_losses.len() - 1]);
    if !(last < 0.5 * first && accuracy > 0.8) {
        return Err(format!("did not learn: loss {first:.3} -> {last:.3}, accuracy {accuracy:.2}").into());
    }
    Ok(())
}
