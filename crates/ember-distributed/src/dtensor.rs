//! Sharded tensors (`torch.distributed.tensor`): [`DTensor`], a rank's local shard of a global
//! tensor laid out over a [`DeviceMesh`] by a [`Placement`], and [`distribute_tensor`].
//!
//! Note [Shard layout]: `Shard(0)` splits dim 0 by `torch.chunk`'s rule, which DTensor and
//! FSDP2 both use: with `n` rows over `w` ranks, every rank gets `c = ceil(n / w)` rows, rank
//! `r` rows `[min(r·c, n), min((r+1)·c, n))`, so the last ranks may hold fewer rows or none
//! (5 rows on 4 ranks: 2, 2, 1, 0). [`chunk_range`] is the rule; a local shard always holds
//! exactly its rows, unpadded. Collectives that need equal sizes (the all-gather of
//! [`DTensor::full_tensor`], FSDP2's) pad every shard to `c` rows and cut the padding off after,
//! as FSDP2 does, so no backend needs uneven collectives.
//!
//! The local shard is an ordinary [`Tensor`] with its own storage: a leaf that can require
//! grad, that an optimizer steps on in place, and that [`DTensor::to_local`] hands out (the
//! same storage, not a copy), so whatever writes to the shard writes to the DTensor.

use std::ops::Range;

use ember_core::{no_grad, DType, Device, Error, Result, Shape, Tensor};

use crate::mesh::DeviceMesh;

/// How a tensor is laid out over one mesh dimension (`Shard(dim)`, `Replicate()`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split along this dim, one chunk per rank (Note [Shard layout]); only dim 0 for now.
    Shard(usize),
    /// Every rank holds the whole tensor.
    Replicate,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard(dim={d})"),
            Placement::Replicate => f.write_str("Replicate()"),
        }
    }
}

/// The rows of dim 0 that rank `rank` of `world` holds when `rows` rows are sharded
/// (`torch.chunk`'s rule, Note [Shard layout]); empty for the ranks past the last chunk:
/// `chunk_range(5, 4, r)` is `0..2`, `2..4`, `4..5`, `5..5` for `r` = 0 to 3.
pub fn chunk_range(rows: usize, world: usize, rank: usize) -> Range<usize> {
    let c = rows.div_ceil(world.max(1));
    let start = rank.saturating_mul(c).min(rows);
    let end = rank.saturating_add(1).saturating_mul(c).min(rows);
    start..end
}

/// A tensor sharded or replicated over a [`DeviceMesh`] (`DTensor`): this rank's local shard,
/// the global shape, the mesh and the placement. Cheap to clone (tensor handles).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use ember_core::{DType, Device, Tensor};
/// use ember_distributed::dtensor::{distribute_tensor, Placement};
/// use ember_distributed::{BackendKind, DeviceMesh, ProcessGroup, Store, TcpStore};
/// # fn main() -> ember_core::Result<()> {
/// // Two ranks as threads (normally processes started by ember-run).
/// fn rank(r: usize, store: Arc<dyn Store>) -> ember_core::Result<Vec<f32>> {
///     let t = Duration::from_secs(10);
///     let mesh = DeviceMesh::new(ProcessGroup::new(BackendKind::Gloo, store, r, 2, t)?);
///     // 3 rows on 2 ranks: rank 0 holds rows 0..2, rank 1 row 2.
///     let full = Tensor::arange(0.0, 6.0, 1.0, DType::F32, Device::Cpu)?.reshape([3, 2])?;
///     let d = distribute_tensor(&full, &mesh, &[Placement::Shard(0)])?;
///     assert_eq!(d.shape().dims(), [3, 2]);
///     assert_eq!(d.to_local().dims(), [2 - r, 2]);
///     d.full_tensor()?.to_vec::<f32>()
/// }
/// let master = TcpStore::new("127.0.0.1", 0, true, Duration::from_secs(10))?;
/// let port = master.port();
/// let other = std::thread::spawn(move || {
///     rank(1, Arc::new(TcpStore::new("127.0.0.1", port, false, Duration::from_secs(10))?))
/// });
/// assert_eq!(rank(0, Arc::new(master))?, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
/// assert_eq!(other.join().unwrap()?, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct DTensor {
    local: Tensor,
    mesh: DeviceMesh,
    placements: [Placement; 1],
    shape: Shape,
}

impl std::fmt::Debug for DTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DTensor(shape={}, local={}, dtype={}, {}, placements=[{}])",
            self.shape,
            self.local.shape(),
            self.local.dtype(),
            self.mesh,
            self.placements[0]
        )
    }
}

/// The one placement of a 1-D mesh, checked: `Shard(0)` or `Replicate`.
fn check_placements(op: &'static str, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Placement> {
    let [p] = placements else {
        return Err(Error::invalid(
            op,
            format!(
                "{} placement(s) for a mesh of {} dimension(s); give one per mesh dimension",
                placements.len(),
                mesh.ndim()
            ),
        ));
    };
    if let Placement::Shard(d) = p {
        if *d != 0 {
            return Err(Error::invalid(
                op,
                format!("Shard({d}) is not supported yet; shard along dim 0 (Shard(0)), transposing first if needed"),
            ));
        }
    }
    Ok(*p)
}

fn check_shardable(op: &'static str, p: Placement, dims: &[usize]) -> Result<()> {
    if p == Placement::Shard(0) && dims.is_empty() {
        return Err(Error::invalid(
            op,
            "a 0-d tensor has no dim 0 to shard; use Placement::Replicate",
        ));
    }
    Ok(())
}

impl DTensor {
    /// A DTensor of this rank's `local` shard (`DTensor.from_local`), no communication.
    /// `shape` is the global shape; `None` assumes even shards (`Shard(0)`: every rank holds
    /// as many rows as this one; `Replicate`: the local shape), as PyTorch does. With a shape,
    /// `local` must hold exactly this rank's rows by Note [Shard layout], else
    /// [`Error::ShapeMismatch`]. `local` itself becomes the shard (not a copy), so a leaf that
    /// requires grad stays that leaf.
    pub fn from_local(
        local: Tensor,
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: Option<Shape>,
    ) -> Result<DTensor> {
        const OP: &str = "DTensor::from_local";
        let p = check_placements(OP, mesh, placements)?;
        check_shardable(OP, p, local.dims())?;
        let (w, r) = (mesh.size(), mesh.get_local_rank());
        let shape = match (shape, p) {
            (None, Placement::Replicate) => local.shape().clone(),
            (None, _) => {
                let mut dims = local.dims().to_vec();
                dims[0] *= w;
                Shape::new(dims)
            }
            (Some(s), Placement::Replicate) => {
                if &s != local.shape() {
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: s,
                        rhs: local.shape().clone(),
                        hint: "; a replicated local tensor has the global shape",
                    });
                }
                s
            }
            (Some(s), _) => {
                let fits = s.rank() == local.dims().len()
                    && s.dims()[1..] == local.dims()[1..]
                    && chunk_range(s.dims()[0], w, r).len() == local.dims()[0];
                if !fits {
                    let mut expected = s.dims().to_vec();
                    if let Some(rows) = expected.first_mut() {
                        *rows = chunk_range(*rows, w, r).len();
                    }
                    return Err(Error::ShapeMismatch {
                        op: OP,
                        lhs: Shape::new(expected),
                        rhs: local.shape().clone(),
                        hint: "; the local shard must hold this rank's rows of the global shape, ceil(rows / world) per rank as torch.chunk splits them (chunk_range)",
                    });
                }
                s
            }
        };
        Ok(DTensor {
            local,
            mesh: mesh.clone(),
            placements: [p],
            shape,
        })
    }

    /// This rank's shard (`to_local()`): the DTensor's own tensor, not a copy.
    pub fn to_local(&self) -> Tensor {
        self.local.clone()
    }

    /// This rank's shard, borrowed.
    pub fn local_tensor(&self) -> &Tensor {
        &self.local
    }

    /// The global shape (`shape`).
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The global dims.
    pub fn dims(&self) -> &[usize] {
        self.shape.dims()
    }

    /// The number of elements of the global tensor.
    pub fn numel(&self) -> usize {
        self.shape.numel()
    }

    pub fn dtype(&self) -> DType {
        self.local.dtype()
    }

    /// The device of the local shard.
    pub fn device(&self) -> Device {
        self.local.device()
    }

    /// Whether the local shard requires grad.
    pub fn requires_grad(&self) -> bool {
        self.local.requires_grad()
    }

    /// One placement per mesh dimension (`placements`).
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }

    /// The mesh the tensor is laid out over (`device_mesh`).
    pub fn device_mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The rows of the global dim 0 this rank's shard holds (all of them when replicated;
    /// `0..1` for a replicated 0-d tensor).
    pub fn local_range(&self) -> Range<usize> {
        let rows = self.shape.dims().first().copied().unwrap_or(1);
        match self.placements[0] {
            Placement::Replicate => 0..rows,
            Placement::Shard(_) => chunk_range(rows, self.mesh.size(), self.mesh.get_local_rank()),
        }
    }

    /// The global tensor on every rank (`full_tensor()`): an all-gather of the shards (padded
    /// to equal size and cut after, Note [Shard layout]), or a copy of the local tensor when
    /// replicated. Collective over the mesh. The result is a new tensor outside autograd.
    pub fn full_tensor(&self) -> Result<Tensor> {
        let _g = no_grad();
        if self.placements[0] == Placement::Replicate {
            return self.local.detach().deep_clone();
        }
        let (dims, w) = (self.shape.dims(), self.mesh.size());
        let (dtype, device) = (self.local.dtype(), self.local.device());
        let (rows, c) = (dims[0], dims[0].div_ceil(w));
        if rows == 0 || w == 1 {
            return self.local.detach().deep_clone();
        }
        let mut padded_dims = dims.to_vec();
        padded_dims[0] = c;
        let input = if self.local.dims()[0] == c {
            self.local.detach().contiguous()?
        } else {
            let padded = Tensor::zeros(padded_dims.clone(), dtype, device)?;
            if self.local.dims()[0] > 0 {
                padded.narrow(0, 0, self.local.dims()[0])?.copy_(&self.local)?;
            }
            padded
        };
        padded_dims[0] = c * w;
        let gathered = Tensor::empty(padded_dims, dtype, device)?;
        self.mesh.get_group().all_gather_into_tensor(&gathered, &input)?;
        gathered.narrow(0, 0, rows)?.contiguous()
    }
}

/// Lays `tensor` out over `mesh` (`distribute_tensor`), with PyTorch's default source: rank 0's
/// values are broadcast, so every rank gets rank 0's data whatever its own `tensor` holds. Then
/// each rank keeps its chunk (`Shard(0)`, Note [Shard layout]) or the whole (`Replicate`), as a
/// new leaf tensor of its own storage with `tensor`'s `requires_grad`. A CPU tensor goes to the
/// mesh's GPU first on an NCCL mesh. Collective over the mesh.
pub fn distribute_tensor(tensor: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<DTensor> {
    distribute_tensor_from(tensor, mesh, placements, Some(0))
}

/// [`distribute_tensor`] with PyTorch's `src_data_rank`: `Some(r)` broadcasts mesh rank `r`'s
/// values first; `None` takes each rank's chunk of its own `tensor` with no communication (what
/// FSDP2 does with parameters every rank initialized identically).
pub fn distribute_tensor_from(
    tensor: &Tensor,
    mesh: &DeviceMesh,
    placements: &[Placement],
    src_data_rank: Option<usize>,
) -> Result<DTensor> {
    const OP: &str = "distribute_tensor";
    let p = check_placements(OP, mesh, placements)?;
    check_shardable(OP, p, tensor.dims())?;
    let local = {
        let _g = no_grad();
        let mut src = tensor.detach();
        if let (Device::Cuda(_), Device::Cpu) = (mesh.device_type(), src.device()) {
            src = src.to(mesh.device_type())?;
        }
        // `owned`: `src` is a copy of this function's own (never the caller's storage).
        let mut owned = false;
        if let Some(root) = src_data_rank {
            let group = mesh.get_group();
            let full = src.deep_clone()?;
            group.broadcast(&full, group.global_rank(root)?)?;
            (src, owned) = (full, true);
        }
        match p {
            Placement::Replicate if owned => src,
            Placement::Replicate => src.deep_clone()?,
            Placement::Shard(_) => {
                let rows = chunk_range(src.dims()[0], mesh.size(), mesh.get_local_rank());
                src.narrow(0, rows.start, rows.len())?.deep_clone()?
            }
        }
    };
    if tensor.requires_grad() {
        local.requires_grad_(true)?;
    }
    let shape = tensor.shape().clone();
    Ok(DTensor {
        local,
        mesh: mesh.clone(),
        placements: [p],
        shape,
    })
}
