//! The `ember` program as a user runs it.

use std::path::PathBuf;
use std::process::Command;

/// The `ember` binary: where cargo built it, or beside this test binary (the GPU bundle puts
/// every binary in one folder, away from the build tree).
fn ember_binary() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_ember"));
    if built.exists() {
        return built;
    }
    let here = std::env::current_exe().expect("the test binary has a path");
    here.parent()
        .expect("the test binary sits in a folder")
        .join("ember")
}

fn ember(args: &[&str]) -> std::process::Output {
    Command::new(ember_binary())
        .args(args)
        .output()
        .expect("the ember binary runs")
}

#[test]
fn info_reports_version_and_devices() {
    let out = ember(&["info"]);
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&format!("ember {}", env!("CARGO_PKG_VERSION"))),
        "{text}"
    );
    assert!(text.contains("devices:\n  cpu"), "{text}");
}

#[test]
fn unknown_subcommand_fails_with_usage() {
    let out = ember(&["frobnicate"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("Usage"));
}

#[test]
fn info_lists_cuda_libraries_and_devices_it_finds() {
    let text = String::from_utf8(ember(&["info"]).stdout).unwrap();
    assert!(text.contains("cuda libraries:\n  driver (libcuda)"), "{text}");
    let gpus = text
        .lines()
        .filter(|l| l.trim_start().starts_with("cuda:") && l.contains("SMs"))
        .count();
    assert_eq!(gpus, ember::cuda::device_count(), "{text}");
}
