//! Blocking TCP I/O bounded by a deadline, shared by the store and the CPU backend.
//!
//! Every read and write of ember-distributed goes through [`read_exact`] and [`write_all`]: each
//! system call is given the time left until the operation's [`Deadline`], so no call waits past
//! it, and a peer that closed its end (its process exited or crashed) is an error at once rather
//! than a hang. Errors are [`Error::Io`] with kind `TimedOut` (the deadline passed),
//! `UnexpectedEof` / `ConnectionReset` / `BrokenPipe` (the peer is gone), so callers can match on
//! the kind; the message names the operation, the peer and what to check.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use ember_core::Error;

/// The point in time by which an operation must have finished, with what it was for.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
    timeout: Duration,
    op: &'static str,
}

impl Deadline {
    /// `timeout` from now, for the operation `op` (named in errors).
    pub fn after(timeout: Duration, op: &'static str) -> Deadline {
        let now = Instant::now();
        Deadline {
            // A timeout past what `Instant` holds (`Duration::MAX`) means "no deadline": a
            // century stands for it.
            at: now
                .checked_add(timeout)
                .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600)),
            timeout,
            op,
        }
    }

    /// The time left, or the timeout error once none is.
    pub fn remaining(&self, waiting_for: &str) -> ember_core::Result<Duration> {
        let left = self.at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(self.timed_out(waiting_for))
        } else {
            Ok(left)
        }
    }

    /// The error for this deadline having passed while waiting for `waiting_for`.
    pub fn timed_out(&self, waiting_for: &str) -> Error {
        timeout_error(self.op, self.timeout, waiting_for)
    }
}

/// [`Error::Io`] of kind `TimedOut` for `op`, which waited `timeout` for `waiting_for`.
pub fn timeout_error(op: &'static str, timeout: Duration, waiting_for: &str) -> Error {
    Error::Io {
        kind: ErrorKind::TimedOut,
        msg: format!(
            "{op} timed out after {timeout:?} waiting for {waiting_for}; check that every rank \
             reached the same call and that the peer is alive, or raise the timeout"
        ),
    }
}

/// The error for a connection to `peer` that failed (closed, reset) during `op`.
pub fn peer_error(op: &'static str, peer: &str, e: &std::io::Error) -> Error {
    let kind = e.kind();
    let why = match kind {
        ErrorKind::UnexpectedEof
        | ErrorKind::ConnectionReset
        | ErrorKind::BrokenPipe
        | ErrorKind::ConnectionAborted => {
            "the connection was closed: the peer process probably exited or crashed (look at its output)"
        }
        _ => "the connection failed",
    };
    Error::Io {
        kind,
        msg: format!("{op}: {why}; talking to {peer}: {e}"),
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)
}

/// Reads exactly `buf.len()` bytes from `stream` by `deadline`.
pub fn read_exact(
    mut stream: &TcpStream,
    mut buf: &mut [u8],
    deadline: &Deadline,
    peer: &str,
) -> ember_core::Result<()> {
    while !buf.is_empty() {
        let left = deadline.remaining(peer)?;
        stream
            .set_read_timeout(Some(left))
            .map_err(|e| peer_error(deadline.op, peer, &e))?;
        match stream.read(buf) {
            Ok(0) => {
                let eof = std::io::Error::new(ErrorKind::UnexpectedEof, "end of stream");
                return Err(peer_error(deadline.op, peer, &eof));
            }
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted || is_timeout(&e) => continue,
            Err(e) => return Err(peer_error(deadline.op, peer, &e)),
        }
    }
    Ok(())
}

/// Writes all of `buf` to `stream` by `deadline`.
pub fn write_all(
    mut stream: &TcpStream,
    mut buf: &[u8],
    deadline: &Deadline,
    peer: &str,
) -> ember_core::Result<()> {
    while !buf.is_empty() {
        let left = deadline.remaining(peer)?;
        stream
            .set_write_timeout(Some(left))
            .map_err(|e| peer_error(deadline.op, peer, &e))?;
        match stream.write(buf) {
            Ok(0) => {
                let closed = std::io::Error::new(ErrorKind::WriteZero, "wrote zero bytes");
                return Err(peer_error(deadline.op, peer, &closed));
            }
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted || is_timeout(&e) => continue,
            Err(e) => return Err(peer_error(deadline.op, peer, &e)),
        }
    }
    Ok(())
}

/// Connects to `addr`, retrying refused connections (the listener may not be up yet) until
/// `deadline`.
pub fn connect(addr: &str, deadline: &Deadline) -> ember_core::Result<TcpStream> {
    use std::net::ToSocketAddrs;
    loop {
        let left = deadline.remaining(&format!("a connection to {addr}"))?;
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map(Iterator::collect)
            .map_err(|e| Error::Io {
                kind: e.kind(),
                msg: format!(
                    "{}: cannot resolve {addr:?}: {e}; check the host name",
                    deadline.op
                ),
            })?;
        let mut last = None;
        for a in &addrs {
            match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                Ok(s) => {
                    s.set_nodelay(true).ok();
                    return Ok(s);
                }
                Err(e) => last = Some(e),
            }
        }
        if let Some(e) = &last {
            if !matches!(
                e.kind(),
                ErrorKind::ConnectionRefused
                    | ErrorKind::TimedOut
                    | ErrorKind::WouldBlock
                    | ErrorKind::Interrupted
            ) {
                return Err(Error::Io {
                    kind: e.kind(),
                    msg: format!("{}: cannot connect to {addr}: {e}", deadline.op),
                });
            }
        }
        std::thread::sleep(Duration::from_millis(20).min(left));
    }
}

/// Appends a u32-length-prefixed byte string.
pub fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// Where a message is read from: a connection ([`Conn`]), or bytes already in memory (a
/// `&[u8]`, for tests and the fuzz targets). The message decoders below take either.
pub trait Source {
    /// Fills `buf` entirely, or fails: the deadline passed, the peer closed, the bytes ended.
    fn fill(&mut self, buf: &mut [u8]) -> ember_core::Result<()>;

    /// "op: peer" for errors about the data read.
    fn context(&self) -> String;
}

/// A connection read within a deadline, for the decoders.
pub struct Conn<'a> {
    pub stream: &'a TcpStream,
    pub deadline: &'a Deadline,
    pub peer: &'a str,
}

impl Source for Conn<'_> {
    fn fill(&mut self, buf: &mut [u8]) -> ember_core::Result<()> {
        read_exact(self.stream, buf, self.deadline, self.peer)
    }

    fn context(&self) -> String {
        format!("{}: {}", self.deadline.op, self.peer)
    }
}

impl Source for &[u8] {
    fn fill(&mut self, buf: &mut [u8]) -> ember_core::Result<()> {
        if self.len() < buf.len() {
            return Err(Error::Io {
                kind: ErrorKind::UnexpectedEof,
                msg: format!(
                    "the message ends after {} more bytes, {} needed",
                    self.len(),
                    buf.len()
                ),
            });
        }
        let (head, rest) = self.split_at(buf.len());
        buf.copy_from_slice(head);
        *self = rest;
        Ok(())
    }

    fn context(&self) -> String {
        "bytes in memory".into()
    }
}

/// Bytes a length-prefixed string grows by at a time: its buffer follows the bytes that came,
/// never a length merely claimed (a peer that announces 256 MiB and sends nothing costs
/// nothing).
const READ_CHUNK: usize = 64 << 10;

/// Reads a u32-length-prefixed byte string (at most `max` bytes).
pub fn read_bytes(src: &mut (impl Source + ?Sized), max: usize) -> ember_core::Result<Vec<u8>> {
    let len = read_u32(src)? as usize;
    if len > max {
        return Err(Error::Io {
            kind: ErrorKind::InvalidData,
            msg: format!(
                "{} sent a {len}-byte string, more than {max}; is it an ember peer?",
                src.context()
            ),
        });
    }
    let mut buf = Vec::with_capacity(len.min(READ_CHUNK));
    while buf.len() < len {
        let start = buf.len();
        buf.resize(start + (len - start).min(READ_CHUNK), 0);
        src.fill(&mut buf[start..])?;
    }
    Ok(buf)
}

pub fn read_u32(src: &mut (impl Source + ?Sized)) -> ember_core::Result<u32> {
    let mut b = [0; 4];
    src.fill(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

pub fn read_u64(src: &mut (impl Source + ?Sized)) -> ember_core::Result<u64> {
    let mut b = [0; 8];
    src.fill(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

pub fn read_u8(src: &mut (impl Source + ?Sized)) -> ember_core::Result<u8> {
    let mut b = [0; 1];
    src.fill(&mut b)?;
    Ok(b[0])
}
