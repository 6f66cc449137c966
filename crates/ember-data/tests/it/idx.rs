//! The IDX reader: hand-built files, every kind of corruption, gzip.

use ember_core::{DType, Device, Error, Tensor};
use ember_data::idx::{parse_idx, read_idx, to_idx_bytes};
use flate2::write::GzEncoder;
use std::io::Write;

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// A u8 [2, 3] file built byte by byte.
fn u8_file() -> Vec<u8> {
    let mut b = vec![0, 0, 0x08, 2, 0, 0, 0, 2, 0, 0, 0, 3];
    b.extend_from_slice(&[1, 2, 3, 250, 251, 255]);
    b
}

/// The message of an InvalidArgument, or a panic naming what came instead.
fn invalid_msg(r: ember_core::Result<Tensor>) -> String {
    match r {
        Err(Error::InvalidArgument { msg, .. }) => msg,
        Err(e) => panic!("expected InvalidArgument, got {e}"),
        Ok(t) => panic!("expected an error, got a tensor of shape {}", t.shape()),
    }
}

#[test]
fn hand_built_u8_file() {
    let t = parse_idx(&u8_file()).unwrap();
    assert_eq!(t.dtype(), DType::U8);
    assert_eq!(t.dims(), &[2, 3]);
    assert_eq!(t.to_vec::<u8>().unwrap(), vec![1, 2, 3, 250, 251, 255]);
    // The same bytes gzipped read the same.
    let g = parse_idx(&gzip(&u8_file())).unwrap();
    assert_eq!(g.to_vec::<u8>().unwrap(), vec![1, 2, 3, 250, 251, 255]);
}

#[test]
fn hand_built_typed_files() {
    // i8 [3] widens to i32.
    let t = parse_idx(&[0, 0, 0x09, 1, 0, 0, 0, 3, 0xff, 0x80, 0x7f]).unwrap();
    assert_eq!(t.dtype(), DType::I32);
    assert_eq!(t.to_vec::<i32>().unwrap(), vec![-1, -128, 127]);
    // i16 [2], big-endian.
    let t = parse_idx(&[0, 0, 0x0B, 1, 0, 0, 0, 2, 0x01, 0x02, 0xff, 0xfe]).unwrap();
    assert_eq!(t.to_vec::<i32>().unwrap(), vec![258, -2]);
    // i32 [1].
    let t = parse_idx(&[0, 0, 0x0C, 1, 0, 0, 0, 1, 0x80, 0, 0, 1]).unwrap();
    assert_eq!(t.to_vec::<i32>().unwrap(), vec![i32::MIN + 1]);
    // f32 [2].
    let mut b = vec![0, 0, 0x0D, 1, 0, 0, 0, 2];
    b.extend(1.5f32.to_be_bytes());
    b.extend((-0.25f32).to_be_bytes());
    let t = parse_idx(&b).unwrap();
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5, -0.25]);
    // f64 [1, 1].
    let mut b = vec![0, 0, 0x0E, 2, 0, 0, 0, 1, 0, 0, 0, 1];
    b.extend(std::f64::consts::PI.to_be_bytes());
    let t = parse_idx(&b).unwrap();
    assert_eq!(t.dims(), &[1, 1]);
    assert_eq!(t.to_vec::<f64>().unwrap(), vec![std::f64::consts::PI]);
    // Zero dimensions: one element; a zero-size dimension: no data.
    assert_eq!(parse_idx(&[0, 0, 0x08, 0, 7]).unwrap().item::<u8>().unwrap(), 7);
    assert_eq!(
        parse_idx(&[0, 0, 0x08, 2, 0, 0, 0, 0, 0, 0, 0, 5])
            .unwrap()
            .dims(),
        &[0, 5]
    );
}

#[test]
fn write_then_read_round_trip() {
    let t = Tensor::arange(-3.0, 3.0, 0.5, DType::F32, Device::Cpu)
        .unwrap()
        .reshape(&[3, 4])
        .unwrap();
    let back = parse_idx(&to_idx_bytes(&t).unwrap()).unwrap();
    assert_eq!(back.dims(), &[3, 4]);
    assert_eq!(back.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    assert_eq!(to_idx_bytes(&parse_idx(&u8_file()).unwrap()).unwrap(), u8_file());
    let dir = std::env::temp_dir().join(format!("ember-data-idx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("x-idx2-ubyte.gz");
    std::fs::write(&path, gzip(&u8_file())).unwrap();
    assert_eq!(
        read_idx(&path).unwrap().to_vec::<u8>().unwrap(),
        vec![1, 2, 3, 250, 251, 255]
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(
        to_idx_bytes(&Tensor::zeros([2], DType::Bool, Device::Cpu).unwrap()),
        Err(Error::UnsupportedDType { .. })
    ));
}

#[test]
fn bad_magic() {
    let mut b = u8_file();
    b[0] = 1;
    assert!(invalid_msg(parse_idx(&b)).contains("bad magic"));
    let mut b = u8_file();
    b[2] = 0x0A;
    let msg = invalid_msg(parse_idx(&b));
    assert!(msg.contains("bad magic") && msg.contains("0x0a"), "{msg}");
    assert!(invalid_msg(parse_idx(&[])).contains("truncated header"));
    assert!(invalid_msg(parse_idx(&[0, 0, 8])).contains("truncated header"));
}

#[test]
fn truncated_header_and_data() {
    let b = u8_file();
    assert!(invalid_msg(parse_idx(&b[..10])).contains("truncated header"));
    let msg = invalid_msg(parse_idx(&b[..b.len() - 1]));
    assert!(
        msg.contains("truncated data") && msg.contains("need 6 bytes") && msg.contains("found 5"),
        "{msg}"
    );
    // Truncated after gzip too.
    assert!(invalid_msg(parse_idx(&gzip(&b[..b.len() - 2]))).contains("truncated data"));
}

#[test]
fn dims_overflow() {
    // 255 dimensions of u32::MAX: the product overflows any usize.
    let mut b = vec![0, 0, 0x0E, 255];
    for _ in 0..255 {
        b.extend(u32::MAX.to_be_bytes());
    }
    assert!(invalid_msg(parse_idx(&b)).contains("overflow"));
    // Three large dimensions whose product times 8 bytes passes isize::MAX.
    let mut b = vec![0, 0, 0x0E, 3];
    for _ in 0..3 {
        b.extend(0x0100_0000u32.to_be_bytes());
    }
    assert!(invalid_msg(parse_idx(&b)).contains("overflow"));
}

#[test]
fn trailing_garbage() {
    let mut b = u8_file();
    b.extend_from_slice(b"junk");
    let msg = invalid_msg(parse_idx(&b));
    assert!(msg.contains("4 bytes of trailing garbage"), "{msg}");
}

/// A gzipped file inflating far past what its header announces (50 MiB of zeros after 6 bytes
/// of data, 50 KiB compressed) is refused after the announced bytes and one more, never
/// inflated whole.
#[test]
fn gzip_inflating_past_its_header_is_refused_early() {
    let mut b = u8_file();
    b.extend(std::iter::repeat_n(0u8, 50 << 20));
    let g = gzip(&b);
    assert!(g.len() < 100 << 10);
    let msg = invalid_msg(parse_idx(&g));
    assert!(
        msg.contains("trailing garbage") && msg.contains("runs past"),
        "{msg}"
    );
}

#[test]
fn broken_gzip() {
    let g = gzip(&u8_file());
    // Cut short: the stream ends early.
    assert!(invalid_msg(parse_idx(&g[..g.len() / 2])).contains("gzip"));
    // A flipped byte in the CRC trailer.
    let mut bad_crc = g.clone();
    let n = bad_crc.len();
    bad_crc[n - 6] ^= 0xff;
    assert!(invalid_msg(parse_idx(&bad_crc)).contains("gzip"));
    // Just the magic.
    assert!(invalid_msg(parse_idx(&[0x1f, 0x8b])).contains("gzip"));
}

#[test]
fn read_idx_names_the_file() {
    let dir = std::env::temp_dir().join(format!("ember-data-idx-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("broken-idx1-ubyte");
    std::fs::write(&path, [0, 0, 0x08, 1, 0, 0, 0, 9, 1, 2]).unwrap();
    let msg = invalid_msg(read_idx(&path));
    assert!(
        msg.contains("broken-idx1-ubyte") && msg.contains("truncated data"),
        "{msg}"
    );
    let missing = invalid_msg(read_idx(dir.join("missing")));
    assert!(
        missing.contains("missing") && missing.contains("cannot read"),
        "{missing}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
