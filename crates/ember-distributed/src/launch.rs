//! The launcher behind the `ember-run` program (`torchrun`): starts `nproc_per_node` workers of
//! a program on this node with the environment `init_process_group("env://")` reads, and stops
//! them all when one fails.
//!
//! Note [Launcher output]: as torchrun, the workers' output passes through unchanged by default
//! (the workers write to the launcher's own stdout and stderr), so `ember-run ... | grep '^{'`
//! or `| jq` sees the lines a worker printed. torchrun's options change that per stream
//! ([`Std`]: 0 none, 1 stdout, 2 stderr, 3 both): `--tee` copies the chosen streams to the
//! console with each line prefixed `[rankN]: ` (and into `--log-dir` when given);
//! `--redirects` sends them to files in `--log-dir` only. The files are
//! `LOG_DIR/<local rank>/stdout.log` and `stderr.log`, unprefixed (torchrun nests them under a
//! run id and an attempt number, which a launcher without restarts does not have).
//!
//! Each worker gets `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `GROUP_RANK` (the
//! node rank), `MASTER_ADDR`, `MASTER_PORT`, as torchrun sets them, and `NCCL_NVLS_ENABLE=0`
//! unless already set (NCCL's NVLink multicast, NVLS, off by default; set it to 1 to opt in).
//!
//! Note [Launcher failure policy]: the launcher polls its workers (every 20 ms). When one
//! exits with a non-zero status or is killed by a signal, the launcher kills every other
//! worker (SIGKILL through `Child::kill`; std offers no gentler signal without unsafe code),
//! prints which rank failed and how, and exits with status 1, as torchrun does with
//! `ChildFailedError`. When every worker exits with 0, so does the launcher.
//! Grandchildren of a worker (a worker that is a shell starting another program) are not
//! killed with it: make the worker `exec` its program.
//!
//! Note [Launcher store]: the launcher of node 0 runs the store server for the job's lifetime,
//! as torchrun's agent does, and tells the workers so with `TORCHELASTIC_USE_AGENT_STORE=True`:
//! `init_process_group` then only connects, from every rank. With `--standalone` the server
//! binds port 0 and the workers get the port it was given. Picking a free port and letting
//! rank 0 bind it later (as before) lost a race: the distributed tests start many stores at
//! once, and on the GPU machine (session 54) one of them took the port in between, so rank 0
//! failed with "address already in use".

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ember_core::{Error, Result};

use crate::rendezvous::DEFAULT_MASTER_PORT;
use crate::store::StoreServer;

/// `ember-run --help`.
pub const USAGE: &str = "\
usage: ember-run [options] program [args...]

Starts the workers of a distributed ember program on this node (flags as torchrun's).

options:
  --nproc-per-node N   workers on this node (default 1)
  --nnodes N           nodes in the job (default 1)
  --node-rank R        this node's rank, 0..nnodes (default 0)
  --master-addr HOST   host of node 0, whose ember-run runs the store (default 127.0.0.1)
  --master-port PORT   the store's port (default 29500)
  --standalone         one node, on localhost, with a free port picked for the store
  --tee STD            copy the workers' STD streams to the console with each line prefixed
                       [rankN]: (and to --log-dir when given); STD: 0 none, 1 stdout,
                       2 stderr, 3 both (default 0)
  --redirects STD      send the workers' STD streams to files in --log-dir only (default 0)
  --log-dir DIR        where --tee and --redirects write LOCAL_RANK/stdout.log, stderr.log
  -h, --help           this message

Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR and
MASTER_PORT; its output passes through unchanged unless --tee or --redirects says otherwise.
When a worker fails, the others are stopped and ember-run exits with status 1, naming the
failed rank.";

/// Which of a worker's streams an output option applies to (torchrun's `Std`: 0, 1, 2, 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Std {
    /// Neither stream (0).
    #[default]
    None,
    /// stdout (1).
    Out,
    /// stderr (2).
    Err,
    /// Both (3).
    All,
}

impl Std {
    /// torchrun's spelling: `0`, `1`, `2` or `3`.
    pub fn parse(v: &str) -> Option<Std> {
        match v {
            "0" => Some(Std::None),
            "1" => Some(Std::Out),
            "2" => Some(Std::Err),
            "3" => Some(Std::All),
            _ => None,
        }
    }

    /// Whether the option covers stdout (`err == false`) or stderr (`err == true`).
    pub fn covers(self, err: bool) -> bool {
        matches!((self, err), (Std::All, _) | (Std::Out, false) | (Std::Err, true))
    }
}

/// What to launch: the parsed command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchConfig {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    /// 0 with `standalone`: [`run`]'s store server picks a free one.
    pub master_port: u16,
    pub standalone: bool,
    /// Streams copied to the console prefixed `[rankN]: ` (Note [Launcher output]).
    pub tee: Std,
    /// Streams sent to files in `log_dir` only.
    pub redirects: Std,
    /// Where `tee` and `redirects` write their files.
    pub log_dir: Option<std::path::PathBuf>,
    pub program: String,
    pub args: Vec<String>,
}

fn usage_error(msg: impl Into<String>) -> Error {
    Error::invalid("ember-run", format!("{}; see ember-run --help", msg.into()))
}

impl LaunchConfig {
    /// Parses the arguments after the program name. `Ok(None)` for `--help`.
    pub fn parse<I: IntoIterator<Item = String>>(args: I) -> Result<Option<LaunchConfig>> {
        let mut cfg = LaunchConfig {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            standalone: false,
            tee: Std::None,
            redirects: Std::None,
            log_dir: None,
            program: String::new(),
            args: Vec::new(),
        };
        let (mut addr_set, mut port_set) = (false, false);
        let mut it = args.into_iter();
        while let Some(arg) = it.next() {
            if arg == "--" {
                break;
            }
            if !arg.starts_with('-') {
                cfg.program = arg;
                break;
            }
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) => (f.to_string(), Some(v.to_string())),
                None => (arg.clone(), None),
            };
            let flag = flag.replace('_', "-");
            let mut value = |name: &str| -> Result<String> {
                inline
                    .clone()
                    .or_else(|| it.next())
                    .ok_or_else(|| usage_error(format!("{name} needs a value")))
            };
            fn num<T: std::str::FromStr>(name: &str, v: &str) -> Result<T> {
                v.parse()
                    .map_err(|_| usage_error(format!("{name} takes a number, got {v:?}")))
            }
            match flag.as_str() {
                "-h" | "--help" => return Ok(None),
                "--standalone" => cfg.standalone = true,
                "--nproc-per-node" => cfg.nproc_per_node = num(&flag, &value(&flag)?)?,
                "--nnodes" => {
                    let v = value(&flag)?;
                    if v.contains(':') {
                        return Err(usage_error(format!(
                            "--nnodes {v}: elastic node ranges are not supported; give one number"
                        )));
                    }
                    cfg.nnodes = num(&flag, &v)?;
                }
                "--node-rank" => cfg.node_rank = num(&flag, &value(&flag)?)?,
                "--master-addr" => {
                    cfg.master_addr = value(&flag)?;
                    addr_set = true;
                }
                "--master-port" => {
                    cfg.master_port = num(&flag, &value(&flag)?)?;
                    port_set = true;
                }
                "--tee" | "--redirects" => {
                    let v = value(&flag)?;
                    let std = Std::parse(&v).ok_or_else(|| {
                        usage_error(format!(
                            "{flag} takes 0, 1, 2 or 3 (none, stdout, stderr, both), got {v:?}; per-rank maps are not supported"
                        ))
                    })?;
                    if flag == "--tee" {
                        cfg.tee = std;
                    } else {
                        cfg.redirects = std;
                    }
                }
                "--log-dir" => cfg.log_dir = Some(value(&flag)?.into()),
                _ => return Err(usage_error(format!("unknown option {arg}"))),
            }
        }
        if cfg.program.is_empty() {
            cfg.program = it
                .next()
                .ok_or_else(|| usage_error("no program to run was given"))?;
        }
        cfg.args = it.collect();
        if cfg.nproc_per_node == 0 || cfg.nnodes == 0 {
            return Err(usage_error("--nproc-per-node and --nnodes must be at least 1"));
        }
        if cfg.node_rank >= cfg.nnodes {
            return Err(usage_error(format!(
                "--node-rank {} is not below --nnodes {}",
                cfg.node_rank, cfg.nnodes
            )));
        }
        if cfg.redirects != Std::None && cfg.log_dir.is_none() {
            return Err(usage_error("--redirects writes files into --log-dir: give one"));
        }
        if cfg.standalone {
            if cfg.nnodes != 1 || addr_set {
                return Err(usage_error(
                    "--standalone runs one node on localhost: drop --nnodes / --master-addr",
                ));
            }
            if !port_set {
                cfg.master_port = 0;
            }
        }
        Ok(Some(cfg))
    }

    pub fn world_size(&self) -> usize {
        self.nnodes * self.nproc_per_node
    }

    /// The variables of worker `local_rank`; `existing` looks up the launcher's environment
    /// (for `NCCL_NVLS_ENABLE`, kept when set).
    pub fn worker_env(
        &self,
        local_rank: usize,
        existing: &dyn Fn(&str) -> Option<String>,
    ) -> Vec<(String, String)> {
        let rank = self.node_rank * self.nproc_per_node + local_rank;
        let mut env = vec![
            ("RANK".to_string(), rank.to_string()),
            ("LOCAL_RANK".to_string(), local_rank.to_string()),
            ("WORLD_SIZE".to_string(), self.world_size().to_string()),
            ("LOCAL_WORLD_SIZE".to_string(), self.nproc_per_node.to_string()),
            ("GROUP_RANK".to_string(), self.node_rank.to_string()),
            ("MASTER_ADDR".to_string(), self.master_addr.clone()),
            ("MASTER_PORT".to_string(), self.master_port.to_string()),
            // Note [Launcher store].
            ("TORCHELASTIC_USE_AGENT_STORE".to_string(), "True".to_string()),
        ];
        if existing("NCCL_NVLS_ENABLE").is_none() {
            env.push(("NCCL_NVLS_ENABLE".to_string(), "0".to_string()));
        }
        env
    }
}

/// Kills and reaps the workers started so far.
fn stop_all(children: &mut [(usize, Child)]) {
    for (_, c) in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

impl LaunchConfig {
    /// Where worker `local_rank`'s stdout and stderr go (Note [Launcher output]): the
    /// launcher's own streams (inherited), a pipe read by [`forward`] (with the tee file), or a
    /// file.
    fn stream_sinks(&self, local_rank: usize) -> Result<[(Stdio, Option<std::fs::File>); 2]> {
        let file = |name: &str| -> Result<std::fs::File> {
            let dir = self
                .log_dir
                .as_ref()
                .expect("checked by the caller")
                .join(local_rank.to_string());
            let io = |e: std::io::Error, what: &std::path::Path| Error::Io {
                kind: e.kind(),
                msg: format!("ember-run: cannot write the log file {}: {e}", what.display()),
            };
            std::fs::create_dir_all(&dir).map_err(|e| io(e, &dir))?;
            let path = dir.join(name);
            std::fs::File::create(&path).map_err(|e| io(e, &path))
        };
        let sink = |err: bool, name: &str| -> Result<(Stdio, Option<std::fs::File>)> {
            let logged = self.log_dir.is_some();
            Ok(if self.tee.covers(err) {
                (Stdio::piped(), if logged { Some(file(name)?) } else { None })
            } else if self.redirects.covers(err) {
                (Stdio::from(file(name)?), None)
            } else {
                (Stdio::inherit(), None)
            })
        };
        Ok([sink(false, "stdout.log")?, sink(true, "stderr.log")?])
    }
}

/// How the launch ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LaunchOutcome {
    /// Every worker exited with status 0.
    Succeeded,
    /// Global rank `rank` failed first (`status` describes how); the others were stopped.
    Failed { rank: usize, status: String },
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(9)) => "killed by signal 9 (SIGKILL; out of memory?)".into(),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => format!("{status}"),
    }
}

/// Copies `from` line by line to the launcher's stdout or stderr, each line prefixed, and
/// unprefixed into `file` when given (`--tee`, Note [Launcher output]).
fn forward(
    from: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    mut file: Option<std::fs::File>,
    done: mpsc::Sender<()>,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    if let Some(f) = &mut file {
                        let _ = f.write_all(&line);
                    }
                    let mut out = Vec::with_capacity(prefix.len() + line.len());
                    out.extend_from_slice(prefix.as_bytes());
                    out.extend_from_slice(&line);
                    // One write per line, under the stream's lock: lines never interleave.
                    let _ = if to_stderr {
                        std::io::stderr().lock().write_all(&out)
                    } else {
                        std::io::stdout().lock().write_all(&out)
                    };
                }
            }
        }
        let _ = done.send(());
    });
}

/// Starts the workers of `cfg` and waits for them (Note [Launcher failure policy]); on node 0
/// it runs the job's store meanwhile (Note [Launcher store]).
pub fn run(cfg: &LaunchConfig) -> Result<LaunchOutcome> {
    let mut cfg = cfg.clone();
    let _store = match cfg.node_rank {
        0 => {
            let server = StoreServer::start(cfg.master_port).map_err(|e| Error::Io {
                kind: match &e {
                    Error::Io { kind, .. } => *kind,
                    _ => std::io::ErrorKind::Other,
                },
                msg: format!(
                    "ember-run: cannot start the store on port {}: {e}; pick another --master-port \
                     (or --standalone for a free one)",
                    cfg.master_port
                ),
            })?;
            cfg.master_port = server.port();
            Some(server)
        }
        _ => None,
    };
    let cfg = &cfg;
    let existing = |k: &str| std::env::var(k).ok();
    let (done_tx, done_rx) = mpsc::channel();
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut streams = 0;
    for local in 0..cfg.nproc_per_node {
        let rank = cfg.node_rank * cfg.nproc_per_node + local;
        let [(out_stdio, out_file), (err_stdio, err_file)] = match cfg.stream_sinks(local) {
            Ok(s) => s,
            Err(e) => {
                stop_all(&mut children);
                return Err(e);
            }
        };
        let spawned = Command::new(&cfg.program)
            .args(&cfg.args)
            .envs(cfg.worker_env(local, &existing))
            .stdin(Stdio::null())
            .stdout(out_stdio)
            .stderr(err_stdio)
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut children);
                return Err(Error::Io {
                    kind: e.kind(),
                    msg: format!(
                        "ember-run: cannot start {:?}: {e}; check the program's path",
                        cfg.program
                    ),
                });
            }
        };
        let prefix = format!("[rank{rank}]: ");
        if let Some(out) = child.stdout.take() {
            forward(out, prefix.clone(), false, out_file, done_tx.clone());
            streams += 1;
        }
        if let Some(err) = child.stderr.take() {
            forward(err, prefix, true, err_file, done_tx.clone());
            streams += 1;
        }
        children.push((rank, child));
    }
    drop(done_tx);

    let mut failed = None;
    let mut running: Vec<bool> = vec![true; children.len()];
    while failed.is_none() && running.iter().any(|&r| r) {
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    running[i] = false;
                    if !status.success() {
                        failed = Some((*rank, describe(status)));
                        break;
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failed = Some((*rank, format!("could not be waited for: {e}")));
                    break;
                }
            }
        }
        if failed.is_none() {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    if failed.is_some() {
        for (i, (_, child)) in children.iter_mut().enumerate() {
            if running[i] {
                let _ = child.kill();
            }
        }
    }
    for (_, child) in &mut children {
        let _ = child.wait();
    }
    // Let the output threads print what the workers wrote last, but do not wait on pipes that a
    // grandchild still holds open.
    let until = Instant::now() + Duration::from_secs(2);
    for _ in 0..streams {
        let left = until.saturating_duration_since(Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    Ok(match failed {
        None => LaunchOutcome::Succeeded,
        Some((rank, status)) => LaunchOutcome::Failed { rank, status },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<LaunchConfig>> {
        LaunchConfig::parse(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn torchrun_flags() {
        let c = parse(&[
            "--nproc-per-node",
            "4",
            "--nnodes=2",
            "--node_rank",
            "1",
            "--master-addr",
            "h",
            "--master_port=99",
            "prog",
            "--lr",
            "3",
        ])
        .unwrap()
        .unwrap();
        assert_eq!((c.nproc_per_node, c.nnodes, c.node_rank), (4, 2, 1));
        assert_eq!((c.master_addr.as_str(), c.master_port), ("h", 99));
        assert_eq!(
            (c.program.as_str(), c.args.clone()),
            ("prog", vec!["--lr".to_string(), "3".to_string()])
        );
        let env = c.worker_env(2, &|_| None);
        let get = |k: &str| env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
        assert_eq!(get("RANK"), "6");
        assert_eq!(get("LOCAL_RANK"), "2");
        assert_eq!(get("WORLD_SIZE"), "8");
        assert_eq!(get("LOCAL_WORLD_SIZE"), "4");
        assert_eq!(get("GROUP_RANK"), "1");
        assert_eq!(get("NCCL_NVLS_ENABLE"), "0");
        assert_eq!(get("TORCHELASTIC_USE_AGENT_STORE"), "True");
        let env = c.worker_env(0, &|k| (k == "NCCL_NVLS_ENABLE").then(|| "1".to_string()));
        assert!(env.iter().all(|(k, _)| k != "NCCL_NVLS_ENABLE"));
    }

    #[test]
    fn standalone_and_bad_flags() {
        let c = parse(&["--standalone", "--nproc-per-node=2", "--", "prog"])
            .unwrap()
            .unwrap();
        // 0: the launcher's store picks a free port (Note [Launcher store]).
        assert_eq!(c.master_port, 0);
        assert_eq!(parse(&["--help"]).unwrap(), None);
        let c = parse(&["--tee", "3", "--log-dir=/tmp/x", "p"]).unwrap().unwrap();
        assert_eq!((c.tee, c.redirects), (Std::All, Std::None));
        assert_eq!(c.log_dir.as_deref(), Some(std::path::Path::new("/tmp/x")));
        let c = parse(&["p"]).unwrap().unwrap();
        assert_eq!((c.tee, c.redirects, c.log_dir), (Std::None, Std::None, None));
        assert!(Std::Out.covers(false) && !Std::Out.covers(true) && Std::All.covers(true));
        for bad in [
            &["--tee", "4", "p"][..],
            &["--tee", "0:1,1:2", "p"],
            &["--redirects", "3", "p"],
            &["--nproc-per-node"][..],
            &["--nproc-per-node", "x", "p"],
            &["--nnodes", "1:2", "p"],
            &["--node-rank", "1", "p"],
            &["--bogus", "p"],
            &["--nproc-per-node", "2"],
            &["--standalone", "--nnodes", "2", "p"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }
}
