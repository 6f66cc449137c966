//! Whether a model's training state fits the GPUs of a run: [`DoesNotFit`], the error that
//! says what it needs, what the GPU has and what to change (more GPUs, `--shard`, a smaller
//! model), before training or in place of the out-of-memory error training ran into.

use ember::Device;

/// Bytes a parameter takes in training with AdamW: itself, its gradient and the two moments,
/// float32 each.
pub(super) const TRAINING_BYTES_PER_PARAMETER: usize = 16;

/// A model whose training state does not fit the GPUs it is given: what it needs per GPU,
/// what the GPU has, and what to change. Reported before training when the parameters,
/// gradients and AdamW state alone exceed a GPU's memory, and in place of the
/// [`ember::Error::OutOfMemory`] that training ran into otherwise (`cause`).
#[derive(Debug)]
pub(super) struct DoesNotFit {
    parameters: usize,
    /// Bytes of parameters, gradients and AdamW state on each GPU (1/world of them sharded).
    per_gpu: usize,
    device: Device,
    /// The GPU's memory in bytes.
    total: usize,
    world: usize,
    sharded: bool,
    cause: Option<ember::Error>,
}

/// Bytes of training state on each GPU: all of it, or 1/world of it sharded.
fn per_gpu(parameters: usize, world: usize, sharded: bool) -> usize {
    let whole = parameters * TRAINING_BYTES_PER_PARAMETER;
    if sharded {
        whole.div_ceil(world.max(1))
    } else {
        whole
    }
}

impl DoesNotFit {
    /// The error of a run of `parameters` in `world` processes (`sharded` or not) that ran out
    /// of GPU memory: `oom`, an [`ember::Error::OutOfMemory`], is its cause.
    pub(super) fn out_of_memory(
        parameters: usize,
        world: usize,
        sharded: bool,
        oom: ember::Error,
    ) -> DoesNotFit {
        let (device, total) = match &oom {
            ember::Error::OutOfMemory { device, total, .. } => (*device, *total),
            _ => (Device::Cpu, 0),
        };
        DoesNotFit {
            parameters,
            per_gpu: per_gpu(parameters, world, sharded),
            device,
            total,
            world,
            sharded,
            cause: Some(oom),
        }
    }

    /// Checks that the training state of `parameters` fits a GPU of `total` bytes when
    /// `world` processes hold it (sharded) or each holds all of it.
    pub(super) fn check(
        parameters: usize,
        world: usize,
        sharded: bool,
        device: Device,
        total: usize,
    ) -> Result<(), DoesNotFit> {
        let per_gpu = per_gpu(parameters, world, sharded);
        if per_gpu <= total {
            return Ok(());
        }
        Err(DoesNotFit {
            parameters,
            per_gpu,
            device,
            total,
            world,
            sharded,
            cause: None,
        })
    }
}

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        if let Some(e) = &self.cause {
            writeln!(f, "training ran out of GPU memory ({e}).")?;
        }
        write!(
            f,
            "The model's {:.2e} parameters need {:.1} GiB on each GPU for parameters, gradients and AdamW state \
             ({TRAINING_BYTES_PER_PARAMETER} bytes per parameter{}), before activations; {} has {:.1} GiB. ",
            self.parameters as f64,
            gib(self.per_gpu),
            if self.sharded {
                format!(", sharded over {} processes", self.world)
            } else if self.world > 1 {
                format!(", replicated in each of {} processes", self.world)
            } else {
                String::new()
            },
            self.device,
            gib(self.total),
        )?;
        // GPUs whose memory holds the state alone, sharded.
        let needed = (self.parameters * TRAINING_BYTES_PER_PARAMETER)
            .div_ceil(self.total.max(1))
            .max(2);
        if self.sharded {
            write!(
                f,
                "Shard it over more GPUs (--nproc-per-node above {}; the state alone needs {needed}), or train a \
                 smaller model (--n-layer, --n-embd; --batch-size and --block-size for the activations).",
                self.world
            )
        } else {
            write!(
                f,
                "Shard it over several GPUs with --nproc-per-node N --shard (each GPU then holds 1/N of it; the \
                 state alone needs N of at least {needed}), or train a smaller model (--n-layer, --n-embd; \
                 --batch-size and --block-size for the activations)."
            )
        }
    }
}

impl std::error::Error for DoesNotFit {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.as_ref().map(|e| e as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_large_models_say_what_to_change() {
        // 1e9 parameters: 16e9 bytes of training state.
        let (p, gpu) = (1_000_000_000, Device::Cuda(0));
        assert!(DoesNotFit::check(p, 1, false, gpu, 20 << 30).is_ok());
        let e = DoesNotFit::check(p, 2, false, gpu, 10 << 30)
            .unwrap_err()
            .to_string();
        for what in [
            "1.00e9 parameters need 14.9 GiB on each GPU",
            "replicated in each of 2 processes",
            "cuda:0 has 10.0 GiB",
            "--nproc-per-node N --shard",
            "N of at least 2",
            "smaller model (--n-layer, --n-embd",
        ] {
            assert!(e.contains(what), "{what:?} not in {e}");
        }
        assert!(DoesNotFit::check(p, 2, true, gpu, 10 << 30).is_ok());
        let e = DoesNotFit::check(p, 2, true, gpu, 5 << 30)
            .unwrap_err()
            .to_string();
        for what in [
            "7.5 GiB on each GPU",
            "sharded over 2 processes",
            "above 2; the state alone needs 3",
        ] {
            assert!(e.contains(what), "{what:?} not in {e}");
        }
    }
}
