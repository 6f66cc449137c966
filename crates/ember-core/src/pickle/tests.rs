//! The pickle writer against bytes CPython 3.11 wrote (`pickle.dumps(v, protocol=2)`), and the
//! reader against those bytes, its own output and what later protocols write.

use super::*;

fn ints(v: &[i128]) -> Value {
    Value::List(v.iter().map(|&i| Value::Int(i)).collect())
}

fn roundtrip(v: &Value) {
    assert_eq!(loads(&dumps(v)).as_ref(), Ok(v), "{v}");
}

#[test]
fn ints_pick_cpythons_opcodes_by_magnitude() {
    let v = ints(&[
        0,
        1,
        255,
        256,
        65535,
        65536,
        -1,
        -128,
        -129,
        (1 << 31) - 1,
        -(1 << 31),
        1 << 31,
        -(1 << 31) - 1,
        i64::MAX as i128,
        u64::MAX as i128,
        i64::MIN as i128,
        i128::MAX,
        i128::MIN,
        0x7f00_0000_0000,
    ]);
    let expected: &[u8] = b"\x80\x02]q\x00(K\x00K\x01K\xffM\x00\x01M\xff\xffJ\x00\x00\x01\x00J\xff\xff\xff\xff\
J\x80\xff\xff\xffJ\x7f\xff\xff\xffJ\xff\xff\xff\x7fJ\x00\x00\x00\x80\x8a\x05\x00\x00\x00\x80\x00\
\x8a\x05\xff\xff\xff\x7f\xff\x8a\x08\xff\xff\xff\xff\xff\xff\xff\x7f\x8a\t\xff\xff\xff\xff\xff\xff\xff\xff\x00\
\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x8a\x10\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f\
\x8a\x10\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x80\x8a\x06\x00\x00\x00\x00\x00\x7fe.";
    assert_eq!(dumps(&v), expected);
    assert_eq!(loads(expected), Ok(v));
}

#[test]
fn none_bools_and_floats() {
    let v = Value::Tuple(vec![
        Value::None,
        true.into(),
        false.into(),
        1.5.into(),
        (-0.0).into(),
        f64::INFINITY.into(),
    ]);
    let expected: &[u8] =
        b"\x80\x02(N\x88\x89G?\xf8\x00\x00\x00\x00\x00\x00G\x80\x00\x00\x00\x00\x00\x00\x00\
G\x7f\xf0\x00\x00\x00\x00\x00\x00tq\x00.";
    assert_eq!(dumps(&v), expected);
    assert_eq!(loads(expected), Ok(v));
}

#[test]
fn equal_strings_are_written_once() {
    let v = Value::List(vec!["".into(), "a".into(), "é✓".into(), "a".into()]);
    let expected: &[u8] =
        b"\x80\x02]q\x00(X\x00\x00\x00\x00q\x01X\x01\x00\x00\x00aq\x02X\x05\x00\x00\x00\xc3\xa9\xe2\x9c\x93q\x03h\x02e.";
    assert_eq!(dumps(&v), expected);
    assert_eq!(loads(expected), Ok(v));
}

#[test]
fn tuples_of_every_length() {
    let t = |n: i128| Value::Tuple((1..=n).map(Value::Int).collect());
    let v = Value::List((0..=4).map(t).collect());
    let expected: &[u8] =
        b"\x80\x02]q\x00()K\x01\x85q\x01K\x01K\x02\x86q\x02K\x01K\x02K\x03\x87q\x03(K\x01K\x02K\x03K\x04tq\x04e.";
    assert_eq!(dumps(&v), expected);
    assert_eq!(loads(expected), Ok(v));
}

#[test]
fn dicts_with_one_and_several_items() {
    let one = Value::dict([("k", Value::Int(1))]);
    assert_eq!(dumps(&one), b"\x80\x02}q\x00X\x01\x00\x00\x00kq\x01K\x01s.");
    let two = Value::dict([("a", Value::List(vec![])), ("b", Value::Dict(vec![]))]);
    assert_eq!(
        dumps(&two),
        b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02X\x01\x00\x00\x00bq\x03}q\x04u."
    );
    assert_eq!(
        dumps(&Value::List(vec![Value::List(vec![7.into()])])),
        b"\x80\x02]q\x00]q\x01K\x07aa."
    );
    roundtrip(&one);
    roundtrip(&two);
    assert_eq!(two.get("b"), Some(&Value::Dict(vec![])));
    assert_eq!(two.get("c"), None);
}

#[test]
fn large_containers_batch_by_a_thousand_and_memo_past_256() {
    // CPython: 1,001 items are MARK <1000 items> APPENDS MARK <1 item> APPENDS.
    let big = Value::List((0..1001).map(Value::Int).collect());
    let bytes = dumps(&big);
    assert_eq!(bytes.len(), 2757);
    assert_eq!(&bytes[..12], b"\x80\x02]q\x00(K\x00K\x01K\x02");
    assert_eq!(&bytes[bytes.len() - 12..], b"\xe6\x03M\xe7\x03e(M\xe8\x03e.");
    roundtrip(&big);
    // 1,001 distinct keys: memo indices past 255 use LONG_BINPUT (CPython's tail below).
    let d = Value::Dict(
        (0..1001)
            .map(|i| (Value::Str(i.to_string()), Value::Int(i)))
            .collect(),
    );
    let bytes = dumps(&d);
    assert!(bytes.ends_with(b"(X\x04\x00\x00\x001000r\xe9\x03\x00\x00M\xe8\x03u."));
    roundtrip(&d);
    // Repeated strings past index 255 come back through LONG_BINGET.
    let many = Value::List((0..600).map(|i| Value::Str(format!("s{}", i % 300))).collect());
    assert!(dumps(&many).windows(5).any(|w| w == b"j\x2c\x01\x00\x00"));
    roundtrip(&many);
}

#[test]
fn nested_snapshot_like_value_roundtrips() {
    let block = |addr: u64| {
        Value::dict([
            ("address", Value::from(addr)),
            ("size", Value::from(512usize)),
            ("state", "active_allocated".into()),
            ("frames", Value::List(vec![])),
        ])
    };
    let v = Value::dict([
        (
            "segments",
            Value::List(vec![Value::dict([
                ("address", Value::from(0x7f00_0000_0000u64)),
                ("segment_pool_id", Value::Tuple(vec![0.into(), 0.into()])),
                ("is_expandable", false.into()),
                (
                    "blocks",
                    Value::List((0..5).map(|i| block(0x7f00_0000_0000 + i * 512)).collect()),
                ),
            ])]),
        ),
        ("device_traces", Value::List(vec![Value::List(vec![])])),
        (
            "allocator_settings",
            Value::dict([("garbage_collection_threshold", 0.0.into())]),
        ),
    ]);
    roundtrip(&v);
    assert_eq!(
        v.get("segments")
            .and_then(|s| s.as_seq())
            .map(|s| s[0].get("is_expandable")),
        Some(Some(&Value::Bool(false)))
    );
}

#[test]
fn reads_what_protocol_4_and_5_write() {
    // pickle.dumps({"a": [1, "xyz", None], "b": (True, 2.5)}, protocol=4), CPython 3.11.
    let p4: &[u8] = b"\x80\x04\x95\x26\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01\x8c\x03xyz\x94Ne\x8c\x01b\x94\x88G@\x04\x00\x00\x00\x00\x00\x00\x86\x94u.";
    let expected = Value::dict([
        ("a", Value::List(vec![1.into(), "xyz".into(), Value::None])),
        ("b", Value::Tuple(vec![true.into(), 2.5.into()])),
    ]);
    assert_eq!(loads(p4), Ok(expected));
    // Memo references through MEMOIZE: ["k", "k"] as protocol 5 writes it.
    let p5: &[u8] = b"\x80\x05\x95\x0b\x00\x00\x00\x00\x00\x00\x00]\x94(\x8c\x01k\x94h\x01e.";
    assert_eq!(loads(p5), Ok(Value::List(vec!["k".into(), "k".into()])));
}

#[test]
fn corrupt_data_is_an_error_not_a_panic() {
    let good = dumps(&Value::dict([("k", Value::List(vec![1.into(), 2.into()]))]));
    for n in 0..good.len() {
        assert!(
            matches!(
                loads(&good[..n]),
                Err(PickleError::Truncated { .. } | PickleError::Malformed { .. })
            ),
            "prefix of {n} bytes"
        );
    }
    assert!(matches!(
        loads(b"\x80\x02c__builtin__\nset\n."),
        Err(PickleError::Unsupported {
            opcode: b'c',
            offset: 2
        })
    ));
    assert!(matches!(
        loads(b"\x80\x02h\x05."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x02K\x01K\x02."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x02N.extra"),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x02K\x01a."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x02X\x02\x00\x00\x00\xff\xfe."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x02X\xff\xff\xff\xff"),
        Err(PickleError::Truncated { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x02\x8b\x00\x00\x10\x00."),
        Err(PickleError::Truncated { .. })
    ));
    // Every corruption of one byte of a valid pickle is an error or a value; never a panic.
    for i in 0..good.len() {
        for b in [0x00, 0x28, 0x2e, 0x71, 0x80, 0x8a, 0xff] {
            let mut bad = good.clone();
            bad[i] = b;
            let _ = loads(&bad);
        }
    }
}

#[test]
fn display_reads_like_python() {
    let v = Value::dict([
        ("a", Value::Tuple(vec![1.into()])),
        (
            "b",
            Value::List(vec![Value::None, true.into(), 1.0.into(), "it's".into()]),
        ),
    ]);
    assert_eq!(v.to_string(), r"{'a': (1,), 'b': [None, True, 1.0, 'it\'s']}");
}

#[test]
fn a_memoized_container_is_shared_as_filled_later() {
    // f = [{"filename": "a.py", "line": 1, "name": "f"}]; [{"frames": f}, {"frames": f}],
    // protocol 4: the list is memoized empty, filled, then referenced again.
    let p4: &[u8] = b"\x80\x04\x95E\x00\x00\x00\x00\x00\x00\x00]\x94(}\x94\x8c\x06frames\x94]\x94}\x94(\x8c\x08filename\x94\
\x8c\x04a.py\x94\x8c\x04line\x94K\x01\x8c\x04name\x94\x8c\x01f\x94uas}\x94h\x02h\x03se.";
    let frame = Value::dict([
        ("filename", "a.py".into()),
        ("line", 1.into()),
        ("name", "f".into()),
    ]);
    let entry = Value::dict([("frames", Value::List(vec![frame]))]);
    assert_eq!(loads(p4), Ok(Value::List(vec![entry.clone(), entry])));
}

#[test]
fn self_containing_and_exploding_data_is_an_error() {
    // l = []; l.append(l)
    assert!(matches!(
        loads(b"\x80\x02]q\x00h\x00a."),
        Err(PickleError::Malformed { .. })
    ));
    // x = []; forty times x = [x, x]: 286 bytes (CPython's) that expand to 2^41 values.
    let hex = [
        "80025d7100285d7101285d7102285d7103285d7104285d7105285d7106285d7107285d7108285d7109285d710a285d71",
        "0b285d710c285d710d285d710e285d710f285d7110285d7111285d7112285d7113285d7114285d7115285d7116285d71",
        "17285d7118285d7119285d711a285d711b285d711c285d711d285d711e285d711f285d7120285d7121285d7122285d71",
        "23285d7124285d7125285d7126285d7127285d7128682865682765682665682565682465682365682265682165682065",
        "681f65681e65681d65681c65681b65681a65681965681865681765681665681565681465681365681265681165681065",
        "680f65680e65680d65680c65680b65680a656809656808656807656806656805656804656803656802656801652e",
    ]
    .concat();
    let p: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    assert_eq!(p.len(), 286);
    // The copy stops at the budget (10,000 values here) instead of running away.
    let r = read::loads_limited(&p, 10_000, usize::MAX);
    assert!(matches!(r, Err(PickleError::Malformed { .. })), "{r:?}");
}

/// The opcodes of `bytes`, a pickle from [`dumps`], walked with each opcode's argument length.
fn opcodes(bytes: &[u8]) -> std::collections::BTreeSet<u8> {
    let mut seen = std::collections::BTreeSet::new();
    let mut at = 0;
    let u32_at = |i: usize| u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap()) as usize;
    while at < bytes.len() {
        let op = bytes[at];
        seen.insert(op);
        at += 1 + match op {
            PROTO | BININT1 | BINPUT | BINGET => 1,
            BININT2 => 2,
            BININT | LONG_BINPUT | LONG_BINGET => 4,
            BINFLOAT => 8,
            LONG1 => 1 + bytes[at + 1] as usize,
            BINUNICODE => 4 + u32_at(at + 1),
            NONE | NEWTRUE | NEWFALSE | MARK | EMPTY_LIST | APPEND | APPENDS | EMPTY_DICT | SETITEM
            | SETITEMS | EMPTY_TUPLE | TUPLE | TUPLE1 | TUPLE2 | TUPLE3 | STOP => 0,
            other => panic!("dumps wrote opcode {other:#04x}, which this walker does not know"),
        };
    }
    seen
}

#[test]
fn dumps_writes_only_opcodes_pytorchs_memory_viz_page_reads() {
    // The opcodes the unpickler of PyTorch's memory_viz page (torch/utils/viz/MemoryViz.js)
    // handles, protocols 2 to 4.
    let page_reads: &[u8] = &[
        APPENDS,
        BINGET,
        BININT,
        BININT1,
        BININT2,
        EMPTY_DICT,
        EMPTY_LIST,
        FRAME,
        LONG1,
        LONG_BINGET,
        MARK,
        MEMOIZE,
        PROTO,
        SETITEMS,
        SHORT_BINUNICODE,
        STOP,
        TUPLE2,
        APPEND,
        NEWFALSE,
        BINPUT,
        BINUNICODE,
        EMPTY_TUPLE,
        NEWTRUE,
        NONE,
        BINFLOAT,
        TUPLE,
        TUPLE1,
        TUPLE3,
        LONG_BINPUT,
        SETITEM,
    ];
    let mut items: Vec<(Value, Value)> = (0..300)
        .map(|i| (Value::Str(format!("k{i}")), Value::Int(i * 1_000_003 - 7)))
        .collect();
    items.push(("big".into(), Value::from(u64::MAX)));
    items.push(("neg".into(), Value::Int(-(1 << 40))));
    items.push(("float".into(), 0.25.into()));
    items.push((
        "flags".into(),
        Value::List(vec![true.into(), false.into(), Value::None]),
    ));
    items.push((
        "tuples".into(),
        Value::List(
            (0..5)
                .map(|n| Value::Tuple((0..n).map(Value::Int).collect()))
                .collect(),
        ),
    ));
    // Strings written again past memo index 255 come back through LONG_BINGET.
    items.push((
        "one".into(),
        Value::dict([("k299", Value::List(vec!["k298".into()]))]),
    ));
    let bytes = dumps(&Value::Dict(items));
    let used = opcodes(&bytes);
    for op in &used {
        assert!(
            page_reads.contains(op),
            "opcode {op:#04x} is not read by PyTorch's memory_viz page"
        );
    }
    assert!(used.contains(&LONG_BINGET) && used.contains(&LONG1) && used.contains(&SETITEM));
}

/// Nesting as deep as the file is long (100,000 levels): refused when copied (past 1,000), and the
/// nodes already built are freed without recursing, so the reader's stack (a test thread's
/// 2 MiB here) does not overflow.
#[test]
fn deeply_nested_containers_are_refused_without_overflowing_the_stack() {
    const N: usize = 100_000;
    // [[[...]]]: N empty lists, each appended into the one below it.
    let mut lists = vec![PROTO, 2];
    lists.extend(std::iter::repeat_n(EMPTY_LIST, N));
    lists.extend(std::iter::repeat_n(APPEND, N - 1));
    lists.push(STOP);
    // (((None,),),...): N one-tuples.
    let mut tuples = vec![PROTO, 2, NONE];
    tuples.extend(std::iter::repeat_n(TUPLE1, N));
    tuples.push(STOP);
    // {((...),): 1}: the same tuple as a dict key, hashed and compared to a bounded depth.
    let mut key = vec![PROTO, 2, EMPTY_DICT, NONE];
    key.extend(std::iter::repeat_n(TUPLE1, N));
    key.extend([BININT1, 1, SETITEM, STOP]);
    for (what, bytes) in [("lists", lists), ("tuples", tuples), ("dict key", key)] {
        match loads(&bytes) {
            Err(PickleError::Malformed { what: w, .. }) => assert!(w.contains("too deep"), "{what}: {w}"),
            other => panic!("{what}: {other:?}"),
        }
    }
}

/// A dict finds repeated keys by hash: twenty thousand keys read in a moment (the scan per
/// key it replaces grew with the square of the keys), and a repeated key still replaces the
/// value in place, as in Python.
#[test]
fn a_dict_of_many_keys_reads_in_linear_time() {
    let n = 20_000;
    let mut items: Vec<(Value, Value)> = (0..n)
        .map(|i| (Value::Str(format!("key{i}")), Value::Int(i as i128)))
        .collect();
    items.push((Value::Tuple(vec![1.into(), "a".into()]), Value::None));
    let bytes = dumps(&Value::Dict(items.clone()));
    assert_eq!(loads(&bytes), Ok(Value::Dict(items.clone())));
    // {"key0": 0, ..., (1, "a"): None} then d["key7"] = -1; d[(1, "a")] = True; d[0.0] = 1; d[-0.0] = 2
    let mut again = bytes[..bytes.len() - 1].to_vec();
    again.extend([SHORT_BINUNICODE, 4]);
    again.extend(b"key7");
    again.extend([BININT, 0xff, 0xff, 0xff, 0xff, SETITEM]);
    again.extend([BININT1, 1, SHORT_BINUNICODE, 1, b'a', TUPLE2, NEWTRUE, SETITEM]);
    again.push(BINFLOAT);
    again.extend(0.0f64.to_be_bytes());
    again.extend([BININT1, 1, SETITEM, BINFLOAT]);
    again.extend((-0.0f64).to_be_bytes());
    again.extend([BININT1, 2, SETITEM, STOP]);
    items[7].1 = Value::Int(-1);
    items[n].1 = Value::Bool(true);
    items.push((Value::Float(0.0), Value::Int(2)));
    assert_eq!(loads(&again), Ok(Value::Dict(items)));
}

/// A list of `n` references to a list of `n` references to the string `s`.
fn nested_references(s: &str, n: usize) -> Vec<u8> {
    let mut p = vec![PROTO, 2, EMPTY_LIST, BINPUT, 2, MARK, EMPTY_LIST, BINPUT, 1, MARK];
    p.push(BINUNICODE);
    p.extend((s.len() as u32).to_le_bytes());
    p.extend(s.as_bytes());
    p.extend([BINPUT, 0]);
    for _ in 1..n {
        p.extend([BINGET, 0]);
    }
    p.push(APPENDS);
    for _ in 1..n {
        p.extend([BINGET, 1]);
    }
    p.extend([APPENDS, STOP]);
    p
}

/// One string referenced through nested memo references (a thousand lists of a thousand
/// references to 64 KiB: 64 GB of copies) stops at the string budget instead.
#[test]
fn a_string_repeated_through_the_memo_stops_at_the_byte_budget() {
    let p = nested_references(&"x".repeat(64 << 10), 1000);
    match read::loads_limited(&p, usize::MAX, 16 << 20) {
        Err(PickleError::Malformed { what, .. }) => assert!(what.contains("bytes of strings"), "{what}"),
        other => panic!("{:?}", other.map(|_| "a value")),
    }
    // Within the budget, the copies are made.
    let inner = Value::List(vec!["abc".into(); 10]);
    assert_eq!(
        loads(&nested_references("abc", 10)),
        Ok(Value::List(vec![inner; 10]))
    );
}
