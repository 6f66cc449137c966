//! `ember-run`: the workers' environment, their output (passed through, or prefixed and logged
//! with `--tee` / `--redirects` / `--log-dir`), and failure handling.

use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn sets_the_environment_and_passes_output_through() {
    let out = Command::new(crate::common::ember_run())
        .args(["--standalone", "--nproc-per-node", "3", "sh", "-c"])
        .arg("echo $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GROUP_RANK $MASTER_ADDR $MASTER_PORT $NCCL_NVLS_ENABLE; echo err >&2")
        .env_remove("NCCL_NVLS_ENABLE")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines.len(), 3, "{stdout}");
    let port = lines[0].split_whitespace().nth(6).unwrap().to_string();
    assert!(port.parse::<u16>().unwrap() > 0);
    for (r, line) in lines.iter().enumerate() {
        assert_eq!(*line, format!("{r} {r} 3 3 0 127.0.0.1 {port} 0"));
    }
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().filter(|l| *l == "err").count(), 3, "{stderr}");
}

#[test]
fn tee_prefixes_and_logs_and_redirects_only_log() {
    let dir = std::env::temp_dir().join(format!("ember-run-logs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(crate::common::ember_run())
        .args([
            "--standalone",
            "--nproc-per-node",
            "2",
            "--tee",
            "1",
            "--redirects",
            "2",
        ])
        .arg(format!("--log-dir={}", dir.display()))
        .args(["sh", "-c", "echo '{\"rank\": '$RANK'}'; echo oops $RANK >&2"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        ["[rank0]: {\"rank\": 0}", "[rank1]: {\"rank\": 1}"],
        "{stdout}"
    );
    // stderr went to the files only.
    assert!(String::from_utf8(out.stderr).unwrap().is_empty());
    for r in 0..2 {
        let read = |name: &str| std::fs::read_to_string(dir.join(r.to_string()).join(name)).unwrap();
        assert_eq!(read("stdout.log"), format!("{{\"rank\": {r}}}\n"));
        assert_eq!(read("stderr.log"), format!("oops {r}\n"));
    }
    let _ = std::fs::remove_dir_all(&dir);
    // --redirects needs --log-dir.
    let out = Command::new(crate::common::ember_run())
        .args(["--redirects", "3", "true"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn multi_node_ranks_and_kept_nvls_setting() {
    let out = Command::new(crate::common::ember_run())
        .args([
            "--nnodes=2",
            "--node-rank=1",
            "--nproc-per-node=2",
            "--master-addr=10.9.8.7",
            "--master-port=4321",
        ])
        .args([
            "sh",
            "-c",
            "echo $RANK/$WORLD_SIZE $MASTER_ADDR:$MASTER_PORT $NCCL_NVLS_ENABLE",
        ])
        .env("NCCL_NVLS_ENABLE", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.lines().any(|l| l == "2/4 10.9.8.7:4321 1"), "{stdout}");
    assert!(stdout.lines().any(|l| l == "3/4 10.9.8.7:4321 1"), "{stdout}");
}

#[test]
fn a_failed_worker_stops_the_others() {
    let start = Instant::now();
    let out = Command::new(crate::common::ember_run())
        .args(["--standalone", "--nproc-per-node", "3", "sh", "-c"])
        .arg(r#"if [ "$RANK" = 1 ]; then echo bye; exit 3; fi; exec sleep 30"#)
        .output()
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("worker rank 1 failed (exit code 3)"), "{stderr}");
    assert!(String::from_utf8(out.stdout).unwrap().lines().any(|l| l == "bye"));
}

#[test]
fn a_killed_worker_stops_the_others() {
    let start = Instant::now();
    let out = Command::new(crate::common::ember_run())
        .args(["--standalone", "--nproc-per-node", "2", "sh", "-c"])
        .arg(r#"if [ "$RANK" = 0 ]; then sleep 0.2; kill -9 $$; fi; exec sleep 30"#)
        .output()
        .unwrap();
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains("worker rank 0 failed (killed by signal 9"),
        "{stderr}"
    );
}

#[test]
fn bad_usage_and_missing_program() {
    let out = Command::new(crate::common::ember_run())
        .args(["--nproc-per-node", "x", "p"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(crate::common::ember_run())
        .args(["--standalone", "/nonexistent/program"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8(out.stderr).unwrap().contains("cannot start"));
    let out = Command::new(crate::common::ember_run())
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8(out.stdout)
        .unwrap()
        .contains("--nproc-per-node"));
}
