//! [`DataParallel`] (`torch.nn.DataParallel`): one process drives several devices. Each forward
//! splits the batch along dim 0 into one chunk per device (`scatter`), copies the module to the
//! other devices (`replicate`: its parameters through differentiable copies, so every replica's
//! gradients flow back and add up in the original parameters' `.grad`; buffers copied
//! detached), runs the replicas on one thread per device (`parallel_apply`, each thread under
//! the caller's grad mode and autocast state), and concatenates the outputs on the output
//! device (`gather`). Backward needs nothing more: the original parameters get the sum of the
//! replicas' gradients, which is the full batch's gradient when the loss sums (or averages)
//! over the gathered batch.
//!
//! As in PyTorch, the module's parameters and buffers must live on the first device; with one
//! device (or none: a machine without GPUs) the wrapper just calls the module. Replicating on
//! every forward costs a copy of the parameters per extra device, which is why PyTorch
//! recommends DistributedDataParallel; buffer updates made by replicas (batch-norm running
//! statistics) are lost, as in PyTorch.

use crate::module::{join_name, Forward, Module, TensorKind};
use ember_core::amp;
use ember_core::{cuda, Device, DeviceType, Error, Result, Tensor};

/// A module run data-parallel over several devices in one process (`nn.DataParallel`).
pub struct DataParallel<M> {
    module: M,
    devices: Vec<Device>,
    output_device: Device,
}

impl<M> std::fmt::Debug for DataParallel<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataParallel")
            .field("devices", &self.devices)
            .field("output_device", &self.output_device)
            .finish_non_exhaustive()
    }
}

impl<M: Forward + Clone> DataParallel<M> {
    /// Over every visible GPU (`cuda:0`, `cuda:1`, ...), gathering on `cuda:0`; on a machine
    /// without GPUs the wrapper calls the module as it is.
    pub fn new(module: M) -> Result<DataParallel<M>> {
        let devices: Vec<Device> = (0..cuda::device_count()).map(Device::Cuda).collect();
        DataParallel::with_devices(module, devices)
    }

    /// Over `devices` (`device_ids`), gathering on the first. The module's parameters and
    /// buffers must be on the first device (an error otherwise, as PyTorch's).
    pub fn with_devices(module: M, devices: impl IntoIterator<Item = Device>) -> Result<DataParallel<M>> {
        let devices: Vec<Device> = devices.into_iter().collect();
        let output_device = devices.first().copied().unwrap_or(Device::Cpu);
        if let Some(&first) = devices.first() {
            let mut misplaced = None;
            module.visit("", &mut |name, t, _| {
                if misplaced.is_none() && t.device() != first {
                    misplaced = Some((name.to_string(), t.device()));
                }
            });
            if let Some((name, device)) = misplaced {
                return Err(Error::invalid(
                    "DataParallel",
                    format!(
                        "module must have its parameters and buffers on device {first} (device_ids[0]) but found {name} on {device}; move it with module.to_device({first})"
                    ),
                ));
            }
        }
        Ok(DataParallel {
            module,
            devices,
            output_device,
        })
    }

    /// The wrapped module (`dp.module`).
    pub fn module(&self) -> &M {
        &self.module
    }

    /// The wrapped module, mutably.
    pub fn module_mut(&mut self) -> &mut M {
        &mut self.module
    }

    /// The devices the batch is split over (`device_ids`).
    pub fn devices(&self) -> &[Device] {
        &self.devices
    }

    /// A copy of the module on `device` whose parameters are differentiable copies of the
    /// module's (their gradients flow back into the originals) and whose buffers are plain
    /// copies.
    fn replicate(&self, device: Device) -> Result<M> {
        let mut replica = self.module.clone();
        replica.visit_mut("", &mut |_, t, kind| {
            *t = match kind {
                TensorKind::Parameter => t.to(device)?,
                TensorKind::Buffer => t.detach().to(device)?,
            };
            Ok(())
        })?;
        Ok(replica)
    }

    /// Scatter, replicate, run the replicas in parallel, gather (see the module docs).
    fn forward_parallel(&self, x: &Tensor) -> Result<Tensor> {
        // A batch smaller than the device count uses as many devices as it has rows.
        let chunks = x.chunk(self.devices.len(), 0)?;
        let used = chunks.len();
        let inputs = chunks
            .iter()
            .zip(&self.devices)
            .map(|(c, &d)| c.to(d))
            .collect::<Result<Vec<_>>>()?;
        let replicas = self.devices[1..used]
            .iter()
            .map(|&d| self.replicate(d))
            .collect::<Result<Vec<_>>>()?;
        // Each thread starts with the defaults of thread-local state: carry the caller's.
        let grad = ember_core::is_grad_enabled();
        let autocast: Vec<(DeviceType, ember_core::DType)> = [DeviceType::Cuda, DeviceType::Cpu]
            .into_iter()
            .filter(|&dt| amp::is_autocast_enabled(dt))
            .map(|dt| (dt, amp::get_autocast_dtype(dt)))
            .collect();
        let outputs = std::thread::scope(|s| {
            let handles: Vec<_> = (0..used)
                .map(|i| {
                    let module = if i == 0 { &self.module } else { &replicas[i - 1] };
                    let (x, autocast) = (&inputs[i], &autocast);
                    s.spawn(move || -> Result<Tensor> {
                        let previous = ember_core::set_grad_enabled(grad);
                        let guards = autocast
                            .iter()
                            .map(|&(dt, dtype)| amp::autocast(dt, dtype))
                            .collect::<Result<Vec<_>>>();
                        let out = guards.and_then(|_guards| module.forward(x));
                        ember_core::set_grad_enabled(previous);
                        out
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(Error::invalid(
                            "DataParallel",
                            format!("the replica on {} panicked in its forward", self.devices[i]),
                        ))
                    })
                })
                .collect::<Result<Vec<_>>>()
        })?;
        let gathered = outputs
            .iter()
            .map(|o| o.to(self.output_device))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&gathered, 0)
    }
}

impl<M: Forward + Clone> Forward for DataParallel<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self.devices.as_slice() {
            [] => self.module.forward(x),
            [only] => self.module.forward(&x.to(*only)?),
            _ => self.forward_parallel(x),
        }
    }
}

/// The wrapper is a module whose only child is `module` (names `module.fc.weight`, as PyTorch).
impl<M: Module> Module for DataParallel<M> {
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.module.visit(&join_name(prefix, "module"), f)
    }

    fn visit_mut(
        &mut self,
        prefix: &str,
        f: &mut dyn FnMut(&str, &mut Tensor, TensorKind) -> Result<()>,
    ) -> Result<()> {
        self.module.visit_mut(&join_name(prefix, "module"), f)
    }

    fn set_training(&mut self, training: bool) {
        self.module.set_training(training)
    }

    fn is_training(&self) -> bool {
        self.module.is_training()
    }
}
