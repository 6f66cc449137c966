//! ember's CPU backend (PyTorch's "gloo" role): collectives between processes over TCP.
//!
//! Note [CPU backend design]:
//! - Connections: a full mesh, two TCP connections per pair of ranks, one for collectives and
//!   one for point-to-point messages, set up through the store: each rank listens on the
//!   interface through which it reaches the store, publishes `addr/<rank>`, connects to every
//!   lower rank and accepts every higher one (a handshake names the rank and the channel).
//!   Rank 0 has accepted everyone only once every rank finished its store reads, so rank 0 may
//!   leave (taking the store server with it) as soon as its own work is done.
//! - Threads: one worker per group runs collectives and receives in issue order; a second one
//!   runs sends, so `isend` + `irecv` between two ranks cannot deadlock on full socket buffers.
//! - Algorithms: all_reduce is a ring reduce-scatter followed by a ring all-gather (each rank
//!   sends about 2·(n−1)/n of the tensor, the bandwidth-optimal schedule); reduce_scatter and
//!   all_gather (list and flat forms, the same messages) are those two halves; broadcast sends from the root to each rank; barrier is an
//!   all_reduce of one byte. In each ring step the send runs on a scoped thread while the
//!   receive runs on the worker, so neither waits for the other's socket buffer.
//! - Framing: every message has a header (operation, dtype, sequence number or tag, length);
//!   a rank that called a different collective, or passed a tensor of another size or dtype,
//!   is reported as such instead of corrupting data.
//! - Failure: every read and write is bounded by the operation's deadline (the group timeout
//!   from the operation's start). On any error the backend aborts: it shuts every connection
//!   down, so peers blocked on this rank fail at once instead of at their timeout, and every
//!   later operation fails with the first error.
//! - Device tensors are copied to the host and back (as gloo does for CUDA tensors).

use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use ember_core::{DType, Error, Result, Tensor};

use crate::backend::{Backend, Completion, Pending, ReduceOp, Work};
use crate::buffer::{wire_size, HostBuffer};
use crate::store::Store;
use crate::wire::{self, Deadline};

const MAGIC: u32 = 0x454d_4244; // "EMBD"
const COLL: u8 = 0;
const P2P: u8 = 1;

/// Operation codes in message headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum OpCode {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    ReduceScatter = 4,
    Barrier = 5,
    Send = 6,
}

impl OpCode {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "all_reduce",
            2 => "broadcast",
            3 => "all_gather",
            4 => "reduce_scatter",
            5 => "barrier",
            6 => "send",
            _ => "an unknown operation",
        }
    }
}

const HEADER: usize = 1 + 1 + 8 + 8;

fn dtype_code(d: DType) -> u8 {
    match d {
        DType::Bool => 0,
        DType::U8 => 1,
        DType::I32 => 2,
        DType::I64 => 3,
        DType::F16 => 4,
        DType::BF16 => 5,
        DType::F32 => 6,
        DType::F64 => 7,
    }
}

/// What a message must be: checked against the header that arrives.
#[derive(Debug, Clone, Copy)]
struct Expect {
    op: OpCode,
    dtype: DType,
    seq: u64,
    len: usize,
}

impl Expect {
    fn frame(&self, payload: &[u8]) -> Vec<u8> {
        let mut m = Vec::with_capacity(HEADER + payload.len());
        m.push(self.op as u8);
        m.push(dtype_code(self.dtype));
        m.extend_from_slice(&self.seq.to_le_bytes());
        m.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        m.extend_from_slice(payload);
        m
    }
}

type Job = Box<dyn FnOnce(&Inner) -> Result<()> + Send>;

/// The connections and state the worker threads share.
struct Inner {
    rank: usize,
    size: usize,
    timeout: Duration,
    /// Per peer rank (None at this rank's own index): the collective and p2p connections.
    coll: Vec<Option<TcpStream>>,
    p2p: Vec<Option<TcpStream>>,
    /// The first error, after which every operation fails (Note [CPU backend design]).
    broken: Mutex<Option<Error>>,
    /// Collectives issued so far: the sequence number in headers.
    seq: AtomicU64,
}

/// The CPU backend of one process group.
pub struct CpuBackend {
    inner: Arc<Inner>,
    queue: Mutex<Option<mpsc::Sender<(Job, Pending)>>>,
    send_queue: Mutex<Option<mpsc::Sender<(Job, Pending)>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

fn peer_name(rank: usize) -> String {
    format!("rank {rank}")
}

impl CpuBackend {
    /// Joins the group of `size` ranks as `rank`, meeting the others through `store` (keys
    /// `addr/<rank>`; give each group its own [`crate::PrefixStore`]) and listening on
    /// `listen_ip`, the address the peers will connect to. Fails after `timeout` if the others
    /// do not all arrive.
    pub fn new(
        store: &dyn Store,
        rank: usize,
        size: usize,
        timeout: Duration,
        listen_ip: IpAddr,
    ) -> Result<CpuBackend> {
        let deadline = Deadline::after(timeout, "init_process_group (gloo)");
        let listener = TcpListener::bind((listen_ip, 0)).map_err(|e| Error::Io {
            kind: e.kind(),
            msg: format!("gloo backend: cannot listen on {listen_ip}: {e}"),
        })?;
        let addr = listener.local_addr()?;
        store.set(&format!("addr/{rank}"), addr.to_string().as_bytes())?;

        let mut coll: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        let mut p2p: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // Lower ranks: read every address first (Note [CPU backend design]: store use ends
        // before the connections that rank 0 waits for), then connect.
        let keys: Vec<String> = (0..rank).map(|j| format!("addr/{j}")).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        if !refs.is_empty() {
            store.wait_timeout(&refs, deadline.remaining("the other ranks' addresses")?)?;
        }
        let mut addrs = Vec::with_capacity(rank);
        for k in &keys {
            addrs.push(String::from_utf8_lossy(&store.get(k)?).into_owned());
        }
        for (j, a) in addrs.iter().enumerate() {
            for channel in [COLL, P2P] {
                let s = wire::connect(a, &deadline)?;
                let mut hello = Vec::with_capacity(9);
                hello.extend_from_slice(&MAGIC.to_le_bytes());
                hello.extend_from_slice(&(rank as u32).to_le_bytes());
                hello.push(channel);
                wire::write_all(&s, &hello, &deadline, &peer_name(j))?;
                if channel == COLL {
                    coll[j] = Some(s);
                } else {
                    p2p[j] = Some(s);
                }
            }
        }
        // Higher ranks connect to us.
        listener.set_nonblocking(true)?;
        let mut missing = 2 * (size - 1 - rank);
        while missing > 0 {
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    s.set_nodelay(true).ok();
                    let mut hello = [0u8; 9];
                    wire::read_exact(&s, &mut hello, &deadline, "a connecting rank")?;
                    let magic = u32::from_le_bytes(hello[0..4].try_into().expect("4 bytes"));
                    let from = u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes")) as usize;
                    let slot = match hello[8] {
                        COLL => &mut coll,
                        _ => &mut p2p,
                    };
                    if magic != MAGIC || from <= rank || from >= size || slot[from].is_some() {
                        continue; // not one of ours: ignore the connection
                    }
                    slot[from] = Some(s);
                    missing -= 1;
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let left = deadline.remaining(&format!(
                        "{missing} connection(s) from higher ranks (are all {size} ranks running?)"
                    ))?;
                    std::thread::sleep(left.min(Duration::from_millis(2)));
                }
                Err(e) => return Err(e.into()),
            }
        }

        let inner = Arc::new(Inner {
            rank,
            size,
            timeout,
            coll,
            p2p,
            broken: Mutex::new(None),
            seq: AtomicU64::new(0),
        });
        let (tx, rx) = mpsc::channel::<(Job, Pending)>();
        let (stx, srx) = mpsc::channel::<(Job, Pending)>();
        let threads = vec![
            spawn_worker(format!("ember-gloo-{rank}"), inner.clone(), rx)?,
            spawn_worker(format!("ember-gloo-send-{rank}"), inner.clone(), srx)?,
        ];
        Ok(CpuBackend {
            inner,
            queue: Mutex::new(Some(tx)),
            send_queue: Mutex::new(Some(stx)),
            threads: Mutex::new(threads),
        })
    }

    /// `rank` is another rank of this group (the checks of [`crate::ProcessGroup`], repeated
    /// for callers of the backend itself, so that a bad rank is an error, not a panic).
    fn check_peer(&self, op: &'static str, rank: usize, may_be_self: bool) -> Result<()> {
        if rank >= self.inner.size || (!may_be_self && rank == self.inner.rank) {
            return Err(Error::invalid(
                op,
                format!(
                    "rank {rank} is not another rank of this group of {}",
                    self.inner.size
                ),
            ));
        }
        Ok(())
    }

    fn check_count(&self, op: &'static str, n: usize) -> Result<()> {
        if n != self.inner.size {
            return Err(Error::invalid(
                op,
                format!("expected {} tensors (one per rank), got {n}", self.inner.size),
            ));
        }
        Ok(())
    }

    fn enqueue(&self, sends: bool, job: Job) -> Result<Work> {
        let completion = Completion::new();
        let q = if sends { &self.send_queue } else { &self.queue };
        let q = q.lock().unwrap_or_else(|p| p.into_inner());
        let Some(q) = q.as_ref() else {
            return Err(Error::invalid(
                "ProcessGroup",
                "the process group was destroyed; create a new one",
            ));
        };
        // A send fails only when the worker is gone; the Pending then completes with an error.
        let _ = q.send((job, Pending(completion.clone())));
        Ok(Work::new(completion))
    }
}

fn spawn_worker(
    name: String,
    inner: Arc<Inner>,
    rx: mpsc::Receiver<(Job, Pending)>,
) -> Result<JoinHandle<()>> {
    Ok(std::thread::Builder::new().name(name).spawn(move || {
        for (job, pending) in rx {
            let broken = inner.broken.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let outcome = match broken {
                Some(e) => Err(broken_error(&e)),
                None => job(&inner).inspect_err(|e| inner.abort(e.clone())),
            };
            pending.complete(outcome);
        }
    })?)
}

fn broken_error(first: &Error) -> Error {
    match first {
        Error::Io { kind, msg } => Error::Io {
            kind: *kind,
            msg: format!("the process group is broken by an earlier failure ({msg}); destroy it and initialize a new one"),
        },
        other => Error::invalid(
            "ProcessGroup",
            format!("the process group is broken by an earlier failure ({other}); destroy it and initialize a new one"),
        ),
    }
}

impl Inner {
    /// Records the first error and shuts every connection down (Note [CPU backend design]).
    fn abort(&self, e: Error) {
        let mut b = self.broken.lock().unwrap_or_else(|p| p.into_inner());
        if b.is_none() {
            *b = Some(e);
        }
        drop(b);
        for s in self.coll.iter().chain(&self.p2p).flatten() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn conn(&self, peer: usize, channel: u8) -> &TcpStream {
        let c = if channel == COLL { &self.coll } else { &self.p2p };
        c[peer].as_ref().expect("a connection to every other rank")
    }

    /// Reads one message from `peer` and checks its header against `expect`.
    fn read_msg(&self, peer: usize, channel: u8, expect: &Expect, d: &Deadline) -> Result<Vec<u8>> {
        let s = self.conn(peer, channel);
        let name = peer_name(peer);
        let mut h = [0u8; HEADER];
        wire::read_exact(s, &mut h, d, &name)?;
        let (op, dt) = (h[0], h[1]);
        let seq = u64::from_le_bytes(h[2..10].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(h[10..18].try_into().expect("8 bytes")) as usize;
        let mismatch = |what: String| Error::invalid(expect_name(expect.op), what);
        if op != expect.op as u8 {
            return Err(mismatch(format!(
                "rank {peer} is running {} while rank {} runs {}; every rank must call the same collectives in the same order",
                OpCode::name(op),
                self.rank,
                expect_name(expect.op)
            )));
        }
        if seq != expect.seq {
            let what = if expect.op == OpCode::Send {
                "tag"
            } else {
                "collective number"
            };
            return Err(mismatch(format!(
                "rank {peer} sent {what} {seq} where rank {} expected {}; every rank must issue the same operations in the same order",
                self.rank, expect.seq
            )));
        }
        if dt != dtype_code(expect.dtype) || len != expect.len {
            return Err(mismatch(format!(
                "rank {peer} sent {len} bytes (dtype code {dt}) where rank {} expected {} bytes of {}; every rank must pass tensors of the same shape and dtype",
                self.rank, expect.len, expect.dtype
            )));
        }
        let mut payload = vec![0u8; len];
        wire::read_exact(s, &mut payload, d, &name)?;
        Ok(payload)
    }

    fn write_msg(&self, peer: usize, channel: u8, msg: &[u8], d: &Deadline) -> Result<()> {
        wire::write_all(self.conn(peer, channel), msg, d, &peer_name(peer))
    }

    /// Sends `msg` to `to` while receiving the message `expect` from `from` (one ring step).
    fn exchange(
        &self,
        to: usize,
        msg: Vec<u8>,
        from: usize,
        expect: &Expect,
        d: &Deadline,
    ) -> Result<Vec<u8>> {
        std::thread::scope(|s| {
            let writer = s.spawn(|| self.write_msg(to, COLL, &msg, d));
            let got = self.read_msg(from, COLL, expect, d);
            if let Err(e) = &got {
                // Unblock the writer at once: the group is broken anyway.
                self.abort(e.clone());
            }
            let wrote = writer
                .join()
                .unwrap_or_else(|_| Err(Error::invalid("ProcessGroup", "a send thread panicked")));
            let got = got?;
            wrote?;
            Ok(got)
        })
    }

    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Ring reduce-scatter of `buf` split in `chunks` (one per rank): afterwards this rank's
    /// chunk `rank` holds the reduction over all ranks.
    fn ring_reduce_scatter(
        &self,
        buf: &mut HostBuffer,
        chunks: &[std::ops::Range<usize>],
        op: ReduceOp,
        code: OpCode,
        seq: u64,
        d: &Deadline,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let ws = wire_size(buf.dtype());
        for s in 0..n - 1 {
            let send = (r + 2 * n - s - 1) % n;
            let recv = (r + 2 * n - s - 2) % n;
            let expect = Expect {
                op: code,
                dtype: buf.dtype(),
                seq,
                len: chunks[recv].len() * ws,
            };
            let msg = expect.frame(&buf.bytes(chunks[send].clone()));
            let got = self.exchange(right, msg, left, &expect, d)?;
            buf.reduce_from(chunks[recv].clone(), &got, op);
        }
        Ok(())
    }

    /// Ring all-gather: each rank starts with its chunk `rank` and ends with all of them.
    fn ring_all_gather(
        &self,
        buf: &mut HostBuffer,
        chunks: &[std::ops::Range<usize>],
        code: OpCode,
        seq: u64,
        d: &Deadline,
    ) -> Result<()> {
        let (n, r) = (self.size, self.rank);
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        let ws = wire_size(buf.dtype());
        for s in 0..n - 1 {
            let send = (r + n - s) % n;
            let recv = (r + n - s - 1) % n;
            let expect = Expect {
                op: code,
                dtype: buf.dtype(),
                seq,
                len: chunks[recv].len() * ws,
            };
            let msg = expect.frame(&buf.bytes(chunks[send].clone()));
            let got = self.exchange(right, msg, left, &expect, d)?;
            buf.assign_from(chunks[recv].clone(), &got);
        }
        Ok(())
    }

    fn deadline(&self, op: &'static str) -> Deadline {
        Deadline::after(self.timeout, op)
    }
}

fn expect_name(op: OpCode) -> &'static str {
    OpCode::name(op as u8)
}

/// `0..len` in `n` nearly equal consecutive ranges.
fn split(len: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|i| i * len / n..(i + 1) * len / n).collect()
}

/// `n` consecutive ranges of `each` elements.
fn blocks(each: usize, n: usize) -> Vec<std::ops::Range<usize>> {
    (0..n).map(|i| i * each..(i + 1) * each).collect()
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "gloo"
    }

    fn rank(&self) -> usize {
        self.inner.rank
    }

    fn size(&self) -> usize {
        self.inner.size
    }

    fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let t = tensor.clone();
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("all_reduce");
                let mut buf = HostBuffer::from_tensors("all_reduce", std::slice::from_ref(&t))?;
                if g.size > 1 {
                    let chunks = split(buf.len(), g.size);
                    g.ring_reduce_scatter(&mut buf, &chunks, op, OpCode::AllReduce, seq, &d)?;
                    g.ring_all_gather(&mut buf, &chunks, OpCode::AllReduce, seq, &d)?;
                }
                if op == ReduceOp::Avg {
                    buf.divide(g.size);
                }
                buf.write_into(0..buf.len(), &t)
            }),
        )
    }

    fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        self.check_peer("broadcast", root, true)?;
        let t = tensor.clone();
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("broadcast");
                let expect = Expect {
                    op: OpCode::Broadcast,
                    dtype: t.dtype(),
                    seq,
                    len: t.numel() * wire_size(t.dtype()),
                };
                if g.rank == root {
                    let buf = HostBuffer::from_tensors("broadcast", std::slice::from_ref(&t))?;
                    let msg = expect.frame(&buf.bytes(0..buf.len()));
                    for peer in (0..g.size).filter(|&p| p != root) {
                        g.write_msg(peer, COLL, &msg, &d)?;
                    }
                    Ok(())
                } else {
                    let got = g.read_msg(root, COLL, &expect, &d)?;
                    let mut buf = HostBuffer::zeros(t.dtype(), t.numel());
                    buf.assign_from(0..t.numel(), &got);
                    buf.write_into(0..t.numel(), &t)
                }
            }),
        )
    }

    fn all_gather(&self, outputs: &[Tensor], input: &Tensor) -> Result<Work> {
        self.check_count("all_gather", outputs.len())?;
        let (outputs, input) = (outputs.to_vec(), input.clone());
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("all_gather");
                let each = input.numel();
                let chunks = blocks(each, g.size);
                let mine = HostBuffer::from_tensors("all_gather", std::slice::from_ref(&input))?;
                let mut buf = HostBuffer::zeros(input.dtype(), each * g.size);
                buf.assign_from(chunks[g.rank].clone(), &mine.bytes(0..each));
                g.ring_all_gather(&mut buf, &chunks, OpCode::AllGather, seq, &d)?;
                for (out, range) in outputs.iter().zip(chunks) {
                    buf.write_into(range, out)?;
                }
                Ok(())
            }),
        )
    }

    fn reduce_scatter(&self, output: &Tensor, inputs: &[Tensor], op: ReduceOp) -> Result<Work> {
        self.check_count("reduce_scatter", inputs.len())?;
        if inputs.iter().any(|i| i.numel() != output.numel()) {
            return Err(Error::invalid(
                "reduce_scatter",
                "every input must have as many elements as the output",
            ));
        }
        let (output, inputs) = (output.clone(), inputs.to_vec());
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("reduce_scatter");
                let each = output.numel();
                let chunks = blocks(each, g.size);
                let mut buf = HostBuffer::from_tensors("reduce_scatter", &inputs)?;
                g.ring_reduce_scatter(&mut buf, &chunks, op, OpCode::ReduceScatter, seq, &d)?;
                let mine = chunks[g.rank].clone();
                if op == ReduceOp::Avg {
                    let mut part = HostBuffer::zeros(buf.dtype(), each);
                    part.assign_from(0..each, &buf.bytes(mine));
                    part.divide(g.size);
                    return part.write_into(0..each, &output);
                }
                buf.write_into(mine, &output)
            }),
        )
    }

    fn all_gather_into_tensor(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let each = input.numel();
        if output.numel() != each * self.inner.size {
            return Err(Error::invalid(
                "all_gather_into_tensor",
                format!(
                    "the output has {} elements where {} ranks × {each} are needed",
                    output.numel(),
                    self.inner.size
                ),
            ));
        }
        let (output, input) = (output.clone(), input.clone());
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("all_gather_into_tensor");
                let chunks = blocks(each, g.size);
                let mine = HostBuffer::from_tensors("all_gather_into_tensor", std::slice::from_ref(&input))?;
                let mut buf = HostBuffer::zeros(input.dtype(), each * g.size);
                buf.assign_from(chunks[g.rank].clone(), &mine.bytes(0..each));
                g.ring_all_gather(&mut buf, &chunks, OpCode::AllGather, seq, &d)?;
                buf.write_into(0..buf.len(), &output)
            }),
        )
    }

    fn reduce_scatter_tensor(&self, output: &Tensor, input: &Tensor, op: ReduceOp) -> Result<Work> {
        let each = output.numel();
        if input.numel() != each * self.inner.size {
            return Err(Error::invalid(
                "reduce_scatter_tensor",
                format!(
                    "the input has {} elements where {} ranks × {each} are needed",
                    input.numel(),
                    self.inner.size
                ),
            ));
        }
        let (output, input) = (output.clone(), input.clone());
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("reduce_scatter_tensor");
                let chunks = blocks(each, g.size);
                let mut buf =
                    HostBuffer::from_tensors("reduce_scatter_tensor", std::slice::from_ref(&input))?;
                g.ring_reduce_scatter(&mut buf, &chunks, op, OpCode::ReduceScatter, seq, &d)?;
                let mut part = HostBuffer::zeros(buf.dtype(), each);
                part.assign_from(0..each, &buf.bytes(chunks[g.rank].clone()));
                if op == ReduceOp::Avg {
                    part.divide(g.size);
                }
                part.write_into(0..each, &output)
            }),
        )
    }

    fn barrier(&self) -> Result<Work> {
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let seq = g.next_seq();
                let d = g.deadline("barrier");
                if g.size > 1 {
                    let mut buf = HostBuffer::U8(vec![1; g.size]);
                    let chunks = split(g.size, g.size);
                    g.ring_reduce_scatter(&mut buf, &chunks, ReduceOp::Sum, OpCode::Barrier, seq, &d)?;
                    g.ring_all_gather(&mut buf, &chunks, OpCode::Barrier, seq, &d)?;
                }
                Ok(())
            }),
        )
    }

    fn send(&self, tensor: &Tensor, dst: usize, tag: u32) -> Result<Work> {
        self.check_peer("send", dst, false)?;
        let t = tensor.clone();
        self.enqueue(
            true,
            Box::new(move |g: &Inner| {
                let d = g.deadline("send");
                let buf = HostBuffer::from_tensors("send", std::slice::from_ref(&t))?;
                let expect = Expect {
                    op: OpCode::Send,
                    dtype: t.dtype(),
                    seq: tag as u64,
                    len: 0,
                };
                g.write_msg(dst, P2P, &expect.frame(&buf.bytes(0..buf.len())), &d)
            }),
        )
    }

    fn recv(&self, tensor: &Tensor, src: usize, tag: u32) -> Result<Work> {
        self.check_peer("recv", src, false)?;
        let t = tensor.clone();
        self.enqueue(
            false,
            Box::new(move |g: &Inner| {
                let d = g.deadline("recv");
                let expect = Expect {
                    op: OpCode::Send,
                    dtype: t.dtype(),
                    seq: tag as u64,
                    len: t.numel() * wire_size(t.dtype()),
                };
                let got = g.read_msg(src, P2P, &expect, &d)?;
                let mut buf = HostBuffer::zeros(t.dtype(), t.numel());
                buf.assign_from(0..t.numel(), &got);
                buf.write_into(0..t.numel(), &t)
            }),
        )
    }

    fn shutdown(&self) {
        self.inner.abort(Error::invalid(
            "ProcessGroup",
            "the process group was destroyed (destroy_process_group)",
        ));
        self.queue.lock().unwrap_or_else(|p| p.into_inner()).take();
        self.send_queue.lock().unwrap_or_else(|p| p.into_inner()).take();
        for h in self.threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = h.join();
        }
    }
}

impl Drop for CpuBackend {
    fn drop(&mut self) {
        self.shutdown();
    }
}
