//! [`DeviceMesh`] (`torch.distributed.device_mesh`): the ranks a sharded tensor is laid out
//! over, and the process group that connects them.
//!
//! Only 1-D meshes exist for now: one process group, mesh coordinate = group rank. A 2-D mesh
//! (HSDP: replicate across nodes, shard within one) would add a group per mesh dimension.

use ember_core::{Device, Error, Result};

use crate::group::{default_group, ProcessGroup};

/// A 1-D mesh of ranks (`DeviceMesh`): its process group and the device its tensors live on.
/// Cheap to clone (the group is shared).
#[derive(Clone, Debug)]
pub struct DeviceMesh {
    group: ProcessGroup,
}

impl DeviceMesh {
    /// The mesh of every rank of `group`, in group-rank order.
    pub fn new(group: ProcessGroup) -> DeviceMesh {
        DeviceMesh { group }
    }

    /// The number of ranks in the mesh (`mesh.size()`).
    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// The number of mesh dimensions (`mesh.ndim`): always 1.
    pub fn ndim(&self) -> usize {
        1
    }

    /// The mesh's shape (`mesh.shape`): `[size]`.
    pub fn shape(&self) -> [usize; 1] {
        [self.size()]
    }

    /// This rank's coordinate along the mesh (`mesh.get_local_rank()`): its group rank.
    pub fn get_local_rank(&self) -> usize {
        self.group.rank()
    }

    /// The process group of the mesh (`mesh.get_group()`).
    pub fn get_group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Where the mesh's tensors live (`mesh.device_type`): the CPU for the CPU backend, this
    /// rank's GPU for NCCL.
    pub fn device_type(&self) -> Device {
        self.group.device()
    }

    /// Whether two meshes are the same ranks (same global ranks, same order).
    pub(crate) fn same_ranks(&self, other: &ProcessGroup) -> bool {
        self.group.ranks() == other.ranks()
    }
}

impl std::fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceMesh({}, {:?})",
            self.group.backend(),
            self.group.ranks()
        )
    }
}

/// A mesh over the default group (`init_device_mesh(device_type, mesh_shape)`):
/// `mesh_shape` must be `[world_size]` (1-D meshes only for now), and `device_type` `"cpu"` or
/// `"cuda"` as the default group's backend serves (gloo: `"cpu"`, NCCL: `"cuda"`).
pub fn init_device_mesh(device_type: &str, mesh_shape: &[usize]) -> Result<DeviceMesh> {
    let group = default_group()?;
    let world = group.size();
    if mesh_shape != [world] {
        return Err(Error::invalid(
            "init_device_mesh",
            format!(
                "mesh_shape {mesh_shape:?} is not [{world}]: only 1-D meshes over the whole default group exist yet"
            ),
        ));
    }
    let serves = match group.device() {
        Device::Cpu => "cpu",
        Device::Cuda(_) => "cuda",
    };
    if device_type != serves {
        return Err(Error::invalid(
            "init_device_mesh",
            format!(
                "device_type {device_type:?}, but the default group's {} backend serves {serves:?} tensors; initialize the process group with the backend of that device",
                group.backend()
            ),
        ));
    }
    Ok(DeviceMesh::new(group))
}
