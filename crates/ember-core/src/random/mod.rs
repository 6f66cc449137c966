//! Random numbers: a counter-based Philox4x32-10 [`Generator`] whose whole state is
//! `(seed, offset)`, the process-wide default generator of each device, and the seeding
//! functions of `torch.random` ([`manual_seed`], [`seed`], [`initial_seed`], [`get_rng_state`],
//! [`set_rng_state`]). Random tensor creation and in-place fills are in `random/tensor.rs` and
//! the block function in `cpu/philox.rs` (re-exported as [`philox`]); the op enum
//! ([`Distribution`]) and the generator state ([`RngState`]) are the backends' vocabulary
//! (`backend/op.rs`), the kernels are `cpu/random.rs` and `cuda_backend/random.rs` +
//! `kernels/random.cu`.
//!
//! Note [Philox stream]: how `(seed, offset, element index i)` becomes a value. Any backend
//! (the CPU kernels here, a CUDA kernel later) must compute exactly this, so that one seed
//! gives the same tensor on every device and for every thread count.
//!
//! 1. Block `b` (a u64) of seed `s` is `philox4x32_10(counter, key)` with
//!    `key = [s as u32, (s >> 32) as u32]` and `counter = [b as u32, (b >> 32) as u32, 0, 0]`;
//!    its four output words are `x0..x3`.
//! 2. A draw of `n` elements with `E` elements per block (table below) reads blocks
//!    `offset, offset + 1, ..., offset + ceil(n / E) - 1`: element `i` (row-major index in the
//!    result) reads block `offset + i / E` at slot `s = i % E`. Afterwards the generator's
//!    offset is `offset + ceil(n / E)` (wrapping). A draw of 0 elements consumes nothing.
//! 3. Per distribution (`u24(x) = (x >> 8) * 2^-24`, `join(lo, hi) = hi << 32 | lo` as u64):
//!
//!    | draw | dtype | E | element at slot `s` |
//!    |------|-------|---|---------------------|
//!    | uniform `[lo, hi)` | f32 | 4 | `u = (x_s >> 8) * 2^-24`; `lo + u * (hi - lo)` in f32 |
//!    | uniform | f16 | 4 | `u = (x_s >> 21) * 2^-11`; as f32, then rounded once to f16 |
//!    | uniform | bf16 | 4 | `u = (x_s >> 24) * 2^-8`; as f32, then rounded once to bf16 |
//!    | uniform | f64 | 2 | `u = (join(x_2s, x_2s+1) >> 11) * 2^-53`; `lo + u * (hi - lo)` in f64 |
//!    | normal | f32/f16/bf16 | 4 | pair `p = s / 2`: `u1 = ((x_2p >> 8) + 1) * 2^-24` in (0, 1], `u2 = u24(x_2p+1)`; Box-Muller below; even `s` takes `z0`, odd `s` takes `z1` |
//!    | normal | f64 | 2 | `u1 = ((join(x0, x1) >> 11) + 1) * 2^-53`, `u2 = (join(x2, x3) >> 11) * 2^-53`; slot 0 takes `z0`, slot 1 `z1` |
//!    | bernoulli(p) | any | 4 | `1` if `(u24(x_s) as f64) < p` else `0` (p per element for a probability tensor) |
//!    | randint `[lo, hi)`, `r = hi - lo <= 2^32` | i64 | 4 | `lo + (x_s mod r)` |
//!    | randint, `r > 2^32` | i64 | 2 | `lo + (join(x_2s, x_2s+1) mod r)` (wrapping i64 add) |
//!    | randperm(n) | i64 | 2 | key `k_s = join(x_2s, x_2s+1)`; the result lists `0..n` sorted by `(k_i, i)` ascending |
//!
//!    In the uniform rows `lo` and `hi` are first cast to the compute type (f32 or f64), and a
//!    result that rounds to `hi` in the dtype becomes `lo` (as PyTorch's CUDA kernel), so
//!    values stay in `[lo, hi)`.
//!    Box-Muller is computed in f64: `z0 = r cos θ`, `z1 = r sin θ` with `r = sqrt(-2 ln u1)`,
//!    `θ = 2π u2`; then `mean + std * z` in f64, rounded once to the dtype. Every `a + b * c`
//!    above is two separately rounded operations, never a fused multiply-add (CUDA code must
//!    use `__fmul_rn`/`__fadd_rn` or build with `-fmad=false`). Uniform bits are
//!    exact integer arithmetic and reproduce bit for bit anywhere; normals depend on the
//!    accuracy of f64 `ln`/`sin`/`cos` (correctly rounded in practice on glibc and CUDA's
//!    double-precision functions, so f32 normals agree; f64 normals may differ in the last ulp).
//!
//! Because every element's value is a function of `(seed, offset, i)` only, the CPU kernels
//! split the output into chunks of whole blocks and run them on rayon in any order.
//!
//! Default generators: one per [`Device`], created on first use (CUDA devices included, before
//! any CUDA backend exists, so a seed set now also applies to GPUs used later). They start from
//! [`DEFAULT_SEED`] (PyTorch's default) until [`manual_seed`] reseeds all of them.
//!
//! Note [Philox under graph capture]: a CUDA graph replays its kernels with the arguments they
//! were captured with, so a draw that passed `(seed, offset)` by value would draw the same
//! numbers at every replay. As PyTorch's `CUDAGeneratorImpl` (`philox_cuda_state`,
//! `capture_prologue`, `replay_prologue`), a generator keeps, per GPU it has captured on, two
//! u64 in device memory, the seed and an offset base, and a draw hands the backend a
//! [`PhiloxState`] ([`Generator::reserve_draw`]):
//! - eagerly, [`PhiloxState::Value`]: the `(seed, offset)` by value, and the host offset
//!   advances by the draw's blocks, as always;
//! - between [`Generator::begin_capture`] and [`Generator::end_capture`],
//!   [`PhiloxState::Device`]: pointers to the seed and the offset base, plus the draw's offset
//!   within the graph (the blocks the graph's earlier draws consumed); the host offset does not
//!   move. Kernels read both through one helper (`philox_seed_offset` in
//!   `kernels/prelude.cuh`), so eager and captured launches share every kernel;
//! - `end_capture` returns the graph's whole increment (its draws' blocks), and before each
//!   replay [`Generator::replay_prologue`] writes the seed and the current host offset to the
//!   device (a copy on the current stream, ordered before the replay launched after it on that
//!   stream) and advances the host offset by that increment.
//!
//! So each replay draws new numbers, exactly those eager execution would draw from the same
//! state: element `i` of a draw at graph offset `o` reads block `base + o + i / E`, which is
//! what an eager draw reads when the generator is at `base + o`. `begin_capture` also writes the
//! current seed and offset, so a region run between the two calls without a stream capture draws
//! what it would draw eagerly (how the tests check the device path). Rules: call
//! `begin_capture` and `replay_prologue` outside any stream capture (they enqueue copies from
//! the host); replays of graphs that share a generator must be ordered on one stream, since
//! they share the offset base; `randperm` (computed on the host) and [`Generator::reserve`]
//! (the state by value, for custom kernels run eagerly) cannot be captured.

#![deny(unsafe_code)]

/// The counter-based generator itself, computed by the CPU backend (`cpu/philox.rs`).
pub use crate::cpu::philox;
mod tensor;

pub use crate::backend::op::{Distribution, PhiloxState};

use crate::storage::Storage;
use crate::{DType, Device, Error, Result};
use std::collections::HashMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The seed of a generator nobody has seeded (PyTorch's `default_rng_seed_val`).
pub const DEFAULT_SEED: u64 = 67_280_421_310_721;

/// The whole state of a [`Generator`] (defined with the backends' vocabulary, which draws at it).
pub use crate::backend::op::RngState;

/// A Philox4x32-10 random number generator whose state is `(seed, offset)` (`torch.Generator`).
///
/// It is `Send + Sync`: concurrent draws each reserve their own counter blocks. A generator is
/// not tied to a device: the same state produces the same numbers on any device. `Clone`
/// copies the state (the copy then advances independently).
pub struct Generator {
    state: Mutex<GenState>,
}

/// A generator's state behind its lock: `(seed, offset)` and what graph capture needs (Note
/// [Philox under graph capture]).
struct GenState {
    rng: RngState,
    capture: Option<Capture>,
    /// Per GPU captured on: the seed and the offset base, two u64 (as i64) in device memory.
    slots: Vec<(usize, Storage)>,
}

/// A capture in progress.
#[derive(Debug, Clone, Copy)]
struct Capture {
    device: usize,
    ptrs: CapturePhilox,
    /// Blocks the draws recorded so far consumed: the next draw's offset within the graph.
    consumed: u64,
}

/// Device addresses of a generator's Philox seed and offset base on one GPU, what the random
/// kernels of a captured graph read (Note [Philox under graph capture]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapturePhilox {
    /// One u64: the seed.
    pub seed_ptr: u64,
    /// One u64: the offset of the graph's first draw, rewritten before every replay.
    pub offset_ptr: u64,
}

impl Generator {
    /// A generator seeded with `seed`, at offset 0.
    pub fn new(seed: u64) -> Generator {
        Generator {
            state: Mutex::new(GenState {
                rng: RngState { seed, offset: 0 },
                capture: None,
                slots: Vec::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, GenState> {
        // The state is written whole under the lock; a poisoned lock still holds a valid one.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reseeds with `seed` and rewinds the offset to 0 (`Generator.manual_seed`).
    pub fn manual_seed(&self, seed: u64) -> &Generator {
        self.lock().rng = RngState { seed, offset: 0 };
        self
    }

    /// Reseeds from a non-deterministic source and returns the new seed (`Generator.seed`).
    pub fn seed(&self) -> u64 {
        let s = nondeterministic_seed();
        self.manual_seed(s);
        s
    }

    /// The seed this generator was last seeded with (`Generator.initial_seed`).
    pub fn initial_seed(&self) -> u64 {
        self.lock().rng.seed
    }

    /// The current `(seed, offset)` (`Generator.get_state`).
    pub fn get_state(&self) -> RngState {
        self.lock().rng
    }

    /// Restores a state saved with [`Generator::get_state`] (`Generator.set_state`).
    pub fn set_state(&self, state: RngState) {
        self.lock().rng = state;
    }

    /// Reserves `blocks` counter blocks for one draw: returns the state to draw with and
    /// advances the offset past them (see Note [Philox stream]). For custom kernels that take
    /// the state by value, run eagerly: it ignores a capture in progress (the values would be
    /// baked into the graph); tensor ops use [`Generator::reserve_draw`].
    pub fn reserve(&self, blocks: u64) -> RngState {
        let mut st = self.lock();
        let at = st.rng;
        st.rng.offset = st.rng.offset.wrapping_add(blocks);
        at
    }

    /// Reserves `blocks` counter blocks for one draw and says where its kernels find the
    /// state: by value, advancing the offset as [`Generator::reserve`], or, while capturing,
    /// in device memory at the draw's offset within the graph (Note [Philox under graph
    /// capture]).
    pub fn reserve_draw(&self, blocks: u64) -> PhiloxState {
        let mut st = self.lock();
        match &mut st.capture {
            Some(c) => {
                let at = c.consumed;
                c.consumed = c.consumed.wrapping_add(blocks);
                PhiloxState::Device {
                    device: c.device,
                    seed_ptr: c.ptrs.seed_ptr,
                    offset_ptr: c.ptrs.offset_ptr,
                    offset: at,
                }
            }
            None => {
                let at = st.rng;
                st.rng.offset = st.rng.offset.wrapping_add(blocks);
                PhiloxState::Value(at)
            }
        }
    }

    /// Starts recording draws for a CUDA graph on GPU `device` (PyTorch's `capture_prologue`):
    /// until [`Generator::end_capture`], draws read the seed and offset from device memory
    /// (Note [Philox under graph capture]). Writes the current seed and offset there (on the
    /// current stream), so call it before the stream begins capturing. Returns the addresses
    /// the kernels read.
    pub fn begin_capture(&self, device: usize) -> Result<CapturePhilox> {
        let mut st = self.lock();
        if let Some(c) = &st.capture {
            return Err(Error::invalid(
                "Generator::begin_capture",
                format!("the generator is already capturing on cuda:{}", c.device),
            ));
        }
        let ptrs = write_slots(&mut st, device)?;
        st.capture = Some(Capture {
            device,
            ptrs,
            consumed: 0,
        });
        Ok(ptrs)
    }

    /// Ends the capture begun by [`Generator::begin_capture`] (PyTorch's `capture_epilogue`)
    /// and returns the counter blocks the recorded draws consume per replay, what
    /// [`Generator::replay_prologue`] takes. The host offset is where it was at the start.
    pub fn end_capture(&self) -> Result<u64> {
        match self.lock().capture.take() {
            Some(c) => Ok(c.consumed),
            None => Err(Error::invalid(
                "Generator::end_capture",
                "the generator is not capturing (call begin_capture first)",
            )),
        }
    }

    /// True between [`Generator::begin_capture`] and [`Generator::end_capture`].
    pub fn is_capturing(&self) -> bool {
        self.lock().capture.is_some()
    }

    /// Prepares one replay of a graph captured on GPU `device` whose draws consume `increment`
    /// blocks (PyTorch's `replay_prologue`): writes the current seed and offset to the device
    /// (on the current stream, so the replay must follow on that stream) and advances the
    /// offset by `increment`, so the replay draws what an eager run from this state would, and
    /// the next replay or eager draw draws new numbers.
    pub fn replay_prologue(&self, device: usize, increment: u64) -> Result<()> {
        let mut st = self.lock();
        if st.capture.is_some() {
            return Err(Error::invalid(
                "Generator::replay_prologue",
                "the generator is capturing; end the capture before replaying",
            ));
        }
        if !st.slots.iter().any(|(d, _)| *d == device) {
            return Err(Error::invalid(
                "Generator::replay_prologue",
                format!("the generator never captured on cuda:{device}"),
            ));
        }
        write_slots(&mut st, device)?;
        st.rng.offset = st.rng.offset.wrapping_add(increment);
        Ok(())
    }
}

/// Writes the seed and the current offset into the device slots of `device` (made on first
/// use), on the current stream; returns their addresses.
fn write_slots(st: &mut GenState, device: usize) -> Result<CapturePhilox> {
    let i = match st.slots.iter().position(|(d, _)| *d == device) {
        Some(i) => i,
        None => {
            st.slots
                .push((device, Storage::alloc(Device::Cuda(device), DType::I64, 2)?));
            st.slots.len() - 1
        }
    };
    let (seed_ptr, offset_ptr) = st.slots[i].1.write_philox_slot(st.rng)?;
    Ok(CapturePhilox { seed_ptr, offset_ptr })
}

impl Default for Generator {
    /// A generator seeded with [`DEFAULT_SEED`].
    fn default() -> Generator {
        Generator::new(DEFAULT_SEED)
    }
}

impl Clone for Generator {
    fn clone(&self) -> Generator {
        let st = self.get_state();
        let g = Generator::new(st.seed);
        g.set_state(st);
        g
    }
}

impl fmt::Debug for Generator {
    // (The capture state is not shown.)
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.get_state();
        write!(f, "Generator(seed={}, offset={})", st.seed, st.offset)
    }
}

/// The default generators and the seed new ones start from.
struct Defaults {
    seed: u64,
    generators: HashMap<Device, &'static Generator>,
}

fn defaults() -> MutexGuard<'static, Defaults> {
    static DEFAULTS: OnceLock<Mutex<Defaults>> = OnceLock::new();
    DEFAULTS
        .get_or_init(|| {
            Mutex::new(Defaults {
                seed: DEFAULT_SEED,
                generators: HashMap::new(),
            })
        })
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The process-wide default generator of `device` (created on first use; lives for the
/// whole process).
pub fn default_generator(device: Device) -> &'static Generator {
    let mut d = defaults();
    let seed = d.seed;
    d.generators
        .entry(device)
        .or_insert_with(|| Box::leak(Box::new(Generator::new(seed))))
}

/// Seeds the default generator of every device, present and future (`torch.manual_seed`).
pub fn manual_seed(seed: u64) -> Result<()> {
    let mut d = defaults();
    d.seed = seed;
    for g in d.generators.values() {
        g.manual_seed(seed);
    }
    Ok(())
}

/// Seeds every default generator from a non-deterministic source and returns the seed
/// (`torch.seed`).
pub fn seed() -> u64 {
    let s = nondeterministic_seed();
    manual_seed(s).expect("seeding cannot fail");
    s
}

/// The initial seed of the CPU default generator (`torch.initial_seed`).
pub fn initial_seed() -> u64 {
    default_generator(Device::Cpu).initial_seed()
}

/// The state of the CPU default generator (`torch.get_rng_state`).
pub fn get_rng_state() -> RngState {
    default_generator(Device::Cpu).get_state()
}

/// Restores the state of the CPU default generator (`torch.set_rng_state`).
pub fn set_rng_state(state: RngState) {
    default_generator(Device::Cpu).set_state(state)
}

/// A seed from the clock, a process-wide counter and std's randomly keyed hasher.
fn nondeterministic_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u64(CALLS.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generator_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Generator>();
    }

    #[test]
    fn reserve_advances_offset() {
        let g = Generator::new(7);
        assert_eq!(g.reserve(3), RngState { seed: 7, offset: 0 });
        assert_eq!(g.get_state(), RngState { seed: 7, offset: 3 });
        let c = g.clone();
        g.reserve(1);
        assert_eq!(c.get_state().offset, 3);
        assert_eq!(g.get_state().offset, 4);
    }

    #[test]
    fn eager_draws_take_the_state_by_value() {
        let g = Generator::new(5);
        g.reserve(2);
        assert_eq!(
            g.reserve_draw(3),
            PhiloxState::Value(RngState { seed: 5, offset: 2 })
        );
        assert_eq!(g.get_state().offset, 5);
        assert!(!g.is_capturing());
        assert!(g.end_capture().is_err());
        assert!(g.replay_prologue(0, 1).is_err());
        let captured = PhiloxState::Device {
            device: 0,
            seed_ptr: 8,
            offset_ptr: 16,
            offset: 0,
        };
        assert!(matches!(
            captured.value("randperm"),
            Err(Error::InvalidArgument { op: "randperm", .. })
        ));
    }
}
