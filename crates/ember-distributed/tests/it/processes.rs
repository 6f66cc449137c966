//! Ranks as processes: this test binary re-executed as workers, through `ember-run` and
//! directly, using the default group (`init_process_group` with `env://`).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ember_core::{Device, Tensor};
use ember_distributed as dist;

use crate::common::check_all_collectives;

const SCENARIO: &str = "EMBER_DIST_WORKER";

/// The worker side: runs the scenario named by `EMBER_DIST_WORKER`; a no-op in a normal run.
#[test]
fn worker_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let backend = if scenario.starts_with("nccl_") {
        dist::BackendKind::Nccl // on cuda:{LOCAL_RANK}
    } else {
        dist::BackendKind::Gloo
    };
    if scenario == "collectives" {
        // PyTorch's `init_process_group("gloo")`: the backend as a string, the rest defaults.
        dist::init_process_group("gloo").unwrap();
    } else {
        let opts = dist::InitOptions::new(backend).timeout(Duration::from_secs(20));
        dist::init_process_group(opts).unwrap();
    }
    assert!(dist::is_initialized());
    let (rank, n) = (dist::get_rank().unwrap(), dist::get_world_size().unwrap());
    assert_eq!(rank.to_string(), std::env::var("RANK").unwrap());
    match scenario.as_str() {
        "collectives" => {
            let world = dist::default_group().unwrap();
            check_all_collectives(&world);
            // The free functions act on the default group.
            let x = Tensor::from_vec(vec![1i64], 1, Device::Cpu).unwrap();
            dist::all_reduce(&x, dist::ReduceOp::Sum).unwrap();
            assert_eq!(x.to_vec::<i64>().unwrap(), [n as i64]);
            let pair = dist::new_group(&[0, n - 1]).unwrap();
            if let Some(pair) = pair {
                let x = Tensor::from_vec(vec![rank as f32], 1, Device::Cpu).unwrap();
                pair.all_reduce(&x, dist::ReduceOp::Max).unwrap();
                assert_eq!(x.to_vec::<f32>().unwrap(), [(n - 1) as f32]);
            }
            // `DistributedSampler(dataset)` takes world size and rank from the default group.
            let ds = ember_data::TensorDataset::new(vec![Tensor::zeros(
                [10],
                ember_core::DType::F32,
                Device::Cpu,
            )
            .unwrap()])
            .unwrap();
            use ember_data::Sampler;
            let implicit = ember_data::DistributedSampler::new(&ds).unwrap().shuffle(false);
            let explicit = ember_data::DistributedSampler::with_replicas(10, n, rank)
                .unwrap()
                .shuffle(false);
            assert_eq!(implicit.indices().unwrap(), explicit.indices().unwrap());
            assert_eq!(implicit.num_samples(), 10usize.div_ceil(n));
            dist::barrier().unwrap();
            println!("worker {rank} of {n}: ok");
        }
        "ddp" => {
            // DDP on processes: each rank's gradients equal one process's full-batch ones.
            let options = dist::DdpOptions::new().bucket_cap_mb(1e-4);
            let got = crate::ddp::ddp_run(dist::default_group().unwrap(), options, 3, 12);
            for (s, expected) in crate::ddp::reference(3, 12).iter().enumerate() {
                crate::ddp::assert_close(&got[s], expected, &format!("rank {rank}, step {s}"));
            }
            println!("ddp worker {rank} of {n}: ok");
        }
        "dead_peer" => {
            if rank == n - 1 {
                std::process::exit(7); // gone right after joining (no core dump, unlike abort)
            }
            let start = Instant::now();
            let x = Tensor::from_vec(vec![1.0f32; 4096], 4096, Device::Cpu).unwrap();
            let e = dist::all_reduce(&x, dist::ReduceOp::Sum).unwrap_err();
            println!("survivor {rank} got an error after {:?}: {e}", start.elapsed());
            assert!(start.elapsed() < Duration::from_secs(10));
        }
        "dcp_save" | "dcp_load" => {
            let dir = std::path::PathBuf::from(std::env::var("EMBER_DCP_DIR").unwrap());
            crate::checkpoint::process_scenario(scenario == "dcp_save", &dir);
            println!("dcp worker {rank} of {n}: ok");
        }
        "dcp_killed" => {
            let dir = std::path::PathBuf::from(std::env::var("EMBER_DCP_DIR").unwrap());
            crate::checkpoint::killed_scenario(&dir);
            println!("dcp survivor {rank} of {n}: ok");
            return; // the default group is gone already
        }
        "nccl_collectives" => {
            let world = dist::default_group().unwrap();
            let dev: usize = std::env::var("LOCAL_RANK").unwrap().parse().unwrap();
            crate::nccl::check_nccl_collectives(&world, dev);
            let x = Tensor::from_vec(vec![1i64], 1, Device::Cuda(dev)).unwrap();
            dist::all_reduce(&x, dist::ReduceOp::Sum).unwrap();
            assert_eq!(x.to_vec::<i64>().unwrap(), [n as i64]);
            dist::barrier().unwrap();
            println!("nccl worker {rank} of {n}: ok");
        }
        "nccl_ddp" => {
            let dev: usize = std::env::var("LOCAL_RANK").unwrap().parse().unwrap();
            let options = dist::DdpOptions::new().bucket_cap_mb(1e-4);
            let got =
                crate::ddp::ddp_run_on(dist::default_group().unwrap(), options, 3, 12, Device::Cuda(dev));
            for (s, expected) in crate::ddp::reference(3, 12).iter().enumerate() {
                crate::ddp::assert_close_tol(
                    &got[s],
                    expected,
                    1e-10,
                    1e-7,
                    &format!("rank {rank}, step {s}"),
                );
            }
            println!("nccl ddp worker {rank} of {n}: ok");
        }
        "nccl_dead_peer" => {
            let dev: usize = std::env::var("LOCAL_RANK").unwrap().parse().unwrap();
            if rank == n - 1 {
                std::process::exit(7);
            }
            // The all_reduce cannot finish: the watchdog aborts it after the group timeout
            // (20 s) at the latest, so the host read returns and the next operation fails.
            let start = Instant::now();
            let x = Tensor::from_vec(vec![1.0f32; 4096], 4096, Device::Cuda(dev)).unwrap();
            let outcome = dist::all_reduce(&x, dist::ReduceOp::Sum)
                .and_then(|_| x.to_vec::<f32>())
                .and_then(|_| dist::barrier());
            let e = outcome.unwrap_err();
            println!("survivor {rank} got an error after {:?}: {e}", start.elapsed());
            assert!(start.elapsed() < Duration::from_secs(40));
        }
        other => panic!("unknown scenario {other}"),
    }
    dist::destroy_process_group();
    assert!(!dist::is_initialized());
}

fn worker_args() -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    vec![
        exe.to_string_lossy().into_owned(),
        "--exact".into(),
        "processes::worker_entry".into(),
        "--nocapture".into(),
        "--test-threads=1".into(),
    ]
}

/// Runs the worker `scenario` in `n` processes under `ember-run --standalone` and checks that
/// it succeeds with every rank printing `... {line} R of n: ok`.
fn every_rank_ok_under_ember_run(scenario: &str, n: usize, line: &str) {
    every_rank_ok_under_ember_run_with(scenario, n, line, &[]);
}

/// [`every_rank_ok_under_ember_run`] with more environment variables.
fn every_rank_ok_under_ember_run_with(scenario: &str, n: usize, line: &str, env: &[(&str, &str)]) {
    let out = Command::new(crate::common::ember_run())
        .args(["--standalone", "--nproc-per-node", &n.to_string()])
        .args(worker_args())
        .env(SCENARIO, scenario)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{scenario}, world {n}: {stdout}\n{stderr}");
    for r in 0..n {
        assert!(
            stdout
                .lines()
                .any(|l| l.contains(&format!("{line} {r} of {n}: ok"))),
            "{stdout}"
        );
    }
}

#[test]
fn collectives_between_processes_under_ember_run() {
    for n in [2, 3] {
        every_rank_ok_under_ember_run("collectives", n, "worker");
    }
}

#[test]
fn ddp_between_processes_under_ember_run() {
    for n in [2, 3] {
        every_rank_ok_under_ember_run("ddp", n, "ddp worker");
    }
}

#[test]
fn checkpoint_saved_by_2_processes_loads_in_3() {
    let dir = std::env::temp_dir().join(format!("ember-dcp-processes-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let env = [("EMBER_DCP_DIR", dir.to_str().unwrap())];
    every_rank_ok_under_ember_run_with("dcp_save", 2, "dcp worker", &env);
    every_rank_ok_under_ember_run_with("dcp_load", 3, "dcp worker", &env);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs the worker `scenario` as `n` processes started directly (no launcher, so nothing
/// stops the others when one dies), each with its rank and a free port in the environment;
/// their outputs in rank order and how long the slowest took.
fn run_ranks_directly(scenario: &str, n: usize) -> (Vec<std::process::Output>, Duration) {
    run_ranks_directly_with(scenario, n, &[])
}

/// [`run_ranks_directly`] with more environment variables.
fn run_ranks_directly_with(
    scenario: &str,
    n: usize,
    env: &[(&str, &str)],
) -> (Vec<std::process::Output>, Duration) {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let args = worker_args();
    let start = Instant::now();
    let children: Vec<_> = (0..n)
        .map(|r| {
            Command::new(&args[0])
                .args(&args[1..])
                .env(SCENARIO, scenario)
                .env("RANK", r.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("NCCL_NVLS_ENABLE", "0")
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    (outs, start.elapsed())
}

#[test]
fn survivors_of_a_crashed_rank_get_errors_not_hangs() {
    let n = 3;
    let (outs, took) = run_ranks_directly("dead_peer", n);
    assert!(took < Duration::from_secs(20), "{took:?}");
    assert!(!outs[n - 1].status.success(), "the last rank aborts");
    for out in &outs[..n - 1] {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("got an error"), "{stdout}");
    }
}

#[test]
fn a_rank_killed_during_a_checkpoint_leaves_the_previous_one_loadable() {
    let dir = std::env::temp_dir().join(format!("ember-dcp-killed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let n = 3;
    let (outs, _) = run_ranks_directly_with("dcp_killed", n, &[("EMBER_DCP_DIR", dir.to_str().unwrap())]);
    assert!(
        !outs[n - 1].status.success(),
        "the last rank exits during the second save"
    );
    for (r, out) in outs[..n - 1].iter().enumerate() {
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains(&format!("dcp survivor {r} of {n}: ok")),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_collectives_and_ddp_between_processes_on_two_gpus_under_ember_run() {
    crate::common::require_two_gpus();
    for (scenario, line) in [
        ("nccl_collectives", "nccl worker"),
        ("nccl_ddp", "nccl ddp worker"),
    ] {
        every_rank_ok_under_ember_run(scenario, 2, line);
    }
}

#[test]
#[ignore = "needs two CUDA devices"]
fn nccl_survivor_of_a_crashed_rank_on_two_gpus_gets_an_error_not_a_hang() {
    crate::common::require_two_gpus();
    let n = 2;
    let (outs, took) = run_ranks_directly("nccl_dead_peer", n);
    let said = |o: &std::process::Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    };
    assert!(
        took < Duration::from_secs(60),
        "{took:?}; rank 0 said: {}",
        said(&outs[0])
    );
    assert!(!outs[n - 1].status.success(), "the last rank exits with an error");
    let stdout = String::from_utf8_lossy(&outs[0].stdout);
    assert!(
        outs[0].status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&outs[0].stderr)
    );
    assert!(stdout.contains("got an error"), "{stdout}");
}
