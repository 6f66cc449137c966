//! The rendezvous key-value store (`torch.distributed.Store`, `TCPStore`, `PrefixStore`).
//!
//! A [`TcpStore`] is a client of one store server; the client created with `is_master` also
//! runs the server (on rank 0, or in a launcher). Ranks use it to find each other: each
//! publishes its address under a key and waits for the others' keys.
//!
//! Semantics follow PyTorch's TCPStore: [`Store::get`] waits for the key up to the store's
//! timeout, [`Store::add`] keeps the counter as decimal text (so `get` of a counter gives
//! `b"3"`), [`Store::compare_set`] sets only when the current value equals `expected` (or, for
//! a missing key, when `expected` is empty) and returns the value the key then has.
//!
//! Note [Store failures]: every call is bounded. Blocking requests (`get`, `wait`) carry their
//! timeout to the server, which answers "timed out" when it passes; the client itself waits one
//! second longer for that answer, so a server that died or hangs gives an [`Error::Io`] of kind
//! `TimedOut` or `UnexpectedEof` / `ConnectionReset`, never a hang. Timeouts are kind
//! `TimedOut`; a closed server connection is reported as such.
//!
//! The protocol (one TCP connection per client, one request at a time): a command byte, then
//! u32-length-prefixed strings and little-endian integers; the answer is a status byte (0 ok,
//! 1 timed out) followed by the command's result. It is ember's own, not PyTorch's wire format.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ember_core::{Error, Result};

use crate::wire::{self, Deadline};

/// PyTorch's default store timeout (`default_pg_timeout`): 30 minutes.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// The largest key or value the server accepts (bytes).
const MAX_VALUE: usize = 256 << 20;

/// A key-value store shared by all ranks (`torch.distributed.Store`).
pub trait Store: Send + Sync {
    /// Sets `key` to `value`, replacing any value; wakes waiters on `key`.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;

    /// The value of `key`, waiting up to [`Store::timeout`] for it to be set.
    fn get(&self, key: &str) -> Result<Vec<u8>>;

    /// Adds `amount` to the integer at `key` (0 when missing) and returns the new value.
    fn add(&self, key: &str, amount: i64) -> Result<i64>;

    /// Sets `key` to `desired` if its value is `expected` (a missing key matches an empty
    /// `expected`); returns the value `key` has afterwards (PyTorch's `compare_set`).
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;

    /// Waits until every key in `keys` is set, or fails with kind `TimedOut` after `timeout`.
    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()>;

    /// Waits until every key in `keys` is set, up to [`Store::timeout`].
    fn wait(&self, keys: &[&str]) -> Result<()> {
        self.wait_timeout(keys, self.timeout())
    }

    /// Whether every key in `keys` is set, without waiting.
    fn check(&self, keys: &[&str]) -> Result<bool>;

    /// Deletes `key`; true when it existed.
    fn delete_key(&self, key: &str) -> Result<bool>;

    /// The number of keys in the whole store.
    fn num_keys(&self) -> Result<usize>;

    /// The timeout of blocking calls without one of their own.
    fn timeout(&self) -> Duration;

    /// Sets the timeout of blocking calls without one of their own.
    fn set_timeout(&self, timeout: Duration);

    /// The address of this host's interface that reaches the store, when the store knows it;
    /// a CPU backend listens there for its peers (default: `None`, meaning localhost).
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        None
    }
}

// Command bytes of the protocol.
const SET: u8 = 1;
const GET: u8 = 2;
const ADD: u8 = 3;
const COMPARE_SET: u8 = 4;
const WAIT: u8 = 5;
const CHECK: u8 = 6;
const DELETE: u8 = 7;
const NUM_KEYS: u8 = 8;

const OK: u8 = 0;
const TIMED_OUT: u8 = 1;

/// A client of a TCP store server, which it also runs when created as master (`TCPStore`).
///
/// ```
/// use std::time::Duration;
/// use ember_distributed::{Store, TcpStore};
/// # fn main() -> ember_core::Result<()> {
/// let master = TcpStore::new("127.0.0.1", 0, true, Duration::from_secs(5))?; // 0: a free port
/// let client = TcpStore::new("127.0.0.1", master.port(), false, Duration::from_secs(5))?;
/// client.set("first", b"hello")?;
/// assert_eq!(master.get("first")?, b"hello");
/// assert_eq!(master.add("count", 2)?, 2);
/// assert_eq!(client.get("count")?, b"2");
/// # Ok(())
/// # }
/// ```
pub struct TcpStore {
    conn: Mutex<TcpStream>,
    peer: String,
    port: u16,
    timeout: Mutex<Duration>,
    // Kept alive for as long as this client: the master's server.
    _server: Option<Arc<StoreServer>>,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TcpStore({}, master={})", self.peer, self._server.is_some())
    }
}

impl TcpStore {
    /// A client of the store at `host:port`; with `is_master`, first starts the server on `port`
    /// (all interfaces; 0 picks a free port, see [`TcpStore::port`]). Connecting retries until
    /// `timeout` so that clients may start before the master.
    pub fn new(host: &str, port: u16, is_master: bool, timeout: Duration) -> Result<TcpStore> {
        let server = if is_master {
            Some(Arc::new(StoreServer::start(port)?))
        } else {
            None
        };
        let port = server.as_ref().map_or(port, |s| s.port);
        let host = if server.is_some() && (host.is_empty() || host == "0.0.0.0") {
            "127.0.0.1"
        } else {
            host
        };
        let peer = format!("the store at {host}:{port}");
        let deadline = Deadline::after(timeout, "TcpStore::new");
        let conn = wire::connect(&format!("{host}:{port}"), &deadline).map_err(|e| match e {
            Error::Io {
                kind: ErrorKind::TimedOut,
                ..
            } => wire::timeout_error(
                "TcpStore::new",
                timeout,
                &format!("{peer} (is rank 0 / the master running? check MASTER_ADDR and MASTER_PORT)"),
            ),
            e => e,
        })?;
        Ok(TcpStore {
            conn: Mutex::new(conn),
            peer,
            port,
            timeout: Mutex::new(timeout),
            _server: server,
        })
    }

    /// The server's port (the one picked when created as master on port 0).
    pub fn port(&self) -> u16 {
        self.port
    }

    fn lock_conn(&self) -> std::sync::MutexGuard<'_, TcpStream> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `request` and returns the status byte, leaving the result to `read` within the
    /// same deadline. `wait` is how long the server may block on it.
    fn call<T>(
        &self,
        op: &'static str,
        request: &[u8],
        wait: Duration,
        read: impl FnOnce(&mut dyn wire::Source) -> Result<T>,
    ) -> Result<T> {
        let conn = self.lock_conn();
        let deadline = Deadline::after(wait.saturating_add(Duration::from_secs(1)), op);
        wire::write_all(&conn, request, &deadline, &self.peer)?;
        let mut src = wire::Conn {
            stream: &conn,
            deadline: &deadline,
            peer: &self.peer,
        };
        match wire::read_u8(&mut src)? {
            OK => read(&mut src),
            TIMED_OUT => Err(wire::timeout_error(op, wait, "keys in the store")),
            other => Err(Error::Io {
                kind: ErrorKind::InvalidData,
                msg: format!(
                    "{op}: {} answered with unknown status {other}; is it an ember store?",
                    self.peer
                ),
            }),
        }
    }
}

fn request(cmd: u8, strings: &[&[u8]]) -> Vec<u8> {
    let mut out = vec![cmd];
    out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    for s in strings {
        wire::put_bytes(&mut out, s);
    }
    out
}

fn with_millis(mut req: Vec<u8>, d: Duration) -> Vec<u8> {
    req.extend_from_slice(&(d.as_millis().min(u64::MAX as u128) as u64).to_le_bytes());
    req
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let req = with_millis(request(SET, &[key.as_bytes(), value]), Duration::ZERO);
        self.call("Store::set", &req, Duration::ZERO, |_| Ok(()))
    }

    fn get(&self, key: &str) -> Result<Vec<u8>> {
        let t = self.timeout();
        let req = with_millis(request(GET, &[key.as_bytes()]), t);
        self.call("Store::get", &req, t, answer::get)
            .map_err(|e| name_keys(e, &[key]))
    }

    fn add(&self, key: &str, amount: i64) -> Result<i64> {
        let req = with_millis(
            request(ADD, &[key.as_bytes(), &amount.to_le_bytes()]),
            Duration::ZERO,
        );
        self.call("Store::add", &req, Duration::ZERO, answer::add)
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let req = with_millis(
            request(COMPARE_SET, &[key.as_bytes(), expected, desired]),
            Duration::ZERO,
        );
        self.call("Store::compare_set", &req, Duration::ZERO, answer::compare_set)
    }

    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let strings: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let req = with_millis(request(WAIT, &strings), timeout);
        self.call("Store::wait", &req, timeout, |_| Ok(()))
            .map_err(|e| name_keys(e, keys))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let strings: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
        let req = with_millis(request(CHECK, &strings), Duration::ZERO);
        self.call("Store::check", &req, Duration::ZERO, answer::flag)
    }

    fn delete_key(&self, key: &str) -> Result<bool> {
        let req = with_millis(request(DELETE, &[key.as_bytes()]), Duration::ZERO);
        self.call("Store::delete_key", &req, Duration::ZERO, answer::flag)
    }

    fn num_keys(&self) -> Result<usize> {
        let req = with_millis(request(NUM_KEYS, &[]), Duration::ZERO);
        self.call("Store::num_keys", &req, Duration::ZERO, answer::num_keys)
    }

    fn timeout(&self) -> Duration {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set_timeout(&self, timeout: Duration) {
        *self.timeout.lock().unwrap_or_else(|p| p.into_inner()) = timeout;
    }

    /// The local address of this client's connection: the interface through which this
    /// process reaches the master, which the other ranks can usually reach too.
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.lock_conn().local_addr().ok().map(|a| a.ip())
    }
}

/// Adds the keys waited for to a timeout's message.
fn name_keys(e: Error, keys: &[&str]) -> Error {
    match e {
        Error::Io {
            kind: ErrorKind::TimedOut,
            msg,
        } => Error::Io {
            kind: ErrorKind::TimedOut,
            msg: format!("{msg} (keys {keys:?})"),
        },
        e => e,
    }
}

/// Keys under a prefix of another store (`torch.distributed.PrefixStore`): each process group
/// keeps its rendezvous keys apart this way. `num_keys` counts the whole store, as PyTorch's.
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Keys of `inner` under `prefix` + "/".
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> PrefixStore {
        PrefixStore {
            prefix: prefix.into(),
            inner,
        }
    }

    fn key(&self, key: &str) -> String {
        format!("{}/{}", self.prefix, key)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key))
    }
    fn add(&self, key: &str, amount: i64) -> Result<i64> {
        self.inner.add(&self.key(key), amount)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }
    fn wait_timeout(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.wait_timeout(&refs, timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        self.inner.check(&refs)
    }
    fn delete_key(&self, key: &str) -> Result<bool> {
        self.inner.delete_key(&self.key(key))
    }
    fn num_keys(&self) -> Result<usize> {
        self.inner.num_keys()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
    fn set_timeout(&self, timeout: Duration) {
        self.inner.set_timeout(timeout)
    }
    fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.inner.local_ip()
    }
}

/// The store's data: the map, and a condition variable signalled on every change.
#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// The server half: an accept thread and one thread per client connection. Dropping it stops
/// the accept thread and closes every client connection (clients then get errors, not hangs).
/// `ember-run` holds one alone for its workers (Note [Launcher store] in `launch.rs`).
pub(crate) struct StoreServer {
    port: u16,
    stop: Arc<AtomicBool>,
    clients: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Listens on `port` (0: a free one) on every interface.
    pub(crate) fn start(port: u16) -> Result<StoreServer> {
        let listener = TcpListener::bind(("0.0.0.0", port)).map_err(|e| Error::Io {
            kind: e.kind(),
            msg: format!(
                "TcpStore: cannot listen on port {port}: {e}; pick another MASTER_PORT (or 0 for a free one)"
            ),
        })?;
        let port = listener.local_addr()?.port();
        let stop = Arc::new(AtomicBool::new(false));
        let clients = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Shared::default());
        let accept = {
            let (stop, clients) = (stop.clone(), clients.clone());
            std::thread::Builder::new()
                .name("ember-store-accept".into())
                .spawn(move || accept_loop(listener, stop, clients, shared))?
        };
        Ok(StoreServer {
            port,
            stop,
            clients,
            accept: Some(accept),
        })
    }

    /// The port it listens on.
    pub(crate) fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept with a connection of our own.
        let _ = TcpStream::connect_timeout(&([127, 0, 0, 1], self.port).into(), Duration::from_secs(1));
        for c in self.clients.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = c.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    clients: Arc<Mutex<Vec<TcpStream>>>,
    shared: Arc<Shared>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(conn) = conn else { continue };
        conn.set_nodelay(true).ok();
        if let Ok(c) = conn.try_clone() {
            clients.lock().unwrap_or_else(|p| p.into_inner()).push(c);
        }
        let shared = shared.clone();
        let _ = std::thread::Builder::new()
            .name("ember-store-client".into())
            .spawn(move || {
                while serve_one(&conn, &shared).is_ok() {}
                let _ = conn.shutdown(Shutdown::Both);
            });
    }
}

/// How long the server waits for the rest of a request once its first byte came: a client
/// sends a request in one write.
const REQUEST_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// Serves one request; `Err` when the client is gone or spoke garbage (the connection closes).
fn serve_one(conn: &TcpStream, shared: &Shared) -> Result<()> {
    let peer = "a store client";
    // The first byte waits as long as the client stays connected.
    let cmd = {
        let mut b = [0u8; 1];
        let mut r = conn;
        conn.set_read_timeout(None)?;
        match std::io::Read::read(&mut r, &mut b)? {
            0 => return Err(Error::invalid("store server", "client closed")),
            _ => b[0],
        }
    };
    let d = Deadline::after(REQUEST_READ_TIMEOUT, "store server");
    let request = Request::read(
        cmd,
        &mut wire::Conn {
            stream: conn,
            deadline: &d,
            peer,
        },
    )?;
    let out = shared.answer(&request)?;
    wire::write_all(
        conn,
        &out,
        &Deadline::after(REQUEST_READ_TIMEOUT, "store server"),
        peer,
    )
}

/// The most strings one request may carry (keys of a `wait`).
const MAX_STRINGS: usize = 1 << 20;

/// A request as the server reads it: the command byte, its strings, and how long the server
/// may block on it.
#[derive(Debug)]
struct Request {
    cmd: u8,
    strings: Vec<Vec<u8>>,
    wait: Duration,
}

impl Request {
    /// The rest of a request whose command byte `cmd` came. Counts and lengths are checked
    /// before use, and storage grows with the bytes that arrive, never with a claimed size.
    fn read(cmd: u8, src: &mut impl wire::Source) -> Result<Request> {
        let n = wire::read_u32(src)? as usize;
        if n > MAX_STRINGS {
            return Err(Error::invalid(
                "store server",
                format!("a request of {n} strings, more than {MAX_STRINGS}"),
            ));
        }
        let mut strings = Vec::new();
        for _ in 0..n {
            strings.push(wire::read_bytes(src, MAX_VALUE)?);
        }
        let wait = Duration::from_millis(wire::read_u64(src)?);
        Ok(Request { cmd, strings, wait })
    }

    /// Argument `i` as a key.
    fn key(&self, i: usize) -> Result<String> {
        let s = self
            .strings
            .get(i)
            .ok_or_else(|| Error::invalid("store server", format!("missing argument {i}")))?;
        String::from_utf8(s.clone()).map_err(|_| Error::invalid("store server", "key is not UTF-8"))
    }

    /// Every argument as a key.
    fn keys(&self) -> Result<Vec<String>> {
        (0..self.strings.len()).map(|i| self.key(i)).collect()
    }
}

impl Shared {
    /// The answer to `req` (status byte, then the command's result), after applying it; a
    /// `get` or `wait` blocks until its keys are set or its wait passed.
    fn answer(&self, req: &Request) -> Result<Vec<u8>> {
        let mut out = vec![OK];
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        match req.cmd {
            SET => {
                let value = req.strings.get(1).cloned().unwrap_or_default();
                map.insert(req.key(0)?, value);
                self.changed.notify_all();
            }
            GET | WAIT => {
                let keys = req.keys()?;
                if req.cmd == GET && keys.is_empty() {
                    return Err(Error::invalid("store server", "a get of no key"));
                }
                let now = Instant::now();
                // A wait past what `Instant` holds waits "forever": a century.
                let until = now
                    .checked_add(req.wait)
                    .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600));
                loop {
                    if keys.iter().all(|k| map.contains_key(k)) {
                        if req.cmd == GET {
                            wire::put_bytes(&mut out, &map[&keys[0]]);
                        }
                        break;
                    }
                    let left = until.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        out = vec![TIMED_OUT];
                        break;
                    }
                    map = self
                        .changed
                        .wait_timeout(map, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
            }
            ADD => {
                let k = req.key(0)?;
                let amount = req
                    .strings
                    .get(1)
                    .and_then(|b| <[u8; 8]>::try_from(b.as_slice()).ok())
                    .map(i64::from_le_bytes)
                    .ok_or_else(|| Error::invalid("store server", "bad add amount"))?;
                let current = map
                    .get(&k)
                    .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse::<i64>().ok())
                    .unwrap_or(0);
                let new = current.wrapping_add(amount);
                map.insert(k, new.to_string().into_bytes());
                self.changed.notify_all();
                out.extend_from_slice(&(new as u64).to_le_bytes());
            }
            COMPARE_SET => {
                let k = req.key(0)?;
                let (expected, desired) = (
                    req.strings.get(1).cloned().unwrap_or_default(),
                    req.strings.get(2).cloned().unwrap_or_default(),
                );
                let value = match map.get(&k) {
                    None if expected.is_empty() => {
                        map.insert(k, desired.clone());
                        self.changed.notify_all();
                        desired
                    }
                    None => expected,
                    Some(v) if *v == expected => {
                        map.insert(k, desired.clone());
                        self.changed.notify_all();
                        desired
                    }
                    Some(v) => v.clone(),
                };
                wire::put_bytes(&mut out, &value);
            }
            CHECK => {
                let keys = req.keys()?;
                out.push(keys.iter().all(|k| map.contains_key(k)) as u8);
            }
            DELETE => {
                let existed = map.remove(&req.key(0)?).is_some();
                out.push(existed as u8);
            }
            NUM_KEYS => out.extend_from_slice(&(map.len() as u64).to_le_bytes()),
            _ => return Err(Error::invalid("store server", "unknown command")),
        }
        Ok(out)
    }
}

/// The client's decoders of each command's result (after the status byte).
mod answer {
    use super::{wire, Result, MAX_VALUE};

    pub(super) fn get(src: &mut dyn wire::Source) -> Result<Vec<u8>> {
        wire::read_bytes(src, MAX_VALUE)
    }

    pub(super) fn compare_set(src: &mut dyn wire::Source) -> Result<Vec<u8>> {
        wire::read_bytes(src, MAX_VALUE)
    }

    pub(super) fn add(src: &mut dyn wire::Source) -> Result<i64> {
        Ok(wire::read_u64(src)? as i64)
    }

    pub(super) fn flag(src: &mut dyn wire::Source) -> Result<bool> {
        Ok(wire::read_u8(src)? != 0)
    }

    pub(super) fn num_keys(src: &mut dyn wire::Source) -> Result<usize> {
        usize::try_from(wire::read_u64(src)?)
            .map_err(|_| ember_core::Error::invalid("Store::num_keys", "a count past usize"))
    }
}

/// Entry points for the fuzz target `store` (`fuzz/`): the wire format's decoders run on bytes
/// in memory. Not an API: hidden, and free to change with the protocol.
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// Serves every request in `client_bytes` (as a server reads them off one connection)
    /// against a fresh store whose `get`/`wait` never block (each request's wait is taken as
    /// zero), then decodes `server_bytes` as each command's answer; returns the answers served.
    /// Bad bytes must give errors, never panics, hangs or allocations beyond the bytes given.
    pub fn decode(client_bytes: &[u8], server_bytes: &[u8]) -> Vec<Vec<u8>> {
        let shared = Shared::default();
        let mut src = client_bytes;
        let mut answers = Vec::new();
        while let Ok(cmd) = wire::read_u8(&mut src) {
            let Ok(mut req) = Request::read(cmd, &mut src) else {
                break;
            };
            req.wait = Duration::ZERO;
            match shared.answer(&req) {
                Ok(a) => answers.push(a),
                Err(_) => break,
            }
        }
        for cmd in [GET, ADD, COMPARE_SET, CHECK, DELETE, NUM_KEYS] {
            let mut src = server_bytes;
            let _ = match wire::read_u8(&mut src) {
                Ok(OK) => match cmd {
                    GET => answer::get(&mut src).map(drop),
                    COMPARE_SET => answer::compare_set(&mut src).map(drop),
                    ADD => answer::add(&mut src).map(drop),
                    NUM_KEYS => answer::num_keys(&mut src).map(drop),
                    _ => answer::flag(&mut src).map(drop),
                },
                _ => Ok(()),
            };
        }
        answers
    }

    /// A request of each command as the client encodes it, for seed inputs.
    pub fn client_requests() -> Vec<Vec<u8>> {
        let ms = |r, ms| with_millis(r, Duration::from_millis(ms));
        vec![
            ms(request(SET, &[b"addr/0", b"127.0.0.1:29500"]), 0),
            ms(request(GET, &[b"addr/0"]), 10),
            ms(request(ADD, &[b"count", &2i64.to_le_bytes()]), 0),
            ms(request(COMPARE_SET, &[b"k", b"", b"v"]), 0),
            ms(request(WAIT, &[b"addr/0", b"count"]), 10),
            ms(request(CHECK, &[b"addr/0", b"missing"]), 0),
            ms(request(DELETE, &[b"k"]), 0),
            ms(request(NUM_KEYS, &[]), 0),
        ]
    }
}
