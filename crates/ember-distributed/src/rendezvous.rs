//! Where a process finds its rank, the world size and the master (`init_method`), from
//! `env://`, `tcp://host:port`, or the variables of SLURM and Open MPI.
//!
//! Everything here is a pure function of an environment given as a lookup function, so it is
//! tested on maps without touching the process environment.
//!
//! Order of precedence, for each of rank and world size: the value passed to
//! `init_process_group`, then `RANK` / `WORLD_SIZE` (set by `ember-run` and torchrun), then
//! `SLURM_PROCID` / `SLURM_NTASKS`, then `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`.
//! The master is `MASTER_ADDR` / `MASTER_PORT`; under SLURM without `MASTER_ADDR`, the first
//! host of `SLURM_JOB_NODELIST` (`node[01-04,07]` gives `node01`); without `MASTER_PORT` under
//! SLURM or Open MPI, [`DEFAULT_MASTER_PORT`] (torchrun's default). Under plain `env://`, both
//! must be set. Rank 0 starts the store server there, unless `TORCHELASTIC_USE_AGENT_STORE` is
//! `True` (torchrun's variable, set by `ember-run`): the launcher runs the server already, and
//! every rank is its client (Note [Launcher store] in `launch.rs`).

use ember_core::{Error, Result};

/// torchrun's default master port.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Which launcher the rank and world size came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Passed to `init_process_group`, or `RANK` / `WORLD_SIZE` (ember-run, torchrun).
    Explicit,
    /// `SLURM_PROCID` / `SLURM_NTASKS`.
    Slurm,
    /// `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
}

/// A resolved rendezvous: who this process is and where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    pub rank: usize,
    pub world_size: usize,
    /// The rank within this node, when the launcher says (`LOCAL_RANK`, `SLURM_LOCALID`,
    /// `OMPI_COMM_WORLD_LOCAL_RANK`); the device a rank usually uses.
    pub local_rank: Option<usize>,
    pub master_addr: String,
    pub master_port: u16,
    pub launcher: Launcher,
    /// The launcher runs the store server (`TORCHELASTIC_USE_AGENT_STORE=True`): rank 0 must
    /// not start another.
    pub agent_store: bool,
}

fn parse_num<T: std::str::FromStr>(name: &str, value: &str) -> Result<T> {
    value.trim().parse().map_err(|_| {
        Error::invalid(
            "init_process_group",
            format!("environment variable {name}={value:?} is not a non-negative integer"),
        )
    })
}

fn var<T: std::str::FromStr>(env: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<T>> {
    env(name).map(|v| parse_num(name, &v)).transpose()
}

/// Resolves `init_method` (`"env://"`, `"tcp://host:port"`, or empty for `env://`) with the
/// explicit `rank` / `world_size` and the environment `env`.
pub fn resolve(
    init_method: &str,
    rank: Option<usize>,
    world_size: Option<usize>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Rendezvous> {
    const OP: &str = "init_process_group";
    // Rank and size: explicit, then RANK/WORLD_SIZE, then SLURM, then Open MPI.
    let mut launcher = Launcher::Explicit;
    let mut local_rank = var::<usize>(env, "LOCAL_RANK")?;
    let (mut r, mut w) = (rank, world_size);
    if r.is_none() {
        r = var(env, "RANK")?;
    }
    if w.is_none() {
        w = var(env, "WORLD_SIZE")?;
    }
    if r.is_none() || w.is_none() {
        if let (Some(pr), Some(nt)) = (
            var::<usize>(env, "SLURM_PROCID")?,
            var::<usize>(env, "SLURM_NTASKS")?,
        ) {
            launcher = Launcher::Slurm;
            r = r.or(Some(pr));
            w = w.or(Some(nt));
            local_rank = local_rank.or(var(env, "SLURM_LOCALID")?);
        } else if let (Some(pr), Some(ws)) = (
            var::<usize>(env, "OMPI_COMM_WORLD_RANK")?,
            var::<usize>(env, "OMPI_COMM_WORLD_SIZE")?,
        ) {
            launcher = Launcher::OpenMpi;
            r = r.or(Some(pr));
            w = w.or(Some(ws));
            local_rank = local_rank.or(var(env, "OMPI_COMM_WORLD_LOCAL_RANK")?);
        }
    }
    let (Some(rank), Some(world_size)) = (r, w) else {
        return Err(Error::invalid(
            OP,
            "rank and world size are unknown: pass them, or start the program with ember-run (which sets RANK and \
             WORLD_SIZE), srun (SLURM) or mpirun (Open MPI)",
        ));
    };
    if world_size == 0 || rank >= world_size {
        return Err(Error::invalid(
            OP,
            format!("rank {rank} is not in a world of {world_size} process(es); ranks go from 0 to world_size - 1"),
        ));
    }

    let (master_addr, master_port) = if let Some(rest) = init_method.strip_prefix("tcp://") {
        parse_host_port(rest)?
    } else if init_method.is_empty() || init_method == "env://" {
        let addr = match env("MASTER_ADDR") {
            Some(a) => a,
            None if launcher == Launcher::Slurm => {
                let list = env("SLURM_JOB_NODELIST")
                    .or_else(|| env("SLURM_NODELIST"))
                    .ok_or_else(|| {
                        Error::invalid(
                            OP,
                            "under SLURM without MASTER_ADDR, SLURM_JOB_NODELIST is needed; set MASTER_ADDR",
                        )
                    })?;
                first_host(&list)?
            }
            None => {
                return Err(Error::invalid(
                    OP,
                    "env:// needs MASTER_ADDR (the host of rank 0); set it, or use ember-run",
                ))
            }
        };
        let port = match env("MASTER_PORT") {
            Some(p) => parse_num("MASTER_PORT", &p)?,
            None if launcher != Launcher::Explicit => DEFAULT_MASTER_PORT,
            None => {
                return Err(Error::invalid(
                    OP,
                    "env:// needs MASTER_PORT (a free port on rank 0's host); set it, or use ember-run",
                ))
            }
        };
        (addr, port)
    } else {
        return Err(Error::invalid(
            OP,
            format!("unsupported init_method {init_method:?}; use \"env://\" or \"tcp://host:port\""),
        ));
    };
    Ok(Rendezvous {
        rank,
        world_size,
        local_rank,
        master_addr,
        master_port,
        launcher,
        // Under env:// only, as PyTorch.
        agent_store: !init_method.starts_with("tcp://")
            && env("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True"),
    })
}

/// `host:port` or `[v6]:port`.
fn parse_host_port(s: &str) -> Result<(String, u16)> {
    let s = s.trim_end_matches('/');
    let bad = || {
        Error::invalid(
            "init_process_group",
            format!("tcp:// init_method {s:?} is not host:port (e.g. tcp://10.0.0.1:29500)"),
        )
    };
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_string(), port.parse().map_err(|_| bad())?))
}

/// The first host of a SLURM node list: `node[01-04,07],gpu3` gives `node01`,
/// `rack[1-2]-n[5,6]` gives `rack1-n5`, `a,b` gives `a`.
pub fn first_host(nodelist: &str) -> Result<String> {
    let bad = |why: &str| {
        Error::invalid(
            "init_process_group",
            format!("cannot read the SLURM node list {nodelist:?}: {why}; set MASTER_ADDR instead"),
        )
    };
    let mut out = String::new();
    let mut chars = nodelist.trim().chars();
    while let Some(c) = chars.next() {
        match c {
            ',' => break,
            '[' => {
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some(']') => break,
                        Some(c) => inner.push(c),
                        None => return Err(bad("unclosed '['")),
                    }
                }
                let first = inner.split(',').next().unwrap_or("");
                let first = first.split('-').next().unwrap_or("").trim();
                if first.is_empty() || !first.chars().all(|c| c.is_ascii_digit()) {
                    return Err(bad("a bracket range must start with a number"));
                }
                out.push_str(first);
            }
            ']' => return Err(bad("unmatched ']'")),
            c => out.push(c),
        }
    }
    if out.is_empty() {
        return Err(bad("it is empty"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env_of(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn torchrun_variables() {
        let env = env_of(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "10.0.0.2"),
            ("MASTER_PORT", "1234"),
        ]);
        let r = resolve("env://", None, None, &env).unwrap();
        assert_eq!(
            r,
            Rendezvous {
                rank: 3,
                world_size: 8,
                local_rank: Some(1),
                master_addr: "10.0.0.2".into(),
                master_port: 1234,
                launcher: Launcher::Explicit,
                agent_store: false,
            }
        );
        // Under ember-run (torchrun) the launcher runs the store: no rank starts one.
        let mut vars = vec![
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "5"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        assert!(resolve("env://", None, None, &env_of(&vars)).unwrap().agent_store);
        assert!(
            !resolve("tcp://h:5", None, None, &env_of(&vars))
                .unwrap()
                .agent_store
        );
        vars[4].1 = "False";
        assert!(!resolve("env://", None, None, &env_of(&vars)).unwrap().agent_store);
        // Explicit arguments win.
        let r = resolve("env://", Some(0), Some(2), &env).unwrap();
        assert_eq!((r.rank, r.world_size), (0, 2));
        // Missing MASTER_PORT under plain env:// is an error that says what to set.
        let env = env_of(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "h")]);
        let e = resolve("env://", None, None, &env).unwrap_err().to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }

    #[test]
    fn slurm_variables() {
        let env = env_of(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[03-04,07],cpu1"),
        ]);
        let r = resolve("env://", None, None, &env).unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank), (5, 8, Some(1)));
        assert_eq!(
            (r.master_addr.as_str(), r.master_port),
            ("gpu03", DEFAULT_MASTER_PORT)
        );
        assert_eq!(r.launcher, Launcher::Slurm);
        // MASTER_ADDR / MASTER_PORT override the node list and the default port.
        let env = env_of(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_JOB_NODELIST", "gpu[03-04]"),
            ("MASTER_ADDR", "head"),
            ("MASTER_PORT", "4000"),
        ]);
        let r = resolve("", None, None, &env).unwrap();
        assert_eq!((r.master_addr.as_str(), r.master_port), ("head", 4000));
    }

    #[test]
    fn open_mpi_variables() {
        let env = env_of(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("MASTER_ADDR", "n1"),
        ]);
        let r = resolve("env://", None, None, &env).unwrap();
        assert_eq!((r.rank, r.world_size, r.local_rank), (2, 4, Some(0)));
        assert_eq!(
            (r.master_addr.as_str(), r.master_port),
            ("n1", DEFAULT_MASTER_PORT)
        );
        assert_eq!(r.launcher, Launcher::OpenMpi);
        // RANK / WORLD_SIZE win over Open MPI's.
        let env = env_of(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "n1"),
            ("MASTER_PORT", "5"),
        ]);
        let r = resolve("env://", None, None, &env).unwrap();
        assert_eq!((r.rank, r.world_size, r.launcher), (1, 2, Launcher::Explicit));
        // Open MPI gives no host list: MASTER_ADDR is required.
        let env = env_of(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "4")]);
        assert!(resolve("env://", None, None, &env)
            .unwrap_err()
            .to_string()
            .contains("MASTER_ADDR"));
    }

    #[test]
    fn tcp_init_method_and_bad_values() {
        let none = env_of(&[]);
        let r = resolve("tcp://10.1.2.3:23456", Some(1), Some(2), &none).unwrap();
        assert_eq!((r.master_addr.as_str(), r.master_port), ("10.1.2.3", 23456));
        let r = resolve("tcp://[::1]:80", Some(0), Some(1), &none).unwrap();
        assert_eq!(r.master_addr, "::1");
        assert!(resolve("tcp://nohost", Some(0), Some(1), &none).is_err());
        assert!(resolve("file:///tmp/x", Some(0), Some(1), &none).is_err());
        assert!(resolve("env://", None, None, &none).is_err());
        assert!(resolve("tcp://h:1", Some(2), Some(2), &none).is_err());
        let env = env_of(&[("RANK", "x"), ("WORLD_SIZE", "2")]);
        assert!(resolve("env://", None, None, &env)
            .unwrap_err()
            .to_string()
            .contains("RANK"));
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("node[01-04,07]").unwrap(), "node01");
        assert_eq!(first_host("node[07,01-04]").unwrap(), "node07");
        assert_eq!(first_host("a,b").unwrap(), "a");
        assert_eq!(first_host("single").unwrap(), "single");
        assert_eq!(first_host("rack[1-2]-n[5,6],x").unwrap(), "rack1-n5");
        assert_eq!(first_host("gpu[003-010]").unwrap(), "gpu003");
        assert!(first_host("node[01-").is_err());
        assert!(first_host("").is_err());
    }
}
