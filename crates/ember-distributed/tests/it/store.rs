//! The TCP store: operations, PyTorch's semantics, timeouts and a dead server.

use std::io::ErrorKind;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_core::Error;
use ember_distributed::{PrefixStore, Store, TcpStore};

fn pair(timeout: Duration) -> (TcpStore, TcpStore) {
    let master = TcpStore::new("127.0.0.1", 0, true, timeout).unwrap();
    let client = TcpStore::new("127.0.0.1", master.port(), false, timeout).unwrap();
    (master, client)
}

fn timed_out(e: &Error) -> bool {
    matches!(
        e,
        Error::Io {
            kind: ErrorKind::TimedOut,
            ..
        }
    )
}

#[test]
fn operations() {
    let (m, c) = pair(Duration::from_secs(5));
    c.set("a", b"1").unwrap();
    assert_eq!(m.get("a").unwrap(), b"1");
    assert_eq!(c.add("n", 5).unwrap(), 5);
    assert_eq!(m.add("n", -2).unwrap(), 3);
    assert_eq!(
        c.get("n").unwrap(),
        b"3",
        "counters are decimal text, as in PyTorch"
    );
    // compare_set: a missing key with empty expected is set; a wrong expected leaves it.
    assert_eq!(c.compare_set("k", b"", b"v1").unwrap(), b"v1");
    assert_eq!(c.compare_set("k", b"nope", b"v2").unwrap(), b"v1");
    assert_eq!(c.compare_set("k", b"v1", b"v2").unwrap(), b"v2");
    assert_eq!(c.compare_set("missing", b"x", b"y").unwrap(), b"x");
    assert!(!c.check(&["missing"]).unwrap());
    assert!(c.check(&["a", "k"]).unwrap());
    assert_eq!(m.num_keys().unwrap(), 3);
    assert!(c.delete_key("a").unwrap());
    assert!(!c.delete_key("a").unwrap());
    assert_eq!(m.num_keys().unwrap(), 2);
    // wait returns once another client sets the key.
    let port = m.port();
    let setter = std::thread::spawn(move || {
        let s = TcpStore::new("127.0.0.1", port, false, Duration::from_secs(5)).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        s.set("late", b"x").unwrap();
    });
    c.wait(&["late", "k"]).unwrap();
    assert_eq!(c.get("late").unwrap(), b"x");
    setter.join().unwrap();
    // Binary values and empty values.
    c.set("bin", &[0, 255, 1]).unwrap();
    assert_eq!(m.get("bin").unwrap(), [0, 255, 1]);
}

#[test]
fn prefix_store_keeps_keys_apart() {
    let (m, _c) = pair(Duration::from_secs(5));
    let m: Arc<dyn Store> = Arc::new(m);
    let a = PrefixStore::new("a", m.clone());
    let b = PrefixStore::new("b", m.clone());
    a.set("k", b"1").unwrap();
    b.set("k", b"2").unwrap();
    assert_eq!(a.get("k").unwrap(), b"1");
    assert_eq!(m.get("b/k").unwrap(), b"2");
    assert!(a.check(&["k"]).unwrap());
}

#[test]
fn blocking_calls_time_out() {
    let (_m, c) = pair(Duration::from_millis(300));
    let start = Instant::now();
    let e = c.get("never").unwrap_err();
    assert!(timed_out(&e), "{e}");
    assert!(e.to_string().contains("never"), "{e}");
    let e = c
        .wait_timeout(&["never"], Duration::from_millis(200))
        .unwrap_err();
    assert!(timed_out(&e), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));
    // The connection is still usable after a timeout.
    c.set("x", b"1").unwrap();
    assert_eq!(c.get("x").unwrap(), b"1");
}

#[test]
fn no_server_and_dead_server_are_errors() {
    // Nobody listens: connecting gives up after the timeout.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let start = Instant::now();
    let e = TcpStore::new("127.0.0.1", port, false, Duration::from_millis(300)).unwrap_err();
    assert!(timed_out(&e), "{e}");
    assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(3));

    // The server goes away while a client waits on it: an error, not a hang.
    let (m, c) = pair(Duration::from_secs(30));
    let waiter = std::thread::spawn(move || {
        let start = Instant::now();
        (c.get("never"), start.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    drop(m);
    let (got, elapsed) = waiter.join().unwrap();
    let e = got.unwrap_err();
    assert!(!timed_out(&e), "closed, not timed out: {e}");
    assert!(elapsed < Duration::from_secs(5), "{elapsed:?}");
}

/// One request as the client writes it: command byte, string count, u32-prefixed strings,
/// then the wait in milliseconds.
fn raw_request(cmd: u8, strings: &[&[u8]], wait_ms: u64) -> Vec<u8> {
    let mut out = vec![cmd];
    out.extend_from_slice(&(strings.len() as u32).to_le_bytes());
    for s in strings {
        out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        out.extend_from_slice(s);
    }
    out.extend_from_slice(&wait_ms.to_le_bytes());
    out
}

/// Bytes a peer sends are checked, never trusted: a `get` of no key, and requests cut short
/// (a string's length claimed, its bytes missing) are refused, not a panic of the server.
#[test]
fn malformed_requests_are_refused_by_the_server() {
    use ember_distributed::store::fuzzing::decode;
    const GET: u8 = 2;
    const SET: u8 = 1;
    // A get of no key: the server indexed its first key (a panic, found by reading).
    assert!(decode(&raw_request(GET, &[], 0), &[]).is_empty());
    // A set claiming a 200 MiB value and sending 3 bytes: refused when the bytes end.
    let mut cut = vec![SET, 2, 0, 0, 0, 1, 0, 0, 0, b'k'];
    cut.extend_from_slice(&(200u32 << 20).to_le_bytes());
    cut.extend_from_slice(b"abc");
    assert!(decode(&cut, &[]).is_empty());
    // Well-formed requests after each other are all answered.
    let ok = [raw_request(SET, &[b"k", b"v"], 0), raw_request(GET, &[b"k"], 0)].concat();
    let answers = decode(&ok, &[]);
    assert_eq!(answers, vec![vec![0], vec![0, 1, 0, 0, 0, b'v']]);
}

/// A wait of u64::MAX milliseconds (past what `Instant` holds) is "wait as long as it takes"
/// on the server, and a store with a timeout of `Duration::MAX` works: both overflowed an
/// `Instant` and panicked (found by reading).
#[test]
fn waits_and_timeouts_past_what_an_instant_holds() {
    use std::io::{Read, Write};
    let master = TcpStore::new("127.0.0.1", 0, true, Duration::MAX).unwrap();
    master.set("k", b"v").unwrap();
    assert_eq!(master.get("k").unwrap(), b"v");
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", master.port())).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    conn.write_all(&raw_request(2, &[b"k"], u64::MAX)).unwrap();
    let mut answer = [0u8; 6];
    conn.read_exact(&mut answer)
        .expect("the server answers instead of dying");
    assert_eq!(answer, [0, 1, 0, 0, 0, b'v']);
}
