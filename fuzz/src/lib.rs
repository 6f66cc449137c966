//! What the fuzz targets share: the modules that state dicts and checkpoints are loaded into,
//! and (in `bin/make_seeds.rs`) the seed corpus made by ember's own writers.
//!
//! Each target in `fuzz_targets/` feeds libFuzzer's bytes to one reader of outside bytes and
//! asserts little beyond that the reader returns: a panic, an abort (stack overflow), a hang
//! (libFuzzer's `-timeout`) or an allocation far beyond the input ([`GuardedAlloc`]) is what
//! libFuzzer reports, with the input that caused it.

use ember::amp::{GradScaler, GradScalerConfig};
use ember::nn::optim::{Adam, AdamConfig, SgdConfig, SGD};
use ember::nn::{BatchNorm1d, Embedding, Forward, LayerNorm, Linear, Module, LSTM};
use ember::{Device, Result, Tensor};
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

const CPU: Device = Device::Cpu;

/// A model with one of each kind of state a state dict holds: weights and biases, an i64
/// buffer (`num_batches_tracked`), running statistics, an embedding table, recurrent weights.
#[derive(Module)]
pub struct Zoo {
    pub fc: Linear,
    pub bn: BatchNorm1d,
    pub emb: Embedding,
    pub norm: LayerNorm,
    pub rnn: LSTM,
}

impl Zoo {
    pub fn new() -> Result<Zoo> {
        Ok(Zoo {
            fc: Linear::new(4, 3, CPU)?,
            bn: BatchNorm1d::new(3, CPU)?,
            emb: Embedding::new(5, 2, CPU)?,
            norm: LayerNorm::new(&[3], CPU)?,
            rnn: LSTM::new(2, 2, CPU)?,
        })
    }
}

/// The model of the `checkpoint` target: `ember train`'s checkpoints hold any `Forward`; a
/// small MLP keeps each run fast.
#[derive(Module)]
pub struct Mlp {
    pub fc1: Linear,
    pub fc2: Linear,
}

impl Mlp {
    pub fn new() -> Result<Mlp> {
        Ok(Mlp {
            fc1: Linear::new(4, 3, CPU)?,
            fc2: Linear::new(3, 2, CPU)?,
        })
    }
}

impl Forward for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.forward(&self.fc1.forward(x)?.relu()?)
    }
}

/// Adam as `ember train` builds it.
pub fn adam(params: Vec<Tensor>) -> Result<Adam> {
    Adam::new(params, AdamConfig::default())
}

/// SGD with momentum (it has a state per parameter).
pub fn sgd(params: Vec<Tensor>) -> Result<SGD> {
    SGD::new(
        params,
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..Default::default()
        },
    )
}

/// An enabled GradScaler (its state dict is empty when disabled).
pub fn scaler() -> Result<GradScaler> {
    GradScaler::with_config(GradScalerConfig::default())
}

/// Bytes one allocation may take without the input holding them: more than this beyond
/// [`PER_INPUT_BYTE`] times the input means a reader allocated what the input merely claims.
const SLACK: usize = 64 << 20;
/// Bytes of output one input byte may legitimately become: deflate's largest expansion is
/// 1032:1 (a gzipped IDX file), with a little room.
const PER_INPUT_BYTE: usize = 1100;

/// The largest allocation allowed while the current input runs (`usize::MAX` outside one).
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// Starts an input of `len` bytes: from now on, an allocation larger than
/// `64 MiB + 1100 × len` aborts the process (libFuzzer reports the input as a crash). Without
/// a sanitizer libFuzzer's `-malloc_limit_mb` does nothing, and a claimed size allocated with
/// `vec![0; n]` never touches its pages, so the RSS limit would not see it either.
pub fn input(len: usize) {
    LIMIT.store(
        SLACK.saturating_add(PER_INPUT_BYTE.saturating_mul(len)),
        Ordering::Relaxed,
    );
}

/// The system allocator, refusing one allocation past [`input`]'s limit by aborting.
pub struct GuardedAlloc;

impl GuardedAlloc {
    fn check(size: usize) {
        let limit = LIMIT.load(Ordering::Relaxed);
        if size > limit {
            // No allocation from here on: the message is a fixed string.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                b"ember-fuzz: an allocation exceeds 64 MiB + 1100 x the input's length: the reader allocated what the input claims\n",
            );
            std::process::abort();
        }
    }
}

// SAFETY: every method forwards to `System` with the caller's layout and pointer unchanged,
// after a check that only reads an atomic; `System` upholds `GlobalAlloc`'s contract.
unsafe impl GlobalAlloc for GuardedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Self::check(layout.size());
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Self::check(new_size);
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged (see the impl).
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// A fuzz target over a reader: installs [`GuardedAlloc`] and sets the allocation limit for
/// each input before running `$body` on it.
#[macro_export]
macro_rules! reader_target {
    (|$data:ident| $body:block) => {
        #[global_allocator]
        static ALLOC: $crate::GuardedAlloc = $crate::GuardedAlloc;

        ::libfuzzer_sys::fuzz_target!(|$data: &[u8]| {
            $crate::input($data.len());
            $body
        });
    };
}
