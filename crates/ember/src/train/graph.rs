//! `ember train --cuda-graph`: the training step (forward, loss, backward, Adam step and, with
//! `--amp fp16`, the GradScaler's scale/step/update) captured once into a CUDA graph and
//! replayed for every batch of the captured shape, one launch per step instead of one per op.
//!
//! Note [Graphed training step]: PyTorch's whole-network capture, step by step:
//! - Warm-up: the first [`WARMUP_STEPS`] full batches train eagerly on a side stream (the
//!   current stream waits for it after each). They are real training steps on real batches,
//!   as PyTorch's recipe asks ("because the warmup includes optimizer.step(), you must use a
//!   few batches of real data"), so no batch is skipped or trained twice: they load the
//!   kernels, set up cuBLASLt/cuDNN workspaces and make Adam's state (moments, device step
//!   counts, the device lr) and the GradScaler's scale before the capture, none of which may
//!   happen during it.
//! - Capture: the gradients are released (`zero_grad`) before the capture begins, so the
//!   captured backward makes them in the graph's private pool, where they stay, held by the
//!   parameters, and every replay writes them at the same addresses. Nothing inside the
//!   captured region releases them. The region reads the batch from static input and target
//!   tensors on the device and leaves its loss in a static loss tensor.
//! - Replay: each later batch of the captured shape is copied into the static tensors
//!   (asynchronously from the loader's pinned memory, on the current stream) and the graph
//!   replayed on the current stream; the loss is read from the static tensor, before the next
//!   replay overwrites it. Adam reads its lr and step counts from device tensors and
//!   `Optimizer::set_lr` writes the lr tensor in place (Note [Learning rate on the device] of
//!   `ember_nn::optim`), so the per-epoch schedule applies to replays; the GradScaler's scale and
//!   growth tracker are device tensors updated in place (Note [GradScaler keeps the host out]).
//! - A batch of another shape (the last, partial batch of an epoch, or one before the capture)
//!   trains eagerly on the current stream. Its backward makes gradients of its own; the graph's
//!   are handed back to the parameters after it, so the parameters always hold the tensors the
//!   replays write.
//! - Evaluation, checkpoints and the schedule stay outside the graph, between replays.
//! - Under `--nproc-per-node` the model is DistributedDataParallel: the warm-up's first step
//!   rebuilds its buckets, and the captured backward holds the bucket copies and the NCCL
//!   all-reduces, which every replay runs (Note [NCCL under capture] in ember-distributed).
//!   Every rank captures the same step and replays it as often, in the same order as its eager
//!   steps: the DistributedSampler gives each rank as many batches of each size.

use super::Step;
use ember::cuda::{self, CUDAGraph, CaptureErrorMode, GraphOptions, Stream};
use ember::{Device, Tensor};
use std::fmt;

/// Full batches trained eagerly on a side stream before the capture (PyTorch's recipe uses 3).
pub(super) const WARMUP_STEPS: usize = 3;

/// Why `--cuda-graph` could not be used.
#[derive(Debug)]
pub(super) enum CudaGraphError {
    /// The run is not on a GPU.
    NeedsGpu { device: Device },
    /// Capturing the training step failed (an operation that cannot be captured, or the
    /// driver refused the graph).
    Capture(ember::Error),
}

impl fmt::Display for CudaGraphError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaGraphError::NeedsGpu { device } => write!(
                f,
                "--cuda-graph: CUDA graphs need a GPU, and this run is on {device}; \
                 use --device cuda:N on a machine with an NVIDIA GPU, or leave out --cuda-graph"
            ),
            CudaGraphError::Capture(e) => write!(
                f,
                "--cuda-graph: capturing the training step failed: {e}; leave out --cuda-graph to train eagerly"
            ),
        }
    }
}

impl std::error::Error for CudaGraphError {}

/// The graph of one capture and its static tensors.
struct Captured {
    graph: CUDAGraph,
    /// Static input and target: each batch is copied in before a replay.
    x: Tensor,
    y: Tensor,
    /// The loss a replay writes.
    loss: Tensor,
    /// Each parameter and the gradient the captured backward made (in the graph's pool).
    grads: Vec<(Tensor, Option<Tensor>)>,
}

/// The training steps of a `--cuda-graph` run (Note [Graphed training step]).
pub(super) struct GraphedSteps {
    device: usize,
    /// The batch size a capture is made for: a full batch.
    batch_size: usize,
    /// The side stream of the warm-up steps.
    side: Stream,
    /// Warm-up steps done.
    warmed: usize,
    captured: Option<Captured>,
    replays: usize,
}

impl GraphedSteps {
    /// Graphed steps on `device` for batches of `batch_size`; an error off the GPU.
    pub(super) fn new(device: Device, batch_size: usize) -> Result<GraphedSteps, Box<dyn std::error::Error>> {
        let Device::Cuda(i) = device else {
            return Err(CudaGraphError::NeedsGpu { device }.into());
        };
        Ok(GraphedSteps {
            device: i,
            batch_size,
            side: Stream::new_on(i)?,
            warmed: 0,
            captured: None,
            replays: 0,
        })
    }

    /// How many steps were graph replays.
    pub(super) fn replays(&self) -> usize {
        self.replays
    }

    /// One training step on the batch `x`, `y` (host tensors, pinned by the loader): a replay
    /// when the batch has the captured shape, else an eager step (a warm-up step on the side
    /// stream while warming up; the capture once warm). Returns the loss, a device tensor: after
    /// a replay the graph's static loss, which the next replay overwrites, so it is read (or
    /// added up on the current stream) before the next step.
    pub(super) fn step(
        &mut self,
        step: &mut Step<'_>,
        x: &Tensor,
        y: &Tensor,
    ) -> Result<Tensor, Box<dyn std::error::Error>> {
        let device = Device::Cuda(self.device);
        if let Some(c) = &self.captured {
            if x.dims() == c.x.dims() && y.dims() == c.y.dims() {
                c.x.copy_non_blocking_(x)?;
                c.y.copy_non_blocking_(y)?;
                c.graph.replay()?;
                self.replays += 1;
                return Ok(c.loss.clone());
            }
            let loss = step.eager(&x.to_non_blocking(device)?, &y.to_non_blocking(device)?)?;
            for (p, g) in &c.grads {
                p.set_grad(g.clone())?;
            }
            return Ok(loss);
        }
        if x.dims()[0] != self.batch_size {
            // Not the shape to capture: eagerly, on the current stream.
            return Ok(step.eager(&x.to_non_blocking(device)?, &y.to_non_blocking(device)?)?);
        }
        if self.warmed < WARMUP_STEPS {
            self.warmed += 1;
            return Ok(self.warm_up(step, x, y)?);
        }
        // This batch is the first the graph trains on: captured, then replayed below.
        self.capture(step, x, y)?;
        self.step(step, x, y)
    }

    /// An eager step on the side stream, ordered after the current stream's work and before
    /// what the current stream does next. Tensors made here belong to the side stream's blocks
    /// and are used on the current stream afterwards (the loss, Adam's state); each warm-up
    /// begins by waiting for the current stream, so no such block is reused on the side stream
    /// while the current stream may still read it, and the side stream is idle after the last.
    fn warm_up(&mut self, step: &mut Step<'_>, x: &Tensor, y: &Tensor) -> ember::Result<Tensor> {
        let device = Device::Cuda(self.device);
        let current = cuda::current_stream_on(self.device)?;
        self.side.wait_stream(&current)?;
        let loss = {
            let _side = cuda::stream(&self.side);
            step.eager(&x.to_non_blocking(device)?, &y.to_non_blocking(device)?)?
        };
        current.wait_stream(&self.side)?;
        Ok(loss)
    }

    /// Captures the step for batches shaped as `x`, `y` (Note [Graphed training step]).
    fn capture(&mut self, step: &mut Step<'_>, x: &Tensor, y: &Tensor) -> Result<(), CudaGraphError> {
        let device = Device::Cuda(self.device);
        let _device = cuda::DeviceGuard::new(self.device).map_err(CudaGraphError::Capture)?;
        let static_x = Tensor::zeros(x.dims(), x.dtype(), device).map_err(CudaGraphError::Capture)?;
        let static_y = Tensor::zeros(y.dims(), y.dtype(), device).map_err(CudaGraphError::Capture)?;
        // Released outside the region: the captured backward makes them in the graph's pool.
        step.zero_grad().map_err(CudaGraphError::Capture)?;
        let mut graph = CUDAGraph::new();
        // Thread-local mode: with `num_workers > 0` the DataLoader's worker threads pin their
        // batches (cuMemHostAlloc) at any time, and in the default global mode the driver
        // refuses such calls from every thread while a capture is underway (and the capture is
        // invalidated); thread-local mode refuses them only in the capturing thread, which
        // makes none (the batch is loaded before the capture begins).
        let options = GraphOptions {
            capture_error_mode: CaptureErrorMode::ThreadLocal,
            ..Default::default()
        };
        let capture = cuda::graph_with(&mut graph, options).map_err(CudaGraphError::Capture)?;
        let loss = step.forward_backward_step(&static_x, &static_y);
        // The capture ends before an error of the region is returned; the region's own error
        // says more than the capture's.
        let ended = capture.end();
        let loss = loss.map_err(CudaGraphError::Capture)?.detach();
        ended.map_err(CudaGraphError::Capture)?;
        let grads = step.opt.params().iter().map(|p| (p.clone(), p.grad())).collect();
        self.captured = Some(Captured {
            graph,
            x: static_x,
            y: static_y,
            loss,
            grads,
        });
        Ok(())
    }
}
