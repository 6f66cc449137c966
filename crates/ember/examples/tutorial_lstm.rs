//! PyTorch's "Sequence Models and Long Short-Term Memory Networks": the `LSTMTagger`
//! (`Embedding`, an `LSTM` run as `lstm(embeds, (h0, c0))`, a `Linear` to tag space and
//! `log_softmax`) learning part-of-speech tags for the tutorial's two sentences with `NLLLoss`
//! and SGD, printing the tag scores before and after training.
//!
//! Run: `cargo run --release -p ember --example tutorial_lstm`

use ember::cuda;
use ember::nn::optim::{SgdConfig, SGD};
use ember::nn::{Embedding, Linear, NLLLoss, LSTM};
use ember::prelude::*;

const TRAINING_DATA: [(&str, &str); 2] =
    [("The dog ate the apple", "DET NN V DET NN"), ("Everybody read that book", "NN V DET NN")];
const TAGS: [&str; 3] = ["DET", "NN", "V"];
const EMBEDDING_DIM: usize = 6;
const HIDDEN_DIM: usize = 6;

#[derive(Module)]
struct LSTMTagger {
    hidden_dim: usize,
    word_embeddings: Embedding,
    lstm: LSTM,
    hidden2tag: Linear,
}

impl LSTMTagger {
    fn new(
        embedding_dim: usize,
        hidden_dim: usize,
        vocab_size: usize,
        tagset_size: usize,
        device: Device,
    ) -> Result<Self> {
        Ok(LSTMTagger {
            hidden_dim,
            word_embeddings: Embedding::new(vocab_size, embedding_dim, device)?,
            lstm: LSTM::new(embedding_dim, hidden_dim, device)?,
            hidden2tag: Linear::new(hidden_dim, tagset_size, device)?,
        })
    }

    /// The zero `(h0, c0)`, each `[num_layers, batch, hidden]`.
    fn init_hidden(&self, device: Device) -> Result<(Tensor, Tensor)> {
        let zeros = || Tensor::zeros([1, 1, self.hidden_dim], DType::F32, device);
        Ok((zeros()?, zeros()?))
    }

    /// Tag scores `[words, tags]` for a sentence of word indices, and the final `(h, c)`.
    fn forward(&self, sentence: &Tensor, (h0, c0): &(Tensor, Tensor)) -> Result<(Tensor, (Tensor, Tensor))> {
        let len = sentence.dims()[0];
        let embeds = self.word_embeddings.forward(sentence)?;
        let (lstm_out, hidden) = self.lstm.forward_with(&embeds.view((len, 1, -1))?, Some((h0, c0)))?;
        let tag_space = self.hidden2tag.forward(&lstm_out.view((len, -1))?)?;
        Ok((tag_space.log_softmax(1)?, hidden))
    }
}

/// The indices of `words` in `vocabulary` (the tutorial's `prepare_sequence`).
fn prepare_sequence(words: &str, vocabulary: &[&str], device: Device) -> Result<Tensor> {
    let idxs: Vec<i64> =
        words.split(' ').map(|w| vocabulary.iter().position(|v| *v == w).unwrap() as i64).collect();
    let len = idxs.len();
    Tensor::from_vec(idxs, [len], device)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let device = if cuda::is_available() { Device::cuda() } else { Device::Cpu };
    ember::manual_seed(1)?;
    let mut words: Vec<&str> = Vec::new(); // word_to_ix: a word's index is its position
    for word in TRAINING_DATA.iter().flat_map(|(sentence, _)| sentence.split(' ')) {
        if !words.contains(&word) {
            words.push(word);
        }
    }

    let model = LSTMTagger::new(EMBEDDING_DIM, HIDDEN_DIM, words.len(), TAGS.len(), device)?;
    let loss_function = NLLLoss::new();
    let mut optimizer = SGD::new(model.parameters(), SgdConfig { lr: 0.1, ..Default::default() })?;
    let tag_scores = |model: &LSTMTagger| -> Result<Tensor> {
        let _no_grad = ember::no_grad();
        let inputs = prepare_sequence(TRAINING_DATA[0].0, &words, device)?;
        Ok(model.forward(&inputs, &model.init_hidden(device)?)?.0)
    };
    println!("tag scores before training:\n{}", tag_scores(&model)?);

    let mut losses = Vec::new();
    for epoch in 0..300 {
        let mut epoch_loss = 0.0;
        for (sentence, tags) in TRAINING_DATA {
            model.zero_grad()?;
            let sentence_in = prepare_sequence(sentence, &words, device)?;
            let targets = prepare_sequence(tags, &TAGS, device)?;
            let (tag_scores, _) = model.forward(&sentence_in, &model.init_hidden(device)?)?;
            let loss = loss_function.forward(&tag_scores, &targets)?;
            loss.backward()?;
            optimizer.step()?;
            epoch_loss += loss.item_f64()?;
        }
        if epoch % 50 == 0 || epoch == 299 {
            println!("epoch {epoch:3}: loss {epoch_loss:.4}");
        }
        losses.push(epoch_loss);
    }

    // The element i,j is the score of tag j for word i; the highest should be the right tag.
    let scores = tag_scores(&model)?;
    println!("tag scores after training:\n{scores}");
    let predicted: Vec<&str> =
        scores.argmax(Some(1), false)?.to_vec::<i64>()?.iter().map(|&t| TAGS[t as usize]).collect();
    println!("{:?} -> {predicted:?}", TRAINING_DATA[0].0);
    if predicted.join(" ") != TRAINING_DATA[0].1 || losses[299] > 0.5 * losses[0] {
        return Err(format!("did not learn the tags: loss {:.3} -> {:.3}", losses[0], losses[299]).into());
    }
    Ok(())
}
