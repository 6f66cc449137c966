//! The autograd engine's GPU threads (Note [Device threads] in `engine.rs`): one long-lived
//! thread per GPU that runs the jobs backward hands it, in order. Long-lived because cuDNN and
//! cuBLASLt plans are kept per thread (Note [cuDNN state]): a fresh thread per backward would
//! choose every algorithm again.

use crate::{Error, Result};
use std::cell::Cell;
use std::sync::mpsc::{self, Sender};
use std::sync::Mutex;

pub(super) type Job = Box<dyn FnOnce() + Send>;

/// Per GPU index: the channel to its thread, once started.
static THREADS: Mutex<Vec<Option<Sender<Job>>>> = Mutex::new(Vec::new());

thread_local! {
    static ON_DEVICE_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// True on one of the engine's GPU threads.
pub(super) fn on_device_thread() -> bool {
    ON_DEVICE_THREAD.with(Cell::get)
}

/// Queues `job` on GPU `device`'s thread, starting the thread on first use.
pub(super) fn run(device: usize, job: Job) -> Result<()> {
    let mut threads = THREADS.lock().unwrap_or_else(|e| e.into_inner());
    if threads.len() <= device {
        threads.resize_with(device + 1, || None);
    }
    let sender = match &threads[device] {
        Some(sender) => sender,
        None => threads[device].insert(start(device)?),
    };
    sender.send(job).map_err(|_| {
        Error::Autograd(format!(
            "the autograd thread of cuda:{device} has stopped; restart the process"
        ))
    })
}

fn start(device: usize) -> Result<Sender<Job>> {
    let (tx, rx) = mpsc::channel::<Job>();
    std::thread::Builder::new()
        .name(format!("autograd cuda:{device}"))
        .spawn(move || {
            ON_DEVICE_THREAD.with(|d| d.set(true));
            // The device exists: a gradient on it is what sent the first job here.
            let _ = crate::storage::set_thread_device(device);
            // A job catches its own panics; one that escapes ends the thread, and later
            // sends report it.
            for job in rx {
                job();
            }
        })
        .map_err(|e| Error::Autograd(format!("cannot start the autograd thread of cuda:{device}: {e}")))?;
    Ok(tx)
}
