//! Where a tensor lives: [`Device::Cpu`] or [`Device::Cuda`] with an ordinal (as `torch.device`).

use crate::{Error, Result};
use std::cell::Cell;
use std::fmt;
use std::str::FromStr;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// Host memory, computed by the multi-threaded CPU backend.
    #[default]
    Cpu,
    /// The NVIDIA GPU with this ordinal.
    Cuda(usize),
}

impl Device {
    /// Parses `"cpu"`, `"cuda"` (the calling thread's current CUDA device, as
    /// [`Device::cuda`]) or `"cuda:N"`.
    pub fn parse(s: &str) -> Result<Device> {
        s.parse()
    }

    /// The calling thread's current CUDA device (`torch.device("cuda")`): cuda:0 unless
    /// [`crate::cuda::set_device`] or a [`crate::cuda::DeviceGuard`] chose another, so that
    /// under `let _g = DeviceGuard::new(1)?` a tensor made on `Device::cuda()` lands on cuda:1
    /// as under PyTorch's `with torch.cuda.device(1):`. The device is resolved now: the value
    /// stays `Cuda(i)` after the guard is gone. Needs no GPU to call.
    pub fn cuda() -> Device {
        Device::Cuda(current_cuda_index())
    }

    pub fn is_cpu(self) -> bool {
        matches!(self, Device::Cpu)
    }

    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }

    /// `"cpu"` or `"cuda"`, as `torch.device.type`.
    pub fn type_name(self) -> &'static str {
        self.device_type().name()
    }

    /// The kind of device, without the ordinal (`torch.device.type`).
    pub fn device_type(self) -> DeviceType {
        match self {
            Device::Cpu => DeviceType::Cpu,
            Device::Cuda(_) => DeviceType::Cuda,
        }
    }
}

thread_local! {
    /// The calling thread's current CUDA device index: kept here, beside [`Device`], so that
    /// [`Device::cuda`] reads it without calling up into the CUDA backend, whose `set_device`
    /// and `DeviceGuard` write it.
    static CURRENT_CUDA: Cell<usize> = const { Cell::new(0) };
}

/// The calling thread's current CUDA device index (`torch.cuda.current_device`).
pub(crate) fn current_cuda_index() -> usize {
    CURRENT_CUDA.with(Cell::get)
}

/// Makes `index` the calling thread's current CUDA device; the CUDA backend checks that it
/// exists first (`set_device`), unit tests need not.
pub(crate) fn set_current_cuda_index(index: usize) {
    CURRENT_CUDA.with(|d| d.set(index));
}

/// A kind of device (`torch.device.type`): what per-device-type settings such as autocast
/// ([`crate::amp::autocast`]) are keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceType {
    Cpu,
    Cuda,
}

impl DeviceType {
    /// `"cpu"` or `"cuda"`.
    pub fn name(self) -> &'static str {
        match self {
            DeviceType::Cpu => "cpu",
            DeviceType::Cuda => "cuda",
        }
    }

    /// Parses `"cpu"` or `"cuda"` (PyTorch's `device_type` strings).
    pub fn parse(s: &str) -> Result<DeviceType> {
        match s.trim() {
            "cpu" => Ok(DeviceType::Cpu),
            "cuda" => Ok(DeviceType::Cuda),
            _ => Err(Error::InvalidDevice(s.to_string())),
        }
    }
}

impl fmt::Display for DeviceType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Device {
    type Err = Error;

    fn from_str(s: &str) -> Result<Device> {
        let bad = || Error::InvalidDevice(s.to_string());
        match s.trim() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::cuda()),
            t => {
                let ordinal = t.strip_prefix("cuda:").ok_or_else(bad)?;
                if ordinal.is_empty() || !ordinal.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                ordinal.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_pytorch_device_strings() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::Cpu);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
        assert_eq!(Device::cuda(), Device::Cuda(0));
        assert_eq!(Device::parse("cuda:3").unwrap(), Device::Cuda(3));
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "cuda:1:2"] {
            let err = Device::parse(bad).unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
        }
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }

    #[test]
    fn plain_cuda_means_the_current_device() {
        // The current device is per thread; this test's thread is its own.
        set_current_cuda_index(3);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(3));
        assert_eq!(" cuda ".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!(Device::cuda(), Device::Cuda(3));
        assert_eq!(Device::parse("cuda:1").unwrap(), Device::Cuda(1));
        set_current_cuda_index(0);
        assert_eq!(Device::parse("cuda").unwrap(), Device::Cuda(0));
    }
}
