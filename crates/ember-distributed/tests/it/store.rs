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
